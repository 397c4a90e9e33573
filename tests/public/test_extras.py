"""Without an optional extra, the code that needs it names the extra to install.

Each case runs in a subprocess whose import system refuses the extra's
packages as an environment without them does (``ModuleNotFoundError: No
module named ...``), so these tests run whether or not the extras are
installed here: ``import trio_cuda.ray`` without Ray, and the service
example's ``serve.py`` and ``load.py`` without hypercorn and httpx.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "examples" / "service"

#: run first in the subprocess: sys.argv[1] lists the top-level packages that are "not installed"
ABSENT = textwrap.dedent(
    """
    import sys

    class Absent:
        def __init__(self, names):
            self.names = names

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.names:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    absent = Absent(set(sys.argv.pop(1).split(",")))
    assert not [m for m in sys.modules if m.partition(".")[0] in absent.names], "imported already"
    sys.meta_path.insert(0, absent)
    """
)

#: then run a script, sys.argv[1] and on as its own command line
SCRIPT = "import runpy\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"


def _run(code: str, absent: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-c", ABSENT + code, absent, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_trio_cuda_ray_without_ray_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import json
        import trio_cuda  # the package itself needs no Ray

        def attempt():
            try:
                import trio_cuda.ray
            except ImportError as exc:
                cause = exc.__cause__
                return {"type": type(exc).__name__, "message": str(exc), "name": exc.name,
                        "cause": [type(cause).__name__, getattr(cause, "name", None), str(cause)]}
            return None

        print(json.dumps([attempt(), attempt(), "trio_cuda.ray" in sys.modules]))
        """
    )
    out = _run(code, "ray")
    assert out.returncode == 0, out.stderr[-3000:]
    first, second, left = json.loads(out.stdout.strip().splitlines()[-1])
    assert first is not None, "trio_cuda.ray imported without Ray"
    assert first["type"] == "ModuleNotFoundError", first  # an ImportError
    assert first["message"].startswith("trio_cuda.ray needs Ray (No module named 'ray'): "), first
    assert "pip install 'trio_cuda[ray]'" in first["message"], first
    assert first["name"] == "ray", first
    assert first["cause"] == ["ModuleNotFoundError", "ray", "No module named 'ray'"], first  # chained
    assert second == first  # nothing half-imported: the next import says the same
    assert left is False


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == "", out.stdout  # nothing started
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_serve_without_hypercorn_names_the_extra() -> None:
    out = _run(SCRIPT, "hypercorn", str(SERVICE / "serve.py"), "--port", "0", "--device", "sim")
    line = _one_line(out)
    assert line == "serve.py needs hypercorn (No module named 'hypercorn'): pip install 'trio_cuda[service]'"


def test_load_without_httpx_names_the_extra() -> None:
    out = _run(SCRIPT, "httpx", str(SERVICE / "load.py"), "--url", "http://127.0.0.1:9")
    line = _one_line(out)
    assert line == "load.py needs httpx (No module named 'httpx'): pip install 'trio_cuda[service]'"


def test_the_absent_packages_are_refused_and_only_they() -> None:
    # the harness itself: it refuses what it names, and nothing else
    code = textwrap.dedent(
        """
        import importlib, json
        found = {}
        for name in ("json", "numpy", "trio", "absent_pkg", "absent_pkg.sub"):
            try:
                importlib.import_module(name)
                found[name] = True
            except ModuleNotFoundError as exc:
                found[name] = exc.name
        print(json.dumps(found))
        """
    )
    out = _run(code, "absent_pkg,numpy")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == {
        "json": True,
        "numpy": "numpy",
        "trio": True,
        "absent_pkg": "absent_pkg",
        "absent_pkg.sub": "absent_pkg",
    }
