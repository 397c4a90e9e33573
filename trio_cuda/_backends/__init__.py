"""Backends: the simulated device and the real CUDA driver.

Invariants: importing this package never imports ``cuda``; the CUDA backend is
imported only when a CUDA device is asked for or probed. Probing never raises,
also on machines without libcuda (where ``cuda.bindings.driver`` imports but
its first call raises ``DynamicLibNotFoundError``).

Shared by both backends: ``_common`` (checks and errors they raise alike) and
``_nvrtc`` (the NVRTC compiler, which needs no driver: the cuda backend
compiles with it, and the simulator checks kernels' code with it).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._core._driver import DeviceContext
    from .sim import SimDevice

log = logging.getLogger("trio_cuda")


@attrs.frozen
class CudaProbe:
    """What :func:`probe_cuda` found."""

    available: bool
    device_count: int = 0
    driver_version: int = 0
    reason: str = ""


def probe_cuda() -> CudaProbe:
    """Ask the CUDA driver, if there is one, how many devices answer."""
    try:
        from cuda.bindings import driver as cu
    except Exception as exc:  # ImportError and friends
        return CudaProbe(False, reason=f"cuda.bindings is not importable ({exc})")
    try:
        (err,) = cu.cuInit(0)
        if int(err) != 0:
            return CudaProbe(False, reason=f"cuInit failed ({err!r})")
        err, count = cu.cuDeviceGetCount()
        if int(err) != 0:
            return CudaProbe(False, reason=f"cuDeviceGetCount failed ({err!r})")
        err, version = cu.cuDriverGetVersion()
        version = int(version) if int(err) == 0 else 0
    except Exception as exc:  # e.g. DynamicLibNotFoundError: no libcuda here
        return CudaProbe(False, reason=f"no CUDA driver ({type(exc).__name__}: {exc})")
    if count < 1:
        return CudaProbe(False, 0, version, reason="the CUDA driver reports no device")
    return CudaProbe(True, int(count), version)


def _cuda_backend_available() -> bool:
    try:
        from . import cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _open_cuda(ordinal: int) -> DeviceContext:
    try:
        from .cuda import open_context
    except ImportError as exc:
        raise RuntimeError(f"device: the cuda backend is not available ({exc})") from exc
    return open_context(ordinal)


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
            log.info("trio_cuda: using the cuda backend (device 0 of %d)", probe.device_count)
            return _open_cuda(0)
        reason = probe.reason if not probe.available else "the cuda backend is not installed"
        log.info("trio_cuda: using the simulated device: %s", reason)
        return make_sim().open_context()
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        raise ValueError(f"device: expected 'auto', 'sim', 'cuda' or 'cuda:N', got {device!r}")
    ordinal = int(m.group(1) or 0)
    probe = probe_cuda()
    if not probe.available:
        raise RuntimeError(f"device: {device!r} was asked for, but {probe.reason}")
    if ordinal >= probe.device_count:
        raise ValueError(f"device: expected an ordinal below {probe.device_count}, got {device!r}")
    return _open_cuda(ordinal)
