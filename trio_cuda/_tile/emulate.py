"""Running a ``@ct.kernel`` on NumPy tiles: how the simulator executes a tile
kernel that has no ``reference=``.

:func:`run_tile_kernel` executes the kernel's Python once per block, blocks in
order (axis 0 fastest, then 1, then 2), with the name bound to the
``cuda.tile`` module, the names imported from it and every function the
kernel reaches (module globals, closures, ``@ct.function`` wrappers,
recursively) resolved to an emulation of the cuTile ops on NumPy arrays.
Builtins ``max``, ``min`` and ``abs`` work on tiles (elementwise), as in tile
code.

Invariants:

* Memory is touched only through the arrays given (the simulator's
  bounds-checked views): loads, stores, gathers, scatters and atomics index
  them, with cuTile's bounds rules, so a legal kernel never indexes out of
  range. A tile partly outside its array is padded on load and clipped on
  store; ``check_bounds=False`` accesses index the view as given, so the
  memcheck sees what the GPU would do, and an access past the extent raises
  :class:`TileEmulationError` where the view does not catch it.
* ``PaddingMode.UNDETERMINED`` (the default of ``ct.load``) pads floats with
  NaN and integers with the byte pattern ``0xA5``, so that results depending
  on undetermined padding show up.
* Dtypes follow cuTile, not NumPy: a Python scalar takes the dtype of the
  tile it meets (``f16 * 2.0`` stays f16; an int tile and a Python float give
  f32); integer kinds of different signedness do not mix; ``mma`` keeps the
  accumulator's dtype; stores accept only a tile whose dtype widens to the
  array's. Scalar kernel arguments are typed (int32, int64 where it does not
  fit or is annotated ``ct.ScalarInt64``, float32, bool); ``ct.Constant``
  parameters stay Python values.
* A block that polls memory no block writes while it waits (the same small
  read, failed ``atomic_cas`` or non-modifying atomic repeated ``spin_limit``
  times with no write in between) raises :class:`TileSpinError` instead of
  hanging: blocks run one after another, so a block waiting on a later block
  never finishes. A loop that touches no memory at all cannot be detected.
* An op this module does not cover raises :class:`TileNotEmulatedError`
  naming it. No global mutable state: the per-launch state lives in a context
  variable, so launches in different threads do not interfere; the emulated
  namespace is built once, under a lock.

This relies on cuda.tile 1.7's ``kernel._pyfunc`` to reach the Python function
of a ``@ct.kernel``; other versions are tried the same way and refused with a
clear error where that attribute is missing.
"""

from __future__ import annotations

import builtins
import contextvars
import inspect
import math
import threading
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, final

import attrs
import numpy as np

from .._core._errors import TrioCudaError

__all__ = [
    "DEFAULT_SPIN_LIMIT",
    "EMULATED_OPS",
    "TileEmulationError",
    "TileNotEmulatedError",
    "TileSpinError",
    "run_tile_kernel",
]

#: consecutive identical polls (with no write between them) that make a spin
DEFAULT_SPIN_LIMIT: Final = 10_000

#: the cuda.tile minor version whose internals this module was written against
_PINNED_MINOR: Final = "1.7"

#: largest tile (elements) whose repeated read counts as polling
_POLL_MAX_ELEMENTS: Final = 64


class TileEmulationError(TrioCudaError):
    """A tile kernel did something the NumPy emulation of cuTile refuses: an
    access past an array's extent with ``check_bounds=False``, a dtype or shape
    cuTile would reject, or (subclasses) an op not emulated, a spinning block."""


class TileNotEmulatedError(TileEmulationError, NotImplementedError):
    """The kernel uses a ``cuda.tile`` op the emulator does not cover. ``op``
    is its name (``"mma_scaled"``)."""

    def __init__(self, op: str) -> None:
        self.op = op
        super().__init__(f"ct.{op} is not emulated on the simulator; pass reference= to the kernel")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.op,))


class TileSpinError(TileEmulationError):
    """A block repeated the same poll of memory ``spin_limit`` times with no
    write in between: it waits for something no block that has run will do
    (blocks run one after another, so a block waiting on a later one never
    finishes). ``block`` is its block index."""

    def __init__(self, message: str, block: tuple[int, int, int] = (0, 0, 0)) -> None:
        super().__init__(message)
        self.block = block

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.block))


# --------------------------------------------------------------------------- dtypes


def _ct() -> Any:
    import cuda.tile as ct

    return ct


