"""The scope's memory table: handles, frees, and what garbage collection hands back.

Invariants:

* Memory is freed only when no handle is open, no lease of any range of it is
  in flight, and it is live (never when quarantined): ``_maybe_free`` is the
  one place that decides.
* A handle released off the loop thread (a finalizer, a worker thread) is
  queued for the loop; only the loop touches the table and the driver.
* Releasing the last handle of memory a foreign consumer was given sweeps
  the DLPack capsules dropped unconsumed (``_dlpack.sweep_dropped``): an
  export whose capsule nobody took is then all that keeps the memory, and is
  released now rather than at the scope's next unrelated look.
* A failed free quarantines the memory with a ``ResourceWarning``: a leak is
  preferred to a dangling pointer. Borrowed memory is only let go of.
"""

from __future__ import annotations

import warnings
from _thread import get_ident
from collections import deque
from typing import TYPE_CHECKING

import trio
from trio.lowlevel import enable_ki_protection

from ._array import Allocation, AllocState
from ._dlpack import UNCONSUMED, sweep_dropped

if TYPE_CHECKING:
    from ._driver import DeviceContext
    from ._trace import Tracer

__all__ = ["MemoryTable"]


class MemoryTable:
    """Part of :class:`~trio_cuda.ResourceScope`: its allocations."""

    __slots__ = ()

    if TYPE_CHECKING:
        _driver: DeviceContext
        _allocs: dict[Allocation, None]
        _gc_releases: deque[Allocation]
        _closed: bool
        _thread: int
        _token: trio.lowlevel.TrioToken
        _tracer: Tracer | None
        _trace_id: int

        def _wake(self) -> None: ...

    @enable_ki_protection
    def _release_handle(self, alloc: Allocation) -> None:
        if get_ident() != self._thread:  # closed from a worker thread
            self._release_handle_later(alloc)
            return
        alloc.handles -= 1
        if alloc.exports and alloc.handles <= 0 and UNCONSUMED:
            sweep_dropped()  # an export whose capsule was dropped unconsumed: released now
        self._maybe_free(alloc)

    @enable_ki_protection
    def _release_handle_later(self, alloc: Allocation) -> None:
        """From a garbage-collection finalizer, possibly on another thread."""
        if self._closed:
            return
        self._gc_releases.append(alloc)
        try:
            self._token.run_sync_soon(self._wake)
        except trio.RunFinishedError:
            pass

    @enable_ki_protection
    def _maybe_free(self, alloc: Allocation) -> None:
        if alloc.handles <= 0 and not alloc.active and alloc.state is AllocState.LIVE:
            self._free(alloc)

    @enable_ki_protection
    def _free(self, alloc: Allocation) -> None:
        if alloc.borrowed:  # another library's memory: only let go of it
            alloc.state = AllocState.FREED
            alloc.owner = None
            self._allocs.pop(alloc, None)
            tr = self._tracer
            if tr is not None:
                tr.emit("free", "release", self._trace_id, alloc=alloc.ptr, args={"borrowed": True})
            return
        try:
            self._driver.free(alloc.ptr, alloc.nbytes)
        except Exception as exc:
            # Prefer a leak to a dangling pointer.
            alloc.state = AllocState.QUARANTINED
            warnings.warn(
                ResourceWarning(f"freeing {alloc!r} failed ({exc}); the memory is quarantined"), stacklevel=2
            )
            return
        alloc.state = AllocState.FREED
        del self._allocs[alloc]
        tr = self._tracer
        if tr is not None:
            tr.emit("free", "free", self._trace_id, alloc=alloc.ptr, args={"bytes": alloc.nbytes})
