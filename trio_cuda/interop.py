"""Interoperability with CuPy, PyTorch, Numba and any DLPack or CUDA Array Interface object.

* **Import**: :func:`borrow` wraps another library's device memory in a
  :class:`~trio_cuda.DeviceArray` without taking ownership.
* **Export**: every :class:`~trio_cuda.DeviceArray` has ``__dlpack__`` /
  ``__dlpack_device__`` and (on the cuda backend) ``__cuda_array_interface__``;
  see the "Interoperability" chapter of the docs for the lease each export holds.
  Inside an ``ops.external`` fn, exports of the arrays its ``reads``/``writes``
  cover hold no lease of their own (``_export``).

Invariants:

* Borrowed memory is never freed by trio_cuda. The borrowed handle keeps the
  producer's object (or its DLPack tensor) alive until the last trio_cuda work
  on it retired; only then is the reference dropped (and a DLPack producer's
  deleter called).
* Work on borrowed memory is ordered after the producer's work: the
  producer's stream is fenced when the memory is borrowed, and trio_cuda's
  other streams order after that fence through the ordinary lease table.
* Bad input (host memory, another device, an unsupported dtype, a
  non-contiguous layout, ``access="write"`` on read-only memory) raises before
  anything is retained; a DLPack tensor already taken over is handed back to
  its producer's deleter.
* A borrowed shape is bounded as the shapes of arrays made here are (every
  dimension and the bytes spanned fit int64; a sub-array dtype's dimensions
  join the shape): a DLPack tensor is checked before it is taken over
  (``_dlpack``), a CUDA Array Interface dict (its shape, strides, dtype and
  pointer) before its producer's stream is fenced (``_borrow``).
"""

from __future__ import annotations as _annotations  # (aliased: this module exposes only __all__)

import typing

from ._core import _borrow, _manager, _scope

if typing.TYPE_CHECKING:
    from typing import Literal

    from ._core._array import DeviceArray
    from ._core._scope import ResourceScope
    from ._core._stream import Stream

__all__ = ["borrow"]


def borrow(
    obj: object,
    access: Literal["read", "write"] = "read",
    *,
    scope: ResourceScope | None = None,
    stream: Stream | None = None,
) -> DeviceArray:
    """Wrap another library's device memory (a CuPy array, a PyTorch tensor, a
    Numba device array, a DeviceArray of another scope: anything with
    ``__dlpack__`` or ``__cuda_array_interface__``) in a
    :class:`~trio_cuda.DeviceArray` of ``scope`` (default: the current one),
    without copying and without taking ownership.

    ``access="read"`` gives a read-only handle; ``"write"`` a writable one
    (refused for memory its producer marked read-only). Work on the handle is
    ordered after the producer's work at the time of the call: DLPack
    producers make ``stream`` (default: one of the scope's) wait for their
    stream; a CUDA Array Interface ``stream`` is fenced the same way. The
    memory is never freed by trio_cuda: closing the handle (or the scope
    exiting) lets go of the producer's object once trio_cuda's last work on
    it completed. Until then, the producer must not write memory trio_cuda
    reads, nor touch memory it writes, without ordering after that work
    (export it back with DLPack, or await the work).
    """
    if access not in ("read", "write"):
        raise ValueError(f"borrow: access: expected 'read' or 'write', got {access!r}")
    if scope is None:
        scope = _manager.current_scope()
    elif not isinstance(scope, _scope.ResourceScope):
        raise TypeError(f"borrow: scope: expected a ResourceScope, got {type(scope).__name__}")
    return _borrow.borrow(obj, access, scope, stream)
