"""Argument arenas: the byte layout of a kernel's parameters, and the packers
that fill it.

Invariants:

* The arena follows the C ABI of kernel parameters: each slot starts at a
  multiple of its alignment and takes ``sizeof`` bytes (a struct's size
  rounded up to its alignment); padding is zero. It holds at most
  :data:`MAX_PARAM_BYTES`.
* A :class:`ParamPlan` is immutable and hashable, built once per kernel (or
  per builder layout); backends cache per plan.
* The fast packer covers only parameter kinds that a ``struct.Struct`` lays
  out byte for byte as the general path (:func:`_pack` of
  :func:`_scalar_bytes`) does; for any other kind it returns None, and the
  kernel packs on the general path.
* :func:`check_param_layout` refuses a launch whose slots differ from the
  compiled kernel's own layout, naming the argument, before anything is
  enqueued.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from ._errors import KernelArgumentError
from ._params import Param, Scalar, Slice, _align_up, _param_label, dtype_alignment

if TYPE_CHECKING:
    from ._launch import PreparedLaunch


_POINTER = np.dtype(np.uint64)
#: the most parameter bytes a kernel can receive (CUDA 12.1+, Volta and newer)
MAX_PARAM_BYTES = 32764


# --------------------------------------------------------------------------- packing


@attrs.frozen
class Slot:
    """One kernel parameter as the driver sees it."""

    offset: int
    size: int
    align: int


@attrs.frozen(cache_hash=True)
class ParamPlan:
    """Arena layout of a parameter list, built once per kernel (or builder)."""

    slots: tuple[Slot, ...]
    size: int

    @classmethod
    def from_layout(cls, layout: Sequence[tuple[int, int]]) -> ParamPlan:
        """``layout`` is (size, alignment) per slot, in kernel order."""
        offset = 0
        slots = []
        for size, align in layout:
            if align <= 0 or align & (align - 1):
                raise KernelArgumentError(f"align: expected a power of two, got {align}")
            offset = _align_up(offset, align)
            slots.append(Slot(offset, size, align))
            offset += size
        if offset > MAX_PARAM_BYTES:
            raise KernelArgumentError(
                f"params: expected at most {MAX_PARAM_BYTES} bytes of kernel parameters, got {offset}"
            )
        return cls(tuple(slots), offset)


def _slots_for(param: Param) -> list[tuple[int, int]]:
    if isinstance(param, Scalar):
        return [(param.size, param.alignment)]
    if isinstance(param, Slice):
        return [(8, 8), (param.len_dtype.itemsize, dtype_alignment(param.len_dtype))]
    return [(8, 8)]


def _scalar_bytes(dtype: np.dtype[Any], value: object) -> bytes:
    """The bytes of one by-value argument; a struct's padding is zero (the
    fields are assigned into a zeroed buffer, whatever the source's padding
    held)."""
    if dtype.fields is None:
        return np.asarray(value, dtype=dtype).tobytes()
    buf = np.zeros(1, dtype=dtype)
    buf[0] = value
    return buf.tobytes()


def _pack(plan: ParamPlan, values: Sequence[bytes]) -> bytes:
    arena = bytearray(plan.size)
    for slot, raw in zip(plan.slots, values, strict=True):
        arena[slot.offset : slot.offset + len(raw)] = raw
    return bytes(arena)


# --------------------------------------------------------------------------- fast path

_STRUCT_CODES = {
    "i1": "b",
    "u1": "B",
    "i2": "h",
    "u2": "H",
    "i4": "i",
    "u4": "I",
    "i8": "q",
    "u8": "Q",
    "f2": "e",
    "f4": "f",
    "f8": "d",
    "b1": "?",
}
_K_INT, _K_FLOAT, _K_BOOL, _K_ARRAY, _K_SLICE = range(5)


def _code(dtype: np.dtype[Any]) -> str | None:
    if dtype.fields is not None or dtype.subdtype is not None or dtype.metadata:
        return None
    if dtype.byteorder not in ("=", "|", "<"):
        return None
    return _STRUCT_CODES.get(f"{dtype.kind}{dtype.itemsize}")


def _fast_packer(
    params: Sequence[Param], plan: ParamPlan
) -> tuple[tuple[tuple[Any, ...], ...] | None, struct.Struct | None]:
    """A per-kernel table and ``struct.Struct`` for the common parameter kinds
    (numeric scalars, arrays, slices). None when a parameter needs the general
    path (structs, complex, exotic dtypes)."""
    table: list[tuple[Any, ...]] = []
    codes: list[str] = []
    for p in params:
        if isinstance(p, Scalar):
            code = _code(p.dtype)
            if code is None:
                return None, None
            kind = p.dtype.kind
            if kind in "iu":
                info = np.iinfo(p.dtype)
                table.append((_K_INT, p.dtype.type, int(info.min), int(info.max), None))
            elif kind == "f":
                table.append((_K_FLOAT, p.dtype.type, 0, 0, None))
            else:
                table.append((_K_BOOL, p.dtype.type, 0, 0, None))
            codes.append(code)
        elif isinstance(p, Slice):
            code = _code(p.len_dtype)
            if code is None or p.len_dtype.kind not in "iu":
                return None, None
            table.append((_K_SLICE, p.dtype, 0, int(np.iinfo(p.len_dtype).max), p.access))
            codes.extend(("Q", code))
        else:
            table.append((_K_ARRAY, p.dtype, 0, 0, p.access))
            codes.append("Q")
    fmt = ["<"]
    offset = 0
    for slot, code in zip(plan.slots, codes, strict=True):
        if slot.offset > offset:
            fmt.append(f"{slot.offset - offset}x")
        fmt.append(code)
        offset = slot.offset + slot.size
    if plan.size > offset:
        fmt.append(f"{plan.size - offset}x")
    packer = struct.Struct("".join(fmt))
    assert packer.size == plan.size
    return tuple(table), packer


# --------------------------------------------------------------------------- compiled layout


_KIND_LABELS = {"array": "an array", "scalar": "a scalar", "raw": "boxed bytes", "slice": "a slice"}


def slot_labels(prepared: PreparedLaunch) -> list[str]:
    """A label for each slot of ``prepared.plan``: the argument it belongs to."""
    kernel = prepared.kernel
    if kernel.tile is not None and kernel.tile.kind == "specialisation":
        labels: list[str] = kernel.tile.slot_labels()
        return labels
    if prepared.plan is kernel._plan:
        labels = []
        for i, p in enumerate(kernel.params):
            label = _param_label(i, p)
            if isinstance(p, Slice):
                labels += [f"{label} pointer", f"{label} length"]
            else:
                labels.append(label)
        return labels
    out = []
    for i, view in enumerate(prepared.arg_views()):
        out.append(f"argument {i} ({_KIND_LABELS[view.kind]})")
    return out


def check_param_layout(prepared: PreparedLaunch, layout: Sequence[tuple[int, int]]) -> None:
    """Compare the arena's slots with the compiled kernel's own parameter
    layout, ``(offset, size)`` per parameter (as ``cuFuncGetParamInfo`` reports
    it). Raises :class:`KernelArgumentError` naming the first argument that
    differs."""
    slots = prepared.plan.slots
    name = prepared.kernel.name
    if len(slots) == len(layout) and all(
        s.offset == off and s.size == size for s, (off, size) in zip(slots, layout, strict=True)
    ):
        return
    labels = slot_labels(prepared)
    for i, (slot, (off, size)) in enumerate(zip(slots, layout, strict=False)):
        if slot.offset != off or slot.size != size:
            raise KernelArgumentError(
                f"{name}: {labels[i]}: the compiled kernel's parameter {i} takes {size} bytes at offset "
                f"{off}, the argument packs {slot.size} bytes at offset {slot.offset} "
                f"(check the dtype, or the align of a struct or boxed argument)"
            )
    raise KernelArgumentError(
        f"{name}: params: expected {len(layout)} kernel parameters (as compiled), "
        f"the launch packs {len(slots)}"
    )
