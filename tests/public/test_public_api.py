"""The public API: exported once, documented, listed in the API reference; and the CLI.

Optional submodules (``trio_cuda.ray``, which needs Ray) are checked alike where
their dependency is installed, and never imported by ``import trio_cuda``.
"""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import trio_cuda

ROOT = Path(__file__).resolve().parents[2]
INIT = ROOT / "trio_cuda" / "__init__.py"
API_RST = ROOT / "docs" / "api.rst"
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
SUBMODULES = ("ops", "unsafe", "testing")
#: submodules that ``import trio_cuda`` does not import -> the package each one needs
OPTIONAL_SUBMODULES = {"ray": "ray"}


def _reexports() -> list[tuple[str, str | None, int]]:
    """(exported name, the name it was imported as, line) for each import in __init__.py."""
    tree = ast.parse(INIT.read_text(encoding="utf-8"), filename=str(INIT))
    out = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom | ast.Import):
            for alias in node.names:
                out.append((alias.asname or alias.name, alias.asname, node.lineno))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            pytest.fail(f"trio_cuda/__init__.py:{node.lineno}: only re-exports belong there")
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = target.id if isinstance(target, ast.Name) else ast.unparse(target)
                if not (name.startswith("__") and name.endswith("__")):
                    pytest.fail(f"trio_cuda/__init__.py:{node.lineno}: only re-exports belong there")
    return out


def public_names() -> list[str]:
    return [name for name, _, _ in _reexports() if not name.startswith("_")]


def _api_rst_targets() -> set[str]:
    """Fully qualified names documented by a directive in docs/api.rst."""
    text = API_RST.read_text(encoding="utf-8")
    targets = set()
    for m in re.finditer(r"^\.\. (?:auto\w+|py:\w+):: +([\w.]+)(?P<rest>.*(?:\n   .*)*)", text, re.M):
        name = m.group(1)
        module = re.search(r"^   :module: +([\w.]+)", m.group("rest"), re.M)
        targets.add(f"{module.group(1)}.{name}" if module else name)
    return targets


def test_every_name_is_reexported_exactly_once_as_itself() -> None:
    entries = _reexports()
    seen: dict[str, int] = {}
    for name, asname, line in entries:
        assert name not in seen, f"{name} is exported twice (lines {seen[name]} and {line})"
        seen[name] = line
        assert asname is not None, f"line {line}: re-export {name} as 'from ... import {name} as {name}'"
    imported = {alias for alias, _, _ in entries}
    # Nothing public reaches the package namespace except through these re-exports.
    extra = {
        n
        for n in vars(trio_cuda)
        if not n.startswith("_") and not isinstance(getattr(trio_cuda, n), types.ModuleType)
    }
    assert extra <= imported, f"public but not re-exported in __init__.py: {sorted(extra - imported)}"


def test_fixed_names_of_the_design_are_exported() -> None:
    fixed = {
        "open_scope", "ResourceScope", "DeviceArray", "Kernel", "Scalar", "In", "Out", "InOut",
        "Slice", "KernelLaunch", "DeviceOp", "DeviceFuture", "zip", "SchedulingPolicy",
        "TrioCudaError", "CudaError", "OutOfMemoryError", "LaunchError", "KernelArgumentError",
        "AccessConflictError", "CompletionUnknownError", "GraphCaptureError", "ScopeClosedError",
        "ops", "unsafe", "testing",
    }  # fmt: skip
    assert fixed <= set(public_names())
    for name in ("value", "copy", "fill", "host_closure"):
        assert callable(getattr(trio_cuda.ops, name))
    assert callable(trio_cuda.unsafe.async_on)
    sim = trio_cuda.testing.SimDevice
    for control in ("hold", "release", "complete_next", "run_until_idle", "inject_fault"):
        assert callable(getattr(sim, control)), control
    for record in ("violations", "live_allocations"):
        assert hasattr(sim, record), record


@pytest.mark.parametrize("name", public_names())
def test_public_name_has_a_docstring(name: str) -> None:
    obj = getattr(trio_cuda, name)
    if isinstance(obj, str):  # __version__-like data
        return
    if isinstance(obj, enum.Enum):  # a sentinel (NO_REFERENCE): its enum documents it
        obj = type(obj)
    assert inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj), (name, obj)
    doc = inspect.getdoc(obj)
    assert (doc or "").strip(), f"trio_cuda.{name} has no docstring"


@pytest.mark.parametrize("module", SUBMODULES)
def test_submodule_names_have_docstrings(module: str) -> None:
    mod = getattr(trio_cuda, module)
    assert inspect.getdoc(mod), f"trio_cuda.{module} has no module docstring"
    for name in mod.__all__:
        obj = getattr(mod, name)
        assert inspect.getdoc(obj), f"trio_cuda.{module}.{name} has no docstring"


def test_every_public_name_is_in_the_api_reference() -> None:
    targets = _api_rst_targets()
    missing = []
    for name in public_names():
        obj = getattr(trio_cuda, name)
        if isinstance(obj, types.ModuleType):
            if f"trio_cuda.{name}" not in targets:
                missing.append(f"trio_cuda.{name} (module)")
            for sub in obj.__all__:
                if f"trio_cuda.{name}.{sub}" not in targets:
                    missing.append(f"trio_cuda.{name}.{sub}")
        elif f"trio_cuda.{name}" not in targets:
            missing.append(f"trio_cuda.{name}")
    if "trio_cuda.__version__" not in targets:
        missing.append("trio_cuda.__version__")
    assert not missing, f"not documented in docs/api.rst: {missing}"


