"""Foreign work inside the lifetime contract: ``ops.external`` and ``ops.after``.

Invariants:

* ``external(fn, reads=, writes=)`` takes its leases (as a kernel's: read
  leases on ``reads``, write leases on ``writes``, by byte range) before
  ``fn`` runs, and ``fn`` runs at enqueue, on the event loop, with the
  :class:`~trio_cuda.Stream` it must enqueue on. Whatever ``fn`` enqueues
  there is covered by the submission's completion marker, recorded after
  ``fn`` returns: the leases are released only when that work completed.
* ``fn`` is assumed to have enqueued something as soon as it was called, so
  that an ``fn`` that raises leaves its partial work retained behind a marker
  (rule 6), with the error raised to the submitter.
* While ``fn`` runs, exports of the scope's arrays on this thread
  (``__cuda_array_interface__``, ``__dlpack__``: ``cupy.asarray(x)``,
  ``torch.from_dlpack(x)``) are covered by the external's leases, by bytes:
  they take no lease of their own, wait for nothing and retain nothing, and a
  view that ``reads``/``writes`` do not cover is refused (see ``_export``). A
  DLPack capsule not consumed when ``fn`` returns is expired.
* ``fn`` must not block: it runs on the loop, so a synchronising call inside
  it (a ``.get()``, a ``synchronize()``) stalls every task of the program until
  the device finished. It is not an error, and nothing is freed early; it is
  slow.
* ``after(obj)`` makes the op's stream wait, device-side, for the work that
  the foreign stream had enqueued when the op was submitted (or for a foreign
  event), without blocking the host. It takes no lease and has no output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, final

from ._array import DeviceArray
from ._errors import GraphCaptureError
from ._export import enter_external, exit_external
from ._ops import OPAQUE, Access, DeviceOp

if TYPE_CHECKING:
    from ._enqueue import EnqueueTarget
    from ._stream import Stream

T = TypeVar("T")

__all__ = ["after", "external"]


def _arrays(value: object, label: str) -> tuple[DeviceArray, ...]:
    if isinstance(value, DeviceArray):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{label}: expected a DeviceArray or a sequence of them, got {type(value).__name__}")
    out = tuple(value)
    for i, a in enumerate(out):
        if not isinstance(a, DeviceArray):
            raise TypeError(
                f"{label}[{i}]: expected a DeviceArray (trio_cuda.borrow() wraps another library's "
                f"memory), got {type(a).__name__}"
            )
    return out


@final
class _External(DeviceOp[Any]):
    __slots__ = ("_accesses", "_fn")

    def __init__(self, fn: Callable[[Stream], Any], accesses: tuple[tuple[DeviceArray, Access], ...]) -> None:
        self._fn = fn
        self._accesses = accesses

    def _enqueue(self, ctx: EnqueueTarget) -> Any:
        ctx.use(self._accesses, what="ops.external")
        if ctx.preflight:  # fn runs once, at the real enqueue: its output is not known yet
            return OPAQUE
        ctx.retain(self._fn)  # its closure may hold what the foreign work uses
        mark = ctx.mark()
        ctx.enqueued()  # from here on, fn may have enqueued work: retain behind a marker
        frame = enter_external(ctx.scope, ctx.stream, self._accesses, self)
        try:
            out = self._fn(ctx.stream)
        finally:
            exit_external(frame)
        if not ctx.capturing:
            ctx.traced(f"external {getattr(self._fn, '__name__', 'fn')}", mark)
        return out

    def __repr__(self) -> str:
        return f"ops.external({getattr(self._fn, '__qualname__', self._fn)!r})"


def external(
    fn: Callable[[Stream], T],
    *,
    reads: Sequence[DeviceArray] | DeviceArray = (),
    writes: Sequence[DeviceArray] | DeviceArray = (),
) -> DeviceOp[T]:
    """A DeviceOp that runs another library's GPU work on a trio_cuda stream,
    under leases.

    At enqueue, ``fn(stream)`` is called on the event loop with the
    :class:`~trio_cuda.Stream` the op runs on; it enqueues its work there
    (``cupy.cuda.Stream.from_external(stream)``,
    ``torch.cuda.ExternalStream(stream.__cuda_stream__()[1])``, cuBLAS with
    that stream, ...) and
    returns the op's output. ``reads`` and ``writes`` are the trio_cuda arrays
    (views, or memory wrapped with :func:`trio_cuda.borrow`) the work touches:
    read leases on ``reads``, write leases on ``writes``, taken before ``fn``
    runs and released when the work completed, exactly as a kernel's.

    Inside ``fn``, the other library may wrap those arrays directly:
    ``cupy.asarray(x)``, ``torch.as_tensor(x, device="cuda")`` (the CUDA Array
    Interface) and ``torch.from_dlpack(x)`` (DLPack) export them under the
    external's leases, with no lease or wait of their own. A view is covered
    when its bytes lie inside the declared arrays' (of one allocation); one
    covered only by ``reads`` is exported read-only (the CUDA Array
    Interface's flag, which ``torch.as_tensor`` refuses: use
    ``torch.from_dlpack`` there; a versioned DLPack consumer is told; a legacy
    one is refused with ``BufferError``); an
    uncovered array of this scope raises
    :class:`~trio_cuda.AccessConflictError` naming ``reads=`` and ``writes=``.
    The consumer must enqueue on ``stream`` (DLPack refuses another consumer
    stream), and must not touch the memory it wrapped after ``fn`` returns:
    the leases end with the op's work (a DLPack capsule not consumed by then
    is expired).

    It composes like any op (``then``, ``zip``, graphs where the library's
    work can be captured). If ``fn`` raises, whatever it enqueued stays
    retained until the stream reaches the op's marker (rule 6), and the error
    reaches the caller. ``fn`` must only enqueue: a call that synchronises
    blocks the event loop until the device is done (nothing is freed early;
    everything else waits).
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable taking the stream, got {type(fn).__name__}")
    accesses = tuple((a, Access.READ) for a in _arrays(reads, "reads")) + tuple(
        (a, Access.WRITE) for a in _arrays(writes, "writes")
    )
    return _External(fn, accesses)


