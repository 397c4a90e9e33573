"""Specialisation signatures of tile kernels and the byte layout of their
parameter buffer.

A tile kernel is compiled once per :class:`TileSignature`: per parameter an
:class:`ArraySpec` (dtype, rank, index width, the layout and alignment the
runtime guarantees), a :class:`ScalarSpec`, a :class:`ConstantSpec`, a
:class:`TupleSpec` or a :class:`ListSpec`, plus the target architecture.
:func:`param_layout` gives the byte layout of the parameter buffer in the
``cutile_python_v2`` calling convention (each array: an 8-byte pointer, then
``ndim`` shape values, then ``ndim`` strides in elements, 4 or 8 bytes each by
the index dtype; a scalar: one slot of its dtype; a constant: nothing; a
tuple: its items in order; a list of arrays: an 8-byte device pointer and an
int32 length; every slot at its natural alignment).

Invariants:

* This module imports neither ``cuda.tile`` nor ``tileiras``: specs, keys and
  layouts are known without the toolchain.
* Specs are immutable values; a malformed one is refused when made (a
  ``ValueError`` or ``TypeError`` naming the field). ``key()`` is a stable
  text, equal for equal specs across processes and machines.
* A spec never claims more than it is given: :func:`spec_of_array` declares a
  unit stride constant only where the stride is 1, a divisibility only as the
  largest power of two (at most 16) that divides the value, an alignment only
  as given, and ``may_alias_internally`` wherever two indices could reach one
  element (zero strides, overlapping dimensions). An array it cannot describe
  (a negative stride, an index dtype too narrow) is a
  :class:`~trio_cuda.KernelArgumentError`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import attrs
import numpy as np

from .._core._errors import KernelArgumentError

__all__ = [
    "CCONV",
    "ArraySpec",
    "ConstantSpec",
    "IndexDtype",
    "ListSpec",
    "ParamLayout",
    "ParamSpec",
    "ScalarSpec",
    "Slot",
    "SlotKind",
    "TileSignature",
    "TupleSpec",
    "address_alignment",
    "param_layout",
    "spec_of_array",
]

#: the calling convention :func:`param_layout` lays parameters out for
CCONV = "cutile_python_v2"

IndexDtype = Literal["int32", "int64"]
SlotKind = Literal["pointer", "shape", "stride", "scalar", "list_pointer", "list_length"]


# --------------------------------------------------------------------------- specs


def _as_dtype(value: Any) -> np.dtype[Any]:
    try:
        dt: np.dtype[Any] = np.dtype(value)
    except TypeError as exc:
        raise TypeError(f"dtype: expected a NumPy dtype or dtype string, got {value!r}") from exc
    return dt


def _opt_tuple(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


def _pow2(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise ValueError(f"{name}: expected a positive power of two, got {value!r}")


@attrs.frozen
class ArraySpec:
    """What the runtime guarantees about an array parameter.

    ``strides``: per dimension the stride (in elements) every launch has, or
    ``None`` where it varies; ``base_align``: bytes the base address is always
    divisible by; ``shape_divisible_by``/``stride_divisible_by``: per
    dimension a factor every launch's value is divisible by; ``may_alias``:
    the array may overlap other ``may_alias`` arrays of the launch;
    ``may_alias_internally``: two indices may reach one element."""

    dtype: np.dtype[Any] = attrs.field(converter=_as_dtype)
    ndim: int
    index_dtype: IndexDtype = "int32"
    strides: tuple[int | None, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    base_align: int = 1
    shape_divisible_by: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    stride_divisible_by: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    may_alias: bool = False
    may_alias_internally: bool = False

    def __attrs_post_init__(self) -> None:
        if isinstance(self.ndim, bool) or not isinstance(self.ndim, int) or self.ndim < 0:
            raise ValueError(f"ndim: expected a non-negative int, got {self.ndim!r}")
        if self.index_dtype not in ("int32", "int64"):
            raise ValueError(f"index_dtype: expected 'int32' or 'int64', got {self.index_dtype!r}")
        _pow2("base_align", self.base_align)
        for name in ("strides", "shape_divisible_by", "stride_divisible_by"):
            value = getattr(self, name)
            if value is not None and len(value) != self.ndim:
                raise ValueError(f"{name}: expected {self.ndim} values (one per dimension), got {value!r}")
        for name in ("shape_divisible_by", "stride_divisible_by"):
            for v in getattr(self, name) or ():
                _pow2(name, v)
        for s in self.strides or ():
            if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
                raise ValueError(f"strides: expected non-negative ints or None, got {self.strides!r}")
        if self.strides is not None and self.stride_divisible_by is not None:
            for s, d in zip(self.strides, self.stride_divisible_by, strict=True):
                if s is not None and s % d:
                    raise ValueError(
                        f"strides: a constant stride must be divisible by its stride_divisible_by, "
                        f"got strides={self.strides!r}, stride_divisible_by={self.stride_divisible_by!r}"
                    )

    def key(self) -> list[Any]:
        return [
            "array",
            self.dtype.str if self.dtype.names is None else str(self.dtype),
            self.dtype.name,
            self.ndim,
            self.index_dtype,
            self.strides,
            self.base_align,
            self.shape_divisible_by,
            self.stride_divisible_by,
            self.may_alias,
            self.may_alias_internally,
        ]


@attrs.frozen
class ScalarSpec:
    """A scalar parameter of a NumPy dtype (one slot of that dtype)."""

    dtype: np.dtype[Any] = attrs.field(converter=_as_dtype)

    def key(self) -> list[Any]:
        return ["scalar", self.dtype.name]


def _as_constant(value: Any) -> bool | int | float:
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating) and not isinstance(value, np.longdouble):
        return float(value)
    raise TypeError(f"value: expected a bool, int or float constant, got {value!r}")


@attrs.frozen
class ConstantSpec:
    """A compile-time constant (a ``ct.Constant`` parameter); it takes no slot.
    ``1``, ``True`` and ``1.0`` are three different constants; NumPy scalars
    become the Python bool, int or float of the same value."""

    value: bool | int | float = attrs.field(converter=_as_constant)

    def key(self) -> list[Any]:
        v: object = self.value
        shown = struct.pack("=d", v).hex() if isinstance(v, float) else v
        return ["constant", type(v).__name__, shown]


@attrs.frozen
class TupleSpec:
    """A tuple parameter; its items are laid out in order."""

    items: tuple[ParamSpec, ...] = attrs.field(converter=tuple)

    def key(self) -> list[Any]:
        return ["tuple", [item.key() for item in self.items]]


@attrs.frozen
class ListSpec:
    """A list of arrays: a device pointer to ``(1 + 2 * ndim)`` 64-bit words per
    element, and an int32 length. ``elements_may_alias``: two elements may
    overlap."""

    element: ArraySpec
    elements_may_alias: bool = False

    def key(self) -> list[Any]:
        return ["list", self.element.key(), self.elements_may_alias]


ParamSpec: TypeAlias = "ArraySpec | ScalarSpec | ConstantSpec | TupleSpec | ListSpec"
_SPEC_TYPES = (ArraySpec, ScalarSpec, ConstantSpec, TupleSpec, ListSpec)


def _check_params(_: object, __: object, params: tuple[object, ...]) -> None:
    def check(p: object) -> None:
        if not isinstance(p, _SPEC_TYPES):
            raise TypeError(
                "params: expected ArraySpec, ScalarSpec, ConstantSpec, TupleSpec or ListSpec "
                f"items, got {p!r}"
            )
        if isinstance(p, TupleSpec):
            for item in p.items:
                check(item)

    for p in params:
        check(p)


def _check_arch(_: object, __: object, arch: str) -> None:
    if not isinstance(arch, str) or not arch.startswith("sm_") or not arch[3:].rstrip("af").isdigit():
        raise ValueError(f"arch: expected a GPU architecture such as 'sm_90', got {arch!r}")


@attrs.frozen
class TileSignature:
    """One specialisation of a tile kernel: a spec per parameter and the
    target architecture (a cubin is specific to it)."""

    params: tuple[ParamSpec, ...] = attrs.field(converter=tuple, validator=_check_params)
    arch: str = attrs.field(default="sm_90", validator=_check_arch)

    def key(self) -> str:
        """A stable text naming this signature (equal for equal signatures,
        across processes and machines)."""
        return json.dumps([self.arch, [p.key() for p in self.params]], separators=(",", ":"))


def address_alignment(address: int, guaranteed: int = 256) -> int:
    """The largest power of two, at most ``guaranteed``, dividing ``address``."""
    _pow2("guaranteed", guaranteed)
    if address == 0:
        return guaranteed
    return min(address & -address, guaranteed)


def _divisor(value: int, cap: int = 16) -> int:
    if value == 0:
        return cap
    return min(abs(value) & -abs(value), cap)


def _overlaps(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether two distinct indices may reach one element (conservative)."""
    dims = sorted((abs(s), n) for n, s in zip(shape, strides, strict=True) if n > 1)
    reach = 0  # the furthest offset the smaller dimensions reach
    for s, n in dims:
        if s <= reach:
            return True
        reach += s * (n - 1)
    return False


