"""Lifetime traces: what scopes did, recorded as events in a bounded ring.

Invariants:

* Off by default, and then free: every hook reads one attribute
  (``scope._tracer``) and does nothing when it is None.
* Recording writes one plain tuple per event into a ring of ``limit``
  slots; the oldest events are overwritten first, and ``dropped`` counts them.
  Events never hold a :class:`~trio_cuda.DeviceArray` (that would keep
  memory alive); allocations are named by their address. An event's ``args``
  never change once it is recorded; events may share them (the compiled
  submission record reuses one launch's), so exporters copy what they hand out.
* Everything else a tracer keeps is bounded too: the scope registry and the
  device times of commands are pruned, from time to time, of what no event
  in the ring refers to any more.
* Times are host ``perf_counter()`` seconds. Device times of enqueued work
  come from the driver where it keeps them (``Capabilities.device_clock``:
  the simulator's clock), collected when a scope closes; otherwise the
  exporter shows host-observed times (enqueue to the completion observed).
* Where the ``nvtx`` package is installed, a tracer also opens NVTX ranges:
  one per scope (open to exit) and one per submission (submit to
  retirement), in the domain ``trio_cuda``, so that Nsight Systems shows them
  next to the kernels. Without the package nothing is imported or called.
* A tracer may be shared by many scopes (per process: :func:`set_process_tracer`),
  in any number of threads and Trio runs; each scope gets its own id.
* Thread safety: one reentrant lock guards the ring, the counters and the
  registries (``threading.RLock``; where the compiled paths are in use, the
  ``_claunch.TraceLock`` of the same semantics, which their records take with
  no call). Recording takes it once per event (one uncontended acquire, and
  the event's time is read under it); readers hold it only to copy what they need
  (:meth:`Tracer.snapshot`) and export from the copy without it, so any
  thread may export while scopes record. Nothing iterates the live ring.
"""

from __future__ import annotations

import logging
import threading
from operator import itemgetter
from time import perf_counter
from typing import TYPE_CHECKING, Any, NamedTuple, final

from trio.lowlevel import enable_ki_protection

from . import _compiled
from ._ops import Access

if TYPE_CHECKING:
    from ._array import Allocation
    from ._launch import KernelLaunch
    from ._scope import ResourceScope
    from ._submit import Submission

log = logging.getLogger("trio_cuda")

#: (t, cat, name, scope id, stream index, submission id, allocation address, args)
Event = tuple[float, str, str, int, "int | None", "int | None", "int | None", "dict[str, Any] | None"]

#: the lifetime event kinds (a Chrome trace event's ``cat``)
CATEGORIES = (
    "scope",
    "alloc",
    "free",
    "submit",
    "lease",
    "wait",
    "enqueue",
    "complete",
    "retire",
    "cancel",
    "drop",
    "quarantine",
    "error",
)


class Snapshot(NamedTuple):
    """A tracer's state at one moment (:meth:`Tracer.snapshot`), for exporters."""

    t0: float
    limit: int
    recorded: int
    events: list[Event]  #: oldest first
    #: scope id -> (label, backend, device clock)
    scopes: dict[int, tuple[str, str, str]]
    device: dict[tuple[int, int], tuple[float, float]]
    marks: dict[tuple[int, int], float]

    @property
    def dropped(self) -> int:
        return self.recorded - len(self.events)


