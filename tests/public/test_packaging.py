"""trio_cuda as this environment installed it: what type checkers see, and what it depends on.

The installed package is checked where a user's project would check it: mypy --strict runs
on a small user program in a folder outside the repository, with nothing added to its path,
so it finds trio_cuda only through the install. CI installs as README.md's Quick start says
(``pip install -e '.[dev]'``), so this checks that install: an editable install must put a
plain directory on the path (a static ``.pth`` entry, which mypy reads), not an import hook
(which only the interpreter runs). A regular install passes as well.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

#: a user program that uses trio_cuda's annotations; it must check clean
CLEAN = textwrap.dedent(
    """\
    from typing import Any, assert_type

    import numpy as np
    import trio

    import trio_cuda


    async def main() -> None:
        async with trio_cuda.open_scope("sim") as gpu:
            assert_type(gpu, trio_cuda.ResourceScope)
            x = await gpu.to_device(np.ones(4, np.float32))
            assert_type(x, trio_cuda.DeviceArray)
            assert_type(await gpu.to_host(x), np.ndarray[Any, Any])


    trio.run(main)
    """
)

#: a mistake mypy reports only where it reads trio_cuda's annotations (Any would pass it)
MISTAKE = textwrap.dedent(
    """\
    import numpy as np

    import trio_cuda


    async def main() -> None:
        async with trio_cuda.open_scope("sim") as gpu:
            x = await gpu.to_device(np.ones(4, np.float32))
            n: int = await gpu.to_host(x)
    """
)


def _installed() -> importlib.metadata.Distribution:
    """The installed distribution (not the ``trio_cuda.egg-info`` a build leaves in the
    repository, which the repository's place on ``sys.path`` would also find)."""
    path = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    found = list(importlib.metadata.distributions(name="trio_cuda", path=path))
    if not found:
        pytest.skip("trio_cuda is not installed in this environment (the tests check the install)")
    return found[0]


def _outside(tmp_path: Path) -> Path:
    work = tmp_path / "project"
    work.mkdir()
    assert not work.resolve().is_relative_to(ROOT), f"{work} is inside the repository"
    return work


def _user_env() -> dict[str, str]:
    """The environment of a user's shell: nothing of the repository on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH", "PYTHONSTARTUP")}


def _path_entries(dist: importlib.metadata.Distribution) -> str:
    """The install's .pth files and what they hold (for a failure's report)."""
    lines = []
    for file in dist.files or ():
        if file.name.endswith(".pth"):
            text = Path(str(file.locate())).read_text(encoding="utf-8", errors="replace").strip()
            lines.append(f"  {file.name}: {text}")
    return "\n".join(lines) or "  (none)"


def test_mypy_strict_sees_the_installed_package(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    dist = _installed()
    work = _outside(tmp_path)
    (work / "clean.py").write_text(CLEAN)
    (work / "mistake.py").write_text(MISTAKE)
    (work / "mypy.ini").write_text("[mypy]\n")  # not a user-wide configuration
    env = _user_env()
    imported = subprocess.run(
        [sys.executable, "-c", "import trio_cuda; print(trio_cuda.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.returncode == 0, imported.stderr
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            "--no-error-summary",
            "--show-error-codes",
            "--hide-error-context",
            "--no-pretty",
            "clean.py",
            "mistake.py",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = result.stdout + result.stderr
    context = (
        f"mypy --strict on a user program, with trio_cuda installed at {imported.stdout.strip()}:\n"
        f"{report}\nthe install's path entries:\n{_path_entries(dist)}\n"
        "(an 'import ...' line is an import hook: the interpreter runs it, type checkers do not)"
    )
    errors = re.findall(r"^(\S+?\.py):(\d+): error: .*\[([\w-]+)\]$", report, re.MULTILINE)
    assert errors == [("mistake.py", "9", "assignment")], context
    assert 'expression has type "ndarray[Any, Any]", variable has type "int"' in report, context
    assert result.returncode == 1, context


def test_the_install_carries_the_license_and_the_typed_marker(tmp_path: Path) -> None:
    dist = _installed()
    assert dist.metadata["License-Expression"] == "MIT", dist.metadata["License-Expression"]
    licenses = [f for f in dist.files or () if f.name == "LICENSE"]
    assert licenses, [str(f) for f in dist.files or ()]
    assert Path(str(licenses[0].locate())).read_text(encoding="utf-8").startswith("MIT License\n")
    assert "Typing :: Typed" in (dist.metadata.get_all("Classifier") or [])
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.resources as r; print(r.files('trio_cuda') / 'py.typed')"],
        cwd=_outside(tmp_path),
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert Path(found.stdout.strip()).is_file(), found.stdout


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_dependencies_are_what_the_package_imports() -> None:
    """The library's own dependencies: cuda-bindings (trio_cuda imports only ``cuda.bindings``,
    so neither the cuda-python metapackage nor cuda-core), no tqdm (the demo extra's); cuda.tile
    only in trio_cuda/_tile, from the tile extra; outcome (Trio's own), which the awaiting
    step reads."""
    project = PYPROJECT["project"]
    required = _names(project["dependencies"])
    assert required == {"trio", "attrs", "numpy", "cuda-bindings", "sniffio", "outcome"}, required
    cuda_imports = set()
    tile_imports = set()
    for path in (ROOT / "trio_cuda").rglob("*.py"):
        if path.parent.name == "_tile":  # the tile extra's: cuda.tile, and cuda.bindings
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                    names = [node.module]
                tile_imports |= {n for n in names if n.split(".")[0] == "cuda"}
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                cuda_imports |= {a.name for a in node.names if a.name.split(".")[0] == "cuda"}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                cuda_imports |= {node.module} if node.module.split(".")[0] == "cuda" else set()
    assert cuda_imports, "no cuda import found"
    assert all(m.startswith("cuda.bindings") for m in cuda_imports), sorted(cuda_imports)
    assert all(m.startswith(("cuda.tile", "cuda.bindings")) for m in tile_imports), sorted(tile_imports)
    extras = project["optional-dependencies"]
    assert _names(extras["tile"]) == {"cuda-tile"}
    assert _names(extras["demo"]) == {"tqdm"}
    assert _names(extras["pytest"]) == {"pytest", "pytest-trio"}  # light: no Ray, Sphinx, mypy
    assert extras["test"] == ["trio_cuda[dev]"]
    dev = extras["dev"]
    (everything,) = [r for r in dev if r.startswith("trio_cuda[")]
    included = set(everything[len("trio_cuda[") : -1].split(","))
    assert included == set(extras) - {"dev", "test"}, included


def test_the_quick_start_installs_the_dev_extra() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "pip install -q -e '.[dev]'" in quick_start, quick_start
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra in ("pytest", "compiler", "demo"):
        assert f"`{extra}` (" in quick_start, extra
        assert extra in extras