def spec_of_array(
    dtype: Any,
    shape: Sequence[int],
    strides: Sequence[int] | None = None,
    *,
    alignment: int = 1,
    index_dtype: IndexDtype | None = None,
    may_alias: bool = False,
) -> ArraySpec:
    """The :class:`ArraySpec` of one array as the runtime sees it: ``strides``
    in elements (C-contiguous when ``None``), ``alignment`` the bytes its base
    address is guaranteed to be divisible by (see :func:`address_alignment`).
    The index dtype is int32 where every shape, stride and offset fits, else
    int64, unless given. Raises :class:`KernelArgumentError` for a negative
    stride (cuTile supports none) or an index dtype too narrow."""
    dt = _as_dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise KernelArgumentError(f"shape: expected non-negative extents, got {shape}")
    if strides is None:
        acc, out = 1, []
        for n in reversed(shape):
            out.append(acc)
            acc *= max(n, 1)
        strides = tuple(reversed(out))
    strides = tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise KernelArgumentError(f"strides: expected {len(shape)} values for shape {shape}, got {strides}")
    if any(s < 0 for s, n in zip(strides, shape, strict=True) if n > 1):
        raise KernelArgumentError(
            f"strides: tile kernels take no negative strides, got {strides} for shape {shape}"
        )
    strides = tuple(0 if n <= 1 and s < 0 else s for s, n in zip(strides, shape, strict=True))
    extent = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if n > 0)
    fits32 = all(v < 2**31 for v in (*shape, *strides, extent))
    if index_dtype is None:
        index_dtype = "int32" if fits32 else "int64"
    elif index_dtype == "int32" and not fits32:
        raise KernelArgumentError(
            f"index_dtype: an array of shape {shape} and strides {strides} needs 'int64', got 'int32'"
        )
    return ArraySpec(
        dtype=dt,
        ndim=len(shape),
        index_dtype=index_dtype,
        strides=tuple(1 if s == 1 else None for s in strides),
        base_align=alignment,
        shape_divisible_by=tuple(_divisor(n) for n in shape),
        stride_divisible_by=tuple(1 if s == 1 else _divisor(s) for s in strides),
        may_alias=may_alias,
        may_alias_internally=_overlaps(shape, strides),
    )