@final
class Tracer:
    """The recorder behind :class:`trio_cuda.trace.Trace`.

    The ring is a list that grows to ``limit`` slots, then is written in
    turn (``recorded`` modulo ``limit`` is the next slot). The lock is
    reentrant: a garbage-collection finalizer (a dropped future's) may record
    an event on a thread that holds it. So snapshots copy the ring by a slice
    assignment into a list made beforehand (C code that allocates nothing a
    collection could start from: no event lands halfway through the copy).
    A scope's exit copies only its own span, with plain slices: there, an
    event recorded by such a finalizer can at worst hide the oldest one."""

    __slots__ = (
        "device",
        "first",
        "limit",
        "lock",
        "marks",
        "next_sid",
        "nvtx",
        "nvtx_ranges",
        "prune_at",
        "recorded",
        "ring",
        "scopes",
        "t0",
        "timing",
    )

    def __init__(self, limit: int, timing: bool = False) -> None:
        self.limit = limit
        #: CUDA events around each enqueue where the backend has device timing
        self.timing = timing
        #: guards what follows (see the module's invariants)
        self.lock = _new_lock()
        #: the events kept; grows to ``limit``, then the oldest are overwritten
        self.ring: list[Event] = []
        self.recorded = 0
        self.t0 = perf_counter()
        #: scope id -> (label, backend, device clock)
        self.scopes: dict[int, tuple[str, str, str]] = {}
        self.next_sid = 0
        #: open scope id -> ``recorded`` before its opening event
        self.first: dict[int, int] = {}
        #: (scope id, command id) -> device (start, end), collected at scope exit
        self.device: dict[tuple[int, int], tuple[float, float]] = {}
        #: (scope id, mark id) -> host time of a device timestamp, at scope exit
        self.marks: dict[tuple[int, int], float] = {}
        #: size of the registries (scopes, device, marks) past which they are pruned
        self.prune_at = 2 * limit
        #: the ``nvtx`` module where it is installed, and the open ranges
        self.nvtx: Any = _load_nvtx()
        self.nvtx_ranges: dict[tuple[int, int], Any] = {}

    @property
    def kept(self) -> int:
        return min(self.recorded, self.limit)

    @property
    def dropped(self) -> int:
        return max(0, self.recorded - self.limit)

    def _copy(self, into: list[Event]) -> int:
        """Copy the ring into ``into``, a list made before the lock was taken
        (see the class); ``recorded`` at the copy."""
        into[:] = self.ring
        return self.recorded

    def snapshot(self) -> Snapshot:
        """A consistent copy of what an export needs, oldest first. The lock
        is held only for C copies: about a millisecond per 100,000 events."""
        ring: list[Event] = []
        with self.lock:
            scopes, device, marks = dict(self.scopes), dict(self.device), dict(self.marks)
            recorded = self._copy(ring)  # last, and with nothing allocated in between
        if recorded > self.limit:
            cut = recorded % self.limit
            ring = ring[cut:] + ring[:cut]
        # a finalizer's event recorded within another one's went in first
        ring.sort(key=itemgetter(0))
        return Snapshot(self.t0, self.limit, recorded, ring, scopes, device, marks)

    @enable_ki_protection
    def emit(
        self,
        cat: str,
        name: str,
        sid: int,
        stream: int | None = None,
        sub: int | None = None,
        alloc: int | None = None,
        args: dict[str, Any] | None = None,
    ) -> None:
        lock = self.lock
        lock.acquire()  # (KI-protected: a KeyboardInterrupt cannot land before the try)
        try:
            ev = (perf_counter(), cat, name, sid, stream, sub, alloc, args)
            n = self.recorded
            if n < self.limit:
                self.ring.append(ev)
            else:
                self.ring[n % self.limit] = ev
            self.recorded = n + 1
        finally:
            lock.release()
        if self.nvtx is not None:
            self._nvtx(cat, name, sid, sub)

    def _nvtx(self, cat: str, name: str, sid: int, sub: int | None) -> None:
        """NVTX ranges: a scope's life, and each submission's (submit to retire).
        Keys are per scope, and a scope records from one thread only."""
        nvtx = self.nvtx
        try:
            if cat == "submit" and sub is not None:
                rid = nvtx.start_range(message=f"{name} #{sub}", domain="trio_cuda")
                self.nvtx_ranges[(sid, sub)] = rid
            elif cat in ("retire", "quarantine", "error") and sub is not None:
                rid = self.nvtx_ranges.pop((sid, sub), None)
                if rid is not None:
                    nvtx.end_range(rid)
            elif cat == "scope":
                if name == "open":
                    self.nvtx_ranges[(sid, 0)] = nvtx.start_range(message=f"scope #{sid}", domain="trio_cuda")
                else:
                    rid = self.nvtx_ranges.pop((sid, 0), None)
                    if rid is not None:
                        nvtx.end_range(rid)
        except Exception as exc:  # a broken profiler hook must not break the program
            log.warning("NVTX ranges turned off: %r", exc)
            self.nvtx = None

    # ------------------------------------------------------------------ scopes
    def open_scope(self, scope: ResourceScope) -> int:
        info = scope._info
        caps = scope._driver.capabilities
        clock = "cuda-events" if self.timing and caps.device_timing else caps.device_clock
        with self.lock:
            self.next_sid += 1
            sid = self.next_sid
            self.scopes[sid] = (f"scope #{sid} ({info.name})", info.backend, clock)
            self.first[sid] = self.recorded
        self.emit(
            "scope",
            "open",
            sid,
            args={"backend": info.backend, "device": info.name, "streams": len(scope._streams)},
        )
        return sid

    def collect_times(self, scope: ResourceScope, sid: int) -> None:
        """At scope exit, after the drain and before the driver closes: the
        device times of this scope's commands and timing marks. Only the
        events recorded since the scope opened are copied and searched."""
        with self.lock:
            n, limit = self.recorded, self.limit
            since = min(n - self.first.get(sid, 0), n, limit)
            lo, hi = (n - since) % limit, n % limit
            if since == 0:
                recent: list[Event] = []
            elif n <= limit:
                recent = self.ring[n - since : n]
            elif lo < hi:
                recent = self.ring[lo:hi]
            else:
                recent = self.ring[lo:] + self.ring[:hi]
        wanted: list[int] = []
        marks: list[int] = []
        for e in recent:
            if e[3] == sid and (args := e[7]) is not None:
                if isinstance(cmd := args.get("cmd"), int):
                    wanted.append(cmd)
                if (pair := args.get("marks")) is not None:
                    marks.extend(pair)
        # the driver is asked without the lock: other threads go on recording
        times: dict[int, tuple[float, float]] = {}
        if wanted:
            try:
                times = scope._driver.command_times(wanted)
            except Exception:  # the device is gone: host-observed times only
                times = {}
        mark_times: dict[int, float] = {}
        if marks:
            try:
                mark_times = scope._driver.mark_times(marks)
            except Exception:  # the device is gone: host-observed times only
                mark_times = {}
        if times or mark_times:
            with self.lock:
                for cmd, span in times.items():
                    self.device[(sid, cmd)] = span
                for mark, t in mark_times.items():
                    self.marks[(sid, mark)] = t

    def close_scope(self, scope: ResourceScope, sid: int) -> None:
        """At scope exit, after everything was released: the exit event."""
        st = scope.statistics()
        self.emit(
            "scope",
            "close",
            sid,
            args={
                "completed": st.completed,
                "failed": st.failed,
                "quarantined": st.quarantined,
                "live_allocations": st.live_allocations,
            },
        )
        with self.lock:
            self.first.pop(sid, None)
            if len(self.scopes) + len(self.device) + len(self.marks) > self.prune_at:
                self._prune()

    def _prune(self) -> None:
        """Forget the scopes, device times and marks that no event in the ring
        refers to, except open scopes' (with the lock held). Amortised: the
        next prune waits until the registries have doubled."""
        sids: set[int] = set(self.first)
        cmds: set[tuple[int, int]] = set()
        marks: set[tuple[int, int]] = set()
        ring: list[Event] = []
        self._copy(ring)
        for e in ring:
            sid, args = e[3], e[7]
            sids.add(sid)
            if args is not None:
                if isinstance(cmd := args.get("cmd"), int):
                    cmds.add((sid, cmd))
                if (pair := args.get("marks")) is not None:
                    marks.update((sid, m) for m in pair)
        self.scopes = {k: v for k, v in self.scopes.items() if k in sids}
        self.device = {k: v for k, v in self.device.items() if k in cmds or k[0] in self.first}
        self.marks = {k: v for k, v in self.marks.items() if k in marks or k[0] in self.first}
        left = len(self.scopes) + len(self.device) + len(self.marks)
        self.prune_at = max(2 * left, 2 * self.limit)


