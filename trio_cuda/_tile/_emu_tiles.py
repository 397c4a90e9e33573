"""Tiles and arrays of the NumPy emulation: :class:`Tile`, :class:`EmuArray`,
promotion, elementwise arithmetic, casts, and the shape ops a tile has as
methods (reshape, permute, transpose, extract, insert, ``@``).

Invariants: a :class:`Tile` is a NumPy array plus its cuTile dtype, and the
array's dtype is that dtype's storage; ops return new tiles (``insert`` and
``extract`` copy) and never write into their operands. A Python scalar takes
the dtype of the tile it meets (:func:`_result_dtype`); 8- and 16-bit floats
are computed in float32 and stored back; tfloat32 results are rounded. An
:class:`EmuArray` wraps the kernel's NumPy view without copying it.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Iterator
from typing import Any, final

import numpy as np

from ._emu_dtypes import _dt, _round_tf32
from ._emu_errors import TileEmulationError, TileNotEmulatedError


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_shape(shape: tuple[int, ...], what: str) -> None:
    for n in shape:
        if not _is_pow2(n):
            raise TileEmulationError(f"{what}: tile shape {shape} has a dimension that is not a power of two")


def _shape_of(shape: Any, what: str) -> tuple[int, ...]:
    if isinstance(shape, int | np.integer | Tile):
        shape = (shape,)
    try:
        out = tuple(builtins.int(n) for n in shape)
    except TypeError:
        raise TileEmulationError(f"{what}: expected a shape (a tuple of ints), got {shape!r}") from None
    return out


class Tile:
    """A tile of the emulation: a NumPy array ``a`` and its cuTile ``dtype``."""

    __slots__ = ("a", "dtype")
    __array_ufunc__ = None  # NumPy scalars defer to the reflected operators

    def __init__(self, a: np.ndarray[Any, Any], dtype: Any) -> None:
        self.a = a
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.a.shape)

    @property
    def ndim(self) -> int:
        return int(self.a.ndim)

    def __repr__(self) -> str:
        return f"Tile({self.a.tolist()!r}, dtype={self.dtype})"

    def __str__(self) -> str:
        return str(self.a.tolist())

    def __format__(self, spec: str) -> str:
        if self.a.ndim == 0:
            return format(self.a.item(), spec)
        return str(np.vectorize(lambda v: format(v, spec))(self.a.tolist()).tolist()).replace("'", "")

    def _scalar(self, what: str) -> Any:
        if self.a.size != 1:
            raise TypeError(f"a tile of shape {self.shape} used as a scalar ({what}); it needs shape ()")
        return self.a.reshape(()).item()

    def __bool__(self) -> bool:
        return bool(self._scalar("truth value"))

    def __index__(self) -> int:
        if not (_dt().is_int(self.dtype) or self.dtype == _dt().ct.bool_):
            raise TypeError(f"a {self.dtype} tile used as an index; it needs an integer dtype")
        return int(self._scalar("index"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("tiles are not iterable; use ct.extract or a loop over indices")

    def __getitem__(self, index: Any) -> Tile:
        parts = index if isinstance(index, tuple) else (index,)
        for p in parts:
            if not (p is None or p is Ellipsis or (isinstance(p, slice) and p == slice(None))):
                raise TileEmulationError(
                    f"tile[{index!r}]: tile indexing only inserts axes (None, ':' and '...')"
                )
        return Tile(self.a[index], self.dtype)

    def item(self) -> Tile:
        return _reshape(self, ())

    def extract(self, index: Any, shape: Any) -> Tile:
        return _extract(self, index, shape)

    def insert(self, index: Any, value: Any) -> Tile:
        return _insert(self, index, value)

    def reshape(self, shape: Any) -> Tile:
        return _reshape(self, shape)

    def permute(self, axes: Any) -> Tile:
        return _permute(self, axes)

    def transpose(self, axis0: Any = None, axis1: Any = None) -> Tile:
        return _transpose(self, axis0, axis1)

    def astype(self, dtype: Any, *, rounding_mode: Any = None) -> Tile:
        return _astype(self, dtype)

    def __add__(self, o: Any) -> Any:
        return _arith("add", self, o)

    def __radd__(self, o: Any) -> Any:
        return _arith("add", o, self)

    def __sub__(self, o: Any) -> Any:
        return _arith("sub", self, o)

    def __rsub__(self, o: Any) -> Any:
        return _arith("sub", o, self)

    def __mul__(self, o: Any) -> Any:
        return _arith("mul", self, o)

    def __rmul__(self, o: Any) -> Any:
        return _arith("mul", o, self)

    def __truediv__(self, o: Any) -> Any:
        return _arith("truediv", self, o)

    def __rtruediv__(self, o: Any) -> Any:
        return _arith("truediv", o, self)

    def __floordiv__(self, o: Any) -> Any:
        return _arith("floordiv", self, o)

    def __rfloordiv__(self, o: Any) -> Any:
        return _arith("floordiv", o, self)

    def __mod__(self, o: Any) -> Any:
        return _arith("mod", self, o)

    def __rmod__(self, o: Any) -> Any:
        return _arith("mod", o, self)

    def __pow__(self, o: Any) -> Any:
        return _arith("pow", self, o)

    def __rpow__(self, o: Any) -> Any:
        return _arith("pow", o, self)

    def __divmod__(self, o: Any) -> Any:
        return _arith("floordiv", self, o), _arith("mod", self, o)

    def __rdivmod__(self, o: Any) -> Any:
        return _arith("floordiv", o, self), _arith("mod", o, self)

    def __and__(self, o: Any) -> Any:
        return _arith("and", self, o)

    def __rand__(self, o: Any) -> Any:
        return _arith("and", o, self)

    def __or__(self, o: Any) -> Any:
        return _arith("or", self, o)

    def __ror__(self, o: Any) -> Any:
        return _arith("or", o, self)

    def __xor__(self, o: Any) -> Any:
        return _arith("xor", self, o)

    def __rxor__(self, o: Any) -> Any:
        return _arith("xor", o, self)

    def __lshift__(self, o: Any) -> Any:
        return _arith("lshift", self, o)

    def __rlshift__(self, o: Any) -> Any:
        return _arith("lshift", o, self)

    def __rshift__(self, o: Any) -> Any:
        return _arith("rshift", self, o)

    def __rrshift__(self, o: Any) -> Any:
        return _arith("rshift", o, self)

    def __lt__(self, o: Any) -> Any:
        return _arith("lt", self, o)

    def __le__(self, o: Any) -> Any:
        return _arith("le", self, o)

    def __gt__(self, o: Any) -> Any:
        return _arith("gt", self, o)

    def __ge__(self, o: Any) -> Any:
        return _arith("ge", self, o)

    def __eq__(self, o: Any) -> Any:
        return _arith("eq", self, o)

    def __ne__(self, o: Any) -> Any:
        return _arith("ne", self, o)

    __hash__ = None  # type: ignore[assignment]

    def __neg__(self) -> Tile:
        if self.dtype == _dt().ct.bool_:
            raise TileEmulationError("unary minus of a bool tile")
        return Tile(np.negative(self.a), self.dtype)

    def __pos__(self) -> Tile:
        return self

    def __invert__(self) -> Tile:
        if _dt().is_float(self.dtype):
            raise TileEmulationError("bitwise not of a float tile")
        return Tile(np.invert(self.a), self.dtype)

    def __abs__(self) -> Tile:
        r: Tile = _unary("abs", self)
        return r

    def __matmul__(self, o: Any) -> Tile:
        return _matmul(self, o)

    def __rmatmul__(self, o: Any) -> Tile:
        return _matmul(o, self)


@final
class EmuArray:
    """A kernel's array argument as tile code sees it: ``dtype`` (cuTile's),
    ``shape``, ``strides`` (in elements) and ``ndim``; ``data`` is the NumPy
    view the emulated ops index."""

    __slots__ = ("data", "dtype")

    def __init__(self, data: np.ndarray[Any, Any]) -> None:
        self.data = data
        self.dtype = _dt().ct_of(data.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(s // self.data.itemsize for s in self.data.strides)

    @property
    def ndim(self) -> int:
        return int(self.data.ndim)

    def slice(self, axis: int, start: Any, stop: Any) -> EmuArray:
        ix: list[Any] = [slice(None)] * self.ndim
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.data.shape[int(axis)]:
            raise TileEmulationError(
                f"array.slice({axis}, {start}, {stop}): outside the array's extent {self.shape}"
            )
        ix[int(axis)] = builtins.slice(start, stop)
        return EmuArray(self.data[tuple(ix)])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise TileNotEmulatedError(f"Array.{name}")

    def __repr__(self) -> str:
        return f"Array(shape={self.shape}, dtype={self.dtype})"


def _tile_of(x: Any, dtype: Any = None) -> Tile:
    """A tile of ``x`` (a tile or a scalar), converted to ``dtype`` when given."""
    if isinstance(x, Tile):
        return x if dtype is None or x.dtype == dtype else _astype(x, dtype)
    d = _dt()
    if dtype is None:
        dtype = _loose_dtype(x)
    return Tile(np.asarray(x, dtype=d.np_of(dtype)), dtype)


def _loose_dtype(x: Any) -> Any:
    """The dtype of a scalar standing alone (cuTile's defaults)."""
    d = _dt()
    if isinstance(x, bool | np.bool_):
        return d.ct.bool_
    if isinstance(x, np.generic):
        return d.ct_of(x.dtype)
    if isinstance(x, int):
        return d.ct.int32 if -(2**31) <= x < 2**31 else d.ct.int64
    if isinstance(x, float):
        return d.ct.float32
    raise TypeError(f"expected a tile or a scalar, got {type(x).__name__}")


def _result_dtype(x: Any, y: Any) -> Any:
    """cuTile's promotion where a Python scalar is loosely typed."""
    d = _dt()
    xt, yt = isinstance(x, Tile | np.generic), isinstance(y, Tile | np.generic)
    if xt and yt:
        return d.promote(_dtype_of(x), _dtype_of(y))
    typed, loose = (x, y) if xt else (y, x)
    td = _dtype_of(typed)
    if isinstance(loose, bool):
        return td
    if isinstance(loose, int):
        return d.ct.int32 if td == d.ct.bool_ else td
    if isinstance(loose, float):
        return td if d.is_float(td) else d.ct.float32
    raise TypeError(f"expected a tile or a scalar, got {type(loose).__name__}")


def _dtype_of(x: Any) -> Any:
    if isinstance(x, Tile):
        return x.dtype
    return _dt().ct_of(x.dtype)


def _np_in(x: Any, dtype: Any) -> Any:
    """``x`` as a NumPy array (or scalar) of ``dtype``'s storage."""
    npd = _dt().np_of(dtype)
    if isinstance(x, Tile):
        return x.a if x.a.dtype == npd else x.a.astype(npd)
    return np.asarray(x, dtype=npd)


_COMPUTE_16 = np.dtype(np.float32)


def _compute_dtype(npd: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype NumPy computes in for storage ``npd``: float32 for the 8- and
    16-bit floats (bfloat16 and float8 included), ``npd`` itself otherwise."""
    return _COMPUTE_16 if npd.kind in "fV" and npd.itemsize < 4 else npd


_ARITH: dict[str, Callable[[Any, Any], Any]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "truediv": np.true_divide,
    "floordiv": np.floor_divide,
    "mod": np.mod,
    "pow": np.power,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "lshift": np.left_shift,
    "rshift": np.right_shift,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "atan2": np.arctan2,
}
_PY: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b,
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    "pow": lambda a, b: a**b,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "lshift": lambda a, b: a << b,
    "rshift": lambda a, b: a >> b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "maximum": builtins.max,
    "minimum": builtins.min,
    "atan2": math.atan2,
}
_COMPARE = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})
_BITWISE = frozenset({"and", "or", "xor", "lshift", "rshift"})


def _arith(fn: str, x: Any, y: Any) -> Any:
    """A binary elementwise op with cuTile's promotion and broadcasting."""
    if not isinstance(x, Tile | np.generic) and not isinstance(y, Tile | np.generic):
        return _PY[fn](x, y)
    d = _dt()
    dtype = _result_dtype(x, y)
    if fn == "truediv" and not d.is_float(dtype):
        dtype = d.ct.float32
    if fn in _BITWISE and d.is_float(dtype):
        raise TileEmulationError(f"bitwise {fn} of {dtype} tiles; bitwise ops need integers or bools")
    if fn not in _COMPARE and fn not in _BITWISE and dtype == d.ct.bool_ and fn not in ("maximum", "minimum"):
        raise TileEmulationError(f"arithmetic {fn} of bool tiles; cast them to an integer dtype")
    if fn == "atan2" and not d.is_float(dtype):
        dtype = d.ct.float32
    npd = d.np_of(dtype)
    compute = _compute_dtype(npd)
    a, b = _np_in(x, dtype), _np_in(y, dtype)
    if compute is not npd:
        a, b = a.astype(compute), b.astype(compute)
    with np.errstate(all="ignore"):
        r = _ARITH[fn](a, b)
    if fn in _COMPARE:
        return Tile(np.asarray(r), d.ct.bool_)
    r = np.asarray(r).astype(npd, copy=False)
    if dtype == d.ct.tfloat32:
        r = _round_tf32(r)
    return Tile(r, dtype)


_UNARY: dict[str, Callable[[Any], Any]] = {
    "exp": np.exp,
    "exp2": np.exp2,
    "log": np.log,
    "log2": np.log2,
    "sqrt": np.sqrt,
    "rsqrt": lambda a: 1.0 / np.sqrt(a),
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "tanh": np.tanh,
    "floor": np.floor,
    "ceil": np.ceil,
    "abs": np.abs,
    "negative": np.negative,
    "isnan": np.isnan,
}
_FLOAT_ONLY = frozenset(_UNARY) - {"abs", "negative", "isnan", "floor", "ceil"}


def _unary(fn: str, x: Any) -> Any:
    d = _dt()
    t = _tile_of(x)
    dtype = t.dtype
    if fn in _FLOAT_ONLY and not d.is_float(dtype):
        dtype = d.ct.float32
    npd = d.np_of(dtype)
    a = t.a.astype(_compute_dtype(npd))
    with np.errstate(all="ignore"):
        r = _UNARY[fn](a)
    if fn == "isnan":
        return Tile(np.asarray(r), d.ct.bool_)
    return Tile(np.asarray(r).astype(npd), dtype)


def _index_of(index: Any, ndim: int, op: str) -> tuple[int, ...]:
    if not isinstance(index, tuple | list):
        index = (index,)
    out = tuple(int(i) for i in index)
    if len(out) != ndim:
        raise TileEmulationError(f"ct.{op}: index {out} has {len(out)} entries for an array of rank {ndim}")
    return out


def _astype(x: Any, dtype: Any, /, *, rounding_mode: Any = None) -> Tile:
    d = _dt()
    ctd = d.as_ct(dtype)
    t = _tile_of(x)
    with np.errstate(all="ignore"):
        a = t.a.astype(d.np_of(ctd))
    if ctd == d.ct.tfloat32:
        a = _round_tf32(a)
    return Tile(a, ctd)


def _reshape(x: Any, /, shape: Any) -> Tile:
    t = _tile_of(x)
    s = _shape_of(shape, "ct.reshape")
    a = t.a.reshape(s)
    _check_shape(a.shape, "ct.reshape")
    return Tile(a, t.dtype)


def _permute(x: Any, /, axes: Any) -> Tile:
    t = _tile_of(x)
    return Tile(np.transpose(t.a, tuple(int(i) for i in axes)), t.dtype)


def _transpose(x: Any, /, axis0: Any = None, axis1: Any = None) -> Tile:
    t = _tile_of(x)
    if axis0 is None and axis1 is None:
        if t.ndim != 2:
            raise TileEmulationError(f"ct.transpose of a rank-{t.ndim} tile needs axis0 and axis1")
        return Tile(t.a.T, t.dtype)
    return Tile(np.swapaxes(t.a, int(axis0), int(axis1)), t.dtype)


def _sub_slices(t: Tile, index: Any, shape: Any, op: str) -> tuple[slice, ...]:
    s = _shape_of(shape, f"ct.{op}")
    idx = _index_of(index, t.ndim, op)
    if len(s) != t.ndim:
        raise TileEmulationError(f"ct.{op}: shape {s} for a tile of rank {t.ndim}")
    out = []
    for i, n, full in zip(idx, s, t.shape):
        if n <= 0 or full % n or not 0 <= i < full // n:
            raise TileEmulationError(
                f"ct.{op}: subtile {idx} of shape {s} is outside a tile of shape {t.shape}"
            )
        out.append(slice(i * n, i * n + n))
    return tuple(out)


def _extract(x: Any, /, index: Any, shape: Any) -> Tile:
    t = _tile_of(x)
    return Tile(np.array(t.a[_sub_slices(t, index, shape, "extract")]), t.dtype)


def _insert(x: Any, /, index: Any, value: Any) -> Tile:
    t = _tile_of(x)
    v = _tile_of(value, t.dtype)
    a = np.array(t.a)
    a[_sub_slices(t, index, v.shape, "insert")] = v.a
    return Tile(a, t.dtype)


def _mm_compute(a: Tile, b: Tile, out_np: np.dtype[Any]) -> np.ndarray[Any, Any]:
    kind = out_np.kind
    compute = np.float64 if out_np == np.float64 else (np.int64 if kind in "iu" else np.float32)
    with np.errstate(all="ignore"):
        r: np.ndarray[Any, Any] = np.matmul(a.a.astype(compute), b.a.astype(compute))
    return r


def _matmul(x: Any, y: Any, /) -> Tile:
    tx, ty = _tile_of(x), _tile_of(y)
    dtype = _dt().promote(tx.dtype, ty.dtype)
    npd = _dt().np_of(dtype)
    r = _mm_compute(
        _astype(tx, dtype), _astype(ty, dtype), npd if npd.kind in "iuf" else np.dtype(np.float32)
    )
    out = np.asarray(r).astype(npd)
    if dtype == _dt().ct.tfloat32:
        out = _round_tf32(out)
    return Tile(out, dtype)
