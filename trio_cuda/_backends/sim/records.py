"""What the simulated device records and reports: allocations, memcheck violations,
trace events and statistics.

Invariants: records are frozen attrs classes, handed out as snapshots; this
module imports nothing else of the simulator.
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["FaultKind", "SimAllocation", "SimCommandRecord", "SimStatistics", "Violation", "ViolationKind"]

ViolationKind = Literal["use_after_free", "unallocated", "out_of_bounds", "double_free", "invalid_free"]
FaultKind = Literal["launch_error", "out_of_memory", "kernel_fault", "completion_unknown"]


@attrs.frozen
class SimAllocation:
    """A live allocation: its device address (an int, shown in hex as
    :class:`~trio_cuda.DeviceArray` shows it) and size in bytes."""

    ptr: int = attrs.field(repr=hex)
    nbytes: int


@attrs.frozen
class Violation:
    """One memcheck record. ``kind`` is ``"use_after_free"`` (freed memory, an
    unloaded module or a destroyed graph), ``"unallocated"`` (no allocation
    there), ``"out_of_bounds"`` (a range that runs past the end of its
    allocation, or a ``reference=`` that indexed an argument past its extent),
    ``"double_free"`` or ``"invalid_free"``. ``address`` and ``size`` are the
    bytes touched (for a reference, the first element past the extent). ``op``
    says which command (and which operand) touched them: for a reference, the
    kernel, the argument, the index and the extent. ``stream`` is the stream
    index, or None for ``free``."""

    kind: ViolationKind
    address: int = attrs.field(repr=hex)
    size: int
    op: str
    stream: int | None


@attrs.frozen
class SimCommandRecord:
    """One command the simulated device executed (an entry of
    :attr:`SimDevice.trace <trio_cuda.testing.SimDevice.trace>`). ``seq`` is
    its global enqueue order, ``stream`` its stream's index, ``kind`` what it
    is (``"launch"``, ``"h2d"``, ``"marker"``, ...) and ``label`` a readable
    description; times are the device clock's (``clock``):
    ``time.perf_counter()`` seconds under Trio's default clock and outside a
    run, virtual ones under a ``MockClock``; simulated ones for timed work.

    Not to be confused with :class:`trio_cuda.trace.TraceEvent`, an event of
    the lifetime trace. ``trio_cuda.testing.TraceEvent``, this class's former
    name, still works as a deprecated alias (it warns)."""

    seq: int
    stream: int
    kind: str
    label: str
    t_enqueue: float
    t_start: float
    t_end: float


@attrs.frozen
class SimStatistics:
    """Counters of a :class:`SimDevice` (executed commands, memory, memcheck)."""

    launches: int
    copies: int
    fills: int
    bytes_copied: int
    commands_executed: int
    pending: int
    live_allocations: int
    live_bytes: int
    violations: int
    kernel_loads: int
    kernel_unloads: int
    allocations: int
    frees: int
