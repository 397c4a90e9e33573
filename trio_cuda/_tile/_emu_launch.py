"""The state of one emulated launch (the grid, the running block, the spin
detector) and the ops that read it (``ct.bid``, ``ct.num_blocks``).

Invariants: the state lives in a context variable set by ``run_tile_kernel``
for the launch's duration, so launches in different threads (or contexts) do
not interfere; an op called outside a launch raises
:class:`TileEmulationError`. A write resets the spin detector; ``spin_limit``
identical polls in a row raise :class:`TileSpinError` naming the block.
"""

from __future__ import annotations

import contextvars
from typing import Any, final

from ._emu_errors import TileEmulationError, TileSpinError


@final
class _Run:
    """The state of one emulated launch: the grid, the running block, the
    spin detector's counters."""

    __slots__ = ("bid", "grid", "last_poll", "polls", "spin_limit", "writes")

    def __init__(self, grid: tuple[int, int, int], spin_limit: int) -> None:
        self.grid = grid
        self.bid = (0, 0, 0)
        self.spin_limit = spin_limit
        self.writes = 0
        self.last_poll: object = None
        self.polls = 0

    def wrote(self) -> None:
        self.writes += 1
        self.last_poll = None
        self.polls = 0

    def poll(self, key: object, what: str) -> None:
        """One read that a spin loop would repeat; ``key`` is None for reads
        that are not (they break a run of identical polls)."""
        if key is None or key != self.last_poll:
            self.last_poll = key
            self.polls = 0
            return
        self.polls += 1
        if self.polls >= self.spin_limit:
            raise TileSpinError(
                f"block {self.bid} of grid {self.grid} repeated {what} {self.polls} times with no write in "
                "between: it waits for memory that no block that has run will change (the simulator runs "
                "blocks one after another, so a block cannot wait on a later one)",
                self.bid,
            )


_run: contextvars.ContextVar[_Run] = contextvars.ContextVar("trio_cuda_tile_emulation")


def _current() -> _Run:
    try:
        return _run.get()
    except LookupError:
        raise TileEmulationError("an emulated cuTile op was called outside run_tile_kernel") from None


def _axis(axis: Any) -> int:
    a = int(axis)
    if a not in (0, 1, 2):
        raise TileEmulationError(f"block axis must be 0, 1 or 2, got {axis!r}")
    return a


def _bid(axis: Any) -> int:
    return _current().bid[_axis(axis)]


def _num_blocks(axis: Any) -> int:
    return _current().grid[_axis(axis)]
