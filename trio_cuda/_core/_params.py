"""Kernel parameter specs (:class:`Scalar`, :class:`In`, :class:`Out`,
:class:`InOut`, :class:`Slice`), their dtype rules, and argument conversion.

Invariants:

* A spec is immutable and its dtype is checked when it is made. A by-value
  parameter's dtype is a native-order numeric, bool, complex (aligned like
  ``float2``/``double2``), ``ml_dtypes`` scalar or a structured dtype whose
  fields sit at C offsets; anything else is refused when the :class:`Scalar`
  is made. An array parameter's dtype (``In``, ``Out``, ``InOut``,
  ``Slice``) is an array's element dtype: a sub-array dtype, whose dimensions
  belong to the array's shape, and the object and zero-size dtypes that no
  array has are refused when the spec is made, never at a launch.
* Sizes and alignments follow the C ABI: a parameter's alignment is its
  dtype's ``alignof``, raised (never lowered) by ``align=`` or
  ``dtype.metadata["align"]``; its size is the dtype's size rounded up to it.
* ``In`` takes a shared read lease, ``Out``/``InOut`` an exclusive one; a
  ``Slice`` has its own access mode; scalars take none.
* A value becomes a kernel argument only through an exact conversion: an int
  out of range, a finite float that would overflow, or a NumPy scalar of
  another dtype is refused with a :class:`KernelArgumentError` naming the
  argument, never narrowed silently.
"""

from __future__ import annotations

import cmath
import importlib
import math
from typing import Any, Literal

import attrs
import numpy as np

from ._array import DeviceArray, split_dtype
from ._errors import KernelArgumentError
from ._final import final
from ._ops import Access

DTypeLike = Any
AccessName = Literal["read", "write", "readwrite"]


def _as_dtype(value: DTypeLike) -> np.dtype[Any]:
    try:
        return np.dtype(value)
    except TypeError as exc:
        raise TypeError(f"dtype: expected a NumPy dtype or dtype string, got {value!r}") from exc


def _array_dtype(value: DTypeLike) -> np.dtype[Any]:
    """The element dtype of an array parameter (``In``, ``Out``, ``InOut``,
    ``Slice``). An array's dtype is never a sub-array dtype (its dimensions
    join the array's shape, see ``_array.normalize_shape``), so one is refused
    here, naming the element dtype and the trailing shape to use instead;
    object and zero-size dtypes, which no array has, are refused too."""
    dtype = _as_dtype(value)
    element, sub = split_dtype(dtype)
    if sub:
        dims = ", ".join(str(d) for d in sub)
        raise TypeError(
            f"dtype: expected the element dtype of the array (a sub-array dtype's dimensions belong to "
            f"the array's shape, as in NumPy), got {dtype}; declare {element.name!r} and pass an array "
            f"of shape (..., {dims}) of {element.name}"
        )
    return dtype


# --------------------------------------------------------------------------- params


def _is_ml_dtype(dtype: np.dtype[Any]) -> bool:
    """A scalar type of the optional ``ml_dtypes`` package (bfloat16, float8_*, int4, ...)."""
    return (
        dtype.kind == "V"
        and dtype.fields is None
        and dtype.subdtype is None
        and getattr(dtype.type, "__module__", "") == "ml_dtypes"
    )


def _param_dtype_problem(dtype: np.dtype[Any], *, field: bool = False) -> str | None:
    """Why ``dtype`` cannot be a by-value kernel parameter (or a field of
    one), or None when it can."""
    if dtype.subdtype is not None:
        if not field:
            return "a fixed-size array is not a C parameter type (wrap it in a structured dtype)"
        return _param_dtype_problem(dtype.subdtype[0], field=True)
    if not dtype.isnative:
        return "it is not in the native byte order"
    if dtype.fields is not None:
        for fname, spec in dtype.fields.items():
            fdt: np.dtype[Any] = spec[0]
            offset: int = spec[1]
            problem = _param_dtype_problem(fdt, field=True)
            if problem is not None:
                return f"field {fname!r}: {problem}"
            align = dtype_alignment(fdt)
            if offset % align:
                return (
                    f"field {fname!r} ({fdt}) is at offset {offset}, not a multiple of its "
                    f"alignment {align} as in C (build the dtype with align=True, or give C offsets)"
                )
        return None
    kind = dtype.kind
    if kind in "biu":
        return None
    if kind == "f" and dtype.itemsize in (2, 4, 8):
        return None
    if kind == "c" and dtype.itemsize in (8, 16):
        return None
    if kind in "fc":
        return f"{dtype.name} (long double) has no CUDA equivalent"
    if _is_ml_dtype(dtype):
        return None
    return f"{dtype.kind!r} dtypes are not kernel parameter types"


