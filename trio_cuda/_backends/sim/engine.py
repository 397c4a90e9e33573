"""The simulated device's engine: its memory and memcheck, and the command queue
that executes work.

Invariants:

* Addresses come from a bump allocator (256-byte aligned, with a 256-byte red
  zone between allocations) and are never reused, so every use after free is
  detectable. ``_free`` poisons the bytes (``0xDB``) and drops the buffer.
* Memcheck: device addresses are resolved when a command *executes*, not when
  it is enqueued. A command that touches bytes outside one live allocation is
  recorded as a :class:`~.records.Violation` and its effect is skipped (the
  reference kernel does not run). It still counts as executed and is not an
  error on the stream. A zero-byte access touches nothing; it is a violation
  only when its address lies in a freed allocation.
* A reference gets its arrays as bounds-checked views (``views``): its first
  access past an argument's extent (or a derived view's) is an
  ``out_of_bounds`` violation, recorded as the ones above are, at the first
  element past the extent. It stops the reference and fails the launch with
  CUDA_ERROR_ILLEGAL_ADDRESS (700), as a GPU faults on one. Unlike the ranges
  above, it is found while the reference runs, after what it already wrote.
* Streams are FIFO. Bookkeeping commands (markers, satisfied waits, opened
  gates) at a stream head execute at once, even while held (``settle``). Work
  commands (launches, copies, fills, graph replays, peer copies) execute on
  enqueue when free-running, when due if ``kernel_time`` or ``copy_time`` is
  positive, and only through ``complete_next`` / ``run_until_idle`` while
  held. ``pump`` is not re-entrant.
* Every time (enqueue, due, start, end) is read from the device's
  :class:`~.clock.SimClock` (``_time``), and waiters wait for due work on
  the same clock (``SimContext.wait_for_progress``): under a Trio
  ``MockClock`` timed work takes virtual time, never wall-clock time.
* On a capturing stream, work commands are recorded instead of enqueued; any
  other command raises ``GraphCaptureError`` (``_common.not_capturable``,
  raised by the stream's ``capture``).
* Errors (an injected ``kernel_fault``, a reference that raises or accesses
  out of bounds) attach to the stream's next marker, which then polls
  ``FAILED``; they are not sticky. A reference's exception is the error's
  ``__cause__``, and its message names the kernel and what was raised (the
  expected arguments of a wrong arity, the read-only argument written). An
  injected ``completion_unknown`` skips its launch and makes the stream's next
  marker poll ``UNKNOWN`` forever. The stream gathers them (``add_error``,
  ``mark_unknown``) and its marker takes them (``complete_marker``). The
  engine never raises into whoever pumps it.
* One owner per piece of state. :class:`SimEngine` owns the device-wide
  mutable state: memory and memcheck, faults, the clock, which streams are
  busy or ready to run, what is pending, the trace and the counters. Each
  :class:`~.handles.SimStream` owns its queue, markers, errors, waiters,
  clock and capture, and a :class:`~.handles.SimGate` its opening; the
  engine schedules and executes through their internal interface (see
  ``handles``). A :class:`~.host.SimHost` owns its cross-device counters and
  its kick loop: a marker's waiters on a host go to ``SimHost.wake_waiters``,
  and a peer copy, which the engine executes, is counted by
  ``SimHost.count_peer_copy``.
* The public :class:`~.device.SimDevice` holds its engine as a field and
  keeps only its settings, which the engine reads through ``device`` (so a
  setting changed on the device takes effect as before). Nothing outside
  this module touches the engine's underscored fields: the contexts, handles
  and host use its internal interface, the methods without a leading
  underscore: memory (``alloc``, ``free``, ``find_live``, ``resolve``),
  commands (``next_seq``, ``enqueue``, ``launch_fault``, ``open_gate``,
  ``mark_ready``), running (``pump``, ``pump_due``, ``settle``,
  ``progress_event``, ``next_due``, ``deadline``, ``busy_streams``), records
  and counters (``record_violation``, ``kernel_loaded``, ``graph_made``, ...)
  and a host's ``is_fresh``, ``clock`` and ``join_host``; ``info``, ``dl_id``
  and ``host`` are plain attributes, set once (``host`` and ``info`` by
  ``join_host``). The other modules import only plain names from here:
  :class:`Command` (what a context builds and enqueues), ``ALIGN`` (the
  allocation alignment, which fake handles are spaced by) and the engine.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio

from ..._core._driver import DeviceInfo
from ..._core._errors import LaunchError, OutOfMemoryError
from ..._core._kernel import NO_REFERENCE
from ..._core._ops import Access
from .. import _common
from .clock import SimClock
from .launch_errors import describer, illegal_address, launch_failed, reference_failed, tile_failed
from .records import SimAllocation, SimCommandRecord, SimStatistics, Violation, ViolationKind
from .views import LaunchCheck, OutOfBounds, bounded

if TYPE_CHECKING:
    from ..._core._kernel import Kernel
    from ..._core._launch import ArgView, PreparedLaunch
    from .device import SimDevice
    from .handles import SimFunction, SimGate, SimGraphExec, SimMarker, SimStream
    from .host import SimHost

__all__ = ["ALIGN", "Command", "SimEngine"]

#: allocation alignment; fake module and graph handles are spaced by it too
ALIGN = 256
_RED_ZONE = 256
_POISON = 0xDB
_EMPTY = np.empty(0, dtype=np.uint8)
_EMPTY.setflags(write=False)
_WORK_KINDS = frozenset({"launch", "h2d", "d2h", "d2d", "fill", "graph", "peer"})


def _out_of_memory(text: str) -> OutOfMemoryError:
    return OutOfMemoryError(2, "CUDA_ERROR_OUT_OF_MEMORY", text, call="cuMemAllocAsync")


class _Alloc:
    __slots__ = ("buf", "freed", "nbytes", "ptr")

    def __init__(self, ptr: int, nbytes: int, buf: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.buf = buf
        self.freed = False


class Command:
    """One queued command. ``data`` is the kind's payload: the staged bytes (h2d),
    the host array (d2h), the pattern (fill), the PreparedLaunch (launch), the
    marker sequence number (marker), the SimMarker (wait_marker) or the SimGate.
    ``t_enqueue`` is set by ``SimEngine.enqueue``, on the device clock."""

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
        self.t_enqueue = 0.0
        self.duration = duration
        self.data = data
        self.dst = dst
        self.src = src
        self.nbytes = nbytes
        self.fault = fault
        self.fn = fn
        self.work = kind in _WORK_KINDS


class SimEngine:
    """Memory, memcheck, faults and the command engine of one
    :class:`~.device.SimDevice`, which holds it as a field. It owns the
    device-wide mutable state (each stream owns its own); the device's
    settings it reads from ``device`` (they stay the public attributes users
    set). The simulator's
    contexts, handles and host use it through the methods without a leading
    underscore (see the module invariants)."""

    __slots__ = (
        "_addr_streams",
        "_alloc_count",
        "_allocs",
        "_bases",
        "_busy",
        "_bytes_copied",
        "_copies",
        "_dirty",
        "_event",
        "_executed",
        "_faults",
        "_fills",
        "_free_count",
        "_graph_launches",
        "_graph_lock",
        "_graph_uploads",
        "_graphs_live",
        "_graphs_made",
        "_held",
        "_kernel_loads",
        "_kernel_unloads",
        "_launches",
        "_live",
        "_live_bytes",
        "_next_ptr",
        "_pending",
        "_pumping",
        "_seq",
        "_stream_addrs",
        "_time",
        "_timed_pending",
        "_trace",
        "_violations",
        "device",
        "dl_id",
        "host",
        "info",
    )

    def __init__(self, device: SimDevice, info: DeviceInfo, dl_id: int, base_address: int) -> None:
        #: the SimDevice whose settings (name, memory, times, trace_limit) the engine reads
        self.device = device
        #: static facts (``DeviceInfo``); a SimHost renumbers its ordinal (``join_host``)
        self.info = info
        #: this device's DLPack device id
        self.dl_id = dl_id
        #: the SimHost the device belongs to (see ``host``), or None; set by ``join_host``
        self.host: SimHost | None = None
        self._held = False
        #: the device clock every time comes from (see ``clock``); a SimHost's
        #: devices share one
        self._time = SimClock()
        self._next_ptr = base_address
        self._bases: list[int] = []
        self._allocs: list[_Alloc] = []
        self._live: dict[int, _Alloc] = {}
        self._live_bytes = 0
        self._violations: list[Violation] = []
        self._trace: deque[SimCommandRecord] = deque(maxlen=device.trace_limit)
        self._faults: dict[str, int] = {}
        self._seq = 0
        self._busy: dict[SimStream, None] = {}
        self._dirty: deque[SimStream] = deque()
        self._pending = 0
        self._timed_pending = 0
        self._event: trio.Event | None = None
        self._pumping = False
        self._launches = 0
        self._copies = 0
        self._fills = 0
        self._bytes_copied = 0
        self._executed = 0
        self._kernel_loads = 0
        self._kernel_unloads = 0
        self._alloc_count = 0
        self._free_count = 0
        #: interop: fake stream addresses
        self._stream_addrs: dict[SimStream, int] = {}
        self._addr_streams: dict[int, SimStream] = {}
        self._graphs_made = 0
        self._graphs_live = 0
        self._graph_launches = 0
        self._graph_uploads = 0
        #: the graph counters, which a worker thread changes too (``graph_host_time``)
        self._graph_lock = threading.Lock()

    # ------------------------------------------------------------------ test controls and snapshots

    @property
    def held(self) -> bool:
        return self._held

    @property
    def pending(self) -> int:
        return self._pending

    def hold(self) -> None:
        self._held = True

    def release(self) -> None:
        self._held = False
        self.pump()
        self._wake()  # waiters re-arm: their deadlines may have changed

    def complete_next(self) -> bool:
        """Execute the oldest runnable work command (see ``SimDevice.complete_next``)."""
        self.settle()
        best: SimStream | None = None
        best_seq = 0
        for s in self._busy:
            head = s.head()
            if head.work and (best is None or head.seq < best_seq):
                best, best_seq = s, head.seq
        if best is None:
            return False
        self._exec_work(best, None)
        self.settle()
        if not self._held:
            self.pump()
        self._wake()
        return True

    def add_fault(self, kind: str, count: int) -> None:
        self._faults[kind] = self._faults.get(kind, 0) + count

    def violations(self) -> list[Violation]:
        return list(self._violations)

    def clear_violations(self) -> None:
        self._violations.clear()

    def record_violation(self, violation: Violation) -> None:
        self._violations.append(violation)

    def live_allocations(self) -> list[SimAllocation]:
        return [SimAllocation(a.ptr, a.nbytes) for a in self._live.values()]

    def graph_counts(self) -> tuple[int, int, int]:
        """Executable graphs live, graph replays executed, graphs uploaded."""
        return self._graphs_live, self._graph_launches, self._graph_uploads

    def trace(self) -> deque[SimCommandRecord]:
        """The recorded commands (the live deque: callers copy or iterate)."""
        return self._trace

    def last_seq(self) -> int:
        """The sequence number of the last command made (0: none yet)."""
        return self._seq

    def statistics(self) -> SimStatistics:
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
        alloc = self.find_live(ptr, nbytes)
        if alloc is None:
            raise ValueError(
                f"ptr: expected a range inside one live allocation, got {nbytes} bytes at {ptr:#x}"
            )
        off = ptr - alloc.ptr
        return alloc.buf[off : off + nbytes].tobytes()

    # ------------------------------------------------------------------ the contexts' interface

    def kernel_loaded(self) -> int:
        """Count a module load; returns the loads so far (the handle's index)."""
        self._kernel_loads += 1
        return self._kernel_loads

    def kernel_unloaded(self) -> None:
        self._kernel_unloads += 1

    def graph_made(self) -> int:
        """Count an executable graph (any thread); returns its index."""
        with self._graph_lock:
            self._graphs_made += 1
            self._graphs_live += 1
            return self._graphs_made

    def graph_uploaded(self, graph_exec: SimGraphExec) -> None:
        """Count an upload of ``graph_exec`` (any thread)."""
        with self._graph_lock:
            graph_exec.uploads += 1
            self._graph_uploads += 1

    def graph_destroyed(self) -> None:
        with self._graph_lock:
            self._graphs_live -= 1

    def stream_address(self, s: SimStream, base: int) -> int:
        """The fake address of ``s`` for interop (made on first use, from ``base``)."""
        addr = self._stream_addrs.get(s)
        if addr is None:
            addr = base + 64 * (len(self._stream_addrs) + 1)
            self._stream_addrs[s] = addr
            self._addr_streams[addr] = s
        return addr

    def stream_at(self, address: int) -> SimStream | None:
        return self._addr_streams.get(address)

    def busy_streams(self) -> list[SimStream]:
        """Streams with commands queued, in the order they became busy."""
        return list(self._busy)

    def pump_due(self) -> int:
        """Free-running with timed work pending: execute what is due now."""
        if self._timed_pending and not self._held:
            return self.pump()
        return 0

    def open_gate(self, gate: SimGate) -> None:
        """Open ``gate`` now; its stream's head may run."""
        gate.open(self._time.now())
        self._dirty.append(gate.stream)
        self.pump()

    def deadline(self, due: float) -> float:
        """``due`` (device clock) as a Trio deadline."""
        return self._time.deadline(due)

    def mark_ready(self, stream: SimStream) -> None:
        """``stream``'s head may run now (a wait it queued on was satisfied)."""
        self._dirty.append(stream)

    def is_fresh(self) -> bool:
        """Nothing was ever allocated and nothing is enqueued."""
        return not (self._alloc_count or self._pending)

    def join_host(self, host: SimHost, clock: SimClock, base_address: int, ordinal: int) -> None:
        """Become device ``ordinal`` of ``host``: its shared clock, its address range."""
        self.host = host
        self._time = clock
        self._next_ptr = base_address
        self.info = attrs.evolve(self.info, ordinal=ordinal)

    def clock(self) -> SimClock:
        return self._time

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

    def launch_fault(self, what: str, name: str, call: str) -> str | None:
        """The fault that a launch (or graph replay) of ``what`` ``name`` takes as
        it is enqueued: an injected ``launch_error`` raises (nothing is enqueued);
        else "completion_unknown", "kernel_fault" or None (at once when no
        fault is injected: the launch path's only cost here)."""
        if not self._faults:
            return None
        if self._take_fault("launch_error"):
            raise LaunchError(
                701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", f"injected launch_error ({what} {name})", call=call
            )
        if self._take_fault("completion_unknown"):
            return "completion_unknown"
        if self._take_fault("kernel_fault"):
            return "kernel_fault"
        return None

    # ------------------------------------------------------------------ memory

    def alloc(self, nbytes: int) -> int:
        nbytes = _common.check_count("nbytes", nbytes)
        if self._take_fault("out_of_memory"):
            raise _out_of_memory(f"injected out_of_memory (allocating {nbytes} bytes)")
        if self._live_bytes + nbytes > self.device.memory:
            raise _out_of_memory(
                f"{self.device.name}: cannot allocate {nbytes} bytes; {self._live_bytes} of "
                f"{self.device.memory} bytes are in use"
            )
        ptr = self._next_ptr
        span = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self._next_ptr = ptr + span + _RED_ZONE
        alloc = _Alloc(ptr, nbytes, np.zeros(nbytes, dtype=np.uint8) if nbytes else _EMPTY)
        self._bases.append(ptr)
        self._allocs.append(alloc)
        self._live[ptr] = alloc
        self._live_bytes += nbytes
        self._alloc_count += 1
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
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

    def find_live(self, addr: int, size: int) -> _Alloc | None:
        i = bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        a = self._allocs[i]
        if a.freed or addr + size > a.ptr + a.nbytes:
            return None
        return a

    def resolve(self, addr: int, size: int, op: str, stream: SimStream) -> _Alloc | None:
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

    def enqueue(self, stream: SimStream, cmd: Command) -> None:
        cmd.t_enqueue = self._time.now()
        if stream.capturing:
            stream.capture(cmd)  # recorded, not executed (or refused)
            return
        became_busy = stream.push(cmd)
        self._pending += 1
        if cmd.duration > 0.0:
            self._timed_pending += 1
        if became_busy:
            self._busy[stream] = None
            self._dirty.append(stream)
            self.pump()
            if cmd.duration > 0.0:
                self._wake()  # a new deadline: timed waiters re-arm

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _wake(self) -> None:
        ev = self._event
        if ev is not None:
            self._event = None
            ev.set()

    def progress_event(self) -> trio.Event:
        ev = self._event
        if ev is None:
            ev = self._event = trio.Event()
        return ev

    def next_due(self) -> float | None:
        """When the earliest timed work at a stream head is due (free mode only)."""
        if self._held or not self._timed_pending:
            return None
        best: float | None = None
        for s in self._busy:
            head = s.head()
            if head.work:
                due = s.due(head)
                if best is None or due < best:
                    best = due
        return best

    def pump(self, until: float = 0.0) -> int:
        """Execute what is runnable and due now, or by ``until`` (a due time
        a waiter waited for on the device clock)."""
        if self._pumping:
            return 0
        self._pumping = True
        try:
            n = self.settle()
            if not self._held:
                now = max(self._time.now(), until) if self._timed_pending else math.inf
                while True:
                    best: SimStream | None = None
                    best_key = (math.inf, 0)
                    for s in self._busy:
                        head = s.head()
                        if not head.work:
                            continue
                        due = s.due(head)
                        if head.duration > 0.0 and due > now:
                            continue
                        key = (due, head.seq)
                        if best is None or key < best_key:
                            best, best_key = s, key
                    if best is None:
                        break
                    head = best.head()
                    self._exec_work(best, best_key[0] if head.duration > 0.0 else None)
                    n += 1 + self.settle()
        finally:
            self._pumping = False
        if n:
            self._wake()
        return n

    def settle(self) -> int:
        """Execute runnable bookkeeping at the heads of the dirty streams."""
        n = 0
        dirty = self._dirty
        busy = self._busy
        while dirty:
            s = dirty.popleft()
            while s.queued:
                cmd = s.head()
                kind = cmd.kind
                if kind == "marker":
                    finish = max(s.clock, cmd.t_enqueue)
                    self._exec_marker(s, cmd.data)
                elif kind == "wait_marker":
                    target: SimMarker = cmd.data
                    ts = target.stream
                    if not ts.reached(target.seq):
                        ts.add_waiter(s)
                        break
                    finish = max(s.clock, cmd.t_enqueue, ts.clock)
                elif kind == "gate":
                    gate: SimGate = cmd.data
                    if not gate.opened:
                        break
                    finish = max(s.clock, cmd.t_enqueue, gate.opened_at)
                else:
                    break
                s.pop()
                self._pending -= 1
                self._executed += 1
                s.ended(finish)
                n += 1
                self._record(s, cmd, finish, finish)
            if not s.queued:
                busy.pop(s, None)
        return n

    def _exec_marker(self, s: SimStream, seq: int) -> None:
        waiters = s.complete_marker(seq)
        if waiters:
            if self.host is None:
                self._dirty.extend(waiters)
            else:  # waiters may be streams of other devices of the host
                self.host.wake_waiters(self, waiters)

    def _exec_work(self, s: SimStream, due: float | None) -> None:
        """Pop and execute the work command at ``s``'s head. ``due`` is its
        simulated end time (timed free-running), or None to read the clock."""
        cmd = s.pop()
        self._pending -= 1
        if cmd.duration > 0.0:
            self._timed_pending -= 1
        if s.queued:
            self._dirty.append(s)
        else:
            del self._busy[s]
        if due is None:
            clock = self._time
            start = clock.now()
            self._effect(s, cmd)
            end = clock.now()
        else:
            start = due - cmd.duration
            self._effect(s, cmd)
            end = due
        s.ended(end)
        self._executed += 1
        self._record(s, cmd, start, end)

    def _record(self, s: SimStream, cmd: Command, start: float, end: float) -> None:
        if self.device.trace_limit != 0:
            record = SimCommandRecord(cmd.seq, s.index, cmd.kind, cmd.label, cmd.t_enqueue, start, end)
            self._trace.append(record)

    def _effect(self, s: SimStream, cmd: Command) -> None:
        kind = cmd.kind
        if kind == "launch":
            self._launches += 1
            self._run_launch(s, cmd)
        elif kind == "h2d":
            self._copies += 1
            dst = self.resolve(cmd.dst, cmd.nbytes, "h2d destination", s)
            if dst is not None and cmd.nbytes:
                off = cmd.dst - dst.ptr
                dst.buf[off : off + cmd.nbytes] = cmd.data
                self._bytes_copied += cmd.nbytes
        elif kind == "d2h":
            self._copies += 1
            src = self.resolve(cmd.src, cmd.nbytes, "d2h source (host read)", s)
            if src is not None and cmd.nbytes:
                off = cmd.src - src.ptr
                host: np.ndarray[Any, Any] = cmd.data
                host.reshape(-1).view(np.uint8)[:] = src.buf[off : off + cmd.nbytes]
                self._bytes_copied += cmd.nbytes
        elif kind == "d2d":
            self._copies += 1
            src = self.resolve(cmd.src, cmd.nbytes, "d2d source", s)
            dst = self.resolve(cmd.dst, cmd.nbytes, "d2d destination", s)
            if src is not None and dst is not None and cmd.nbytes:
                so = cmd.src - src.ptr
                do = cmd.dst - dst.ptr
                dst.buf[do : do + cmd.nbytes] = src.buf[so : so + cmd.nbytes]
                self._bytes_copied += cmd.nbytes
        elif kind == "fill":
            self._fills += 1
            dst = self.resolve(cmd.dst, cmd.nbytes, "fill destination", s)
            if dst is not None and cmd.nbytes:
                off = cmd.dst - dst.ptr
                pattern: bytes = cmd.data
                unit = np.dtype(f"u{len(pattern)}")
                dst.buf[off : off + cmd.nbytes].view(unit)[:] = np.frombuffer(pattern, dtype=unit)[0]
        elif kind == "graph":
            self._run_graph(s, cmd)
        elif kind == "peer":
            self._run_peer_copy(s, cmd)
        else:  # pragma: no cover - enqueue only makes the kinds above
            raise AssertionError(f"unknown command kind {kind!r}")

    def _run_graph(self, s: SimStream, cmd: Command) -> None:
        """One replay: the captured commands, in capture order. Their device
        addresses are resolved now, so memcheck covers every replay."""
        graph_exec: SimGraphExec = cmd.data[0]
        nodes: tuple[Command, ...] = cmd.data[1]
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
            s.mark_unknown()
            return
        if cmd.fault == "kernel_fault":
            s.add_error(
                launch_failed(f"injected kernel_fault in graph {graph_exec.handle:#x}", "cuGraphLaunch")
            )
            return
        for node in nodes:
            self._effect(s, node)

    def _run_peer_copy(self, s: SimStream, cmd: Command) -> None:
        """A copy between the memories of two devices of this device's host.
        Both ends are resolved now, each in its own device's memory."""
        src_engine: SimEngine
        dst_engine: SimEngine
        src_engine, dst_engine, staged = cmd.data
        n = cmd.nbytes
        name = self.device.name
        src = src_engine.resolve(cmd.src, n, f"peer copy source (from {name})", s)
        dst = dst_engine.resolve(cmd.dst, n, f"peer copy destination (from {name})", s)
        moved = 0
        if src is not None and dst is not None and n:
            so = cmd.src - src.ptr
            do = cmd.dst - dst.ptr
            dst.buf[do : do + n] = src.buf[so : so + n]
            moved = n
        self._copies += 1
        self._bytes_copied += moved
        host = self.host
        assert host is not None  # only a host's contexts enqueue peer copies
        host.count_peer_copy(staged, moved)

    def _run_launch(self, s: SimStream, cmd: Command) -> None:
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
            s.mark_unknown()
            return
        if cmd.fault == "kernel_fault":
            s.add_error(launch_failed(f"injected kernel_fault in kernel {kernel.name}", "cuLaunchKernel"))
            return
        views = launch.arg_views()
        check = LaunchCheck(kernel.name, s.index, self._violations)
        args = self._kernel_args(s, kernel, views, check)
        reference = kernel.reference
        tile = kernel.tile
        if args is None or (tile is None and not callable(reference)) or reference is NO_REFERENCE:
            check.close()
            return  # NO_REFERENCE: a no-op on purpose (SimContext.load_kernel refuses None)
        error: BaseException | None = None
        try:
            if tile is not None:
                tile.run_on_cpu(launch, args)  # the reference, or the kernel on NumPy tiles
            elif callable(reference):
                reference(*args)
        except OutOfBounds:
            pass  # recorded in check
        except Exception as exc:
            if tile is not None and not callable(reference):
                error = tile_failed(kernel, exc)
            else:
                error = reference_failed(kernel, reference, views, args, exc)
        except BaseException as exc:
            # KeyboardInterrupt, SystemExit...: the device never raises into
            # whoever happens to pump it; the work fails with the exception
            # itself, so it reaches the waiter (or the scope's exit) as it is.
            error = exc
        finally:
            fault = check.close()
        if check.first is not None and (error is None or isinstance(error, Exception)):
            # an out-of-bounds access is the kernel's fault, whatever the
            # reference did next (it may have caught OutOfBounds)
            error = illegal_address(check, fault, tile=tile is not None and not callable(reference))
        if error is not None:
            s.add_error(error)
        # The error's traceback holds this frame: drop what would make cycles
        # through it (the views hold the device's buffers).
        del args, error, fault

    def _kernel_args(
        self, s: SimStream, kernel: Kernel, views: Sequence[ArgView], check: LaunchCheck
    ) -> list[object] | None:
        """The reference's arguments (arrays as bounds-checked views of
        ``check``'s launch), or None if memcheck rejected one."""
        out: list[object] = []
        ok = True
        for i, av in enumerate(views):
            kind = av.kind
            if kind == "scalar" or kind == "raw":
                out.append(av.value)
                continue
            dtype = av.dtype if av.dtype is not None else np.dtype(np.uint8)
            nbytes = av.nbytes
            alloc = self.resolve(av.ptr, nbytes, f"launch {kernel.name} (argument {i})", s)
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
                readonly = av.access is Access.READ
                if readonly:
                    view.setflags(write=False)
                out.append(bounded(view, check, av.ptr, readonly, describer(kernel, i, av, len(views))))
                if kind == "slice":
                    len_dtype = av.len_dtype if av.len_dtype is not None else np.dtype(np.uint64)
                    out.append(len_dtype.type(av.length))
        return out if ok else None
