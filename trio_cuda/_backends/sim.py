"""The simulated device: a deterministic GPU for machines without one, and for tests.

Invariants:

* One :class:`SimDevice` is one address space and one engine, shared by every
  :class:`SimContext` (one per scope) opened on it. Everything is called from one
  thread (the Trio loop, or synchronous test code); nothing here blocks.
* Addresses come from a bump allocator (256-byte aligned, with a 256-byte red zone
  between allocations) and are never reused, so every use after free is detectable.
  ``free`` poisons the bytes (``0xDB``) and drops the buffer.
* Memcheck: device addresses are resolved when a command *executes*, not when it is
  enqueued. A command that touches bytes outside one live allocation is recorded in
  :attr:`SimDevice.violations` and its effect is skipped (the reference kernel does
  not run). It still counts as executed and is not an error on the stream. A
  zero-byte access touches nothing; it is a violation only when its address lies in
  a freed allocation.
* Streams are FIFO. Bookkeeping commands (markers, satisfied waits, opened gates) at
  a stream head execute at once, even while held. Work commands (launches, copies,
  fills) execute on enqueue when free-running, when due if ``kernel_time`` or
  ``copy_time`` is positive, and only through :meth:`SimDevice.complete_next` /
  :meth:`SimDevice.run_until_idle` while held.
* Errors (an injected ``kernel_fault``, a reference that raises) attach to the
  stream's next marker, which then polls ``FAILED``. They are not sticky: later work
  on the stream runs normally. An injected ``completion_unknown`` skips its launch
  and makes the stream's next marker poll ``UNKNOWN`` forever; the stream itself
  goes on with later work.
* ``load_kernel`` hands out a module with a unique fake address; a launch that
  executes after ``unload_kernel`` is a ``use_after_free`` at that address.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, final

import attrs
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
    CompletionUnknownError,
    CudaError,
    GraphCaptureError,
    LaunchError,
    OutOfMemoryError,
    ScopeClosedError,
)
from .._core._kernel import check_cooperative_occupancy, modeled_blocks_per_sm
from .._core._ops import Access

if TYPE_CHECKING:
    from .._core._driver import DeviceContext
    from .._core._kernel import ArgView, Kernel, PreparedLaunch

__all__ = [
    "FaultKind",
    "SimAllocation",
    "SimContext",
    "SimDevice",
    "SimFunction",
    "SimGate",
    "SimGraph",
    "SimGraphExec",
    "SimMarker",
    "SimStatistics",
    "SimStream",
    "TraceEvent",
    "Violation",
    "ViolationKind",
]

ViolationKind = Literal["use_after_free", "unallocated", "out_of_bounds", "double_free", "invalid_free"]
FaultKind = Literal["launch_error", "out_of_memory", "kernel_fault", "completion_unknown"]
_FAULT_KINDS: tuple[str, ...] = ("launch_error", "out_of_memory", "kernel_fault", "completion_unknown")

_BASE_ADDRESS = 0x7F00_0000_0000
_MODULE_BASE = 0x7E00_0000_0000  # fake module handles: never inside device memory
_STREAM_ADDRESS_BASE = 0x7D00_0000_0000  # fake stream handles for interop (stream_address)
#: DLPack device type of simulated memory: kDLExtDev, which no real consumer accepts
DLPACK_SIM_DEVICE = 12
_sim_device_ids = iter(range(1 << 30))
_GRAPH_BASE = 0x7D00_0000_0000  # fake executable-graph handles
_ALIGN = 256
_RED_ZONE = 256
_POISON = 0xDB
_EMPTY = np.empty(0, dtype=np.uint8)
_EMPTY.setflags(write=False)
_WORK_KINDS = frozenset({"launch", "h2d", "d2h", "d2d", "fill", "graph", "peer"})

perf_counter = time.perf_counter


# --------------------------------------------------------------------------- records


@attrs.frozen
class SimAllocation:
    """A live allocation: its device address and size in bytes."""

    ptr: int
    nbytes: int


@attrs.frozen
class Violation:
    """One memcheck record. ``op`` says which command (and which operand) touched
    the bytes; ``stream`` is the stream index, or None for ``free``."""

    kind: ViolationKind
    address: int
    size: int
    op: str
    stream: int | None


@attrs.frozen
class TraceEvent:
    """One executed command. ``seq`` is its global enqueue order; times are
    ``time.perf_counter()`` values (simulated ones for timed work)."""

    seq: int
    stream: int
    kind: str
    label: str
    t_enqueue: float
    t_start: float
    t_end: float


@attrs.frozen
class SimStatistics:
    """Counters of a :class:`SimDevice` (executed commands, memory, memcheck)."""

    launches: int
    copies: int
    fills: int
    bytes_copied: int
    commands_executed: int
    pending: int
    live_allocations: int
    live_bytes: int
    violations: int
    kernel_loads: int
    kernel_unloads: int
    allocations: int
    frees: int


# --------------------------------------------------------------------------- handles


class _Alloc:
    __slots__ = ("buf", "freed", "nbytes", "ptr")

    def __init__(self, ptr: int, nbytes: int, buf: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.buf = buf
        self.freed = False


class _Cmd:
    """One queued command. ``data`` is the kind's payload: the staged bytes (h2d),
    the host array (d2h), the pattern (fill), the PreparedLaunch (launch), the
    marker sequence number (marker), the SimMarker (wait_marker) or the SimGate."""

    __slots__ = (
        "data",
        "dst",
        "duration",
        "fault",
        "fn",
        "kind",
        "label",
        "nbytes",
        "seq",
        "src",
        "t_enqueue",
        "work",
    )

    def __init__(
        self,
        kind: str,
        seq: int,
        label: str,
        duration: float,
        data: Any = None,
        dst: int = 0,
        src: int = 0,
        nbytes: int = 0,
        fault: str | None = None,
        fn: SimFunction | None = None,
    ) -> None:
        self.kind = kind
        self.seq = seq
        self.label = label
        self.t_enqueue = perf_counter()
        self.duration = duration
        self.data = data
        self.dst = dst
        self.src = src
        self.nbytes = nbytes
        self.fault = fault
        self.fn = fn
        self.work = kind in _WORK_KINDS


@final
class SimStream:
    """A simulated stream: a FIFO command queue. The core only uses ``index``."""

    __slots__ = (
        "_capture",
        "_clock",
        "_context",
        "_destroyed",
        "_done_seq",
        "_error",
        "_extra_errors",
        "_marker_seq",
        "_queue",
        "_results",
        "_unknown",
        "_waiters",
        "index",
    )

    def __init__(self, index: int, context: SimContext) -> None:
        self.index = index
        self._context = context
        self._queue: deque[_Cmd] = deque()
        self._marker_seq = 0  # last marker recorded
        self._done_seq = 0  # last marker executed (the host-visible counter)
        self._results: dict[int, Poll] = {}  # only markers that did not end DONE
        self._error: BaseException | None = None
        self._extra_errors = 0
        self._unknown = False
        self._waiters: dict[SimStream, None] = {}
        self._clock = 0.0
        self._destroyed = False
        #: commands recorded instead of enqueued while a graph capture runs
        self._capture: list[_Cmd] | None = None

    @property
    def device(self) -> SimDevice:
        return self._context._device

    @property
    def queued(self) -> int:
        """Commands enqueued on this stream and not executed yet."""
        return len(self._queue)

    def __repr__(self) -> str:
        state = " destroyed" if self._destroyed else ""
        return f"<SimStream {self.index} of {self._context._device.name}{state} queued={len(self._queue)}>"

    def _add_error(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        else:
            self._extra_errors += 1


@attrs.frozen
class SimMarker:
    """A recorded point in a stream's order: done once the stream's counter
    reaches ``seq``."""

    stream: SimStream
    seq: int


@final
class SimGate:
    """A stream-side wait that :meth:`SimContext.open_gate` opens."""

    __slots__ = ("_opened_at", "opened", "stream")

    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        self.opened = False
        self._opened_at = 0.0

    def __repr__(self) -> str:
        return f"<SimGate on stream {self.stream.index} {'open' if self.opened else 'closed'}>"


@final
class SimFunction:
    """What :meth:`SimContext.load_kernel` returns: the kernel's module, loaded in
    one context. ``handle`` is a unique fake module address; after
    :meth:`SimContext.unload_kernel` a launch of it that still executes is a
    ``use_after_free`` violation at that address."""

    __slots__ = ("context", "handle", "kernel", "unloaded")

    def __init__(self, kernel: Kernel, context: SimContext, handle: int) -> None:
        self.kernel = kernel
        self.context = context
        self.handle = handle
        self.unloaded = False

    def __repr__(self) -> str:
        state = " unloaded" if self.unloaded else ""
        return f"<SimFunction {self.kernel.name} at {self.handle:#x}{state}>"


# --------------------------------------------------------------------------- device


def _check_memory(_inst: object, _attr: object, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"memory: expected a non-negative int (bytes), got {value!r}")


def _check_time(_inst: object, attr: attrs.Attribute[float], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{attr.name}: expected a non-negative number of seconds, got {value!r}")


def _check_cc(_inst: object, _attr: object, value: object) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)):
        raise TypeError(f"compute_capability: expected a (major, minor) tuple of ints, got {value!r}")


def _check_sms(_inst: object, _attr: object, value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"multiprocessor_count: expected a positive int, got {value!r}")


def _check_trace_limit(_inst: object, _attr: object, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"trace_limit: expected None or a non-negative int, got {value!r}")


@final
@attrs.define(eq=False, repr=False)
class SimDevice:
    """A simulated GPU, shared by every scope opened on it.

    ``memory`` is the total device memory in bytes. ``kernel_time`` and
    ``copy_time`` are the simulated seconds each launch / each copy or fill takes
    while free-running (0: it executes as soon as it is enqueued). ``trace_limit``
    bounds :attr:`trace` to the most recent events (None: unbounded, 0: off).
    ``batch_markers`` lets scopes record one completion marker per burst of
    submissions, as on a real GPU.

    Test controls: :meth:`hold`, :meth:`release`, :meth:`complete_next`,
    :meth:`run_until_idle`, :meth:`inject_fault`, :attr:`violations`,
    :attr:`live_allocations`.
    """

    name: str = "sim0"
    memory: int = attrs.field(default=8 * 2**30, validator=_check_memory)
    kernel_time: float = attrs.field(default=0.0, validator=_check_time)
    copy_time: float = attrs.field(default=0.0, validator=_check_time)
    trace_limit: int | None = attrs.field(default=100_000, kw_only=True, validator=_check_trace_limit)
    #: let scopes share one completion marker among a burst of submissions
    #: (as the CUDA backend does); an error then fails every submission of
    #: the burst. Off by default so that each error is attributed exactly.
    batch_markers: bool = attrs.field(default=False, kw_only=True)
    #: seconds an awaiting task polls its own marker before parking (see
    #: ``DeviceFuture.wait``); useful with ``kernel_time`` to model a GPU
    await_spin: float = attrs.field(default=0.0, kw_only=True, validator=_check_time)
    #: what ``info.compute_capability`` reports; clusters and programmatic
    #: dependent launch are refused below (9, 0), as on a real GPU
    compute_capability: tuple[int, int] = attrs.field(default=(9, 0), kw_only=True, validator=_check_cc)
    #: SMs of the occupancy model that bounds cooperative launches
    multiprocessor_count: int = attrs.field(default=132, kw_only=True, validator=_check_sms)

    _held: bool = attrs.field(init=False, default=False)
    _next_ptr: int = attrs.field(init=False, default=_BASE_ADDRESS)
    _bases: list[int] = attrs.field(init=False, factory=list)
    _allocs: list[_Alloc] = attrs.field(init=False, factory=list)
    _live: dict[int, _Alloc] = attrs.field(init=False, factory=dict)
    _live_bytes: int = attrs.field(init=False, default=0)
    _violations: list[Violation] = attrs.field(init=False, factory=list)
    _trace: deque[TraceEvent] = attrs.field(init=False, factory=deque)
    _faults: dict[str, int] = attrs.field(init=False, factory=dict)
    _seq: int = attrs.field(init=False, default=0)
    _busy: dict[SimStream, None] = attrs.field(init=False, factory=dict)
    _dirty: deque[SimStream] = attrs.field(init=False, factory=deque)
    _pending: int = attrs.field(init=False, default=0)
    _timed_pending: int = attrs.field(init=False, default=0)
    _event: trio.Event | None = attrs.field(init=False, default=None)
    _pumping: bool = attrs.field(init=False, default=False)
    _info: DeviceInfo = attrs.field(init=False)
    _launches: int = attrs.field(init=False, default=0)
    _copies: int = attrs.field(init=False, default=0)
    _fills: int = attrs.field(init=False, default=0)
    _bytes_copied: int = attrs.field(init=False, default=0)
    _executed: int = attrs.field(init=False, default=0)
    _kernel_loads: int = attrs.field(init=False, default=0)
    _kernel_unloads: int = attrs.field(init=False, default=0)
    _alloc_count: int = attrs.field(init=False, default=0)
    _free_count: int = attrs.field(init=False, default=0)
    #: interop: fake stream addresses, and this device's DLPack device id
    _stream_addrs: dict[SimStream, int] = attrs.field(init=False, factory=dict)
    _addr_streams: dict[int, SimStream] = attrs.field(init=False, factory=dict)
    _dl_id: int = attrs.field(init=False, factory=lambda: next(_sim_device_ids))
    _graphs_made: int = attrs.field(init=False, default=0)
    _graphs_live: int = attrs.field(init=False, default=0)
    _graph_launches: int = attrs.field(init=False, default=0)
    #: the SimHost this device belongs to (see ``sim_multi``), or None
    _host: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._info = DeviceInfo(
            backend="sim",
            name=self.name,
            ordinal=0,
            total_memory=self.memory,
            compute_capability=self.compute_capability,
            multiprocessor_count=self.multiprocessor_count,
            max_shared_memory_per_block_optin=232448,
            max_threads_per_multiprocessor=2048,
            max_blocks_per_multiprocessor=32,
            max_shared_memory_per_multiprocessor=233472,
            reserved_shared_memory_per_block=1024,
        )
        self._trace = deque(maxlen=self.trace_limit)

    def __repr__(self) -> str:
        mode = "held" if self._held else "free-running"
        return (
            f"<SimDevice {self.name!r} {mode} pending={self._pending} "
            f"live={len(self._live)} ({self._live_bytes} B) violations={len(self._violations)}>"
        )

    # ------------------------------------------------------------------ public

    @property
    def info(self) -> DeviceInfo:
        """Static facts about the simulated device."""
        return self._info

    def open_context(self) -> SimContext:
        """A new context (one per scope) on this device."""
        return SimContext(self)

    @property
    def held(self) -> bool:
        """True while work commands only execute through complete_next/run_until_idle."""
        return self._held

    @property
    def pending(self) -> int:
        """Commands enqueued on any stream and not executed yet."""
        return self._pending

    @property
    def violations(self) -> list[Violation]:
        """Memcheck records, oldest first (a snapshot); ``[]`` means clean."""
        return list(self._violations)

    def clear_violations(self) -> None:
        """Forget the recorded memcheck violations."""
        self._violations.clear()

    @property
    def live_allocations(self) -> list[SimAllocation]:
        """Allocations not yet freed, by address (a snapshot)."""
        return [SimAllocation(a.ptr, a.nbytes) for a in self._live.values()]

    @property
    def live_graphs(self) -> int:
        """Executable graphs instantiated and not yet destroyed."""
        return self._graphs_live

    @property
    def graph_launches(self) -> int:
        """Graph replays executed so far (each runs all its captured commands)."""
        return self._graph_launches

    @property
    def trace(self) -> list[TraceEvent]:
        """Executed commands in execution order (a snapshot; the most recent
        ``trace_limit`` of them)."""
        return list(self._trace)

    def clear_trace(self) -> None:
        """Forget the recorded trace."""
        self._trace.clear()

    def statistics(self) -> SimStatistics:
        """Counters of the device (a snapshot)."""
        return SimStatistics(
            launches=self._launches,
            copies=self._copies,
            fills=self._fills,
            bytes_copied=self._bytes_copied,
            commands_executed=self._executed,
            pending=self._pending,
            live_allocations=len(self._live),
            live_bytes=self._live_bytes,
            violations=len(self._violations),
            kernel_loads=self._kernel_loads,
            kernel_unloads=self._kernel_unloads,
            allocations=self._alloc_count,
            frees=self._free_count,
        )

    def peek(self, ptr: int, nbytes: int) -> bytes:
        """Debug read of device memory, outside any stream order. The range must
        lie in one live allocation (ValueError otherwise); no violation is recorded."""
        alloc = self._find_live(ptr, nbytes)
        if alloc is None:
            raise ValueError(
                f"ptr: expected a range inside one live allocation, got {nbytes} bytes at {ptr:#x}"
            )
        off = ptr - alloc.ptr
        return alloc.buf[off : off + nbytes].tobytes()

    def hold(self) -> None:
        """Stop free-running: from now on work commands execute only through
        :meth:`complete_next` and :meth:`run_until_idle` (bookkeeping still runs)."""
        self._held = True

    def release(self) -> None:
        """Go back to free-running and execute everything runnable (timing allowing)."""
        self._held = False
        self._pump()
        self._wake()  # waiters re-arm: their deadlines may have changed

    def complete_next(self) -> bool:
        """Execute exactly one runnable work command (the oldest by enqueue order
        among the stream heads) and the bookkeeping it unblocks. Ignores timing.
        Returns False if no work command was runnable."""
        self._settle()
        best: SimStream | None = None
        best_seq = 0
        for s in self._busy:
            head = s._queue[0]
            if head.work and (best is None or head.seq < best_seq):
                best, best_seq = s, head.seq
        if best is None:
            return False
        self._exec_work(best, None)
        self._settle()
        if not self._held:
            self._pump()
        self._wake()
        return True

    def run_until_idle(self) -> int:
        """Execute runnable commands until none is runnable (even while held; the
        device stays held). Returns the number of work commands executed."""
        count = 0
        while self.complete_next():
            count += 1
        return count

    def pump(self) -> int:
        """Free-running: execute every command that is runnable and due now.
        Returns the number of commands executed (0 while held, apart from
        bookkeeping)."""
        return self._pump()

    def inject_fault(self, kind: FaultKind, *, count: int = 1) -> None:
        """Make the next ``count`` launches (or allocations) fail.

        * ``"launch_error"``: ``launch()`` raises LaunchError 701
          (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); nothing is enqueued.
        * ``"out_of_memory"``: ``alloc()`` raises OutOfMemoryError.
        * ``"kernel_fault"``: the launch enqueues; at execution it does not run and
          the stream's next marker fails with LaunchError 719
          (CUDA_ERROR_LAUNCH_FAILED). Not sticky: later work runs normally.
        * ``"completion_unknown"``: the launch enqueues; at execution it does not
          run and the stream's next marker polls UNKNOWN forever.

        One launch consumes at most one fault: launch_error first, then
        completion_unknown, then kernel_fault.
        """
        if kind not in _FAULT_KINDS:
            raise ValueError(
                f"kind: expected one of {', '.join(repr(k) for k in _FAULT_KINDS)}, got {kind!r}"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count: expected a positive int, got {count!r}")
        self._faults[kind] = self._faults.get(kind, 0) + count

    # ------------------------------------------------------------------ faults

    def _take_fault(self, kind: str) -> bool:
        n = self._faults.get(kind, 0)
        if n <= 0:
            return False
        if n == 1:
            del self._faults[kind]
        else:
            self._faults[kind] = n - 1
        return True

    # ------------------------------------------------------------------ memory

    def _alloc(self, nbytes: int) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ValueError(f"nbytes: expected a non-negative int, got {nbytes!r}")
        nbytes = int(nbytes)
        if self._take_fault("out_of_memory"):
            raise OutOfMemoryError(
                2,
                "CUDA_ERROR_OUT_OF_MEMORY",
                f"injected out_of_memory (allocating {nbytes} bytes)",
                call="cuMemAllocAsync",
            )
        if self._live_bytes + nbytes > self.memory:
            raise OutOfMemoryError(
                2,
                "CUDA_ERROR_OUT_OF_MEMORY",
                f"{self.name}: cannot allocate {nbytes} bytes; {self._live_bytes} of "
                f"{self.memory} bytes are in use",
                call="cuMemAllocAsync",
            )
        ptr = self._next_ptr
        span = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        self._next_ptr = ptr + span + _RED_ZONE
        alloc = _Alloc(ptr, nbytes, np.zeros(nbytes, dtype=np.uint8) if nbytes else _EMPTY)
        self._bases.append(ptr)
        self._allocs.append(alloc)
        self._live[ptr] = alloc
        self._live_bytes += nbytes
        self._alloc_count += 1
        return ptr

    def _free(self, ptr: int, nbytes: int) -> None:
        alloc = self._live.get(ptr)
        if alloc is None:
            i = bisect_left(self._bases, ptr)
            freed = i < len(self._bases) and self._bases[i] == ptr and self._allocs[i].freed
            self._violations.append(
                Violation("double_free" if freed else "invalid_free", ptr, nbytes, "free", None)
            )
            return
        if nbytes != alloc.nbytes:
            self._violations.append(
                Violation(
                    "invalid_free", ptr, nbytes, f"free (size {nbytes} != allocated {alloc.nbytes})", None
                )
            )
            return
        del self._live[ptr]
        self._live_bytes -= alloc.nbytes
        self._free_count += 1
        alloc.freed = True
        if alloc.nbytes:
            alloc.buf.fill(_POISON)  # stale views see the poison
        alloc.buf = _EMPTY

    def _find_live(self, addr: int, size: int) -> _Alloc | None:
        i = bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        a = self._allocs[i]
        if a.freed or addr + size > a.ptr + a.nbytes:
            return None
        return a

    def _resolve(self, addr: int, size: int, op: str, stream: SimStream) -> _Alloc | None:
        """The live allocation holding ``[addr, addr + size)``, or None after
        recording a violation. A zero-byte range outside every allocation gets an
        empty stand-in."""
        i = bisect_right(self._bases, addr) - 1
        kind: ViolationKind
        if i >= 0:
            a = self._allocs[i]
            end = a.ptr + a.nbytes
            if addr < end or (size == 0 and addr == end):
                if a.freed:
                    kind = "use_after_free"
                elif addr + size > end:
                    kind = "out_of_bounds"
                else:
                    return a
                self._violations.append(Violation(kind, addr, size, op, stream.index))
                return None
        if size == 0:
            return _Alloc(addr, 0, _EMPTY)
        self._violations.append(Violation("unallocated", addr, size, op, stream.index))
        return None

    # ------------------------------------------------------------------ engine

    def _enqueue(self, stream: SimStream, cmd: _Cmd) -> None:
        capture = stream._capture
        if capture is not None:
            if not cmd.work:
                raise GraphCaptureError(
                    f"{cmd.label}: stream {stream.index} is capturing a graph; completion markers, "
                    f"waits and gates cannot be captured"
                )
            capture.append(cmd)  # recorded, not executed
            return
        q = stream._queue
        q.append(cmd)
        self._pending += 1
        if cmd.duration > 0.0:
            self._timed_pending += 1
        if len(q) == 1:
            self._busy[stream] = None
            self._dirty.append(stream)
            self._pump()
            if cmd.duration > 0.0:
                self._wake()  # a new deadline: timed waiters re-arm

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _wake(self) -> None:
        ev = self._event
        if ev is not None:
            self._event = None
            ev.set()

    def _progress_event(self) -> trio.Event:
        ev = self._event
        if ev is None:
            ev = self._event = trio.Event()
        return ev

    def _next_due(self) -> float | None:
        """When the earliest timed work at a stream head is due (free mode only)."""
        if self._held or not self._timed_pending:
            return None
        best: float | None = None
        for s in self._busy:
            head = s._queue[0]
            if head.work:
                due = max(s._clock, head.t_enqueue) + head.duration
                if best is None or due < best:
                    best = due
        return best

    def _pump(self) -> int:
        if self._pumping:
            return 0
        self._pumping = True
        try:
            n = self._settle()
            if not self._held:
                now = perf_counter() if self._timed_pending else math.inf
                while True:
                    best: SimStream | None = None
                    best_key = (math.inf, 0)
                    for s in self._busy:
                        head = s._queue[0]
                        if not head.work:
                            continue
                        due = max(s._clock, head.t_enqueue) + head.duration
                        if head.duration > 0.0 and due > now:
                            continue
                        key = (due, head.seq)
                        if best is None or key < best_key:
                            best, best_key = s, key
                    if best is None:
                        break
                    head = best._queue[0]
                    self._exec_work(best, best_key[0] if head.duration > 0.0 else None)
                    n += 1 + self._settle()
        finally:
            self._pumping = False
        if n:
            self._wake()
        return n

    def _settle(self) -> int:
        """Execute runnable bookkeeping at the heads of the dirty streams."""
        n = 0
        dirty = self._dirty
        busy = self._busy
        while dirty:
            s = dirty.popleft()
            q = s._queue
            while q:
                cmd = q[0]
                kind = cmd.kind
                if kind == "marker":
                    finish = max(s._clock, cmd.t_enqueue)
                    self._exec_marker(s, cmd.data)
                elif kind == "wait_marker":
                    target: SimMarker = cmd.data
                    ts = target.stream
                    if ts._done_seq < target.seq:
                        ts._waiters[s] = None
                        break
                    finish = max(s._clock, cmd.t_enqueue, ts._clock)
                elif kind == "gate":
                    gate: SimGate = cmd.data
                    if not gate.opened:
                        break
                    finish = max(s._clock, cmd.t_enqueue, gate._opened_at)
                else:
                    break
                q.popleft()
                self._pending -= 1
                self._executed += 1
                s._clock = finish
                n += 1
                self._record(s, cmd, finish, finish)
            if not q:
                busy.pop(s, None)
        return n

    def _exec_marker(self, s: SimStream, seq: int) -> None:
        if s._unknown:
            s._results[seq] = Poll(
                MarkerState.UNKNOWN,
                CompletionUnknownError(
                    f"{self.name}: completion of work before marker {seq} on stream {s.index} "
                    f"cannot be established (injected completion_unknown)"
                ),
            )
        elif s._error is not None:
            error = s._error
            if s._extra_errors:
                error.add_note(f"{s._extra_errors} more error(s) on stream {s.index} before this marker")
            s._results[seq] = Poll(MarkerState.FAILED, error)
        s._unknown = False
        s._error = None
        s._extra_errors = 0
        s._done_seq = seq
        if s._waiters:
            if self._host is None:
                self._dirty.extend(s._waiters)
                s._waiters.clear()
            else:  # waiters may be streams of other devices of the host
                from .sim_multi import wake_waiters

                waiters = list(s._waiters)
                s._waiters.clear()
                wake_waiters(self, waiters)

    def _exec_work(self, s: SimStream, due: float | None) -> None:
        """Pop and execute the work command at ``s``'s head. ``due`` is its
        simulated end time (timed free-running), or None to use real time."""
        q = s._queue
        cmd = q.popleft()
        self._pending -= 1
        if cmd.duration > 0.0:
            self._timed_pending -= 1
        if q:
            self._dirty.append(s)
        else:
            del self._busy[s]
        if due is None:
            start = perf_counter()
            self._effect(s, cmd)
            end = perf_counter()
        else:
            start = due - cmd.duration
            self._effect(s, cmd)
            end = due
        s._clock = end
        self._executed += 1
        self._record(s, cmd, start, end)

    def _record(self, s: SimStream, cmd: _Cmd, start: float, end: float) -> None:
        if self.trace_limit != 0:
            self._trace.append(TraceEvent(cmd.seq, s.index, cmd.kind, cmd.label, cmd.t_enqueue, start, end))

    def _effect(self, s: SimStream, cmd: _Cmd) -> None:
        kind = cmd.kind
        if kind == "launch":
            self._launches += 1
            self._run_launch(s, cmd)
        elif kind == "h2d":
            self._copies += 1
            dst = self._resolve(cmd.dst, cmd.nbytes, "h2d destination", s)
            if dst is not None and cmd.nbytes:
                off = cmd.dst - dst.ptr
                dst.buf[off : off + cmd.nbytes] = cmd.data
                self._bytes_copied += cmd.nbytes
        elif kind == "d2h":
            self._copies += 1
            src = self._resolve(cmd.src, cmd.nbytes, "d2h source (host read)", s)
            if src is not None and cmd.nbytes:
                off = cmd.src - src.ptr
                host: np.ndarray[Any, Any] = cmd.data
                host.reshape(-1).view(np.uint8)[:] = src.buf[off : off + cmd.nbytes]
                self._bytes_copied += cmd.nbytes
        elif kind == "d2d":
            self._copies += 1
            src = self._resolve(cmd.src, cmd.nbytes, "d2d source", s)
            dst = self._resolve(cmd.dst, cmd.nbytes, "d2d destination", s)
            if src is not None and dst is not None and cmd.nbytes:
                so = cmd.src - src.ptr
                do = cmd.dst - dst.ptr
                dst.buf[do : do + cmd.nbytes] = src.buf[so : so + cmd.nbytes]
                self._bytes_copied += cmd.nbytes
        elif kind == "fill":
            self._fills += 1
            dst = self._resolve(cmd.dst, cmd.nbytes, "fill destination", s)
            if dst is not None and cmd.nbytes:
                off = cmd.dst - dst.ptr
                pattern: bytes = cmd.data
                unit = np.dtype(f"u{len(pattern)}")
                dst.buf[off : off + cmd.nbytes].view(unit)[:] = np.frombuffer(pattern, dtype=unit)[0]
        elif kind == "graph":
            self._run_graph(s, cmd)
        elif kind == "peer":
            from .sim_multi import run_peer_copy

            run_peer_copy(self, s, cmd)
        else:  # pragma: no cover - enqueue only makes the kinds above
            raise AssertionError(f"unknown command kind {kind!r}")

    def _run_graph(self, s: SimStream, cmd: _Cmd) -> None:
        """One replay: the captured commands, in capture order. Their device
        addresses are resolved now, so memcheck covers every replay."""
        graph_exec: SimGraphExec = cmd.data[0]
        nodes: tuple[_Cmd, ...] = cmd.data[1]
        self._graph_launches += 1
        if graph_exec.destroyed:
            self._violations.append(
                Violation(
                    "use_after_free",
                    graph_exec.handle,
                    0,
                    "graph launch (its executable graph was destroyed)",
                    s.index,
                )
            )
            return
        if cmd.fault == "completion_unknown":
            s._unknown = True
            return
        if cmd.fault == "kernel_fault":
            s._add_error(
                LaunchError(
                    719,
                    "CUDA_ERROR_LAUNCH_FAILED",
                    f"injected kernel_fault in graph {graph_exec.handle:#x}",
                    call="cuGraphLaunch",
                )
            )
            return
        for node in nodes:
            self._effect(s, node)

    def _run_launch(self, s: SimStream, cmd: _Cmd) -> None:
        launch: PreparedLaunch = cmd.data
        kernel = launch.kernel
        fn = cmd.fn
        if fn is not None and fn.unloaded:
            self._violations.append(
                Violation(
                    "use_after_free", fn.handle, 0, f"launch {kernel.name} (its module was unloaded)", s.index
                )
            )
            return
        if cmd.fault == "completion_unknown":
            s._unknown = True
            return
        if cmd.fault == "kernel_fault":
            s._add_error(
                LaunchError(
                    719,
                    "CUDA_ERROR_LAUNCH_FAILED",
                    f"injected kernel_fault in kernel {kernel.name}",
                    call="cuLaunchKernel",
                )
            )
            return
        args = self._kernel_args(s, kernel, launch.arg_views())
        if args is None or kernel.reference is None:
            return
        try:
            kernel.reference(*args)
        except Exception as exc:
            error = LaunchError(
                719, "CUDA_ERROR_LAUNCH_FAILED", f"reference of kernel {kernel.name} raised {exc!r}"
            )
            error.__cause__ = exc
            s._add_error(error)
        except BaseException as exc:
            # KeyboardInterrupt, SystemExit...: the device never raises into
            # whoever happens to pump it; the work fails with the exception
            # itself, so it reaches the waiter (or the scope's exit) as it is.
            s._add_error(exc)

    def _kernel_args(self, s: SimStream, kernel: Kernel, views: Sequence[ArgView]) -> list[object] | None:
        """The reference's arguments, or None if memcheck rejected one."""
        out: list[object] = []
        ok = True
        for i, av in enumerate(views):
            kind = av.kind
            if kind == "scalar" or kind == "raw":
                out.append(av.value)
                continue
            dtype = av.dtype if av.dtype is not None else np.dtype(np.uint8)
            nbytes = av.nbytes
            alloc = self._resolve(av.ptr, nbytes, f"launch {kernel.name} (argument {i})", s)
            if alloc is None:
                ok = False
                continue
            if ok:
                view: np.ndarray[Any, Any]
                if nbytes:
                    view = np.ndarray(
                        av.shape, dtype=dtype, buffer=alloc.buf, offset=av.ptr - alloc.ptr, order=av.order
                    )
                else:
                    view = np.empty(av.shape, dtype=dtype, order=av.order)
                if av.access is Access.READ:
                    view.setflags(write=False)
                out.append(view)
                if kind == "slice":
                    len_dtype = av.len_dtype if av.len_dtype is not None else np.dtype(np.uint64)
                    out.append(len_dtype.type(av.length))
        return out if ok else None


