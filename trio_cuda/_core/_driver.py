"""The driver protocol: the small surface a backend implements.

Invariants:

* Every method is called from the Trio loop thread, never concurrently.
* Nothing here imports ``cuda``; backends live in ``trio_cuda._backends``.
* Work enqueued on one stream executes in FIFO order. A *marker* is a point in a
  stream's order; polling it never blocks. Markers of one stream complete in the
  order they were recorded.
* Methods that enqueue work raise a :class:`~trio_cuda.TrioCudaError` subclass
  when the work could not be enqueued; nothing was enqueued in that case.
* ``alloc`` returns device addresses as plain ``int``. ``free`` is only called
  when no enqueued work can still touch the memory.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np

from ._final import final

if TYPE_CHECKING:
    from ._kernel import Kernel
    from ._launch import PreparedLaunch


class MarkerState(enum.Enum):
    """What polling a marker established."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  #: completed, but work before it on the stream failed
    UNKNOWN = "unknown"  #: completion cannot be established (sticky error)


@attrs.frozen
class Poll:
    """Result of :meth:`DeviceContext.poll_marker`."""

    state: MarkerState
    error: BaseException | None = None


PENDING = Poll(MarkerState.PENDING)
DONE = Poll(MarkerState.DONE)


class StreamHandle(Protocol):
    """Backend stream; opaque to the core apart from a stable ``index``."""

    @property
    def index(self) -> int: ...


class Marker(Protocol):
    """A recorded point in one stream's order."""

    @property
    def stream(self) -> Any: ...


class Gate(Protocol):
    """A stream-side wait that the host opens (see ``ops.host_closure``)."""


#: Called at retirement, after the GPU finished the work (e.g. staging -> host).
Finisher = Callable[[], None]


@final
@attrs.frozen
class DeviceInfo:
    """Static facts about the device a context runs on."""

    backend: str  #: ``"cuda"`` or ``"sim"``
    name: str  #: the device's name, as the driver reports it
    ordinal: int  #: the device's index among the host's devices (``cuda:N``)
    total_memory: int  #: bytes of device memory
    compute_capability: tuple[int, int] = (0, 0)  #: (major, minor); (0, 0) on the simulator
    multiprocessor_count: int = 0  #: streaming multiprocessors (SMs)
    max_threads_per_block: int = 1024  #: threads per block, all dimensions together
    #: bytes of shared memory a block gets without opting in (static and dynamic together)
    max_shared_memory_per_block: int = 48 * 1024
    #: bytes of shared memory a block may use after opting in (a launch's ``shared_mem`` above 48 KiB)
    max_shared_memory_per_block_optin: int = 48 * 1024
    max_grid_dim: tuple[int, int, int] = (2**31 - 1, 65535, 65535)  #: blocks per grid, per dimension
    max_block_dim: tuple[int, int, int] = (1024, 1024, 64)  #: threads per block, per dimension
    #: per-SM residency limits (what a cooperative launch can keep co-resident)
    max_threads_per_multiprocessor: int = 2048
    max_blocks_per_multiprocessor: int = 32  #: resident blocks per SM
    max_shared_memory_per_multiprocessor: int = 228 * 1024  #: bytes of shared memory per SM
    #: bytes of shared memory the system reserves for each resident block
    reserved_shared_memory_per_block: int = 1024
    #: whether the device supports cooperative launches
    cooperative_launch: bool = True


@attrs.frozen
class Capabilities:
    """What a backend's driver context can do, declared once (never probed)."""

    #: the core records one completion marker per burst of submissions on a
    #: stream (markers are cheap to coalesce on this backend)
    batch_markers: bool = False
    #: seconds an awaiting task may busy-poll its own marker, while no other
    #: task is runnable, before it parks
    await_spin: float = 0.0
    #: seconds an awaiting task keeps looking at its marker between
    #: checkpoints, while other tasks run, before it parks
    await_budget: float = 0.0
    #: ``load_kernel`` may run in a worker thread (NVRTC and module loading)
    load_in_thread: bool = False
    #: ``instantiate``, ``graph_upload`` and ``graph_update`` may run in a
    #: worker thread (large graphs take milliseconds); the core never calls
    #: another method on the same executable graph meanwhile
    instantiate_in_thread: bool = False
    #: ``foreign_fence(None)`` synchronises the whole device and blocks its caller
    foreign_fence_blocks: bool = False
    #: ``foreign_fence(stream)`` may be called from any thread (a DLPack deleter)
    foreign_fence_threadsafe: bool = False
    #: where traces take the device times of enqueued work: "simulated" (the
    #: driver's ``command_times``), or "host-observed" (from enqueue to the
    #: completion the host observed)
    device_clock: str = "host-observed"
    #: ``timing_mark`` records device timestamps (traces asked for timing)
    device_timing: bool = False


