"""An allocation's lease table by byte range, and its index (rule 11).

``Allocation.writers`` and ``Allocation.readers`` map each in-flight
submission to the extent of its write or read lease (see ``_extent``).

Invariants:

* An entry is in a table from the lease's recording until its submission
  retires, or until a later write whose extent covers it drops it (the later
  write is ordered after it, and whatever overlaps it overlaps the write).
* Small tables are scanned. A table that grows past ``INDEX_AT`` entries
  through the recording of a *partial* lease (an extent short of the whole
  allocation) gets a :class:`RangeIndex`; a whole-allocation lease never makes
  one (its extent overlaps every entry, so an index could not narrow a query),
  so an allocation that only ever gets whole-allocation leases never has an
  index and keeps the launch fast path. Every entry enters a table through
  :func:`record_lease` (or the launch fast path's whole-allocation recording,
  which is the same for an allocation without an index), which keeps the
  index in step (while an allocation has one, the launch fast path steps
  aside: ``take_launch_leases``); retirement
  pops entries from the tables only, and the index drops them lazily (a
  query skips entries no longer in their table; the index is rebuilt when
  most of it is stale, and dropped when the tables are empty). So a query for
  a range costs O(log n + k) for k overlapping entries, not O(n): many
  disjoint chunks of one buffer in flight at once stay cheap.
* Queries return a superset of the overlapping entries' submissions; callers
  check :func:`~._extent.overlaps` themselves.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING, final

from ._extent import Extent, covers, union
from ._ops import Access

if TYPE_CHECKING:
    from ._array import Allocation
    from ._submit import Submission

#: entries (writers and readers together) past which an allocation gets an index
INDEX_AT = 32

#: (lo, hi, id(submission), submission): ordered by ``lo``, unique per table
_Entry = tuple[int, int, int, "Submission"]


@final
class RangeIndex:
    """The ranges of an allocation's lease tables, sorted by their start.

    Ranges no longer than ``span`` (1/64 of the allocation) are kept in sorted
    lists, so the ones that may overlap ``[lo, hi)`` start in
    ``[lo - longest, hi)``, where ``longest`` is the longest such range
    entered since the index was made; a submission with a longer range is
    kept in a small ``wide`` table that every query scans (few wide writes can
    be in flight at once: a write drops the entries it covers)."""

    __slots__ = ("longest", "r", "span", "w", "wide_r", "wide_w")

    def __init__(self, alloc: Allocation) -> None:
        self.span = max(1, alloc.nbytes // 64)
        self.longest = 1
        self.w: list[_Entry] = []
        self.r: list[_Entry] = []
        self.wide_w: dict[Submission, None] = {}
        self.wide_r: dict[Submission, None] = {}
        for sub, ext in alloc.writers.items():
            self.add(True, sub, ext)
        for sub, ext in alloc.readers.items():
            self.add(False, sub, ext)

    def _wide(self, ext: Extent) -> bool:
        span = self.span
        return any(ext[i + 1] - ext[i] > span for i in range(0, len(ext), 2))

    def add(self, write: bool, sub: Submission, ext: Extent) -> None:
        if self._wide(ext):
            (self.wide_w if write else self.wide_r)[sub] = None
            return
        entries = self.w if write else self.r
        key = id(sub)
        for i in range(0, len(ext), 2):
            lo, hi = ext[i], ext[i + 1]
            if hi - lo > self.longest:
                self.longest = hi - lo
            insort(entries, (lo, hi, key, sub))

    def remove(self, write: bool, sub: Submission, ext: Extent) -> None:
        if self._wide(ext):
            (self.wide_w if write else self.wide_r).pop(sub, None)
            return
        entries = self.w if write else self.r
        key = id(sub)
        for i in range(0, len(ext), 2):
            j = bisect_left(entries, (ext[i], ext[i + 1], key))
            if j < len(entries) and entries[j][3] is sub:
                del entries[j]

    def size(self) -> int:
        return len(self.w) + len(self.r) + len(self.wide_w) + len(self.wide_r)

    def query(self, write: bool, ext: Extent) -> dict[Submission, None]:
        """Submissions whose ranges may overlap ``ext``, stale ones included
        (retired since: no longer in their table)."""
        found = dict(self.wide_w if write else self.wide_r)
        entries = self.w if write else self.r
        longest = self.longest
        for i in range(0, len(ext), 2):
            lo, hi = ext[i], ext[i + 1]
            j = bisect_left(entries, (lo - longest + 1,))
            end = bisect_left(entries, (hi,))
            while j < end:
                e = entries[j]
                if e[1] > lo:
                    found[e[3]] = None
                j += 1
        return found


def _whole(alloc: Allocation, ext: Extent) -> bool:
    return len(ext) == 2 and ext[0] == 0 and ext[1] >= alloc.nbytes


def candidates(alloc: Allocation, write: bool, ext: Extent) -> list[tuple[Submission, Extent]]:
    """The entries of ``alloc``'s writers (``write``) or readers table that
    may overlap ``ext`` (all of them for a small table or a whole-allocation
    extent; from the index otherwise), as (submission, extent) pairs."""
    table = alloc.writers if write else alloc.readers
    if not table or not ext:
        return []
    index = alloc.index
    if index is None or _whole(alloc, ext):
        return list(table.items())
    get = table.get
    return [(s, e) for s in index.query(write, ext) if (e := get(s)) is not None]


def overlapping(alloc: Allocation, write: bool, ext: Extent) -> list[Submission]:
    """Submissions whose write (``write``) or read lease overlaps ``ext``."""
    from ._extent import overlaps

    return [s for s, e in candidates(alloc, write, ext) if overlaps(e, ext)]


def record_lease(alloc: Allocation, sub: Submission, access: Access, ext: Extent) -> None:
    """Enter ``sub``'s lease on ``ext`` of ``alloc`` in its lease table (its
    ``active`` count is the caller's). A write drops the entries of other
    work its extent covers (and ``sub``'s own read entry it covers)."""
    if not ext:
        return
    index = alloc.index
    writers = alloc.writers
    readers = alloc.readers
    if index is not None:
        live = len(writers) + len(readers)
        if not live:
            index = alloc.index = None  # everything retired
        elif index.size() > 2 * live + INDEX_AT:
            index = alloc.index = RangeIndex(alloc)  # mostly stale: rebuild
    if access is Access.WRITE:
        prev = writers.get(sub)
        if prev is not None:
            if index is not None:
                index.remove(True, sub, prev)
            ext = union(prev, ext)
        if _whole(alloc, ext):
            writers.clear()  # the whole allocation: everything is covered
            readers.clear()
            alloc.index = None
            writers[sub] = ext
            return
        for write, table in ((True, writers), (False, readers)):
            for s, e in candidates(alloc, write, ext):
                if (s is not sub or not write) and covers(ext, e):
                    del table[s]
                    if index is not None:
                        index.remove(write, s, e)
        writers[sub] = ext
        if index is not None:
            index.add(True, sub, ext)
    else:
        prev = readers.get(sub)
        if prev is not None:
            if index is not None:
                index.remove(False, sub, prev)
            ext = union(prev, ext)
        readers[sub] = ext
        if index is not None:
            index.add(False, sub, ext)
    if index is None and len(writers) + len(readers) > INDEX_AT and not _whole(alloc, ext):
        alloc.index = RangeIndex(alloc)  # only partial leases need one
