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

This module holds the entry point, the emulated ``cuda.tile`` namespace and
the rebinding of the kernel's functions; the ops live in ``_emu_tiles``
(tiles, arithmetic), ``_emu_memory`` (loads, stores, atomics), ``_emu_ops``
(the other compute ops) and ``_emu_launch`` (per-launch state), each
importing only those below it.
"""

from __future__ import annotations

import builtins
import inspect
import threading
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Final, final

import attrs
import numpy as np

from ._emu_dtypes import _ct, _dt
from ._emu_errors import TileEmulationError as TileEmulationError
from ._emu_errors import TileNotEmulatedError as TileNotEmulatedError
from ._emu_errors import TileSpinError as TileSpinError
from ._emu_launch import _bid as _bid
from ._emu_launch import _num_blocks, _Run, _run
from ._emu_memory import _RMW, _atomic_cas, _gather, _load, _num_tiles, _rmw, _scatter, _store
from ._emu_ops import (
    _arange,
    _assert,
    _astile,
    _binary,
    _bitcast,
    _bitwise_not,
    _broadcast_to,
    _builtin_abs,
    _builtin_minmax,
    _cat,
    _cdiv,
    _divmod,
    _expand_dims,
    _full,
    _identity,
    _mma,
    _nothing,
    _ones,
    _print,
    _printf,
    _reduction,
    _scan,
    _static_assert,
    _unary_op,
    _where,
    _zeros,
)
from ._emu_tiles import (
    _UNARY,
    EmuArray,
    Tile,
    _astype,
    _extract,
    _insert,
    _matmul,
    _permute,
    _reshape,
    _tile_of,
    _transpose,
)

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
    if isinstance(value, np.generic | int | float):
        declared = _scalar_dtype(annotation)
        if declared is not None and isinstance(value, int | float) and not isinstance(value, bool):
            return Tile(np.asarray(value, dtype=_dt().np_of(declared)), declared)
        return _tile_of(value)  # cuTile's dtype of a lone scalar
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