# --------------------------------------------------------------------------- layout


@attrs.frozen
class Slot:
    """One value of the parameter buffer: what it is, its dtype, its byte
    offset, the dimension it describes (shape/stride) and the path of tuple
    item indices below its parameter."""

    kind: SlotKind
    dtype: np.dtype[Any]
    offset: int
    dim: int | None = None
    path: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return self.dtype.itemsize


@attrs.frozen
class ParamLayout:
    """The slots of one kernel parameter (none for a constant)."""

    index: int
    slots: tuple[Slot, ...]


_U64 = np.dtype(np.uint64)
_I32 = np.dtype(np.int32)


def param_layout(signature: TileSignature) -> tuple[tuple[ParamLayout, ...], int]:
    """The ``cutile_python_v2`` parameter layout of ``signature`` and the
    buffer's total size in bytes (each slot at its natural alignment)."""
    offset = 0
    slots: list[Slot] = []

    def put(kind: SlotKind, dtype: np.dtype[Any], dim: int | None, path: tuple[int, ...]) -> None:
        nonlocal offset
        align = dtype.alignment
        offset = (offset + align - 1) // align * align
        slots.append(Slot(kind, dtype, offset, dim, path))
        offset += dtype.itemsize

    def walk(spec: ParamSpec, path: tuple[int, ...]) -> None:
        if isinstance(spec, ArraySpec):
            idx = np.dtype(spec.index_dtype)
            put("pointer", _U64, None, path)
            for d in range(spec.ndim):
                put("shape", idx, d, path)
            for d in range(spec.ndim):
                put("stride", idx, d, path)
        elif isinstance(spec, ScalarSpec):
            put("scalar", spec.dtype, None, path)
        elif isinstance(spec, TupleSpec):
            for i, item in enumerate(spec.items):
                walk(item, (*path, i))
        elif isinstance(spec, ListSpec):
            put("list_pointer", _U64, None, path)
            put("list_length", _I32, None, path)

    layouts = []
    for i, p in enumerate(signature.params):
        start = len(slots)
        walk(p, ())
        layouts.append(ParamLayout(i, tuple(slots[start:])))
    return tuple(layouts), offset