def lease_args(sub: Submission) -> list[tuple[int, int, int, str]]:
    """``sub``'s leases as (allocation address, lo, hi, mode), from the lease
    tables (each lease's byte range within its allocation)."""
    out: list[tuple[int, int, int, str]] = []
    for alloc in sub.leases:
        for table, mode in ((alloc.writers, "write"), (alloc.readers, "read")):
            ext = table.get(sub)
            if ext:
                for i in range(0, len(ext), 2):
                    out.append((alloc.ptr, ext[i], ext[i + 1], mode))
    return out


def plan_lease_args(op: KernelLaunch) -> list[tuple[int, int, int, str]]:
    """The leases a launch's lease plan records (``take_launch_leases``'s
    fast path), as :func:`lease_args` gives them."""
    out: list[tuple[int, int, int, str]] = []
    for arr, access in op._accesses:
        alloc = arr._alloc
        ext = arr._extent
        mode = "write" if access is Access.WRITE else "read"
        for i in range(0, len(ext), 2):
            out.append((alloc.ptr, ext[i], ext[i + 1], mode))
    return out


def op_name(op: object) -> str:
    """A short name for what a submission runs (no repr: it may be costly)."""
    prepared = getattr(op, "prepared", None)
    if prepared is not None:
        return str(prepared.kernel.name)
    name = type(op).__name__.lstrip("_")
    return name.lower() if name else "op"


