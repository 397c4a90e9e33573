"""The scope's memory table: its allocations, their handles and frees, and
what garbage collection hands back.

Invariants:

* :class:`MemoryTable` is the one owner of a scope's allocation table:
  every allocation enters it through :meth:`~MemoryTable.new` or
  :meth:`~MemoryTable.register`, leaves it through :meth:`~MemoryTable.free`,
  and is quarantined through :meth:`~MemoryTable.quarantine_lease`. Nothing
  else writes ``Allocation.state`` except the lease code it hands memory to.
* Memory is freed only when no handle is open, no lease of any range of it is
  in flight, and it is live (never when quarantined): :meth:`~MemoryTable.maybe_free`
  is the one place that decides (the completion's retirement inlines the same test).
* A handle released off the loop thread (a finalizer, a worker thread) is
  queued for the loop; only the loop touches the table and the driver.
* Releasing the last handle of memory a foreign consumer was given sweeps
  the DLPack capsules dropped unconsumed (``_dlpack.sweep_dropped``): an
  export whose capsule nobody took is then all that keeps the memory, and is
  released now rather than at the scope's next unrelated look.
* A failed free quarantines the memory with a ``ResourceWarning``: a leak is
  preferred to a dangling pointer. Borrowed memory is only let go of.

Its interface (plain names: it is internal) is what the scope, the
completion, arrays and the feature modules use.
"""

from __future__ import annotations

import warnings
from _thread import get_ident
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio
from trio.lowlevel import enable_ki_protection

from ._array import Allocation, AllocState
from ._dlpack import UNCONSUMED, sweep_dropped
from ._final import final

if TYPE_CHECKING:
    from ._driver import DeviceContext
    from ._scope import ResourceScope
    from ._submit import Submission
    from ._trace import Tracer

__all__ = ["MemoryTable"]


def _nothing() -> None:
    pass


