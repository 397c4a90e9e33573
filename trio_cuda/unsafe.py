"""Escape hatches that trade safety for speed.

Invariant: nothing here takes a lease, retains an owner or records a marker.
When a function returns (or raises), the runtime holds nothing of the work; the
caller keeps every array alive and orders every access itself.
"""

from __future__ import annotations as _annotations  # (aliased: this module exposes only __all__)

import typing

import trio as _trio

from ._core import _array, _final, _scope, _stream

if typing.TYPE_CHECKING:
    from typing import Any, TypeVar

    from ._core._array import DeviceArray
    from ._core._ops import DeviceOp
    from ._core._stream import Stream

    T = TypeVar("T")

__all__ = ["CudaView", "async_on", "cuda_view"]


@_trio.lowlevel.enable_ki_protection  # (the driver's launch, called from the compiled path, inherits it)
def async_on(op: DeviceOp[T], stream: Stream) -> T:
    """Enqueue ``op`` on ``stream`` synchronously and return its output.

    No lease, owner or completion marker is taken: the caller must keep every
    array, kernel and host buffer alive until the work completed, and order
    conflicting accesses on other streams. Only the checks that need no
    bookkeeping run (the scope is open; the launch fits the device).
    ``ops.host_closure`` is refused (it needs the completion handoff).
    """
    if type(stream) is not _stream.Stream:
        raise TypeError(f"stream: expected a Stream, got {type(stream).__name__}")
    out: T = _scope.enqueue_unsafe(op, stream)
    return out


@_final.final
class CudaView:
    """A lease-free CUDA Array Interface (v3) view of a :class:`DeviceArray`,
    from :func:`cuda_view`. It keeps the array's handle alive, nothing more."""

    __slots__ = ("__cuda_array_interface__", "array")

    def __init__(self, array: DeviceArray, cai: dict[str, Any]) -> None:
        #: the array viewed: the view holds this handle, so garbage collection
        #: does not release it while the view lives (the memory still goes once
        #: every handle is closed, or at the scope's exit; no lease orders work)
        self.array = array
        self.__cuda_array_interface__ = cai

    def __repr__(self) -> str:
        return f"<unsafe.CudaView of {self.array!r}>"


def cuda_view(arr: DeviceArray) -> CudaView:
    """A view of ``arr`` that another library can wrap without a lease:
    ``cupy.asarray(cuda_view(x))``, ``torch.as_tensor(cuda_view(x), device="cuda")``.

    Unlike ``arr.__cuda_array_interface__``, it takes no lease and names no
    stream to synchronise with: its consumer orders nothing, and nothing checks
    that a lease covers ``arr``. Inside :func:`trio_cuda.ops.external` the safe
    path is the plain export (``cupy.asarray(x)``, ``torch.from_dlpack(x)``), which
    checks that the external's ``reads``/``writes`` cover ``x``; this view is for
    the places no lease covers, where the caller orders every access and keeps
    the scope open while the consumer uses the memory.
    Only on the ``cuda`` backend (simulated memory has no CUDA address)."""
    if not isinstance(arr, _array.DeviceArray):
        raise TypeError(f"arr: expected a DeviceArray, got {type(arr).__name__}")
    backend = arr.scope.device.backend
    if backend != "cuda":
        raise ValueError(
            f"arr: expected an array on the cuda backend, got one on the {backend!r} backend, "
            "whose memory has no CUDA address"
        )
    _array.check_usable(arr, "cuda_view")
    dt = arr.dtype
    cai: dict[str, Any] = {
        "shape": arr.shape,
        "typestr": dt.str,
        "data": (arr.ptr, arr.readonly),
        "version": 3,
        "strides": None if arr.c_contiguous else arr.strides,
        "stream": None,
    }
    if dt.fields is not None:
        cai["descr"] = dt.descr
    return CudaView(arr, cai)
