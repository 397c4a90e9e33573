"""Developer sessions: ``nox -s tests lint types docs`` (and ``gpu`` on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "types", "docs"]
nox.options.reuse_existing_virtualenvs = True

LINT_PATHS = ["trio_cuda", "tests", "examples", "benchmarks", "noxfile.py", "docs/conf.py"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite on the simulated device (and the GPU, where one answers)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint, and check formatting (``nox -s lint -- --no-format`` skips the latter)."""
    session.install("-e", ".[lint]")
    paths = [p for p in LINT_PATHS if Path(p).exists()]  # benchmarks/ may not exist yet
    session.run("ruff", "check", *paths)
    if "--no-format" not in session.posargs:
        session.run("ruff", "format", "--check", *paths)


@nox.session
def types(session: nox.Session) -> None:
    """mypy --strict on trio_cuda/ (configured in pyproject.toml)."""
    session.install("-e", ".[types,test]")
    session.run("mypy", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the HTML docs; any Sphinx warning is an error."""
    session.install("-e", ".[docs]")
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html", *session.posargs
    )


@nox.session
def gpu(session: nox.Session) -> None:
    """Only the tests that need a real NVIDIA GPU, and the batch job on it."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "trio_cuda", "info")
    session.run("python", "-m", "pytest", "-q", "-m", "gpu", *session.posargs)
    session.run("python", "-m", "trio_cuda", "demo", "--device", "cuda")


@nox.session
def sanitizer(session: nox.Session) -> None:
    """The GPU tests under ``compute-sanitizer --tool memcheck`` (GPU machine only).

    Host backtraces are off (``--show-backtrace device``): to print one on an
    error, the tool keeps the Python frames of every launching call alive, and
    with them their local variables, so arrays whose last handle was dropped
    would look pinned after their work retired. Device backtraces stay on.
    """
    session.install("-e", ".[test]")
    session.run(
        "compute-sanitizer",
        "--tool",
        "memcheck",
        "--show-backtrace",
        "device",
        "--error-exitcode",
        "1",
        "python",
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        *session.posargs,
        env={"TRIO_CUDA_SANITIZER": "1"},
        external=True,
    )
