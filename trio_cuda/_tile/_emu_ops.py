"""The compute ops of the NumPy emulation that are not tile methods:
factories, the remaining shape ops, ``where``, ``mma``, reductions and scans,
the named elementwise ops, ``max``/``min``/``abs`` as tile code has them,
printing and assertions.

Invariants: every op returns a new tile and writes no memory; dtypes follow
cuTile (``mma`` keeps the accumulator's dtype, reductions and scans keep the
tile's, argmax/argmin give int32); shapes a factory or broadcast builds have
power-of-two dimensions.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._emu_dtypes import _dt
from ._emu_errors import TileEmulationError
from ._emu_tiles import (
    Tile,
    _arith,
    _check_shape,
    _compute_dtype,
    _mm_compute,
    _np_in,
    _result_dtype,
    _shape_of,
    _tile_of,
    _unary,
)


def _cdiv(x: Any, y: Any) -> Any:
    if isinstance(x, Tile) or isinstance(y, Tile):
        return _arith("floordiv", _arith("add", x, _arith("sub", y, 1)), y)
    return -(int(x) // -int(y))


def _arange(size: Any, /, *, dtype: Any, start: Any = 0, step: Any = 1) -> Tile:
    n = int(size)
    _check_shape((n,), "ct.arange")
    d = _dt()
    ctd = d.as_ct(dtype)
    if d.is_float(ctd):
        a: np.ndarray[Any, Any] = np.arange(n, dtype=np.float64) * float(step) + float(start)
    else:
        a = np.arange(n, dtype=np.int64) * int(step) + int(start)
    return Tile(a.astype(d.np_of(ctd)), ctd)


def _full(shape: Any, fill_value: Any, dtype: Any) -> Tile:
    s = _shape_of(shape, "ct.full")
    _check_shape(s, "ct.full")
    d = _dt()
    ctd = d.as_ct(dtype)
    v = fill_value.a if isinstance(fill_value, Tile) else fill_value
    return Tile(np.full(s, v, dtype=d.np_of(ctd)), ctd)


def _zeros(shape: Any, dtype: Any) -> Tile:
    return _full(shape, 0, dtype)


def _ones(shape: Any, dtype: Any) -> Tile:
    return _full(shape, 1, dtype)


def _astile(value: Any, /, *, dtype: Any) -> Tile:
    d = _dt()
    ctd = d.as_ct(dtype)
    a = np.asarray(value.a if isinstance(value, Tile) else value, dtype=d.np_of(ctd))
    _check_shape(a.shape, "ct.astile")
    return Tile(a, ctd)


def _bitcast(x: Any, /, dtype: Any) -> Tile:
    d = _dt()
    ctd = d.as_ct(dtype)
    t = _tile_of(x)
    npd = d.np_of(ctd)
    if npd.itemsize != t.a.dtype.itemsize:
        raise TileEmulationError(f"ct.bitcast: {t.dtype} and {ctd} differ in width")
    return Tile(np.ascontiguousarray(t.a).view(npd), ctd)


def _expand_dims(x: Any, /, axis: Any) -> Tile:
    t = _tile_of(x)
    return Tile(np.expand_dims(t.a, int(axis)), t.dtype)


def _broadcast_to(x: Any, /, shape: Any) -> Tile:
    t = _tile_of(x)
    s = _shape_of(shape, "ct.broadcast_to")
    _check_shape(s, "ct.broadcast_to")
    return Tile(np.broadcast_to(t.a, s), t.dtype)


def _cat(tiles: Any, /, axis: Any) -> Tile:
    a, b = tiles
    ta, tb = _tile_of(a), _tile_of(b)
    if ta.shape != tb.shape or ta.dtype != tb.dtype:
        raise TileEmulationError(
            f"ct.cat: the two tiles must have one shape and dtype, got {ta.shape} {ta.dtype} and "
            f"{tb.shape} {tb.dtype}"
        )
    return Tile(np.concatenate([ta.a, tb.a], axis=int(axis)), ta.dtype)


def _where(cond: Any, x: Any, y: Any, /) -> Tile:
    c = _tile_of(cond)
    if isinstance(x, Tile | np.generic) or isinstance(y, Tile | np.generic):
        dtype = _result_dtype(x, y)
    else:
        dtype = _result_dtype(_tile_of(x), y)
    r = np.where(c.a.astype(bool), _np_in(x, dtype), _np_in(y, dtype))
    return Tile(np.asarray(r), dtype)


# --------------------------------------------------------------------------- matmul


_MMA_ACC: Final = {
    "float8_e4m3fn": ("float16", "float32"),
    "float8_e5m2": ("float16", "float32"),
    "float16": ("float16", "float32"),
    "bfloat16": ("float32",),
    "float32": ("float32",),
    "tfloat32": ("float32",),
    "float64": ("float64",),
    "int8": ("int32",),
    "uint8": ("int32",),
}


def _mma(x: Any, y: Any, /, acc: Any, *, use_fast_acc: Any = False) -> Tile:
    tx, ty, tacc = _tile_of(x), _tile_of(y), _tile_of(acc)
    ints = {"int8", "uint8"}
    if tx.dtype != ty.dtype and not {tx.dtype.name, ty.dtype.name} <= ints:
        raise TileEmulationError(f"ct.mma: x and y must have one dtype, got {tx.dtype} and {ty.dtype}")
    allowed = _MMA_ACC.get(tx.dtype.name)
    if allowed is None or tacc.dtype.name not in allowed:
        raise TileEmulationError(
            f"ct.mma: inputs of {tx.dtype} take an accumulator of {' or '.join(allowed or ('none',))}, "
            f"got {tacc.dtype}"
        )
    if tx.ndim not in (2, 3) or ty.ndim not in (2, 3):
        raise TileEmulationError(f"ct.mma: x and y must be 2-d or 3-d, got shapes {tx.shape} and {ty.shape}")
    npd = tacc.a.dtype
    prod = _mm_compute(tx, ty, npd)
    if prod.shape != np.broadcast_shapes(prod.shape, tacc.shape):
        raise TileEmulationError(f"ct.mma: x @ y has shape {prod.shape}, the accumulator {tacc.shape}")
    with np.errstate(all="ignore"):
        r = (prod + tacc.a.astype(prod.dtype)).astype(npd)
    return Tile(r, tacc.dtype)


# --------------------------------------------------------------------------- reductions and scans


def _axes(axis: Any, ndim: int) -> Any:
    if axis is None:
        return None
    if isinstance(axis, tuple | list):
        return tuple(int(a) for a in axis)
    return int(axis)


_REDUCE: dict[str, Callable[..., Any]] = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}


def _reduction(fn: str) -> Callable[..., Tile]:
    def reduce(x: Any, /, axis: Any = None, *, keepdims: Any = False, **_options: Any) -> Tile:
        t = _tile_of(x)
        npd = t.a.dtype
        ax = _axes(axis, t.ndim)
        d = _dt()
        if fn in ("argmax", "argmin"):
            if isinstance(ax, tuple):
                raise TileEmulationError(f"ct.{fn}: axis must be None or one axis, got {axis!r}")
            a = t.a.reshape(-1) if ax is None else t.a
            r = getattr(np, fn)(
                a, axis=None if ax is None else ax, keepdims=bool(keepdims) and ax is not None
            )
            return Tile(np.asarray(r).astype(np.int32), d.ct.int32)
        compute = _compute_dtype(npd)
        with np.errstate(all="ignore"):
            r = _REDUCE[fn](t.a.astype(compute), axis=ax, keepdims=bool(keepdims))
        return Tile(np.asarray(r).astype(npd), t.dtype)

    reduce.__name__ = fn
    return reduce


def _scan(fn: str) -> Callable[..., Tile]:
    def scan(x: Any, /, axis: Any = 0, *, reverse: Any = False, **_options: Any) -> Tile:
        t = _tile_of(x)
        npd = t.a.dtype
        ax = int(axis)
        a = np.flip(t.a, ax) if reverse else t.a
        compute = _compute_dtype(npd)
        r = (np.cumsum if fn == "cumsum" else np.cumprod)(a.astype(compute), axis=ax)
        if reverse:
            r = np.flip(r, ax)
        return Tile(np.asarray(r).astype(npd), t.dtype)

    scan.__name__ = fn
    return scan


# --------------------------------------------------------------------------- the rest


def _binary(fn: str) -> Callable[..., Any]:
    def op(x: Any, y: Any, /, **_options: Any) -> Any:
        if fn in ("maximum", "minimum", "atan2") and not isinstance(x, Tile) and not isinstance(y, Tile):
            return _arith(fn, _tile_of(x), y)
        return _arith(fn, x, y)

    op.__name__ = fn
    return op


def _unary_op(fn: str) -> Callable[..., Any]:
    def op(x: Any, /, **_options: Any) -> Any:
        return _unary(fn, x)

    op.__name__ = fn
    return op


def _divmod(x: Any, y: Any, /) -> tuple[Any, Any]:
    return _arith("floordiv", x, y), _arith("mod", x, y)


def _bitwise_not(x: Any, /) -> Any:
    return ~_tile_of(x) if not isinstance(x, int) else ~x


def _builtin_minmax(fn: str, builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``max``/``min`` as tile code has them: elementwise on tiles."""

    def minmax(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) < 2 or not any(isinstance(a, Tile) for a in args):
            return builtin(*args, **kwargs)
        r = args[0]
        for a in args[1:]:
            r = _arith(fn, r if isinstance(r, Tile) else _tile_of(r), a)
        return r

    minmax.__name__ = builtin.__name__
    return minmax


def _builtin_abs(x: Any) -> Any:
    return _unary("abs", x) if isinstance(x, Tile) else builtins.abs(x)


def _printf(format: Any, *args: Any) -> None:  # noqa: A002 - cuTile's name
    values = tuple(a.a.item() if isinstance(a, Tile) and a.a.size == 1 else a for a in args)
    builtins.print(str(format) % values, end="")


def _print(*args: Any, sep: str = " ", end: str = "\n") -> None:
    builtins.print(*args, sep=sep, end=end)


def _assert(cond: Any, /, message: Any = None) -> None:
    if not np.all(cond.a if isinstance(cond, Tile) else cond):
        raise AssertionError(message if message is not None else "ct.assert_ failed")


def _static_assert(condition: Any, message: Any = None, /) -> None:
    if not condition:
        raise AssertionError(message if message is not None else "ct.static_assert failed")


def _identity(x: Any, /, *_args: Any, **_kwargs: Any) -> Any:
    return x


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None
