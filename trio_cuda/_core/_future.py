"""Futures: the pending result of a submission, and awaiting it.

Invariants:

* Awaiting a future never changes what is retained: cancelling, dropping or
  forgetting it leaves the submission to the scope's completion handoff.
* A future is awaited, and its statistics read while its scope is open, only
  from the Trio run (thread) that owns its scope.
* A waiting task that observes its submission's completion retires the
  scope's completed work itself, in stream order, with no await between the
  look and the retirement; it parks (and the handoff task takes over) only
  when the work is still running, a host closure is due, or it is cancelled.
"""

from __future__ import annotations

import threading
import weakref
from _thread import get_ident
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import attrs
import trio

from ._array import DeviceArray
from ._final import NoPublicConstructor, final
from ._ops import HostResult, resolve_output
from ._submit import TERMINAL, Submission, SubState
from ._trio_internals import current_run

if TYPE_CHECKING:
    from ._scope import ResourceScope
    from ._stream import Stream

__all__ = ["DeviceFuture", "FutureStatistics", "check_reader", "wrong_caller"]

U = TypeVar("U")
#: a future's output type (covariant, as a DeviceOp's)
T_co = TypeVar("T_co", covariant=True)


@final
@attrs.frozen
class FutureStatistics:
    """A snapshot of one submission (``fut.statistics()``)."""

    #: ``"in_flight"``, ``"done"``, ``"failed"`` or ``"quarantined"`` (its
    #: completion is unknown: it keeps its leases for good)
    state: str
    #: the index of the stream it was submitted on (:attr:`Stream.index <trio_cuda.Stream.index>`)
    stream: int
    #: the leases it holds, one per allocation: released when it retires (0
    #: then), kept forever once it is quarantined
    leases: int
    #: bytes of the allocations it holds leases on (whole allocations, each
    #: counted once; only part of one may be leased)
    retained_bytes: int


def wrong_caller(what: str, scope: ResourceScope, *, how: str | None = None) -> RuntimeError:
    """The error for a scope (or one of its futures or graphs) used outside
    the Trio run that opened it. ``what`` names the call; the message names
    the scope's thread and the caller's and, from a thread with no Trio run,
    how to make the call on the scope's loop: ``how`` is that call
    (``"trio.from_thread.run_sync(fut.statistics)"``); without it the message
    names ``run_sync`` for a synchronous call and ``run`` for an async one.
    The wording is ``ResourceScope.statistics()``'s."""
    names = {t.ident: t.name for t in threading.enumerate()}
    loop = names.get(scope._thread, f"thread {scope._thread}")
    mine = threading.current_thread().name
    if current_run() is not None:
        where = (
            f"another Trio run, on thread {mine!r}; a scope belongs to the run (and thread) that opened it"
        )
    else:
        if how is None:
            how = "trio.from_thread.run_sync() (trio.from_thread.run() for an async call)"
        where = (
            f"thread {mine!r}, which runs no Trio loop; call it on that loop: {how} from a thread "
            "Trio started (trio.to_thread.run_sync), with trio_token= from any other thread"
        )
    return RuntimeError(
        f"{what}: expected a call from the Trio run that opened {scope!r} (on thread {loop!r}), "
        f"got one from {where}"
    )


def check_reader(what: str, scope: ResourceScope, how: str) -> None:
    """Refuse a read of tables the loop of ``scope`` changes (a future's or a
    graph's statistics) from another thread or Trio run while the scope is
    open, as ``ResourceScope.statistics()`` does; once the scope has closed,
    nothing changes them and they may be read anywhere."""
    if get_ident() != scope._thread and not scope._closed:
        raise wrong_caller(what, scope, how=how)


