"""Developer sessions: ``nox -s tests lint types docs`` (and ``gpu`` on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "types", "docs"]
nox.options.reuse_existing_virtualenvs = True

LINT_PATHS = ["trio_cuda", "tests", "examples", "benchmarks", "noxfile.py", "conftest.py", "docs/conf.py"]
# Where pytest finds tests: the suite, and the code blocks of the docs and the README (conftest.py).
TEST_PATHS = ["tests", "docs", "README.md"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite and the docs' code blocks, on the simulated device (and the GPU, where one
    answers), with the dev extra (tests/public/test_docs_render.py also builds and renders the HTML)."""
    session.install("-e", ".[dev]")
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
    session.install("-e", ".[dev]")  # mypy, and the optional packages trio_cuda imports (pytest)
    session.run("mypy", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the HTML docs (furo, myst-parser for the design records); any Sphinx warning is an
    error. Their code blocks run in the ``tests`` session."""
    session.install("-e", ".[docs]")
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html", *session.posargs
    )


@nox.session
def gpu(session: nox.Session) -> None:
    """Only the tests that need a real NVIDIA GPU -- the suite's and the docs' code blocks marked
    ``:class: gpu`` (those importing CuPy or PyTorch skip where it is not installed) -- and the
    batch job on it."""
    session.install("-e", ".[dev]")
    session.run("python", "-m", "trio_cuda", "info")
    session.run("python", "-m", "pytest", "-q", "-m", "gpu", *TEST_PATHS, *session.posargs)
    session.run("python", "-m", "trio_cuda", "demo", "--device", "cuda")


@nox.session
def sanitizer(session: nox.Session) -> None:
    """The GPU tests under ``compute-sanitizer --tool memcheck`` (GPU machine only).

    Host backtraces are off (``--show-backtrace device``): to print one on an
    error, the tool keeps the Python frames of every launching call alive, and
    with them their local variables, so arrays whose last handle was dropped
    would look pinned after their work retired. Device backtraces stay on.
    """
    session.install("-e", ".[dev]")
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