def _scalar_dtype(value: DTypeLike) -> np.dtype[Any]:
    dtype = _as_dtype(value)
    problem = _param_dtype_problem(dtype)
    if problem is not None:
        raise TypeError(
            f"dtype: expected a numeric, bool, complex or C-layout structured dtype, got {dtype}: {problem}"
        )
    return dtype


def _check_align(inst: Scalar, _attr: object, value: int | None) -> None:
    if value is None:
        return
    if type(value) is not int or value <= 0 or value & (value - 1):
        raise ValueError(f"align: expected a power of two, got {value!r}")
    natural = dtype_alignment(inst.dtype)
    if value < natural:
        raise ValueError(
            f"align: expected a power of two >= {natural} (the alignment of {inst.dtype}), got {value}"
        )


@final
@attrs.frozen
class Scalar:
    """A by-value parameter: a NumPy scalar type (``"f2"``, ``"f4"``, ``"i8"``,
    ``"c8"``, ``ml_dtypes.bfloat16``...), or a structured dtype for a C struct.

    ``align`` over-aligns the parameter, as ``__align__(n)``/``alignas(n)``
    does in C (e.g. a struct holding a ``float4``); it must be a power of two
    no smaller than the dtype's own alignment. ``dtype.metadata["align"]`` does
    the same for a struct dtype."""

    #: the value's type, as a NumPy dtype (given as a dtype, a type or a
    #: string such as ``"f4"``): the C type the kernel declares
    dtype: np.dtype[Any] = attrs.field(converter=_scalar_dtype)
    #: the parameter's name, for errors and the kernel's repr (``n: Scalar(int32)``)
    name: str | None = attrs.field(default=None, kw_only=True)
    #: bytes to align the parameter to: a power of two, at least the dtype's
    #: own alignment; None for the dtype's (see :attr:`alignment`)
    align: int | None = attrs.field(default=None, kw_only=True, validator=_check_align)

    @property
    def access(self) -> None:
        """Scalars take no lease."""
        return None

    @property
    def alignment(self) -> int:
        """The parameter's alignment in the argument arena (C ``alignof``)."""
        natural = dtype_alignment(self.dtype)
        return natural if self.align is None else max(natural, self.align)

    @property
    def size(self) -> int:
        """The parameter's size in the argument arena (C ``sizeof``: the
        dtype's size rounded up to :attr:`alignment`)."""
        return _align_up(self.dtype.itemsize, self.alignment)


@attrs.frozen
class _ArrayParam:
    dtype: np.dtype[Any] = attrs.field(converter=_array_dtype)
    name: str | None = attrs.field(default=None, kw_only=True)
    access: Access = attrs.field(init=False, default=Access.READ)


@final
@attrs.frozen
class In(_ArrayParam):
    """A device array the kernel only reads (shared read lease). ``dtype``
    is the array's element dtype, which the argument must have; ``name``
    names the parameter in errors."""

    #: ``Access.READ``: a shared lease (other readers of the array's bytes may
    #: run alongside the kernel, writers never do), and a read-only view in
    #: the kernel's reference
    access: Access = attrs.field(init=False, default=Access.READ)


@final
@attrs.frozen
class Out(_ArrayParam):
    """A device array the kernel writes (exclusive lease). ``dtype`` is the
    array's element dtype, which the argument must have; ``name`` names the
    parameter in errors."""

    #: ``Access.WRITE``: an exclusive lease (no other work on the array's bytes
    #: runs alongside the kernel); the launch outputs the array (in a tuple,
    #: if the kernel writes several)
    access: Access = attrs.field(init=False, default=Access.WRITE)


