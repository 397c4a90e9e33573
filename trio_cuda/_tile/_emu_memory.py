"""Memory ops of the NumPy emulation: ``ct.load``, ``ct.store``,
``ct.num_tiles``, gathers, scatters and atomics, with cuTile's bounds rules
and padding.

Invariants: memory is touched only through the kernel's array views. With
bounds checks a tile partly outside its array is padded on load (see
:func:`_padding`) and clipped on store, and a gather or scatter skips
out-of-range or masked-off elements; with ``check_bounds=False`` the view is
indexed as given (a bounds-checked view records it) and an access past the
extent raises :class:`TileEmulationError`. Stores accept only a tile whose
dtype widens to the array's. Every write tells the launch (resetting the
spin detector); small reads and atomics that change nothing count as polls.
Atomics apply element after element where indices repeat.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from ._emu_dtypes import _ct, _dt
from ._emu_errors import TileEmulationError
from ._emu_launch import _current
from ._emu_tiles import EmuArray, Tile, _astype, _check_shape, _index_of, _np_in, _shape_of, _tile_of

#: largest tile (elements) whose repeated read counts as polling
_POLL_MAX_ELEMENTS: Final = 64


def _poll_key(op: str, arr: EmuArray, where: Any, result: np.ndarray[Any, Any]) -> object:
    if result.size > _POLL_MAX_ELEMENTS:
        return None
    return (op, id(arr.data), arr.data.__array_interface__["data"][0], repr(where), result.tobytes())


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


def _oriented(
    arr: EmuArray, index: Any, order: Any, op: str
) -> tuple[tuple[int, ...], tuple[int, ...], np.ndarray[Any, Any]]:
    """A tile access's block index, its axis order, and the array's view with
    its axes in that order."""
    nd = arr.ndim
    idx = _index_of(index, nd, op)
    perm = _order(order, nd, op)
    view = arr.data if perm == tuple(range(nd)) else arr.data.transpose(perm)
    return idx, perm, view


def _window(
    op: str, view: np.ndarray[Any, Any], index: tuple[int, ...], shape: tuple[int, ...], check_bounds: Any
) -> tuple[tuple[slice, ...], tuple[slice, ...], bool, bool]:
    """The part of tile ``index`` of ``shape`` to access: its slices of the view
    and of the tile, whether it is whole, whether any of it is in bounds. With
    ``check_bounds`` false it is the whole tile, or
    :class:`TileEmulationError` where that lies past the extent (the view's
    memcheck sees the access first; a plain array raises only here)."""
    if not check_bounds:
        full = tuple(slice(i * t, i * t + t) for i, t in zip(index, shape))
        for s, n in zip(full, view.shape):
            if s.start < 0 or s.stop > n:
                view[full]  # a bounds-checked view records the access here
                raise TileEmulationError(
                    f"ct.{op} with check_bounds=False: tile {index} of shape {shape} lies past the "
                    f"array's extent {view.shape}"
                )
        return full, tuple(slice(0, t) for t in shape), True, True
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
    idx, perm, view = _oriented(arr, index, order, "load")
    src, dst, whole, some = _window("load", view, idx, tshape, check_bounds)
    if whole:
        out = np.array(view[src])
    else:
        npd = arr.data.dtype
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
    idx, _, view = _oriented(arr, index, order, "store")
    src, dst, whole, some = _window("store", view, idx, data.shape, check_bounds)
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


def _updated(
    op: str, old: np.ndarray[Any, Any], operands: Sequence[Any], npd: np.dtype[Any]
) -> np.ndarray[Any, Any]:
    """The values atomic ``op`` leaves where memory held ``old``."""
    if op == "atomic_cas":
        return np.asarray(np.where(old == operands[0], operands[1], old))
    with np.errstate(all="ignore"):
        return np.asarray(_RMW[op](old, operands[0])).astype(npd)


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
        new = _updated(op, old, [v[ok] for v in vs], npd)
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
            new1 = _updated(op, old1, [v[p] for v in vs], npd)
            if new1.tobytes() != old1.tobytes():
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