# --------------------------------------------------------------------------- graphs


@final
class SimGraph:
    """A captured command list (what :meth:`SimContext.end_capture` returns)."""

    __slots__ = ("consumed", "context", "nodes")

    def __init__(self, context: SimContext, nodes: tuple[_Cmd, ...]) -> None:
        self.context = context
        self.nodes = nodes
        self.consumed = False

    def __repr__(self) -> str:
        return f"<SimGraph of {len(self.nodes)} commands>"


@final
class SimGraphExec:
    """An executable graph: its command list and a unique fake handle. A launch
    of it that executes after :meth:`SimContext.destroy_graph` is a
    ``use_after_free`` violation at that handle."""

    __slots__ = ("context", "destroyed", "handle", "nodes")

    def __init__(self, context: SimContext, nodes: tuple[_Cmd, ...], handle: int) -> None:
        self.context = context
        self.nodes = nodes
        self.handle = handle
        self.destroyed = False

    def __repr__(self) -> str:
        state = " destroyed" if self.destroyed else ""
        return f"<SimGraphExec {self.handle:#x} of {len(self.nodes)} commands{state}>"


# --------------------------------------------------------------------------- context


@final
class SimContext:
    """One scope's view of a :class:`SimDevice` (the DeviceContext protocol).
    Commands from every context of a device share the device's engine."""

    __slots__ = ("_capturing", "_closed", "_device", "_streams", "info")

    info: DeviceInfo

    def __init__(self, device: SimDevice) -> None:
        self._device = device
        self.info = device._info
        self._streams: dict[SimStream, None] = {}
        self._closed = False
        self._capturing: SimStream | None = None

    @property
    def device(self) -> SimDevice:
        return self._device

    @property
    def capabilities(self) -> Capabilities:
        dev = self._device
        return Capabilities(batch_markers=dev.batch_markers, await_spin=dev.await_spin)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._streams)} streams"
        return f"<SimContext on {self._device.name!r} {state}>"

    # ------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._closed:
            raise ScopeClosedError(f"{self._device.name}: this simulator context is closed")

    def _stream(self, stream: StreamHandle) -> SimStream:
        if not isinstance(stream, SimStream):
            raise TypeError(f"stream: expected a SimStream, got {type(stream).__name__}")
        if stream._context is not self:
            raise ValueError(f"stream: {stream!r} belongs to another simulator context")
        if stream._destroyed:
            raise ScopeClosedError(f"stream {stream.index} was destroyed")
        if self._closed:
            raise ScopeClosedError(f"{self._device.name}: this simulator context is closed")
        return stream

    def _marker(self, marker: Marker) -> SimMarker:
        if not isinstance(marker, SimMarker):
            raise TypeError(f"marker: expected a SimMarker, got {type(marker).__name__}")
        dev = marker.stream._context._device
        if dev is not self._device and (dev._host is None or dev._host is not self._device._host):
            raise ValueError(
                f"marker: {marker!r} was recorded on another simulated device, not of this one's SimHost"
            )
        return marker

    # ------------------------------------------------------------------ streams

    def create_stream(self, index: int) -> SimStream:
        self._check_open()
        stream = SimStream(index, self)
        self._streams[stream] = None
        return stream

    def destroy_stream(self, stream: StreamHandle) -> None:
        s = self._stream(stream)
        if s._queue:
            raise RuntimeError(
                f"destroy_stream: stream {s.index} still has {len(s._queue)} queued command(s); "
                f"destroying it would lose them"
            )
        s._destroyed = True
        del self._streams[s]

    # ------------------------------------------------------------------ memory

    def alloc(self, nbytes: int, stream: StreamHandle) -> int:
        self._stream(stream)
        if self._capturing is not None:
            raise GraphCaptureError(
                f"allocating {nbytes} bytes while stream {self._capturing.index} captures a graph "
                f"(allocate before capturing)"
            )
        return self._device._alloc(nbytes)

    def free(self, ptr: int, nbytes: int) -> None:
        self._device._free(ptr, nbytes)

    def copy_h2d(self, stream: StreamHandle, dst: int, src: np.ndarray[Any, Any]) -> object | None:
        s = self._stream(stream)
        dev = self._device
        staged = np.frombuffer(np.ascontiguousarray(src).tobytes(), dtype=np.uint8)
        n = staged.nbytes
        dev._enqueue(s, _Cmd("h2d", dev._next_seq(), f"h2d {n} B", dev.copy_time, staged, dst=dst, nbytes=n))
        return None

    def copy_d2h(
        self, stream: StreamHandle, dst: np.ndarray[Any, Any], src: int, *, direct: bool = False
    ) -> Finisher | None:
        s = self._stream(stream)
        if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise ValueError(f"dst: expected a writeable C-contiguous numpy array, got {type(dst).__name__}")
        if direct and s._capture is not None:
            raise GraphCaptureError(
                f"a synchronising device-to-host copy on stream {s.index} while it captures a graph"
            )
        dev = self._device
        n = dst.nbytes
        dev._enqueue(s, _Cmd("d2h", dev._next_seq(), f"d2h {n} B", dev.copy_time, dst, src=src, nbytes=n))
        return None

    def copy_d2d(self, stream: StreamHandle, dst: int, src: int, nbytes: int) -> None:
        s = self._stream(stream)
        if nbytes < 0:
            raise ValueError(f"nbytes: expected a non-negative int, got {nbytes!r}")
        dev = self._device
        dev._enqueue(
            s, _Cmd("d2d", dev._next_seq(), f"d2d {nbytes} B", dev.copy_time, dst=dst, src=src, nbytes=nbytes)
        )

    def copy_peer(
        self,
        stream: StreamHandle,
        dst: int,
        dst_context: object,
        src: int,
        src_context: object,
        nbytes: int,
    ) -> object | None:
        """Enqueue on ``stream`` a copy of ``nbytes`` from ``src`` (memory of
        ``src_context``'s device) to ``dst`` (``dst_context``'s device): a
        ``d2d`` on one device, else a peer copy between devices of one
        :class:`~trio_cuda.testing.SimHost` (see ``sim_multi``)."""
        from .sim_multi import copy_peer

        return copy_peer(self, self._stream(stream), dst, dst_context, src, src_context, nbytes)

    def check_copy_peer(self, dst_context: object, src_context: object) -> None:
        """Raise ``ValueError`` unless :meth:`copy_peer` can copy between the
        devices of these contexts (one device, or devices of one SimHost).
        Enqueues nothing."""
        from .sim_multi import check_copy_peer

        check_copy_peer(self, dst_context, src_context)

    def fill(self, stream: StreamHandle, dst: int, pattern: bytes, count: int) -> None:
        s = self._stream(stream)
        pattern = bytes(pattern)
        if len(pattern) not in (1, 2, 4, 8):
            raise ValueError(f"pattern: expected 1, 2, 4 or 8 bytes, got {len(pattern)}")
        if count < 0:
            raise ValueError(f"count: expected a non-negative int, got {count!r}")
        dev = self._device
        n = len(pattern) * count
        dev._enqueue(
            s, _Cmd("fill", dev._next_seq(), f"fill {n} B", dev.copy_time, pattern, dst=dst, nbytes=n)
        )

    # ------------------------------------------------------------------ kernels

    def load_kernel(self, kernel: Kernel) -> SimFunction:
        self._check_open()
        dev = self._device
        dev._kernel_loads += 1
        return SimFunction(kernel, self, _MODULE_BASE + dev._kernel_loads * _ALIGN)

    def unload_kernel(self, function: object) -> None:
        """Unload a module from :meth:`load_kernel`. A launch of it that executes
        later is a ``use_after_free`` violation; unloading twice a ``double_free``."""
        if not isinstance(function, SimFunction):
            raise TypeError(
                f"function: expected a SimFunction from load_kernel, got {type(function).__name__}"
            )
        dev = self._device
        if function.unloaded:
            dev._violations.append(Violation("double_free", function.handle, 0, "unload_kernel", None))
            return
        function.unloaded = True
        dev._kernel_unloads += 1

    def check_launch(self, function: object, launch: PreparedLaunch) -> None:
        """The simulator's share of the up-front launch checks: a cooperative
        grid must be co-resident under the occupancy model of
        ``modeled_blocks_per_sm`` (the device's per-SM thread, block and shared
        memory limits; registers and static shared memory are not modelled).
        Raises ``KernelArgumentError``; enqueues nothing."""
        if not isinstance(function, SimFunction):
            raise TypeError(
                f"function: expected a SimFunction from load_kernel, got {type(function).__name__}"
            )
        c = launch.config
        if c.cooperative:
            info = self.info
            check_cooperative_occupancy(launch, info, modeled_blocks_per_sm(info, c.block, c.shared_mem))

    def launch(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> None:
        s = self._stream(stream)
        if not isinstance(function, SimFunction):
            raise TypeError(
                f"function: expected a SimFunction from load_kernel, got {type(function).__name__}"
            )
        kernel = launch.kernel
        if function.context is not self or function.kernel is not kernel or function.unloaded:
            raise CudaError(
                400,
                "CUDA_ERROR_INVALID_HANDLE",
                f"{function!r} is not loaded in this context for kernel {kernel.name}",
                call="cuLaunchKernel",
            )
        info = self.info
        config = launch.config
        bx, by, bz = config.block
        if (
            bx * by * bz > info.max_threads_per_block
            or config.shared_mem > info.max_shared_memory_per_block_optin
        ):
            raise LaunchError(
                1,
                "CUDA_ERROR_INVALID_VALUE",
                f"kernel {kernel.name}: block {config.block} / shared_mem {config.shared_mem} exceeds "
                f"{info.max_threads_per_block} threads / {info.max_shared_memory_per_block_optin} bytes",
                call="cuLaunchKernel",
            )
        dev = self._device
        fault: str | None = None
        if dev._faults and s._capture is None:  # a capture runs nothing: faults wait for a replay
            if dev._take_fault("launch_error"):
                raise LaunchError(
                    701,
                    "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
                    f"injected launch_error (kernel {kernel.name})",
                    call="cuLaunchKernel",
                )
            if dev._take_fault("completion_unknown"):
                fault = "completion_unknown"
            elif dev._take_fault("kernel_fault"):
                fault = "kernel_fault"
        dev._enqueue(
            s, _Cmd("launch", dev._next_seq(), kernel.name, dev.kernel_time, launch, fault=fault, fn=function)
        )

    # ------------------------------------------------------------------ ordering

    def record_marker(self, stream: StreamHandle) -> SimMarker:
        s = self._stream(stream)
        dev = self._device
        s._marker_seq += 1
        seq = s._marker_seq
        marker = SimMarker(s, seq)
        dev._enqueue(s, _Cmd("marker", dev._next_seq(), f"marker {seq}", 0.0, seq))
        return marker

    def poll_marker(self, marker: Marker) -> Poll:
        m = self._marker(marker)
        dev = self._device
        if dev._timed_pending and not dev._held:
            dev._pump()
        s = m.stream
        if m.seq > s._done_seq:
            return PENDING
        if s._results:
            return s._results.get(m.seq, DONE)
        return DONE

    def wait_marker(self, stream: StreamHandle, marker: Marker) -> None:
        s = self._stream(stream)
        m = self._marker(marker)
        dev = self._device
        label = f"wait stream {m.stream.index} marker {m.seq}"
        dev._enqueue(s, _Cmd("wait_marker", dev._next_seq(), label, 0.0, m))

    def create_gate(self, stream: StreamHandle) -> SimGate:
        s = self._stream(stream)
        dev = self._device
        gate = SimGate(s)
        dev._enqueue(s, _Cmd("gate", dev._next_seq(), "gate", 0.0, gate))
        return gate

    def open_gate(self, gate: Gate) -> None:
        if not isinstance(gate, SimGate):
            raise TypeError(f"gate: expected a SimGate, got {type(gate).__name__}")
        dev = self._device
        if gate.stream._context._device is not dev:
            raise ValueError(f"gate: {gate!r} was created on another simulated device")
        if gate.opened:
            return
        gate.opened = True
        gate._opened_at = perf_counter()
        dev._dirty.append(gate.stream)
        dev._pump()

    async def wait_for_progress(self, pending: Sequence[Marker]) -> None:
        dev = self._device
        if dev._timed_pending and not dev._held and dev._pump():
            await trio.lowlevel.checkpoint()
            return
        event = dev._progress_event()
        due = dev._next_due()
        if due is None:
            await event.wait()
            return
        with trio.move_on_after(max(0.0, due - perf_counter())):
            await event.wait()
        dev._pump()

    def notify_submitted(self) -> None:
        """Nothing to do: enqueueing already wakes timed waiters."""

    # ------------------------------------------------------------------ interop
    # Foreign streams are streams of any context of the same SimDevice, named by
    # the fake address stream_address() gives them (as a CUstream would be).

    # foreign_fence(None) never blocks here: it is device-side (markers).

    def stream_address(self, stream: StreamHandle) -> int:
        """A fake handle naming ``stream`` to consumers (``__dlpack__(stream=)``)."""
        s = self._stream(stream)
        dev = self._device
        addr = dev._stream_addrs.get(s)
        if addr is None:
            addr = _STREAM_ADDRESS_BASE + 64 * (len(dev._stream_addrs) + 1)
            dev._stream_addrs[s] = addr
            dev._addr_streams[addr] = s
        return addr

    def _foreign_stream(self, address: object) -> SimStream:
        s = self._device._addr_streams.get(address) if isinstance(address, int) else None
        if s is None or s._destroyed:
            raise ValueError(
                f"stream: expected the address of a live stream of simulated device "
                f"{self._device.name!r} (from stream_address()), got {address!r}"
            )
        return s

    def check_foreign_stream(self, address: int) -> None:
        """Raise ``ValueError`` unless ``address`` names a live stream of this device."""
        self._foreign_stream(address)

    def _mark(self, s: SimStream) -> SimMarker:
        dev = self._device
        s._marker_seq += 1
        marker = SimMarker(s, s._marker_seq)
        dev._enqueue(s, _Cmd("marker", dev._next_seq(), f"marker {marker.seq}", 0.0, marker.seq))
        return marker

    def foreign_wait(self, foreign: int, stream: StreamHandle) -> None:
        """Make the foreign stream wait, device-side, for the work enqueued so
        far on ``stream``."""
        s = self._stream(stream)
        fs = self._foreign_stream(foreign)
        marker = self._mark(s)
        dev = self._device
        label = f"wait stream {s.index} marker {marker.seq}"
        dev._enqueue(fs, _Cmd("wait_marker", dev._next_seq(), label, 0.0, marker))

    def foreign_fence(self, foreign: int | None) -> tuple[SimMarker, ...]:
        """A point after the work enqueued so far on the foreign stream, or,
        for None, on every stream of the device (any context)."""
        self._check_open()
        if foreign is None:
            streams = list(self._device._busy)
        else:
            fs = self._device._addr_streams.get(foreign)
            if fs is not None and fs._destroyed:
                return ()  # a destroyed stream had no queued work left
            streams = [self._foreign_stream(foreign)]
        return tuple(self._mark(fs) for fs in streams if not fs._destroyed)

    def wait_fence(self, stream: StreamHandle, fence: object) -> None:
        """Make ``stream`` wait, device-side, for a fence of :meth:`foreign_fence`."""
        s = self._stream(stream)
        if not isinstance(fence, tuple):
            raise TypeError(f"fence: expected what foreign_fence() returned, got {type(fence).__name__}")
        dev = self._device
        for m in fence:
            label = f"wait stream {m.stream.index} marker {m.seq}"
            dev._enqueue(s, _Cmd("wait_marker", dev._next_seq(), label, 0.0, m))

    def drop_fence(self, fence: object) -> None:
        """Nothing to free on the simulator."""

    def dlpack_device(self) -> tuple[int, int]:
        """``(kDLExtDev, n)``: simulated memory is no real device's; only
        ``trio_cuda.borrow`` on the same SimDevice accepts it."""
        return (DLPACK_SIM_DEVICE, self._device._dl_id)

    def pointer_device(self, ptr: int, nbytes: int) -> str | None:
        """None if ``[ptr, ptr + nbytes)`` is live memory of this device, else
        what it is instead."""
        dev = self._device
        if nbytes == 0 or dev._find_live(ptr, nbytes) is not None:
            return None
        return f"no live allocation of simulated device {dev.name!r} holds {nbytes} bytes at {ptr:#x}"

    # ------------------------------------------------------------------ graphs

    def begin_capture(self, stream: StreamHandle) -> None:
        """Record the work commands enqueued on ``stream`` instead of running
        them. Until the capture ends, ``alloc`` raises GraphCaptureError, and so
        do markers, waits, gates and synchronising copies on the stream.
        Faults injected with ``inject_fault`` are not consumed by a capture:
        they hit the next replay."""
        s = self._stream(stream)
        if self._capturing is not None:
            raise GraphCaptureError(
                f"begin_capture: stream {self._capturing.index} of this context is already capturing"
            )
        s._capture = []
        self._capturing = s

    def _end(self, stream: StreamHandle) -> list[_Cmd]:
        s = self._stream(stream)
        if s._capture is None:
            raise GraphCaptureError(f"end_capture: stream {s.index} is not capturing")
        nodes = s._capture
        s._capture = None
        self._capturing = None
        return nodes

    def end_capture(self, stream: StreamHandle) -> SimGraph:
        return SimGraph(self, tuple(self._end(stream)))

    def abort_capture(self, stream: StreamHandle) -> None:
        s = self._stream(stream)
        if s._capture is not None:
            self._end(s)

    def instantiate(self, graph: object) -> SimGraphExec:
        g = self._graph(graph)
        g.consumed = True
        dev = self._device
        dev._graphs_made += 1
        dev._graphs_live += 1
        return SimGraphExec(self, g.nodes, _GRAPH_BASE + dev._graphs_made * _ALIGN)

    def graph_launch(self, stream: StreamHandle, graph_exec: object) -> None:
        s = self._stream(stream)
        ge = self._exec(graph_exec)
        dev = self._device
        fault: str | None = None
        if dev._faults and s._capture is None:
            if dev._take_fault("launch_error"):
                raise LaunchError(
                    701,
                    "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
                    f"injected launch_error (graph {ge.handle:#x})",
                    call="cuGraphLaunch",
                )
            if dev._take_fault("completion_unknown"):
                fault = "completion_unknown"
            elif dev._take_fault("kernel_fault"):
                fault = "kernel_fault"
        nodes = ge.nodes  # a snapshot: graph_update only affects later launches
        duration = sum(n.duration for n in nodes)
        label = f"graph {ge.handle:#x} ({len(nodes)} commands)"
        dev._enqueue(s, _Cmd("graph", dev._next_seq(), label, duration, (ge, nodes), fault=fault))

    def graph_update(self, graph_exec: object, graph: object) -> None:
        """Take the parameters of ``graph``: it must have the same topology (the
        same command kinds in the same order, fills of the same element size)."""
        ge = self._exec(graph_exec)
        g = self._graph(graph)
        g.consumed = True
        old, new = ge.nodes, g.nodes
        if len(old) != len(new):
            raise GraphCaptureError(
                f"graph_update: the topology changed: {len(old)} commands were captured, the update has "
                f"{len(new)}"
            )
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            if a.kind != b.kind or (a.kind == "fill" and len(a.data) != len(b.data)):
                raise GraphCaptureError(
                    f"graph_update: the topology changed: command {i} was {a.label!r}, the update has "
                    f"{b.label!r}"
                )
        ge.nodes = new

    def destroy_graph(self, graph_exec: object) -> None:
        """Destroy an executable graph. A launch of it that still executes later
        is a ``use_after_free``; destroying it twice a ``double_free``."""
        ge = self._exec(graph_exec, destroyed_ok=True)
        dev = self._device
        if ge.destroyed:
            dev._violations.append(Violation("double_free", ge.handle, 0, "destroy_graph", None))
            return
        ge.destroyed = True
        ge.nodes = ()  # drop the captured launches (and the arrays they name)
        dev._graphs_live -= 1

    def _graph(self, graph: object) -> SimGraph:
        if not isinstance(graph, SimGraph) or graph.context is not self:
            raise TypeError(f"graph: expected a SimGraph of this context from end_capture, got {graph!r}")
        if graph.consumed:
            raise ValueError(f"graph: {graph!r} was already instantiated or used for an update")
        return graph

    def _exec(self, graph_exec: object, *, destroyed_ok: bool = False) -> SimGraphExec:
        if not isinstance(graph_exec, SimGraphExec) or graph_exec.context is not self:
            raise TypeError(
                f"graph_exec: expected a SimGraphExec of this context from instantiate, got {graph_exec!r}"
            )
        if graph_exec.destroyed and not destroyed_ok:
            raise CudaError(
                400, "CUDA_ERROR_INVALID_HANDLE", f"{graph_exec!r} was destroyed", call="cuGraphLaunch"
            )
        return graph_exec

    def close(self) -> None:
        """Close the context. Streams with queued commands stay in the device's
        engine and still execute; their memory is never touched here."""
        if self._closed:
            return
        self._closed = True
        for s in self._streams:
            if not s._queue:
                s._destroyed = True
        self._streams.clear()


if TYPE_CHECKING:

    def _implements_protocol(ctx: SimContext) -> DeviceContext:
        return ctx
