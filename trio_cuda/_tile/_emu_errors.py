"""The errors of the NumPy emulation of cuTile kernels.

Invariants: every error is a :class:`TileEmulationError` (a
:class:`~trio_cuda.TrioCudaError`); each pickles to an equal error (its
``__reduce__`` keeps ``op`` or ``block``), so it crosses a worker thread or a
process unchanged.
"""

from __future__ import annotations

from .._core._errors import TrioCudaError

__all__ = ["TileEmulationError", "TileNotEmulatedError", "TileSpinError"]


class TileEmulationError(TrioCudaError):
    """A tile kernel did something the NumPy emulation of cuTile refuses: an
    access past an array's extent with ``check_bounds=False``, a dtype or shape
    cuTile would reject, or (subclasses) an op not emulated, a spinning block."""


class TileNotEmulatedError(TileEmulationError, NotImplementedError):
    """The kernel uses a ``cuda.tile`` op the emulator does not cover. ``op``
    is its name (``"mma_scaled"``)."""

    def __init__(self, op: str) -> None:
        self.op = op
        super().__init__(f"ct.{op} is not emulated on the simulator; pass reference= to the kernel")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.op,))


class TileSpinError(TileEmulationError):
    """A block repeated the same poll of memory ``spin_limit`` times with no
    write in between: it waits for something no block that has run will do
    (blocks run one after another, so a block waiting on a later one never
    finishes). ``block`` is its block index."""

    def __init__(self, message: str, block: tuple[int, int, int] = (0, 0, 0)) -> None:
        super().__init__(message)
        self.block = block

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.block))
