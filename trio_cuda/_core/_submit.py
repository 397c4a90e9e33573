"""Submissions, leases and the enqueue context.

Invariants:

* A :class:`Submission` runs on exactly one stream. Everything its work
  touches (arrays, kernels/modules, argument storage, staging buffers, host
  closures) is recorded on it *before* the driver call that enqueues the work.
* Every lease is released by the completion-handoff task when the
  submission's end marker has completed, never when an awaiting task returns.
* Under ``conflicts="order"``, a conflict with in-flight work on another stream
  becomes a device-side wait on that work's marker; under ``"error"`` it raises
  :class:`AccessConflictError` before anything of the *op* is enqueued: an op of
  several pieces (``zip``, ``then``, ``map``, ``shared``) is first walked by a
  :class:`Preflight`, which checks every piece's leases, enqueues and records
  nothing, and runs each ``then``/``map`` closure once, keeping its result for
  the real enqueue (``EnqueueContext.memo``). Only what comes after the output
  of a foreign step (``ops.external``), which the preflight cannot know, is
  checked piece by piece.
* Reads never conflict with reads; same-stream work needs no wait (FIFO).
* The unsafe context (``submission is None``) takes no lease, retains nothing
  and adds no wait.
"""

from __future__ import annotations

import enum
import functools
from _thread import get_ident
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, final

import numpy as np
import trio

from . import _compiled
from ._array import Allocation, AllocState, DeviceArray, h2d_source, host_layout
from ._crosscopy import cross_scope_copy
from ._driver import Finisher, Gate, Marker, MarkerState
from ._errors import AccessConflictError, CompletionUnknownError, KernelArgumentError
from ._extent import Extent, array_extent, describe, overlaps
from ._launch import KernelLaunch
from ._leases import candidates, record_lease
from ._ops import OPAQUE as OPAQUE
from ._ops import RUN, Access, DeviceOp, HostResult, StopPreflight

if TYPE_CHECKING:
    from ._launch import PreparedLaunch
    from ._scope import ResourceScope
    from ._stream import Stream


T = TypeVar("T")


class SubState(enum.Enum):
    ENQUEUING = "enqueuing"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    #: holds an export lease for a foreign consumer (see ``_export``); put in
    #: flight when the consumer releases it
    EXPORTED = "exported"


TERMINAL = frozenset({SubState.DONE, SubState.FAILED, SubState.QUARANTINED})


@final
class Submission:
    """Everything one submission retains, and how it ended."""

    __slots__ = (
        "__weakref__",
        "dirty",
        "error",
        "finishers",
        "id",
        "leases",
        "marker",
        "observed",
        "op",
        "output",
        "owners",
        "scope",
        "state",
        "stream",
        "unknown",
        "waiter",
    )

    def __init__(self, scope: ResourceScope, stream: Stream, sid: int, op: object) -> None:
        self.scope = scope
        self.stream = stream
        self.id = sid
        #: the op; it retains a launch's argument storage until retirement
        self.op = op
        self.state = SubState.ENQUEUING
        self.marker: Marker | None = None
        #: made on first use: a kernel launch needs none (its module is kept by
        #: the scope's function table, which unloads only after the drain)
        self.owners: list[object] | None = None
        self.finishers: list[Finisher] | None = None
        #: allocation -> strongest access; a single launch keeps its kernel
        #: launch's shared tuple of allocations instead (``take_launch_leases``)
        self.leases: dict[Allocation, Access] | tuple[Allocation, ...] = ()
        self.error: BaseException | None = None
        self.observed = False
        self.output: object = None
        #: the task parked on this submission (``Completion._observe``); the
        #: retirer reschedules it, its cancellation removes it
        self.waiter: trio.lowlevel.Task | list[trio.lowlevel.Task] | None = None
        #: True once any driver call of this submission enqueued something
        self.dirty = False
        #: set when a marker of this submission reported unknown completion
        self.unknown: BaseException | None = None

    @property
    def label(self) -> str:
        if self.op is None:
            return f"submission #{self.id}"
        text = repr(self.op)
        if len(text) > 80:
            text = text[:77] + "..."
        return f"submission #{self.id} ({text})"

    def __repr__(self) -> str:
        return f"<{self.label} on stream {self.stream.index}: {self.state.value}>"