@final
class DeviceFuture(Generic[T_co], metaclass=NoPublicConstructor):
    """The pending result of ``scope.submit(op)``.

    ``await fut.wait()`` returns the op's output once the GPU completed the
    work, or raises its error. Dropping or forgetting a future is safe: the
    scope keeps the submission, and an error nobody observed is raised when
    the scope exits.
    """

    __slots__ = ("__weakref__", "_sub")

    _obtain = "use scope.submit()"

    _sub: Submission

    @classmethod
    def _create(cls, sub: Submission) -> DeviceFuture[Any]:
        self = object.__new__(cls)
        self._sub = sub
        return self

    def _watch(self) -> None:
        """Traced scopes: record it if this future is dropped while its work
        is in flight (rule 4)."""
        weakref.finalize(self, _dropped, self._sub)

    def done(self) -> bool:
        """True once the work completed and was retired (or quarantined)."""
        return self._sub.state in TERMINAL

    @property
    def stream(self) -> Stream:
        """The stream the work was submitted to."""
        return self._sub.stream

    @overload
    async def wait(self: DeviceFuture[HostResult[U]]) -> U: ...  # a host closure's value
    @overload
    async def wait(self) -> T_co: ...
    async def wait(self) -> Any:
        """Wait, without blocking the loop, for the work to complete; return
        its output or raise its error. Cancelling this wait does not cancel
        or release the GPU work.

        The waiting task observes the completion itself where it can, and
        then retires the completed work of the scope's streams in stream
        order (see the lifetime chapter, rule 10)."""
        sub = self._sub
        scope = sub.scope
        if get_ident() != scope._thread:
            raise wrong_caller("wait", scope, how="trio.from_thread.run(fut.wait)")
        if sub.state in TERMINAL:
            await trio.lowlevel.checkpoint()
        else:
            await scope._completion.observe(sub)
        return outcome(sub)

    @overload
    def wait_nowait(self: DeviceFuture[HostResult[U]]) -> U: ...
    @overload
    def wait_nowait(self) -> T_co: ...
    def wait_nowait(self) -> Any:
        """The output if the work completed; raises ``trio.WouldBlock`` if not.
        A completion nobody observed yet is observed (and retired) here."""
        sub = self._sub
        scope = sub.scope
        # a finished future's outcome marks its error observed in the scope's tables, which
        # the loop changes: from another thread only once the scope has closed
        if get_ident() != scope._thread and (sub.state not in TERMINAL or not scope._closed):
            raise wrong_caller("wait_nowait", scope, how="trio.from_thread.run_sync(fut.wait_nowait)")
        if sub.state not in TERMINAL and not scope._completion.observe_nowait(sub):
            raise trio.WouldBlock
        return outcome(sub)

    def statistics(self) -> FutureStatistics:
        """A snapshot of this submission's state and retention.

        It reads tables the scope's loop changes: from another thread or Trio
        run of an open scope it raises ``RuntimeError`` (a worker thread uses
        ``trio.from_thread.run_sync(fut.statistics)``); once the scope has
        closed, it may be read from any thread."""
        sub = self._sub
        check_reader("statistics", sub.scope, "trio.from_thread.run_sync(fut.statistics)")
        state = sub.state.value
        return FutureStatistics(state, sub.stream.index, len(sub.leases), sum(a.nbytes for a in sub.leases))

    def __repr__(self) -> str:
        return f"<DeviceFuture of {self._sub!r}>"


def outcome(sub: Submission) -> Any:
    """What awaiting settled work gives: its output, or its error raised
    (which then counts as observed: the exit does not raise it again)."""
    if sub.error is not None:
        sub.scope._completion.observed(sub)
        raise sub.error
    out = sub.output
    if out is None or type(out) is DeviceArray:  # a launch's output, as it is
        return out
    return resolve_output(out)


@trio.lowlevel.enable_ki_protection  # (run by the collector wherever the future is dropped)
def _dropped(sub: Submission) -> None:
    if sub.state is SubState.IN_FLIGHT:
        tr = sub.scope._tracer
        if tr is not None:
            tr.emit("drop", "dropped future", sub.scope._trace_id, sub.stream.index, sub.id)
