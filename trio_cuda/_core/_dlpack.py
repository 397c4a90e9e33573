"""DLPack structures and capsules, with ctypes only (no ``cuda`` import).

Invariants:

* A capsule made by :func:`make_capsule` owns one ``DLManagedTensor`` (legacy,
  capsule name ``"dltensor"``) or ``DLManagedTensorVersioned`` (``"dltensor_versioned"``)
  and the Python objects behind it (kept in ``_HOLDERS`` under the struct's
  address). Its ``release`` callback runs exactly once: when the consumer calls
  the tensor's deleter, or, if no consumer took the capsule, when
  :func:`sweep_dropped` finds it dropped with its original name (the scope
  sweeps at each retirement pass, conflicting access, ``statistics()``, the
  close of an exported allocation's last handle, and exit); then its
  ``swept`` callback runs instead, where one was given. Capsules have no
  destructor: one would run with a refusing consumer's exception set, and
  fail.
* The deleter may run on any thread (or inside a garbage collection); a
  ``release`` callback must only hand work to the Trio loop, never touch
  runtime state itself. A ``swept`` callback runs only from
  :func:`sweep_dropped`, which its callers run on a Trio loop at a point where
  the runtime's state may change, so it may act at once.
* :func:`consume_capsule` takes a foreign capsule over (renames it to
  ``"used_..."``); the returned :class:`ImportedTensor` calls the producer's
  deleter exactly once, on :meth:`ImportedTensor.close` or when collected.
* :func:`expire_unconsumed` ends capsules that must not outlive a call (those
  made inside an ``ops.external`` fn, whose leases end with its submission):
  one not consumed yet is renamed ``"expired_dltensor[_versioned]"``, which no
  consumer accepts, and forgotten; its ``release`` does not run. One already
  consumed is its consumer's, as any other.
* Shapes and strides are int64 in DLPack: :func:`make_capsule` refuses one
  that does not fit (``ValueError``) before it makes anything, and
  :class:`ImportedTensor` refuses a negative dimension, or a tensor spanning
  more than 2**63 - 1 bytes (every dimension counted at least once), before
  it takes the capsule over.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any, Final, final

import numpy as np

# --------------------------------------------------------------------------- constants

kDLCPU: Final = 1
kDLCUDA: Final = 2
kDLCUDAHost: Final = 3
kDLExtDev: Final = 12  #: the simulated device exports as DLPack's test/extension device
kDLCUDAManaged: Final = 13

DEVICE_NAMES: Final = {
    1: "kDLCPU",
    2: "kDLCUDA",
    3: "kDLCUDAHost",
    4: "kDLOpenCL",
    7: "kDLVulkan",
    8: "kDLMetal",
    9: "kDLVPI",
    10: "kDLROCM",
    11: "kDLROCMHost",
    12: "kDLExtDev",
    13: "kDLCUDAManaged",
    14: "kDLOneAPI",
}

_kDLInt, _kDLUInt, _kDLFloat, _kDLBfloat, _kDLComplex, _kDLBool = 0, 1, 2, 4, 5, 6
_KIND_CODES: Final = {"i": _kDLInt, "u": _kDLUInt, "f": _kDLFloat, "c": _kDLComplex, "b": _kDLBool}
_CODE_KINDS: Final = {v: k for k, v in _KIND_CODES.items()}

_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1

FLAG_READ_ONLY: Final = 1
FLAG_IS_COPIED: Final = 2
VERSION: Final = (1, 1)


def device_name(device_type: int) -> str:
    return DEVICE_NAMES.get(device_type, f"device type {device_type}")


# --------------------------------------------------------------------------- structures


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# The Python C-API, called without releasing the GIL. Private function objects,
# so that argtypes set elsewhere on ctypes.pythonapi cannot interfere.
_api = ctypes.pythonapi
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api)
)
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)
_PyCapsule_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api)
)

# Capsule names must outlive every capsule: ctypes string buffers kept forever.
_NAMES: Final = {
    name: ctypes.create_string_buffer(name)
    for name in (
        b"dltensor",
        b"dltensor_versioned",
        b"used_dltensor",
        b"used_dltensor_versioned",
        b"expired_dltensor",
        b"expired_dltensor_versioned",
    )
}


def _name(name: bytes) -> Any:
    return ctypes.cast(_NAMES[name], ctypes.c_char_p)


# --------------------------------------------------------------------------- dtypes


def dl_dtype(dtype: np.dtype[Any]) -> tuple[int, int] | None:
    """``(code, bits)`` of a NumPy dtype, or None if DLPack cannot carry it."""
    if dtype.fields is not None or dtype.subdtype is not None:
        return None
    code = _KIND_CODES.get(dtype.kind)
    if code is None or dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian):
        return None
    return code, dtype.itemsize * 8


def np_dtype(code: int, bits: int, lanes: int) -> np.dtype[Any] | None:
    """The NumPy dtype of a DLPack dtype, or None if NumPy has none."""
    kind = _CODE_KINDS.get(code)
    if kind is None or lanes != 1 or bits % 8:
        return None
    if kind == "b":
        return np.dtype(np.bool_) if bits == 8 else None
    try:
        return np.dtype(f"{kind}{bits // 8}")
    except TypeError:
        return None


# --------------------------------------------------------------------------- export


@final
class _Holder:
    """Everything a capsule's struct points into, plus the release callback."""

    __slots__ = ("lock", "release", "shape", "strides", "struct", "swept")

    def __init__(
        self,
        struct: ctypes.Structure,
        shape: Any,
        strides: Any,
        release: Callable[[], None],
        swept: Callable[[], None] | None = None,
    ) -> None:
        self.struct = struct
        self.shape = shape
        self.strides = strides
        self.release: Callable[[], None] | None = release
        self.swept = swept
        self.lock = threading.Lock()