@final
class HostStep:
    """A host closure waiting in stream order (see ``ops.host_closure``)."""

    __slots__ = ("args", "fn", "gate", "marker", "result", "submission")

    def __init__(
        self,
        submission: Submission,
        marker: Marker,
        gate: Gate,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        result: HostResult[Any],
    ) -> None:
        self.submission = submission
        self.marker = marker
        self.gate = gate
        self.fn = fn
        self.args = args
        self.result = result


def _conflict_name(held: Access, wanted: Access) -> str:
    if held is Access.WRITE and wanted is Access.READ:
        return "read-after-write"
    if held is Access.WRITE:
        return "write-after-write"
    return "write-after-read"


class _Enqueue:
    """What the tracked and the unsafe enqueue share (see ``_enqueue``)."""

    __slots__ = ("driver", "memo", "scope", "stream", "submission")

    #: a real enqueue (see :class:`Preflight`), not a graph recording
    preflight = False
    capturing = False
    unsafe = False

    def __init__(self, scope: ResourceScope, stream: Stream, submission: Submission | None) -> None:
        self.scope = scope
        self.stream = stream
        self.submission = submission
        self.driver = scope._driver
        #: what a preflight's closures returned, last first (``recall``)
        self.memo: list[object] | None = None

    def keep(self, value: object) -> object:
        return value

    def recall(self) -> object:
        """The next value a preflight kept for this enqueue (in the order it
        kept them), or ``RUN``: compute it now."""
        memo = self.memo
        return memo.pop() if memo else RUN

    # ------------------------------------------------------------------ retention
    def retain(self, obj: object) -> None:
        """Keep ``obj`` alive until the submission retired."""
        sub = self.submission
        if sub is not None:
            if sub.owners is None:
                sub.owners = [obj]
            else:
                sub.owners.append(obj)

    def on_retire(self, fn: Finisher) -> None:
        """Run ``fn`` at retirement, once the work completed successfully."""
        sub = self.submission
        if sub is not None:
            if sub.finishers is None:
                sub.finishers = [fn]
            else:
                sub.finishers.append(fn)

    def enqueued(self) -> None:
        """A driver call enqueued work: the submission must be retired
        behind a marker, even if a later piece fails."""
        sub = self.submission
        if sub is not None:
            sub.dirty = True

    def mark(self) -> int | None:
        """Before an enqueue, in a traced scope that asked for device times: a
        device timestamp (its id), else None."""
        scope = self.scope
        if scope._tracer is not None and scope._trace_timing:
            return self.driver.timing_mark(self.stream.handle)
        return None

    def traced(self, name: str, mark: int | None = None) -> None:
        """Record, in the scope's trace if it has one, the enqueue of ``name``
        (call it right after the driver call that enqueued the work; ``mark``
        is what :meth:`mark` gave before it)."""
        scope = self.scope
        tr = scope._tracer
        if tr is not None:
            sub = self.submission
            args: dict[str, Any] = {"unsafe": self.unsafe}
            if scope._trace_cmds:
                args["cmd"] = self.driver.last_command()
            if mark is not None:
                args["marks"] = (mark, self.driver.timing_mark(self.stream.handle))
            sid = None if sub is None else sub.id
            tr.emit("enqueue", name, scope._trace_id, self.stream.index, sid, args=args)

    # ------------------------------------------------------------------ leases
    def use(self, accesses: Sequence[tuple[DeviceArray, Access]], *, what: str = "argument") -> None:
        """Check, order and record leases for one piece of work, atomically:
        if this raises, no lease of the piece was taken and nothing enqueued."""
        take_leases(self.scope, self.stream, self.submission, accesses, what)

    def after(self, other: Submission | None) -> None:
        """Order this work after ``other`` (used by shared ops)."""
        sub = self.submission
        if other is None or sub is None or other is sub:
            return
        if other.state is SubState.QUARANTINED:
            raise CompletionUnknownError(f"shared op: completion of {other.label} is unknown")
        if other.state is SubState.IN_FLIGHT and other.stream is not self.stream:
            if other.marker is None:
                other.scope._completion.flush(other.stream)
                if other.marker is None:  # quarantined
                    raise CompletionUnknownError(f"shared op: completion of {other.label} is unknown")
            state = other.scope._driver.poll_marker(other.marker).state
            if state is MarkerState.UNKNOWN:
                raise CompletionUnknownError(f"shared op: completion of {other.label} is unknown")
            if state is not MarkerState.PENDING:
                return  # completed: nothing to wait for
            self.driver.wait_marker(self.stream.handle, other.marker)
            self.enqueued()
            tr = self.scope._tracer
            if tr is not None:
                tr.emit(
                    "wait",
                    "wait",
                    self.scope._trace_id,
                    self.stream.index,
                    sub.id,
                    args={"on": other.id, "on_stream": other.stream.index, "what": "shared op"},
                )

    # ------------------------------------------------------------------ work
    def launch(self, prepared: PreparedLaunch, accesses: Sequence[tuple[DeviceArray, Access]]) -> None:
        function = self.scope._kernel_function(prepared)
        self.use(accesses, what=prepared.kernel.name)
        sub = self.submission
        if sub is not None:
            self.retain(prepared)  # the argument storage (the module: the scope's table)
        mark = self.mark()
        self.driver.launch(self.stream.handle, function, prepared)
        if sub is not None:
            sub.dirty = True
        if self.scope._tracer is not None:
            self.traced(prepared.kernel.name, mark)

    def copy(self, dst: object, src: object) -> None:
        d = self.driver
        h = self.stream.handle
        mark = self.mark()
        if isinstance(dst, DeviceArray) and isinstance(src, DeviceArray):
            if dst._alloc.scope is not self.scope or src._alloc.scope is not self.scope:
                cross_scope_copy(self, dst, src)  # another scope's memory: see _crosscopy
                return
            self.use([(src, Access.READ), (dst, Access.WRITE)], what="copy")
            d.copy_d2d(h, dst.ptr, src.ptr, dst.nbytes)
        elif isinstance(dst, DeviceArray):
            assert isinstance(src, np.ndarray)
            host = h2d_source(dst, src)
            self.use([(dst, Access.WRITE)], what="copy: dst")
            token = d.copy_h2d(h, dst.ptr, host)
            if token is not None:
                self.retain(token)
        else:
            assert isinstance(dst, np.ndarray)
            assert isinstance(src, DeviceArray)
            target = host_layout(src, dst)
            tmp: np.ndarray[Any, Any] | None = None
            if target is None:
                if self.unsafe:
                    raise ValueError(
                        f"copy: dst: the unsafe path needs a host array contiguous in the device "
                        f"array's order ({src._order}), got strides {dst.strides}"
                    )
                tmp = np.empty(src.shape, src.dtype, order=src._order)
                target = host_layout(src, tmp)
                assert target is not None
            self.use([(src, Access.READ)], what="copy: src")
            self.retain(dst)
            fin = d.copy_d2h(h, target, src.ptr, direct=self.unsafe)
            if fin is not None:
                self.on_retire(fin)
            if tmp is not None:
                self.on_retire(functools.partial(np.copyto, dst, tmp))
        self.enqueued()
        if self.scope._tracer is not None:
            self.traced("copy", mark)

    def fill(self, arr: DeviceArray, pattern: bytes) -> None:
        self.use([(arr, Access.WRITE)], what="fill")
        mark = self.mark()
        self.driver.fill(self.stream.handle, arr.ptr, pattern, arr.size)
        self.enqueued()
        if self.scope._tracer is not None:
            self.traced("fill", mark)

    def host_step(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> HostResult[Any]:
        sub = self.submission
        assert sub is not None
        kept = self.recall()  # the result a preflight handed to later closures
        result: HostResult[Any] = kept if isinstance(kept, HostResult) else HostResult()
        self.retain(fn)
        self.retain(args)
        self.scope._completion.flush(self.stream)  # earlier submissions' marker must precede the gate
        marker = self.driver.record_marker(self.stream.handle)
        gate = self.driver.create_gate(self.stream.handle)
        self.enqueued()
        if self.scope._tracer is not None:
            self.traced("host_closure")
        self.stream._pending.append(HostStep(sub, marker, gate, fn, args, result))
        self.scope._completion.host_steps += 1
        return result


@final
class EnqueueContext(_Enqueue):
    """The tracked enqueue (``EnqueueTarget``): one per submission. Every
    lease, owner and finisher is recorded on the submission before the work
    is enqueued."""

    __slots__ = ()

    def __init__(self, scope: ResourceScope, stream: Stream, submission: Submission) -> None:
        super().__init__(scope, stream, submission)


@final
class UnsafeEnqueue(_Enqueue):
    """``unsafe.async_on`` (``EnqueueTarget``): the arrays are checked, but no
    lease is taken, nothing is retained and no wait is added; the caller
    keeps everything alive and orders every access."""

    __slots__ = ()

    unsafe = True

    def __init__(self, scope: ResourceScope, stream: Stream) -> None:
        super().__init__(scope, stream, None)

    def retain(self, obj: object) -> None:
        pass

    def on_retire(self, fn: Finisher) -> None:
        pass

    def after(self, other: Submission | None) -> None:
        pass

    def host_step(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> HostResult[Any]:
        raise TypeError(
            "host_closure cannot run through unsafe.async_on: it needs the scope's "
            "completion-handoff task; submit it with scope.run() or scope.submit()"
        )


@final
class Preflight:
    """A dry run of an op's enqueue under ``conflicts="error"``, so that a
    conflict anywhere in an op of several pieces is refused before any piece
    is enqueued (see the module invariants). It has the enqueue context's
    interface: every lease is checked (``take_leases(check=True)``), nothing
    is recorded, retained or enqueued. Closures run here, once; their results
    go to ``memo`` for the real enqueue."""

    __slots__ = ("driver", "memo", "scope", "shared", "stream")

    preflight = True
    capturing = False
    unsafe = False
    submission = None

    def __init__(self, scope: ResourceScope, stream: Stream) -> None:
        self.scope = scope
        self.stream = stream
        self.driver = scope._driver  # never called: a preflight enqueues nothing
        self.memo: list[object] = []
        #: shared ops not executed yet, walked once: their outputs
        self.shared: dict[object, object] = {}

    def keep(self, value: object) -> object:
        self.memo.append(value)
        return value

    def recall(self) -> object:
        return RUN  # a preflight runs each closure itself (``keep``)

    def retain(self, obj: object) -> None:
        pass

    def on_retire(self, fn: Finisher) -> None:
        pass

    def enqueued(self) -> None:
        pass

    def mark(self) -> None:
        return None

    def traced(self, name: str, mark: int | None = None) -> None:
        pass

    def use(self, accesses: Sequence[tuple[DeviceArray, Access]], *, what: str = "argument") -> None:
        take_leases(self.scope, self.stream, None, accesses, what, check=True)

    def after(self, other: Submission | None) -> None:
        if other is not None and other.state is SubState.QUARANTINED:
            raise CompletionUnknownError(f"shared op: completion of {other.label} is unknown")

    def launch(self, prepared: PreparedLaunch, accesses: Sequence[tuple[DeviceArray, Access]]) -> None:
        self.use(accesses, what=prepared.kernel.name)

    def copy(self, dst: object, src: object) -> None:
        if isinstance(dst, DeviceArray) and isinstance(src, DeviceArray):
            foreign = dst._alloc.scope is not self.scope or src._alloc.scope is not self.scope
            accesses = ((src, Access.READ), (dst, Access.WRITE))
            take_leases(self.scope, self.stream, None, accesses, "copy", foreign=foreign, check=True)
        elif isinstance(dst, DeviceArray):
            assert isinstance(src, np.ndarray)
            h2d_source(dst, src)
            self.use([(dst, Access.WRITE)], what="copy: dst")
        else:
            assert isinstance(src, DeviceArray)
            self.use([(src, Access.READ)], what="copy: src")

    def fill(self, arr: DeviceArray, pattern: bytes) -> None:
        self.use([(arr, Access.WRITE)], what="fill")

    def host_step(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> HostResult[Any]:
        result: HostResult[Any] = HostResult()
        self.memo.append(result)
        return result


def preflight(scope: ResourceScope, stream: Stream, op: DeviceOp[Any]) -> list[object]:
    """Walk ``op`` (a DeviceOp of several pieces) with a :class:`Preflight`;
    raise what its real enqueue would raise before enqueueing anything, or
    return the kept closure results for ``EnqueueContext.memo``."""
    ctx = Preflight(scope, stream)
    try:
        op._enqueue(ctx)
    except StopPreflight:
        pass
    ctx.memo.reverse()  # recall() pops from the end
    return ctx.memo


def is_quarantined(alloc: Allocation) -> bool:
    return alloc.state is AllocState.QUARANTINED


def take_leases(
    scope: ResourceScope,
    stream: Stream,
    sub: Submission | None,
    accesses: Sequence[tuple[DeviceArray, Access]],
    what: str,
    *,
    foreign: bool = False,
    check: bool = False,
) -> None:
    """Check, order and record leases for one piece of work on ``stream``,
    atomically: if this raises, no lease was taken and nothing enqueued.
    ``sub`` None (the unsafe path) only checks the arrays; with ``check``
    (a :class:`Preflight`) it checks conflicts too, as for a new submission,
    and records nothing. ``foreign=True`` (cross-scope
    copies, see ``_crosscopy``) accepts live arrays of other scopes; their leases
    are recorded on their allocations as any other, and conflicts with the
    other scope's in-flight work become device-side waits on its markers.

    Each lease covers the byte extent of the view it is taken through: only
    in-flight work on another stream whose extent overlaps it conflicts."""
    waits: dict[int, Submission] | None = None
    write = Access.WRITE
    extents: list[Extent] = []
    for arr, access in accesses:
        alloc = arr._alloc
        if arr._closed or alloc.state is not AllocState.LIVE or (alloc.scope is not scope and not foreign):
            arr._check_usable(what)
            raise KernelArgumentError(
                f"{what}: expected an array of this scope, got one of another scope ({arr!r})"
            )
        if access is write and arr._readonly:
            raise KernelArgumentError(f"{what}: write access to a read-only array ({arr!r})")
        if sub is None and not check:
            continue
        ext = arr._extent
        extents.append(ext)
        if not ext:
            continue
        for w, wext in candidates(alloc, True, ext):
            if w is not sub and w.stream is not stream and overlaps(wext, ext):
                waits = _conflict(scope, stream, waits, arr, w, write, access, what, wext)
        if access is write:
            for r, rext in candidates(alloc, False, ext):
                if r is not sub and r.stream is not stream and overlaps(rext, ext):
                    waits = _conflict(scope, stream, waits, arr, r, Access.READ, access, what, rext)
    if sub is None:
        return
    if waits:
        _issue_waits(scope, stream, sub, waits, what)
    leases = sub.leases
    if type(leases) is not dict:
        assert not leases, "a single launch's leases are taken once"
        leases = sub.leases = {}
    for (arr, access), ext in zip(accesses, extents):
        alloc = arr._alloc
        prev = leases.get(alloc)
        if prev is None:
            leases[alloc] = access
            alloc.active += 1
        elif prev is not access and access is write:
            leases[alloc] = access
        record_lease(alloc, sub, access, ext)


def _issue_waits(
    scope: ResourceScope, stream: Stream, sub: Submission, waits: dict[int, Submission], what: str
) -> None:
    """Make ``stream`` wait, device-side, for each of ``waits`` (in-flight
    work of other streams, each behind its marker), for ``sub``."""
    wait_marker = scope._driver.wait_marker
    handle = stream.handle
    for other in waits.values():
        assert other.marker is not None
        wait_marker(handle, other.marker)
    sub.dirty = True
    tr = scope._tracer
    if tr is not None:
        for other in waits.values():
            tr.emit(
                "wait",
                "wait",
                scope._trace_id,
                stream.index,
                sub.id,
                args={"on": other.id, "on_stream": other.stream.index, "what": what},
            )


def _unknown(what: str, arr: DeviceArray, other: Submission) -> CompletionUnknownError:
    return CompletionUnknownError(
        f"{what}: completion of {other.label} on stream {other.stream.index}, which uses {arr!r}, "
        f"could not be established; work that touches its memory is refused (nothing was enqueued)"
    )


def _conflict(
    scope: ResourceScope,
    stream: Stream,
    waits: dict[int, Submission] | None,
    arr: DeviceArray,
    other: Submission,
    held: Access,
    access: Access,
    what: str,
    held_ext: Extent = (),
) -> dict[int, Submission] | None:
    """``other`` (in-flight, another stream) conflicts with this access:
    note a device-side wait, or raise under ``conflicts="error"``."""
    if other.state is SubState.EXPORTED:
        exports = other.scope._extensions.exports
        assert exports is not None, "an exported submission comes from the scope's exports"
        other = exports.conflict(other, arr, access, what)  # raises unless released
        if other.stream is stream:
            return waits
    if other.state is SubState.QUARANTINED:
        raise _unknown(what, arr, other)
    if other.state is not SubState.IN_FLIGHT or (waits is not None and other.id in waits):
        return waits
    marker = other.marker
    owner = other.scope  # another scope's work, for cross-scope copies (``_crosscopy``)
    if marker is None:
        owner._completion.flush(other.stream)
        if other.marker is None:  # recording the marker failed: quarantined
            raise _unknown(what, arr, other)
    else:
        state = owner._driver.poll_marker(marker).state
        if state is MarkerState.UNKNOWN:  # not quarantined yet, but it will be
            raise _unknown(what, arr, other)
        if state is not MarkerState.PENDING:
            return waits  # completed; it is retired soon
    if scope._conflicts == "error":
        raise AccessConflictError(
            f"{what}: {_conflict_name(held, access)} conflict on {arr!r}: in-flight "
            f"{other.label} on stream {other.stream.index} holds a "
            f"{'write' if held is Access.WRITE else 'read'} lease on {describe(held_ext)} of its allocation, "
            f"which overlaps this access ({describe(array_extent(arr))}); this work targets "
            f"stream {stream.index} (conflicts='error')"
        )
    if waits is None:
        waits = {}
    waits[other.id] = other
    return waits


#: the access-plan fast path of ``take_launch_leases`` (tests turn it off to
#: check that both paths agree)
FAST_LEASES = True

#: the compiled common case of that fast path (``_claunch.take_whole``: a
#: simple plan, other streams' leases in its way ordered as
#: ``_order_conflicts`` orders them), where the compiled paths are used
#: (``_compiled``); None runs it in Python (tests compare both)
take_whole: Callable[..., bool] | None = None
if _compiled.ext is not None:
    _compiled.ext.configure_leases(Submission, Allocation)
    _compiled.ext.configure_order(
        {"IN_FLIGHT": SubState.IN_FLIGHT, "EXPORTED": SubState.EXPORTED, "QUARANTINED": SubState.QUARANTINED}
        | {"PENDING": MarkerState.PENDING, "UNKNOWN": MarkerState.UNKNOWN, "_unknown": _unknown}
    )
    take_whole = _compiled.ext.take_whole


#: (allocations, each once; whether every access is a whole allocation of
#: its own): a launch keeps them in two slots (``_lease_plan``,
#: ``_lease_simple``); each access's allocation and extent are its array's
#: (``_alloc``, ``_extent``, both fixed when the handle was made)
LeasePlan = tuple[tuple[Allocation, ...], bool]

#: a lease in the way of a launch: (the launch's array, the other stream's
#: submission, the access it holds, the launch's access, the extent it holds)
_Conflict = tuple[DeviceArray, Submission, Access, Access, Extent]


def launch_lease_plan(op: KernelLaunch) -> LeasePlan:
    """``op``'s lease plan, made once and shared by its submissions (each
    array's extent, and whether it is its whole allocation, come from the
    handle: ``DeviceArray._create`` computed them). One object per launch
    (its allocations' tuple): a fresh launch submitted once pays for no more."""
    made = op._lease_plan
    if made is not None:
        return made, op._lease_simple
    allocs: list[Allocation] = []
    simple = True
    for arr, _ in op._accesses:
        alloc = arr._alloc
        if alloc in allocs:  # (identity: allocations do not define equality)
            simple = False
        else:
            allocs.append(alloc)
        if not arr._whole:
            simple = False
    plan = tuple(allocs)
    object.__setattr__(op, "_lease_simple", simple)
    object.__setattr__(op, "_lease_plan", plan)  # (last: a plan that is not None is whole)
    return plan, simple


def take_launch_leases(scope: ResourceScope, stream: Stream, sub: Submission, op: KernelLaunch) -> None:
    """``take_leases`` for a single kernel launch, from its lease plan: when
    every array is a live, usable array of this scope whose allocation has no
    range index, the leases are recorded with no per-submission allocation
    (``sub.leases`` is the plan's shared tuple of allocations). Leases of
    other streams in the way (a writer whose extent overlaps, or a reader
    where this launch writes) are ordered here under ``conflicts="order"``:
    each goes through ``_conflict``, the general path's own step (its marker
    flushed first if needed, polled, and a completion that cannot be
    established raised as there), in the general path's order, and the
    device-side waits are issued as there (``_issue_waits``). Anything else
    (``conflicts="error"`` with a lease in the way, an exported or
    quarantined submission in the way, an indexed lease table, a read-only,
    closed, quarantined or foreign array) takes the general path, before
    anything was flushed or enqueued; it gives the same result or raises the
    same error (``tests/core/test_lease_paths.py`` checks both agree)."""
    if FAST_LEASES:
        allocs = op._lease_plan
        if allocs is None:
            allocs, simple = launch_lease_plan(op)
        else:
            simple = op._lease_simple
        if simple and take_whole is not None and take_whole(scope, stream, sub, op._accesses, allocs):
            return
        take_launch_leases_rest(scope, stream, sub, op, allocs, simple)
    else:
        take_leases(scope, stream, sub, op._accesses, op.prepared.kernel.name)


def take_launch_leases_rest(
    scope: ResourceScope,
    stream: Stream,
    sub: Submission,
    op: KernelLaunch,
    allocs: tuple[Allocation, ...],
    simple: bool,
) -> None:
    """``take_launch_leases`` once its compiled common case declined (or is
    not in use): the fast path in Python, else the general path."""
    accesses = op._accesses
    live = AllocState.LIVE
    write = Access.WRITE
    conflicts: list[_Conflict] | None = None
    for arr, access in accesses:
        alloc = arr._alloc
        ext = arr._extent
        if arr._closed or alloc.state is not live or alloc.scope is not scope or alloc.index is not None:
            break
        if access is write and arr._readonly:
            break
        if not ext:
            continue
        writers = alloc.writers
        if writers:
            for w, wext in writers.items():
                if w.stream is not stream and (simple or overlaps(wext, ext)):
                    if conflicts is None:
                        conflicts = []
                    conflicts.append((arr, w, write, access, wext))
        if access is write:
            readers = alloc.readers
            if readers:
                for r, rext in readers.items():
                    if r.stream is not stream and (simple or overlaps(rext, ext)):
                        if conflicts is None:
                            conflicts = []
                        conflicts.append((arr, r, Access.READ, access, rext))
    else:
        if conflicts is None or _order_conflicts(scope, stream, sub, op, conflicts):
            if simple:  # whole allocations, each once: the common case
                for arr, access in accesses:
                    alloc = arr._alloc
                    ext = arr._extent
                    alloc.active += 1
                    if access is write:
                        writers = alloc.writers
                        if writers:
                            writers.clear()
                        if alloc.readers:
                            alloc.readers.clear()
                        writers[sub] = ext
                    else:
                        alloc.readers[sub] = ext
            else:
                for alloc in allocs:
                    alloc.active += 1
                for arr, access in accesses:
                    record_lease(arr._alloc, sub, access, arr._extent)
            sub.leases = allocs
            return
    take_leases(scope, stream, sub, op._accesses, op.prepared.kernel.name)


def _order_conflicts(
    scope: ResourceScope, stream: Stream, sub: Submission, op: KernelLaunch, conflicts: list[_Conflict]
) -> bool:
    """The launch fast path's cross-stream conflicts under ``conflicts="order"``:
    the device-side waits, as ``take_leases`` makes them (True), or False,
    before anything is done, where the general path must take them."""
    if scope._conflicts != "order":
        return False
    exported = SubState.EXPORTED
    quarantined = SubState.QUARANTINED
    for c in conflicts:
        state = c[1].state
        if state is exported or state is quarantined:
            return False
    what = op.prepared.kernel.name
    waits: dict[int, Submission] | None = None
    for arr, other, held, access, held_ext in conflicts:
        waits = _conflict(scope, stream, waits, arr, other, held, access, what, held_ext)
    if waits:
        _issue_waits(scope, stream, sub, waits, what)
    return True


@trio.lowlevel.enable_ki_protection
def enqueue_unsafe_py(op: DeviceOp[T], stream: Stream) -> T:
    """``unsafe.async_on``: enqueue ``op`` on ``stream`` (a Stream, checked
    by the caller) with no lease, owner or marker; only the checks that
    need no bookkeeping run. (``enqueue_unsafe`` is this, or where it was
    built the compiled one, which does a lone launch itself.)"""
    scope = stream._scope
    if type(op) is KernelLaunch:
        if scope._closing or get_ident() != scope._thread:
            scope._check_open("async_on")
        prepared = op.prepared
        ready = prepared.ready  # ``KernelTable.function_for``, inline when it hits
        if ready is not None and ready[0] is scope._functions:
            fn = ready[1]
        else:
            fn = scope._kernels.function_for(prepared)
        scope._driver.launch(stream.handle, fn, prepared)
        return op._output  # type: ignore[return-value]
    if not isinstance(op, DeviceOp):
        from ._builder import LaunchBuilder

        if isinstance(op, LaunchBuilder):
            raise TypeError(
                "op: a LaunchBuilder is inert and cannot be scheduled; call .finalize_unchecked() first"
            )
        raise TypeError(f"op: expected a DeviceOp, got {type(op).__name__}")
    scope._check_open("async_on")
    scope._kernels.load_static(op)
    out: Any = op._enqueue(UnsafeEnqueue(scope, stream))
    return out  # type: ignore[no-any-return]
