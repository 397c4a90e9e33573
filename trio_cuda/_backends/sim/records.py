"""What the simulated device records and reports: allocations, memcheck violations,
trace events and statistics.

Invariants: records are frozen attrs classes, handed out as snapshots; this
module imports nothing else of the simulator.
"""

from __future__ import annotations

from typing import Literal

import attrs

from ..._core._final import final

__all__ = ["FaultKind", "SimAllocation", "SimCommandRecord", "SimStatistics", "Violation", "ViolationKind"]

ViolationKind = Literal["use_after_free", "unallocated", "out_of_bounds", "double_free", "invalid_free"]
FaultKind = Literal["launch_error", "out_of_memory", "kernel_fault", "completion_unknown"]


@final
@attrs.frozen
class SimAllocation:
    """A live allocation: its device address (an int, shown in hex as
    :class:`~trio_cuda.DeviceArray` shows it) and size in bytes."""

    ptr: int = attrs.field(repr=hex)  #: the allocation's device address
    nbytes: int  #: its size in bytes


@final
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

    kind: ViolationKind  #: what went wrong (see above)
    address: int = attrs.field(repr=hex)  #: the first device address touched
    size: int  #: how many bytes were touched from ``address``
    op: str  #: the command, and its operand, that touched them
    stream: int | None  #: the index of the stream it ran on; None for ``free``


@final
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

    seq: int  #: the command's place in the device's global enqueue order
    stream: int  #: the index of its stream
    kind: str  #: ``"launch"``, ``"h2d"``, ``"d2h"``, ``"d2d"``, ``"fill"``, ``"marker"``, ...
    label: str  #: a readable description (the kernel's name, the copy's size, ...)
    t_enqueue: float  #: when it was enqueued, on the device clock
    t_start: float  #: when it started executing (after what was ahead of it on its stream)
    t_end: float  #: when it finished executing (``t_start`` plus its simulated time)


@final
@attrs.frozen
class SimStatistics:
    """Counters of a :class:`SimDevice` (executed commands, memory, memcheck)."""

    launches: int  #: kernel launches executed (a graph's kernels each count)
    copies: int  #: copies executed: host to device, device to host, device to device, peer
    fills: int  #: fills executed
    bytes_copied: int  #: bytes those copies moved (a copy that touched bad memory moves none)
    #: commands executed of every kind: launches, copies and fills, and also completion
    #: markers, waits and gates
    commands_executed: int
    pending: int  #: commands enqueued on a stream and not executed yet
    live_allocations: int  #: allocations not freed yet (``len(sim.live_allocations)``)
    live_bytes: int  #: bytes of those allocations
    violations: int  #: memcheck records (``len(sim.violations)``)
    kernel_loads: int  #: kernel modules loaded
    kernel_unloads: int  #: kernel modules unloaded
    allocations: int  #: allocations ever made
    frees: int  #: allocations ever freed