def _optional(module: str) -> types.ModuleType:
    """``trio_cuda.<module>``, imported; skips where the package it needs is not installed."""
    pytest.importorskip(
        OPTIONAL_SUBMODULES[module],
        reason=f"{OPTIONAL_SUBMODULES[module]} is not installed: trio_cuda.{module} needs its extra",
    )
    return importlib.import_module(f"trio_cuda.{module}")


def test_api_reference_names_exist() -> None:
    for target in sorted(_api_rst_targets()):
        obj: object = sys.modules["trio_cuda"]
        parts = target.split(".")
        assert parts[0] == "trio_cuda", target
        if parts[1] in OPTIONAL_SUBMODULES:
            if importlib.util.find_spec(OPTIONAL_SUBMODULES[parts[1]]) is None:
                continue  # documented, but its dependency is not installed here
            obj = importlib.import_module(f"trio_cuda.{parts[1]}")  # not an attribute until imported
            parts = parts[1:]
        for part in parts[1:]:
            assert hasattr(obj, part), f"docs/api.rst documents {target}, which does not exist"
            obj = getattr(obj, part)


@pytest.mark.parametrize("module", sorted(OPTIONAL_SUBMODULES))
def test_optional_submodule_names_are_documented(module: str) -> None:
    mod = _optional(module)
    assert inspect.getdoc(mod), f"trio_cuda.{module} has no module docstring"
    assert mod.__all__, f"trio_cuda.{module} has an empty __all__"
    # the classes and functions it defines that have public names are all in __all__
    public = {
        n
        for n, v in vars(mod).items()
        if not n.startswith("_")
        and (inspect.isclass(v) or inspect.isfunction(v))
        and v.__module__ == mod.__name__
    }
    assert public <= set(mod.__all__), (
        f"trio_cuda.{module}: public but not in __all__: {sorted(public - set(mod.__all__))}"
    )
    targets = _api_rst_targets()
    missing = [f"trio_cuda.{module}"] if f"trio_cuda.{module}" not in targets else []
    for name in mod.__all__:
        obj = getattr(mod, name)
        assert inspect.getdoc(obj), f"trio_cuda.{module}.{name} has no docstring"
        if f"trio_cuda.{module}.{name}" not in targets:
            missing.append(f"trio_cuda.{module}.{name}")
    assert not missing, f"not documented in docs/api.rst: {missing}"


def test_importing_trio_cuda_imports_no_optional_dependency() -> None:
    """``import trio_cuda`` (its public submodules, the pytest plugin, the CLI's info and the
    demo's options) in a fresh interpreter imports none of the optional packages; importing
    the optional submodule then does, which shows the check sees such an import."""
    optional = sorted(set(OPTIONAL_SUBMODULES.values()))
    code = f"""
import sys
import trio_cuda, trio_cuda.ops, trio_cuda.unsafe, trio_cuda.testing, trio_cuda.interop, trio_cuda.trace
import trio_cuda.testing.pytest_plugin
from trio_cuda.__main__ import main
from trio_cuda._demo.cli import build_parser
assert main(["info"]) == 0
build_parser()  # the demo's options, --ray's included
imported = [name for name in {optional!r} if sys.modules.get(name) is not None]
assert not imported, f"import trio_cuda imported {{imported}}"
print("clean")
"""
    for module, package in OPTIONAL_SUBMODULES.items():
        if importlib.util.find_spec(package) is not None:
            code += f"import trio_cuda.{module}\nassert sys.modules.get({package!r}) is not None\n"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "clean" in proc.stdout.splitlines(), proc.stdout


def _quick_start_commands() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```(?:sh|bash|console)?\n(.*?)```", section, re.S)]


def test_readme_quick_start_has_two_one_line_commands() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    for command in commands:
        assert "\n" not in command, command
    job, tests = commands
    assert "examples/batch_job.py" in job
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_exactly() -> None:
    _, tests = _quick_start_commands()
    lines = [line.strip() for line in CI_RUN.read_text(encoding="utf-8").splitlines()]
    assert tests in lines, f".ci/run does not run the README's test command {tests!r}"


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "trio_cuda", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_cli_info_prints_backend_and_versions() -> None:
    proc = _run_cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    first = out.splitlines()[0]
    assert re.match(r"backend: (cuda|sim) \(.+\)", first), out
    assert f"trio_cuda {trio_cuda.__version__}" in " ".join(out.split())
    for dist in ("python", "trio", "numpy"):
        assert re.search(rf"^\s+{dist}\s+\S", out, re.M), (dist, out)
    from trio_cuda._backends import probe_cuda

    if not probe_cuda().available:
        assert first.startswith("backend: sim"), out


def test_cli_main_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    from trio_cuda.__main__ import main

    assert main(["info"]) == 0
    assert capsys.readouterr().out.startswith("backend: ")
    assert main([]) == 2  # no command: help, and a usage error status
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert trio_cuda.__version__ in capsys.readouterr().out
