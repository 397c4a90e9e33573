"""Lifetime traces: what scopes did, recorded as events in a bounded ring.

Invariants:

* Off by default, and then free: every hook reads one attribute
  (``scope._tracer``) and does nothing when it is None.
* Recording appends one plain tuple per event to a ``deque`` bounded by
  ``limit``; the oldest events are evicted first, and ``dropped`` counts them.
  Events never hold a :class:`~trio_cuda.DeviceArray` (that would keep
  memory alive); allocations are named by their address.
* Times are host ``perf_counter()`` seconds. Device times of enqueued work
  come from the driver where it keeps them (``Capabilities.device_clock``:
  the simulator's clock), collected when a scope closes; otherwise the
  exporter shows host-observed times (enqueue to the completion observed).
* Where the ``nvtx`` package is installed, a tracer also opens NVTX ranges:
  one per scope (open to exit) and one per submission (submit to
  retirement), in the domain ``trio_cuda``, so that Nsight Systems shows them
  next to the kernels. Without the package nothing is imported or called.
* A tracer may be shared by many scopes (per process: :func:`set_process_tracer`);
  each scope gets its own id. Recording happens on the scopes' Trio threads
  only; ``threading`` never touches the ring.
"""

from __future__ import annotations

import logging
from collections import deque
from time import perf_counter
from typing import TYPE_CHECKING, Any, final

from ._ops import Access

if TYPE_CHECKING:
    from ._array import Allocation
    from ._scope import ResourceScope
    from ._submit import LeasePlan, Submission

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


@final
class Tracer:
    """The recorder behind :class:`trio_cuda.trace.Trace`."""

    __slots__ = (
        "device",
        "events",
        "limit",
        "marks",
        "nvtx",
        "nvtx_ranges",
        "recorded",
        "scopes",
        "t0",
        "timing",
    )

    def __init__(self, limit: int, timing: bool = False) -> None:
        self.limit = limit
        #: CUDA events around each enqueue where the backend has device timing
        self.timing = timing
        #: (scope id, mark id) -> host time of a device timestamp, at scope exit
        self.marks: dict[tuple[int, int], float] = {}
        self.events: deque[Event] = deque(maxlen=limit)
        self.recorded = 0
        self.t0 = perf_counter()
        #: scope id -> (label, backend, device clock)
        self.scopes: dict[int, tuple[str, str, str]] = {}
        #: (scope id, command id) -> device (start, end), collected at scope exit
        self.device: dict[tuple[int, int], tuple[float, float]] = {}
        #: the ``nvtx`` module where it is installed, and the open ranges
        self.nvtx: Any = _load_nvtx()
        self.nvtx_ranges: dict[tuple[int, int], Any] = {}

    @property
    def dropped(self) -> int:
        return self.recorded - len(self.events)

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
        self.recorded += 1
        self.events.append((perf_counter(), cat, name, sid, stream, sub, alloc, args))
        if self.nvtx is not None:
            self._nvtx(cat, name, sid, sub)

    def _nvtx(self, cat: str, name: str, sid: int, sub: int | None) -> None:
        """NVTX ranges: a scope's life, and each submission's (submit to retire)."""
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
        sid = len(self.scopes) + 1
        info = scope._info
        caps = scope._driver.capabilities
        clock = "cuda-events" if self.timing and caps.device_timing else caps.device_clock
        self.scopes[sid] = (f"scope #{sid} ({info.name})", info.backend, clock)
        self.emit(
            "scope",
            "open",
            sid,
            args={"backend": info.backend, "device": info.name, "streams": len(scope._streams)},
        )
        return sid

    def collect_times(self, scope: ResourceScope, sid: int) -> None:
        """At scope exit, after the drain and before the driver closes: the
        device times of this scope's commands and timing marks."""
        wanted = [
            cmd
            for e in self.events
            if e[3] == sid and e[7] is not None and isinstance(cmd := e[7].get("cmd"), int)
        ]
        if wanted:
            try:
                times = scope._driver.command_times(wanted)
            except Exception:  # the device is gone: host-observed times only
                times = {}
            for cmd, span in times.items():
                self.device[(sid, cmd)] = span
        marks = [
            m
            for e in self.events
            if e[3] == sid and e[7] is not None and (pair := e[7].get("marks")) is not None
            for m in pair
        ]
        if marks:
            try:
                for mark, t in scope._driver.mark_times(marks).items():
                    self.marks[(sid, mark)] = t
            except Exception:  # the device is gone: host-observed times only
                pass

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


def plan_lease_args(plan: LeasePlan) -> list[tuple[int, int, int, str]]:
    """The leases a launch's lease plan records (``take_launch_leases``'s
    fast path), as :func:`lease_args` gives them."""
    out: list[tuple[int, int, int, str]] = []
    for _, alloc, access, ext in plan[1]:
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
