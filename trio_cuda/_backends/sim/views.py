"""Bounds-checked views: the arrays a kernel's ``reference=`` receives.

A GPU kernel that reads or writes past the memory it was given faults, and
compute-sanitizer reports the access. A reference gets NumPy views instead,
and NumPy forgives what a GPU does not: ``y[:1000]`` of 16 elements silently
clamps to 16. :class:`BoundedView` is the ndarray subclass the simulator hands
a reference, so that such an access is an ``out_of_bounds`` violation.

Invariants:

* A view is checked while its launch's reference runs (:class:`LaunchCheck`
  ``active``); once the engine closes the check, it behaves as a plain
  ndarray, and the check holds none of the launch's views (no reference
  cycle keeps the device's buffers alive).
* Checked: ``[]`` reads and writes (``__getitem__``/``__setitem__``), and
  ``take``/``put`` and ``ufunc.at`` with their default ``mode="raise"``, of
  the argument and of every view derived from it (slices, reshapes,
  transposes, fields, ``.view``: every array whose NumPy ``base`` is the
  argument's root view, to which NumPy collapses a view's base), each
  against its own shape; iteration stays in bounds. Per dimension: an integer
  outside ``[-n, n)`` (negative indices count from the end, as in Python), a
  slice whose start or stop lies beyond the dimension (``[-n, n]`` for a
  positive step; for a negative one, a start in ``[-n, n)`` and a stop in
  ``[-n - 1, n)``: what NumPy would silently clamp), an integer array holding
  such an integer, a boolean mask longer than its dimensions.
* The first out-of-bounds access of a launch is recorded (one
  :class:`~.records.Violation` at the first element past the extent, the
  size of one element) and stops the reference there, with
  :class:`OutOfBounds`, a ``BaseException`` that ``except Exception`` in the
  reference does not catch; the launch then fails (``engine``). Later ones
  are counted, not recorded.
* A write to a read-only argument (``In``, or ``Slice(access="read")``) by
  ``[]=``, ``put``, ``ufunc.at`` or an ``out=`` (a ufunc's, ``take``'s)
  raises ``ValueError`` naming the argument.
* Arithmetic comes back as plain ndarrays: ufuncs (and the reductions and
  methods built on them) take and return plain arrays, except an ``out=``
  given by the caller, returned as it was given. Copies (``copy()``,
  fancy-indexing results, ``astype``) are plain ndarrays too; other NumPy
  functions may give the subclass for a copy, which is not checked (it does
  not share the argument's buffer).
* Cost: a check per index operation, vectorised for index arrays (a min and
  a max); no per-element Python.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, final

import numpy as np

from .records import Violation

__all__ = ["BoundedView", "Describe", "LaunchCheck", "OutOfBounds", "bounded"]

#: (dimension, element index past the extent, what is wrong) of a bad index
_Bad = tuple[int, int, str]


class OutOfBounds(BaseException):
    """Stops a reference at its first out-of-bounds access (as a GPU stops a
    faulting kernel). A ``BaseException``, so that ``except Exception`` in the
    reference lets it through; the engine catches it."""


@final
class LaunchCheck:
    """The memcheck of one launch's reference: active until :meth:`close`. The
    first out-of-bounds access goes to ``violations`` (the device's list)."""

    __slots__ = ("active", "args", "error", "first", "kernel", "more", "stream", "violations")

    def __init__(self, kernel: str, stream: int, violations: list[Violation]) -> None:
        self.kernel = kernel
        self.stream = stream
        self.violations = violations
        self.active = True
        self.args: list[_Arg] = []
        #: the first out-of-bounds access: its description, and the exception it raised
        self.first: str | None = None
        self.error: OutOfBounds | None = None
        #: out-of-bounds accesses after the first (the reference caught the first)
        self.more = 0

    def close(self) -> OutOfBounds | None:
        """End the check (views become plain arrays) and drop what would keep
        views alive in reference cycles. Returns the first fault raised."""
        self.active = False
        for arg in self.args:
            arg.root = arg.owner = None
        self.args.clear()
        error, self.error = self.error, None
        return error


#: the text naming an argument, and the declaration that makes it read-only
Describe = Callable[[], tuple[str, str]]


@final
class _Arg:
    """One array argument of a checked launch."""

    __slots__ = ("check", "describe", "owner", "ptr", "readonly", "root")

    def __init__(
        self, check: LaunchCheck, describe: Describe, readonly: bool, ptr: int, root: BoundedView
    ) -> None:
        self.check = check
        self.describe = describe
        self.readonly = readonly
        self.ptr = ptr
        self.root: BoundedView | None = root
        #: the ``base`` of every view of this argument: NumPy collapses a view's
        #: base to the first array of another type, the root (``root.base`` is a
        #: plain ndarray)
        self.owner: BoundedView | None = root

    def out_of_bounds(self, view: np.ndarray[Any, Any], key: object, bad: _Bad, action: str) -> None:
        """Record (the first of a launch) and raise :class:`OutOfBounds`."""
        check = self.check
        dim, element, why = bad
        root = self.root
        of = "" if view is root else f" (a view of shape {view.shape} of it)"
        text = f"{self.describe()[0]}{of} {action} [{key_text(key)}]: {why}"
        if check.first is not None or root is None:
            check.more += 1
            raise OutOfBounds(text)
        origin = self.ptr + (_data(view) - _data(root))
        stride = view.strides[dim] if dim < view.ndim else view.itemsize
        address = origin + element * stride
        check.first = text
        check.violations.append(
            Violation("out_of_bounds", address, view.itemsize, f"launch {check.kernel}: {text}", check.stream)
        )
        check.error = OutOfBounds(text)
        raise check.error

    def read_only(self) -> ValueError:
        label, mode = self.describe()
        return ValueError(
            f"{label} is read-only ({mode}): the kernel only reads it; declare it InOut or Out to write to it"
        )


def _data(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


def _arg_of(a: object) -> _Arg | None:
    """The argument a checked view belongs to while its launch runs, else None."""
    arg: _Arg | None = getattr(a, "_sim_arg", None)
    if arg is not None and arg.check.active:
        return arg
    return None


def _plain(a: Any) -> Any:
    return a.view(np.ndarray) if isinstance(a, BoundedView) else a


_getitem = np.ndarray.__getitem__
_setitem = np.ndarray.__setitem__


class BoundedView(np.ndarray[Any, np.dtype[Any]]):
    """A NumPy view of a kernel argument that records out-of-bounds indexing
    (see the module docstring). Otherwise an ordinary ndarray."""

    #: the argument this is a view of (set on the root and inherited by views)
    _sim_arg: _Arg | None = None

    def __array_finalize__(self, obj: object) -> None:
        arg: _Arg | None = getattr(obj, "_sim_arg", None)
        if arg is not None and self.base is arg.owner:  # a view of the argument, not a copy
            self._sim_arg = arg

    def __getitem__(self, key: Any) -> Any:
        arg = self._sim_arg
        if arg is not None and arg.check.active:
            bad = _out_of_bounds(self.shape, key)
            if bad is not None:
                arg.out_of_bounds(self, key, bad, "indexed")
        result = _getitem(self, key)
        if type(result) is BoundedView and result._sim_arg is None:
            return result.view(np.ndarray)  # a copy (fancy indexing): host memory
        return result

    def __setitem__(self, key: Any, value: Any) -> None:
        arg = self._sim_arg
        if arg is not None and arg.check.active:
            bad = _out_of_bounds(self.shape, key)
            if bad is not None:
                arg.out_of_bounds(self, key, bad, "assigned to")
            if arg.readonly:
                raise arg.read_only()
        _setitem(self, key, value)

    def __iter__(self) -> Any:
        # without this, iteration goes through __getitem__ until an IndexError,
        # and the index past the end would be an access out of bounds
        if not self.ndim:
            raise TypeError("iteration over a 0-d array")
        getitem = self.__getitem__
        return (getitem(i) for i in range(self.shape[0]))

    def take(self, indices: Any, axis: Any = None, out: Any = None, mode: Any = "raise") -> Any:
        arg = _arg_of(self)
        if arg is not None and mode == "raise":
            bad = _take_out_of_bounds(self, indices, axis)
            if bad is not None:
                arg.out_of_bounds(self, _TakeKey(indices, axis), bad, "took")
        out_arg = _arg_of(out)
        if out_arg is not None and out_arg.readonly:
            raise out_arg.read_only()
        result = self.view(np.ndarray).take(indices, axis=axis, out=_plain(out), mode=mode)
        return out if out is not None else result

    def put(self, indices: Any, values: Any, mode: Any = "raise") -> None:
        arg = _arg_of(self)
        if arg is not None:
            if mode == "raise":
                bad = _take_out_of_bounds(self, indices, None)
                if bad is not None:
                    arg.out_of_bounds(self, _TakeKey(indices, None), bad, "put to")
            if arg.readonly:
                raise arg.read_only()
        self.view(np.ndarray).put(indices, values, mode=mode)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method == "at" and inputs:
            arg = _arg_of(inputs[0])
            if arg is not None:
                target: np.ndarray[Any, Any] = inputs[0]
                key = inputs[1] if len(inputs) > 1 else ()
                bad = _out_of_bounds(target.shape, key)
                if bad is not None:
                    arg.out_of_bounds(target, key, bad, f"{ufunc.__name__}.at")
                if arg.readonly:
                    raise arg.read_only()
        args = [a.view(np.ndarray) if isinstance(a, BoundedView) else a for a in inputs]
        out = kwargs.get("out")
        if out is not None:
            plain_out = []
            for o in out:
                if isinstance(o, BoundedView):
                    arg = o._sim_arg
                    if arg is not None and arg.readonly and arg.check.active:
                        raise arg.read_only()
                    o = o.view(np.ndarray)
                plain_out.append(o)
            kwargs["out"] = tuple(plain_out)
        if "where" in kwargs:
            kwargs["where"] = _plain(kwargs["where"])
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is None or method == "at":
            return result
        if ufunc.nout == 1:
            return out[0] if out[0] is not None else result
        return tuple(o if o is not None else r for o, r in zip(out, result, strict=True))

    def copy(self, order: Any = "C") -> Any:
        return self.view(np.ndarray).copy(order)

    def __copy__(self) -> Any:
        return self.view(np.ndarray).copy("K")

    def __deepcopy__(self, memo: Any) -> Any:
        return self.view(np.ndarray).__deepcopy__(memo)

    def astype(self, *args: Any, **kwargs: Any) -> Any:
        plain = self.view(np.ndarray)
        result = plain.astype(*args, **kwargs)
        return self if result is plain else result  # copy=False and nothing to convert

    def __repr__(self) -> str:
        return repr(self.view(np.ndarray))

    def __reduce__(self) -> Any:  # a pickle of one is a plain array
        return self.view(np.ndarray).__reduce__()


def bounded(
    view: np.ndarray[Any, Any], check: LaunchCheck, ptr: int, readonly: bool, describe: Describe
) -> BoundedView:
    """``view`` (of the argument at device address ``ptr``) as a checked view of
    ``check``'s launch. ``describe()`` names it, and how it is declared
    read-only, for messages (only called for one)."""
    out = view.view(BoundedView)
    arg = _Arg(check, describe, readonly, ptr, out)
    out._sim_arg = arg
    check.args.append(arg)
    return out


# --------------------------------------------------------------------------- the checks


@final
class _TakeKey:
    """How ``take``/``put`` indices are shown."""

    __slots__ = ("axis", "indices")

    def __init__(self, indices: object, axis: object) -> None:
        self.indices = indices
        self.axis = axis


def _out_of_bounds(shape: tuple[int, ...], key: object) -> _Bad | None:
    """What is out of bounds in indexing an array of ``shape`` with ``key``, or
    None (in bounds, or an index NumPy refuses on its own)."""
    if type(key) is int:  # the fast path
        if not shape:
            return None
        n = shape[0]
        return None if -n <= key < n else _int_bad(0, key, n)
    if type(key) is slice:
        return _slice_bad(0, key, shape[0]) if shape else None
    parts = key if type(key) is tuple else (key,)
    items: list[tuple[str, Any, int]] = []  # (kind, value, dimensions it takes)
    taken = 0
    ellipsis = False
    for part in parts:
        item = _classify(part)
        if item is None:
            return None  # a field name or something NumPy refuses itself
        if item[0] == "ellipsis":
            if ellipsis:
                return None
            ellipsis = True
        taken += item[2]
        items.append(item)
    if taken > len(shape):
        return None  # too many indices: NumPy's IndexError
    dim = 0
    for kind, value, ndims in items:
        if kind == "ellipsis":
            dim += len(shape) - taken
            continue
        if kind == "int":
            n = shape[dim]
            if not -n <= value < n:
                return _int_bad(dim, value, n)
        elif kind == "slice":
            bad = _slice_bad(dim, value, shape[dim])
            if bad is not None:
                return bad
        elif kind == "ints":
            bad = _ints_bad(dim, value, shape[dim])
            if bad is not None:
                return bad
        elif kind == "mask":
            for j, m in enumerate(value.shape):
                n = shape[dim + j]
                if m > n:
                    return (
                        dim + j,
                        n,
                        f"a boolean mask of length {m} spans dimension {dim + j} of extent {n}",
                    )
        dim += ndims
    return None


def _classify(part: Any) -> tuple[str, Any, int] | None:
    if part is None:
        return ("newaxis", None, 0)
    if part is Ellipsis:
        return ("ellipsis", None, 0)
    if isinstance(part, slice):
        return ("slice", part, 1)
    if isinstance(part, bool | np.bool_):
        return ("newaxis", None, 0)  # a 0-d mask: a new axis of length 0 or 1
    if isinstance(part, int | np.integer):
        return ("int", int(part), 1)
    if isinstance(part, np.ndarray | list | tuple):
        try:
            arr = np.asarray(part)
        except (ValueError, TypeError):
            return None
        if arr.dtype == np.bool_:
            return ("mask", arr, arr.ndim) if arr.ndim else ("newaxis", None, 0)
        if arr.dtype.kind in "iu":
            return ("int", int(arr), 1) if arr.ndim == 0 else ("ints", arr, 1)
        if arr.size == 0 and isinstance(part, list | tuple):
            return ("ints", arr, 1)  # [] indexes nothing
        return None
    if isinstance(part, str):
        return None
    try:
        return ("int", operator.index(part), 1)
    except TypeError:
        return None


def _int_bad(dim: int, i: int, n: int) -> _Bad:
    hint = f" (negative indices count from the end: -{n} is the first element)" if i < 0 else ""
    return (dim, i if i >= 0 else i + n, f"index {i} is outside dimension {dim} of extent {n}{hint}")


def _slice_bad(dim: int, s: slice, n: int) -> _Bad | None:
    start, stop = s.start, s.stop
    if (
        s.step is None  # the common case, checked first
        and (start is None or (type(start) is int and -n <= start <= n))
        and (stop is None or (type(stop) is int and -n <= stop <= n))
    ):
        return None
    try:
        step = 1 if s.step is None else operator.index(s.step)
        start = None if s.start is None else operator.index(s.start)
        stop = None if s.stop is None else operator.index(s.stop)
    except TypeError:
        return None  # NumPy refuses it
    if step == 0:
        return None
    if step > 0:
        start_lo, start_hi, stop_lo, stop_hi = -n, n, -n, n
    else:
        start_lo, start_hi, stop_lo, stop_hi = -n, n - 1, -n - 1, n - 1
    for name, value, lo, hi in (("start", start, start_lo, start_hi), ("stop", stop, stop_lo, stop_hi)):
        if value is not None and not lo <= value <= hi:
            past = value >= 0
            element = n if past and name == "stop" and step > 0 else value if past else value + n
            where = "past the end of" if past else "before the start of"
            return (
                dim,
                element,
                f"slice {name} {value} lies {where} dimension {dim} of extent {n} "
                f"(NumPy would silently clamp it)",
            )
    return None


def _ints_bad(dim: int, arr: np.ndarray[Any, Any], n: int) -> _Bad | None:
    if arr.size == 0:
        return None
    lo = int(arr.min())
    hi = int(arr.max())
    if hi >= n:
        return (dim, hi, f"an index array holds {hi}, outside dimension {dim} of extent {n}")
    if lo < -n:
        return (dim, lo + n, f"an index array holds {lo}, outside dimension {dim} of extent {n}")
    return None


def _take_out_of_bounds(a: np.ndarray[Any, Any], indices: object, axis: Any) -> _Bad | None:
    try:
        arr = np.asarray(indices)
    except (ValueError, TypeError):
        return None
    if arr.dtype.kind not in "iu":
        return None
    if axis is None:
        n, dim = a.size, 0
    else:
        try:
            dim = operator.index(axis)
        except TypeError:
            return None
        if not -a.ndim <= dim < a.ndim:
            return None
        dim %= a.ndim
        n = a.shape[dim]
    bad = _ints_bad(dim, arr.reshape(-1), n)
    if bad is not None and axis is None:
        return (a.ndim, bad[1], bad[2].replace(f"dimension {dim} of extent", "the flattened view of size"))
    return bad


def key_text(key: object) -> str:
    """An index as written between brackets: ``:1000``, ``2, ...``."""
    if isinstance(key, _TakeKey):
        axis = "" if key.axis is None else f", axis={key.axis}"
        return f"{_part_text(key.indices)}{axis}"
    parts = key if type(key) is tuple else (key,)
    return ", ".join(_part_text(p) for p in parts)


def _part_text(part: object) -> str:
    if part is None:
        return "None"
    if part is Ellipsis:
        return "..."
    if isinstance(part, slice):
        text = f"{'' if part.start is None else part.start}:{'' if part.stop is None else part.stop}"
        return text if part.step is None else f"{text}:{part.step}"
    if isinstance(part, np.ndarray | list | tuple):
        try:
            arr = np.asarray(part)
        except (ValueError, TypeError):
            return type(part).__name__
        if arr.size <= 8:
            return repr(arr.tolist())
        return f"<{arr.dtype} array of shape {arr.shape}>"
    if isinstance(part, np.generic):
        return str(part)
    return repr(part)
