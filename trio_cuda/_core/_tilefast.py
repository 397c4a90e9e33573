"""The fast path of tile launches: a function generated per launch recipe.

A tile kernel's launch (``trio_cuda._tile.kernel``) reads a signature from its
arguments on its checked path. Launches whose arguments have the same
*recipe* (each array's dtype, shape, order and address alignment modulo 16,
each scalar's Python or NumPy type, each constant's value) share a
specialisation, a parameter layout in which every shape and stride is a
constant, and their accesses. :func:`compile_tile_fast` turns a recipe into a
function ``fast(args, config)`` that checks exactly that recipe's guards and
builds the launch the checked path would build, or returns None (then the
checked path runs and raises the precise error or handles the case).

Invariants:

* The generated source comes from the recipe's kinds only; every value in
  it is a name bound in its namespace (never text from the user).
* A guard that fails returns None, never raises. Lists and tuples have no
  fast path. Two arrays of one allocation, one of them written, return None,
  and so does any borrowed array among several with one written (two
  borrows may cover the same bytes): the checked path compares byte ranges.
* A float constant matches by its ``repr`` (``-0.0`` is not ``0.0``, and a
  NaN constant matches itself).
* The launch is built as ``_kernel._compile_fast`` builds a typed launch's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from . import _compiled, _fastgen
from ._launch import KernelLaunch
from ._ops import Access

__all__ = ["TileArg", "compile_tile_fast", "compile_tile_fast_c", "compile_tile_fast_py"]

FastTileLauncher = Callable[[tuple[object, ...], Any], "KernelLaunch | None"]


@attrs.frozen
class TileArg:
    """One argument of a recipe. ``kind`` is ``"array"`` (``dtype``,
    ``shape``, ``order``, ``align`` = address modulo 16, ``access``, and
    ``packed`` = the shape and strides packed after its pointer), ``"int"``
    (``fits32``: whether the recipe's int fits int32, which its recipe
    depends on), ``"float"``, ``"bool"`` or ``"np"`` (a NumPy scalar of type
    ``type_``), or ``"constant"`` (``value``, not packed)."""

    kind: str
    dtype: Any = None
    shape: tuple[int, ...] = ()
    order: str = "C"
    align: int = 0
    access: Access | None = None
    packed: tuple[int, ...] = ()
    type_: Any = None
    value: Any = None
    fits32: bool = False


def compile_tile_fast(
    kernel: Any, plan: Any, packer: struct.Struct, args: Sequence[TileArg]
) -> FastTileLauncher:
    """The fast path of one recipe of the specialisation kernel ``kernel``
    (its parameter ``plan`` and the arena's ``packer``): compiled where the
    compiled paths are used (``_compiled``) and the recipe's packing is one
    it knows, else generated Python (:func:`compile_tile_fast_py`)."""
    if _compiled.ext is not None:
        fast = compile_tile_fast_c(kernel, plan, packer, args)
        if fast is not None:
            return fast
    return compile_tile_fast_py(kernel, plan, packer, args)


#: _claunch's kinds of a tile recipe's arguments
_K_TILE_ARRAY, _K_CONSTANT, _K_EXACT = 5, 6, 7
_EXACT_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool}


def _value_slots(fmt: str) -> list[tuple[str, int]] | None:
    """Each packed value's struct code and offset in a packer's format
    (standard sizes, no alignment: ``=`` or ``<`` and ``x`` for padding),
    or None for another format."""
    if not fmt or fmt[0] not in "=<":
        return None
    out: list[tuple[str, int]] = []
    offset = 0
    count = ""
    for ch in fmt[1:]:
        if ch.isdigit():
            count += ch
            continue
        n = int(count or 1)
        count = ""
        if ch == "x":
            offset += n
            continue
        if ch not in "bBhHiIqQefd?":
            return None
        size = struct.calcsize("<" + ch)
        for _ in range(n):
            out.append((ch, offset))
            offset += size
    return out


def compile_tile_fast_c(
    kernel: Any, plan: Any, packer: struct.Struct, args: Sequence[TileArg]
) -> FastTileLauncher | None:
    """The compiled fast path of one recipe (``_claunch.typed`` with ``tile``
    set): the guards and packing of :func:`compile_tile_fast_py`, from each
    argument's kind and the offsets of its packed values. None where nothing
    is compiled, or the packing is not one it knows."""
    ext = _compiled.ext
    slots = _value_slots(packer.format)
    if ext is None or slots is None:
        return None
    values = iter(slots)
    entries: list[tuple[object, ...]] = []
    try:
        for arg in args:
            if arg.kind == "array":
                code, at = next(values)
                if code != "Q":
                    return None
                consts = tuple((*next(values), int(v)) for v in arg.packed)
                if any(c[0] not in "bBhHiIqQ" for c in consts):
                    return None
                extra = (tuple(arg.shape), arg.order, int(arg.align), consts)
                entries.append((_K_TILE_ARRAY, arg.dtype, arg.access, "Q", at, 0, extra))
            elif arg.kind == "constant":
                value = arg.value
                by_repr = isinstance(value, float)
                entries.append(
                    (_K_CONSTANT, None, None, "Q", 0, 0, (repr(value) if by_repr else value, by_repr))
                )
            else:
                code, at = next(values)
                exact = arg.type_ if arg.kind == "np" else _EXACT_TYPES[arg.kind]
                fits = (bool(arg.fits32),) if arg.kind == "int" else None
                entries.append((_K_EXACT, exact, None, code, at, 0, fits))
    except StopIteration:
        return None
    if next(values, None) is not None:
        return None
    fast: FastTileLauncher = ext.typed(kernel, plan, packer.size, tuple(entries), True)
    return fast


def compile_tile_fast_py(
    kernel: Any, plan: Any, packer: struct.Struct, args: Sequence[TileArg]
) -> FastTileLauncher:
    """The fast path of one recipe, generated Python: the reference."""
    ns = _fastgen.namespace(kernel, plan, packer)
    names = [f"a{i}" for i in range(len(args))]
    body = [_fastgen.unpack(names)]
    packed: list[str] = []
    accesses: list[str] = []
    allocs: list[tuple[str, bool]] = []
    outputs: list[str] = []
    for i, arg in enumerate(args):
        a = names[i]
        if arg.kind == "array":
            m = f"m{i}"
            ns[f"dt{i}"] = arg.dtype
            ns[f"shape{i}"] = arg.shape
            ns[f"order{i}"] = arg.order
            ns[f"access{i}"] = arg.access
            body.append(_fastgen.array_guard(a, m, i))
            body.append(
                f"    p{i} = {m}.ptr + {a}._offset\n"
                f"    if {a}._shape != shape{i} or {a}._order != order{i} or p{i} & 15 != {int(arg.align)}:\n"
                "        return None"
            )
            if arg.access is Access.WRITE:
                body.append(f"    if {a}._readonly:\n        return None")
                outputs.append(a)
            packed.append(f"p{i}")
            packed.extend(str(int(v)) for v in arg.packed)
            accesses.append(f"({a}, access{i})")
            allocs.append((m, arg.access is Access.WRITE))
        elif arg.kind == "constant":
            ns[f"c{i}"] = arg.value
            ns[f"ct{i}"] = type(arg.value)
            if isinstance(arg.value, float):  # -0.0 == 0.0 and nan != nan: compare the spelling
                ns[f"c{i}"] = repr(arg.value)
                body.append(f"    if type({a}) is not float or repr({a}) != c{i}:\n        return None")
            else:
                body.append(f"    if type({a}) is not ct{i} or {a} != c{i}:\n        return None")
        elif arg.kind == "int":
            body.append(
                f"    if type({a}) is not int or ({-(2**31)} <= {a} < {2**31}) != {bool(arg.fits32)}:\n"
                "        return None"
            )
            packed.append(a)
        elif arg.kind == "float":
            body.append(f"    if type({a}) is not float:\n        return None")
            packed.append(a)
        elif arg.kind == "bool":
            body.append(f"    if type({a}) is not bool:\n        return None")
            packed.append(a)
        else:  # a NumPy scalar of exactly this type
            ns[f"t{i}"] = arg.type_
            body.append(f"    if type({a}) is not t{i}:\n        return None")
            packed.append(a)
    body.append(_fastgen.pack(packed))
    # two arrays of one allocation: the checked path compares byte ranges
    # (and merges the accesses of identical extents)
    n = len(allocs)
    written = [
        f"{allocs[i][0]} is {allocs[j][0]}"
        for i in range(n)
        for j in range(i + 1, n)
        if allocs[i][1] or allocs[j][1]
    ]
    read = [
        f"{allocs[i][0]} is {allocs[j][0]}"
        for i in range(n)
        for j in range(i + 1, n)
        if not (allocs[i][1] or allocs[j][1])
    ]
    if written:
        body.append(f"    if {' or '.join(written)}:\n        return None")
        # borrowed memory may be borrowed twice (two records, the same bytes)
        body.append(f"    if {' or '.join(f'{m}.borrowed' for m, _ in allocs)}:\n        return None")
    body.append(f"    accesses = ({''.join(x + ', ' for x in accesses)})")
    if read:  # reads of one allocation: one lease per extent
        body.append(f"    if {' or '.join(read)}:\n        accesses = merge(accesses)")
    body.append(_fastgen.launch_tail(outputs))
    fast: FastTileLauncher = _fastgen.build(body, ns, f"fast tile launch of {kernel.name}")
    return fast
