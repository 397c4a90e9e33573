"""The real CUDA backend: the driver protocol on ``cuda.bindings.driver`` and NVRTC.

Invariants:

* Importing this module never calls the driver: it imports on machines
  without libcuda (where ``cuda.bindings.driver`` imports but the first call
  raises ``DynamicLibNotFoundError``). :func:`open_context` is the first call.
* One :class:`CudaContext` per scope. It retains the device's primary context
  (released in :meth:`CudaContext.close`) and makes it current on the calling
  thread; the module keeps one extra retain per device for the life of the
  process, so scopes do not tear the primary context down and rebuild it.
* Every method runs on the Trio loop thread, except the waiter threads of
  ``_cuda_wait`` (which only block in the driver or read pinned flags) and
  staging-buffer finalizers (which only return host buffers to a pool).
* Markers are sequence numbers written by the GPU into pinned, device-mapped
  host memory (``cuStreamWriteValue32``, one slot per stream). Polling one is a
  memory read, not a driver call. Writes are deferred and coalesced: recording
  a marker costs no driver call; the newest sequence number of each stream is
  written before anything waits on it (``wait_for_progress``, ``wait_marker``,
  ``create_gate``), which places the write at or after the marker's point in
  the stream, so a marker never completes early. A context hit by a sticky error (a kernel
  fault) reports every pending marker as ``UNKNOWN``; nothing of it is freed
  afterwards (its pinned memory, streams and modules are leaked on purpose).
* ``free`` is only called by the core when no enqueued work can touch the
  memory; it is stream-ordered (``cuMemFreeAsync``) on an internal stream.
* Host staging buffers (pinned) are reused only once the GPU is done with
  them: a buffer returns to the pool when the core drops its token or
  finisher, i.e. after retirement, and carries a guard (stream, marker
  sequence) that must have completed before it is handed out again. This also
  covers ``unsafe.async_on``, which drops tokens at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, NoReturn, final

import numpy as np
import trio

from .._core._driver import (
    DONE,
    PENDING,
    Capabilities,
    DeviceInfo,
    Finisher,
    Gate,
    Marker,
    MarkerState,
    Poll,
    StreamHandle,
)
from .._core._errors import (
    CudaError,
    GraphCaptureError,
    KernelArgumentError,
    LaunchError,
    OutOfMemoryError,
    ScopeClosedError,
)
from .._core._kernel import check_cooperative_occupancy, check_param_layout
from . import _cuda_nvrtc
from ._cuda_wait import EventJob, PollJob, WaiterPool

if TYPE_CHECKING:
    from .._core._driver import DeviceContext
    from .._core._kernel import Kernel, PreparedLaunch

try:  # importing the bindings never touches libcuda
    from cuda.bindings import driver as cu
except Exception:  # pragma: no cover - no cuda-python at all
    cu = None

__all__ = [
    "CudaContext",
    "CudaFunction",
    "CudaGate",
    "CudaGraphExec",
    "CudaGraphTemplate",
    "CudaMarker",
    "CudaStream",
    "compile_statistics",
    "open_context",
]

log = logging.getLogger("trio_cuda")

_M32: Final = 0xFFFFFFFF
_HALF: Final = 0x80000000
_DEFAULT_SMEM: Final = 48 * 1024
#: flag slots: per stream one 64-byte line holding the marker slot and, 16
#: slots (64 bytes) further, the gate slot
_PAGE_BYTES: Final = 4096
_SLOTS_PER_PAGE: Final = _PAGE_BYTES // 4
_STREAMS_PER_PAGE: Final = _SLOTS_PER_PAGE // 32

# CUresult codes that mean "a kernel could not run or faulted"
_LAUNCH_CODES: Final = frozenset({700, 701, 702, 703, 710, 714, 715, 716, 717, 718, 719, 720, 912})
_OOM: Final = 2
_NOT_READY: Final = 600

compile_statistics = _cuda_nvrtc.compile_statistics
perf_counter = time.perf_counter


# --------------------------------------------------------------------------- errors


_names: dict[int, tuple[str, str]] = {}
_stream_ids = itertools.count(1)


def _describe(err: Any) -> tuple[str, str]:
    code = int(err)
    hit = _names.get(code)
    if hit is not None:
        return hit
    name = getattr(err, "name", "") or f"CUresult {code}"
    text = ""
    try:
        e, raw = cu.cuGetErrorName(err)
        if not e and raw:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        e, raw = cu.cuGetErrorString(err)
        if not e and raw:
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:  # pragma: no cover - best effort
        pass
    _names[code] = (name, text)
    return name, text


def cuda_error(err: Any, call: str, cls: type[CudaError] | None = None) -> CudaError:
    """The :class:`CudaError` (or subclass) for a failed driver call."""
    code = int(err)
    name, text = _describe(err)
    if cls is None:
        if code == _OOM:
            cls = OutOfMemoryError
        elif code in _LAUNCH_CODES:
            cls = LaunchError
        else:
            cls = CudaError
    return cls(code, name, text, call=call)


def _check(result: Any, call: str) -> Any:
    """Unpack ``(CUresult, *values)``; raise on error."""
    err = result[0]
    if err:
        raise cuda_error(err, call)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


# --------------------------------------------------------------------------- primary contexts


_ctx_lock = threading.Lock()
_keepalive: dict[int, Any] = {}  # ordinal -> retained primary context (never released)
_devices_open: dict[int, int] = {}  # ordinal -> open CudaContexts
_multi_device = False  # set once scopes on two devices were open at once


def _retain_primary(ordinal: int) -> tuple[Any, Any]:
    global _multi_device
    _check(cu.cuInit(0), "cuInit")
    dev = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    with _ctx_lock:
        if ordinal not in _keepalive:
            _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _keepalive[ordinal] = ctx
        _devices_open[ordinal] = _devices_open.get(ordinal, 0) + 1
        if sum(1 for n in _devices_open.values() if n) > 1:
            _multi_device = True
    return dev, ctx


def _device_info(dev: Any, ordinal: int) -> DeviceInfo:
    A = cu.CUdevice_attribute

    def attr(name: str) -> int:
        return int(_check(cu.cuDeviceGetAttribute(getattr(A, name), dev), f"cuDeviceGetAttribute({name})"))

    raw = _check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    total = int(_check(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))
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


# --------------------------------------------------------------------------- handles


class _FlagPage:
    """One page of pinned, device-mapped host memory holding flag slots."""

    __slots__ = ("array", "dptr", "host", "mv", "used")

    def __init__(self) -> None:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        err, host = cu.cuMemHostAlloc(_PAGE_BYTES, flags)
        if err:
            raise cuda_error(err, "cuMemHostAlloc(flags)", OutOfMemoryError if int(err) == _OOM else None)
        self.host = int(host)
        ctypes.memset(self.host, 0, _PAGE_BYTES)
        err, dptr = cu.cuMemHostGetDevicePointer(self.host, 0)
        if err:
            cu.cuMemFreeHost(self.host)
            raise cuda_error(err, "cuMemHostGetDevicePointer")
        self.dptr = int(dptr)
        carr = (ctypes.c_uint32 * _SLOTS_PER_PAGE).from_address(self.host)
        self.mv = memoryview(carr).cast("B").cast("I")
        #: a NumPy view of the same slots (for inspection and tests)
        self.array: np.ndarray[Any, Any] = np.frombuffer(carr, dtype=np.uint32)  # type: ignore[call-overload]
        self.used = 0


@final
class CudaStream:
    """A non-blocking stream of one context, with its marker and gate slots."""

    __slots__ = (
        "__weakref__",
        "ctx",
        "cu",
        "destroyed",
        "dirty",
        "gate_dptr",
        "gate_seq",
        "gate_slot",
        "handle",
        "hot",
        "index",
        "key",
        "mv",
        "page",
        "seq",
        "slot",
        "slot_dptr",
        "watched",
    )

    def __init__(self, ctx: CudaContext, index: int, stream: Any, page: _FlagPage, line: int) -> None:
        self.ctx = ctx
        self.index = index
        self.cu = stream
        self.handle = int(stream)
        #: key of this stream's entries in ``PreparedLaunch.cache`` (unique per process)
        self.key = f"cu:{next(_stream_ids)}"
        self.page = page
        self.mv = page.mv
        self.slot = line * 32
        self.gate_slot = line * 32 + 16
        self.slot_dptr = cu.CUdeviceptr(page.dptr + 4 * self.slot)
        self.gate_dptr = cu.CUdeviceptr(page.dptr + 4 * self.gate_slot)
        self.seq = 0  # last marker sequence recorded (the GPU writes it when it gets there)
        self.gate_seq = 0
        self.watched = False
        self.destroyed = False
        self.dirty = False  # a deferred marker write is pending
        self.hot = False  # a marker was written since the last flush (hybrid mode)

    @property
    def completed_seq(self) -> int:
        """The last marker sequence (mod 2**32) the GPU wrote."""
        return int(self.mv[self.slot])

    def __repr__(self) -> str:
        return f"<CudaStream {self.index} 0x{self.handle:x} seq={self.seq}>"


class CudaMarker:
    """A point in a stream's order: done once the stream's slot reached ``seq``."""

    __slots__ = ("event", "seq", "stream")

    def __init__(self, stream: CudaStream, seq: int, event: Any = None) -> None:
        self.stream = stream
        self.seq = seq
        self.event = event

    def __repr__(self) -> str:
        return f"<CudaMarker stream {self.stream.index} seq {self.seq}>"


@final
class _EventMarker(CudaMarker):
    """A marker that also recorded an event (``record_events``); the event
    goes back to the context's pool when the marker is dropped."""

    __slots__ = ()

    def __del__(self) -> None:
        try:
            self.stream.ctx._marker_events.append(self.event)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


