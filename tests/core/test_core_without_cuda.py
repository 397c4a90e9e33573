"""``trio_cuda._core`` never imports ``cuda``; without it, ``device="auto"`` picks the simulator."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "trio_cuda" / "_core"

# Runs in a fresh interpreter: every import of cuda* is refused (and recorded).
SCRIPT = textwrap.dedent(
    r"""
    import importlib
    import importlib.abc
    import json
    import logging
    import pkgutil
    import sys

    attempts = []

    class BlockCuda(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "cuda" or name.startswith("cuda."):
                attempts.append(name)
                raise ImportError(f"cuda is blocked in this test ({name})")
            return None

    sys.meta_path.insert(0, BlockCuda())
    for name in [m for m in sys.modules if m == "cuda" or m.startswith("cuda.")]:
        del sys.modules[name]

    # 1. The core and every module in it import without cuda, and never ask for it.
    import trio_cuda._core as core

    core_modules = ["trio_cuda._core"]
    for info in pkgutil.iter_modules(core.__path__, "trio_cuda._core."):
        importlib.import_module(info.name)
        core_modules.append(info.name)
    core_attempts = list(attempts)

    # 2. A tiny scope on device="auto" picks the simulator, and says so.
    sys.modules["cuda"] = None  # the way a missing package looks to an import
    import numpy as np
    import trio

    import trio_cuda

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("trio_cuda")
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)

    async def tiny():
        async with trio_cuda.open_scope(device="auto") as gpu:
            x = await gpu.to_device(np.arange(8, dtype=np.float32))
            back = await gpu.to_host(x)
            assert back.tolist() == list(range(8)), back
            return gpu.backend, gpu.statistics().in_flight

    backend, in_flight = trio.run(tiny)
    loaded = sorted(
        m for m, mod in sys.modules.items() if (m == "cuda" or m.startswith("cuda.")) and mod is not None
    )
    print(json.dumps({
        "core_modules": core_modules,
        "core_attempts": core_attempts,
        "backend": backend,
        "log": records,
        "loaded": loaded,
    }))
    """
)


def _run_blocked() -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_core_imports_with_cuda_blocked_and_auto_picks_the_simulator() -> None:
    result = _run_blocked()
    expected = {"trio_cuda._core"} | {
        f"trio_cuda._core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__"
    }
    if importlib.util.find_spec("trio_cuda._core._claunch") is not None:
        # the compiled paths, where they were built (imported here even where
        # TRIO_CUDA_PURE turns them off; they import no cuda either)
        expected.add("trio_cuda._core._claunch")
    assert set(result["core_modules"]) == expected  # type: ignore[arg-type]
    assert result["core_attempts"] == [], (
        f"importing trio_cuda._core tried to import {result['core_attempts']}"
    )
    assert result["backend"] == "sim"
    log = result["log"]
    assert isinstance(log, list)
    assert any("simulat" in line for line in log), f"the choice of the simulator was not logged: {log}"
    assert result["loaded"] == [], f"cuda modules were imported: {result['loaded']}"


def test_core_sources_do_not_import_cuda() -> None:
    """A static check, complementing the runtime one: no import of cuda in _core, even lazily."""
    offenders = []
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None))
                in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
            for name in names:
                if name == "cuda" or name.startswith("cuda."):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert offenders == [], offenders


def test_core_imports_nothing_outside_the_core() -> None:
    """Imports go downward only: ``_core`` never imports ``_backends``, ``_open``
    or any other part of ``trio_cuda`` outside itself, even lazily or for types."""
    offenders = []
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level >= 2 or (node.level == 0 and (node.module or "").startswith("trio_cuda")):
                    target = "." * node.level + (node.module or "")
                    if node.level == 0 and (node.module or "").startswith("trio_cuda._core"):
                        continue
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {target} import ...")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("trio_cuda") and not alias.name.startswith("trio_cuda._core"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
    assert offenders == [], offenders
