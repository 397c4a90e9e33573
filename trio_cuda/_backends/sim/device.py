"""The simulated GPU: :class:`SimDevice`, its settings and its test controls.

Invariants:

* One :class:`SimDevice` is one address space and one engine, shared by every
  :class:`~.context.SimContext` (one per scope) opened on it. The device holds
  its :class:`~.engine.SimEngine` as a field: the engine owns the
  device-wide mutable state (each stream owns its own, see ``handles``), the
  device keeps its settings and the public controls, each a call into the
  engine. Everything is called from one thread (the Trio loop, or
  synchronous test code); nothing here blocks.
* The controls have fixed names, which tests and users rely on (see
  ``docs/testing.rst``): ``hold``, ``release``, ``complete_next``,
  ``run_until_idle``, ``inject_fault``, ``violations``, ``live_allocations``.
  While held, work commands execute only through ``complete_next`` /
  ``run_until_idle``; bookkeeping still runs.
* An injected fault hits the next launch (or allocation); one launch consumes
  at most one fault. What the engine does with it is in ``engine``.
* Settings are checked when the device is made; records come out as snapshots
  (``records``).
* ``kernel_time`` and ``copy_time`` are seconds of the device clock
  (``clock``): the Trio run's clock inside a run, so that under
  ``trio.testing.MockClock`` they take virtual time.
* The one exception to "one thread": with ``graph_host_time`` set, the core
  instantiates, uploads and updates graphs in worker threads (as on a GPU).
  Those calls touch only their own graph objects and the graph counters,
  which the engine's ``_graph_lock`` guards.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

from ..._core._driver import DeviceInfo
from ..._core._final import final
from .context import SimContext
from .engine import SimEngine

if TYPE_CHECKING:
    from .records import FaultKind, SimAllocation, SimCommandRecord, SimStatistics, Violation

__all__ = ["SimDevice"]

_FAULT_KINDS: tuple[str, ...] = ("launch_error", "out_of_memory", "kernel_fault", "completion_unknown")
BASE_ADDRESS = 0x7F00_0000_0000
_sim_device_ids = iter(range(1 << 30))


def _check_memory(_inst: object, _attr: object, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"memory: expected a non-negative int (bytes), got {value!r}")


def _check_time(_inst: object, attr: attrs.Attribute[float], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{attr.name}: expected a non-negative number of seconds, got {value!r}")


def _check_cc(_inst: object, _attr: object, value: object) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)):
        raise TypeError(f"compute_capability: expected a (major, minor) tuple of ints, got {value!r}")


def _check_sms(_inst: object, _attr: object, value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"multiprocessor_count: expected a positive int, got {value!r}")


def _check_trace_limit(_inst: object, _attr: object, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"trace_limit: expected None or a non-negative int, got {value!r}")


@final
@attrs.define(eq=False, repr=False)
class SimDevice:
    """A simulated GPU, shared by every scope opened on it.

    ``memory`` is the total device memory in bytes. ``kernel_time`` and
    ``copy_time`` are the simulated seconds each launch / each copy or fill takes
    while free-running (0: it executes as soon as it is enqueued), on the Trio
    run's clock (``trio.testing.MockClock`` included; ``perf_counter``
    outside a run). ``trace_limit``
    bounds :attr:`trace` to the most recent events (None: unbounded, 0: off).
    ``batch_markers`` lets scopes record one completion marker per burst of
    submissions, as on a real GPU.

    Test controls: :meth:`hold`, :meth:`release`, :meth:`complete_next`,
    :meth:`run_until_idle`, :meth:`inject_fault`, :attr:`violations`,
    :attr:`live_allocations`.
    """

    name: str = "sim0"  #: the device's name, as ``DeviceInfo.name`` reports it
    #: total device memory in bytes; an allocation past it raises OutOfMemoryError
    memory: int = attrs.field(default=8 * 2**30, validator=_check_memory)
    #: simulated seconds each kernel launch takes while free-running (0: none)
    kernel_time: float = attrs.field(default=0.0, validator=_check_time)
    #: simulated seconds each copy or fill takes while free-running (0: none)
    copy_time: float = attrs.field(default=0.0, validator=_check_time)
    #: how many of the most recent executed commands :attr:`trace` keeps (None: all, 0: none)
    trace_limit: int | None = attrs.field(default=100_000, kw_only=True, validator=_check_trace_limit)
    #: let scopes share one completion marker among a burst of submissions
    #: (as the CUDA backend does); an error then fails every submission of
    #: the burst. Off by default so that each error is attributed exactly.
    batch_markers: bool = attrs.field(default=False, kw_only=True)
    #: seconds an awaiting task polls its own marker before parking (see
    #: ``DeviceFuture.wait``); useful with ``kernel_time`` to model a GPU
    await_spin: float = attrs.field(default=0.0, kw_only=True, validator=_check_time)
    #: what ``info.compute_capability`` reports; clusters and programmatic
    #: dependent launch are refused below (9, 0), as on a real GPU
    compute_capability: tuple[int, int] = attrs.field(default=(9, 0), kw_only=True, validator=_check_cc)
    #: SMs of the occupancy model that bounds cooperative launches
    multiprocessor_count: int = attrs.field(default=132, kw_only=True, validator=_check_sms)
    #: host seconds that instantiating and updating a graph each take (a
    #: ``time.sleep`` where the driver would work on the CPU). When it is not
    #: 0, the contexts declare ``instantiate_in_thread``, so the core runs
    #: both in a worker thread, as it does on a GPU
    graph_host_time: float = attrs.field(default=0.0, kw_only=True, validator=_check_time)

    #: the engine: the device-wide mutable state (memory, memcheck, faults,
    #: the scheduling of the streams' commands, counters), behind its
    #: internal interface
    _engine: SimEngine = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        info = DeviceInfo(
            backend="sim",
            name=self.name,
            ordinal=0,
            total_memory=self.memory,
            compute_capability=self.compute_capability,
            multiprocessor_count=self.multiprocessor_count,
            max_shared_memory_per_block_optin=232448,
            max_threads_per_multiprocessor=2048,
            max_blocks_per_multiprocessor=32,
            max_shared_memory_per_multiprocessor=233472,
            reserved_shared_memory_per_block=1024,
        )
        self._engine = SimEngine(self, info, next(_sim_device_ids), BASE_ADDRESS)

    def __repr__(self) -> str:
        stats = self._engine.statistics()
        mode = "held" if self._engine.held else "free-running"
        return (
            f"<SimDevice {self.name!r} {mode} pending={stats.pending} "
            f"live={stats.live_allocations} ({stats.live_bytes} B) violations={stats.violations}>"
        )

    # ------------------------------------------------------------------ public

    @property
    def info(self) -> DeviceInfo:
        """Static facts about the simulated device."""
        return self._engine.info

    @property
    def _dl_id(self) -> int:
        # this device's DLPack device id (the engine's)
        return self._engine.dl_id

    def open_context(self) -> SimContext:
        """A new context (one per scope) on this device."""
        return SimContext(self, self._engine)

    @property
    def held(self) -> bool:
        """True while work commands only execute through complete_next/run_until_idle."""
        return self._engine.held

    @property
    def pending(self) -> int:
        """Commands enqueued on any stream and not executed yet."""
        return self._engine.pending

    @property
    def violations(self) -> list[Violation]:
        """Memcheck records, oldest first (a snapshot); ``[]`` means clean."""
        return self._engine.violations()

    def clear_violations(self) -> None:
        """Forget the recorded memcheck violations."""
        self._engine.clear_violations()

    @property
    def live_allocations(self) -> list[SimAllocation]:
        """Allocations not yet freed, by address (a snapshot)."""
        return self._engine.live_allocations()

    @property
    def live_graphs(self) -> int:
        """Executable graphs instantiated and not yet destroyed."""
        return self._engine.graph_counts()[0]

    @property
    def graph_launches(self) -> int:
        """Graph replays executed so far (each runs all its captured commands)."""
        return self._engine.graph_counts()[1]

    @property
    def graph_uploads(self) -> int:
        """Executable graphs uploaded so far (``graph_upload``: the core
        uploads each one once, after instantiating it, before any replay)."""
        return self._engine.graph_counts()[2]

    @property
    def trace(self) -> list[SimCommandRecord]:
        """Executed commands in execution order, as
        :class:`~trio_cuda.testing.SimCommandRecord` (a snapshot; the most
        recent ``trace_limit`` of them)."""
        return list(self._engine.trace())

    def clear_trace(self) -> None:
        """Forget the recorded trace."""
        self._engine.trace().clear()

    def statistics(self) -> SimStatistics:
        """Counters of the device (a snapshot)."""
        return self._engine.statistics()

    def peek(self, ptr: int, nbytes: int) -> bytes:
        """Debug read of device memory, outside any stream order. The range must
        lie in one live allocation (ValueError otherwise); no violation is recorded."""
        return self._engine.peek(ptr, nbytes)

    def hold(self) -> None:
        """Stop free-running: from now on work commands execute only through
        :meth:`complete_next` and :meth:`run_until_idle` (bookkeeping still runs)."""
        self._engine.hold()

    def release(self) -> None:
        """Go back to free-running and execute everything runnable (timing allowing)."""
        self._engine.release()

    def complete_next(self) -> bool:
        """Execute exactly one runnable work command (the oldest by enqueue order
        among the stream heads) and the bookkeeping it unblocks. Ignores timing.
        Returns False if no work command was runnable."""
        return self._engine.complete_next()

    def run_until_idle(self) -> int:
        """Execute runnable commands until none is runnable (even while held; the
        device stays held). Returns the number of work commands executed."""
        count = 0
        while self.complete_next():
            count += 1
        return count

    def pump(self) -> int:
        """Free-running: execute every command that is runnable and due now.
        Returns the number of commands executed (0 while held, apart from
        bookkeeping)."""
        return self._engine.pump()

    def inject_fault(self, kind: FaultKind, *, count: int = 1) -> None:
        """Make the next ``count`` launches (or allocations) fail.

        * ``"launch_error"``: ``launch()`` raises LaunchError 701
          (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); nothing is enqueued.
        * ``"out_of_memory"``: ``alloc()`` raises OutOfMemoryError.
        * ``"kernel_fault"``: the launch enqueues; at execution it does not run and
          the stream's next marker fails with LaunchError 719
          (CUDA_ERROR_LAUNCH_FAILED). Not sticky: later work runs normally.
        * ``"completion_unknown"``: the launch enqueues; at execution it does not
          run and the stream's next marker polls UNKNOWN forever.

        One launch consumes at most one fault: launch_error first, then
        completion_unknown, then kernel_fault.
        """
        if kind not in _FAULT_KINDS:
            raise ValueError(
                f"kind: expected one of {', '.join(repr(k) for k in _FAULT_KINDS)}, got {kind!r}"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count: expected a positive int, got {count!r}")
        self._engine.add_fault(kind, count)


def engine_of(device: SimDevice) -> SimEngine:
    """The engine ``device`` holds (for the simulator's host, which joins devices)."""
    return device._engine
