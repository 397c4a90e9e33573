"""Streams of a scope's pool.

Invariants:

* A :class:`Stream` belongs to exactly one scope for its whole life and has no
  public constructor; ``scope.streams`` are the only ones.
* Its queues hold what the scope's completion machinery has yet to retire, in
  stream (FIFO) order: ``_unmarked`` submissions wait for a completion marker,
  ``_pending`` ones (and host steps) for theirs to complete.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import attrs

from ._errors import ScopeClosedError
from ._final import NoPublicConstructor, final

if TYPE_CHECKING:
    from ._driver import StreamHandle
    from ._scope import ResourceScope
    from ._submit import HostStep, Submission

__all__ = ["Stream", "StreamStatistics"]


@final
@attrs.frozen
class StreamStatistics:
    """Counters of one stream."""

    index: int  #: the stream's position in ``gpu.streams``
    in_flight: int  #: submissions on this stream enqueued and not yet retired
    submitted: int  #: submissions ever made on this stream
    completed: int  #: of ``submitted``: those retired


@final
class Stream(metaclass=NoPublicConstructor):
    """One stream of a scope's pool. Pass it as ``stream=`` to pin work."""

    __slots__ = (
        "__weakref__",
        "_completed",
        "_in_flight",
        "_pending",
        "_scope",
        "_unmarked",
        "handle",
        "index",
    )

    _obtain = "use scope.streams"

    _scope: ResourceScope
    #: the stream's position in ``gpu.streams``
    index: int
    #: the backend's handle: a ``CUstream`` on the cuda backend (see :meth:`__cuda_stream__`)
    handle: StreamHandle
    _pending: deque[Submission | HostStep]
    _unmarked: list[Submission]
    _in_flight: int
    _completed: int

    @classmethod
    def _create(cls, scope: ResourceScope, index: int, handle: StreamHandle) -> Stream:
        self = object.__new__(cls)
        self._scope = scope
        self.index = index
        self.handle = handle
        self._pending = deque()
        self._unmarked = []
        self._in_flight = 0
        self._completed = 0
        return self

    @property
    def scope(self) -> ResourceScope:
        """The scope this stream belongs to."""
        return self._scope

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (cuda.core): ``(0, handle)``, the stream's
        ``CUstream`` as an int, so that ``cupy.cuda.ExternalStream``,
        ``torch.cuda.ExternalStream`` and ``cuda.core`` can adopt it. Work
        enqueued on it that way is outside trio_cuda's leases unless it runs
        inside :func:`trio_cuda.ops.external`. On the simulator the handle
        names the simulated stream (``ops.after`` accepts it)."""
        scope = self._scope
        if scope._closed:
            raise ScopeClosedError(f"__cuda_stream__: the scope of stream {self.index} has exited")
        return (0, scope._driver.stream_address(self.handle))

    def statistics(self) -> StreamStatistics:
        """A snapshot of counters (see the class of the result)."""
        return StreamStatistics(
            self.index, self._in_flight, self._completed + self._in_flight, self._completed
        )

    def __repr__(self) -> str:
        return f"<Stream {self.index} of {self._scope._info.backend}:{self._scope._info.ordinal}>"