def alloc_args(alloc: Allocation) -> dict[str, Any]:
    return {"bytes": alloc.nbytes, "borrowed": bool(alloc.borrowed)}


def _new_lock() -> Any:
    """A tracer's lock: reentrant (see :class:`Tracer`), the compiled one where it is in use."""
    ext = _compiled.ext
    return threading.RLock() if ext is None else ext.TraceLock()


#: the tracer new scopes record into when ``open_scope(trace=None)``
_process_tracer: Tracer | None = None


def process_tracer() -> Tracer | None:
    return _process_tracer


def set_process_tracer(tracer: Tracer | None) -> None:
    global _process_tracer
    _process_tracer = tracer


def _load_nvtx() -> Any:
    """The ``nvtx`` package, or None where it is not installed."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("nvtx") is None:
        return None
    try:
        return importlib.import_module("nvtx")
    except Exception:
        return None


def trace_error(scope: ResourceScope, tr: Tracer, sub: Submission, exc: BaseException) -> None:
    """Record that ``sub`` failed at submission (``partial``: work of it was
    enqueued or leased before the error, and stays retained)."""
    partial = bool(sub.dirty or sub.leases)
    args: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}"[:300], "partial": partial}
    if partial:
        args["leases"] = lease_args(sub)
    tr.emit("error", type(exc).__name__, scope._trace_id, sub.stream.index, sub.id, args=args)


def trace_submit(
    scope: ResourceScope, tr: Tracer, sub: Submission, op: KernelLaunch, mark: int | None
) -> None:
    """Record a single launch that was enqueued and put in flight: one
    ``submit`` event that also stands for the launch's enqueue
    (``args["enqueue"]``, and the driver's command id)."""
    plan = op._lease_plan
    if plan is not None and sub.leases is plan:  # the fast path: the plan's leases
        cache = op.prepared.scratch()
        leases = cache.get("trace_leases")
        if leases is None:
            leases = cache["trace_leases"] = plan_lease_args(op)
    else:
        leases = lease_args(sub)
    name = op.prepared.kernel.name
    driver = scope._driver
    tr.emit(
        "submit",
        name,
        scope._trace_id,
        sub.stream.index,
        sub.id,
        args={
            "leases": leases,
            "enqueue": name,
            "cmd": driver.last_command() if scope._trace_cmds else None,
            "marks": None if mark is None else (mark, driver.timing_mark(sub.stream.handle)),
        },
    )
