"""Backends: the simulated device and the real CUDA driver.

Invariants: importing this package never imports ``cuda``; the CUDA backend is
imported only when a CUDA device is asked for or probed. Probing never raises,
also on machines without libcuda (where ``cuda.bindings.driver`` imports but
its first call raises ``DynamicLibNotFoundError``). A probe's ``reason`` is
one short line (``no CUDA driver: libcuda.so.1 not found``); the exception
behind it, in full, is its ``detail``, logged at debug level when "auto"
falls back to the simulator and shown by ``python -m trio_cuda info``.

A CUDA device that is asked for by name ("cuda", "cuda:N") and is not there
is :class:`~trio_cuda.DeviceUnavailableError`, naming what was asked for, why
it is not there and what to use instead; nothing is opened.

Shared by both backends: ``_common`` (checks and errors they raise alike) and
``_nvrtc`` (the NVRTC compiler, which needs no driver: the cuda backend
compiles with it, and the simulator checks kernels' code with it).
"""

from __future__ import annotations

import logging
import re
import sys
from typing import TYPE_CHECKING

import attrs

from .._core._errors import DeviceUnavailableError

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._core._driver import DeviceContext
    from .sim import SimDevice

log = logging.getLogger("trio_cuda")


@attrs.frozen
class CudaProbe:
    """What :func:`probe_cuda` found. ``reason``: why no device answers, in
    one short line; ``detail``: the error behind it, in full (or "")."""

    available: bool
    device_count: int = 0
    driver_version: int = 0
    reason: str = ""
    detail: str = ""


#: the CUDA driver's library, as the platform's loader names it
DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"

#: what to use instead of a CUDA device that does not answer
INSTEAD = "use device='auto' (a GPU when one answers, else the simulator) or device='sim'"

#: what to use instead of CUDA devices for a pool
POOL_INSTEAD = (
    "use devices='auto' (every GPU when one answers, else one simulated device), "
    "['sim'] or a trio_cuda.testing.SimHost"
)


def _result_name(err: object) -> str:
    return str(getattr(err, "name", None) or err)


def _no_driver(exc: BaseException) -> CudaProbe:
    detail = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ == "DynamicLibNotFoundError":  # cuda.pathfinder's: no libcuda here
        return CudaProbe(False, reason=f"no CUDA driver: {DRIVER_LIBRARY} not found", detail=detail)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(first) > 80:
        first = first[:77] + "..."
    short = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return CudaProbe(False, reason=f"no CUDA driver ({short})", detail=detail)


def probe_cuda() -> CudaProbe:
    """Ask the CUDA driver, if there is one, how many devices answer. Never raises."""
    try:
        from cuda.bindings import driver as cu
    except Exception as exc:  # ImportError and friends
        return CudaProbe(
            False, reason="cuda.bindings is not importable", detail=f"{type(exc).__name__}: {exc}"
        )
    try:
        (err,) = cu.cuInit(0)
        if int(err) != 0:
            return CudaProbe(False, reason=f"cuInit failed: {_result_name(err)}", detail=repr(err))
        err, count = cu.cuDeviceGetCount()
        if int(err) != 0:
            return CudaProbe(False, reason=f"cuDeviceGetCount failed: {_result_name(err)}", detail=repr(err))
        err, version = cu.cuDriverGetVersion()
        version = int(version) if int(err) == 0 else 0
    except Exception as exc:  # e.g. DynamicLibNotFoundError: no libcuda here
        return _no_driver(exc)
    if count < 1:
        return CudaProbe(False, 0, version, reason="the CUDA driver reports no device")
    return CudaProbe(True, int(count), version)


def _cuda_backend_available() -> bool:
    try:
        from . import cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _open_cuda(device: str, ordinal: int) -> DeviceContext:
    try:
        from .cuda import open_context
    except ImportError as exc:
        reason = f"the cuda backend cannot be imported ({exc})"
        raise DeviceUnavailableError(
            f"device: {device!r} was asked for, but {reason}; {INSTEAD}", device=device, reason=reason
        ) from exc
    return open_context(ordinal)


def check_cuda(device: str, ordinal: int | None, *, argument: str = "device") -> CudaProbe:
    """The probe, if the CUDA device(s) ``device`` names answer (``ordinal``
    None: any device); else :class:`DeviceUnavailableError` saying what was
    asked for, why it is not there and what to use instead."""
    probe = probe_cuda()
    instead = INSTEAD if argument == "device" else POOL_INSTEAD
    if not probe.available:
        reason, why = probe.reason, f"no CUDA device answered ({probe.reason})"
    elif not _cuda_backend_available():
        reason = "the cuda backend cannot be imported"
        why = f"{reason} ({probe.device_count} CUDA device(s) answer)"
    elif ordinal is not None and ordinal >= probe.device_count:
        n = probe.device_count
        reason = f"the CUDA driver reports {n} device(s): " + (
            "cuda:0" if n == 1 else f"cuda:0 to cuda:{n - 1}"
        )
        why = f"no such CUDA device answered ({reason})"
        instead = "use one of those, device='auto' or device='sim'"
    else:
        return probe
    raise DeviceUnavailableError(
        f"{argument}: {device!r} was asked for, but {why}; {instead}", device=device, reason=reason
    )


def auto_devices() -> list[str]:
    """What ``open_device_pool(devices="auto")`` opens: every CUDA device when
    a driver and a device answer and the cuda backend is installed, else one
    simulated device (``["sim"]``). The choice is logged."""
    probe = probe_cuda()
    if probe.available and _cuda_backend_available():
        log.info("device pool: using the cuda backend (%d device(s))", probe.device_count)
        return [f"cuda:{i}" for i in range(probe.device_count)]
    _log_fallback("device pool: using one simulated device", probe)
    return ["sim"]


def _log_fallback(what: str, probe: CudaProbe) -> None:
    reason = probe.reason if not probe.available else "the cuda backend is not installed"
    log.info("%s: %s", what, reason)
    if probe.detail:
        log.debug("the CUDA probe: %s", probe.detail)


def open_device(device: object, make_sim: Callable[[], SimDevice] | None = None) -> DeviceContext:
    """Resolve ``open_scope(device=...)`` to a fresh driver context. ``make_sim``
    makes the simulator of "sim" and of the "auto" fallback (``SimDevice()``
    when None)."""
    from .sim import SimDevice

    if make_sim is None:
        make_sim = SimDevice

    if isinstance(device, SimDevice):
        return device.open_context()
    if not isinstance(device, str):
        raise TypeError(
            f"device: expected 'auto', 'sim', 'cuda', 'cuda:N' or a SimDevice, got {type(device).__name__}"
        )
    if device == "sim":
        return make_sim().open_context()
    if device == "auto":
        probe = probe_cuda()
        if probe.available and _cuda_backend_available():
            log.info("using the cuda backend (device 0 of %d)", probe.device_count)
            return _open_cuda("cuda:0", 0)
        _log_fallback("using the simulated device", probe)
        return make_sim().open_context()
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        raise ValueError(f"device: expected 'auto', 'sim', 'cuda' or 'cuda:N', got {device!r}")
    ordinal = int(m.group(1) or 0)
    check_cuda(device, ordinal)
    return _open_cuda(device, ordinal)
