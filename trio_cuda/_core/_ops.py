"""Lazy device operations (DeviceOps) and their combinators.

Invariants:

* A DeviceOp describes work; building one enqueues nothing and retains nothing.
* Submitting an op calls ``_enqueue(ctx)`` once, on one stream. ``_enqueue``
  retains what the work touches through ``ctx`` *before* enqueueing it, and
  returns the op's output (a handle that is valid in stream order).
* ``then`` closures and ``map`` functions run on the host at submission time,
  with the output handle of the previous op; the work they return is enqueued
  on the same stream, after it.
* A ``shared()`` op executes once; later submissions reuse its output and
  order after it device-side when they run on another stream.
* An op that does no work of its own (a bare ``DeviceOp()``, or a subclass
  that does not implement ``_enqueue``) is refused with a ``TypeError``
  before anything is enqueued: by the combinators when they are built, and
  by its ``_enqueue`` (the first thing a submission calls) otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast, overload

import numpy as np

from ._final import final

if TYPE_CHECKING:
    from ._array import DeviceArray
    from ._enqueue import EnqueueTarget
    from ._submit import Submission

T = TypeVar("T")
U = TypeVar("U")
#: an op's output type: an op of a subtype's output is an op of the type's
T_co = TypeVar("T_co", covariant=True)
A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")
E = TypeVar("E")
F = TypeVar("F")
#: the destination of ``copy``, which is its output
Dst = TypeVar("Dst", bound="DeviceArray | np.ndarray[Any, Any]")


class Access(enum.Enum):
    """Lease mode: ``READ`` is shared, ``WRITE`` is exclusive."""

    READ = "read"
    WRITE = "write"


class DeviceOp(Generic[T_co]):
    """Lazy GPU work with an output of type ``T`` (covariant: an op whose
    output is a ``bool`` is also an op whose output is an ``int``).

    Submit it with ``await scope.run(op)`` or ``scope.submit(op)``; inside a
    scope, ``await op`` means ``await current_scope.run(op)``.
    """

    __slots__ = ()

    #: why this kind of op cannot be captured into a graph (None: it can);
    #: see :func:`capture_refusal`
    _capture_refusal: ClassVar[str | None] = None

    def _enqueue(self, ctx: EnqueueTarget) -> T_co:
        raise not_an_op("op", self)

    def then(self, fn: Callable[[T_co], DeviceOp[U]]) -> DeviceOp[U]:
        """Chain dependent work on the same stream: ``fn(output)`` runs at
        submission and returns the next DeviceOp."""
        check_op("then: self", self)
        if not callable(fn):
            raise TypeError(f"then: expected a callable returning a DeviceOp, got {fn!r}")
        return _Then(self, fn)

    def map(self, fn: Callable[[T_co], U]) -> DeviceOp[U]:
        """Change the output with no GPU work (``fn`` runs at submission)."""
        check_op("map: self", self)
        if not callable(fn):
            raise TypeError(f"map: expected a callable, got {fn!r}")
        return _Map(self, fn)

    def shared(self) -> DeviceOp[T_co]:
        """An op that may be used several times but executes once."""
        if isinstance(self, _Shared):
            return self
        check_op("shared: self", self)
        return _Shared(self)

    @overload
    def __await__(self: DeviceOp[HostResult[U]]) -> Generator[Any, None, U]: ...
    @overload
    def __await__(self) -> Generator[Any, None, T_co]: ...
    def __await__(self) -> Generator[Any, None, Any]:
        from ._manager import current_scope

        return current_scope().run(self).__await__()


def does_work(op: DeviceOp[Any]) -> bool:
    """True unless ``op`` is a bare ``DeviceOp()`` or of a subclass that does
    not implement ``_enqueue``."""
    return type(op)._enqueue is not DeviceOp._enqueue


def not_an_op(label: str, op: object) -> TypeError:
    """The error for something submitted as an op that is none, or does nothing."""
    if isinstance(op, DeviceOp):
        name = type(op).__name__
        got = (
            "a bare DeviceOp()"
            if type(op) is DeviceOp
            else f"{name} (a DeviceOp subclass that does not implement _enqueue)"
        )
    else:
        got = type(op).__name__
    return TypeError(
        f"{label}: expected a DeviceOp that does work (from Kernel.launch, a LaunchBuilder's "
        f"finalize_unchecked(), trio_cuda.ops or the combinators, or a subclass that implements "
        f"_enqueue), got {got}"
    )


def check_op(label: str, op: object) -> None:
    """Raise :func:`not_an_op`'s error unless ``op`` is a DeviceOp that does work."""
    if not isinstance(op, DeviceOp) or not does_work(op):
        raise not_an_op(label, op)


