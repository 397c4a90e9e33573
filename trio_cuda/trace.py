"""Lifetime traces: see what scopes did, in Perfetto or as a timeline page.

.. code-block:: python

    trace = trio_cuda.trace.Trace()
    async with trio_cuda.open_scope(trace=trace) as gpu:
        ...
    trace.write("run.json")     # Chrome trace-event JSON: open it in ui.perfetto.dev
    trace.write("run.html")     # a self-contained timeline page

:func:`enable` records every scope of the process (``python -m trio_cuda
trace SCRIPT`` does that). Invariants:

* A trace records, per scope: its opening and exit; allocations and frees
  (with bytes); submissions with their leases (allocation, byte range, mode,
  stream); cross-stream waits and what they wait on; the enqueue of each
  kernel, copy, fill and host closure; completions, and who observed them
  (the awaiting task, the handoff task, or the exit); retirement; cancelled
  waiters, dropped futures, quarantine and errors; and each awaiting task's
  wait.
* Recording is bounded (``limit`` events, oldest dropped first);
  :attr:`Trace.dropped` and both outputs say how many were dropped.
* Device times: on the simulator, its clock (each command's start and end);
  elsewhere, host-observed times: from the enqueue to the completion the
  host observed.
* Exporting never changes the trace, and a trace holds no array: recording
  never keeps memory alive.
* Thread safety: scopes in any number of threads and Trio runs may record
  into one trace, and any thread may export it while they do (a 100,000-event
  page is best rendered off the loop: ``await trio.to_thread.run_sync(trace.write,
  path)``). An export works from a consistent copy of the trace; recording
  waits only while it is copied (about a millisecond per 100,000 events).
"""

from __future__ import annotations as _annotations  # (aliased: this module exposes only __all__)

import json
import os
import sys
import threading
import typing

import attrs

from ._core import _final, _trace
from ._version import __version__

if typing.TYPE_CHECKING:
    from typing import Any

    from ._core._trace import Snapshot

__all__ = ["Trace", "TraceEvent", "current", "disable", "enable"]


@_final.final
@attrs.frozen
class TraceEvent:
    """One recorded lifetime event (:attr:`Trace.events`).

    A ``retire`` event is named by who observed the completion (``waiter``,
    ``handoff`` or ``exit``). A single kernel launch records one ``submit``
    event that stands for its enqueue too (``args["enqueue"]``); other ops
    record their ``enqueue`` events one by one, and their leases in a
    ``lease`` event."""

    #: seconds from the trace's creation to the event, on the host's
    #: ``time.perf_counter()`` clock (device times are in the exports only)
    t: float
    #: the kind of event: one of ``scope alloc free submit lease wait enqueue
    #: retire cancel drop quarantine error``, or ``await`` (a task's wait)
    cat: str
    #: what happened, within ``cat``: ``open`` or ``close`` for a scope, the
    #: op or kernel for ``submit`` and ``enqueue``, the retirer for ``retire``,
    #: the exception's type for ``error``
    name: str
    #: the scope's number in this trace: 1, 2, ... in the order the scopes
    #: opened
    scope: int
    #: the index of the stream in the scope's ``streams``, or None for an
    #: event of no stream (a scope's open and close, a free)
    stream: int | None
    #: the submission's number within its scope (as in ``submission #3``),
    #: or None for an event of no submission (a scope's, an allocation's, work
    #: enqueued by ``unsafe.async_on``)
    submission: int | None
    #: the allocation's device address, for ``alloc`` and ``free`` events;
    #: None for the others (leases name their allocations in ``args``)
    allocation: int | None
    #: the event's details, by key, or None: bytes of an allocation, the
    #: leases (allocation address, byte range, mode), an error's message, ...
    #: (this event's own dict: changing it changes nothing recorded)
    args: dict[str, Any] | None


