"""The trio_cuda pytest plugin: fixtures for testing code that uses trio_cuda.

Installing trio_cuda registers it as the ``trio_cuda`` pytest plugin (the
``pytest11`` entry point), so pytest loads it in every run of an environment
that has trio_cuda (``-p no:trio_cuda`` turns it off; with
``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` set, ``-p trio_cuda`` turns it on).

Fixtures (function-scoped):

* ``trio_cuda_sim``: a fresh :class:`~trio_cuda.testing.SimDevice`. After
  the test, the test fails at teardown if the device recorded a memcheck
  violation or still holds an allocation.
* ``trio_cuda_scope``: an open :class:`~trio_cuda.ResourceScope` on
  ``trio_cuda_sim``.
* ``trio_cuda_gpu_scope``: an open scope on a real GPU (``cuda:0``); the test
  is skipped, with the reason, where there is none. Tests that use it are
  marked ``gpu``.

The two scope fixtures are Trio fixtures: they need pytest-trio
(``pip install 'trio_cuda[pytest]'`` brings pytest and pytest-trio), and a
Trio test (``trio_mode = true``, or ``@pytest.mark.trio``). Where pytest-trio
is not loaded, a test that uses one fails at setup with a message that names
pytest-trio and the extra, or the way it was turned off.

Markers: ``trio_cuda_sim(**options)`` passes SimDevice options to
``trio_cuda_sim`` (``check=False`` turns its teardown checks off);
``trio_cuda_scope(**options)`` passes ``open_scope`` options to both scope
fixtures (not ``device``: the fixture chooses it).
``--trio-cuda-kernel-time=SECONDS`` (or the environment variable
``TRIO_CUDA_SIM_KERNEL_TIME``) sets ``trio_cuda_sim``'s ``kernel_time``.
Under pytest-trio's ``mock_clock`` / ``autojump_clock`` fixtures the
simulator's ``kernel_time`` and ``copy_time`` take virtual time.

Invariants:

* The plugin has no effect on tests that use none of its fixtures: its hooks
  only register markers and an option, and mark the tests that use
  ``trio_cuda_gpu_scope``. It registers ``gpu`` only where the project has
  not registered it.
* Nothing here touches CUDA until ``trio_cuda_gpu_scope`` is used: the probe
  runs then, once per session.
* Nothing here imports pytest-trio: whether it is loaded is read from the
  plugin manager (its module, under whatever name it was registered), and
  checked before either scope fixture, or the GPU probe, runs.
* A marker's bad argument fails the test with an error that names the
  marker and the argument, what was expected and what was given: unknown
  names before anything is made, bad values as the device or scope refuses
  them (the same error type, its message prefixed with the marker).
"""

from __future__ import annotations as _annotations  # (aliased: only __all__ and hooks are public)

import argparse
import contextlib
import importlib.util
import inspect
import math
import typing

import pytest

if typing.TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from typing import Any

    from .._backends import CudaProbe
    from .._core._scope import ResourceScope
    from . import SimDevice

__all__ = ["trio_cuda_gpu_scope", "trio_cuda_scope", "trio_cuda_sim"]

_KERNEL_TIME_OPTION = "--trio-cuda-kernel-time"
_GPU_MARKER = "gpu: needs a real NVIDIA GPU (skipped cleanly without one)"
_probe_key = pytest.StashKey["CudaProbe"]()
_PYTEST_TRIO = "pytest_trio.plugin"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("trio_cuda")
    group.addoption(
        _KERNEL_TIME_OPTION,
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="simulated seconds each kernel takes on the trio_cuda_sim device "
        "(default: TRIO_CUDA_SIM_KERNEL_TIME, else 0)",
    )


