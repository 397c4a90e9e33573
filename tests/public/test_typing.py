"""Users' type checkers see trio_cuda's annotations: mypy --strict on a typed user program.

The package is built as it is installed (setuptools' build_py, which copies the package
data pyproject.toml declares) into a site directory outside the repository, and mypy runs
from another directory with only that site directory added to the path, as in a user's
project (for an interpreter that sees the test environment's packages but none of its
``.pth`` files, so an editable install of the repository stays out of the way). Without
the py.typed marker the same run reports the import as untyped, so the marker is what
makes it work.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import site as site_module
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is in the test extra")

ROOT = Path(__file__).resolve().parents[2]
TYPING = ROOT / "tests" / "public" / "typing"
#: typed programs that must check clean (each also runs, on the simulator)
PROGRAMS = ("user_program.py", "typed_results.py")
#: wrong uses: each line marked ``# E: CODE[, CODE]`` must be reported with those codes
WRONG = "wrong_uses.py"


def _build(tmp: Path) -> Path:
    """trio_cuda as installed: the package and its package data, in ``tmp/site``."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "trio_cuda", src / "trio_cuda", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp / "site"
    try:
        backend = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        backend = 0
    # pyproject.toml's license metadata needs setuptools >= 77 (a Python 3.11 venv has 65)
    if backend < 77:  # no usable build backend here: copy what pyproject.toml declares
        data = tomllib.loads((ROOT / "pyproject.toml").read_text())
        assert "py.typed" in data["tool"]["setuptools"]["package-data"]["trio_cuda"]
        shutil.copytree(src / "trio_cuda", site / "trio_cuda")
        return site
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from setuptools import setup; setup()",
            "-q",
            "build_py",
            "--build-lib",
            str(site),
        ],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return site


def _isolated_python(where: Path) -> Path:
    """An interpreter that sees this one's installed packages (NumPy's and Trio's
    annotations) but none of its ``.pth`` files: an editable install of this
    repository in the test environment would otherwise put the repository's own
    (typed) ``trio_cuda`` on mypy's search path, behind the one under test."""
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(where)
    python = where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    dirs = [*site_module.getsitepackages(), site_module.getusersitepackages()]
    Path(purelib, "test_environment.pth").write_text("".join(f"{d}\n" for d in dirs if Path(d).is_dir()))
    return python


def _mypy(python: Path, site: Path, work: Path, cache: Path, *files: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = str(site)
    config = work / "mypy.ini"
    config.write_text("[mypy]\n")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--python-executable",
            str(python),
            "--config-file",
            str(config),
            "--cache-dir",
            str(cache),
            "--no-error-summary",
            "--show-error-codes",
            "--hide-error-context",
            "--no-pretty",
            *files,
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter mypy resolves imports for (see :func:`_isolated_python`)."""
    return _isolated_python(tmp_path_factory.mktemp("python"))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("installed"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mypy's cache for runs against ``site`` (NumPy's and Trio's stubs are read once)."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_the_built_package_ships_py_typed(site: Path) -> None:
    assert (site / "trio_cuda" / "py.typed").is_file()
    assert (site / "trio_cuda" / "_core" / "_scope.py").is_file()
    assert not (site / "tests").exists()


def _expected(path: Path) -> set[tuple[int, str]]:
    return {
        (i, code.strip())
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if (m := re.search(r"# E: ([\w-]+(?:, [\w-]+)*)$", line))
        for code in m.group(1).split(",")
    }


def test_typed_programs_check_clean_and_wrong_uses_are_reported(
    python: Path, site: Path, cache: Path, tmp_path: Path
) -> None:
    work = tmp_path / "project"
    work.mkdir()
    for name in (*PROGRAMS, WRONG):
        shutil.copy2(TYPING / name, work / name)
    result = _mypy(python, site, work, cache, *PROGRAMS, WRONG)
    report = result.stdout + result.stderr
    # the typed programs check clean (trio_cuda came from the installed copy: a
    # library mypy cannot find is reported on their import lines)
    for name in PROGRAMS:
        assert name not in report, report
    expected = _expected(TYPING / WRONG)
    assert len(expected) >= 30
    found = {
        (int(m.group(1)), m.group(2))
        for m in re.finditer(rf"^{re.escape(WRONG)}:(\d+): error: .*\[([\w-]+)\]$", report, re.MULTILINE)
    }
    assert found == expected, report
    assert result.returncode == 1


def test_without_py_typed_users_get_untyped_imports(
    python: Path, site: Path, cache: Path, tmp_path: Path
) -> None:
    untyped = tmp_path / "site"
    shutil.copytree(site, untyped)
    (untyped / "trio_cuda" / "py.typed").unlink()
    work = tmp_path / "project"
    work.mkdir()
    (work / "program.py").write_text("import trio_cuda\n\nscope: int = trio_cuda.open_scope()\n")
    result = _mypy(python, untyped, work, tmp_path / "cache", "program.py")
    report = result.stdout + result.stderr
    assert re.search(
        r"^program\.py:1: error: .*py\.typed marker.*\[import-untyped\]$", report, re.MULTILINE
    ), report
    # with the marker, the same line is a type error: the annotations are read
    typed = _mypy(python, site, work, cache, "program.py")
    assert re.search(
        r"^program\.py:3: error: Incompatible types in assignment "
        r".*AbstractAsyncContextManager\[ResourceScope",
        typed.stdout,
        re.MULTILINE,
    ), typed.stdout + typed.stderr


@pytest.mark.parametrize("name", PROGRAMS)
def test_the_typed_programs_run(name: str) -> None:
    result = subprocess.run([sys.executable, str(TYPING / name)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