class InteropContext(Protocol):
    """The part of :class:`DeviceContext` for DLPack / CUDA Array Interface
    interop (``trio_cuda._core._export``, ``trio_cuda.interop``) and copies
    between devices (``_multi``). Every backend implements all of it; what
    differs is declared in :class:`Capabilities`. A *foreign stream* is an int naming another
    library's stream (a CUstream handle; 1 and 2 are CUDA's legacy and
    per-thread default streams). A *fence* is an opaque point in some streams'
    order."""

    def stream_address(self, stream: StreamHandle) -> int:
        """The int that names ``stream`` to other libraries."""
        ...

    def foreign_wait(self, foreign: int, stream: StreamHandle) -> None:
        """Make the foreign stream wait, device-side, for the work enqueued so far on ``stream``."""
        ...

    def foreign_fence(self, foreign: int | None) -> object:
        """A fence after the work enqueued so far on the foreign stream; for
        None, after all work on the device (CUDA: a context synchronisation,
        returning None). May be called from a non-loop thread only where the
        backend's capabilities say ``foreign_fence_threadsafe``."""
        ...

    def wait_fence(self, stream: StreamHandle, fence: object) -> None:
        """Make ``stream`` wait, device-side, for ``fence`` (reusable until dropped)."""
        ...

    def drop_fence(self, fence: object) -> None:
        """Release a fence's resources."""
        ...

    def wait_foreign_event(self, stream: StreamHandle, event: int) -> None:
        """Make ``stream`` wait, device-side, for another library's event
        (a CUevent handle); backends without foreign events raise TypeError."""
        ...

    def copy_peer(
        self,
        stream: StreamHandle,
        dst: int,
        dst_context: object,
        src: int,
        src_context: object,
        nbytes: int,
    ) -> object | None:
        """Enqueue on ``stream`` a copy between memory of two contexts of this
        backend (two devices, or one). Returns an object to retain until
        completion, or None."""
        ...

    def check_copy_peer(self, dst_context: object, src_context: object) -> None:
        """Raise ``ValueError`` unless :meth:`copy_peer` can copy between these
        contexts. Enqueues nothing."""
        ...

    def check_foreign_stream(self, address: int) -> None:
        """Raise ``ValueError`` if ``address`` surely names no stream a foreign
        consumer may use (checked before an export is made)."""
        ...

    def dlpack_device(self) -> tuple[int, int]:
        """``(device_type, device_id)`` of this context's memory, as DLPack names it."""
        ...

    def pointer_device(self, ptr: int, nbytes: int) -> str | None:
        """None if ``[ptr, ptr + nbytes)`` is memory of this context's device,
        else a description of what it is instead."""
        ...


