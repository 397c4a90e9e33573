"""Completion: markers, the completion-handoff task, retirement and the drain.

Invariants:

* Completion markers follow the work they mark on its stream: one per
  submission, or one per burst when the driver batches them. A marker that
  cannot be recorded makes its submissions' completion unknown.
* Exactly one completion-handoff task per scope, in the scope's nursery and
  shielded from outside cancellation, polls markers, runs host closures and
  retires submissions, per stream in completion (FIFO) order. It never blocks
  the loop (it sleeps in the driver's ``wait_for_progress``) and it never dies:
  what user code or the driver raises there is kept for the waiter or the exit.
* Retiring releases leases and owners; memory whose last lease retired is freed
  (``MemoryTable``). Work whose completion is unknown is quarantined instead:
  its owners and leases are leaked on purpose, never released.
* The drain at exit waits for every submission, and polls by itself if the
  handoff task is gone; after ``drain_timeout`` it looks once more, then
  quarantines what is still in flight with a ``ResourceWarning``.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import TYPE_CHECKING

import trio

from ._array import Allocation, AllocState
from ._driver import MarkerState, Poll
from ._errors import CompletionUnknownError
from ._multi import release_foreign
from ._submit import HostStep, Submission, SubState

if TYPE_CHECKING:
    from ._driver import DeviceContext
    from ._extension import ScopeExtension
    from ._stream import Stream

__all__ = ["Completion"]


class Completion:
    """Part of :class:`~trio_cuda.ResourceScope`: how its work completes."""

    __slots__ = (
        "_completed",
        "_drain_event",
        "_failed",
        "_handoff_cs",
        "_handoff_errors",
        "_handoff_task",
        "_host_steps",
        "_idle",
        "_in_flight",
        "_timed_out",
        "_unflushed",
    )

    _unflushed: list[Stream]
    _idle: trio.Event | None
    _drain_event: trio.Event | None
    _handoff_cs: trio.CancelScope | None
    _handoff_task: trio.lowlevel.Task | None
    _handoff_errors: int
    _in_flight: int
    _completed: int
    _failed: int
    _host_steps: int
    _timed_out: int

    if TYPE_CHECKING:
        _driver: DeviceContext
        _batch: bool
        _streams: tuple[Stream, ...]
        _closed: bool
        _quarantine: list[Submission]
        _quarantined_leases: int
        _unobserved: dict[Submission, None]
        _orphan_errors: list[BaseException]
        _gc_releases: deque[Allocation]
        _extensions: dict[object, ScopeExtension]

        def _release_handle(self, alloc: Allocation) -> None: ...
        def _maybe_free(self, alloc: Allocation) -> None: ...

    # ------------------------------------------------------------------ markers
    def _finish_submission(self, sub: Submission, out: object) -> None:
        """Put an enqueued submission in flight. Its completion marker is
        recorded now, or, when the driver batches markers, once for every
        submission of the stream since the last one (see :meth:`_flush`)."""
        s = sub.stream
        sub.output = out
        sub.state = SubState.IN_FLIGHT
        s._in_flight += 1
        self._in_flight += 1
        if not s._unmarked:
            self._unflushed.append(s)
        s._unmarked.append(sub)
        if not self._batch:
            self._flush(s)
        self._driver.notify_submitted()
        idle = self._idle
        if idle is not None:
            self._idle = None
            idle.set()

    def _flush(self, s: Stream) -> None:
        """Record one completion marker after the stream's unmarked
        submissions. If that fails, their completion cannot be established."""
        subs = s._unmarked
        if not subs:
            return
        s._unmarked = []
        try:
            marker = self._driver.record_marker(s.handle)
        except Exception as exc:
            for sub in subs:
                self._quarantine_submission(sub, exc)
            return
        for sub in subs:
            sub.marker = marker
        s._pending.extend(subs)

    def _flush_all(self) -> None:
        streams = self._unflushed
        if streams:
            self._unflushed = []
            for s in streams:
                self._flush(s)

    def _wake(self) -> None:
        idle = self._idle
        if idle is not None:
            self._idle = None
            idle.set()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C goes to the program's tasks, never here
    async def _handoff(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The backstop that retires what nobody awaits. It must never die:
        anything raised while it retires work (a host closure or a simulated
        reference raising ``KeyboardInterrupt``, a driver failure) is kept for
        the waiter or the scope's exit, and it goes on. Should it end anyway,
        the drain polls by itself (``_drain``)."""
        with trio.CancelScope(shield=True) as cs:
            self._handoff_cs = cs
            self._handoff_task = trio.lowlevel.current_task()
            task_status.started()
            try:
                while not self._closed:
                    try:
                        await self._handoff_loop()
                    except trio.Cancelled:
                        raise
                    except BaseException as exc:
                        self._handoff_failed(exc)
                        # back off a failing driver instead of spinning on it
                        await trio.sleep(min(0.1, 0.0005 * 2 ** min(self._handoff_errors, 8)))
            finally:
                self._handoff_task = None
                drain = self._drain_event
                if drain is not None:
                    drain.set()

    async def _handoff_loop(self) -> None:
        """The handoff's work, until it is cancelled at exit or something
        raises (then ``_handoff`` keeps the error and comes back here)."""
        streams = self._streams
        while True:
            # Retiring or running a host closure can complete work on a stream
            # scanned earlier (a gate opens, the device moves on): rescan until
            # a pass finds nothing, or that wakeup is lost.
            while self._scan():
                pass
            if self._handoff_errors:
                self._handoff_errors = 0  # a pass went through: the driver recovered
            heads = [s._pending[0].marker for s in streams if s._pending]
            if not heads:
                drain = self._drain_event
                if drain is not None:
                    drain.set()
                idle = self._idle = trio.Event()
                await idle.wait()
            else:
                await self._driver.wait_for_progress(heads)  # type: ignore[arg-type]

    def _handoff_failed(self, exc: BaseException) -> None:
        """Keep an error raised inside the handoff for the scope's exit."""
        self._handoff_errors += 1
        if self._handoff_errors <= 3:  # a driver failing on every pass: keep the first few
            self._orphan_errors.append(exc)

    def _scan(self) -> bool:
        """Retire what completed, per stream in order; True if anything did."""
        self._flush_all()
        progressed = False
        gc = self._gc_releases
        while gc:
            self._release_handle(gc.popleft())
        poll = self._driver.poll_marker
        for stream in self._streams:
            pending = stream._pending
            while pending:
                head = pending[0]
                assert head.marker is not None
                try:
                    p = poll(head.marker)
                except Exception as exc:  # the driver cannot tell: completion unknown
                    p = Poll(MarkerState.UNKNOWN, exc)
                if p.state is MarkerState.PENDING:
                    break
                pending.popleft()
                progressed = True
                if type(head) is HostStep:
                    self._run_host_step(head, p)
                else:
                    self._retire(head, p)
        return progressed

    def _run_host_step(self, step: HostStep, p: Poll) -> None:
        sub = step.submission
        self._host_steps -= 1
        if p.state is MarkerState.DONE:
            try:
                step.result._resolve(step.fn(*step.args))
            except BaseException as exc:  # KeyboardInterrupt too: it reaches the waiter or the exit
                if sub.error is None:
                    sub.error = exc
                else:
                    self._orphan_errors.append(exc)
        elif p.state is MarkerState.FAILED:
            if sub.error is None:
                sub.error = p.error
        else:
            sub.unknown = p.error or CompletionUnknownError("unknown completion")
        try:
            self._driver.open_gate(step.gate)
        except Exception as exc:
            sub.unknown = exc

    def _retire(self, sub: Submission, p: Poll) -> None:
        if p.state is MarkerState.UNKNOWN or sub.unknown is not None:
            self._quarantine_submission(sub, p.error or sub.unknown)
            return
        if p.state is MarkerState.FAILED:
            err = p.error or RuntimeError("work failed")
            if sub.error is None:
                sub.error = err
            elif sub.error is not err:
                self._orphan_errors.append(err)
        elif sub.error is None:
            for fin in sub.finishers:
                try:
                    fin()
                except BaseException as exc:
                    sub.error = exc
                    break
        for alloc in sub.leases:
            alloc.active -= 1
            if alloc.last_writer is sub:
                alloc.last_writer = None
            alloc.readers.pop(sub, None)
            if alloc.scope is self:
                self._maybe_free(alloc)
            else:  # a cross-scope copy's lease on another scope's memory
                release_foreign(alloc)
        sub.owners.clear()
        sub.finishers.clear()
        sub.leases.clear()
        sub.op = None  # a kept future must not pin the op's arrays
        self._settle(sub, SubState.FAILED if sub.error is not None else SubState.DONE)

    def _settle(self, sub: Submission, state: SubState) -> None:
        sub.state = state
        self._in_flight -= 1
        self._completed += 1
        s = sub.stream
        s._in_flight -= 1
        s._completed += 1
        if sub.error is not None:
            self._failed += 1
            if not sub.observed:
                self._unobserved[sub] = None
        event = sub.event
        if event is not None:
            event.set()

    def _quarantine_submission(
        self, sub: Submission, cause: BaseException | None, *, report: bool = True
    ) -> None:
        """Leak ``sub``'s owners and leases on purpose. ``report=False`` (drain
        timeout: the ResourceWarning reports it) keeps the error off the exit
        group; awaiting the future still raises it."""
        err = CompletionUnknownError(
            f"completion of {sub.label} on stream {sub.stream.index} could not be established"
            + (f": {cause}" if cause is not None else "")
            + "; its memory and resources are quarantined and will never be freed"
        )
        err.__cause__ = cause
        if sub.error is not None and sub.observed:
            if report:
                self._orphan_errors.append(err)
        else:
            sub.error = err
            if not report:
                sub.observed = True
        for alloc in sub.leases:
            if alloc.state is AllocState.LIVE:
                alloc.state = AllocState.QUARANTINED
            owner = alloc.scope  # counted where the memory lives
            owner._quarantined_leases += 1
            if owner is not self:
                release_foreign(alloc)  # leaked with it: its owner stops waiting for it
        self._quarantine.append(sub)
        self._settle(sub, SubState.QUARANTINED)

    # ------------------------------------------------------------------ exit
    def _work_remains(self) -> bool:
        return bool(self._in_flight) or any(s._pending or s._unmarked for s in self._streams)

    async def _drain(self, timeout: float | None) -> None:
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                # extensions first (exports end at exit: their leases retire
                # below; other scopes' copies of our memory finish), then the
                # work in flight, until both are quiet
                for ext in list(self._extensions.values()):
                    await ext.drain()
                if not self._work_remains():
                    break
                while self._work_remains():
                    if self._handoff_task is not None:
                        self._drain_event = trio.Event()
                        self._wake()
                        await self._drain_event.wait()
                    else:  # the handoff task is gone: never wait for it, poll here
                        await self._drain_step()
        self._drain_event = None

    async def _drain_step(self) -> None:
        try:
            while self._scan():
                pass
            heads = [s._pending[0].marker for s in self._streams if s._pending]
            if heads:
                await self._driver.wait_for_progress(heads)  # type: ignore[arg-type]
            else:  # in flight, but nothing to poll (an export not yet released)
                await trio.sleep(0.001)
        except trio.Cancelled:
            raise
        except BaseException as exc:
            self._handoff_failed(exc)
            await trio.sleep(0.001)

    def _abandon_in_flight(self, timeout: float | None) -> None:
        """Quarantine what is still in flight after the drain timeout, after
        one last look: work the device finished meanwhile is retired, not
        leaked (``drain_timeout=0`` waits for nothing, but polls)."""
        abandoned = 0
        try:
            while self._scan():
                pass
        except BaseException as exc:  # pragma: no cover - _scan keeps its own errors
            self._handoff_failed(exc)
        self._flush_all()
        for stream in self._streams:
            pending = stream._pending
            while pending:
                head = pending.popleft()
                if type(head) is HostStep:
                    self._host_steps -= 1
                    head.submission.unknown = CompletionUnknownError("host closure never ran")
                    try:
                        self._driver.open_gate(head.gate)
                    except Exception:  # pragma: no cover - best effort
                        pass
                else:
                    assert isinstance(head, Submission)
                    abandoned += 1
                    self._quarantine_submission(
                        head,
                        TimeoutError(f"still in flight when drain_timeout={timeout} s passed"),
                        report=False,
                    )
        self._timed_out += abandoned
        if abandoned:
            warnings.warn(
                ResourceWarning(
                    f"trio_cuda scope exited with {abandoned} submission(s) still in flight after "
                    f"drain_timeout={timeout} s; their memory, streams and driver state are quarantined "
                    f"(leaked, never freed)"
                ),
                stacklevel=3,
            )
