"""trio_cuda: structured concurrency for NVIDIA GPUs, on Trio.

Describe GPU work as lazy DeviceOps, submit it inside a resource scope, and
await it without blocking the event loop. No GPU memory, module, argument
buffer or access lease is released while the GPU may still use it, whatever the
awaiting task does.
"""

from . import interop as interop
from . import ops as ops
from . import testing as testing
from . import trace as trace
from . import unsafe as unsafe
from ._core._array import DeviceArray as DeviceArray
from ._core._builder import LaunchBuilder as LaunchBuilder
from ._core._config import LaunchConfig as LaunchConfig
from ._core._driver import DeviceInfo as DeviceInfo
from ._core._errors import AccessConflictError as AccessConflictError
from ._core._errors import CompletionUnknownError as CompletionUnknownError
from ._core._errors import CudaError as CudaError
from ._core._errors import DeviceUnavailableError as DeviceUnavailableError
from ._core._errors import GraphCaptureError as GraphCaptureError
from ._core._errors import KernelArgumentError as KernelArgumentError
from ._core._errors import LaunchError as LaunchError
from ._core._errors import MissingReferenceError as MissingReferenceError
from ._core._errors import OutOfMemoryError as OutOfMemoryError
from ._core._errors import ScopeClosedError as ScopeClosedError
from ._core._errors import TrioCudaError as TrioCudaError
from ._core._future import DeviceFuture as DeviceFuture
from ._core._future import FutureStatistics as FutureStatistics
from ._core._graph import CudaGraph as CudaGraph
from ._core._graph import GraphStatistics as GraphStatistics
from ._core._kernel import NO_REFERENCE as NO_REFERENCE
from ._core._kernel import Kernel as Kernel
from ._core._launch import KernelLaunch as KernelLaunch
from ._core._manager import current_scope as current_scope
from ._core._multi import DevicePolicy as DevicePolicy
from ._core._multi import DevicePool as DevicePool
from ._core._multi import DevicePoolStatistics as DevicePoolStatistics
from ._core._multi import LeastLoadedDevice as LeastLoadedDevice
from ._core._multi import RoundRobinDevices as RoundRobinDevices
from ._core._ops import DeviceOp as DeviceOp
from ._core._ops import zip as zip  # noqa: A004
from ._core._params import In as In
from ._core._params import InOut as InOut
from ._core._params import Out as Out
from ._core._params import Scalar as Scalar
from ._core._params import Slice as Slice
from ._core._policy import FollowWriter as FollowWriter
from ._core._policy import LeastLoaded as LeastLoaded
from ._core._policy import RoundRobin as RoundRobin
from ._core._policy import SchedulingPolicy as SchedulingPolicy
from ._core._scope import ResourceScope as ResourceScope
from ._core._statistics import ScopeStatistics as ScopeStatistics
from ._core._stream import Stream as Stream
from ._core._stream import StreamStatistics as StreamStatistics
from ._open import open_device_pool as open_device_pool
from ._open import open_scope as open_scope
from ._public import publish as _publish
from ._tile.compile import TileCompileError as TileCompileError
from ._tile.compile import TileToolchainError as TileToolchainError
from ._tile.launching import install as _install_tile
from ._version import __version__ as __version__
from .interop import borrow as borrow

_install_tile()  # Kernel.from_tile
del _install_tile

# tracebacks, reprs and pickles name the public module: trio_cuda.KernelArgumentError
for _module in (interop, ops, testing, trace, unsafe):
    _publish(vars(_module), _module.__name__, _module.__all__)
_publish(globals(), __name__)
del _module