@final
class _Dtypes:
    """The cuTile dtypes and their NumPy storage (tf32 is stored as float32)."""

    def __init__(self) -> None:
        ct = _ct()
        self.ct = ct
        names = ["bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
        names += ["float16", "float32", "float64"]
        self.to_np: dict[Any, np.dtype[Any]] = {getattr(ct, n): np.dtype(n) for n in names}
        self.to_np[ct.tfloat32] = np.dtype(np.float32)
        self.from_np: dict[np.dtype[Any], Any] = {np.dtype(n): getattr(ct, n) for n in names}
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - ml_dtypes comes with the development extra
            pass
        else:
            for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
                self.to_np[getattr(ct, n)] = np.dtype(getattr(ml_dtypes, n))
                self.from_np[np.dtype(getattr(ml_dtypes, n))] = getattr(ct, n)
        ints = [ct.int8, ct.int16, ct.int32, ct.int64]
        uints = [ct.uint8, ct.uint16, ct.uint32, ct.uint64]
        self.signed = {d: i for i, d in enumerate(ints)}
        self.unsigned = {d: i for i, d in enumerate(uints)}
        self.floats = {ct.float16: 0, ct.bfloat16: 0, ct.float32: 1, ct.float64: 2}
        self.restricted = {ct.tfloat32, ct.float8_e4m3fn, ct.float8_e5m2}

    def np_of(self, dtype: Any) -> np.dtype[Any]:
        try:
            return self.to_np[dtype]
        except (KeyError, TypeError):
            if isinstance(dtype, (np.dtype | type, str)):
                return np.dtype(dtype)
            raise TileNotEmulatedError(f"{dtype} (dtype)") from None

    def ct_of(self, dtype: np.dtype[Any]) -> Any:
        try:
            return self.from_np[np.dtype(dtype)]
        except KeyError:
            raise TileEmulationError(f"arrays of NumPy dtype {dtype} have no cuTile dtype") from None

    def as_ct(self, dtype: Any) -> Any:
        """A dtype given by a kernel (cuTile's, or a NumPy one) as cuTile's."""
        if isinstance(dtype, self.ct.DType):
            return dtype
        return self.ct_of(np.dtype(dtype))

    def is_float(self, d: Any) -> bool:
        return d in self.floats or d in self.restricted

    def is_int(self, d: Any) -> bool:
        return d in self.signed or d in self.unsigned

    def promote(self, a: Any, b: Any) -> Any:
        """cuTile's implicit promotion of two typed dtypes."""
        ct = self.ct
        if a == b:
            return a
        if a in self.restricted or b in self.restricted:
            raise TileEmulationError(
                f"implicit promotion of {a} and {b} involves a restricted float dtype; cast explicitly"
            )
        if a == ct.bool_:
            return b
        if b == ct.bool_:
            return a
        af, bf = a in self.floats, b in self.floats
        if af and bf:
            if {a, b} == {ct.float16, ct.bfloat16}:
                raise TileEmulationError("implicit promotion of float16 and bfloat16; cast explicitly")
            return a if self.floats[a] >= self.floats[b] else b
        if af:
            return a
        if bf:
            return b
        for kind in (self.signed, self.unsigned):
            if a in kind and b in kind:
                return a if kind[a] >= kind[b] else b
        raise TileEmulationError(f"implicit promotion of {a} and {b} (mixed signedness); cast explicitly")


_dtypes_lock = threading.Lock()
_dtypes_cache: list[_Dtypes] = []


def _dt() -> _Dtypes:
    if not _dtypes_cache:
        with _dtypes_lock:
            if not _dtypes_cache:
                _dtypes_cache.append(_Dtypes())
    return _dtypes_cache[0]


def _round_tf32(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float32 values rounded (to nearest even) to tf32's 10 mantissa bits."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    finite = np.isfinite(a)
    rounded = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return np.where(finite, rounded, bits).astype(np.uint32).view(np.float32)


# --------------------------------------------------------------------------- tiles and arrays


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
    compute = _COMPUTE_16 if npd.itemsize < 4 and npd.kind not in "biu" else npd
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
    a = t.a.astype(_COMPUTE_16 if (npd.kind == "f" and npd.itemsize < 4) or npd.kind == "V" else npd)
    with np.errstate(all="ignore"):
        r = _UNARY[fn](a)
    if fn == "isnan":
        return Tile(np.asarray(r), d.ct.bool_)
    return Tile(np.asarray(r).astype(npd), dtype)


# --------------------------------------------------------------------------- per-launch state


@final
class _Run:
    """The state of one emulated launch: the grid, the running block, the
    spin detector's counters."""

    __slots__ = ("bid", "grid", "last_poll", "polls", "spin_limit", "writes")

    def __init__(self, grid: tuple[int, int, int], spin_limit: int) -> None:
        self.grid = grid
        self.bid = (0, 0, 0)
        self.spin_limit = spin_limit
        self.writes = 0
        self.last_poll: object = None
        self.polls = 0

    def wrote(self) -> None:
        self.writes += 1
        self.last_poll = None
        self.polls = 0

    def poll(self, key: object, what: str) -> None:
        """One read that a spin loop would repeat; ``key`` is None for reads
        that are not (they break a run of identical polls)."""
        if key is None or key != self.last_poll:
            self.last_poll = key
            self.polls = 0
            return
        self.polls += 1
        if self.polls >= self.spin_limit:
            raise TileSpinError(
                f"block {self.bid} of grid {self.grid} repeated {what} {self.polls} times with no write in "
                "between: it waits for memory that no block that has run will change (the simulator runs "
                "blocks one after another, so a block cannot wait on a later one)",
                self.bid,
            )


_run: contextvars.ContextVar[_Run] = contextvars.ContextVar("trio_cuda_tile_emulation")


def _current() -> _Run:
    try:
        return _run.get()
    except LookupError:
        raise TileEmulationError("an emulated cuTile op was called outside run_tile_kernel") from None


def _poll_key(op: str, arr: EmuArray, where: Any, result: np.ndarray[Any, Any]) -> object:
    if result.size > _POLL_MAX_ELEMENTS:
        return None
    return (op, id(arr.data), arr.data.__array_interface__["data"][0], repr(where), result.tobytes())


# --------------------------------------------------------------------------- grid


def _axis(axis: Any) -> int:
    a = int(axis)
    if a not in (0, 1, 2):
        raise TileEmulationError(f"block axis must be 0, 1 or 2, got {axis!r}")
    return a


def _bid(axis: Any) -> int:
    return _current().bid[_axis(axis)]


def _num_blocks(axis: Any) -> int:
    return _current().grid[_axis(axis)]


def _cdiv(x: Any, y: Any) -> Any:
    if isinstance(x, Tile) or isinstance(y, Tile):
        return _arith("floordiv", _arith("add", x, _arith("sub", y, 1)), y)
    return -(int(x) // -int(y))


# --------------------------------------------------------------------------- load / store


def _array(x: Any, op: str) -> EmuArray:
    if isinstance(x, EmuArray):
        return x
    raise TypeError(f"ct.{op}: expected an array argument of the kernel, got {type(x).__name__}")


def _order(order: Any, ndim: int, op: str) -> tuple[int, ...]:
    if order == "C":
        return tuple(range(ndim))
    if order == "F":
        return tuple(reversed(range(ndim)))
    perm = tuple(int(o) for o in order)
    if sorted(perm) != list(range(ndim)):
        raise TileEmulationError(f"ct.{op}: order {order!r} is not a permutation of {ndim} axes")
    return perm


def _index_of(index: Any, ndim: int, op: str) -> tuple[int, ...]:
    if not isinstance(index, tuple | list):
        index = (index,)
    out = tuple(int(i) for i in index)
    if len(out) != ndim:
        raise TileEmulationError(f"ct.{op}: index {out} has {len(out)} entries for an array of rank {ndim}")
    return out


def _padding(mode: Any, npd: np.dtype[Any]) -> Any:
    PaddingMode = _ct().PaddingMode
    if mode is None or mode == PaddingMode.UNDETERMINED:
        if npd.kind in "fV" and npd != np.dtype(bool):
            return np.nan
        return np.frombuffer(b"\xa5" * npd.itemsize, dtype=npd)[0] if npd.kind in "iu" else True
    if mode == PaddingMode.ZERO:
        return 0
    values = {
        PaddingMode.NEG_ZERO: -0.0,
        PaddingMode.NAN: np.nan,
        PaddingMode.POS_INF: np.inf,
        PaddingMode.NEG_INF: -np.inf,
    }
    if mode not in values:
        raise TileEmulationError(f"ct.load: padding_mode must be a ct.PaddingMode, got {mode!r}")
    if npd.kind not in "fV":
        raise TileEmulationError(f"ct.load: padding_mode {mode} needs a float array, got {npd}")
    return values[mode]


def _window(
    view: np.ndarray[Any, Any], index: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[tuple[slice, ...], tuple[slice, ...], bool, bool]:
    """The in-bounds part of tile ``index`` of ``shape``: its slices of the view
    and of the tile, whether it is whole, whether any of it is in bounds."""
    src: list[slice] = []
    dst: list[slice] = []
    whole = True
    some = True
    for i, t, n in zip(index, shape, view.shape):
        start = i * t
        stop = builtins.min(start + t, n)
        if start < 0 or start >= n:
            some = False
            stop = start
        if stop - start != t:
            whole = False
        src.append(slice(start, builtins.max(stop, start)))
        dst.append(slice(0, builtins.max(stop - start, 0)))
    return tuple(src), tuple(dst), whole, some


def _unchecked(op: str, view: np.ndarray[Any, Any], index: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """The full slices of a ``check_bounds=False`` access (the view's memcheck
    sees any part past the extent; a plain array raises here)."""
    src = tuple(slice(i * t, i * t + t) for i, t in zip(index, shape))
    for s, n in zip(src, view.shape):
        if s.start < 0 or s.stop > n:
            view[src]  # a bounds-checked view records the access here
            raise TileEmulationError(
                f"ct.{op} with check_bounds=False: tile {index} of shape {shape} lies past the array's "
                f"extent {view.shape}"
            )
    return src


def _load(
    array: Any,
    /,
    index: Any,
    shape: Any,
    *,
    order: Any = "C",
    padding_mode: Any = None,
    check_bounds: Any = True,
    latency: Any = None,
    allow_tma: Any = None,
    memory_order: Any = None,
    memory_scope: Any = None,
) -> Tile:
    arr = _array(array, "load")
    tshape = _shape_of(shape, "ct.load")
    _check_shape(tshape, "ct.load")
    nd = arr.ndim
    scalar = len(tshape) == 0 and nd > 0
    if scalar:
        tshape = (1,) * nd
    if len(tshape) != nd:
        raise TileEmulationError(f"ct.load: tile shape {tshape} has rank {len(tshape)}, the array {nd}")
    idx = _index_of(index, nd, "load")
    perm = _order(order, nd, "load")
    view = arr.data if perm == tuple(range(nd)) else arr.data.transpose(perm)
    npd = arr.data.dtype
    if not check_bounds:
        out = np.array(view[_unchecked("load", view, idx, tshape)])
    else:
        src, dst, whole, some = _window(view, idx, tshape)
        if whole:
            out = np.array(view[src])
        else:
            out = np.full(tshape, _padding(padding_mode, npd), dtype=npd)
            if some:
                out[dst] = view[src]
    if scalar:
        out = out.reshape(())
    _current().poll(_poll_key("load", arr, (idx, perm, tshape), out), "the same ct.load")
    return Tile(out, arr.dtype)


def _check_store_dtype(value: Any, target: Any, op: str) -> Tile:
    d = _dt()
    if isinstance(value, Tile):
        if value.dtype != target:
            try:
                widened = d.promote(value.dtype, target)
            except TileEmulationError:
                widened = None
            if widened != target:
                raise TileEmulationError(
                    f"ct.{op}: a {value.dtype} tile does not convert implicitly to the array's dtype "
                    f"{target}; use ct.astype"
                )
            return _astype(value, target)
        return value
    return _tile_of(value, target)


def _store(
    array: Any,
    /,
    index: Any,
    tile: Any,
    *,
    order: Any = "C",
    check_bounds: Any = True,
    latency: Any = None,
    allow_tma: Any = None,
    memory_order: Any = None,
    memory_scope: Any = None,
) -> None:
    arr = _array(array, "store")
    t = _check_store_dtype(tile, arr.dtype, "store")
    nd = arr.ndim
    data = t.a
    if data.ndim == 0:
        data = data.reshape((1,) * nd)
    if data.ndim != nd:
        raise TileEmulationError(f"ct.store: a tile of rank {data.ndim} stored into an array of rank {nd}")
    _check_shape(data.shape, "ct.store")
    idx = _index_of(index, nd, "store")
    perm = _order(order, nd, "store")
    view = arr.data if perm == tuple(range(nd)) else arr.data.transpose(perm)
    if not check_bounds:
        view[_unchecked("store", view, idx, data.shape)] = data
    else:
        src, dst, whole, some = _window(view, idx, data.shape)
        if whole:
            view[src] = data
        elif some:
            view[src] = data[dst]
    _current().wrote()


def _num_tiles(array: Any, /, axis: Any, shape: Any, order: Any = "C") -> int:
    arr = _array(array, "num_tiles")
    tshape = _shape_of(shape, "ct.num_tiles")
    perm = _order(order, arr.ndim, "num_tiles")
    a = int(axis)
    n = arr.data.shape[perm[a]]
    return int(-(n // -tshape[a]))


# --------------------------------------------------------------------------- gather / scatter / atomics


def _indices(
    arr: EmuArray, indices: Any, op: str, *extra: Any
) -> tuple[tuple[np.ndarray[Any, Any], ...], list[np.ndarray[Any, Any]], tuple[int, ...]]:
    """Index arrays broadcast to their common shape (and ``extra`` operands to
    it, None staying None)."""
    if not isinstance(indices, tuple | list):
        if arr.ndim != 1:
            raise TileEmulationError(f"ct.{op}: a {arr.ndim}-d array needs a tuple of {arr.ndim} indices")
        indices = (indices,)
    if len(indices) != arr.ndim:
        raise TileEmulationError(f"ct.{op}: {len(indices)} indices for an array of rank {arr.ndim}")
    idx = [np.asarray(i.a if isinstance(i, Tile) else i) for i in indices]
    for i in idx:
        if i.dtype.kind not in "iu":
            raise TileEmulationError(f"ct.{op}: indices must be integers, got {i.dtype}")
    shape = np.broadcast_shapes(*(i.shape for i in idx))
    more = [np.asarray(e.a if isinstance(e, Tile) else e) for e in extra if e is not None]
    shape = np.broadcast_shapes(shape, *(m.shape for m in more))
    out = tuple(np.broadcast_to(i.astype(np.int64), shape) for i in idx)
    return out, [np.broadcast_to(m, shape) for m in more], tuple(shape)


def _in_bounds(arr: EmuArray, idx: tuple[np.ndarray[Any, Any], ...]) -> np.ndarray[Any, Any]:
    ok = np.ones(idx[0].shape, dtype=bool)
    for i, n in zip(idx, arr.data.shape):
        ok &= (i >= 0) & (i < n)
    return ok


def _valid(
    arr: EmuArray, idx: tuple[np.ndarray[Any, Any], ...], mask: Any, check_bounds: Any, op: str
) -> np.ndarray[Any, Any]:
    ok = _in_bounds(arr, idx)
    if not check_bounds and not ok.all():
        bad = tuple(int(i[~ok].flat[0]) for i in idx)
        arr.data[bad]  # a bounds-checked view records the access here
        raise TileEmulationError(
            f"ct.{op} with check_bounds=False: index {bad} lies outside the array's extent {arr.shape}"
        )
    if mask is not None:
        ok = ok & np.broadcast_to(
            np.asarray(mask.a if isinstance(mask, Tile) else mask, dtype=bool), ok.shape
        )
    return ok


def _gather(
    array: Any,
    indices: Any,
    /,
    *,
    mask: Any = None,
    padding_value: Any = 0,
    check_bounds: Any = True,
    latency: Any = None,
) -> Tile:
    arr = _array(array, "gather")
    idx, _, shape = _indices(arr, indices, "gather", mask, padding_value)
    ok = _valid(arr, idx, mask, check_bounds, "gather")
    pad = _np_in(padding_value, arr.dtype)
    out = np.array(np.broadcast_to(pad, shape), dtype=arr.data.dtype)
    if ok.all():
        out[...] = arr.data[idx]
    elif ok.any():
        out[ok] = arr.data[tuple(i[ok] for i in idx)]
    _current().poll(_poll_key("gather", arr, [i.tobytes() for i in idx], out), "the same gather")
    return Tile(out, arr.dtype)


def _scatter(
    array: Any,
    indices: Any,
    value: Any,
    /,
    *,
    mask: Any = None,
    check_bounds: Any = True,
    latency: Any = None,
) -> None:
    arr = _array(array, "scatter")
    v = _check_store_dtype(value, arr.dtype, "scatter")
    idx, (vals,), _ = _indices(arr, indices, "scatter", v)
    ok = _valid(arr, idx, mask, check_bounds, "scatter")
    if ok.all():
        arr.data[idx] = vals
    elif ok.any():
        arr.data[tuple(i[ok] for i in idx)] = vals[ok]
    _current().wrote()


_RMW: dict[str, Callable[[Any, Any], Any]] = {
    "atomic_xchg": lambda old, new: new,
    "atomic_add": np.add,
    "atomic_max": np.maximum,
    "atomic_min": np.minimum,
    "atomic_and": np.bitwise_and,
    "atomic_or": np.bitwise_or,
    "atomic_xor": np.bitwise_xor,
}


def _atomic(op: str, array: Any, indices: Any, operands: Sequence[Any], check_bounds: Any) -> Tile:
    """One atomic op, element after element where indices repeat."""
    arr = _array(array, op)
    vals = [_check_store_dtype(v, arr.dtype, op) for v in operands]
    idx, vs, shape = _indices(arr, indices, op, *vals)
    ok = _valid(arr, idx, None, check_bounds, op)
    npd = arr.data.dtype
    result = np.array(vs[0], dtype=npd) if op == "atomic_cas" else np.zeros(shape, dtype=npd)
    sel = tuple(i[ok] for i in idx)
    flat = np.ravel_multi_index(sel, arr.data.shape) if sel and sel[0].size else np.zeros(0, np.int64)
    changed = False
    if flat.size == np.unique(flat).size:
        old = np.array(arr.data[sel])
        if op == "atomic_cas":
            hit = old == vs[0][ok]
            new = np.where(hit, vs[1][ok], old)
        else:
            with np.errstate(all="ignore"):
                new = np.asarray(_RMW[op](old, vs[0][ok])).astype(npd)
        changed = bool((new.view(np.uint8) != old.view(np.uint8)).any()) if new.size else False
        if changed:
            arr.data[sel] = new
        result[ok] = old
    else:
        positions = np.argwhere(ok)
        for row in positions:
            p = tuple(int(v) for v in row)
            at = tuple(int(i[p]) for i in idx)
            old1 = np.array(arr.data[at])
            if op == "atomic_cas":
                new1 = vs[1][p] if old1 == vs[0][p] else old1
            else:
                with np.errstate(all="ignore"):
                    new1 = np.asarray(_RMW[op](old1, vs[0][p])).astype(npd)
            if np.asarray(new1).tobytes() != old1.tobytes():
                arr.data[at] = new1
                changed = True
            result[p] = old1
    run = _current()
    if changed:
        run.wrote()
    else:
        run.poll(
            _poll_key(
                op,
                arr,
                [i.tobytes() for i in idx],
                np.concatenate([result.ravel(), *[v.ravel() for v in vs]]),
            ),
            f"the same ct.{op} (changing nothing)",
        )
    return Tile(result, arr.dtype)


def _atomic_cas(
    array: Any,
    indices: Any,
    expected: Any,
    desired: Any,
    /,
    *,
    check_bounds: Any = True,
    memory_order: Any = None,
    memory_scope: Any = None,
) -> Tile:
    return _atomic("atomic_cas", array, indices, (expected, desired), check_bounds)


def _rmw(op: str) -> Callable[..., Tile]:
    def atomic(
        array: Any,
        indices: Any,
        update: Any,
        /,
        *,
        check_bounds: Any = True,
        memory_order: Any = None,
        memory_scope: Any = None,
    ) -> Tile:
        return _atomic(op, array, indices, (update,), check_bounds)

    atomic.__name__ = op
    return atomic


# --------------------------------------------------------------------------- factories, shapes, casts


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


def _astype(x: Any, dtype: Any, /, *, rounding_mode: Any = None) -> Tile:
    d = _dt()
    ctd = d.as_ct(dtype)
    t = _tile_of(x)
    with np.errstate(all="ignore"):
        a = t.a.astype(d.np_of(ctd))
    if ctd == d.ct.tfloat32:
        a = _round_tf32(a)
    return Tile(a, ctd)


def _bitcast(x: Any, /, dtype: Any) -> Tile:
    d = _dt()
    ctd = d.as_ct(dtype)
    t = _tile_of(x)
    npd = d.np_of(ctd)
    if npd.itemsize != t.a.dtype.itemsize:
        raise TileEmulationError(f"ct.bitcast: {t.dtype} and {ctd} differ in width")
    return Tile(np.ascontiguousarray(t.a).view(npd), ctd)


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


def _mm_compute(a: Tile, b: Tile, out_np: np.dtype[Any]) -> np.ndarray[Any, Any]:
    kind = out_np.kind
    compute = np.float64 if out_np == np.float64 else (np.int64 if kind in "iu" else np.float32)
    with np.errstate(all="ignore"):
        r: np.ndarray[Any, Any] = np.matmul(a.a.astype(compute), b.a.astype(compute))
    return r


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
        compute = np.float32 if npd.kind in "fV" and npd.itemsize < 4 else npd
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
        compute = np.float32 if npd.kind in "fV" and npd.itemsize < 4 else npd
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


def _not_emulated(name: str) -> Callable[..., Any]:
    def op(*_args: Any, **_kwargs: Any) -> Any:
        raise TileNotEmulatedError(name)

    op.__name__ = name
    return op


def _ops() -> dict[str, Any]:
    ops: dict[str, Any] = {
        "bid": _bid,
        "num_blocks": _num_blocks,
        "num_tiles": _num_tiles,
        "cdiv": _cdiv,
        "assume_divisible_by": _identity,
        "load": _load,
        "store": _store,
        "gather": _gather,
        "scatter": _scatter,
        "atomic_cas": _atomic_cas,
        "arange": _arange,
        "full": _full,
        "zeros": _zeros,
        "ones": _ones,
        "astile": _astile,
        "astype": _astype,
        "bitcast": _bitcast,
        "reshape": _reshape,
        "permute": _permute,
        "transpose": _transpose,
        "expand_dims": _expand_dims,
        "broadcast_to": _broadcast_to,
        "cat": _cat,
        "extract": _extract,
        "insert": _insert,
        "where": _where,
        "mma": _mma,
        "matmul": _matmul,
        "divmod": _divmod,
        "bitwise_not": _bitwise_not,
        "printf": _printf,
        "print": _print,
        "assert_": _assert,
        "static_assert": _static_assert,
        "static_eval": _identity,
        "static_iter": _identity,
        "ensure_constant": _identity,
        "grid_dependency_control_wait": _nothing,
        "grid_dependency_control_launch_dependents": _nothing,
        "Tile": Tile,
        "Array": EmuArray,
    }
    for op in _RMW:
        ops[op] = _rmw(op)
    for fn in ("sum", "max", "min", "prod", "argmax", "argmin"):
        ops[fn] = _reduction(fn)
    for fn in ("cumsum", "cumprod"):
        ops[fn] = _scan(fn)
    names = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "truediv", "floordiv": "floordiv"}
    names |= {"pow": "pow", "mod": "mod", "maximum": "maximum", "minimum": "minimum", "atan2": "atan2"}
    names |= {"bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor"}
    names |= {"bitwise_lshift": "lshift", "bitwise_rshift": "rshift", "greater": "gt"}
    names |= {"greater_equal": "ge", "less": "lt", "less_equal": "le", "equal": "eq", "not_equal": "ne"}
    for name, fn in names.items():
        ops[name] = _binary(fn)
    for fn in _UNARY:
        ops[fn] = _unary_op(fn)
    return ops


#: the ``cuda.tile`` ops the emulator implements (names as in ``cuda.tile``)
EMULATED_OPS: Final = frozenset(
    set(_RMW)
    | set(_UNARY)
    | {"sum", "max", "min", "prod", "argmax", "argmin", "cumsum", "cumprod"}
    | {"bid", "num_blocks", "num_tiles", "cdiv", "assume_divisible_by", "load", "store", "gather"}
    | {"scatter", "atomic_cas", "arange", "full", "zeros", "ones", "astile", "astype", "bitcast"}
    | {"reshape", "permute", "transpose", "expand_dims", "broadcast_to", "cat", "extract", "insert"}
    | {"where", "mma", "matmul", "divmod", "bitwise_not", "printf", "print", "assert_", "static_assert"}
    | {"static_eval", "static_iter", "ensure_constant", "grid_dependency_control_wait"}
    | {"grid_dependency_control_launch_dependents", "add", "sub", "mul", "truediv", "floordiv", "pow"}
    | {"mod", "maximum", "minimum", "atan2", "bitwise_and", "bitwise_or", "bitwise_xor"}
    | {"bitwise_lshift", "bitwise_rshift", "greater", "greater_equal", "less", "less_equal"}
    | {"equal", "not_equal"}
)


@final
class _Namespace(types.ModuleType):
    """``cuda.tile`` as the emulated kernel sees it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise TileNotEmulatedError(name)


@final
@attrs.frozen
class _Emulation:
    """The emulated module and the map from cuda.tile's objects to theirs."""

    module: _Namespace
    by_id: dict[int, Any]
    real: Any


_emulation_lock = threading.Lock()
_emulation_cache: list[_Emulation] = []


def _emulation() -> _Emulation:
    if _emulation_cache:
        return _emulation_cache[0]
    with _emulation_lock:
        if _emulation_cache:
            return _emulation_cache[0]
        ct = _ct()
        ops = _ops()
        module = _Namespace("cuda.tile", "cuda.tile, emulated on NumPy tiles")
        by_id: dict[int, Any] = {id(ct): module}
        for name in dir(ct):
            if name.startswith("__"):
                continue
            real = getattr(ct, name)
            if name in ops:
                value = ops[name]
            elif (inspect.isfunction(real) or inspect.isbuiltin(real)) and name not in (
                "kernel",
                "function",
                "compiler_timeout",
            ):
                value = _not_emulated(name)
            else:
                value = real
            setattr(module, name, value)
            if value is not real and not isinstance(real, int | str | float | bool):
                by_id[id(real)] = value
        by_id[id(ct.Tile)] = Tile
        by_id[id(ct.Array)] = EmuArray
        _emulation_cache.append(_Emulation(module, by_id, ct))
        return _emulation_cache[0]


# --------------------------------------------------------------------------- running the kernel's Python


@final
class _Patcher:
    """Rebuilds functions with globals (and closure cells) in which cuda.tile
    resolves to the emulation, recursively for the functions they reach."""

    def __init__(self, emu: _Emulation) -> None:
        self.emu = emu
        self.globals: dict[int, dict[str, Any]] = {}
        self.functions: dict[int, types.FunctionType] = {}

    def uses_tile(self, g: dict[str, Any]) -> bool:
        by_id = self.emu.by_id
        return any(id(v) in by_id for v in g.values())

    def value(self, v: Any) -> Any:
        emu = self.emu.by_id.get(id(v))
        if emu is not None:
            return emu
        if isinstance(v, types.FunctionType):
            wrapped = getattr(v, "__wrapped__", None)
            if getattr(v, "_cutile_function_wrapper", False) and isinstance(wrapped, types.FunctionType):
                return self.function(wrapped)
            if self.uses_tile(v.__globals__) or (v.__closure__ and self._closure_uses_tile(v)):
                return self.function(v)
        return v

    def _closure_uses_tile(self, f: types.FunctionType) -> bool:
        for cell in f.__closure__ or ():
            try:
                c = cell.cell_contents
            except ValueError:
                continue
            if id(c) in self.emu.by_id or isinstance(c, types.FunctionType):
                return True
        return False

    def patched_globals(self, g: dict[str, Any]) -> dict[str, Any]:
        got = self.globals.get(id(g))
        if got is not None:
            return got
        new: dict[str, Any] = {}
        self.globals[id(g)] = new
        for k, v in g.items():
            new[k] = self.value(v)
        new.setdefault("max", _builtin_minmax("maximum", builtins.max))
        new.setdefault("min", _builtin_minmax("minimum", builtins.min))
        new.setdefault("abs", _builtin_abs)
        return new

    def function(self, f: types.FunctionType) -> types.FunctionType:
        got = self.functions.get(id(f))
        if got is not None:
            return got
        g = self.patched_globals(f.__globals__)
        # new cells first, so that a function reaching itself finds its copy
        cells = tuple(types.CellType() for _ in f.__closure__ or ())
        new = types.FunctionType(
            f.__code__, g, f.__name__, None, cells if f.__closure__ is not None else None
        )
        new.__qualname__ = f.__qualname__
        self.functions[id(f)] = new
        for cell, old in zip(cells, f.__closure__ or ()):
            try:
                contents = old.cell_contents
            except ValueError:  # an empty cell (a name not yet bound)
                continue
            cell.cell_contents = self.value(contents)
        if f.__defaults__:
            new.__defaults__ = tuple(self.value(v) for v in f.__defaults__)
        if f.__kwdefaults__:
            new.__kwdefaults__ = {k: self.value(v) for k, v in f.__kwdefaults__.items()}
        return new


def kernel_function(kernel: Any) -> types.FunctionType:
    """The Python function of a ``@ct.kernel`` (or a plain function as it is)."""
    if isinstance(kernel, types.FunctionType):
        return kernel
    fn = getattr(kernel, "_pyfunc", None)
    if fn is None:  # the attribute behind cuda.tile 1.7's _pyfunc
        fn = getattr(getattr(kernel, "_annotated_function", None), "pyfunc", None)
    if not isinstance(fn, types.FunctionType):
        version = getattr(_ct(), "__version__", "?")
        pinned = (
            "" if str(version).startswith(_PINNED_MINOR) else f" (this emulator targets {_PINNED_MINOR}.x)"
        )
        raise TypeError(
            f"kernel: expected a @ct.kernel function, got {type(kernel).__name__}: its Python function "
            f"could not be found with cuda.tile {version}{pinned}"
        )
    return fn


def _is_constant(annotation: Any) -> bool:
    ct = _ct()
    if annotation is ct.Constant:
        return True
    return any(isinstance(m, ct.ConstantAnnotation) for m in getattr(annotation, "__metadata__", ()))


def _scalar_dtype(annotation: Any) -> Any:
    """The dtype a scalar parameter's annotation declares (``ct.ScalarInt64``), or None."""
    ct = _ct()
    for m in getattr(annotation, "__metadata__", ()):
        dtype = getattr(m, "dtype", None)
        if isinstance(dtype, ct.DType):
            return dtype
    return None


def _argument(value: Any, annotation: Any, name: str) -> Any:
    if _is_constant(annotation):
        return value.a.item() if isinstance(value, Tile) else value
    if isinstance(value, np.ndarray):
        return EmuArray(value)
    if isinstance(value, list):
        return [_argument(v, None, f"{name}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_argument(v, None, f"{name}[{i}]") for i, v in enumerate(value))
    if isinstance(value, EmuArray | Tile):
        return value
    d = _dt()
    if isinstance(value, bool | np.bool_):
        return Tile(np.asarray(bool(value)), d.ct.bool_)
    if isinstance(value, np.generic):
        return Tile(np.asarray(value), d.ct_of(value.dtype))
    declared = _scalar_dtype(annotation)
    if declared is not None and isinstance(value, int | float):
        return Tile(np.asarray(value, dtype=d.np_of(declared)), declared)
    if isinstance(value, int):
        dtype = d.ct.int32 if -(2**31) <= value < 2**31 else d.ct.int64
        return Tile(np.asarray(value, dtype=d.np_of(dtype)), dtype)
    if isinstance(value, float):
        return Tile(np.asarray(value, dtype=np.float32), d.ct.float32)
    raise TypeError(
        f"argument {name!r}: expected an array, a scalar, a constant or a list of arrays, "
        f"got {type(value).__name__}"
    )


def _grid(grid: Any) -> tuple[int, int, int]:
    g = (grid,) if isinstance(grid, int) else tuple(grid)
    if not 1 <= len(g) <= 3 or not all(isinstance(n, int | np.integer) and n >= 1 for n in g):
        raise ValueError(f"grid: expected 1 to 3 positive ints, got {grid!r}")
    full = (*(int(n) for n in g), 1, 1)
    return (full[0], full[1], full[2])


def run_tile_kernel(
    kernel: Any,
    grid: int | Sequence[int],
    args: Sequence[Any],
    *,
    spin_limit: int = DEFAULT_SPIN_LIMIT,
) -> None:
    """Execute the ``@ct.kernel`` ``kernel`` on NumPy tiles, once per block of
    ``grid`` (axis 0 fastest), with ``args`` one per kernel parameter: NumPy
    arrays (views of the simulated device's memory, which the kernel's stores
    and atomics write through), scalars, ``ct.Constant`` values, lists or
    tuples of arrays. See the module docstring for the rules.

    Raises :class:`TileNotEmulatedError` for an op not covered,
    :class:`TileSpinError` for a block spinning on memory no block will
    change, :class:`TileEmulationError` for what cuTile would refuse, and
    whatever the kernel raises."""
    if not isinstance(spin_limit, int) or spin_limit < 1:
        raise ValueError(f"spin_limit: expected a positive int, got {spin_limit!r}")
    g = _grid(grid)
    fn = kernel_function(kernel)
    params = list(inspect.signature(fn).parameters.values())
    args = list(args)
    if len(args) != len(params):
        raise TypeError(
            f"args: kernel {fn.__name__!r} takes {len(params)} arguments "
            f"({', '.join(p.name for p in params)}), got {len(args)}"
        )
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # unresolvable annotations: read them as written
        hints = dict(getattr(fn, "__annotations__", {}))
    values = [_argument(a, hints.get(p.name), p.name) for a, p in zip(args, params)]
    emulated = _Patcher(_emulation()).function(fn)
    run = _Run(g, spin_limit)
    token = _run.set(run)
    try:
        for z in range(g[2]):
            for y in range(g[1]):
                for x in range(g[0]):
                    run.bid = (x, y, z)
                    run.last_poll = None
                    run.polls = 0
                    emulated(*values)
    finally:
        _run.reset(token)
