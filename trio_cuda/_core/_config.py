"""Launch configuration: geometry and modes, and the device limits they must meet.

Invariants:

* A :class:`LaunchConfig` is immutable and normalised: three int dimensions
  of at least 1 each, a non-negative ``shared_mem``, bool modes, and a cluster
  that divides the grid. It is within the limits no device lifts (at most
  :data:`MAX_THREADS_PER_BLOCK` threads per block, :data:`MAX_BLOCK_DIM`,
  :data:`MAX_GRID_DIM`) and within the most any supported device allows
  (:data:`MAX_SHARED_MEMORY_PER_BLOCK`, :data:`MAX_CLUSTER_SIZE`).
  :func:`make_config` turns user input into one, so ``Kernel.launch`` and
  ``LaunchBuilder.finalize_unchecked`` refuse an impossible geometry before a
  launch exists; :func:`cached_config` memoises it only for exact ints and
  bools, so a cache hit is a configuration that passed every check.
* Device limits are checked before anything is enqueued and before any lease
  is taken: :func:`check_device_limits` (geometry, shared memory, clusters,
  cooperative support, against the device's own limits) by the scope, then
  ``DeviceContext.check_launch`` (what only the loaded kernel knows: its own
  thread limit, static shared memory, parameter layout, cooperative occupancy
  through :func:`check_cooperative_occupancy`).
* The caches here are bounded and cleared whole when full. A limit check is
  memoised per configuration and device, so a hit never skips a check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np

from ._errors import KernelArgumentError
from ._final import final

if TYPE_CHECKING:
    from ._driver import DeviceInfo
    from ._launch import PreparedLaunch


Dim3 = tuple[int, int, int]

#: the largest thread-block cluster that every device with clusters can run
PORTABLE_CLUSTER_SIZE = 8
#: the largest cluster any device runs (a non-portable size, compute
#: capability 9.0 and newer); the device's own limit is checked at submission
MAX_CLUSTER_SIZE = 16
#: threads per block, and per block dimension, on every device (compute
#: capability 2.0 and newer)
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIM = (1024, 1024, 64)
#: blocks per grid dimension on every device (compute capability 3.0 and newer)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
#: the most dynamic shared memory any supported device lets one block opt in
#: to (227 KiB, compute capability 9.0 and 10.0); the device's own limit, and
#: what the kernel's static shared memory leaves, are checked at submission
MAX_SHARED_MEMORY_PER_BLOCK = 232448
#: clusters (and programmatic dependent launch) need sm_90 or newer
CLUSTER_MIN_CC = (9, 0)


@final
@attrs.frozen(eq=False)
class LaunchConfig:
    """Validated launch geometry and modes: what ``Kernel.launch`` (or a
    builder) made of its ``grid``, ``block``, ``shared_mem``, ``cluster``,
    ``cooperative`` and ``pdl`` arguments, after checking them (see
    :doc:`launch`). Read it as ``launch.config``; no call takes one."""

    #: blocks per grid in x, y and z (dimensions not given are 1)
    grid: Dim3
    #: threads per block in x, y and z (dimensions not given are 1); at most
    #: 1024 in all
    block: Dim3
    #: bytes of dynamic shared memory per block (the kernel's static shared
    #: memory comes on top); above 48 KiB the kernel is opted in first
    shared_mem: int = 0
    #: blocks per thread-block cluster in x, y and z, each dividing the grid's;
    #: None for no clusters
    cluster: Dim3 | None = None
    #: a cooperative launch: every block resident at once, so grid-wide
    #: barriers work
    cooperative: bool = False
    #: programmatic dependent launch: the kernel may start before the previous
    #: kernel on its stream has finished, once that one signals it
    pdl: bool = False


# --------------------------------------------------------------------------- checks


def _dim3(name: str, value: object) -> Dim3:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        dims = [int(value)]
    elif isinstance(value, tuple | list) and 1 <= len(value) <= 3:
        dims = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise KernelArgumentError(f"{name}: expected an int or a tuple of 1 to 3 ints, got {value!r}")
            dims.append(int(v))
    else:
        raise KernelArgumentError(f"{name}: expected an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < 1 for d in dims):
        raise KernelArgumentError(f"{name}: every dimension must be >= 1, got {value!r}")
    while len(dims) < 3:
        dims.append(1)
    return (dims[0], dims[1], dims[2])


def _shown(dims: Dim3) -> str:
    return f"{dims[0]} x {dims[1]} x {dims[2]}"


def make_config(
    grid: object,
    block: object,
    shared_mem: object = 0,
    cluster: object = None,
    cooperative: object = False,
    pdl: object = False,
) -> LaunchConfig:
    """Check the launch geometry and modes that do not depend on the device:
    types, every dimension at least 1, the limits no device lifts (threads
    per block, block and grid dimensions) and the most any supported device
    allows (dynamic shared memory, cluster size)."""
    g = _dim3("grid", grid)
    b = _dim3("block", block)
    threads = b[0] * b[1] * b[2]
    if threads > MAX_THREADS_PER_BLOCK:
        raise KernelArgumentError(
            f"block: expected at most {MAX_THREADS_PER_BLOCK} threads per block, got {threads} ({_shown(b)})"
        )
    for axis in range(3):
        if b[axis] > MAX_BLOCK_DIM[axis]:
            raise KernelArgumentError(
                f"block: expected at most {MAX_BLOCK_DIM[axis]} threads in dimension {'xyz'[axis]}, "
                f"got {b[axis]} ({_shown(b)})"
            )
        if g[axis] > MAX_GRID_DIM[axis]:
            raise KernelArgumentError(
                f"grid: expected at most {MAX_GRID_DIM[axis]} blocks in dimension {'xyz'[axis]}, "
                f"got {g[axis]} ({_shown(g)})"
            )
    if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)) or shared_mem < 0:
        raise KernelArgumentError(f"shared_mem: expected a non-negative int, got {shared_mem!r}")
    if shared_mem > MAX_SHARED_MEMORY_PER_BLOCK:
        raise KernelArgumentError(
            f"shared_mem: expected at most {MAX_SHARED_MEMORY_PER_BLOCK} bytes of dynamic shared memory "
            f"(the most any supported GPU gives a block), got {shared_mem}"
        )
    for label, flag in (("cooperative", cooperative), ("pdl", pdl)):
        if not isinstance(flag, (bool, np.bool_)):
            raise KernelArgumentError(f"{label}: expected a bool, got {flag!r}")
    c = None
    if cluster is not None:
        c = _dim3("cluster", cluster)
        for axis, (gd, cd) in enumerate(zip(g, c, strict=True)):
            if gd % cd:
                raise KernelArgumentError(
                    f"cluster: dimension {axis} ({cd}) must divide grid dimension {gd}; "
                    f"got grid={g}, cluster={c}"
                )
        size = c[0] * c[1] * c[2]
        if size > MAX_CLUSTER_SIZE:
            raise KernelArgumentError(
                f"cluster: expected at most {MAX_CLUSTER_SIZE} blocks per cluster (the most any GPU "
                f"runs), got {size} ({_shown(c)})"
            )
    return LaunchConfig(g, b, int(shared_mem), c, bool(cooperative), bool(pdl))


_CONFIG_CACHE: dict[tuple[object, ...], LaunchConfig] = {}


def _plain(dims: object) -> bool:
    t = type(dims)
    return t is int or (t is tuple and all(type(d) is int for d in dims))  # type: ignore[attr-defined]


#: the common case (int grid and block, no cluster, no modes), keyed on
#: (grid, block, shared_mem) of exact ints
_SIMPLE_CONFIGS: dict[tuple[int, int, int], LaunchConfig] = {}


def cached_config(
    grid: object, block: object, shared_mem: object, cluster: object, cooperative: object, pdl: object
) -> LaunchConfig:
    """``make_config`` memoised on hashable arguments (the launch hot path)."""
    if (
        cluster is None
        and cooperative is False
        and pdl is False
        and type(grid) is int
        and type(block) is int
        and type(shared_mem) is int
    ):
        key3 = (grid, block, shared_mem)
        config = _SIMPLE_CONFIGS.get(key3)
        if config is None:
            config = make_config(grid, block, shared_mem)
            if len(_SIMPLE_CONFIGS) >= 4096:
                _SIMPLE_CONFIGS.clear()
            _SIMPLE_CONFIGS[key3] = config
        return config
    if not (
        _plain(grid)
        and _plain(block)
        and type(shared_mem) is int
        and (cluster is None or _plain(cluster))
        and type(cooperative) is bool
        and type(pdl) is bool
    ):
        # floats and bools compare equal to ints: only exact ints (and exact
        # bools for the modes) may hit the cache
        return make_config(grid, block, shared_mem, cluster, cooperative, pdl)
    key = (grid, block, shared_mem, cluster, cooperative, pdl)  # (exact ints: hashable)
    try:
        return _CONFIG_CACHE[key]
    except KeyError:
        pass
    # (outside the ``except``: a refusal carries no lookup error as its context)
    config = make_config(grid, block, shared_mem, cluster, cooperative, pdl)
    if len(_CONFIG_CACHE) >= 4096:
        _CONFIG_CACHE.clear()
    _CONFIG_CACHE[key] = config
    return config


# --------------------------------------------------------------------------- device limits


#: configurations that passed :func:`check_device_limits`, and for which device
_LIMITS_OK: dict[LaunchConfig, DeviceInfo] = {}


def check_device_limits(prepared: PreparedLaunch, info: DeviceInfo) -> None:
    """Check a launch's configuration against the device's limits (those that
    do not depend on the compiled kernel). Raises :class:`KernelArgumentError`
    naming the offending setting; the scope calls it before enqueueing.
    Memoised per configuration (typed launches of one geometry share one
    cached :class:`LaunchConfig`)."""
    c = prepared.config
    if _LIMITS_OK.get(c) is info:
        return
    _check_device_limits(prepared, info)
    if len(_LIMITS_OK) >= 4096:
        _LIMITS_OK.clear()
    _LIMITS_OK[c] = info


def _check_device_limits(prepared: PreparedLaunch, info: DeviceInfo) -> None:
    c = prepared.config
    name = prepared.kernel.name
    threads = c.block[0] * c.block[1] * c.block[2]
    if threads > info.max_threads_per_block:
        raise KernelArgumentError(
            f"{name}: block: expected at most {info.max_threads_per_block} threads per block, "
            f"got {c.block} = {threads}"
        )
    for axis, (b, mb) in enumerate(zip(c.block, info.max_block_dim, strict=True)):
        if b > mb:
            raise KernelArgumentError(f"{name}: block: dimension {axis} is {b}, the device allows {mb}")
    for axis, (g, mg) in enumerate(zip(c.grid, info.max_grid_dim, strict=True)):
        if g > mg:
            raise KernelArgumentError(f"{name}: grid: dimension {axis} is {g}, the device allows {mg}")
    if c.shared_mem > info.max_shared_memory_per_block_optin:
        raise KernelArgumentError(
            f"{name}: shared_mem: expected at most {info.max_shared_memory_per_block_optin} bytes, "
            f"got {c.shared_mem}"
        )
    cc = tuple(info.compute_capability)
    if c.cluster is not None:
        if cc < CLUSTER_MIN_CC:
            raise KernelArgumentError(
                f"{name}: cluster: thread-block clusters need compute capability "
                f"{CLUSTER_MIN_CC[0]}.{CLUSTER_MIN_CC[1]} or newer, the device ({info.name}) has "
                f"{cc[0]}.{cc[1]}; got cluster={c.cluster}"
            )
        size = c.cluster[0] * c.cluster[1] * c.cluster[2]
        if size > PORTABLE_CLUSTER_SIZE:
            raise KernelArgumentError(
                f"{name}: cluster: expected at most {PORTABLE_CLUSTER_SIZE} blocks per cluster, got {size}"
            )
    if c.pdl and cc < CLUSTER_MIN_CC:
        raise KernelArgumentError(
            f"{name}: pdl: programmatic dependent launch needs compute capability "
            f"{CLUSTER_MIN_CC[0]}.{CLUSTER_MIN_CC[1]} or newer, the device ({info.name}) has {cc[0]}.{cc[1]}"
        )
    if c.cooperative and not info.cooperative_launch:
        raise KernelArgumentError(
            f"{name}: cooperative: the device ({info.name}) does not support cooperative launches"
        )


def modeled_blocks_per_sm(info: DeviceInfo, block: Dim3, shared_mem: int) -> int:
    """How many blocks of ``block`` threads and ``shared_mem`` bytes of dynamic
    shared memory one SM can hold, from the device's per-SM limits alone (the
    simulator's occupancy model; registers and static shared memory are not
    modelled)."""
    threads = block[0] * block[1] * block[2]
    warps = -(-threads // 32)
    fit = min(info.max_blocks_per_multiprocessor, info.max_threads_per_multiprocessor // (warps * 32))
    if shared_mem:
        per_block = shared_mem + info.reserved_shared_memory_per_block
        fit = min(fit, info.max_shared_memory_per_multiprocessor // per_block)
    return max(0, fit)


def check_cooperative_occupancy(prepared: PreparedLaunch, info: DeviceInfo, blocks_per_sm: int) -> None:
    """Refuse a cooperative launch whose blocks cannot all be resident at once
    (``blocks_per_sm`` of this kernel and configuration, times the SM count):
    a grid-wide barrier in it would never complete."""
    c = prepared.config
    blocks = c.grid[0] * c.grid[1] * c.grid[2]
    sms = info.multiprocessor_count
    limit = blocks_per_sm * sms
    if blocks > limit:
        # (the limit is blocks_per_sm x SMs; a grid-stride loop fits any size)
        raise KernelArgumentError(
            f"{prepared.kernel.name}: cooperative launch of {blocks} blocks exceeds the "
            f"co-resident limit {limit} ({sms} SMs)"
        )
