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
  pointer) before its producer's stream is fenced (``_cai_layout``).
"""

from __future__ import annotations as _annotations  # (aliased: this module exposes only __all__)

import math
import typing

import numpy as np

from ._core import _array, _dlpack, _ops, _scope
from ._core._array import _trivial

if typing.TYPE_CHECKING:
    from typing import Any, Literal

    from ._core._array import DeviceArray, Order
    from ._core._scope import ResourceScope
    from ._core._stream import Stream

__all__ = ["borrow"]


class _Borrow(_ops.DeviceOp[None]):
    __slots__ = ()

    def __repr__(self) -> str:
        return "borrow"


_BORROW_OP = _Borrow()


def _layout(what: str, shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> Order:
    """The order of a layout given in byte strides (None: C-contiguous)."""
    if strides is None or _trivial(shape):
        return "C"
    if tuple(strides) == _array.contiguous_strides(shape, itemsize, "C"):
        return "C"
    if tuple(strides) == _array.contiguous_strides(shape, itemsize, "F"):
        return "F"
    raise ValueError(
        f"{what}: expected C- or F-contiguous memory, got strides {tuple(strides)} (bytes) for shape "
        f"{shape}; make it contiguous first (e.g. .contiguous() or cupy.ascontiguousarray)"
    )


def _check_device(scope: ResourceScope, what: str, ptr: int, nbytes: int) -> None:
    problem = scope._driver.pointer_device(ptr, nbytes)
    if problem is not None:
        raise ValueError(f"{what}: expected device memory of this scope's device, got memory where {problem}")


def _from_dlpack(
    obj: Any, scope: ResourceScope, stream: Stream, what: str
) -> tuple[int, tuple[int, ...], np.dtype[Any], Order, bool, object]:
    ours = scope._driver.dlpack_device
    device = tuple(int(x) for x in obj.__dlpack_device__())
    mine = tuple(ours())
    if device[0] in (_dlpack.kDLCPU, _dlpack.kDLCUDAHost):
        raise ValueError(
            f"{what}: expected device memory, got a host array ({type(obj).__name__} on "
            f"{_dlpack.device_name(device[0])}); copy host data with 'await gpu.to_device(array)'"
        )
    managed_ok = mine[0] == 2 and device[0] == _dlpack.kDLCUDAManaged
    if device != mine and not managed_ok:
        raise ValueError(
            f"{what}: expected memory of this scope's device ({_dlpack.device_name(mine[0])}, id {mine[1]}), "
            f"got {type(obj).__name__} on {_dlpack.device_name(device[0])}, id {device[1]}"
        )
    consumer = scope._driver.stream_address(stream.handle)
    if device[0] == _dlpack.kDLExtDev:  # simulated memory: exported only to a consumer that names its device
        capsule = obj.__dlpack__(stream=consumer, max_version=(1, 1), dl_device=device)
    else:
        try:
            capsule = obj.__dlpack__(stream=consumer, max_version=(1, 1))
        except TypeError:  # a producer of DLPack < 1.0 (no max_version)
            capsule = obj.__dlpack__(stream=consumer)
    tensor = _dlpack.ImportedTensor(capsule)
    try:
        code, bits, lanes = tensor.dtype
        dt = _dlpack.np_dtype(code, bits, lanes)
        if dt is None:
            raise TypeError(
                f"{what}: expected a DLPack dtype NumPy has (bool, int, uint, float, complex; one lane), "
                f"got code {code}, {bits} bits, {lanes} lanes"
            )
        shape = tensor.shape
        strides = None if tensor.strides is None else tuple(s * dt.itemsize for s in tensor.strides)
        order = _layout(what, shape, strides, dt.itemsize)
        return tensor.ptr, shape, dt, order, tensor.read_only, tensor
    except BaseException:
        tensor.close()
        raise


_CAI = "CUDA Array Interface"
_INT64_MIN = -(2**63)


def _cai_ints(what: str, key: str, value: object) -> tuple[int, ...]:
    """A CUDA Array Interface ``shape`` or ``strides``: a tuple of ints."""
    if isinstance(value, tuple | list) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value
    ):
        return tuple(int(v) for v in value)
    raise TypeError(f"{what}: {_CAI} {key}: expected a tuple of ints, got {value!r}")


def _cai_layout(cai: dict[str, Any], what: str) -> tuple[int, tuple[int, ...], np.dtype[Any], Order, bool]:
    """The pointer, shape, element dtype, order and read-only flag of a CUDA
    Array Interface dict, checked as arrays made here are: every dimension in
    ``[0, 2**63 - 1]``, the bytes spanned (every dimension counted at least
    once) at most 2**63 - 1, strides that fit int64 and describe a C- or
    F-contiguous layout. A sub-array dtype adds its dimensions to the shape,
    as in NumPy. Raises before anything is fenced or taken over."""
    data = cai["data"]
    if not (isinstance(data, tuple | list) and len(data) == 2):
        raise TypeError(f"{what}: {_CAI} data: expected a (pointer, read_only) pair, got {data!r}")
    ptr, read_only = data
    if ptr is None:
        ptr = 0
    if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
        raise TypeError(f"{what}: {_CAI} data: expected an int device pointer, got {ptr!r}")
    if not 0 <= ptr < 2**64:
        raise ValueError(f"{what}: {_CAI} data: expected a device pointer from 0 to 2**64 - 1, got {ptr}")
    shape = _cai_ints(what, "shape", cai["shape"])
    if any(d < 0 for d in shape):
        raise ValueError(f"{what}: {_CAI} shape: expected non-negative dimensions, got {shape}")
    if any(d > _array.MAX_EXTENT for d in shape):
        raise ValueError(
            f"{what}: {_CAI} shape: expected dimensions of at most 2**63 - 1 (int64), got {shape}"
        )
    descr = cai.get("descr")
    structured = isinstance(descr, list) and bool(descr) and (len(descr) > 1 or bool(descr[0][0]))
    try:
        given = np.dtype(descr) if structured else np.dtype(cai["typestr"])
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{what}: expected a dtype NumPy understands, got {cai.get('typestr')!r} ({exc})"
        ) from None
    try:
        dt, sub = _array.split_dtype(given)
    except TypeError as exc:
        raise TypeError(f"{what}: {_CAI} {exc}") from None
    full = (*shape, *sub)
    _array.check_span(full, dt, label=f"{what}: {_CAI} shape")
    strides: tuple[int, ...] | None = None
    if cai.get("strides") is not None:
        strides = _cai_ints(what, "strides", cai["strides"])
        if len(strides) != len(shape):
            raise ValueError(
                f"{what}: {_CAI} strides: expected one stride per dimension of shape {shape}, got {strides}"
            )
        if any(not _INT64_MIN <= st <= _array.MAX_EXTENT for st in strides):
            raise ValueError(
                f"{what}: {_CAI} strides: expected values that fit int64 (from -2**63 to 2**63 - 1), "
                f"got {strides}"
            )
    order = _layout(what, shape, strides, given.itemsize)
    if sub:  # the sub-array's dimensions are C-contiguous within each element
        if order == "F" and not _trivial(shape):
            raise ValueError(
                f"{what}: a sub-array dtype adds trailing dimensions {sub}, which an F-order array cannot "
                f"take and stay contiguous; got {given} for an F-order array of shape {shape}"
            )
        order = "C"
    return int(ptr), full, dt, order, bool(read_only)


def _from_cai(
    obj: Any, scope: ResourceScope, stream: Stream, what: str
) -> tuple[int, tuple[int, ...], np.dtype[Any], Order, bool, object]:
    cai = obj.__cuda_array_interface__
    if not isinstance(cai, dict) or not {"data", "shape", "typestr"} <= cai.keys():
        raise TypeError(f"{what}: expected a CUDA Array Interface dict, got {cai!r}")
    if cai.get("mask") is not None:
        raise ValueError(f"{what}: expected no mask in the CUDA Array Interface, got one")
    ptr, shape, dt, order, read_only = _cai_layout(cai, what)
    if scope.backend != "cuda":
        raise ValueError(
            f"{what}: expected memory of this scope's device, got CUDA memory ({type(obj).__name__}, "
            f"CUDA Array Interface) in a scope on the {scope.backend!r} backend"
        )
    producer = cai.get("stream")
    if producer is not None:
        if isinstance(producer, bool) or not isinstance(producer, int) or producer == 0:
            raise ValueError(
                f"{what}: expected a CUDA Array Interface stream handle (not 0), got {producer!r}"
            )
        driver: Any = scope._driver
        fence = driver.foreign_fence(producer)
        try:
            driver.wait_fence(stream.handle, fence)
        finally:
            driver.drop_fence(fence)
    return ptr, shape, dt, order, read_only, obj


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
    what = "borrow: obj"
    if access not in ("read", "write"):
        raise ValueError(f"borrow: access: expected 'read' or 'write', got {access!r}")
    if scope is None:
        scope = _scope.current_scope()
    elif not isinstance(scope, _scope.ResourceScope):
        raise TypeError(f"borrow: scope: expected a ResourceScope, got {type(scope).__name__}")
    scope._check_open("borrow")
    if scope._enqueuing:
        raise RuntimeError(
            "borrow: cannot borrow from inside a then/map closure or an ops.external fn of a submission "
            "of this scope (its leases are being taken); borrow before submitting, and pass the "
            "borrowed array in the external's reads= or writes="
        )
    s = scope._pick(_BORROW_OP, stream)
    has_dlpack = callable(getattr(obj, "__dlpack__", None)) and callable(
        getattr(obj, "__dlpack_device__", None)
    )
    if has_dlpack:
        ptr, shape, dt, order, read_only, owner = _from_dlpack(obj, scope, s, what)
    elif isinstance(obj, np.ndarray) or hasattr(obj, "__array_interface__"):
        raise ValueError(
            f"{what}: expected device memory, got a host array ({type(obj).__name__}); copy host data "
            f"with 'await gpu.to_device(array)'"
        )
    else:
        try:
            has_cai = hasattr(obj, "__cuda_array_interface__")
        except Exception:  # a property that fails: treat it as absent
            has_cai = False
        if not has_cai:
            raise TypeError(
                f"{what}: expected an object with __dlpack__ or __cuda_array_interface__ "
                f"(CuPy, PyTorch, Numba, a DeviceArray), got {type(obj).__name__}"
            )
        ptr, shape, dt, order, read_only, owner = _from_cai(obj, scope, s, what)
    try:
        if access == "write" and read_only:
            raise ValueError(
                "borrow: access: expected 'read' for memory its producer exported read-only, got 'write'"
            )
        nbytes = math.prod(shape) * dt.itemsize  # bounded: at most 2**63 - 1
        _check_device(scope, what, ptr, nbytes)
    except BaseException:
        if isinstance(owner, _dlpack.ImportedTensor):
            owner.close()
        raise
    alloc = _array.Allocation(scope, ptr, nbytes)
    alloc.borrowed = access
    alloc.owner = owner
    # Publish the producer's fence: work on other streams orders after `s`.
    arr = scope._adopt(alloc, shape, dt, order, s, _BORROW_OP, "borrow", dirty=True)
    arr._readonly = access == "read"
    return arr
