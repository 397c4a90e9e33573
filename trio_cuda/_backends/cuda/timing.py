"""Device times for traces: CUDA events around each traced enqueue.

Invariants:

* Only a traced scope whose trace asked for timing calls any of this; an
  untraced context never creates an event here.
* ``timing_start`` records a reference event on an idle stream (the scope has
  just opened) and synchronises it, so the host time taken right after it is
  the reference's time to within the synchronisation's latency; it never
  waits for queued work. Every mark's time is the reference's host time plus
  ``cuEventElapsedTime(reference, mark)``.
* ``mark_times`` is asked at scope exit, after the drain: every mark has
  completed; a mark that cannot be read is left out (the trace then shows
  host-observed times for that work). The events are destroyed with the
  context.
* :class:`Timing` owns the reference and the marks: ``None`` marks until
  ``start``; ``close`` destroys the events and leaves an empty list (so a
  later ``start`` does nothing).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

from ..._core._driver import StreamHandle
from .bindings import cu
from .errors import check

if TYPE_CHECKING:
    from .streams import StreamTable

__all__ = ["Timing"]


@final
class Timing:
    """The timing events of one traced context (none until ``start``)."""

    __slots__ = ("_marks", "_ref", "_stream", "_t0")

    def __init__(self, table: StreamTable) -> None:
        self._stream = table.stream
        #: the reference event and its host time, set by ``start``
        self._ref: Any = None
        self._t0 = 0.0
        #: the mark events, by id; None until ``start``
        self._marks: list[Any] | None = None

    def start(self, stream: StreamHandle) -> None:
        if self._marks is not None:
            return
        s = self._stream(stream)
        ref = check(cu.cuEventCreate(0), "cuEventCreate")
        check(cu.cuEventRecord(ref, s.cu), "cuEventRecord")
        check(cu.cuEventSynchronize(ref), "cuEventSynchronize")  # an idle stream: at once
        self._t0 = time.perf_counter()
        self._ref = ref
        self._marks = []

    def mark(self, stream: StreamHandle) -> int | None:
        marks = self._marks
        if marks is None:
            return None
        ev = check(cu.cuEventCreate(0), "cuEventCreate")
        check(cu.cuEventRecord(ev, self._stream(stream).cu), "cuEventRecord")
        marks.append(ev)
        return len(marks) - 1

    def times(self, ids: Sequence[int]) -> dict[int, float]:
        marks = self._marks
        out: dict[int, float] = {}
        if not marks:
            return out
        for i in ids:
            if 0 <= i < len(marks):
                err, ms = cu.cuEventElapsedTime(self._ref, marks[i])
                if not err:
                    out[i] = self._t0 + float(ms) / 1000.0
        return out

    def close(self) -> None:
        """At close (not after a sticky error): destroy the events."""
        marks = self._marks
        if marks is None:
            return
        for ev in marks:
            cu.cuEventDestroy(ev)
        cu.cuEventDestroy(self._ref)
        self._marks = []
