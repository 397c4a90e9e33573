"""The process's primary contexts and the static facts of each device.

Invariants:

* Every :class:`~.context.CudaContext` retains its device's primary context
  (:func:`retain_primary`, released by :func:`release_primary`); this module
  keeps one extra retain per device for the life of the process, so scopes do
  not tear the primary context down and rebuild it.
* ``multi_device`` turns True, for good, once contexts on two devices were
  open at once; from then on each call makes its context current first. It is
  rebound: read it as ``primary.multi_device``, never import its value.
* ``ctx_lock`` guards the registry (and the peer-access setup of ``peer``).
"""

from __future__ import annotations

import threading
from typing import Any

from ..._core._driver import DeviceInfo
from .bindings import cu
from .errors import check

__all__ = ["ctx_lock", "device_info", "multi_device", "release_primary", "retain_primary"]

ctx_lock = threading.Lock()
_keepalive: dict[int, Any] = {}  # ordinal -> retained primary context (never released)
_devices_open: dict[int, int] = {}  # ordinal -> open CudaContexts
multi_device = False  # set once scopes on two devices were open at once


def retain_primary(ordinal: int) -> tuple[Any, Any]:
    """Retain the primary context of device ``ordinal``: ``(CUdevice, CUcontext)``."""
    global multi_device
    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    with ctx_lock:
        if ordinal not in _keepalive:
            check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _keepalive[ordinal] = ctx
        _devices_open[ordinal] = _devices_open.get(ordinal, 0) + 1
        if sum(1 for n in _devices_open.values() if n) > 1:
            multi_device = True
    return dev, ctx


def release_primary(ordinal: int, dev: Any) -> None:
    """Undo one :func:`retain_primary` (never raises)."""
    with ctx_lock:
        n = _devices_open.get(ordinal, 0)
        if n:
            _devices_open[ordinal] = n - 1
    try:
        cu.cuDevicePrimaryCtxRelease(dev)
    except Exception:  # pragma: no cover - best effort
        pass


def device_info(dev: Any, ordinal: int) -> DeviceInfo:
    """What the driver reports about device ``ordinal``."""
    A = cu.CUdevice_attribute

    def attr(name: str) -> int:
        return int(check(cu.cuDeviceGetAttribute(getattr(A, name), dev), f"cuDeviceGetAttribute({name})"))

    raw = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    total = int(check(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))
    return DeviceInfo(
        backend="cuda",
        name=name,
        ordinal=ordinal,
        total_memory=total,
        compute_capability=(
            attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
            attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
        ),
        multiprocessor_count=attr("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        max_threads_per_block=attr("CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK"),
        max_shared_memory_per_block=attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK"),
        max_shared_memory_per_block_optin=attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        max_grid_dim=(
            attr("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X"),
            attr("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y"),
            attr("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z"),
        ),
        max_block_dim=(
            attr("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X"),
            attr("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y"),
            attr("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z"),
        ),
        max_threads_per_multiprocessor=attr("CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR"),
        max_blocks_per_multiprocessor=attr("CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR"),
        max_shared_memory_per_multiprocessor=attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
        reserved_shared_memory_per_block=attr("CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK"),
        cooperative_launch=bool(attr("CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH")),
    )
