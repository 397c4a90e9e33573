"""Borrowed memory: another library's device memory taken in (DLPack or the
CUDA Array Interface) as a :class:`DeviceArray` handle that never owns it.
``trio_cuda.interop.borrow`` checks its public arguments and calls
:func:`borrow` here.

Invariants:

* Everything about ``obj`` is checked before anything is retained: its
  device, dtype, layout and bounds (:func:`cai_layout` for a CUDA Array
  Interface dict; ``_dlpack.ImportedTensor`` for a DLPack tensor, which is
  closed, its producer's deleter called, when a later check fails), and the
  pointer against the scope's device.
* The producer's stream is fenced on the stream the scope picked for the
  borrow, and the new allocation is published as written there
  (``ResourceScope._adopt``), so every other stream orders after the fence
  through the lease table.
* The allocation is marked ``borrowed`` (never freed) and holds the producer's
  object, or its imported DLPack tensor, as ``owner`` until it is "freed".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _array, _dlpack, _ops
from ._array import _trivial

if TYPE_CHECKING:
    from ._array import DeviceArray, Order
    from ._driver import DeviceContext
    from ._scope import ResourceScope
    from ._stream import Stream

__all__ = ["borrow", "cai_layout"]


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


def _check_device(driver: DeviceContext, what: str, ptr: int, nbytes: int) -> None:
    problem = driver.pointer_device(ptr, nbytes)
    if problem is not None:
        raise ValueError(f"{what}: expected device memory of this scope's device, got memory where {problem}")


def _from_dlpack(
    obj: Any, driver: DeviceContext, stream: Stream, what: str
) -> tuple[int, tuple[int, ...], np.dtype[Any], Order, bool, object]:
    ours = driver.dlpack_device
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
    consumer = driver.stream_address(stream.handle)
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


def cai_layout(cai: dict[str, Any], what: str) -> tuple[int, tuple[int, ...], np.dtype[Any], Order, bool]:
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
    obj: Any, scope: ResourceScope, driver: DeviceContext, stream: Stream, what: str
) -> tuple[int, tuple[int, ...], np.dtype[Any], Order, bool, object]:
    cai = obj.__cuda_array_interface__
    if not isinstance(cai, dict) or not {"data", "shape", "typestr"} <= cai.keys():
        raise TypeError(f"{what}: expected a CUDA Array Interface dict, got {cai!r}")
    if cai.get("mask") is not None:
        raise ValueError(f"{what}: expected no mask in the CUDA Array Interface, got one")
    ptr, shape, dt, order, read_only = cai_layout(cai, what)
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
        fence = driver.foreign_fence(producer)
        try:
            driver.wait_fence(stream.handle, fence)
        finally:
            driver.drop_fence(fence)
    return ptr, shape, dt, order, read_only, obj


def borrow(obj: object, access: str, scope: ResourceScope, stream: Stream | None) -> DeviceArray:
    """``trio_cuda.interop.borrow`` once its public arguments are checked:
    ``access`` is "read" or "write", ``scope`` a ResourceScope."""
    what = "borrow: obj"
    scope._check_open("borrow")
    if scope._enqueuing:
        raise RuntimeError(
            "borrow: cannot borrow from inside a then/map closure or an ops.external fn of a submission "
            "of this scope (its leases are being taken); borrow before submitting, and pass the "
            "borrowed array in the external's reads= or writes="
        )
    driver = scope._driver
    s = scope._pick(_BORROW_OP, stream)
    has_dlpack = callable(getattr(obj, "__dlpack__", None)) and callable(
        getattr(obj, "__dlpack_device__", None)
    )
    if has_dlpack:
        ptr, shape, dt, order, read_only, owner = _from_dlpack(obj, driver, s, what)
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
        ptr, shape, dt, order, read_only, owner = _from_cai(obj, scope, driver, s, what)
    try:
        if access == "write" and read_only:
            raise ValueError(
                "borrow: access: expected 'read' for memory its producer exported read-only, got 'write'"
            )
        nbytes = math.prod(shape) * dt.itemsize  # bounded: at most 2**63 - 1
        _check_device(driver, what, ptr, nbytes)
    except BaseException:
        if isinstance(owner, _dlpack.ImportedTensor):
            owner.close()
        raise
    alloc = scope._memory.new(ptr, nbytes)
    alloc.borrowed = access
    alloc.owner = owner
    # Publish the producer's fence: work on other streams orders after `s`.
    return scope._adopt(
        alloc, shape, dt, order, s, _BORROW_OP, "borrow", dirty=True, readonly=access == "read"
    )