_HOLDERS: dict[int, _Holder] = {}


def _run_release(addr: int, *, swept: bool = False) -> None:
    """Run the capsule's release (``swept``: its ``swept`` callback where it
    has one), once."""
    holder = _HOLDERS.pop(addr, None)
    if holder is None:
        return
    with holder.lock:
        release, holder.release = holder.release, None
        on_sweep, holder.swept = holder.swept, None
    if release is not None:
        if swept and on_sweep is not None:
            on_sweep()
        else:
            release()


def _on_delete(addr: int | None) -> None:
    # The consumer's deleter call (any thread): it consumed the capsule and is done.
    if addr:
        UNCONSUMED.pop(addr, None)
        _run_release(addr)


_DELETER: Final = _Deleter(_on_delete)

#: capsules not consumed yet, by their managed tensor's address. A capsule has
#: no destructor: a Python destructor can run while the consumer has an
#: exception set (NumPy refusing a device), and any call it makes then fails
#: and replaces that exception with a SystemError (and its lease was never
#: released). Instead, a capsule dropped unconsumed is found here by
#: :func:`sweep_dropped` and released.
UNCONSUMED: dict[int, object] = {}
_CONSUMED_NAMES: Final = (b"used_dltensor_versioned", b"used_dltensor")


def sweep_dropped() -> int:
    """Release the exports whose capsules were dropped without being consumed
    (a consumer refused them, or nobody took them); forget the ones a
    consumer took (it calls the deleter when done). Returns how many were
    released. Call it on a Trio loop, where the runtime's state may change:
    a released capsule's ``swept`` callback may finish its export at once."""
    released = 0
    for addr, capsule in list(UNCONSUMED.items()):
        if any(_PyCapsule_IsValid(capsule, _name(n)) for n in _CONSUMED_NAMES):
            UNCONSUMED.pop(addr, None)
        # references: the table, the list's pair, the loop variable, the argument
        elif sys.getrefcount(capsule) <= 4:
            UNCONSUMED.pop(addr, None)
            _run_release(addr, swept=True)
            released += 1
    return released


