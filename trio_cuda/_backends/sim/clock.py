"""The simulator's clock: the one time that timed work is measured and waited on.

Invariants:

* :meth:`SimClock.now` is in seconds and never goes back. Outside a Trio run
  it follows ``time.perf_counter()``; inside one it follows the run's own
  clock (``trio.lowlevel.current_clock()``). Under Trio's default clock the
  two agree, so device times are ``perf_counter`` seconds; under
  ``trio.testing.MockClock`` simulated work takes virtual time: an autojump
  clock jumps to the next due command, and a clock without autojump moves
  only when the test calls ``clock.jump``.
* When the source changes (a run starts or ends, another run's clock), the
  clock re-anchors: its time goes on from the later of its last reading and
  ``perf_counter()``, so queued work keeps its place in time.
* :meth:`SimClock.deadline` turns a device time into a deadline on the
  current run's clock (for ``trio.move_on_at``), rounded down by a few units
  in the last place: never late (a MockClock jumped exactly to a due time
  fires it), maybe a hair early, so whoever waited for a due time executes
  the work due by it (``SimEngine.pump(until=...)``) instead of reading the
  clock again.
* The devices of one SimHost share one clock, so their times compare.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from time import perf_counter
from typing import final

from trio.lowlevel import current_clock

__all__ = ["SimClock"]


@final
class SimClock:
    """Device time: ``perf_counter`` outside Trio, the run's clock inside one."""

    __slots__ = ("_last", "_offset", "_source")

    def __init__(self) -> None:
        #: the Trio clock read now (None: perf_counter); a reference, so that
        #: a new run's clock is never mistaken for a collected one
        self._source: object = None
        self._offset = 0.0
        self._last = 0.0

    def now(self) -> float:
        """The current device time."""
        try:
            source = current_clock()
        except RuntimeError:  # not inside a Trio run (or in a worker thread)
            source = None
        raw = perf_counter() if source is None else source.current_time()
        if source is not self._source:
            self._offset = max(self._last, perf_counter()) - raw
            self._source = source
        t = raw + self._offset
        if t < self._last:
            return self._last
        self._last = t
        return t

    @classmethod
    def merged(cls, clocks: Iterable[SimClock]) -> SimClock:
        """A new clock that goes on from the latest reading of ``clocks``
        (for devices that come to share one)."""
        clock = cls()
        clock._last = max((c._last for c in clocks), default=0.0)
        return clock

    def deadline(self, t: float) -> float:
        """Device time ``t`` on the clock of the current Trio run, rounded
        down: when it passes, :meth:`now` has reached ``t`` but for rounding."""
        self.now()  # anchor to this run's clock
        offset = self._offset
        return (t - offset) - 4 * math.ulp(max(abs(t), abs(offset)))