class DeviceContext(InteropContext, Protocol):
    """One scope's view of a device. Created by a backend, closed by the scope."""

    info: DeviceInfo

    @property
    def capabilities(self) -> Capabilities:
        """What this context can do (see :class:`Capabilities`)."""
        ...

    # streams --------------------------------------------------------------
    def create_stream(self, index: int) -> StreamHandle: ...

    def destroy_stream(self, stream: StreamHandle) -> None: ...

    # traces ---------------------------------------------------------------
    def last_command(self) -> int | None:
        """An id of the command this context enqueued last (traces link it to
        its device times), or None where the driver keeps no device times."""
        ...

    def command_times(self, ids: Sequence[int]) -> dict[int, tuple[float, float]]:
        """Device (start, end) of executed commands among ``ids``, in
        ``time.perf_counter()`` seconds; commands it no longer knows are left out."""
        ...

    def timing_start(self, stream: StreamHandle) -> None:
        """Begin device timing for a traced scope (``stream`` is idle)."""
        ...

    def timing_mark(self, stream: StreamHandle) -> int | None:
        """Record a device timestamp on ``stream`` after the work enqueued so
        far; its id, or None where the backend has no device timing."""
        ...

    def mark_times(self, ids: Sequence[int]) -> dict[int, float]:
        """The ``time.perf_counter()`` time of completed marks among ``ids``."""
        ...

    # memory ---------------------------------------------------------------
    def alloc(self, nbytes: int, stream: StreamHandle) -> int:
        """Stream-ordered allocation; raises ``OutOfMemoryError``."""
        ...

    def free(self, ptr: int, nbytes: int) -> None:
        """Free memory that no enqueued work can touch any more."""
        ...

    def copy_h2d(self, stream: StreamHandle, dst: int, src: np.ndarray) -> object | None:
        """Enqueue host->device. ``src`` is C-contiguous and may be changed by
        the caller as soon as this returns (the backend stages it). Returns an
        object to retain until completion, or None."""
        ...

    def copy_d2h(
        self, stream: StreamHandle, dst: np.ndarray, src: int, *, direct: bool = False
    ) -> Finisher | None:
        """Enqueue device->host into C-contiguous ``dst``. Returns a finisher
        that the core runs at retirement (e.g. staging -> ``dst``), or None.
        ``direct=True`` (unsafe path) must write ``dst`` without a finisher."""
        ...

    def copy_d2d(self, stream: StreamHandle, dst: int, src: int, nbytes: int) -> None: ...

    def fill(self, stream: StreamHandle, dst: int, pattern: bytes, count: int) -> None:
        """Write ``pattern`` (1, 2, 4 or 8 bytes) ``count`` times from ``dst``."""
        ...

    # kernels --------------------------------------------------------------
    def load_kernel(self, kernel: Kernel) -> object:
        """Compile/load once per context; the result is cached by the core."""
        ...

    def unload_kernel(self, function: object) -> None:
        """Unload what :meth:`load_kernel` returned; only called once no
        submission that uses it is in flight."""
        ...

    def check_launch(self, function: object, launch: PreparedLaunch) -> None:
        """Check ``launch`` against what only the loaded ``function`` knows
        (its own thread and shared-memory limits, the occupancy of a
        cooperative launch, its parameter layout); raise
        ``KernelArgumentError``. Enqueues nothing. The core calls it before
        taking leases: for a SIMT kernel once per context and launch shape
        (kernel, config, parameter plan), for a tile kernel once per launch
        and context."""
        ...

    def launch(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> None:
        """Enqueue one kernel launch; raises ``LaunchError``/``CudaError``."""
        ...

    # graphs ---------------------------------------------------------------
    def begin_capture(self, stream: StreamHandle) -> None:
        """Start capturing the work enqueued on ``stream`` into a graph: it is
        recorded, not executed. Until :meth:`end_capture` or
        :meth:`abort_capture`, ``alloc`` raises ``GraphCaptureError``, and so
        do calls that would synchronise with, or record completion on, the
        stream. One capture at a time per context."""
        ...

    def end_capture(self, stream: StreamHandle) -> object:
        """Stop capturing; return the captured graph (a template for
        :meth:`instantiate` or :meth:`graph_update`). Raises
        ``GraphCaptureError`` if the capture was invalidated; the stream has
        left capture mode either way."""
        ...

    def abort_capture(self, stream: StreamHandle) -> None:
        """Stop capturing and discard what was captured; the stream is usable
        afterwards (also when the capture was invalidated)."""
        ...

    def instantiate(self, graph: object) -> object:
        """An executable graph from an :meth:`end_capture` template. Consumes
        the template (also when it raises)."""
        ...

    def graph_upload(self, graph_exec: object) -> None:
        """Upload a new executable graph to the device, so that its first
        launch does not pay for it. The core calls it once, right after
        :meth:`instantiate` and in the same thread, before any launch of it.
        Returns once the upload has completed, having waited for no other
        work. Raises ``CudaError``; ``graph_exec`` is still valid then (the
        core destroys it)."""
        ...

    def graph_launch(self, stream: StreamHandle, graph_exec: object) -> None:
        """Enqueue one replay of an executable graph on ``stream``."""
        ...

    def graph_update(self, graph_exec: object, graph: object) -> None:
        """Give ``graph_exec`` the parameters of the template ``graph`` (same
        topology). Launches already enqueued are not affected. Raises
        ``GraphCaptureError`` when the topology differs (``graph_exec`` is
        unchanged then). Consumes the template. May run in a worker thread
        (``instantiate_in_thread``)."""
        ...

    def destroy_graph(self, graph_exec: object) -> None:
        """Destroy an executable graph; only called once no enqueued launch of
        it can still run."""
        ...

    # ordering and completion ---------------------------------------------
    def record_marker(self, stream: StreamHandle) -> Marker: ...

    def poll_marker(self, marker: Marker) -> Poll: ...

    def wait_marker(self, stream: StreamHandle, marker: Marker) -> None:
        """Make ``stream`` wait, device-side, until ``marker`` completed."""
        ...

    def create_gate(self, stream: StreamHandle) -> Gate:
        """Enqueue a wait that holds ``stream`` until :meth:`open_gate`."""
        ...

    def open_gate(self, gate: Gate) -> None: ...

    async def wait_for_progress(self, pending: Sequence[Marker]) -> None:
        """Sleep until some of ``pending`` may have completed; return at once
        (after a checkpoint) if one of them completed before the call: an
        awaiting task may have observed it meanwhile. Never blocks the loop;
        may return early (spurious wakeups are fine)."""
        ...

    def notify_submitted(self) -> None:
        """Called after each submission; lets a waiter re-arm its strategy."""
        ...

    def close(self) -> None: ...