@_final.final
class Trace:
    """A bounded recording of lifetime events, from one or more scopes.

    Pass it to :func:`~trio_cuda.open_scope` (``trace=``), or make it the
    process's trace with :func:`enable`. ``limit`` bounds the events kept.
    ``timing=True`` records CUDA events around each kernel, copy and fill on a
    GPU, so that the stream lanes show the device's own execution times (it
    costs two events per enqueue); without it, GPU times are host-observed.
    The simulator always gives its own clock."""

    __slots__ = ("_tracer",)

    def __init__(self, *, limit: int = 100_000, timing: bool = False) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit: expected an int >= 1, got {limit!r}")
        if limit > sys.maxsize:
            raise ValueError(f"limit: expected an int >= 1 and at most sys.maxsize, got {limit!r}")
        if not isinstance(timing, bool):
            raise TypeError(f"timing: expected a bool, got {timing!r}")
        self._tracer = _trace.Tracer(limit, timing)

    @property
    def events(self) -> list[TraceEvent]:
        """The events kept, oldest first (a snapshot: recording goes on)."""
        snap = self._tracer.snapshot()
        t0 = snap.t0
        # (each its own copy of ``args``: events of one launch may share them in the ring)
        return [
            TraceEvent(e[0] - t0, e[1], e[2], e[3], e[4], e[5], e[6], None if e[7] is None else dict(e[7]))
            for e in snap.events
        ]

    @property
    def dropped(self) -> int:
        """Events recorded but no longer kept (the ``limit`` was reached)."""
        return self._tracer.dropped

    def __repr__(self) -> str:
        tr = self._tracer
        with tr.lock:
            kept, scopes, dropped = tr.kept, len(tr.scopes), tr.recorded - tr.kept
        return f"<Trace: {kept} events of {scopes} scope(s), {dropped} dropped>"

    # ------------------------------------------------------------------ outputs
    def to_chrome(self) -> dict[str, Any]:
        """The trace as Chrome trace-event JSON (a dict), which
        ui.perfetto.dev and ``chrome://tracing`` open: a process per scope, a
        track per stream (device execution), per allocation (alive, leased,
        freed) and per awaiting task, and flow arrows from each submission to
        its retirement.

        Any thread may call it, while scopes record: it exports a snapshot."""
        return _Chrome(self._tracer.snapshot()).build()

    def to_html(self, *, title: str = "trio_cuda trace") -> str:
        """A self-contained timeline page (inline SVG and JavaScript; no
        network). Any thread may call it, as :meth:`to_chrome`."""
        from ._trace_html import render_html

        if not isinstance(title, str):
            raise TypeError(f"title: expected a str, got {type(title).__name__} {title!r}")
        return render_html(self.to_chrome(), title=title)

    def write(self, path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> None:
        """Write the trace to ``path`` (a ``str``, ``bytes`` or path object, as
        :func:`open` takes): a name ending in ``.json`` (Chrome trace-event
        JSON) or ``.html`` / ``.htm`` (the timeline page), in any case. Any
        thread may call it, as :meth:`to_chrome`."""
        try:
            p = os.fspath(path)  # (not open()'s file descriptors: an int is refused)
        except TypeError as exc:
            detail = f" ({exc})" if isinstance(path, os.PathLike) else ""
            raise TypeError(
                f"path: expected a str, bytes or os.PathLike file name, got {type(path).__name__} "
                f"{path!r}{detail}"
            ) from None
        name = os.fsdecode(p)
        suffix = os.path.splitext(name)[1].lower()
        if suffix == ".json":
            text = json.dumps(self.to_chrome())
        elif suffix in (".html", ".htm"):
            text = self.to_html(title=os.path.basename(name))
        else:
            raise ValueError(f"path: expected a name ending in .json or .html, got {name!r}")
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)


def enable(*, limit: int = 100_000, timing: bool = False) -> Trace:
    """Record every scope opened from now on (``open_scope(trace=None)``), in
    any thread, into a new process-wide :class:`Trace`, and return it."""
    trace = Trace(limit=limit, timing=timing)
    with _switch:
        _trace.set_process_tracer(trace._tracer)
        _current[0] = trace
    return trace