# --------------------------------------------------------------------------- after


def _foreign(obj: object) -> tuple[str, int]:
    """("stream", handle) or ("event", handle) for a foreign stream or event."""
    proto = getattr(type(obj), "__cuda_stream__", None)
    if proto is not None:
        got = obj.__cuda_stream__()  # type: ignore[attr-defined]
        if not (isinstance(got, tuple) and len(got) == 2 and got[0] == 0 and isinstance(got[1], int)):
            raise TypeError(f"obj: __cuda_stream__() must return (0, handle: int), got {got!r}")
        return "stream", got[1]
    module = type(obj).__module__ or ""
    name = type(obj).__name__
    if module.startswith("torch"):
        if hasattr(obj, "cuda_stream"):
            return "stream", int(obj.cuda_stream)
        if hasattr(obj, "cuda_event"):
            return "event", int(obj.cuda_event)
    if module.startswith("cupy") and hasattr(obj, "ptr"):
        if "Event" in name:
            return "event", int(obj.ptr)
        if "Stream" in name:
            return "stream", int(obj.ptr)
    raise TypeError(
        f"obj: expected a stream (anything with __cuda_stream__, a CuPy or Torch stream) or a CuPy or "
        f"Torch event, got {type(obj).__name__}"
    )


@final
class _After(DeviceOp[None]):
    __slots__ = ("_kind", "_label", "_obj", "_value")

    _capture_refusal = "ops.after() (a replay would wait for the foreign stream's point at capture time)"

    def __init__(self, obj: object, kind: str, value: int) -> None:
        self._obj = obj
        self._kind = kind
        self._value = value
        self._label = type(obj).__name__

    def _enqueue(self, ctx: EnqueueTarget) -> None:
        if ctx.preflight:  # it takes no lease; its output is None
            return
        if ctx.capturing:  # the backstop of the declaration above
            raise GraphCaptureError(
                "ops.after() cannot be captured into a graph: a replay would wait for the foreign "
                "stream's point at capture time"
            )
        d = ctx.driver
        if self._kind == "stream":
            fence = d.foreign_fence(self._value)
            try:
                d.wait_fence(ctx.stream.handle, fence)
            finally:
                d.drop_fence(fence)
        else:
            d.wait_foreign_event(ctx.stream.handle, self._value)
        ctx.retain(self._obj)  # the foreign stream or event outlives the wait
        ctx.enqueued()
        if ctx.scope._tracer is not None:
            ctx.traced(f"after {self._label}")

    def __repr__(self) -> str:
        return f"ops.after({self._label} 0x{self._value:x})"


def after(obj: object) -> DeviceOp[None]:
    """A DeviceOp that orders its stream after the current point of a foreign
    stream (anything with ``__cuda_stream__``, a CuPy or Torch stream, or
    another scope's :class:`~trio_cuda.Stream`) or after a CuPy or Torch
    event: ``await gpu.run(ops.after(torch.cuda.current_stream()))`` awaits
    everything Torch enqueued so far, without blocking the event loop. The
    point is taken when the op is submitted. It takes no lease; its output is
    None."""
    kind, value = _foreign(obj)
    if kind == "event" and value == 0:  # Torch creates its CUDA event at the first record()
        raise ValueError(f"obj: expected a recorded event, got a {type(obj).__name__} never recorded")
    return _After(obj, kind, value)