@final
@attrs.frozen
class InOut(_ArrayParam):
    """A device array the kernel reads and writes (exclusive lease). ``dtype``
    is the array's element dtype, which the argument must have; ``name``
    names the parameter in errors."""

    #: ``Access.WRITE``: an exclusive lease, as for :class:`Out`; the launch
    #: outputs the array (in a tuple, if the kernel writes several)
    access: Access = attrs.field(init=False, default=Access.WRITE)


def _access_from_name(value: Access | str) -> Access:
    if isinstance(value, Access):
        return value
    table = {"read": Access.READ, "write": Access.WRITE, "readwrite": Access.WRITE}
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"access: expected 'read', 'write' or 'readwrite', got {value!r}") from None


def _check_len_dtype(_inst: object, _attr: object, value: np.dtype[Any]) -> None:
    if value.kind not in "iu" or not value.isnative:
        raise TypeError(f"len_dtype: expected a native integer dtype (e.g. 'u8' for size_t), got {value}")


@final
@attrs.frozen
class Slice:
    """A device array passed as two parameters: a pointer and its length
    (``len_dtype``, ``size_t`` by default)."""

    #: the array's element dtype, which the argument must have
    dtype: np.dtype[Any] = attrs.field(converter=_array_dtype)
    #: the lease the kernel takes: ``Access.READ`` (given as ``"read"``: shared)
    #: or ``Access.WRITE`` (``"write"`` or ``"readwrite"``: exclusive, and the
    #: launch outputs the array), the default
    access: Access = attrs.field(default=Access.WRITE, converter=_access_from_name, kw_only=True)
    #: the C type of the length parameter, a native integer dtype (``size_t``,
    #: ``"u8"``, by default); the length is the array's element count
    len_dtype: np.dtype[Any] = attrs.field(
        default=np.dtype(np.uint64), converter=_as_dtype, kw_only=True, validator=_check_len_dtype
    )
    #: the parameter's name, for errors and the kernel's repr
    name: str | None = attrs.field(default=None, kw_only=True)


Param = Scalar | In | Out | InOut | Slice


def _param_label(index: int, param: Param | None) -> str:
    if param is None:
        return f"argument {index}"
    desc = f"{type(param).__name__}({param.dtype.str!r})"
    if param.name:
        return f"argument {index} ({param.name}: {desc})"
    return f"argument {index} ({desc})"


# --------------------------------------------------------------------------- C layout


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def dtype_alignment(dtype: np.dtype[Any]) -> int:
    """C alignment of ``dtype``: its fields' largest alignment, or the value in
    ``dtype.metadata['align']`` for over-aligned structs."""
    meta: dict[str, Any] = dict(dtype.metadata or {})
    forced = int(meta.get("align", 0))
    if dtype.fields:
        natural = max(dtype_alignment(f[0]) for f in dtype.fields.values())
    elif dtype.subdtype is not None:
        natural = dtype_alignment(dtype.subdtype[0])
    elif dtype.kind == "c":
        natural = dtype.itemsize  # cuFloatComplex / cuDoubleComplex are float2 / double2
    else:
        natural = max(1, dtype.alignment)
    return max(natural, forced)


# --------------------------------------------------------------------------- argument values


