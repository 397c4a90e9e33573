"""Stream-choosing policies: which stream of a scope runs work not pinned to one.

Invariants:

* A policy is asked once per submission (and per allocation) that names no
  stream; the scope checks its answer is one of its own streams before anything
  is allocated, leased or enqueued, and refuses anything else.
* Policies hold no resources and never block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, final

import attrs

if TYPE_CHECKING:
    from ._ops import DeviceOp
    from ._stream import Stream

__all__ = ["LeastLoaded", "RoundRobin", "SchedulingPolicy"]


class SchedulingPolicy(Protocol):
    """Chooses the stream of a submission that was not pinned to one."""

    def choose(self, streams: Sequence[Stream], op: DeviceOp[Any]) -> Stream:
        """Return the stream ``op`` should run on (one of ``streams``)."""
        ...


@final
@attrs.define(eq=False)
class RoundRobin:
    """The default policy: streams in turn."""

    _next: int = attrs.field(default=0, init=False)

    def choose(self, streams: Sequence[Stream], op: DeviceOp[Any]) -> Stream:
        """Return the stream ``op`` should run on."""
        i = self._next
        self._next = (i + 1) % len(streams)
        return streams[i % len(streams)]


@final
@attrs.define(eq=False)
class LeastLoaded:
    """The stream with the fewest submissions in flight (lowest index on ties)."""

    def choose(self, streams: Sequence[Stream], op: DeviceOp[Any]) -> Stream:
        """The stream with the fewest submissions in flight."""
        return min(streams, key=lambda s: (s._in_flight, s.index))
