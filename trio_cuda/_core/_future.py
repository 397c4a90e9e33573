"""Futures: the pending result of a submission, and awaiting it.

Invariants:

* Awaiting a future never changes what is retained: cancelling, dropping or
  forgetting it leaves the submission to the scope's completion handoff.
* A future is awaited only from the Trio run (thread) that owns its scope.
* The inline spin polls the submission's own marker only when no other task
  is ready to run; retirement (leases, memory) still happens in stream order.
"""

from __future__ import annotations

import time
from _thread import get_ident
from typing import TYPE_CHECKING, Any, Generic, TypeVar, final

import attrs
import trio

from ._driver import MarkerState
from ._final import NoPublicConstructor
from ._ops import resolve_output
from ._submit import TERMINAL, Submission, SubState

if TYPE_CHECKING:
    from ._scope import ResourceScope
    from ._stream import Stream

__all__ = ["DeviceFuture", "FutureStatistics", "wrong_caller"]

T = TypeVar("T")


@attrs.frozen
class FutureStatistics:
    """A snapshot of one submission (``fut.statistics()``)."""

    state: str  #: "in_flight", "done", "failed" or "quarantined"
    stream: int
    leases: int  #: still held (released when the handoff task retires the work)
    retained_bytes: int


def _find_run_context() -> Any:
    """Trio's run context, to read the run queue without the ~2 µs of
    ``current_statistics()``; None on Trio versions without it (no spinning)."""
    try:
        from trio._core import _run
    except ImportError:  # pragma: no cover
        return None
    return getattr(_run, "GLOBAL_RUN_CONTEXT", None)


_RUN_CONTEXT: Any = _find_run_context()


def _current_runner() -> object:
    """The Trio run of the calling thread (an opaque identity), or None in a
    thread with no Trio run (a worker thread, or outside ``trio.run``)."""
    if _RUN_CONTEXT is not None:
        try:
            return _RUN_CONTEXT.runner
        except AttributeError:
            return None
    try:  # pragma: no cover - Trio without the run context
        return trio.lowlevel.current_trio_token()
    except RuntimeError:  # pragma: no cover
        return None


def wrong_caller(what: str, scope: ResourceScope) -> RuntimeError:
    """The error for a scope used outside the Trio run that opened it."""
    if _current_runner() is None:
        where = "a thread with no Trio run (a worker thread?); use trio.from_thread.run_sync() to call it"
    else:
        where = "another Trio run; a scope belongs to the run (and thread) that opened it"
    return RuntimeError(
        f"{what}: expected a call from the Trio run that opened {scope!r}, got one from {where}"
    )


def _others_runnable(handoff: object) -> bool:
    """True when Trio tasks other than the scope's handoff task are ready to
    run: then spinning would delay them, so a waiter parks at once."""
    try:
        runq = _RUN_CONTEXT.runner.runq
    except AttributeError:  # pragma: no cover
        return True
    n = len(runq)
    return n > 1 or (n == 1 and runq[0] is not handoff)


@final
class DeviceFuture(Generic[T], metaclass=NoPublicConstructor):
    """The pending result of ``scope.submit(op)``.

    ``await fut.wait()`` returns the op's output once the GPU completed the
    work, or raises its error. Dropping or forgetting a future is safe: the
    scope keeps the submission, and an error nobody observed is raised when
    the scope exits.
    """

    __slots__ = ("_sub",)

    _obtain = "use scope.submit()"

    _sub: Submission

    @classmethod
    def _create(cls, sub: Submission) -> DeviceFuture[T]:
        self = object.__new__(cls)
        self._sub = sub
        return self

    def done(self) -> bool:
        """True once the work completed (or was quarantined)."""
        sub = self._sub
        return sub.early or sub.state in TERMINAL

    @property
    def stream(self) -> Stream:
        """The stream the work was submitted to."""
        return self._sub.stream

    async def wait(self) -> T:
        """Wait, without blocking the loop, for the work to complete; return
        its output or raise its error. Cancelling this wait does not cancel
        or release the GPU work."""
        sub = self._sub
        scope = sub.scope
        if get_ident() != scope._thread:
            raise wrong_caller("wait", scope)
        if sub.state not in TERMINAL:
            if scope._spin and not _others_runnable(scope._handoff_task) and self._spin():
                await trio.lowlevel.checkpoint()
                return resolve_output(sub.output)  # type: ignore[return-value]
            if sub.marker is None:
                sub.scope._flush(sub.stream)  # someone waits: record the marker now
            event = sub.event
            if event is None:
                event = sub.event = trio.Event()
            await event.wait()
        else:
            await trio.lowlevel.checkpoint()
        return self._outcome()

    def _spin(self) -> bool:
        """Inline spin budget: when no other task is ready to run, poll this
        submission's marker for a few microseconds (the driver's
        ``await_spin``) before parking, so a short kernel's result is returned
        without a round trip through the handoff task. Retirement (leases,
        memory) still happens there, in order."""
        sub = self._sub
        if sub.finishers or sub.error is not None or sub.state is not SubState.IN_FLIGHT:
            return False
        scope = sub.scope
        if sub.marker is None:
            scope._flush(sub.stream)
        marker = sub.marker
        if marker is None:
            return False
        poll = scope._driver.poll_marker
        deadline = time.perf_counter() + scope._spin
        while True:
            state = poll(marker).state
            if state is MarkerState.DONE:
                sub.early = sub.error is None
                return sub.early
            if state is not MarkerState.PENDING or time.perf_counter() >= deadline:
                return False

    def wait_nowait(self) -> T:
        """The output if the work completed; raises ``trio.WouldBlock`` if not."""
        sub = self._sub
        if sub.state not in TERMINAL:
            if sub.early and sub.error is None:
                return resolve_output(sub.output)  # type: ignore[return-value]
            raise trio.WouldBlock
        return self._outcome()

    def _outcome(self) -> T:
        sub = self._sub
        if sub.error is not None:
            sub.observed = True
            sub.scope._unobserved.pop(sub, None)
            raise sub.error
        return resolve_output(sub.output)  # type: ignore[return-value]

    def statistics(self) -> FutureStatistics:
        """A snapshot of this submission's state and retention."""
        sub = self._sub
        state = "done" if sub.early and sub.state is SubState.IN_FLIGHT else sub.state.value
        return FutureStatistics(state, sub.stream.index, len(sub.leases), sum(a.nbytes for a in sub.leases))

    def __repr__(self) -> str:
        return f"<DeviceFuture of {self._sub!r}>"