def _convert_scalar(label: str, dtype: np.dtype[Any], value: object) -> np.generic:
    if dtype.fields is not None:
        if isinstance(value, np.void) and value.dtype == dtype:
            return value
        if isinstance(value, np.ndarray) and value.shape == () and value.dtype == dtype:
            item: np.generic = value[()]  # type: ignore[assignment]
            return item
        if isinstance(value, tuple):
            try:
                made: np.generic = np.array(value, dtype=dtype)[()]  # type: ignore[assignment]
                return made
            except (TypeError, ValueError) as exc:
                raise KernelArgumentError(
                    f"{label}: expected a tuple matching {dtype}, got {value!r} ({exc})"
                ) from None
        raise KernelArgumentError(
            f"{label}: expected a NumPy structured scalar of dtype {dtype} or a tuple, "
            f"got {type(value).__name__}"
        )
    if isinstance(value, np.generic):
        if value.dtype != dtype:
            how = f"ml_dtypes.{dtype.name}(x)" if _is_ml_dtype(dtype) else f"np.{dtype.name}(x)"
            raise KernelArgumentError(
                f"{label}: expected a {dtype.name} scalar, got {value.dtype.name} "
                f"({value!r}); convert explicitly, e.g. {how}"
            )
        return value
    if _is_ml_dtype(dtype):
        return _convert_ml(label, dtype, value)
    kind = dtype.kind
    if kind == "b":
        if isinstance(value, bool):
            return np.bool_(value)
    elif kind in "iu":
        if isinstance(value, int) and not isinstance(value, bool):
            info = np.iinfo(dtype)
            if not info.min <= value <= info.max:
                raise KernelArgumentError(
                    f"{label}: value {value} is out of range for {dtype.name} [{info.min}, {info.max}]"
                )
            return dtype.type(value)  # type: ignore[no-any-return]
    elif kind == "f":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _convert_float(label, dtype, value, np.finfo(dtype).max)
    elif kind == "c" and isinstance(value, (int, float, complex)) and not isinstance(value, bool):
        return _convert_float(label, dtype, value, np.finfo(dtype).max)
    raise KernelArgumentError(
        f"{label}: expected a {dtype.name} scalar, got {type(value).__name__} ({value!r})"
    )


def _finite(value: complex | float) -> bool:
    try:
        return cmath.isfinite(value) if isinstance(value, complex) else math.isfinite(value)
    except OverflowError:  # an int too large for a double
        return True


def _convert_float(label: str, dtype: np.dtype[Any], value: complex | float, top: object) -> np.generic:
    """``value`` as a ``dtype`` scalar; refuses a finite value that would
    become infinite (or NaN, for float8 types without infinities)."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            converted: np.generic = dtype.type(value)
        ok = _finite(complex(converted)) if dtype.kind == "c" else math.isfinite(float(converted))
    except OverflowError:
        ok = False
        converted = dtype.type(0)
    if _finite(value) and not ok:
        raise KernelArgumentError(f"{label}: value {value!r} overflows {dtype.name} (max {top})")
    return converted


def _convert_ml(label: str, dtype: np.dtype[Any], value: object) -> np.generic:
    """A Python number as a scalar of an ``ml_dtypes`` type (the package is
    importable: ``dtype`` is one of its types)."""
    ml_dtypes: Any = importlib.import_module("ml_dtypes")
    try:
        finfo: Any = ml_dtypes.finfo(dtype)
    except (TypeError, ValueError, KeyError):
        finfo = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if finfo is not None:
            return _convert_float(label, dtype, value, finfo.max)
        if isinstance(value, int):
            info = ml_dtypes.iinfo(dtype)
            if not int(info.min) <= value <= int(info.max):
                raise KernelArgumentError(
                    f"{label}: value {value} is out of range for {dtype.name} [{info.min}, {info.max}]"
                )
            made: np.generic = dtype.type(value)
            return made
    raise KernelArgumentError(
        f"{label}: expected a {dtype.name} scalar, got {type(value).__name__} ({value!r})"
    )


def _check_array(label: str, param: Param, value: object, access: Access) -> DeviceArray:
    if not isinstance(value, DeviceArray):
        raise KernelArgumentError(f"{label}: expected a trio_cuda DeviceArray, got {type(value).__name__}")
    if value.closed:
        raise KernelArgumentError(f"{label}: the array is closed")
    if value.dtype != param.dtype:
        expected, got = param.dtype.name, value.dtype.name
        if expected == got:  # structured dtypes of one size, byte orders: "void8", "float32"
            expected, got = str(param.dtype), str(value.dtype)
        raise KernelArgumentError(f"{label}: expected dtype {expected}, got {got}")
    if access is Access.WRITE and value.readonly:
        raise KernelArgumentError(
            f"{label}: the kernel writes this argument, but the array is read-only (made by as_readonly())"
        )
    return value