#: ``EnqueueTarget.recall``: nothing kept, call the closure now
RUN: Any = type("Run", (), {"__repr__": lambda self: "RUN", "__slots__": ()})()
#: the output of a foreign step in a preflight: unknown until it runs
OPAQUE: Any = type("Opaque", (), {"__repr__": lambda self: "OPAQUE", "__slots__": ()})()


class StopPreflight(Exception):
    """A closure's input is only known once a foreign step ran: the preflight
    checked what comes before; the rest is checked as it is enqueued."""


def opaque(out: object) -> bool:
    """Whether ``out`` holds the output of a foreign step, in a preflight."""
    if out is OPAQUE:
        return True
    return type(out) is tuple and any(opaque(o) for o in out)


@final
class _Value(DeviceOp[T]):
    __slots__ = ("_value",)

    def __init__(self, value: T) -> None:
        self._value = value

    def _enqueue(self, ctx: EnqueueTarget) -> T:
        return self._value

    def __repr__(self) -> str:
        return f"ops.value({self._value!r})"


@final
class _Then(DeviceOp[U]):
    __slots__ = ("_fn", "_op")

    def __init__(self, op: DeviceOp[T], fn: Callable[[T], DeviceOp[U]]) -> None:
        self._op = op
        self._fn = fn

    def _enqueue(self, ctx: EnqueueTarget) -> U:
        out = self._op._enqueue(ctx)
        if ctx.preflight:  # conflicts="error": run the closure once, now (see _submit.Preflight)
            if opaque(out):
                raise StopPreflight
            nxt = ctx.keep(self._fn(out))
        else:
            nxt = ctx.recall()
            if nxt is RUN:
                nxt = self._fn(out)
        if not isinstance(nxt, DeviceOp):
            raise TypeError(
                f"then: the closure {self._fn!r} must return a DeviceOp, got {type(nxt).__name__}"
            )
        if not does_work(nxt):
            raise not_an_op(f"then: the closure {self._fn!r}: its result", nxt)
        return cast("DeviceOp[U]", nxt)._enqueue(ctx)

    def __repr__(self) -> str:
        return f"{self._op!r}.then({self._fn!r})"


@final
class _Map(DeviceOp[U]):
    __slots__ = ("_fn", "_op")

    def __init__(self, op: DeviceOp[T], fn: Callable[[T], U]) -> None:
        self._op = op
        self._fn = fn

    def _enqueue(self, ctx: EnqueueTarget) -> U:
        out = self._op._enqueue(ctx)
        if ctx.preflight:  # run it once, now, unless its input is not known yet
            return ctx.keep(OPAQUE if opaque(out) else self._fn(out))  # type: ignore[return-value]
        kept = ctx.recall()
        return self._fn(out) if kept is RUN or kept is OPAQUE else kept  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"{self._op!r}.map({self._fn!r})"


@final
class _Zip(DeviceOp[tuple[Any, ...]]):
    __slots__ = ("_ops",)

    def __init__(self, ops: tuple[DeviceOp[Any], ...]) -> None:
        self._ops = ops

    def _enqueue(self, ctx: EnqueueTarget) -> tuple[Any, ...]:
        return tuple(op._enqueue(ctx) for op in self._ops)

    def __repr__(self) -> str:
        return f"zip({', '.join(map(repr, self._ops))})"


# Typed for up to six ops; seven or more, or a starred sequence, give
# ``tuple[Any, ...]``. (The fallback takes seven or more so that a mismatch in a
# call of up to six is reported, not absorbed by the fallback.)
@overload
def zip() -> DeviceOp[tuple[()]]: ...  # noqa: A001 - public name fixed
@overload
def zip(a: DeviceOp[A], /) -> DeviceOp[tuple[A]]: ...  # noqa: A001
@overload
def zip(a: DeviceOp[A], b: DeviceOp[B], /) -> DeviceOp[tuple[A, B]]: ...  # noqa: A001
@overload
def zip(a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], /) -> DeviceOp[tuple[A, B, C]]: ...  # noqa: A001
@overload
def zip(  # noqa: A001
    a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], d: DeviceOp[D], /
) -> DeviceOp[tuple[A, B, C, D]]: ...
@overload
def zip(  # noqa: A001
    a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], d: DeviceOp[D], e: DeviceOp[E], /
) -> DeviceOp[tuple[A, B, C, D, E]]: ...
@overload
def zip(  # noqa: A001
    a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], d: DeviceOp[D], e: DeviceOp[E], f: DeviceOp[F], /
) -> DeviceOp[tuple[A, B, C, D, E, F]]: ...
@overload
def zip(  # noqa: A001
    a: DeviceOp[Any],
    b: DeviceOp[Any],
    c: DeviceOp[Any],
    d: DeviceOp[Any],
    e: DeviceOp[Any],
    f: DeviceOp[Any],
    g: DeviceOp[Any],
    /,
    *ops: DeviceOp[Any],
) -> DeviceOp[tuple[Any, ...]]: ...
def zip(*ops: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]:  # noqa: A001 - public name fixed
    """Run independent ops in one submission; the output is the tuple of
    their outputs (typed element by element for up to six ops). A host
    closure's element is typed, and passed to ``then``/``map``, as its
    :class:`HostResult`; ``run`` and ``wait`` return the tuple with the
    closure's value in its place."""
    for i, op in enumerate(ops):
        if not isinstance(op, DeviceOp):
            raise TypeError(f"zip: argument {i}: expected a DeviceOp, got {type(op).__name__}")
        check_op(f"zip: argument {i}", op)
    return _Zip(tuple(ops))