@final
class CudaGate:
    """A ``cuStreamWaitValue32`` on the stream's gate slot, opened by the host."""

    __slots__ = ("opened", "seq", "stream")

    def __init__(self, stream: CudaStream, seq: int) -> None:
        self.stream = stream
        self.seq = seq
        self.opened = False

    def __repr__(self) -> str:
        return f"<CudaGate stream {self.stream.index} seq {self.seq} {'open' if self.opened else 'closed'}>"


@final
class CudaFunction:
    """What :meth:`CudaContext.load_kernel` returns: the module and function."""

    __slots__ = (
        "__weakref__",
        "arch",
        "argv",
        "ctx",
        "dyn_smem",
        "fn",
        "from_cache",
        "image_kind",
        "kernel",
        "limits",
        "module",
        "ok",
        "params",
        "params_end",
        "unloaded",
    )

    def __init__(
        self,
        ctx: CudaContext,
        kernel: Kernel,
        module: Any,
        fn: Any,
        image_kind: str,
        arch: str,
        from_cache: bool,
    ) -> None:
        self.ctx = ctx
        self.kernel = kernel
        self.module = module
        self.fn = fn
        self.image_kind = image_kind
        self.arch = arch
        self.from_cache = from_cache
        self.dyn_smem = _DEFAULT_SMEM
        self.unloaded = False
        #: (max threads per block, static shared bytes, parameter count or None), read on first check
        self.limits: tuple[int, int, int | None] | None = None
        #: the parameters' (offset, size) read so far, and the count where a query found the end
        self.params: list[tuple[int, int]] = []
        self.params_end: int | None = None
        #: (config, plan) pairs that passed :meth:`CudaContext.check_launch`
        self.ok: dict[tuple[object, object], None] = {}
        #: the kernel's preallocated parameter arena for first launches:
        #: (arena array, its address, void** array, its address), built on first use
        self.argv: tuple[Any, int, Any, int] | None = None

    def __repr__(self) -> str:
        state = " unloaded" if self.unloaded else ""
        return f"<CudaFunction {self.kernel.name} ({self.image_kind}, {self.arch}){state}>"


@final
class CudaGraphTemplate:
    """A captured ``CUgraph`` (from :meth:`CudaContext.end_capture`), consumed
    by ``instantiate`` or ``graph_update``."""

    __slots__ = ("ctx", "graph")

    def __init__(self, ctx: CudaContext, graph: Any) -> None:
        self.ctx = ctx
        self.graph: Any = graph

    def __repr__(self) -> str:
        return f"<CudaGraphTemplate {'consumed' if self.graph is None else 'captured'}>"


@final
class CudaGraphExec:
    """An executable graph (``CUgraphExec``) of one context."""

    __slots__ = ("__weakref__", "ctx", "destroyed", "handle")

    def __init__(self, ctx: CudaContext, handle: Any) -> None:
        self.ctx = ctx
        self.handle = handle
        self.destroyed = False

    def __repr__(self) -> str:
        return f"<CudaGraphExec 0x{int(self.handle):x}{' destroyed' if self.destroyed else ''}>"


# --------------------------------------------------------------------------- pinned staging