def disable() -> Trace | None:
    """Stop recording new scopes process-wide; return the trace that was on.
    Scopes already open go on recording into it until they exit."""
    with _switch:
        trace = current()
        _trace.set_process_tracer(None)
        _current[0] = None
    return trace


def current() -> Trace | None:
    """The process-wide trace, if :func:`enable` turned one on."""
    trace = _current[0]
    if trace is not None and _trace.process_tracer() is not trace._tracer:
        return None
    return trace


_current: list[Trace | None] = [None]
#: makes enable() and disable() atomic (the process tracer and ``_current`` agree)
_switch = threading.Lock()


# --------------------------------------------------------------------------- Chrome JSON

#: track ids (Chrome ``tid``s) within a scope's process: 0 the scope, 1 + i
#: stream i, 2000 + j the j-th awaiting task, and from 100000 on sixteen per
#: allocation (its lifetime, then lanes for concurrent leases)
_STREAM_TID = 1
_TASK_TID = 2000
_ALLOC_TID = 100_000
_ALLOC_LANES = 16


class _Chrome:
    """Chrome trace events from a snapshot of a tracer (see :meth:`Trace.to_chrome`)."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.t0 = snap.t0
        self.out: list[dict[str, Any]] = []
        self.named: set[tuple[int, int]] = set()
        self.alloc_tid: dict[tuple[int, int], int] = {}
        self.lease_lanes: dict[tuple[int, int], list[float]] = {}
        self.task_tid: dict[tuple[int, str], int] = {}
        self.next_alloc: dict[int, int] = {}
        self.next_task: dict[int, int] = {}

    def us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 3)

    def thread(self, pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in self.named:
            self.named.add((pid, tid))
            self.out.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            )
            self.out.append(
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )

    def instant(self, cat: str, name: str, t: float, pid: int, tid: int, args: dict[str, Any] | None) -> None:
        ev: dict[str, Any] = {
            "ph": "i",
            "s": "t",
            "name": name,
            "cat": cat,
            "ts": self.us(t),
            "pid": pid,
            "tid": tid,
        }
        if args:
            ev["args"] = dict(args)  # (the output's own: the ring's events never change)
        self.out.append(ev)

    def slice(
        self, cat: str, name: str, t0: float, t1: float, pid: int, tid: int, args: dict[str, Any]
    ) -> None:
        ts = self.us(t0)
        self.out.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat,
                "ts": ts,
                "dur": max(0.0, round(self.us(t1) - ts, 3)),
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        )

    def stream_tid(self, pid: int, stream: int | None) -> int:
        if stream is None:
            self.thread(pid, 0, "scope")
            return 0
        tid = _STREAM_TID + stream
        self.thread(pid, tid, f"stream {stream}")
        return tid

    def alloc_track(self, pid: int, ptr: int, nbytes: int | None) -> int:
        tid = self.alloc_tid.get((pid, ptr))
        if tid is None:
            tid = self.next_alloc.get(pid, _ALLOC_TID)
            self.next_alloc[pid] = tid + _ALLOC_LANES
            self.alloc_tid[(pid, ptr)] = tid
            size = "" if nbytes is None else f" ({nbytes} B)"
            self.thread(pid, tid, f"alloc 0x{ptr:x}{size}")
        return tid

    def lease_tid(self, pid: int, ptr: int, t0: float, t1: float) -> int:
        """A lane of the allocation's lease tracks where [t0, t1) fits
        (concurrent leases need separate lanes to nest properly)."""
        lanes = self.lease_lanes.setdefault((pid, ptr), [])
        for i, end in enumerate(lanes):
            if end <= t0:
                lanes[i] = t1
                break
        else:
            lanes.append(t1)
            i = len(lanes) - 1
        base = self.alloc_track(pid, ptr, None)
        tid = base + 1 + min(i, _ALLOC_LANES - 2)
        self.thread(pid, tid, f"alloc 0x{ptr:x} leases")
        return tid

    def task_track(self, pid: int, task: str) -> int:
        tid = self.task_tid.get((pid, task))
        if tid is None:
            tid = self.next_task.get(pid, _TASK_TID)
            self.next_task[pid] = tid + 1
            self.task_tid[(pid, task)] = tid
            self.thread(pid, tid, f"task {task}")
        return tid

    def build(self) -> dict[str, Any]:
        tr = self.snap
        events = tr.events
        end_t = events[-1][0] if events else self.t0
        backends = {b for _, b, _ in tr.scopes.values()}
        clocks = {c for _, _, c in tr.scopes.values()}
        for sid, (label, _, _) in tr.scopes.items():
            self.out.append({"ph": "M", "name": "process_name", "pid": sid, "args": {"name": label}})
            self.out.append(
                {"ph": "M", "name": "process_sort_index", "pid": sid, "args": {"sort_index": sid}}
            )
        # retirement time of each submission, and the leases it held
        retired: dict[tuple[int, int], float] = {}
        leases: dict[tuple[int, int], list[tuple[float, list[Any], int | None]]] = {}
        for t, cat, _name, sid, stream, sub, _alloc, args in events:
            if sub is None:
                continue
            if cat in ("retire", "quarantine"):
                retired.setdefault((sid, sub), t)
            elif cat in ("submit", "lease", "error") and args and args.get("leases"):
                leases.setdefault((sid, sub), []).append((t, args["leases"], stream))
        alloc_bytes: dict[tuple[int, int], int] = {}
        alloc_start: dict[tuple[int, int], float] = {}
        flows = 0
        for t, cat, name, sid, stream, sub, alloc, args in events:
            pid = sid
            if cat == "scope":
                self.instant("scope", name, t, pid, self.stream_tid(pid, None), args)
            elif cat == "alloc" and alloc is not None:
                nbytes = (args or {}).get("bytes")
                alloc_bytes[(pid, alloc)] = nbytes if isinstance(nbytes, int) else 0
                alloc_start[(pid, alloc)] = t
                tid = self.alloc_track(pid, alloc, nbytes if isinstance(nbytes, int) else None)
                self.instant("alloc", "alloc", t, pid, tid, args)
            elif cat == "free" and alloc is not None:
                tid = self.alloc_track(pid, alloc, alloc_bytes.get((pid, alloc)))
                start = alloc_start.pop((pid, alloc), None)
                if start is not None:
                    self.slice("alloc", "alive", start, t, pid, tid, {"bytes": alloc_bytes.get((pid, alloc))})
                self.instant("free", name, t, pid, tid, args)
            elif cat == "enqueue" or (cat == "submit" and args is not None and "enqueue" in args):
                if cat == "submit":  # a single launch: its submit stands for its enqueue too
                    self.instant("submit", name, t, pid, self.stream_tid(pid, stream), {"sub": sub})
                    self.instant("enqueue", name, t, pid, self.stream_tid(pid, stream), {"sub": sub})
                tid = self.stream_tid(pid, stream)
                cmd = (args or {}).get("cmd")
                span = tr.device.get((sid, cmd)) if isinstance(cmd, int) else None
                marks = (args or {}).get("marks")
                if span is None and marks is not None:
                    m0, m1 = tr.marks.get((sid, marks[0])), tr.marks.get((sid, marks[1]))
                    if m0 is not None and m1 is not None:
                        span = (m0, m1)
                if span is not None:
                    t0, t1 = span
                else:
                    t0 = t
                    t1 = retired.get((sid, sub), end_t) if sub is not None else t
                slice_args: dict[str, Any] = {
                    "sub": sub,
                    "op": name if cat == "enqueue" and name in ("copy", "fill", "host_closure") else "kernel",
                    "device_time": ("cuda-events" if marks else "simulated") if span else "host-observed",
                }
                self.slice("enqueue", name, t0, t1, pid, tid, slice_args)
                if sub is not None and (sid, sub) in retired:
                    flows += 1
                    fid = sid * 1_000_000 + sub
                    self.out.append(
                        {
                            "ph": "s",
                            "id": fid,
                            "name": "submission",
                            "cat": "submit",
                            "ts": self.us(t0),
                            "pid": pid,
                            "tid": tid,
                        }
                    )
                    self.out.append(
                        {
                            "ph": "f",
                            "bp": "e",
                            "id": fid,
                            "name": "submission",
                            "cat": "submit",
                            "ts": self.us(retired[(sid, sub)]),
                            "pid": pid,
                            "tid": tid,
                        }
                    )
            elif cat == "await":
                a = args or {}
                task = str(a.get("task", "?"))
                began = a.get("t0")
                tid = self.task_track(pid, task)
                start = began if isinstance(began, float) else t
                label = f"await #{sub}"
                self.slice("submit", label, start, t, pid, tid, {"sub": sub, "outcome": a.get("outcome")})
            elif cat == "retire":  # named by who observed the completion
                tid = self.stream_tid(pid, stream)
                a = dict(args or {})
                self.instant("complete", "complete", t, pid, tid, {"sub": sub, "by": name})
                self.instant("retire", "retire", t, pid, tid, {"sub": sub, "by": name, **a})
                if "error" in a:
                    self.instant("error", "failed", t, pid, tid, {"sub": sub, "error": a["error"]})
                self._leases_of(pid, sid, sub, t, leases)
            elif cat == "quarantine":
                tid = self.stream_tid(pid, stream)
                self.instant("quarantine", name, t, pid, tid, {"sub": sub, **(args or {})})
                for ptr in (args or {}).get("allocations", []):
                    self.instant(
                        "quarantine",
                        "quarantined",
                        t,
                        pid,
                        self.alloc_track(pid, ptr, None),
                        {"sub": sub},
                    )
            elif cat in ("submit", "wait", "cancel", "drop", "error", "lease"):
                tid = self.stream_tid(pid, stream)
                a = {"sub": sub, **{k: v for k, v in (args or {}).items() if k != "leases"}}
                if cat != "lease":
                    self.instant(cat, name, t, pid, tid, a)
                if cat == "cancel" and args and "task" in args:
                    self.instant("cancel", "cancelled", t, pid, self.task_track(pid, str(args["task"])), a)
        # allocations still alive at the end of the trace
        for (pid, ptr), start in alloc_start.items():
            tid = self.alloc_track(pid, ptr, alloc_bytes.get((pid, ptr)))
            self.slice(
                "alloc",
                "alive",
                start,
                end_t,
                pid,
                tid,
                {"bytes": alloc_bytes.get((pid, ptr)), "freed": False},
            )
        # leases of submissions never retired in the trace (in flight at its end)
        for sid, sub in list(leases):
            self._leases_of(sid, sid, sub, end_t, leases)
        return {
            "traceEvents": self.out,
            "displayTimeUnit": "ms",
            "otherData": {
                "trio_cuda": __version__,
                "dropped": tr.dropped,
                "limit": tr.limit,
                "dropped_are": "the oldest",
                "events": len(events),
                "flows": flows,
                "backend": "/".join(sorted(backends)) or "none",
                "device_time": "/".join(sorted(clocks)) or "host-observed",
                "categories": list(_trace.CATEGORIES),
            },
        }

    def _leases_of(
        self,
        pid: int,
        sid: int,
        sub: int | None,
        t_end: float,
        leases: dict[tuple[int, int], list[tuple[float, list[Any], int | None]]],
    ) -> None:
        """A lease slice, and take/release instants, for each lease of ``sub``."""
        if sub is None:
            return
        for t, items, stream in leases.pop((sid, sub), []):
            for ptr, lo, hi, mode in items:
                tid = self.lease_tid(pid, ptr, t, t_end)
                a = {"sub": sub, "stream": stream, "range": [lo, hi], "mode": mode}
                self.slice("lease", mode, t, t_end, pid, tid, a)
                self.instant("lease", "take", t, pid, tid, a)
                self.instant("lease", "release", t_end, pid, tid, a)