@final
class MemoryTable:
    """A scope's allocations (a component of :class:`~trio_cuda.ResourceScope`)."""

    __slots__ = (
        "allocs",
        "closed",
        "driver",
        "foreign",
        "foreign_abandoned",
        "foreign_event",
        "gc_releases",
        "quarantined_leases",
        "scope",
        "thread",
        "token",
        "trace_id",
        "tracer",
        "wake",
    )

    def __init__(
        self,
        scope: ResourceScope,
        driver: DeviceContext,
        token: trio.lowlevel.TrioToken,
        thread: int,
    ) -> None:
        self.scope = scope
        self.driver = driver
        self.token = token
        self.thread = thread
        #: wakes the scope's handoff task (the scope sets ``Completion.wake``)
        self.wake: Callable[[], None] = _nothing
        self.allocs: dict[Allocation, None] = {}
        #: handles released off the loop, for the next look
        self.gc_releases: deque[Allocation] = deque()
        #: leases on this table's memory leaked into quarantine
        self.quarantined_leases = 0
        #: set once the scope closed: finalizers stop queueing releases
        self.closed = False
        self.tracer: Tracer | None = None
        self.trace_id = 0
        #: leases that other scopes' in-flight work (cross-scope copies) holds
        #: on this table's memory; the exit waits for them (``drain_foreign``)
        self.foreign = 0
        self.foreign_event: trio.Event | None = None
        #: the exit gave up on foreign leases: the driver state must leak too
        self.foreign_abandoned = False

    def new(self, ptr: int, nbytes: int) -> Allocation:
        """A new allocation of this scope's memory, not yet registered."""
        return Allocation(self.scope, self, ptr, nbytes)

    def register(self, alloc: Allocation) -> None:
        self.allocs[alloc] = None

    def quarantine_lease(self, alloc: Allocation) -> None:
        """A lease on ``alloc`` (this table's memory) leaks into quarantine
        with work whose completion is unknown: the memory is never freed."""
        if alloc.state is AllocState.LIVE:
            alloc.state = AllocState.QUARANTINED
        self.quarantined_leases += 1

    def release_pending(self) -> None:
        """Release the handles garbage collection handed back (on the loop)."""
        gc = self.gc_releases
        while gc:
            self.release_handle(gc.popleft())

    @enable_ki_protection
    def release_handle(self, alloc: Allocation) -> None:
        if get_ident() != self.thread:  # closed from a worker thread
            self.release_handle_later(alloc)
            return
        alloc.handles -= 1
        if alloc.exports and alloc.handles <= 0 and UNCONSUMED:
            sweep_dropped()  # an export whose capsule was dropped unconsumed: released now
        self.maybe_free(alloc)

    @enable_ki_protection
    def release_handle_later(self, alloc: Allocation) -> None:
        """From a garbage-collection finalizer, possibly on another thread."""
        if self.closed:
            return
        self.gc_releases.append(alloc)
        try:
            self.token.run_sync_soon(self.wake)
        except trio.RunFinishedError:
            pass

    @enable_ki_protection
    def maybe_free(self, alloc: Allocation) -> None:
        if alloc.handles <= 0 and not alloc.active and alloc.state is AllocState.LIVE:
            self.free(alloc)

    @enable_ki_protection
    def free(self, alloc: Allocation) -> None:
        if alloc.borrowed:  # another library's memory: only let go of it
            alloc.state = AllocState.FREED
            alloc.owner = None
            self.allocs.pop(alloc, None)
            tr = self.tracer
            if tr is not None:
                tr.emit("free", "release", self.trace_id, alloc=alloc.ptr, args={"borrowed": True})
            return
        try:
            self.driver.free(alloc.ptr, alloc.nbytes)
        except Exception as exc:
            # Prefer a leak to a dangling pointer.
            alloc.state = AllocState.QUARANTINED
            warnings.warn(
                ResourceWarning(f"freeing {alloc!r} failed ({exc}); the memory is quarantined"), stacklevel=2
            )
            return
        alloc.state = AllocState.FREED
        del self.allocs[alloc]
        tr = self.tracer
        if tr is not None:
            tr.emit("free", "free", self.trace_id, alloc=alloc.ptr, args={"bytes": alloc.nbytes})

    def free_unleased(self) -> None:
        """At exit, after the drain: free every live allocation no lease holds
        (quarantined memory, and memory still leased, stays)."""
        self.gc_releases.clear()
        for alloc in list(self.allocs):
            if alloc.state is AllocState.LIVE and not alloc.active:
                self.free(alloc)

    # ------------------------------------------------------------------ foreign leases
    def add_foreign(self) -> None:
        """Another scope's work took a lease on this table's memory."""
        self.foreign += 1

    def release_foreign(self, alloc: Allocation) -> None:
        """A lease of another scope's work on ``alloc`` was released (retired)
        or leaked (quarantined): free the memory if nothing else uses it, and
        wake the exit if it waits for this."""
        if not self.closed:
            self.maybe_free(alloc)  # only frees LIVE memory without handles and leases
        if self.foreign <= 0:
            return
        self.foreign -= 1
        if self.foreign <= 0 and self.foreign_event is not None:
            self.foreign_event.set()
            self.foreign_event = None

    async def drain_foreign(self) -> None:
        """Sleep until no other scope's in-flight work holds a lease on this
        table's memory (a checkpoint when none does)."""
        await trio.lowlevel.checkpoint()
        while self.foreign > 0:
            ev = self.foreign_event
            if ev is None:
                ev = self.foreign_event = trio.Event()
            await ev.wait()

    def abandon_foreign(self, after: str) -> None:
        """At exit, once the drain gave up: memory that other scopes'
        in-flight work still uses is quarantined, and the scope's driver
        state is leaked with it (``foreign_abandoned``)."""
        if self.foreign <= 0:
            return
        from ._submit import SubState

        def users(alloc: Allocation) -> list[Submission]:
            return [
                u
                for u in (*alloc.readers, *alloc.writers)
                if u.scope is not self.scope and u.state is SubState.IN_FLIGHT
            ]

        held = [a for a in self.allocs if a.active and users(a)]
        scopes = {u.scope for a in held for u in users(a)}
        for a in held:
            if a.state is AllocState.LIVE:
                a.state = AllocState.QUARANTINED
        self.foreign_abandoned = True  # leak modules, streams and the context too
        warnings.warn(
            ResourceWarning(
                f"trio_cuda scope {self.scope!r} exited while {self.foreign} lease(s) of other scopes' "
                f"in-flight work ({', '.join(sorted(map(repr, scopes)))}) still held {len(held)} of its "
                f"allocation(s) {after}; that memory and the scope's driver state are "
                f"quarantined (leaked, never freed)"
            ),
            stacklevel=3,
        )
