"""Stream-choosing policies: which stream of a scope runs work not pinned to one.

Invariants:

* A policy is asked once per submission (and per allocation) that names no
  stream; the scope checks its answer is one of its own streams before anything
  is allocated, leased or enqueued, and refuses anything else.
* Policies hold no resources and never block. They run on every unpinned
  submission, so they read only counters and links the scope already keeps
  (a stream's ``_in_flight``, an allocation's ``writers``) in plain loops.
* The default, :class:`FollowWriter`, lets independent work overlap: it never
  puts work behind another stream's unrelated work while a stream with less in
  flight exists, except to follow a kernel's own dependency (then the kernel
  could not have started sooner anywhere). :class:`RoundRobin` does not have
  this property ("upload x_i, then a kernel on x_i" puts the kernels on
  streams 1, 3, 1, 3 of four, half of them queued behind the other half) and
  is kept for those who ask for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from ._extent import array_extent, overlaps
from ._final import final
from ._launch import KernelLaunch
from ._leases import candidates

if TYPE_CHECKING:
    from ._ops import DeviceOp
    from ._stream import Stream

__all__ = ["FollowWriter", "LeastLoaded", "RoundRobin", "SchedulingPolicy"]


class SchedulingPolicy(Protocol):
    """Chooses the stream of a submission that was not pinned to one."""

    def choose(self, streams: Sequence[Stream], op: DeviceOp[Any]) -> Stream:
        """Return the stream ``op`` should run on (one of ``streams``)."""
        ...


@final
@attrs.define(eq=False)
class RoundRobin:
    """Streams in turn, whatever their load or the op's dependencies.

    Not the default: with it, "``x = await gpu.to_device(a)``, then a kernel
    on ``x``" puts each kernel on the stream after its upload's, so with an
    even number of streams every other kernel queues behind the previous one.
    """

    _next: int = attrs.field(default=0, init=False)

    def choose(self, streams: Sequence[Stream], op: DeviceOp[Any]) -> Stream:
        """Return the next stream in turn."""
        i = self._next
        self._next = (i + 1) % len(streams)
        return streams[i % len(streams)]


@final
@attrs.define(eq=False)
class LeastLoaded:
    """The stream with the fewest submissions in flight (lowest index on ties)."""

    def choose(self, streams: Sequence[Stream], op: DeviceOp[Any]) -> Stream:
        """The stream with the fewest submissions in flight."""
        return _least_loaded(streams)


@final
@attrs.define(eq=False)
class FollowWriter:
    """The default policy: :class:`LeastLoaded`, except that a kernel launch
    follows its dependency.

    If bytes an array argument of a kernel launch touches were last written
    by work that is still in flight and is the last work queued on its stream
    (a write of a disjoint range of the same buffer does not count), the
    launch goes on that stream: it could not start sooner on any other (it
    must wait for that write), it needs no cross-stream wait there, and the
    idle streams stay free for independent work, so a chain of dependent kernels occupies one
    stream instead of one per link. Anything else (other ops, arguments with no
    write in flight, a writer with more work queued behind it) goes to the
    stream with the fewest submissions in flight, the lowest index on ties.
    """

    def choose(self, streams: Sequence[Stream], op: DeviceOp[Any]) -> Stream:
        """The stream of a kernel's in-flight writer at its stream's tail, else
        the least-loaded stream."""
        if type(op) is KernelLaunch:
            # The writes an access must order after are the entries of its
            # allocation's ``writers`` whose extent overlaps the access (what
            # ``take_leases`` waits for): a writer of a disjoint chunk of the
            # same buffer is not one, so independent chunks spread out.
            for arr, _ in op._accesses:
                alloc = arr._alloc
                if not alloc.writers:
                    continue
                ext = array_extent(arr)
                for w, wext in candidates(alloc, True, ext):
                    if not overlaps(wext, ext):
                        continue
                    s = w.stream
                    queued = s._unmarked or s._pending
                    if queued and queued[-1] is w:
                        i = s.index
                        if i < len(streams) and streams[i] is s:
                            return s
        return _least_loaded(streams)


def _least_loaded(streams: Sequence[Stream]) -> Stream:
    """The stream with the fewest submissions in flight, the lowest index on
    ties; a plain loop, as this runs on every unpinned submission."""
    best = streams[0]
    load = best._in_flight
    if load:
        for s in streams:
            n = s._in_flight
            if n < load:
                best = s
                if not n:
                    break
                load = n
    return best