class _Pinned:
    __slots__ = ("addr", "guard", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size
        self.guard: tuple[CudaStream, int] | None = None


def _size_class(n: int) -> int:
    if n <= 4096:
        return 4096
    if n <= 1 << 26:
        return 1 << (n - 1).bit_length()
    step = 1 << 24
    return (n + step - 1) // step * step


class _StagingPool:
    """Pinned host buffers reused by size class (powers of two up to 64 MiB,
    then multiples of 16 MiB). At most ``max_cached`` bytes stay cached."""

    def __init__(self, ctx: CudaContext, max_cached: int = 256 << 20) -> None:
        self.ctx = ctx
        self.max_cached = max_cached
        self.free: dict[int, list[_Pinned]] = {}
        self.cached = 0
        self.outstanding = 0
        self.allocated = 0
        self.closed = False

    def get(self, n: int) -> _Pinned:
        size = _size_class(n)
        bucket = self.free.get(size)
        if bucket:
            for i in range(len(bucket) - 1, -1, -1):
                buf = bucket[i]
                g = buf.guard
                if g is None or ((g[0].mv[g[0].slot] - g[1]) & _M32) < _HALF:
                    del bucket[i]
                    self.cached -= size
                    self.outstanding += 1
                    buf.guard = None
                    return buf
        self.ctx._make_current_if_needed()
        with self.ctx._relaxed_capture():  # a pinned allocation is refused on a capturing thread
            err, addr = cu.cuMemHostAlloc(size, cu.CU_MEMHOSTALLOC_PORTABLE)
        if err:
            raise cuda_error(err, f"cuMemHostAlloc({size})", OutOfMemoryError if int(err) == _OOM else None)
        self.allocated += size
        self.outstanding += 1
        return _Pinned(int(addr), size)

    def put(self, buf: _Pinned) -> None:
        self.outstanding -= 1
        if self.closed:
            self._release(buf)
            return
        g = buf.guard
        reusable = g is None or ((g[0].mv[g[0].slot] - g[1]) & _M32) < _HALF
        if reusable and self.cached + buf.size > self.max_cached:
            self._release(buf)
            return
        self.free.setdefault(buf.size, []).append(buf)
        self.cached += buf.size

    def _release(self, buf: _Pinned) -> None:
        if self.ctx._sticky is not None:
            return  # leak: the context is broken
        try:
            cu.cuMemFreeHost(buf.addr)
            self.allocated -= buf.size
        except Exception:  # pragma: no cover - best effort
            pass

    def close(self) -> None:
        self.closed = True
        for bucket in self.free.values():
            for buf in bucket:
                self._release(buf)
        self.free.clear()
        self.cached = 0


class _StagingToken:
    """Retained by the core until the copy completed; dropping it returns the
    pinned buffer to the pool."""

    __slots__ = ("buf", "pool")

    def __init__(self, pool: _StagingPool, buf: _Pinned) -> None:
        self.pool = pool
        self.buf = buf

    def __del__(self) -> None:
        try:
            self.pool.put(self.buf)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class _D2HFinisher:
    """Copies pinned staging into the destination at retirement. Dropping it
    (after it ran, or when the work failed) returns the buffer to the pool."""

    __slots__ = ("dst", "nbytes", "token")

    def __init__(self, token: _StagingToken, dst: int, nbytes: int) -> None:
        self.token = token
        self.dst = dst
        self.nbytes = nbytes

    def __call__(self) -> None:
        ctypes.memmove(self.dst, self.token.buf.addr, self.nbytes)


# --------------------------------------------------------------------------- the context


_STRATEGIES: Final = ("adaptive", "sleep", "event", "thread")


def _param_count(fn: Any) -> int | None:
    """How many parameters a loaded kernel has (``cuFuncGetParamCount``), or
    None where the driver cannot tell (the bindings may know a function the
    installed driver lacks: calling it raises ``RuntimeError``)."""
    get_count = getattr(cu, "cuFuncGetParamCount", None)
    if get_count is None:
        return None
    try:
        err, n = get_count(fn)
    except Exception:  # not in this driver
        return None
    return None if err else int(n)


def _param_info(fn: Any, index: int) -> tuple[int, int] | bool | None:
    """``(offset, size)`` of parameter ``index`` of a loaded kernel
    (``cuFuncGetParamInfo``); False when the kernel has fewer parameters
    (``CUDA_ERROR_INVALID_VALUE``); None where the driver cannot report it."""
    try:
        err, offset, size = cu.cuFuncGetParamInfo(fn, index)
    except Exception:  # no such function in the bindings or the driver
        return None
    if err:
        return False if int(err) == 1 else None
    return int(offset), int(size)


def _runnable_tasks() -> int:
    """How many Trio tasks are ready to run (decides whether an inline spin
    would delay anyone). Uses the runner's queue when reachable, else the
    public (slower) statistics."""
    try:
        return len(_GLOBAL_RUN_CONTEXT.runner.runq)
    except AttributeError:
        return int(trio.lowlevel.current_statistics().tasks_runnable)


_GLOBAL_RUN_CONTEXT: Any
try:
    from trio._core._run import GLOBAL_RUN_CONTEXT as _GLOBAL_RUN_CONTEXT
except ImportError:  # pragma: no cover - other Trio layouts
    _GLOBAL_RUN_CONTEXT = None


@final
class CudaContext:
    """One scope's view of a CUDA device (the DeviceContext protocol).

    Tunables (attributes, for experiments and benchmarks):

    * ``wait_strategy``: ``"adaptive"`` (default: spin, then a waiter thread),
      ``"sleep"`` (spin, then poll flags from the loop with ``trio.sleep``
      backoff), ``"event"`` (markers also record events; poll them with
      ``cuEventQuery`` from the loop), ``"thread"`` (markers also record
      blocking-sync events; a waiter thread blocks on the oldest head's).
    * ``spin_budget``: seconds of cooperative spinning (``checkpoint()``
      between flag reads) before handing off.
    * ``inline_spin``: seconds of busy-waiting without yielding, only while no
      other Trio task is runnable (0 disables it).
    * ``wait_marker_mode``: ``"event"`` (default: when the marker is the
      newest point of its stream, record an event there now and
      ``cuStreamWaitEvent``; else as "flag") or ``"flag"``
      (``cuStreamWaitValue32(GEQ)`` on the marker's pinned slot).
    * ``marker_mode``: ``"hybrid"`` (default), ``"deferred"`` or ``"eager"``
      flag writes (see ``record_marker``).

    ``docs/design/completion.md`` has the measurements behind the defaults.
    """

    def __init__(self, ordinal: int = 0) -> None:
        if cu is None:  # pragma: no cover
            raise RuntimeError("cuda.bindings is not importable")
        self._closed = False
        self._sticky: CudaError | None = None
        self.ordinal = ordinal
        self._dev, self._ctx = _retain_primary(ordinal)
        try:
            _check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self.info = _device_info(self._dev, ordinal)
            self.driver_version = int(_check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
            self._pool = _check(cu.cuDeviceGetDefaultMemPool(self._dev), "cuDeviceGetDefaultMemPool")
            self._aux = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        except BaseException:
            self._release_primary()
            raise
        self._pages: list[_FlagPage] = []
        #: another context's stream waited on one of our flags: never free the pages
        self._pages_shared = False
        self._streams: dict[CudaStream, None] = {}
        self._staging = _StagingPool(self)
        self._functions: dict[CudaFunction, None] = {}
        self._free_events: list[Any] = []  # blocking-sync, timing-disabled events
        self._marker_events: list[Any] = []  # returned by CudaMarker.__del__
        self._all_events: list[Any] = []
        self._scratch_event: Any = None
        self._waiters = WaiterPool(cu, self._make_current_on_thread)
        self._wake_ev: trio.Event | None = None
        self._new_head = False
        self._dirty: list[CudaStream] = []  # streams with a deferred marker write
        self._token: trio.lowlevel.TrioToken | None = None
        self._last_error_check = 0.0
        # tunables
        self.wait_strategy = "adaptive"
        self.record_events = False
        self.spin_budget = 200e-6
        self.inline_spin = 20e-6
        #: the core's per-await spin budget (``DeviceFuture.wait``) and marker
        #: batching; load_kernel makes the context current in its thread, so it
        #: may run in a worker thread, and so may instantiate.
        #: foreign_fence(None) synchronises the context: the core runs it in a
        #: worker thread where it can; foreign_fence(stream) may be called from
        #: any thread (a DLPack deleter)
        self.capabilities = Capabilities(
            batch_markers=True,
            await_spin=50e-6,
            load_in_thread=True,
            instantiate_in_thread=True,
            foreign_fence_blocks=True,
            foreign_fence_threadsafe=True,
        )
        self.error_check_interval = 0.02
        self.poll_interval = 50e-6
        self.max_poll_interval = 1e-3
        self.sleep_max_interval = 5e-3
        self.wait_marker_mode = "flag"  # measured: 6.9 vs 14.6 us per dependent hop (see completion.md)
        #: "hybrid" (default): the first marker of a stream after each flush is
        #: written at once (so the write queues right behind the work and adds
        #: no latency), later ones are deferred and coalesced until the next
        #: flush; "deferred": always deferred; "eager": a write per marker
        self.marker_mode = "eager"  # the core already coalesces markers (batch_markers)
        self._hot: list[CudaStream] = []  # streams that wrote a marker since the last flush
        #: the stream capturing a graph (one capture at a time), and the live executable graphs
        self._capturing: CudaStream | None = None
        self._graph_execs: dict[CudaGraphExec, None] = {}
        # counters (statistics for tests and benchmarks)
        self.counters = {"handoffs": 0, "event_waits": 0, "poll_waits": 0, "loop_sleeps": 0, "spins": 0}

    # ------------------------------------------------------------------ facts
    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._streams)} streams"
        return f"<CudaContext {self.info.name!r} (cuda:{self.ordinal}) {state}>"

    @property
    def sticky_error(self) -> CudaError | None:
        """The sticky error that broke this context, if any."""
        return self._sticky

    def staging_statistics(self) -> dict[str, int]:
        s = self._staging
        return {"allocated": s.allocated, "cached": s.cached, "outstanding": s.outstanding}

    def set_wait_strategy(
        self, strategy: str, *, spin_budget: float | None = None, inline_spin: float | None = None
    ) -> None:
        """Choose how :meth:`wait_for_progress` sleeps (see the class docs).
        "event" and "thread" make markers record events too."""
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy: expected one of {_STRATEGIES}, got {strategy!r}")
        self.wait_strategy = strategy
        self.record_events = strategy in ("event", "thread")
        if spin_budget is not None:
            self.spin_budget = spin_budget
        if inline_spin is not None:
            self.inline_spin = inline_spin

    # ------------------------------------------------------------------ helpers
    def _make_current_on_thread(self) -> None:
        cu.cuCtxSetCurrent(self._ctx)

    def _make_current_if_needed(self) -> None:
        if _multi_device:
            cu.cuCtxSetCurrent(self._ctx)

    def _check_open(self) -> None:
        if self._closed:
            raise ScopeClosedError(f"cuda:{self.ordinal}: this context is closed")

    def _stream(self, stream: StreamHandle) -> CudaStream:
        if type(stream) is not CudaStream or stream.ctx is not self:
            raise TypeError(f"stream: expected a CudaStream of this context, got {stream!r}")
        if stream.destroyed:
            raise ScopeClosedError(f"stream {stream.index} was destroyed")
        if _multi_device:  # scopes on several devices: each call runs in its own context
            cu.cuCtxSetCurrent(self._ctx)
        return stream

    def _fail(self, err: Any, call: str) -> NoReturn:
        exc = cuda_error(err, call)
        if exc.code in _LAUNCH_CODES and exc.code != 701 and exc.code != 720 and exc.code != 912:
            self._sticky = self._sticky or exc
        raise exc

    def _new_event(self) -> Any:
        if self._free_events:
            return self._free_events.pop()
        self._make_current_if_needed()  # the event belongs to the current context
        flags = cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        ev = _check(cu.cuEventCreate(flags), "cuEventCreate")
        self._all_events.append(ev)
        return ev

    def _take_event(self) -> Any:
        if self._marker_events:
            return self._marker_events.pop()
        return self._new_event()

    # ------------------------------------------------------------------ streams
    def create_stream(self, index: int) -> CudaStream:
        self._check_open()
        self._make_current_if_needed()
        page = self._pages[-1] if self._pages and self._pages[-1].used < _STREAMS_PER_PAGE else None
        if page is None:
            page = _FlagPage()
            self._pages.append(page)
        handle = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        s = CudaStream(self, index, handle, page, page.used)
        page.used += 1
        self._streams[s] = None
        return s

    def destroy_stream(self, stream: StreamHandle) -> None:
        s = self._stream(stream)
        s.destroyed = True
        self._streams.pop(s, None)
        if self._sticky is None:
            (err,) = cu.cuStreamDestroy(s.cu)
            if err:
                raise cuda_error(err, "cuStreamDestroy")

    # ------------------------------------------------------------------ memory
    def alloc(self, nbytes: int, stream: StreamHandle) -> int:
        s = self._stream(stream)
        if self._capturing is not None:
            raise GraphCaptureError(
                f"allocating {nbytes} bytes while stream {self._capturing.index} captures a graph "
                f"(allocate before capturing)"
            )
        if nbytes == 0:
            return 0
        if _multi_device:
            cu.cuCtxSetCurrent(self._ctx)
        err, ptr = cu.cuMemAllocFromPoolAsync(nbytes, self._pool, s.cu)
        if err:
            raise cuda_error(err, f"cuMemAllocFromPoolAsync({nbytes})")
        return int(ptr)

    def free(self, ptr: int, nbytes: int) -> None:
        if ptr == 0:
            return
        if self._sticky is not None:
            raise self._sticky  # the core quarantines the allocation: never freed
        if _multi_device:  # another device's scope may retire our memory's last use
            cu.cuCtxSetCurrent(self._ctx)
        (err,) = cu.cuMemFreeAsync(ptr, self._aux)
        if err:
            self._fail(err, "cuMemFreeAsync")

    def copy_h2d(self, stream: StreamHandle, dst: int, src: np.ndarray[Any, Any]) -> object | None:
        s = self._stream(stream)
        n = src.nbytes
        if n == 0:
            return None
        staging = self._staging
        buf = staging.get(n)
        token = _StagingToken(staging, buf)
        ctypes.memmove(buf.addr, src.ctypes.data, n)
        (err,) = cu.cuMemcpyHtoDAsync(dst, buf.addr, n, s.cu)
        if err:
            self._fail(err, "cuMemcpyHtoDAsync")
        buf.guard = (s, s.seq + 1)
        return token

    def copy_d2h(
        self, stream: StreamHandle, dst: np.ndarray[Any, Any], src: int, *, direct: bool = False
    ) -> Finisher | None:
        s = self._stream(stream)
        if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise ValueError(f"dst: expected a writeable C-contiguous numpy array, got {type(dst).__name__}")
        n = dst.nbytes
        if n == 0:
            return None
        if direct:
            # Unsafe path: into pageable memory the driver returns only once the
            # copy (and the work before it on the stream) completed.
            (err,) = cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, n, s.cu)
            if err:
                self._fail(err, "cuMemcpyDtoHAsync")
            return None
        staging = self._staging
        buf = staging.get(n)
        token = _StagingToken(staging, buf)
        (err,) = cu.cuMemcpyDtoHAsync(buf.addr, src, n, s.cu)
        if err:
            self._fail(err, "cuMemcpyDtoHAsync")
        buf.guard = (s, s.seq + 1)
        return _D2HFinisher(token, dst.ctypes.data, n)

    def check_copy_peer(self, dst_context: object, src_context: object) -> None:
        """Any two contexts of this backend can copy (through peer access, or
        staged through the host); only a context of another backend cannot."""
        for name, ctx in (("dst", dst_context), ("src", src_context)):
            if not isinstance(ctx, CudaContext):
                raise ValueError(f"copy: {name}: expected memory of a CUDA device, got {ctx!r}")  # noqa: TRY004

    def check_foreign_stream(self, address: int) -> None:
        """A foreign CUstream cannot be checked without using it: accepted."""

    def copy_peer(
        self,
        stream: StreamHandle,
        dst: int,
        dst_context: object,
        src: int,
        src_context: object,
        nbytes: int,
    ) -> object | None:
        """Enqueue on ``stream`` a copy between memory of two contexts (two
        devices, or one): see ``_cuda_peer``."""
        from ._cuda_peer import copy_peer

        copy_peer(self, self._stream(stream), dst, dst_context, src, src_context, nbytes)
        return None

    def copy_d2d(self, stream: StreamHandle, dst: int, src: int, nbytes: int) -> None:
        s = self._stream(stream)
        if nbytes < 0:
            raise ValueError(f"nbytes: expected a non-negative int, got {nbytes!r}")
        if nbytes == 0:
            return
        (err,) = cu.cuMemcpyDtoDAsync(dst, src, nbytes, s.cu)
        if err:
            self._fail(err, "cuMemcpyDtoDAsync")

    def fill(self, stream: StreamHandle, dst: int, pattern: bytes, count: int) -> None:
        s = self._stream(stream)
        pattern = bytes(pattern)
        size = len(pattern)
        if size not in (1, 2, 4, 8):
            raise ValueError(f"pattern: expected 1, 2, 4 or 8 bytes, got {size}")
        if count < 0:
            raise ValueError(f"count: expected a non-negative int, got {count!r}")
        if count == 0:
            return
        h = s.cu
        if pattern == pattern[:1] * size:
            (err,) = cu.cuMemsetD8Async(dst, pattern[0], count * size, h)
            call = "cuMemsetD8Async"
        elif size == 2:
            (err,) = cu.cuMemsetD16Async(dst, int.from_bytes(pattern, "little"), count, h)
            call = "cuMemsetD16Async"
        elif size == 4:
            (err,) = cu.cuMemsetD32Async(dst, int.from_bytes(pattern, "little"), count, h)
            call = "cuMemsetD32Async"
        else:
            lo = int.from_bytes(pattern[:4], "little")
            hi = int.from_bytes(pattern[4:], "little")
            if lo == hi:
                (err,) = cu.cuMemsetD32Async(dst, lo, count * 2, h)
                call = "cuMemsetD32Async"
            else:
                # two strided 32-bit fills: low words, then high words (pitch 8)
                call = "cuMemsetD2D32Async"
                (err,) = cu.cuMemsetD2D32Async(dst, 8, lo, 1, count, h)
                if not err:
                    (err,) = cu.cuMemsetD2D32Async(dst + 4, 8, hi, 1, count, h)
        if err:
            self._fail(err, call)

    # ------------------------------------------------------------------ kernels
    def load_kernel(self, kernel: Kernel) -> CudaFunction:
        if self._capturing is not None:
            # first launch of a kernel inside a capture: module loading is
            # refused on a capturing thread, so relax the mode just for it
            with self._relaxed_capture():
                return self._load_kernel(kernel)
        return self._load_kernel(kernel)

    def _load_kernel(self, kernel: Kernel) -> CudaFunction:
        self._check_open()
        cu.cuCtxSetCurrent(self._ctx)
        from_cache = False
        arch = ""
        if kernel.image_kind == "source":
            assert kernel.source is not None
            res = _cuda_nvrtc.compile_source(
                kernel.source,
                kernel.name,
                tuple(kernel.options),
                self.info.compute_capability,
                self.driver_version,
            )
            image, kind, arch, from_cache = res.image, res.kind, res.arch, res.from_cache
        else:
            assert kernel.image is not None
            image, kind = kernel.image, kernel.image_kind
        if kind == "ptx" and not image.endswith(b"\0"):
            image = image + b"\0"
        err, module = cu.cuModuleLoadData(image)
        if err:
            raise cuda_error(err, f"cuModuleLoadData({kernel.name}, {kind})")
        err, fn = cu.cuModuleGetFunction(module, kernel.name.encode())
        if err:
            cu.cuModuleUnload(module)
            raise cuda_error(err, f"cuModuleGetFunction({kernel.name!r})")
        handle = CudaFunction(self, kernel, module, fn, kind, arch, from_cache)
        self._functions[handle] = None
        return handle

    def unload_kernel(self, function: object) -> None:
        """Unload the module of a :meth:`load_kernel` handle. The core calls it
        at scope exit, only when no submission using it is in flight."""
        if not isinstance(function, CudaFunction):
            raise TypeError(
                f"function: expected a CudaFunction from load_kernel, got {type(function).__name__}"
            )
        if function.unloaded:
            return
        function.unloaded = True
        self._functions.pop(function, None)
        if self._sticky is not None:
            return  # leak: the context is broken
        (err,) = cu.cuModuleUnload(function.module)
        if err:
            raise cuda_error(err, "cuModuleUnload")

    def _function_limits(self, function: CudaFunction) -> tuple[int, int, int | None]:
        """The kernel's own limits, read once: its maximum threads per block
        (registers, ``__launch_bounds__``), its static shared memory, and its
        parameter count (``cuFuncGetParamCount``; None where the driver cannot
        report it)."""
        limits = function.limits
        if limits is not None:
            return limits
        A = cu.CUfunction_attribute
        fn = function.fn

        def attr(which: Any, label: str) -> int:
            err, value = cu.cuFuncGetAttribute(which, fn)
            if err:
                raise cuda_error(err, f"cuFuncGetAttribute({label})")
            return int(value)

        threads = attr(A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "MAX_THREADS_PER_BLOCK")
        static = attr(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "SHARED_SIZE_BYTES")
        function.limits = limits = (threads, static, _param_count(fn))
        return limits

    def param_layout(self, function: CudaFunction, n: int) -> tuple[tuple[int, int], ...] | None:
        """The compiled kernel's ``(offset, size)`` per parameter, as far as a
        launch packing ``n`` parameters needs it: all of them where the driver
        reports the count, else the first ``n`` (fewer if the kernel has
        fewer). Only indices that exist are queried, so a matching launch
        makes no failing driver call. None: the driver cannot report it."""
        count = self._function_limits(function)[2]
        known = function.params
        want = count if count is not None else n
        while len(known) < want and function.params_end is None:
            info = _param_info(function.fn, len(known))
            if info is None:
                return None
            if info is False:
                function.params_end = len(known)
                break
            known.append(info)  # type: ignore[arg-type]
        return tuple(known[:want])

    def check_launch(self, function: object, launch: PreparedLaunch) -> None:
        """What only the loaded kernel knows, checked before anything is
        enqueued: its own thread limit, static plus dynamic shared memory
        (opting in to more than 48 KiB here), the parameter layout against the
        compiled kernel, the co-residency of a cooperative grid and the
        schedulability of a cluster. Raises ``KernelArgumentError``."""
        if type(function) is not CudaFunction or function.ctx is not self:
            raise TypeError(f"function: expected a CudaFunction of this context, got {function!r}")
        c = launch.config
        key = (c, launch.plan)
        if key in function.ok:
            return
        self._check_open()
        cu.cuCtxSetCurrent(self._ctx)
        max_threads, static, _ = self._function_limits(function)
        name = launch.kernel.name
        threads = c.block[0] * c.block[1] * c.block[2]
        if threads > max_threads:
            raise KernelArgumentError(
                f"{name}: block: the kernel allows at most {max_threads} threads per block "
                f"(its register use or __launch_bounds__), got {c.block} = {threads}"
            )
        optin = self.info.max_shared_memory_per_block_optin
        smem = c.shared_mem
        if static + smem > optin:
            raise KernelArgumentError(
                f"{name}: shared_mem: expected at most {max(0, optin - static)} bytes (the kernel has "
                f"{static} bytes of static shared memory, the device {optin} per block), got {smem}"
            )
        if smem > function.dyn_smem:
            attrib = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            (err,) = cu.cuFuncSetAttribute(function.fn, attrib, smem)
            if err:
                call = f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={smem})"
                raise cuda_error(err, call, LaunchError)
            function.dyn_smem = smem
        layout = self.param_layout(function, len(launch.plan.slots))
        if layout is not None:
            check_param_layout(launch, layout)
        if c.cooperative:
            err, per_sm = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function.fn, threads, smem)
            if err:
                raise cuda_error(err, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            check_cooperative_occupancy(launch, self.info, int(per_sm))
        if c.cluster is not None:
            cfg = self._launch_config(None, launch)
            err, clusters = cu.cuOccupancyMaxActiveClusters(function.fn, cfg)
            if err or not clusters:
                why = _describe(err)[0] if err else "0 clusters can be resident"
                raise KernelArgumentError(
                    f"{name}: cluster: the device cannot run clusters of {c.cluster} blocks of {c.block} "
                    f"threads with {smem} B of dynamic shared memory ({why})"
                )
        if len(function.ok) >= 1024:
            function.ok.clear()
        function.ok[key] = None

    def _prepare_launch(
        self, stream: CudaStream, function: object, launch: PreparedLaunch
    ) -> tuple[Any, ...]:
        """Build (once per launch and stream) the argument tuple of
        ``cuLaunchKernel``: the parameter arena copied into stable memory and
        the ``void**`` array of slot addresses, both kept in ``launch.cache``."""
        if type(function) is not CudaFunction or function.ctx is not self:
            raise TypeError(f"function: expected a CudaFunction of this context, got {function!r}")
        if function.unloaded:
            raise CudaError(
                400, "CUDA_ERROR_INVALID_HANDLE", f"{function!r} was unloaded", call="cuLaunchKernel"
            )
        cache = launch.cache
        params = cache.get("cu.params")
        if params is None:
            slots = launch.plan.slots
            arena = np.frombuffer(bytearray(launch.arena) or bytearray(8), dtype=np.uint8).copy()
            base = int(arena.ctypes.data)
            ptrs = np.array([base + slot.offset for slot in slots], dtype=np.uint64)
            addr = int(ptrs.ctypes.data) if len(slots) else 0
            params = (arena, ptrs, addr)
            cache["cu.params"] = params
        c = launch.config
        smem = c.shared_mem
        if smem > function.dyn_smem:
            attrib = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            (err,) = cu.cuFuncSetAttribute(function.fn, attrib, smem)
            if err:
                call = f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={smem})"
                raise cuda_error(err, call, LaunchError)
            function.dyn_smem = smem
        if len(cache) > 64:  # bound the per-stream entries of long-lived launches
            for key in [k for k in cache if k.startswith("cu:")]:
                del cache[key]
        entry: tuple[Any, ...]
        if c.cluster is not None or c.cooperative or c.pdl:
            entry = (function, function.fn, self._launch_config(stream, launch), params[2])
        else:
            entry = (function, (function.fn, *c.grid, *c.block, smem, stream.cu, params[2], 0), None)
        cache[stream.key] = entry
        return entry

    def _launch_config(self, stream: CudaStream | None, launch: PreparedLaunch) -> Any:
        """The ``CUlaunchConfig`` of a launch with modes: clusters
        (``CLUSTER_DIMENSION``), cooperative (``COOPERATIVE``) and programmatic
        dependent launch (``PROGRAMMATIC_STREAM_SERIALIZATION``). ``stream``
        None: for occupancy queries."""
        c = launch.config
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = c.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = c.block
        cfg.sharedMemBytes = c.shared_mem
        if stream is not None:
            cfg.hStream = stream.cu
        ids = cu.CUlaunchAttributeID
        attrs = []
        if c.cluster is not None:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = c.cluster
            attrs.append(a)
        if c.cooperative:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            a.value.cooperative = 1
            attrs.append(a)
        if c.pdl:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        return cfg

    def launch(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> None:
        try:
            hit = launch.cache.get(stream.key)  # type: ignore[attr-defined]
        except AttributeError:
            self._stream(stream)
            raise
        if hit is None or hit[0] is not function:
            if "cu.seen" not in launch.cache and self._launch_first(stream, function, launch):
                return
            hit = self._prepare_launch(self._stream(stream), function, launch)
        if _multi_device:
            cu.cuCtxSetCurrent(self._ctx)
        if hit[2] is None:
            (err,) = _cuLaunchKernel(*hit[1])
        else:
            (err,) = cu.cuLaunchKernelEx(hit[2], hit[1], hit[3], 0)
        if err:
            self._launch_failed(err, launch)

    def _launch_first(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> bool:
        """The first enqueue of a plain launch (no launch attributes): its
        parameters are copied into the kernel's own preallocated arena and
        launched from there, since ``cuLaunchKernel`` reads them during the
        call. Only a launch enqueued again gets stable memory of its own (see
        :meth:`_prepare_launch`), so a launch built, submitted once and
        dropped costs no per-launch buffers. False: take the general path."""
        if type(function) is not CudaFunction or function.ctx is not self or function.unloaded:
            return False
        c = launch.config
        plan = launch.plan
        if (
            c.cluster is not None
            or c.cooperative
            or c.pdl
            or c.shared_mem > function.dyn_smem
            or plan is not launch.kernel.plan
        ):
            return False
        s = stream
        if type(s) is not CudaStream or s.ctx is not self:
            s = self._stream(stream)
        argv = function.argv
        if argv is None:
            arena = np.zeros(max(plan.size, 8), dtype=np.uint8)
            base = int(arena.ctypes.data)
            ptrs = np.array([base + slot.offset for slot in plan.slots], dtype=np.uint64)
            argv = function.argv = (arena, base, ptrs, int(ptrs.ctypes.data) if plan.slots else 0)
        data = launch.arena
        _memmove(argv[1], data, len(data))
        launch.cache["cu.seen"] = True
        if _multi_device:
            cu.cuCtxSetCurrent(self._ctx)
        (err,) = _cuLaunchKernel(function.fn, *c.grid, *c.block, c.shared_mem, s.cu, argv[3], 0)
        if err:
            self._launch_failed(err, launch)
        return True

    def _launch_failed(self, err: Any, launch: PreparedLaunch) -> NoReturn:
        exc = cuda_error(err, f"cuLaunchKernel({launch.kernel.name})", LaunchError)
        if exc.code in _LAUNCH_CODES and exc.code not in (701, 720, 912):
            self._sticky = self._sticky or exc
        raise exc

    # ------------------------------------------------------------------ ordering
    def record_marker(self, stream: StreamHandle) -> CudaMarker:
        s = stream
        if type(s) is not CudaStream or s.ctx is not self:
            s = self._stream(stream)
        elif _multi_device:
            cu.cuCtxSetCurrent(self._ctx)
        seq = s.seq + 1
        mode = self.marker_mode
        if mode == "hybrid" and not s.hot and not self.record_events:
            # first marker since the last flush: write it now
            (err,) = _cuStreamWriteValue32(s.cu, s.slot_dptr, seq & _M32, 0)
            if err:
                self._fail(err, "cuStreamWriteValue32")
            s.seq = seq
            s.hot = True
            self._hot.append(s)
            if not s.watched:
                self._new_head = True
            return CudaMarker(s, seq)
        if mode != "eager" and not self.record_events:
            # Deferred and coalesced: the flag write for the newest marker of
            # the stream is enqueued by _flush (before anyone waits on it). It
            # lands at the stream's tail then, i.e. at or after this point.
            s.seq = seq
            if not s.dirty:
                s.dirty = True
                self._dirty.append(s)
            if not s.watched:
                self._new_head = True
            return CudaMarker(s, seq)
        (err,) = _cuStreamWriteValue32(s.cu, s.slot_dptr, seq & _M32, 0)
        if err:
            self._fail(err, "cuStreamWriteValue32")
        s.seq = seq
        if not s.watched:
            self._new_head = True
        if self.record_events:
            ev = self._take_event()
            (err,) = cu.cuEventRecord(ev, s.cu)
            if err:
                self._marker_events.append(ev)
                self._fail(err, "cuEventRecord")
            return _EventMarker(s, seq, ev)
        return CudaMarker(s, seq)

    def poll_marker(self, marker: Marker) -> Poll:
        s = marker.stream
        if ((s.mv[s.slot] - marker.seq) & _M32) < _HALF:  # type: ignore[attr-defined, unused-ignore]
            return DONE
        sticky = self._sticky
        if sticky is not None:
            return Poll(MarkerState.UNKNOWN, sticky)
        return PENDING

    def _done(self, marker: CudaMarker) -> bool:
        s = marker.stream
        return ((s.mv[s.slot] - marker.seq) & _M32) < _HALF

    def wait_marker(self, stream: StreamHandle, marker: Marker) -> None:
        s = self._stream(stream)
        m = marker
        if not isinstance(m, CudaMarker):
            raise TypeError(f"marker: expected a CudaMarker, got {type(m).__name__}")
        other = m.stream
        ev = m.event
        owner = other.ctx  # another device's context for cross-device waits
        if owner is not self:  # record (below) in the marker's context, wait in ours
            cu.cuCtxSetCurrent(owner._ctx)
            owner._flush_stream(other)
        if (
            ev is None
            and (self.wait_marker_mode == "event" or owner is not self)
            and m.seq == other.seq
            and not other.destroyed
        ):
            # The marker is the newest point of its stream: an event recorded
            # now completes with it. Re-recording the scratch event later does
            # not affect a wait already enqueued. The event belongs to the
            # recording stream's context; across devices (cuEventRecord there,
            # cuStreamWaitEvent here) this is the default, flags the fallback.
            ev = owner._scratch_event
            if ev is None:
                ev = owner._scratch_event = owner._new_event()
            (err,) = cu.cuEventRecord(ev, other.cu)
            if err:
                self._fail(err, "cuEventRecord")
        if owner is not self:
            cu.cuCtxSetCurrent(self._ctx)
        if ev is not None:
            (err,) = cu.cuStreamWaitEvent(s.cu, ev, 0)
            if err:
                self._fail(err, "cuStreamWaitEvent")
            return
        owner._flush_stream(other)
        if owner is not self:
            # Our stream will read the other context's flag page, perhaps after
            # that context closed: it must never free its pages (a leak of a
            # few KiB, rather than a wait on freed memory).
            owner._pages_shared = True
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        (err,) = cu.cuStreamWaitValue32(s.cu, other.slot_dptr, m.seq & _M32, geq)
        if err:
            self._fail(err, "cuStreamWaitValue32")

    def _flush(self) -> None:
        """Enqueue the pending (deferred) marker writes: one
        ``cuStreamWriteValue32`` per stream, of its newest sequence number."""
        hot = self._hot
        while hot:
            hot.pop().hot = False
        dirty = self._dirty
        while dirty:
            s = dirty.pop()
            s.dirty = False
            if s.destroyed:
                continue
            (err,) = _cuStreamWriteValue32(s.cu, s.slot_dptr, s.seq & _M32, 0)
            if err:
                self._fail(err, "cuStreamWriteValue32")

    def _flush_stream(self, s: CudaStream) -> None:
        if s.dirty:
            s.dirty = False
            self._dirty.remove(s)
            (err,) = _cuStreamWriteValue32(s.cu, s.slot_dptr, s.seq & _M32, 0)
            if err:
                self._fail(err, "cuStreamWriteValue32")

    def create_gate(self, stream: StreamHandle) -> CudaGate:
        s = self._stream(stream)
        # The marker before a gate must be written before the stream waits on
        # the host, or the host would wait for the gate it has to open.
        self._flush_stream(s)
        seq = s.gate_seq + 1
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        (err,) = cu.cuStreamWaitValue32(s.cu, s.gate_dptr, seq & _M32, geq)
        if err:
            self._fail(err, "cuStreamWaitValue32(gate)")
        s.gate_seq = seq
        return CudaGate(s, seq)

    def open_gate(self, gate: Gate) -> None:
        if type(gate) is not CudaGate:
            raise TypeError(f"gate: expected a CudaGate, got {type(gate).__name__}")
        if gate.opened:
            return
        gate.opened = True
        s = gate.stream
        cur = s.mv[s.gate_slot]
        # gates of a stream open in order; never move the slot backwards
        if ((gate.seq - cur) & _M32) < _HALF:
            s.mv[s.gate_slot] = gate.seq & _M32

    # ------------------------------------------------------------------ graphs
    @contextlib.contextmanager
    def _relaxed_capture(self) -> Iterator[None]:
        """While this thread captures, let one potentially unsafe call through
        (``cuThreadExchangeStreamCaptureMode``); a no-op otherwise."""
        if self._capturing is None:
            yield
            return
        err, old = cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        if err:
            raise cuda_error(err, "cuThreadExchangeStreamCaptureMode")
        try:
            yield
        finally:
            cu.cuThreadExchangeStreamCaptureMode(old)

    def begin_capture(self, stream: StreamHandle) -> None:
        """``cuStreamBeginCapture`` in thread-local mode: potentially unsafe
        calls (allocations, synchronisations) from this thread invalidate the
        capture, and so do synchronising calls on the stream itself."""
        s = self._stream(stream)
        if self._capturing is not None:
            raise GraphCaptureError(
                f"begin_capture: stream {self._capturing.index} of this context is already capturing"
            )
        if self._sticky is not None:
            raise self._sticky
        self._flush_stream(s)  # a deferred marker write of earlier work must not be captured
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        (err,) = cu.cuStreamBeginCapture(s.cu, mode)
        if err:
            raise cuda_error(err, "cuStreamBeginCapture")
        self._capturing = s

    def _end(self, stream: StreamHandle) -> tuple[Any, Any]:
        s = self._stream(stream)
        if self._capturing is not s:
            raise GraphCaptureError(f"end_capture: stream {s.index} is not capturing")
        self._capturing = None
        return cu.cuStreamEndCapture(s.cu)  # type: ignore[no-any-return]

    def end_capture(self, stream: StreamHandle) -> CudaGraphTemplate:
        err, graph = self._end(stream)
        if err:
            if graph is not None and int(graph):
                cu.cuGraphDestroy(graph)
            cause = cuda_error(err, "cuStreamEndCapture")
            raise GraphCaptureError(
                f"the capture was invalidated ({cause.name}): an operation during it was not allowed "
                f"in stream capture (an allocation or a synchronising call)"
            ) from cause
        return CudaGraphTemplate(self, graph)

    def abort_capture(self, stream: StreamHandle) -> None:
        if self._capturing is not stream:
            return
        _err, graph = self._end(stream)  # an invalidated capture also leaves capture mode
        if graph is not None and int(graph):
            cu.cuGraphDestroy(graph)

    def _template(self, graph: object) -> CudaGraphTemplate:
        if type(graph) is not CudaGraphTemplate or graph.ctx is not self:
            raise TypeError(f"graph: expected a CudaGraphTemplate of this context, got {graph!r}")
        if graph.graph is None:
            raise ValueError(f"graph: {graph!r} was already instantiated or used for an update")
        return graph

    def instantiate(self, graph: object) -> CudaGraphExec:
        """``cuGraphInstantiate`` (milliseconds for large graphs: the core
        calls it in a worker thread, see ``instantiate_in_thread``). Pushes
        and pops this context, so it runs on any thread."""
        t = self._template(graph)
        g, t.graph = t.graph, None
        _check(cu.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent (cuGraphInstantiate)")
        try:
            err, graph_exec = cu.cuGraphInstantiate(g, 0)
            if err:
                raise cuda_error(err, "cuGraphInstantiate")
        finally:
            cu.cuGraphDestroy(g)
            cu.cuCtxPopCurrent()
        ge = CudaGraphExec(self, graph_exec)
        self._graph_execs[ge] = None  # one dict store: atomic under the GIL
        return ge

    def _graph_exec(self, graph_exec: object) -> CudaGraphExec:
        if type(graph_exec) is not CudaGraphExec or graph_exec.ctx is not self:
            raise TypeError(f"graph_exec: expected a CudaGraphExec of this context, got {graph_exec!r}")
        if graph_exec.destroyed:
            raise CudaError(
                400, "CUDA_ERROR_INVALID_HANDLE", f"{graph_exec!r} was destroyed", call="cuGraphLaunch"
            )
        return graph_exec

    def graph_launch(self, stream: StreamHandle, graph_exec: object) -> None:
        s = self._stream(stream)
        ge = graph_exec if type(graph_exec) is CudaGraphExec and not graph_exec.destroyed else None
        if ge is None or ge.ctx is not self:
            ge = self._graph_exec(graph_exec)
        if _multi_device:
            cu.cuCtxSetCurrent(self._ctx)
        (err,) = cu.cuGraphLaunch(ge.handle, s.cu)
        if err:
            self._fail(err, "cuGraphLaunch")

    def graph_update(self, graph_exec: object, graph: object) -> None:
        """``cuGraphExecUpdate``: the parameters of ``graph`` (kernel
        arguments, copy and fill operands) for later launches, when the
        topology is the same; ``GraphCaptureError`` naming the reason if not."""
        ge = self._graph_exec(graph_exec)
        t = self._template(graph)
        g, t.graph = t.graph, None
        try:
            err, info = cu.cuGraphExecUpdate(ge.handle, g)
        finally:
            cu.cuGraphDestroy(g)
        if err:
            result = getattr(getattr(info, "result", None), "name", "") or "unknown reason"
            cause = cuda_error(err, "cuGraphExecUpdate")
            raise GraphCaptureError(
                f"cuGraphExecUpdate refused the update ({result}): the new capture must have the "
                f"same topology (the same kernel launches, copies and fills in the same order)"
            ) from cause

    def destroy_graph(self, graph_exec: object) -> None:
        if type(graph_exec) is not CudaGraphExec or graph_exec.ctx is not self:
            raise TypeError(f"graph_exec: expected a CudaGraphExec of this context, got {graph_exec!r}")
        if graph_exec.destroyed:
            return
        graph_exec.destroyed = True
        self._graph_execs.pop(graph_exec, None)
        if self._sticky is not None:
            return  # leak: the context is broken
        (err,) = cu.cuGraphExecDestroy(graph_exec.handle)
        if err:
            raise cuda_error(err, "cuGraphExecDestroy")

    # ------------------------------------------------------------------ interop
    # Foreign streams are CUstream handles of other libraries (or 1: legacy
    # default, 2: per-thread default). These calls may wait device-side on
    # them, never on the host, except foreign_fence(None).

    def stream_address(self, stream: StreamHandle) -> int:
        """The CUstream handle of ``stream``, as consumers name streams."""
        return self._stream(stream).handle

    def _foreign_event(self, on: Any) -> Any:
        ev = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        (err,) = cu.cuEventRecord(ev, on)
        if err:
            cu.cuEventDestroy(ev)
            raise cuda_error(err, "cuEventRecord (interop)")
        return ev

    def foreign_wait(self, foreign: int, stream: StreamHandle) -> None:
        """Make the foreign stream wait, device-side, for the work enqueued so
        far on ``stream``."""
        s = self._stream(stream)
        self._make_current_if_needed()
        ev = self._foreign_event(s.cu)
        try:
            (err,) = cu.cuStreamWaitEvent(cu.CUstream(foreign), ev, 0)
            if err:
                raise cuda_error(err, f"cuStreamWaitEvent(consumer stream {foreign:#x})")
        finally:
            cu.cuEventDestroy(ev)  # released once the wait has seen it complete

    def foreign_fence(self, foreign: int | None) -> Any:
        """An event after the work enqueued so far on the foreign stream; for
        None (stream unknown), synchronise the whole context and return None."""
        # May run on a consumer's thread (a DLPack deleter) or a worker thread:
        # push our context and pop it again, leaving that thread's current
        # context (another library's device) as it was.
        _check(cu.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent (interop fence)")
        try:
            if foreign is None:
                _check(cu.cuCtxSynchronize(), "cuCtxSynchronize (interop fence)")
                return None
            return self._foreign_event(cu.CUstream(foreign))
        finally:
            cu.cuCtxPopCurrent()

    def wait_fence(self, stream: StreamHandle, fence: object) -> None:
        """Make ``stream`` wait, device-side, for a fence of :meth:`foreign_fence`."""
        s = self._stream(stream)
        (err,) = cu.cuStreamWaitEvent(s.cu, fence, 0)
        if err:
            raise cuda_error(err, "cuStreamWaitEvent (interop fence)")

    def drop_fence(self, fence: object) -> None:
        """Destroy a fence's event (a wait already enqueued is unaffected)."""
        cu.cuEventDestroy(fence)

    def dlpack_device(self) -> tuple[int, int]:
        """``(kDLCUDA, ordinal)``."""
        return (2, self.ordinal)

    def pointer_device(self, ptr: int, nbytes: int) -> str | None:
        """None if ``ptr`` is device (or managed) memory of this context's
        device, else what it is instead."""
        if nbytes == 0:
            return None
        self._make_current_if_needed()
        attr = cu.CUpointer_attribute
        err, mtype = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        if err:
            return f"{ptr:#x} is not memory the CUDA driver knows (host memory?)"
        mtype = int(mtype)
        kinds = cu.CUmemorytype
        if mtype not in (int(kinds.CU_MEMORYTYPE_DEVICE), int(kinds.CU_MEMORYTYPE_UNIFIED)):
            return f"{ptr:#x} is host memory (CUmemorytype {mtype}), not device memory"
        err, ordinal = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        if err:
            return f"the device of {ptr:#x} is unknown ({err!r})"
        if int(ordinal) != self.ordinal:
            return f"{ptr:#x} is memory of cuda:{int(ordinal)}, not of this scope's cuda:{self.ordinal}"
        return None

    # ------------------------------------------------------------------ completion
    def notify_submitted(self) -> None:
        if self._new_head:
            ev = self._wake_ev
            if ev is not None:
                self._wake_ev = None
                ev.set()

    def _check_errors(self, streams: Sequence[CudaStream]) -> bool:
        """``cuStreamQuery`` the streams with pending heads; a failure other
        than NOT_READY is sticky: every pending marker becomes UNKNOWN."""
        self._last_error_check = perf_counter()
        self._make_current_if_needed()
        if self._sticky is not None:
            return True
        for s in streams:
            if s.destroyed:
                continue
            (err,) = cu.cuStreamQuery(s.cu)
            if err and int(err) != _NOT_READY:
                self._sticky = cuda_error(err, f"cuStreamQuery(stream {s.index})")
                log.error("trio_cuda: cuda:%d failed: %s", self.ordinal, self._sticky)
                return True
        return False

    async def wait_for_progress(self, pending: Sequence[Marker]) -> None:
        markers = [m for m in pending if isinstance(m, CudaMarker)]
        if not markers or self._sticky is not None:
            await trio.lowlevel.checkpoint()
            return
        self._make_current_if_needed()
        if self._dirty or self._hot:
            try:
                self._flush()
            except CudaError as exc:
                self._sticky = self._sticky or exc
                await trio.lowlevel.checkpoint()
                return
        watch = [(m.stream.mv, m.stream.slot, m.seq) for m in markers]
        streams = [m.stream for m in markers]
        for s in streams:
            s.watched = True
        self._new_head = False
        failed = False
        try:
            strategy = self.wait_strategy
            if strategy == "event":
                await self._wait_event_poll(markers, streams)
            elif await self._spin(watch, streams):
                return
            elif strategy == "sleep":
                await self._wait_sleep(watch, streams)
            else:
                await self._wait_thread(markers, watch, streams)
        except CudaError as exc:
            # a driver call of the waiting machinery failed: the context is
            # broken; pending markers now poll UNKNOWN (never raise into the core)
            if self._sticky is None:
                self._sticky = exc
                log.error("trio_cuda: cuda:%d failed: %s", self.ordinal, exc)  # noqa: TRY400
            failed = True
        finally:
            for s in streams:
                s.watched = False
        if failed:
            await trio.lowlevel.checkpoint()

    async def _spin(self, watch: list[tuple[Any, int, int]], streams: list[CudaStream]) -> bool:
        """Phase 1: read the flags between checkpoints for ``spin_budget``
        seconds (busy-waiting up to ``inline_spin`` while nobody else is
        runnable). True when something completed or a new stream got work.
        Returns without another checkpoint when it finds progress: the caller
        retires it at once (one scheduler pass less per round trip)."""
        budget = self.spin_budget
        inline = self.inline_spin
        now = perf_counter()
        end = now + budget
        inline_end = now + inline
        checkpoint = trio.lowlevel.checkpoint
        while True:
            for mv, slot, seq in watch:
                if ((mv[slot] - seq) & _M32) < _HALF:
                    return True
            if self._new_head:
                return True
            now = perf_counter()
            if now >= end:
                return False
            if now < inline_end and _runnable_tasks() == 0:
                # nobody else wants the loop: busy-wait a little without yielding
                limit = min(inline_end, end)
                while perf_counter() < limit:
                    for mv, slot, seq in watch:
                        if ((mv[slot] - seq) & _M32) < _HALF:
                            return True
                inline_end = 0.0
                continue
            self.counters["spins"] += 1
            await checkpoint()

    def _any_done(self, watch: list[tuple[Any, int, int]]) -> bool:
        return any(((mv[slot] - seq) & _M32) < _HALF for mv, slot, seq in watch)

    async def _wait_sleep(self, watch: list[tuple[Any, int, int]], streams: list[CudaStream]) -> None:
        """Strategy (a): poll the flags from the loop with ``trio.sleep`` backoff."""
        ev = trio.Event()
        self._wake_ev = ev
        interval = self.poll_interval
        last_check = perf_counter()
        try:
            while not ev.is_set():
                self.counters["loop_sleeps"] += 1
                with trio.move_on_after(interval):
                    await ev.wait()
                if self._any_done(watch):
                    return
                interval = min(interval * 2, self.sleep_max_interval)
                now = perf_counter()
                if now - last_check >= self.error_check_interval:
                    last_check = now
                    if self._check_errors(streams):
                        return
        finally:
            if self._wake_ev is ev:
                self._wake_ev = None

    async def _wait_event_poll(self, markers: list[CudaMarker], streams: list[CudaStream]) -> None:
        """Strategy (b): ``cuEventQuery`` the heads' events from the loop:
        spin with checkpoints, then sleep with backoff."""
        events = [m.event for m in markers if m.event is not None]
        if not events:  # markers recorded before record_events was set
            await self._wait_sleep([(m.stream.mv, m.stream.slot, m.seq) for m in markers], streams)
            return
        query = cu.cuEventQuery
        end = perf_counter() + self.spin_budget
        interval = self.poll_interval
        while True:
            for e in events:
                (err,) = query(e)
                if not err:
                    await trio.lowlevel.checkpoint()
                    return
                if int(err) != _NOT_READY:
                    self._sticky = cuda_error(err, "cuEventQuery")
                    await trio.lowlevel.checkpoint()
                    return
            if self._new_head:
                await trio.lowlevel.checkpoint()
                return
            if perf_counter() < end:
                await trio.lowlevel.checkpoint()
            else:
                self.counters["loop_sleeps"] += 1
                ev = trio.Event()
                self._wake_ev = ev
                with trio.move_on_after(interval):
                    await ev.wait()
                self._wake_ev = None
                if ev.is_set():
                    return
                interval = min(interval * 2, self.sleep_max_interval)

    async def _wait_thread(
        self, markers: list[CudaMarker], watch: list[tuple[Any, int, int]], streams: list[CudaStream]
    ) -> None:
        """Phase 2 of "adaptive" and strategy (c): hand the wait to a waiter
        thread and sleep on a Trio event until it (or a new submission on an
        idle stream) wakes us. The loop itself only wakes every
        ``error_check_interval`` to ask the driver about sticky errors."""
        token = self._token
        if token is None:
            token = self._token = trio.lowlevel.current_trio_token()
        ev = trio.Event()
        self._wake_ev = ev
        release_event = None
        job: EventJob | PollJob
        if self.wait_strategy == "thread" and markers[0].event is not None:
            job = EventJob(markers[0].event, self._job_done_cb(token, ev), owner=markers[0])
        elif len(markers) == 1 and markers[0].seq == markers[0].stream.seq:
            # The only pending head is the newest point of its stream: an event
            # recorded now completes with it, so the thread can block on it.
            s = markers[0].stream
            release_event = self._new_event()
            (err,) = cu.cuEventRecord(release_event, s.cu)
            if err:
                self._free_events.append(release_event)
                self._fail(err, "cuEventRecord")
            job = EventJob(release_event, self._job_done_cb(token, ev), recycle=True)
        else:
            job = PollJob(watch, self._job_done_cb(token, ev), self.poll_interval, self.max_poll_interval)
        if isinstance(job, EventJob):
            self.counters["event_waits"] += 1
        else:
            self.counters["poll_waits"] += 1
        self.counters["handoffs"] += 1
        if not self._waiters.dispatch(job):
            if release_event is not None:
                self._free_events.append(release_event)
            if self._wake_ev is ev:
                self._wake_ev = None
            await self._wait_sleep(watch, streams)
            return
        try:
            while not ev.is_set():
                with trio.move_on_after(self.error_check_interval):
                    await ev.wait()
                if ev.is_set() or self._any_done(watch):
                    break
                if self._check_errors(streams):
                    break
        finally:
            job.cancelled = True
            if self._wake_ev is ev:
                self._wake_ev = None

    def _job_done_cb(self, token: trio.lowlevel.TrioToken, ev: trio.Event) -> Any:
        def done(job: EventJob | PollJob) -> None:
            # on the waiter thread: only schedule a wake-up of the loop
            try:
                token.run_sync_soon(self._job_done, job, ev)
            except trio.RunFinishedError:
                pass

        return done

    def _job_done(self, job: EventJob | PollJob, ev: trio.Event) -> None:
        """On the loop thread, once a waiter thread finished a job."""
        if isinstance(job, EventJob):
            result = job.result
            if result is not None and int(result) not in (0, _NOT_READY) and self._sticky is None:
                self._sticky = cuda_error(result, "cuEventSynchronize")
                log.error("trio_cuda: cuda:%d failed: %s", self.ordinal, self._sticky)
            if job.recycle and not self._closed:
                self._free_events.append(job.event)
        ev.set()

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._make_current_if_needed()
        self._waiters.close()
        self._staging.close()
        if self._sticky is not None:
            log.warning(
                "trio_cuda: cuda:%d closed after a sticky error (%s); its driver state is leaked",
                self.ordinal,
                self._sticky,
            )
            self._release_primary()
            return
        for s in list(self._streams):
            if not s.destroyed:
                s.destroyed = True
                cu.cuStreamDestroy(s.cu)
        self._streams.clear()
        for ge in list(self._graph_execs):  # before the modules their kernel nodes use
            ge.destroyed = True
            cu.cuGraphExecDestroy(ge.handle)
        self._graph_execs.clear()
        for fn in list(self._functions):
            fn.unloaded = True
            cu.cuModuleUnload(fn.module)
        self._functions.clear()
        cu.cuStreamDestroy(self._aux)
        # events still held by waiter threads (or markers) are left alone
        for ev in self._free_events:
            cu.cuEventDestroy(ev)
        self._free_events.clear()
        for page in self._pages:
            page.mv.release()
            if not self._pages_shared:
                cu.cuMemFreeHost(page.host)
        self._pages.clear()
        self._release_primary()

    def _release_primary(self) -> None:
        with _ctx_lock:
            n = _devices_open.get(self.ordinal, 0)
            if n:
                _devices_open[self.ordinal] = n - 1
        try:
            cu.cuDevicePrimaryCtxRelease(self._dev)
        except Exception:  # pragma: no cover - best effort
            pass


_cuLaunchKernel: Any = cu.cuLaunchKernel if cu is not None else None
_memmove = ctypes.memmove
_cuStreamWriteValue32: Any = cu.cuStreamWriteValue32 if cu is not None else None


def open_context(ordinal: int = 0) -> CudaContext:
    """A new :class:`CudaContext` on device ``ordinal`` (``open_scope(device="cuda:N")``)."""
    return CudaContext(ordinal)


if TYPE_CHECKING:

    def _implements_protocol(ctx: CudaContext) -> DeviceContext:
        return ctx
