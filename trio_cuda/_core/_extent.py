"""Byte extents: what a lease covers (rule 11 of the lifetime chapter).

An extent is a flat tuple of half-open byte ranges inside one allocation,
``(lo0, hi0, lo1, hi1, ...)``, relative to the allocation's start.

Invariants:

* Ranges are non-empty, sorted, pairwise disjoint and not adjacent
  (:func:`union` coalesces); ``()`` is the empty extent, which touches no byte
  and overlaps nothing.
* A :class:`~trio_cuda.DeviceArray` is always C- or F-contiguous, so its extent
  is exactly the bytes it can touch: one range, ``[offset, offset + nbytes)``,
  or ``()`` when it holds no element. The handle computes it once, when it is
  made (with whether it covers its whole allocation), since a handle's layout
  never changes.
  No extent ever covers less than what its work can touch.
* Two accesses conflict only where their extents overlap; a write whose
  extent covers another lease's extent supersedes it for ordering (everything
  that overlaps the old lease overlaps the write, and the write is ordered
  after the old lease).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._array import DeviceArray

Extent = tuple[int, ...]

EMPTY: Extent = ()


def array_extent(arr: DeviceArray) -> Extent:
    """The bytes ``arr`` can touch, relative to its allocation (computed
    once, when the handle was made: ``DeviceArray._create``)."""
    return arr._extent


def overlaps(a: Extent, b: Extent) -> bool:
    """True if ``a`` and ``b`` share a byte."""
    if len(a) == 2 and len(b) == 2:
        return a[0] < b[1] and b[0] < a[1]
    i = j = 0
    na, nb = len(a), len(b)
    while i < na and j < nb:
        if a[i] < b[j + 1] and b[j] < a[i + 1]:
            return True
        if a[i + 1] <= b[j + 1]:
            i += 2
        else:
            j += 2
    return False


def covers(outer: Extent, inner: Extent) -> bool:
    """True if every byte of ``inner`` lies in ``outer``."""
    if len(outer) == 2 and len(inner) == 2:
        return outer[0] <= inner[0] and inner[1] <= outer[1]
    j = 0
    n = len(outer)
    for i in range(0, len(inner), 2):
        lo, hi = inner[i], inner[i + 1]
        while j < n and outer[j + 1] <= lo:
            j += 2
        if j >= n or not (outer[j] <= lo and hi <= outer[j + 1]):
            return False
    return True


def union(a: Extent, b: Extent) -> Extent:
    """The bytes of ``a`` or ``b``, coalesced."""
    if not a:
        return b
    if not b or a == b:
        return a
    pairs = sorted(
        [(a[i], a[i + 1]) for i in range(0, len(a), 2)] + [(b[i], b[i + 1]) for i in range(0, len(b), 2)]
    )
    out: list[int] = []
    for lo, hi in pairs:
        if out and lo <= out[-1]:
            if hi > out[-1]:
                out[-1] = hi
        else:
            out += (lo, hi)
    return tuple(out)


def describe(ext: Extent) -> str:
    """``ext`` for messages: ``bytes [lo, hi)``."""
    if not ext:
        return "no bytes"
    return "bytes " + ", ".join(f"[{ext[i]}, {ext[i + 1]})" for i in range(0, len(ext), 2))