def make_capsule(
    *,
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: tuple[int, int],
    device: tuple[int, int],
    versioned: bool,
    read_only: bool,
    release: Callable[[], None],
    swept: Callable[[], None] | None = None,
) -> object:
    """A DLPack capsule for ``ptr``. ``strides`` are in elements. ``release``
    runs once, when the consumer deletes it, or, if no consumer took it, when
    :func:`sweep_dropped` finds it dropped; ``swept``, if given, runs then
    instead (on the loop, where it may act at once)."""
    for label, values, low in (("shape", shape, 0), ("strides", strides, _INT64_MIN)):
        if any(not low <= v <= _INT64_MAX for v in values):
            raise ValueError(
                f"DLPack export: {label}: expected values that fit int64 (from {low} to 2**63 - 1), "
                f"got {values}"
            )
    ndim = len(shape)
    c_shape = (ctypes.c_int64 * max(ndim, 1))(*shape)
    c_strides = (ctypes.c_int64 * max(ndim, 1))(*strides)
    struct: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        struct = DLManagedTensorVersioned()
        struct.version.major, struct.version.minor = VERSION
        struct.flags = FLAG_READ_ONLY if read_only else 0
        name = b"dltensor_versioned"
    else:
        struct = DLManagedTensor()
        name = b"dltensor"
    t = struct.dl_tensor
    t.data = ptr or None
    t.device.device_type, t.device.device_id = device
    t.ndim = ndim
    t.dtype.code, t.dtype.bits = dtype
    t.dtype.lanes = 1
    t.shape = ctypes.cast(c_shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(c_strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    struct.manager_ctx = None
    struct.deleter = _DELETER
    addr = ctypes.addressof(struct)
    _HOLDERS[addr] = _Holder(struct, c_shape, c_strides, release, swept)
    try:
        capsule = _PyCapsule_New(addr, _name(name), None)
    except BaseException:
        _HOLDERS.pop(addr, None)
        raise
    UNCONSUMED[addr] = capsule
    return capsule


def expire_unconsumed(capsules: list[object]) -> int:
    """Make the capsules of ``capsules`` that no consumer took yet unusable
    (renamed ``"expired_..."``: consumers refuse them as consumed) and forget
    them; their ``release`` does not run. Capsules a consumer took stay its
    own (its deleter runs as usual). Returns how many expired."""
    expired = 0
    for capsule in capsules:
        for name in (b"dltensor_versioned", b"dltensor"):
            if _PyCapsule_IsValid(capsule, _name(name)):
                addr = _PyCapsule_GetPointer(capsule, _name(name))
                _PyCapsule_SetName(capsule, _name(b"expired_" + name))
                UNCONSUMED.pop(addr, None)
                holder = _HOLDERS.pop(addr, None)
                if holder is not None:
                    with holder.lock:
                        holder.release = holder.swept = None
                expired += 1
                break
    return expired


def no_release() -> None:
    """The ``release`` of a capsule whose memory no lease of its own covers."""


def live_exports() -> int:
    """Capsules made here whose deleter has not run yet (for tests); capsules
    dropped unconsumed are swept first."""
    sweep_dropped()
    return len(_HOLDERS)


# --------------------------------------------------------------------------- import


def _check_extent(shape: tuple[int, ...], dtype: tuple[int, int, int]) -> None:
    """Raise ``ValueError`` for a negative dimension, or for a tensor that
    spans more than 2**63 - 1 bytes (every dimension counted at least once,
    as NumPy does)."""
    if any(d < 0 for d in shape):
        raise ValueError(f"DLPack tensor: shape: expected non-negative dimensions, got {shape}")
    _, bits, lanes = dtype
    span = max(1, -(-bits * lanes // 8))
    for d in shape:
        span *= max(d, 1)
    if span > _INT64_MAX:
        raise ValueError(
            f"DLPack tensor: shape: expected a tensor of at most 2**63 - 1 bytes (every dimension "
            f"counted at least once), got shape {shape} of {bits}-bit x {lanes} elements ({span} bytes)"
        )


@final
class ImportedTensor:
    """A consumed foreign DLPack tensor. Closing it (or collecting it) calls
    the producer's deleter, once."""

    __slots__ = (
        "__weakref__",
        "_addr",
        "_deleter",
        "_lock",
        "device",
        "dtype",
        "ptr",
        "read_only",
        "shape",
        "strides",
    )

    def __init__(self, capsule: object) -> None:
        versioned = bool(_PyCapsule_IsValid(capsule, _name(b"dltensor_versioned")))
        if not versioned and not _PyCapsule_IsValid(capsule, _name(b"dltensor")):
            raise BufferError(
                "__dlpack__ returned a capsule that is not named 'dltensor' or 'dltensor_versioned' "
                "(already consumed, or not a DLPack capsule)"
            )
        name = b"dltensor_versioned" if versioned else b"dltensor"
        addr = _PyCapsule_GetPointer(capsule, _name(name))
        if not addr:
            raise BufferError("__dlpack__ returned a capsule with a NULL tensor")
        flags = 0
        mt: DLManagedTensor | DLManagedTensorVersioned
        if versioned:
            mt = DLManagedTensorVersioned.from_address(addr)
            if mt.version.major != 1:
                raise BufferError(
                    f"DLPack: expected a version 1.x tensor, got {mt.version.major}.{mt.version.minor}"
                )
            flags = int(mt.flags)
        else:
            mt = DLManagedTensor.from_address(addr)
        t = mt.dl_tensor
        ndim = int(t.ndim)
        if ndim < 0:
            raise ValueError(f"DLPack tensor: ndim: expected a non-negative number of dimensions, got {ndim}")
        self.shape = tuple(int(t.shape[i]) for i in range(ndim))
        self.strides = None if not t.strides else tuple(int(t.strides[i]) for i in range(ndim))
        self.device = (int(t.device.device_type), int(t.device.device_id))
        self.dtype = (int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes))
        _check_extent(self.shape, self.dtype)  # before the capsule is ours: its producer keeps it
        self.ptr = int(t.data or 0) + int(t.byte_offset)
        self.read_only = bool(flags & FLAG_READ_ONLY)
        # Take the capsule over: from now on its destruction does not delete.
        _PyCapsule_SetName(capsule, _name(b"used_dltensor_versioned" if versioned else b"used_dltensor"))
        self._addr = addr
        fn = ctypes.cast(mt.deleter, ctypes.c_void_p).value
        self._deleter: Any = _Deleter(fn) if fn else None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Call the producer's deleter (once)."""
        with self._lock:
            deleter, self._deleter = self._deleter, None
        if deleter is not None:
            deleter(self._addr)

    def __del__(self) -> None:
        if hasattr(self, "_lock"):  # not when __init__ failed
            self.close()