def _registered(config: pytest.Config, marker: str) -> bool:
    for line in config.getini("markers"):
        name = line.split(":", 1)[0].split("(", 1)[0].strip()
        if name == marker:
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "trio_cuda_sim(**options): SimDevice options of the trio_cuda_sim fixture "
        "(check=False: no memcheck or leak check after the test)",
    )
    config.addinivalue_line(
        "markers", "trio_cuda_scope(**options): open_scope() options of the trio_cuda scope fixtures"
    )
    if not _registered(config, "gpu"):
        config.addinivalue_line("markers", _GPU_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "trio_cuda_gpu_scope" in getattr(item, "fixturenames", ()):
            item.add_marker("gpu")


# --------------------------------------------------------------------------- options


def _marker_options(request: pytest.FixtureRequest, name: str) -> dict[str, Any]:
    marker = request.node.get_closest_marker(name)
    if marker is None:
        return {}
    if marker.args:
        raise TypeError(f"@pytest.mark.{name}: expected keyword arguments only, got {marker.args!r}")
    return dict(marker.kwargs)


def _check_names(marker: str, options: dict[str, Any], known: list[str], what: str) -> None:
    for name, value in options.items():
        if name not in known:
            raise TypeError(
                f"@pytest.mark.{marker}: {name}: expected {what} ({', '.join(known)}), got {name}={value!r}"
            )


def _naming_marker(marker: str, exc: TypeError | ValueError) -> Exception:
    """``exc`` (a refused option of ``marker``) again, of the same kind, naming the marker."""
    kind = TypeError if isinstance(exc, TypeError) else ValueError
    return kind(f"@pytest.mark.{marker}: {exc}")


def _sim_option_names() -> list[str]:
    import attrs

    from . import SimDevice

    return [str(a.alias) for a in attrs.fields(SimDevice) if a.init]


def _sim_options(request: pytest.FixtureRequest) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """The SimDevice options (the environment's, the command line's, the
    marker's), those of them the marker gave, and the teardown check."""
    from .._open import sim_options_from_env

    options: dict[str, Any] = dict(sim_options_from_env())
    kernel_time = request.config.getoption(_KERNEL_TIME_OPTION)
    if kernel_time is not None:
        options["kernel_time"] = kernel_time
    marked = _marker_options(request, "trio_cuda_sim")
    check = marked.pop("check", True)
    if not isinstance(check, bool):
        raise TypeError(f"@pytest.mark.trio_cuda_sim: check: expected a bool, got {check!r}")
    _check_names("trio_cuda_sim", marked, [*_sim_option_names(), "check"], "a SimDevice option or check")
    options.update(marked)
    return options, marked, check


def _scope_option_names() -> list[str]:
    from .. import open_scope

    return [name for name in inspect.signature(open_scope).parameters if name != "device"]


def _scope_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    options = _marker_options(request, "trio_cuda_scope")
    if "device" in options:
        raise TypeError(
            f"@pytest.mark.trio_cuda_scope: device: expected no device (the scope fixtures open "
            f"trio_cuda_sim, whose options @pytest.mark.trio_cuda_sim(...) sets, or cuda:0; open another "
            f"device with trio_cuda.open_scope in the test), got device={options['device']!r}"
        )
    _check_names("trio_cuda_scope", options, _scope_option_names(), "an open_scope option")
    return options


@contextlib.asynccontextmanager
async def _open_marked_scope(device: object, request: pytest.FixtureRequest) -> AsyncIterator[ResourceScope]:
    """``open_scope(device, **marker options)``; bad options name the marker."""
    from .. import open_scope

    options = _scope_options(request)
    async with contextlib.AsyncExitStack() as stack:
        try:
            gpu = await stack.enter_async_context(open_scope(device, **options))
        except (TypeError, ValueError) as exc:
            if not options:
                raise
            raise _naming_marker("trio_cuda_scope", exc) from exc
        yield gpu


def _unclean(sim: SimDevice) -> str | None:
    """What the test left on ``sim``, as a readable report, or None."""
    violations = sim.violations
    live = sim.live_allocations
    if not violations and not live:
        return None
    lines = [f"trio_cuda_sim: the test left the simulated device {sim.name!r} unclean"]
    if violations:
        lines.append(f"  {len(violations)} memcheck violation(s):")
        for v in violations:
            on = "" if v.stream is None else f" on stream {v.stream}"
            lines.append(f"    {v.kind}: {v.size} bytes at {v.address:#x}, by {v.op}{on}")
    if live:
        total = sum(a.nbytes for a in live)
        lines.append(f"  {len(live)} allocation(s) never freed ({total} bytes):")
        lines.extend(f"    {a.nbytes} bytes at {a.ptr:#x}" for a in live)
    if violations:
        lines.append(
            "Violations the test expects: assert on trio_cuda_sim.violations, "
            "then call trio_cuda_sim.clear_violations()."
        )
    if live:
        lines.append(
            "Memory left on purpose (quarantined work): mark the test "
            "@pytest.mark.trio_cuda_sim(check=False)."
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def trio_cuda_sim(request: pytest.FixtureRequest) -> Iterator[SimDevice]:
    """A fresh simulated device; the test fails at teardown if it left a
    memcheck violation or an allocation on it."""
    from . import SimDevice

    options, marked, check = _sim_options(request)
    try:
        sim = SimDevice(**options)
    except (TypeError, ValueError) as exc:
        if not marked:  # the environment's and the command line's are checked already
            raise
        raise _naming_marker("trio_cuda_sim", exc) from exc
    yield sim
    if check and (report := _unclean(sim)) is not None:
        pytest.fail(report, pytrace=False)


def _gpu_probe(config: pytest.Config) -> CudaProbe:
    probe = config.stash.get(_probe_key, None)
    if probe is None:
        from .._backends import probe_cuda

        probe = config.stash[_probe_key] = probe_cuda()
    return probe


@pytest.fixture
def _trio_cuda_gpu(request: pytest.FixtureRequest) -> str:
    """The GPU that trio_cuda_gpu_scope opens; skips the test without one."""
    probe = _gpu_probe(request.config)
    if not probe.available:
        pytest.skip(f"needs a CUDA device: {probe.reason}")
    return "cuda:0"


def _pytest_trio_loaded(config: pytest.Config) -> bool:
    plugins = config.pluginmanager.get_plugins()
    return any(getattr(plugin, "__name__", None) == _PYTEST_TRIO for plugin in plugins)


def _pytest_trio_installed() -> bool:
    try:
        return importlib.util.find_spec("pytest_trio") is not None
    except (ImportError, ValueError):  # e.g. blocked: sys.modules["pytest_trio"] is None
        return False


def _without_pytest_trio(fixture: str) -> str:
    """Why ``fixture`` cannot run in this session, and what to do."""
    if _pytest_trio_installed():
        why = (
            "which is installed but not loaded in this run: it was turned off (-p no:trio), or "
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD is set; load it with -p trio"
        )
    else:
        why = (
            "which is not installed: pip install 'trio_cuda[pytest]' brings pytest and pytest-trio "
            "(or pip install pytest-trio)"
        )
    return (
        f"{fixture}: trio_cuda's scope fixtures are Trio fixtures and need the pytest-trio plugin, {why}; "
        "then make the test a Trio test (trio_mode = true in the pytest configuration, or @pytest.mark.trio)"
    )


def _require_pytest_trio(config: pytest.Config, fixture: str) -> None:
    """Fails the test, readably, where pytest-trio is not loaded (pytest would
    otherwise refuse the async ``fixture`` without saying what is missing)."""
    if not _pytest_trio_loaded(config):
        pytest.fail(_without_pytest_trio(fixture), pytrace=False)


@pytest.fixture
def _trio_cuda_scope_needs_trio(request: pytest.FixtureRequest) -> None:
    _require_pytest_trio(request.config, "trio_cuda_scope")


@pytest.fixture
def _trio_cuda_gpu_scope_needs_trio(request: pytest.FixtureRequest) -> None:
    _require_pytest_trio(request.config, "trio_cuda_gpu_scope")


@pytest.fixture
async def trio_cuda_scope(
    _trio_cuda_scope_needs_trio: None, trio_cuda_sim: SimDevice, request: pytest.FixtureRequest
) -> AsyncIterator[ResourceScope]:
    """A scope open on ``trio_cuda_sim`` for the test. A device the test left
    held is released before the scope exits (the exit waits for all the
    scope's work)."""
    async with _open_marked_scope(trio_cuda_sim, request) as gpu:
        try:
            yield gpu
        finally:
            if trio_cuda_sim.held:
                trio_cuda_sim.release()


@pytest.fixture
async def trio_cuda_gpu_scope(
    _trio_cuda_gpu_scope_needs_trio: None, _trio_cuda_gpu: str, request: pytest.FixtureRequest
) -> AsyncIterator[ResourceScope]:
    """A scope open on a real GPU (``cuda:0``); the test is skipped, with the
    probe's reason, where there is none."""
    async with _open_marked_scope(_trio_cuda_gpu, request) as gpu:
        yield gpu