@final
class _Shared(DeviceOp[T]):
    __slots__ = ("_done", "_op", "_out", "_submission")

    def __init__(self, op: DeviceOp[T]) -> None:
        self._op = op
        self._done = False
        self._out: Any = None
        self._submission: Submission | None = None

    def _enqueue(self, ctx: EnqueueTarget) -> T:
        if not self._done:
            if ctx.preflight:  # walked once per preflight, as the real enqueue runs it once
                seen: dict[object, Any] = ctx.shared  # type: ignore[attr-defined]
                if self not in seen:
                    seen[self] = self._op._enqueue(ctx)
                return seen[self]  # type: ignore[no-any-return]
            out = self._op._enqueue(ctx)
            self._out = out
            self._submission = ctx.submission
            self._done = True
            return out
        ctx.after(self._submission)
        return self._out  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"{self._op!r}.shared()"


# --------------------------------------------------------------------------- helpers


def value(x: T) -> DeviceOp[T]:
    """An op that does no GPU work and outputs ``x``."""
    return _Value(x)


@final
class _Copy(DeviceOp[Dst]):
    __slots__ = ("_dst", "_src")

    def __init__(self, dst: Dst, src: object) -> None:
        self._dst = dst
        self._src = src

    def _enqueue(self, ctx: EnqueueTarget) -> Dst:
        ctx.copy(self._dst, self._src)
        return self._dst

    def __repr__(self) -> str:
        return f"ops.copy({self._dst!r}, {self._src!r})"


def copy(dst: Dst, src: DeviceArray | np.ndarray[Any, Any]) -> DeviceOp[Dst]:
    """Copy ``src`` into ``dst``: device to device, host to device or device to
    host (host arrays are NumPy arrays). Shapes and dtypes must match. The
    output is ``dst``; a host ``dst`` is filled once the op completed."""
    from ._array import DeviceArray, check_copy

    check_copy(dst, src)
    if not isinstance(dst, DeviceArray) and not isinstance(src, DeviceArray):
        raise TypeError("copy: at least one of dst and src must be a DeviceArray")
    return _Copy(dst, src)


@final
class _Fill(DeviceOp["DeviceArray"]):
    __slots__ = ("_arr", "_pattern")

    def __init__(self, arr: DeviceArray, pattern: bytes) -> None:
        self._arr = arr
        self._pattern = pattern

    def _enqueue(self, ctx: EnqueueTarget) -> DeviceArray:
        ctx.fill(self._arr, self._pattern)
        return self._arr

    def __repr__(self) -> str:
        return f"ops.fill({self._arr!r})"


@final
class _ZeroBytes(DeviceOp["DeviceArray"]):
    """Set every byte of ``arr`` to zero (any dtype; used by ``scope.zeros``)."""

    __slots__ = ("_arr",)

    def __init__(self, arr: DeviceArray) -> None:
        self._arr = arr

    def _enqueue(self, ctx: EnqueueTarget) -> DeviceArray:
        arr = self._arr
        ctx.use([(arr, Access.WRITE)], what="zeros")
        if ctx.preflight:
            return arr
        mark = ctx.mark()
        ctx.driver.fill(ctx.stream.handle, arr.ptr, b"\x00", arr.nbytes)
        ctx.enqueued()
        ctx.traced("fill", mark)
        return arr

    def __repr__(self) -> str:
        return f"zeros({self._arr!r})"


