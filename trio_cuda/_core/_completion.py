"""Completion: markers, the completion-handoff task, retirement and the drain.

Invariants:

* Completion markers follow the work they mark on its stream: one per
  submission, or one per burst when the driver batches them. A marker that
  cannot be recorded makes its submissions' completion unknown.
* Exactly one completion-handoff task per scope, shielded from outside
  cancellation, polls markers, runs host closures and
  retires submissions, per stream in completion (FIFO) order. It never blocks
  the loop (it sleeps in the driver's ``wait_for_progress``) and it never dies:
  what user code or the driver raises there is kept for the waiter or the exit.
  It runs in the nursery of the Trio run's scope host (``_manager``), not in
  the entering task's, so a scope may exit in another task than it entered;
  the scope's exit waits until it has ended.
* Retiring releases leases and owners; memory whose last lease retired is freed
  (``MemoryTable``). Work whose completion is unknown is quarantined instead:
  its owners and leases are leaked on purpose, never released.
* The drain at exit waits for every submission, and polls by itself if the
  handoff task is gone; after ``drain_timeout`` it looks once more, then
  quarantines what is still in flight with a ``ResourceWarning``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING, Final

import outcome
import trio
from trio.lowlevel import (
    Abort,
    checkpoint,
    current_task,
    enable_ki_protection,
    reschedule,
    wait_task_rescheduled,
)

from . import _compiled, _memory, _trio_internals
from ._array import AllocState
from ._dlpack import UNCONSUMED, sweep_dropped
from ._driver import PENDING as _PENDING
from ._driver import MarkerState, Poll
from ._errors import CompletionUnknownError
from ._final import final
from ._stream import Stream
from ._submit import TERMINAL, HostStep, Submission, SubState
from ._trio_internals import others_runnable

if TYPE_CHECKING:
    from ._array import Allocation
    from ._driver import DeviceContext
    from ._extension import Extensions
    from ._memory import MemoryTable
    from ._scope import ResourceScope
    from ._trace import Tracer

__all__ = ["Completion", "others_runnable"]

log = logging.getLogger("trio_cuda")

_IN_FLIGHT = SubState.IN_FLIGHT


@final
class Completion:
    """How a scope's work completes (a component of
    :class:`~trio_cuda.ResourceScope`): the one owner of every submission's
    state once it was enqueued, of the scope's in-flight accounting, of the
    errors nobody observed yet and of the quarantine."""

    __slots__ = (
        "batch",
        "by_waiters",
        "closed",
        "completed",
        "drain_event",
        "driver",
        "exiting",
        "extensions",
        "failed",
        "handoff_cs",
        "handoff_ended",
        "handoff_error",
        "handoff_errors",
        "handoff_task",
        "host_steps",
        "idle",
        "in_flight",
        "leak_driver",
        "look_budget",
        "memory",
        "orphan_errors",
        "quarantined",
        "scope",
        "spin",
        "streams",
        "timed_out",
        "trace_id",
        "tracer",
        "unflushed",
        "unobserved",
    )

    def __init__(
        self, scope: ResourceScope, driver: DeviceContext, memory: MemoryTable, extensions: Extensions
    ) -> None:
        self.scope = scope
        self.driver = driver
        self.memory = memory
        self.extensions = extensions
        caps = driver.capabilities
        #: the driver batches markers (one per stream per burst)
        self.batch = caps.batch_markers
        #: how long a lone waiter busy-polls its marker, and how long a
        #: waiter keeps looking while other tasks run (``observe``)
        self.spin = caps.await_spin
        self.look_budget = caps.await_budget
        self.streams: tuple[Stream, ...] = ()
        #: streams with submissions not yet behind a marker
        self.unflushed: list[Stream] = []
        #: set while the handoff sleeps with nothing to poll; ``wake`` sets it
        self.idle: trio.Event | None = None
        self.drain_event: trio.Event | None = None
        self.handoff_cs: trio.CancelScope | None = None
        self.handoff_task: trio.lowlevel.Task | None = None
        self.handoff_errors = 0
        #: set once the handoff task ended; what it raised (it never should)
        self.handoff_ended = trio.Event()
        self.handoff_error: BaseException | None = None
        self.in_flight = 0
        self.completed = 0
        self.by_waiters = 0
        self.failed = 0
        self.host_steps = 0
        #: submissions quarantined because the exit's drain gave up on them
        self.timed_out = 0
        #: something may still use the driver state after the exit (a graph
        #: update in a worker thread): modules, streams and context leak
        self.leak_driver = False
        #: failed submissions whose error nobody observed yet
        self.unobserved: dict[Submission, None] = {}
        #: errors with no submission to carry them (raised at exit)
        self.orphan_errors: list[BaseException] = []
        #: submissions whose completion is unknown: their owners and leases leak
        self.quarantined: list[Submission] = []
        #: the exit began (retirements are the exit's), and it ended
        self.exiting = False
        self.closed = False
        self.tracer: Tracer | None = None
        self.trace_id = 0

    # ------------------------------------------------------------------ errors
    def observed(self, sub: Submission) -> None:
        """``sub``'s error reached a caller: it is not raised again at exit."""
        sub.observed = True
        self.unobserved.pop(sub, None)

    def add_error(self, exc: BaseException) -> None:
        """Keep an error that no submission carries, for the exit."""
        self.orphan_errors.append(exc)

    def take_errors(self) -> list[BaseException]:
        """The errors nobody observed (for the exit), and forget them."""
        errors: list[BaseException] = [s.error for s in self.unobserved if s.error is not None]
        errors.extend(self.orphan_errors)
        self.unobserved.clear()
        self.orphan_errors.clear()
        return errors

    # ------------------------------------------------------------------ exports
    def hold_exported(self, sub: Submission, placeholder: Stream) -> None:
        """``sub`` holds an export's lease for a foreign consumer: it waits
        on ``placeholder`` (no stream of the pool) until the consumer
        releases it (``resume_exported``)."""
        sub.state = SubState.EXPORTED
        sub.stream = placeholder

    def resume_exported(self, sub: Submission, stream: Stream) -> None:
        """The consumer released the export: its submission is enqueued on
        ``stream`` now, and put in flight with ``finish``."""
        sub.stream = stream
        sub.state = SubState.ENQUEUING

    def quarantine_exported(self, sub: Submission | None, alloc: Allocation) -> None:
        """An export abandoned at exit (``_export``): its lease on ``alloc``
        and its submission, if any, are leaked for good."""
        alloc.table.quarantine_lease(alloc)
        if sub is not None:
            sub.state = SubState.QUARANTINED
            self.quarantined.append(sub)

    # ------------------------------------------------------------------ markers
    @enable_ki_protection
    def finish(self, sub: Submission, out: object, *, wake: bool = True) -> None:
        """Put an enqueued submission in flight. Its completion marker is
        recorded now, or, when the driver batches markers, once for every
        submission of the stream since the last one (see :meth:`_flush`).
        ``wake=False`` (``run``: its waiter observes the completion itself,
        or wakes the handoff when it cannot) leaves the handoff asleep."""
        s = sub.stream
        sub.output = out
        sub.state = SubState.IN_FLIGHT
        s._in_flight += 1
        self.in_flight += 1
        if not s._unmarked:
            self.unflushed.append(s)
        s._unmarked.append(sub)
        if not self.batch:
            self.flush(s)
        self.driver.notify_submitted()
        if wake:
            idle = self.idle
            if idle is not None:
                self.idle = None
                idle.set()

    def launched(self, sub: Submission, out: object, traced: bool) -> None:
        """``finish(sub, out, wake=False)`` for a lone kernel launch, the
        hot path (its caller, ``ResourceScope._submit_launch``, is
        KI-protected): the launch enqueued work. A traced scope records the
        launch first, then calls :meth:`submitted`."""
        sub.dirty = True
        sub.output = out
        sub.state = _IN_FLIGHT
        s = sub.stream
        s._in_flight += 1
        self.in_flight += 1
        unmarked = s._unmarked
        if not unmarked:
            self.unflushed.append(s)
        unmarked.append(sub)
        if not traced:
            if not self.batch:
                self.flush(s)
            self.driver.notify_submitted()

    def submitted(self, s: Stream) -> None:
        """The end of ``finish`` once a submission on ``s`` is in flight:
        its marker (unless markers are batched), and the driver told."""
        if not self.batch:
            self.flush(s)
        self.driver.notify_submitted()

    @enable_ki_protection
    def flush(self, s: Stream) -> None:
        """Record one completion marker after the stream's unmarked
        submissions. If that fails, their completion cannot be established:
        they are quarantined (and a BaseException is raised on)."""
        subs = s._unmarked
        if not subs:
            return
        s._unmarked = []
        try:
            marker = self.driver.record_marker(s.handle)
        except BaseException as exc:
            # (taken off the unmarked list: without this, nothing would ever
            # retire them, and the exit would wait for them for good)
            for sub in subs:
                self.quarantine_submission(sub, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for sub in subs:
            sub.marker = marker
        s._pending.extend(subs)

    def flush_all(self) -> None:
        streams = self.unflushed
        if streams:
            self.unflushed = []
            for s in streams:
                self.flush(s)

    def wake(self) -> None:
        idle = self.idle
        if idle is not None:
            self.idle = None
            idle.set()

    # ------------------------------------------------------------------ waiters
    @enable_ki_protection
    async def observe(self, sub: Submission, t0: float = 0.0) -> None:
        """Wait until ``sub`` settled: the waiter's side of rule 10.

        The waiter checkpoints while the GPU runs (a lone waiter records its
        marker first, so it queues right behind the work; with other tasks
        runnable the first look records one marker per stream for everyone).
        Then it looks at its marker; once it completed, the waiter retires
        the completed prefix of every stream itself, in stream order, with no
        await between the look and the retirement, and returns without waking
        the handoff. While the marker is pending it looks again after each
        checkpoint (other tasks runnable: up to ``_look_budget`` seconds) or
        busy-polls it (nobody else runnable: up to ``_spin``). It parks, and
        the handoff takes over, when its marker is still pending after that,
        when a host closure is due, or when it is cancelled (the submission
        stays retained; the handoff retires it). A traced scope records the
        wait (``trace_await``), from ``t0`` where the caller began it."""
        if self.tracer is not None and not t0:
            t0 = perf_counter()
        try:
            if sub.marker is None and not self.host_steps and not others_runnable():
                self.flush(sub.stream)
            await checkpoint()
            deadline = 0.0
            spun = False
            poll = self.driver.poll_marker
            pending = MarkerState.PENDING
            while sub.state is SubState.IN_FLIGHT:
                if self.host_steps:
                    break  # a host closure is due: only the handoff runs them
                marker = sub.marker
                if marker is None:
                    self.flush_all()  # one marker per stream for this pass
                    continue  # (recording it may have quarantined the submission)
                try:
                    state = poll(marker).state
                except Exception:  # the driver cannot tell: let the scan settle it
                    state = MarkerState.UNKNOWN
                if state is not pending:
                    done = self.completed
                    while self.scan():
                        pass
                    self.by_waiters += self.completed - done
                    continue
                if others_runnable():
                    now = perf_counter()
                    if not deadline:
                        deadline = now + self.look_budget
                    elif now >= deadline:
                        break
                    await checkpoint()
                elif spun or self.spin <= 0:
                    break
                else:  # nobody else wants the loop: busy-poll a little
                    spun = True
                    end = perf_counter() + self.spin
                    while poll(marker).state is pending and perf_counter() < end:
                        pass
            else:
                return
            await self.park(sub)
        except BaseException as exc:
            self.left(sub, exc)
            raise
        finally:
            if t0:
                self.trace_await(sub, t0)

    def left(self, sub: Submission, exc: BaseException) -> None:
        """An awaiting task leaves ``sub`` with ``exc`` (cancelled, or
        failed): if the work is in flight, the handoff is the backstop."""
        if sub.state is SubState.IN_FLIGHT:
            self.wake()
            if isinstance(exc, trio.Cancelled):
                self.cancelled_waiter(sub)

    def retirer(self) -> str:
        """Who is retiring work now (traces): the handoff task, the exit, or
        an awaiting task that observed the completion itself."""
        task = current_task()
        if task is self.handoff_task:
            return "handoff"
        return "exit" if self.exiting else "waiter"

    def trace_await(self, sub: Submission, t0: float) -> None:
        """Record an awaiting task's wait for ``sub`` (traced scopes): its
        outcome is "ok", "error", or "left" (cancelled or failed while the
        work was still in flight)."""
        tr = self.tracer
        if tr is not None:
            state = sub.state
            outcome = "left" if state is SubState.IN_FLIGHT else "ok" if sub.error is None else "error"
            tr.emit(
                "await",
                "await",
                self.trace_id,
                sub.stream.index,
                sub.id,
                args={"task": current_task().name, "t0": t0, "outcome": outcome},
            )

    def cancelled_waiter(self, sub: Submission) -> None:
        """A waiter was cancelled while its work is in flight (rule 3)."""
        log.info(
            "a task awaiting %s was cancelled with the work in flight; the scope keeps it until "
            "the device finished it",
            sub.label,
        )
        tr = self.tracer
        if tr is not None:
            task = current_task()
            tr.emit("cancel", "cancelled", self.trace_id, sub.stream.index, sub.id, args={"task": task.name})

    @enable_ki_protection
    def observe_nowait(self, sub: Submission) -> bool:
        """``_observe`` without waiting: look once; True if ``sub`` settled."""
        if sub.state is SubState.IN_FLIGHT and not self.host_steps:
            if sub.marker is None:
                self.flush_all()
            marker = sub.marker
            if marker is not None:
                try:
                    state = self.driver.poll_marker(marker).state
                except Exception:
                    state = MarkerState.UNKNOWN
                if state is not MarkerState.PENDING:
                    while self.scan():
                        pass
        return sub.state in TERMINAL

    async def park(self, sub: Submission) -> None:
        """Sleep until ``sub`` settles; whoever retires it reschedules us.
        Cancellation takes the task off the submission first, so no later
        retirement reschedules a task that no longer waits."""
        task = current_task()
        waiter = sub.waiter
        if waiter is None:
            sub.waiter = task
        elif isinstance(waiter, list):
            waiter.append(task)
        else:  # a second task awaits the same future
            sub.waiter = [waiter, task]
        self.wake()

        def abort(_: object) -> Abort:
            w = sub.waiter
            if w is task:
                sub.waiter = None
            elif isinstance(w, list) and task in w:
                w.remove(task)
            return Abort.SUCCEEDED

        await wait_task_rescheduled(abort)

    @trio.lowlevel.enable_ki_protection  # Ctrl-C goes to the program's tasks, never here
    async def handoff(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The backstop that retires what nobody awaits. It must never die:
        anything raised while it retires work (a host closure or a simulated
        reference raising ``KeyboardInterrupt``, a driver failure) is kept for
        the waiter or the scope's exit, and it goes on. Should it end anyway,
        the drain polls by itself (``_drain``)."""
        with trio.CancelScope(shield=True) as cs:
            self.handoff_cs = cs
            self.handoff_task = trio.lowlevel.current_task()
            task_status.started()
            try:
                while not self.closed:
                    try:
                        await self.handoff_loop()
                    except trio.Cancelled:
                        raise
                    except BaseException as exc:
                        self.handoff_failed(exc)
                        # back off a failing driver instead of spinning on it
                        await trio.sleep(min(0.1, 0.0005 * 2 ** min(self.handoff_errors, 8)))
            finally:
                self.handoff_task = None
                drain = self.drain_event
                if drain is not None:
                    drain.set()

    async def run_handoff(self) -> None:
        """The handoff task's body, in the scope host's nursery. What it
        raises (it never should) is kept for the exit, not raised into the
        host, whose nursery serves every scope of the run."""
        try:
            await self.handoff()
        except trio.Cancelled:  # pragma: no cover - it is shielded; never swallowed anyway
            raise
        except BaseException as exc:  # pragma: no cover - the handoff never dies
            self.handoff_error = exc
        finally:
            self.handoff_ended.set()

    async def handoff_loop(self) -> None:
        """The handoff's work, until it is cancelled at exit or something
        raises (then ``_handoff`` keeps the error and comes back here)."""
        streams = self.streams
        while True:
            # Retiring or running a host closure can complete work on a stream
            # scanned earlier (a gate opens, the device moves on): rescan until
            # a pass finds nothing, or that wakeup is lost.
            while self.scan():
                pass
            if self.handoff_errors:
                self.handoff_errors = 0  # a pass went through: the driver recovered
            heads = [s._pending[0].marker for s in streams if s._pending]
            if not heads:
                drain = self.drain_event
                if drain is not None:
                    drain.set()
                idle = self.idle = trio.Event()
                await idle.wait()
            else:
                await self.driver.wait_for_progress(heads)  # type: ignore[arg-type]

    def handoff_failed(self, exc: BaseException) -> None:
        """Keep an error raised inside the handoff for the scope's exit."""
        self.handoff_errors += 1
        if self.handoff_errors <= 3:  # a driver failing on every pass: keep the first few
            self.orphan_errors.append(exc)

    @enable_ki_protection
    def scan(self) -> bool:
        """Retire what completed, per stream in order. True when a host
        closure ran: opening its gate can complete work on a stream scanned
        before, so the caller scans again; retiring alone never does. Where
        it was built, the compiled ``scan_streams`` makes these steps."""
        if scan_streams is not None:
            return scan_streams(self)
        self.flush_all()
        progressed = False
        if UNCONSUMED:  # DLPack capsules dropped unconsumed release their exports
            sweep_dropped()
        if self.memory.gc_releases:
            self.memory.release_pending()
        poll = self.driver.poll_marker
        done = MarkerState.DONE
        for stream in self.streams:
            pending = stream._pending
            last: object = None  # a burst shares one marker: poll it once
            p = _PENDING
            while pending:
                head = pending[0]
                marker = head.marker
                if marker is not last:
                    last = marker
                    try:
                        p = poll(marker)  # type: ignore[arg-type]
                    except Exception as exc:  # the driver cannot tell: completion unknown
                        p = Poll(MarkerState.UNKNOWN, exc)
                if p.state is MarkerState.PENDING:
                    break
                pending.popleft()
                if type(head) is HostStep:
                    progressed = True
                    self.run_host_step(head, p)
                elif not (p.state is done and retire_done is not None and retire_done(self, head)):
                    self.retire(head, p)
        return progressed

    def run_host_step(self, step: HostStep, p: Poll) -> None:
        sub = step.submission
        self.host_steps -= 1
        if p.state is MarkerState.DONE:
            try:
                step.result._resolve(step.fn(*step.args))
            except BaseException as exc:  # KeyboardInterrupt too: it reaches the waiter or the exit
                if sub.error is None:
                    sub.error = exc
                else:
                    self.orphan_errors.append(exc)
        elif p.state is MarkerState.FAILED:
            if sub.error is None:
                sub.error = p.error
        else:
            sub.unknown = p.error or CompletionUnknownError("unknown completion")
        try:
            self.driver.open_gate(step.gate)
        except Exception as exc:
            sub.unknown = exc

    @enable_ki_protection
    def retire(self, sub: Submission, p: Poll) -> None:
        if p.state is MarkerState.UNKNOWN or sub.unknown is not None:
            self.quarantine_submission(sub, p.error or sub.unknown)
            return
        if p.state is MarkerState.FAILED:
            err = p.error or RuntimeError("work failed")
            if sub.error is None:
                sub.error = err
            elif sub.error is not err:
                self.orphan_errors.append(err)
        elif sub.error is None and sub.finishers is not None:
            for fin in sub.finishers:
                try:
                    fin()
                except BaseException as exc:
                    sub.error = exc
                    break
        if self.tracer is not None:  # (before the frees it causes)
            self.trace_retire(sub)
        live = AllocState.LIVE
        memory = self.memory
        for alloc in sub.leases:
            alloc.active -= 1
            if alloc.writers:
                alloc.writers.pop(sub, None)
            if alloc.readers:
                alloc.readers.pop(sub, None)  # (an index, if any, drops it lazily)
            if alloc.table is memory:
                # MemoryTable.maybe_free, inline
                if not alloc.active and alloc.handles <= 0 and alloc.state is live:
                    try:
                        memory.free(alloc)
                    except BaseException as exc:  # a warning raised as an error: never half-retire
                        self.orphan_errors.append(exc)
            else:  # a cross-scope copy's lease on another scope's memory
                alloc.table.release_foreign(alloc)
        sub.owners = sub.finishers = None
        sub.leases = ()
        sub.op = None  # a kept future must not pin the op's arrays
        self.settle(sub, SubState.FAILED if sub.error is not None else SubState.DONE)

    def trace_retire(self, sub: Submission) -> None:
        """Record ``sub``'s retirement (traced scopes), named by who observed
        the completion, with its error if it has one."""
        tr = self.tracer
        if tr is not None:
            error = sub.error
            args = None if error is None else {"error": f"{type(error).__name__}: {error}"[:300]}
            tr.emit("retire", self.retirer(), self.trace_id, sub.stream.index, sub.id, args=args)

    @enable_ki_protection
    def settle(self, sub: Submission, state: SubState) -> None:
        sub.state = state
        self.in_flight -= 1
        self.completed += 1
        s = sub.stream
        s._in_flight -= 1
        s._completed += 1
        if sub.error is not None:
            self.failed += 1
            if not sub.observed:
                self.unobserved[sub] = None
        waiter = sub.waiter
        if waiter is not None:
            sub.waiter = None
            if isinstance(waiter, list):
                for task in waiter:
                    reschedule(task)
            else:
                reschedule(waiter)

    def quarantine_submission(
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
                self.orphan_errors.append(err)
        else:
            sub.error = err
            if not report:
                sub.observed = True
        for alloc in sub.leases:
            table = alloc.table  # counted where the memory lives
            table.quarantine_lease(alloc)
            if table is not self.memory:
                table.release_foreign(alloc)  # leaked with it: its owner stops waiting for it
        self.quarantined.append(sub)
        log.warning("%s", err)
        tr = self.tracer
        if tr is not None:
            tr.emit(
                "quarantine",
                "quarantine",
                self.trace_id,
                sub.stream.index,
                sub.id,
                args={"error": str(err)[:300], "allocations": [a.ptr for a in sub.leases]},
            )
        self.settle(sub, SubState.QUARANTINED)

    # ------------------------------------------------------------------ exit
    def work_remains(self) -> bool:
        return bool(self.in_flight) or any(s._pending or s._unmarked for s in self.streams)

    @enable_ki_protection
    async def drain(self, deadline: float) -> None:
        """Wait until nothing of the scope is in flight, or ``deadline`` (on
        Trio's clock) passes. A ``KeyboardInterrupt`` delivered at one of its
        waits propagates with everything still accounted for, so the drain can
        be entered again."""
        with trio.move_on_at(deadline):
            while True:
                # extensions first (exports end at exit: their leases retire
                # below; other scopes' copies of our memory finish), then the
                # work in flight, until both are quiet
                await self.memory.drain_foreign()
                for ext in self.extensions.all():
                    await ext.drain()
                if not self.work_remains():
                    break
                while self.work_remains():
                    if self.handoff_task is not None:
                        self.drain_event = trio.Event()
                        self.wake()
                        await self.drain_event.wait()
                    else:  # the handoff task is gone: never wait for it, poll here
                        await self.drain_step()
        self.drain_event = None

    async def drain_step(self) -> None:
        try:
            while self.scan():
                pass
            heads = [s._pending[0].marker for s in self.streams if s._pending]
            if heads:
                await self.driver.wait_for_progress(heads)  # type: ignore[arg-type]
            else:  # in flight, but nothing to poll (an export not yet released)
                await trio.sleep(0.001)
        except (trio.Cancelled, KeyboardInterrupt):
            raise  # a Ctrl-C delivered here is the exit's to handle (see ScopeManager._drain)
        except BaseException as exc:
            self.handoff_failed(exc)
            await trio.sleep(0.001)

    @enable_ki_protection
    def abandon_in_flight(self, after: str, *, interrupted: bool = False) -> None:
        """Quarantine what is still in flight ``after`` the drain gave up (its
        timeout passed, or a second Ctrl-C stopped it: ``interrupted``), after
        one last look: work the device finished meanwhile is retired, not
        leaked (``drain_timeout=0`` waits for nothing, but polls)."""
        error: type[Exception] = CompletionUnknownError if interrupted else TimeoutError
        abandoned = 0
        try:
            while self.scan():
                pass
        except BaseException as exc:  # pragma: no cover - _scan keeps its own errors
            self.handoff_failed(exc)
        self.flush_all()
        for stream in self.streams:
            pending = stream._pending
            while pending:
                head = pending.popleft()
                if type(head) is HostStep:
                    self.host_steps -= 1
                    head.submission.unknown = CompletionUnknownError("host closure never ran")
                    try:
                        self.driver.open_gate(head.gate)
                    except Exception:  # pragma: no cover - best effort
                        pass
                else:
                    assert isinstance(head, Submission)
                    abandoned += 1
                    self.quarantine_submission(head, error(f"still in flight {after}"), report=False)
        self.timed_out += abandoned
        if abandoned:
            log.warning(
                "%s with %d submission(s) in flight; they are quarantined (their memory is leaked, "
                "never freed)",
                "a second Ctrl-C stopped the exit's drain"
                if interrupted
                else f"{after.removeprefix('after ')} ran out",
                abandoned,
            )
            warnings.warn(
                ResourceWarning(
                    f"trio_cuda scope exited with {abandoned} submission(s) still in flight {after}; "
                    f"their memory, streams and driver state are quarantined (leaked, never freed)"
                ),
                stacklevel=3,
            )


#: the compiled common case of ``Completion.retire`` (``_claunch.retire_done``:
#: work done with nothing but bookkeeping left), where the compiled paths are
#: used (``_compiled``); None retires everything in Python (tests compare both)
retire_done: Callable[[Completion, Submission], bool] | None = None
if _compiled.ext is not None:
    _compiled.ext.configure_retire(Completion, Stream, SubState.DONE)
    retire_done = _compiled.ext.retire_done

#: what ``look`` gives for work still in flight (wait on in ``observe``), and
#: for settled work whose outcome ``outcome()`` gives (an error, an output to resolve)
LOOK_AGAIN: Final = object()
LOOK_SETTLED: Final = object()

#: the compiled ``Completion.scan`` (``_claunch.scan``: the same steps, each
#: retirement and host step through the methods and ``retire_done`` above);
#: None where the pure-Python path runs (tests turn it off)
scan_streams: Callable[[Completion], bool] | None = None
if _compiled.ext is not None:
    _compiled.ext.configure_scan(
        {
            "Completion": Completion,
            "HostStep": HostStep,
            "Stream": Stream,
            "Submission": Submission,
            "MemoryTable": _memory.MemoryTable,
            "Poll": Poll,
            "PENDING": MarkerState.PENDING,
            "DONE": MarkerState.DONE,
            "UNKNOWN": MarkerState.UNKNOWN,
            "IN_FLIGHT": SubState.IN_FLIGHT,
            "PENDING_POLL": _PENDING,
            "AGAIN": LOOK_AGAIN,
            "SETTLED": LOOK_SETTLED,
            "RUN_CONTEXT": _trio_internals._RUN_CONTEXT,
            "completion_module": sys.modules[__name__],
            "flush": Completion.flush,
        }
    )
    scan_streams = _compiled.ext.scan

#: the compiled first look of an awaiting task (``_claunch.look``, used by
#: ``ResourceScope.run``): the output of its settled work, LOOK_SETTLED, or
#: LOOK_AGAIN; None where the pure-Python path runs
look: Callable[[Completion, Submission], object] | None = None
#: what an awaiting task does before its first checkpoint (``_claunch.prepare``:
#: a lone waiter records its marker, as ``observe`` begins)
prepare: Callable[[Completion, Submission], None] | None = None
if _compiled.ext is not None:
    look = _compiled.ext.look
    prepare = _compiled.ext.prepare

#: Trio's run context (``_trio_internals``), for the compiled paths configured elsewhere
RUN_CONTEXT: Final = _trio_internals._RUN_CONTEXT

#: ``Completion.trace_await``, compiled for a plain tracer where the compiled paths are used
#: (``_claunch.trace_await``: the method itself where the class holds another)
trace_awaited: Callable[[Completion, Submission, float], None] = (
    Completion.trace_await if _compiled.ext is None else _compiled.ext.trace_await
)

#: what ``step`` gives where a cancellation may be due: Trio's own checkpoint decides
LOOK_CHECK: Final = object()
#: an awaiting task's checkpoint and first look as one awaitable (``_claunch.step``:
#: ``await checkpoint(); look(c, sub)`` without Trio's checkpoint frames, or LOOK_CHECK);
#: None where the pure-Python path runs, or Trio's checkpoint message was not found
step: Callable[[Completion, Submission], Awaitable[object]] | None = None
if _compiled.ext is not None and (_trap := _trio_internals.checkpoint_message()) is not None:
    _compiled.ext.configure_step(_trap, outcome.Value, LOOK_CHECK)
    step = _compiled.ext.step
