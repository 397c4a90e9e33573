"""Completion waiting of the cuda backend: how ``wait_for_progress`` sleeps.

Invariants:

* Everything here runs on the Trio loop thread, except the waiter threads of
  ``waiters``, which only block in the driver or read pinned flags and then
  wake the loop (``TrioToken.run_sync_soon``).
* ``wait_for_progress`` never blocks the loop and never raises a driver error
  into the core: a failure of the waiting machinery makes the context sticky,
  and pending markers then poll ``UNKNOWN``. It may return early.
* Strategies: "adaptive" (default) spins with checkpoints for
  ``spin_budget`` seconds (busy-waiting up to ``inline_spin`` only while no
  other task is runnable), then hands the wait to a waiter thread; "sleep",
  "event" and "thread" are the alternatives measured in
  ``docs/design/completion.md``. While parked, the loop wakes at least every
  ``error_check_interval`` to ask the driver about sticky errors.
* :class:`CompletionWaiter` owns the strategy, its tunables, the waiter
  threads and the counters. It reads the flags and the ``new_head`` /
  ``wake_ev`` signal of the :class:`~.streams.StreamTable` it was given
  (parking on ``wake_ev``, which ``notify_submitted`` sets), recycles events
  through the table's pool, and records a broken context in the shared
  ``ContextState.sticky``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, final

import trio

from ..._core._driver import Marker
from ..._core._errors import CudaError
from ..._core._trio_internals import runnable_tasks as _runnable_tasks
from .bindings import cu
from .errors import NOT_READY, cuda_error
from .streams import _HALF, _M32, CudaMarker, CudaStream
from .waiters import EventJob, PollJob, WaiterPool

if TYPE_CHECKING:
    from .state import ContextState
    from .streams import StreamTable

__all__ = ["CompletionWaiter"]

log = logging.getLogger("trio_cuda")

_STRATEGIES: Final = ("adaptive", "sleep", "event", "thread")

perf_counter = time.perf_counter


@final
class CompletionWaiter:
    """How one context's ``wait_for_progress`` waits: the strategy and its
    tunables, the waiter threads, and the driver's error checks."""

    __slots__ = (
        "_last_error_check",
        "_state",
        "_table",
        "_token",
        "_waiters",
        "counters",
        "error_check_interval",
        "inline_spin",
        "max_poll_interval",
        "poll_interval",
        "sleep_max_interval",
        "spin_budget",
        "wait_strategy",
    )

    def __init__(self, state: ContextState, table: StreamTable) -> None:
        self._state = state
        self._table = table
        self._waiters = WaiterPool(cu, state.make_current)
        self._token: trio.lowlevel.TrioToken | None = None
        self._last_error_check = 0.0
        # tunables
        self.wait_strategy = "adaptive"
        self.spin_budget = 200e-6
        self.inline_spin = 20e-6
        self.error_check_interval = 0.02
        self.poll_interval = 50e-6
        self.max_poll_interval = 1e-3
        self.sleep_max_interval = 5e-3
        #: statistics for tests and benchmarks
        self.counters = {"handoffs": 0, "event_waits": 0, "poll_waits": 0, "loop_sleeps": 0, "spins": 0}

    def close(self) -> None:
        """At close: stop the waiter threads (a job in flight still ends)."""
        self._waiters.close()

    def set_wait_strategy(
        self, strategy: str, *, spin_budget: float | None = None, inline_spin: float | None = None
    ) -> None:
        """Choose how :meth:`wait_for_progress` sleeps (see the class docs).
        "event" and "thread" make markers record events too."""
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy: expected one of {_STRATEGIES}, got {strategy!r}")
        self.wait_strategy = strategy
        self._table.record_events = strategy in ("event", "thread")
        if spin_budget is not None:
            self.spin_budget = spin_budget
        if inline_spin is not None:
            self.inline_spin = inline_spin

    # ------------------------------------------------------------------ completion
    def _check_errors(self, streams: Sequence[CudaStream]) -> bool:
        """``cuStreamQuery`` the streams with pending heads; a failure other
        than NOT_READY is sticky: every pending marker becomes UNKNOWN."""
        state = self._state
        self._last_error_check = perf_counter()
        state.make_current_if_needed()
        if state.sticky is not None:
            return True
        for s in streams:
            if s.destroyed:
                continue
            (err,) = cu.cuStreamQuery(s.cu)
            if err and int(err) != NOT_READY:
                state.sticky = cuda_error(err, f"cuStreamQuery(stream {s.index})")
                log.error("cuda:%d failed: %s", state.ordinal, state.sticky)
                return True
        return False

    async def wait_for_progress(self, pending: Sequence[Marker]) -> None:
        state = self._state
        table = self._table
        markers = [m for m in pending if isinstance(m, CudaMarker)]
        if not markers or state.sticky is not None:
            await trio.lowlevel.checkpoint()
            return
        state.make_current_if_needed()
        if table.has_deferred():
            try:
                table.flush()
            except CudaError as exc:
                state.sticky = state.sticky or exc
                await trio.lowlevel.checkpoint()
                return
        watch = [(m.stream.mv, m.stream.slot, m.seq) for m in markers]
        streams = [m.stream for m in markers]
        for s in streams:
            s.watched = True
        table.new_head = False
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
            if state.sticky is None:
                state.sticky = exc
                log.error("cuda:%d failed: %s", state.ordinal, exc)  # noqa: TRY400
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
        table = self._table
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
            if table.new_head:
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
        table = self._table
        ev = trio.Event()
        table.wake_ev = ev
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
            if table.wake_ev is ev:
                table.wake_ev = None

    async def _wait_event_poll(self, markers: list[CudaMarker], streams: list[CudaStream]) -> None:
        """Strategy (b): ``cuEventQuery`` the heads' events from the loop:
        spin with checkpoints, then sleep with backoff."""
        events = [m.event for m in markers if m.event is not None]
        if not events:  # markers recorded before record_events was set
            await self._wait_sleep([(m.stream.mv, m.stream.slot, m.seq) for m in markers], streams)
            return
        table = self._table
        query = cu.cuEventQuery
        end = perf_counter() + self.spin_budget
        interval = self.poll_interval
        while True:
            for e in events:
                (err,) = query(e)
                if not err:
                    await trio.lowlevel.checkpoint()
                    return
                if int(err) != NOT_READY:
                    self._state.sticky = cuda_error(err, "cuEventQuery")
                    await trio.lowlevel.checkpoint()
                    return
            if table.new_head:
                await trio.lowlevel.checkpoint()
                return
            if perf_counter() < end:
                await trio.lowlevel.checkpoint()
            else:
                self.counters["loop_sleeps"] += 1
                ev = trio.Event()
                table.wake_ev = ev
                with trio.move_on_after(interval):
                    await ev.wait()
                table.wake_ev = None
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
        table = self._table
        token = self._token
        if token is None:
            token = self._token = trio.lowlevel.current_trio_token()
        ev = trio.Event()
        table.wake_ev = ev
        release_event = None
        job: EventJob | PollJob
        if self.wait_strategy == "thread" and markers[0].event is not None:
            job = EventJob(markers[0].event, self._job_done_cb(token, ev), owner=markers[0])
        elif len(markers) == 1 and markers[0].seq == markers[0].stream.seq:
            # The only pending head is the newest point of its stream: an event
            # recorded now completes with it, so the thread can block on it.
            s = markers[0].stream
            release_event = table.new_event()
            (err,) = cu.cuEventRecord(release_event, s.cu)
            if err:
                table.recycle_event(release_event)
                self._state.fail(err, "cuEventRecord")
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
                table.recycle_event(release_event)
            if table.wake_ev is ev:
                table.wake_ev = None
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
            if table.wake_ev is ev:
                table.wake_ev = None

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
            state = self._state
            result = job.result
            if result is not None and int(result) not in (0, NOT_READY) and state.sticky is None:
                state.sticky = cuda_error(result, "cuEventSynchronize")
                log.error("cuda:%d failed: %s", state.ordinal, state.sticky)
            if job.recycle and not state.closed:
                self._table.recycle_event(job.event)
        ev.set()