def fill(arr: DeviceArray, x: object) -> DeviceOp[DeviceArray]:
    """Set every element of ``arr`` to ``x`` (cast to ``arr.dtype``). The
    element size must be 1, 2, 4 or 8 bytes."""
    from ._array import DeviceArray

    if not isinstance(arr, DeviceArray):
        raise TypeError(f"fill: arr: expected a DeviceArray, got {type(arr).__name__}")
    arr._check_writable("fill: arr")
    return _Fill(arr, fill_pattern(arr.dtype, x))


def fill_pattern(dtype: np.dtype[Any], x: object) -> bytes:
    """The bytes ``fill`` repeats: ``x`` checked and cast to ``dtype``."""
    from ._params import _convert_scalar

    if dtype.fields is not None:
        raise TypeError(f"fill: arr: expected a non-structured dtype, got the struct dtype {dtype}")
    if dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(
            f"fill: arr: expected an element size of 1, 2, 4 or 8 bytes, got dtype {dtype} "
            f"({dtype.itemsize} bytes)"
        )
    scalar = _convert_scalar("fill: x", dtype, x)
    return np.asarray(scalar, dtype=dtype).tobytes()


@final
class HostResult(Generic[T]):
    """The result of an ``ops.host_closure``; ``value`` is set once the
    closure ran (in stream order). Awaiting the op returns the value itself."""

    __slots__ = ("_set", "_value")

    def __init__(self) -> None:
        self._set = False
        self._value: Any = None

    @property
    def ready(self) -> bool:
        """True once the closure ran."""
        return self._set

    @property
    def value(self) -> T:
        """The closure's return value (after it ran)."""
        if not self._set:
            raise RuntimeError("the host closure has not run yet")
        return self._value  # type: ignore[no-any-return]

    def _resolve(self, value: object) -> None:
        self._value = value
        self._set = True

    def __repr__(self) -> str:
        return f"<HostResult {'ready' if self._set else 'pending'}>"


@final
class _HostClosure(DeviceOp[HostResult[T]]):
    __slots__ = ("_args", "_fn")

    _capture_refusal = "ops.host_closure (it needs the scope's completion handoff at every replay)"

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self._fn = fn
        self._args = args

    def _enqueue(self, ctx: EnqueueTarget) -> HostResult[T]:
        return ctx.host_step(self._fn, self._args)

    def __repr__(self) -> str:
        return f"ops.host_closure({self._fn!r})"


def host_closure(fn: Callable[..., T], *args: object) -> DeviceOp[HostResult[T]]:
    """Run ``fn(*args)`` on the Trio loop thread, in stream order: work before
    it has completed when it runs, and work after it starts once it returned.
    If ``fn`` raises, the submission fails with that error, and the stream is
    still released (later work runs)."""
    if not callable(fn):
        raise TypeError(f"host_closure: fn: expected a callable, got {fn!r}")
    return _HostClosure(fn, args)


#: an ``ops.copy`` into host memory cannot be captured
_HOST_COPY_REFUSAL = (
    "ops.copy to a host array (a replay's host copy would race with the next replay; "
    "copy results out with gpu.to_host after the replay)"
)


def capture_refusal(op: DeviceOp[Any]) -> str | None:
    """Why ``op`` cannot be captured into a graph, as far as that is known
    before it runs (the parts of a ``zip``, the op under a ``map`` or a
    ``shared()`` not yet executed, the first part of a ``then``); None if
    nothing declared so. What a ``then`` closure returns is refused by the
    recorder when the capture reaches it."""
    from ._array import DeviceArray

    stack: list[DeviceOp[Any]] = [op]
    while stack:
        cur = stack.pop()
        reason = cur._capture_refusal
        if reason is not None:
            return reason
        if isinstance(cur, _Copy) and not isinstance(cur._dst, DeviceArray):
            return _HOST_COPY_REFUSAL
        if isinstance(cur, _Zip):
            stack.extend(reversed(cur._ops))
        elif isinstance(cur, _Then | _Map) or (isinstance(cur, _Shared) and not cur._done):
            stack.append(cur._op)
    return None


def resolve_output(out: object) -> object:
    """Replace host results by their values (in tuples too)."""
    if isinstance(out, HostResult):
        return out.value if out.ready else None
    if type(out) is tuple:
        return tuple(resolve_output(o) for o in out)
    return out


#: ops of several pieces: under ``conflicts="error"`` they are preflighted
#: (see ``_submit.Preflight``) so that no piece is enqueued if one conflicts
COMPOSITE = frozenset({_Then, _Map, _Zip, _Shared})


class _Alloc(DeviceOp[Any]):
    """What a scheduling policy is asked to place for an allocation (never submitted)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "allocation"


ALLOC_OP = _Alloc()
