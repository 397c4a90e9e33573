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

if TYPE_CHECKING:
    from ._kernel import Kernel, PreparedLaunch


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


@attrs.frozen
class DeviceInfo:
    """Static facts about the device a context runs on."""

    backend: str
    name: str
    ordinal: int
    total_memory: int
    compute_capability: tuple[int, int] = (0, 0)
    multiprocessor_count: int = 0
    max_threads_per_block: int = 1024
    max_shared_memory_per_block: int = 48 * 1024
    max_shared_memory_per_block_optin: int = 48 * 1024
    max_grid_dim: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    max_block_dim: tuple[int, int, int] = (1024, 1024, 64)


class DeviceContext(Protocol):
    """One scope's view of a device. Created by a backend, closed by the scope."""

    info: DeviceInfo

    # streams --------------------------------------------------------------
    def create_stream(self, index: int) -> StreamHandle: ...

    def destroy_stream(self, stream: StreamHandle) -> None: ...

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

    def launch(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> None:
        """Enqueue one kernel launch; raises ``LaunchError``/``CudaError``."""
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
        """Sleep until some of ``pending`` may have completed. Never blocks the
        loop; may return early (spurious wakeups are fine)."""
        ...

    def notify_submitted(self) -> None:
        """Called after each submission; lets a waiter re-arm its strategy."""
        ...

    def close(self) -> None: ...
