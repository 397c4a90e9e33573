"""The real CUDA backend: the driver protocol on ``cuda.bindings.driver`` and NVRTC.

Invariants:

* Importing this package never calls the driver: it imports on machines
  without libcuda (where ``cuda.bindings.driver`` imports but the first call
  raises ``DynamicLibNotFoundError``). :func:`open_context` is the first call.
  ``trio_cuda._backends`` imports it only when a CUDA device is asked for.
* Modules, one concept each, importing only downward in this order:
  ``bindings`` (the ``cu`` module), ``errors`` (CUresult -> trio_cuda
  errors), ``primary`` (primary contexts, device facts), ``waiters`` (waiter
  threads), ``nvrtc`` (compilation and its disk cache), ``state`` (what the
  components share: device, CUcontext, sticky error), ``streams`` (streams,
  markers, gates), ``graphs`` (capture and replay), ``completion``
  (``wait_for_progress``), ``staging`` (pinned host copies), ``launch``
  (kernels), ``timing`` (device times for traces), ``context``
  (:class:`CudaContext` and its memory, interop and close), ``peer`` (copies
  between devices; imported on first use).
* :class:`CudaContext` has no base classes: it holds one component per
  concept as a field and delegates to it. A component gets the components it
  uses (the shared ``ContextState``, the ``StreamTable``) as constructor
  arguments and uses only their attributes and methods without a leading
  underscore (see ``state``); a module never imports one above it except for
  type checks.
* Checks and errors the simulator raises alike come from
  ``trio_cuda._backends._common``.
"""

from .context import CudaContext as CudaContext
from .context import open_context as open_context
from .graphs import CudaGraphExec as CudaGraphExec
from .graphs import CudaGraphTemplate as CudaGraphTemplate
from .launch import CudaFunction as CudaFunction
from .nvrtc import compile_statistics as compile_statistics
from .streams import CudaGate as CudaGate
from .streams import CudaMarker as CudaMarker
from .streams import CudaStream as CudaStream

__all__ = [
    "CudaContext",
    "CudaFunction",
    "CudaGate",
    "CudaGraphExec",
    "CudaGraphTemplate",
    "CudaMarker",
    "CudaStream",
    "compile_statistics",
    "open_context",
]
