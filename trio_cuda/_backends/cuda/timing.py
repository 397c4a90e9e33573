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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..._core._driver import StreamHandle
from .bindings import cu
from .errors import check
from .streams import StreamsMixin


class TimingMixin(StreamsMixin):
    """Part of :class:`~.context.CudaContext`: timing events for traces."""

    _timing_ref: Any
    _timing_t0: float
    _timing_marks: list[Any]

    def timing_start(self, stream: StreamHandle) -> None:
        if getattr(self, "_timing_marks", None) is not None:
            return
        s = self._stream(stream)
        ref = check(cu.cuEventCreate(0), "cuEventCreate")
        check(cu.cuEventRecord(ref, s.cu), "cuEventRecord")
        check(cu.cuEventSynchronize(ref), "cuEventSynchronize")  # an idle stream: at once
        self._timing_t0 = time.perf_counter()
        self._timing_ref = ref
        self._timing_marks = []

    def timing_mark(self, stream: StreamHandle) -> int | None:
        marks = getattr(self, "_timing_marks", None)
        if marks is None:
            return None
        ev = check(cu.cuEventCreate(0), "cuEventCreate")
        check(cu.cuEventRecord(ev, self._stream(stream).cu), "cuEventRecord")
        marks.append(ev)
        return len(marks) - 1

    def mark_times(self, ids: Sequence[int]) -> dict[int, float]:
        marks = getattr(self, "_timing_marks", None)
        out: dict[int, float] = {}
        if not marks:
            return out
        for i in ids:
            if 0 <= i < len(marks):
                err, ms = cu.cuEventElapsedTime(self._timing_ref, marks[i])
                if not err:
                    out[i] = self._timing_t0 + float(ms) / 1000.0
        return out

    def _close_timing(self) -> None:
        marks = getattr(self, "_timing_marks", None)
        if marks is None:
            return
        for ev in marks:
            cu.cuEventDestroy(ev)
        cu.cuEventDestroy(self._timing_ref)
        self._timing_marks = []
