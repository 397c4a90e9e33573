"""Exports: leases held on behalf of foreign consumers (DLPack, CUDA Array Interface).

An export is a lease in the allocation's ordinary lease table, taken by a
submission that stays in the ``EXPORTED`` state while a foreign consumer may
use the memory, and is put in flight, behind a fence on the consumer's work,
when the consumer releases it.

Invariants:

* Opening an export takes a read lease (read-only handle) or a write lease
  (writable handle) on the exported view's bytes exactly as a submission
  would: earlier conflicting work on
  other streams becomes a device-side wait on the export's stream, and the
  consumer's stream is made to wait, device-side, for that stream (DLPack), or
  the exported ``stream`` names it (CAI). Nothing blocks the host.
* While an export is live, trio_cuda work that conflicts with its lease raises
  :class:`~trio_cuda.AccessConflictError` (under either ``conflicts`` mode):
  work the consumer has not enqueued yet cannot be waited for. Reads under a
  read export never conflict.
* A release may be requested from any thread (a DLPack deleter); it only
  takes a fence and hands the export to the Trio loop. The fence is an event
  on the consumer's stream where that stream surely still exists (the
  simulator's streams, CUDA's legacy and per-thread default streams), and
  otherwise a device-wide one, which on CUDA is a context synchronisation run
  in a worker thread, never on the loop: an awaited access that conflicts
  with a released export waits for it (``finish_releases``), a synchronous
  one raises ``AccessConflictError``. The fence is taken before the export is
  published as releasing. The export's stream waits for the fence; then the
  submission goes in flight and retires like any other. Its lease, and the
  memory, are released only at that retirement.
* A release is finished on the loop soon after it was requested
  (``run_sync_soon``), never inside the consumer's call: a deleter may run on
  any thread, or inside a garbage collection anywhere in the runtime. A
  DLPack capsule dropped unconsumed is released by the scope's sweep
  (``_dlpack.sweep_dropped``), which runs on the loop where the runtime's
  state may change; there the release is finished at once (its fence needing
  no blocking call, and no submission of the scope being enqueued), so that
  what the sweep's caller reports next (``statistics()``) already counts it
  in flight.
* Scope exit finishes released exports (within ``drain_timeout``) and
  abandons the others: an export still held by its consumer, or not finished
  in time, has its memory quarantined (never freed) with a ResourceWarning.
* An export whose consumer's work cannot be fenced keeps its lease forever:
  its memory is quarantined, never freed.

Inside an ``ops.external`` fn (its :class:`ExternalFrame`, innermost on this
thread, of the array's scope):

* An export of a view whose bytes the external's ``writes`` cover is
  writable; one whose bytes ``reads`` or ``writes`` cover only together, or
  ``reads`` alone, is read-only (a read-only handle always is). Coverage is by
  bytes of one allocation, as leases are. Any other array of that scope is
  refused with :class:`~trio_cuda.AccessConflictError` naming ``reads=`` and
  ``writes=``; nothing is taken.
* Such an export takes no lease, opens no :class:`Export` and retains
  nothing: the external's own leases cover the consumer's work, which must be
  enqueued on the external's stream (after its lease waits, FIFO). So the CUDA
  Array Interface names no ``stream`` (a consumer would otherwise synchronise
  the host on it), and DLPack accepts only that stream (or -1) as the
  consumer's: nothing is waited for or fenced.
* It ends with the submission: a DLPack capsule not consumed when fn returns
  (or raises) is expired; a capsule consumed, or a CAI dict, used after that
  is the caller's responsibility, as with ``unsafe.cuda_view``.
* Arrays of another scope are exported as anywhere else (their own lease, in
  their own scope); outside an external, an export while the array's scope is
  enqueuing (a then/map closure) is refused with ``RuntimeError``.
"""

from __future__ import annotations

import enum
import threading
import warnings
from typing import TYPE_CHECKING, Any, final

import trio

from ._dlpack import UNCONSUMED, expire_unconsumed, sweep_dropped
from ._errors import AccessConflictError, CompletionUnknownError
from ._extent import EMPTY, Extent, array_extent, covers, describe, union
from ._leases import overlapping
from ._ops import Access, DeviceOp
from ._submit import TERMINAL, Submission, SubState, take_leases

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._array import Allocation, DeviceArray
    from ._scope import ResourceScope
    from ._stream import Stream


class ExportState(enum.Enum):
    LIVE = "live"
    FENCING = "fencing"  #: the consumer is releasing it on its thread (taking the fence)
    RELEASING = "releasing"  #: the consumer released it; the loop has not finished it yet
    RELEASED = "released"
    ABANDONED = "abandoned"  #: still held at scope exit: its memory is quarantined


#: ``consumer`` value of an export whose consumer stream is unknown (CAI)
UNKNOWN_STREAM = None


@final
class _ExportOp(DeviceOp[None]):
    __slots__ = ("_export",)

    def __init__(self, export: Export) -> None:
        self._export = export

    def __repr__(self) -> str:
        e = self._export
        return f"{e.kind} export ({e.access.value}) of {e.label}"


@final
class ExportRegistry:
    """The live exports of one scope (its extension object), and its
    placeholder stream for foreign consumers."""

    __slots__ = ("exports", "foreign", "scope")

    def __init__(self, scope: ResourceScope) -> None:
        from ._stream import Stream

        self.scope = scope
        self.exports: dict[Export, None] = {}
        scope._extensions.exports = self  # the runtime's hooks (``ExportHooks``)
        # Never a stream of the pool: every access conflicts-checks against it.
        self.foreign = Stream._create(scope, -1, None)  # type: ignore[arg-type]

    async def drain(self) -> None:
        """Exports still held by their consumer are abandoned (their memory
        quarantined); released ones are finished, so that their leases retire
        before memory is freed."""
        if not self.exports:
            await trio.lowlevel.checkpoint()
            return
        sweep_dropped()  # capsules dropped unconsumed are released, not abandoned
        abandon_exports(self.scope, why="still held by their consumer", live_only=True)
        await finish_releases(self.scope)

    def abandon(self, after: str) -> None:
        """Released exports whose fence did not finish before the drain gave up. One
        last look first (``drain_timeout=0`` waits for nothing): a release
        whose fence needs no blocking call is finished now, so that its lease
        retires like the scope's other work instead of being leaked."""
        sweep_dropped()  # capsules dropped unconsumed are released, not abandoned
        for e in list(self.exports):
            if e.state is ExportState.RELEASING and not e._blocking_fence():
                e.finish()
        abandon_exports(self.scope, why=f"not finished {after}")

    def close(self) -> None:
        pass

    # the runtime's hooks (``_extension.ExportHooks``)
    def conflict(self, other: Submission, arr: DeviceArray, access: Access, what: str) -> Submission:
        return conflict(self.scope, other, arr, access, what)

    async def finish_releases(self) -> None:
        await finish_releases(self.scope)


def _registry(scope: ResourceScope) -> ExportRegistry:
    return scope._extensions.get(ExportRegistry)


def live_exports(scope: ResourceScope) -> int:
    """How many exports of ``scope`` a consumer still holds."""
    reg = scope._extensions.find(ExportRegistry)
    return 0 if reg is None else sum(1 for e in reg.exports if e.state is ExportState.LIVE)


@final
class Export:
    """A lease held for a foreign consumer until it releases the memory."""

    __slots__ = (
        "__weakref__",
        "_done",
        "_fence",
        "_lock",
        "_loop_thread",
        "access",
        "alloc",
        "consumer",
        "kind",
        "label",
        "scope",
        "state",
        "stream",
        "sub",
    )

    def __init__(
        self, arr: DeviceArray, access: Access, kind: str, consumer: int | None, stream: Stream
    ) -> None:
        self.alloc = arr._alloc
        self.scope: ResourceScope = arr._alloc.scope
        self.access = access
        self.kind = kind
        self.consumer = consumer
        self.label = repr(arr)
        self.stream = stream
        self.state = ExportState.LIVE
        self.sub: Submission | None = None
        self._lock = threading.Lock()
        self._loop_thread = threading.get_ident()
        #: (fence, error) taken when the consumer released it, or None
        self._fence: tuple[object, BaseException | None] | None = None
        #: set (on the loop) once the export is released or abandoned
        self._done = trio.Event()

    def __repr__(self) -> str:
        return f"<Export {self.kind} {self.access.value} of {self.label}: {self.state.value}>"

    # ------------------------------------------------------------------ release
    def release(self) -> None:
        """The consumer is done (any thread). Idempotent. The fence on the
        consumer's work is taken before the export is published as releasing,
        so the loop never finishes it without that fence."""
        with self._lock:
            if self.state is not ExportState.LIVE:
                return
            self.state = ExportState.FENCING
        scope = self.scope
        driver: Any = scope._driver
        caps = scope._driver.capabilities
        consumer = self.consumer
        if caps.foreign_fence_blocks and consumer not in (1, 2):
            # A consumer's own stream may have been destroyed by now (its
            # handle would dangle): fence the whole device instead. Only the
            # legacy and per-thread default streams always exist.
            consumer = None
        fence: tuple[object, BaseException | None] | None = None
        if (
            consumer is not None
            and not scope._closed
            and (threading.get_ident() == self._loop_thread or caps.foreign_fence_threadsafe)
        ):
            # Fence the consumer's stream now, while it surely exists.
            try:
                fence = (driver.foreign_fence(consumer), None)
            except Exception as exc:
                fence = (None, exc)
        with self._lock:
            if self.state is not ExportState.FENCING:  # abandoned at scope exit meanwhile
                if fence is not None and fence[0] is not None:
                    driver.drop_fence(fence[0])
                return
            self.consumer = consumer
            self._fence = fence
            self.state = ExportState.RELEASING
        scope._extensions.exports_releasing = True
        try:
            scope._token.run_sync_soon(self._start_finish)
        except trio.RunFinishedError:  # pragma: no cover - the run is over; nothing to order
            pass

    def release_swept(self) -> None:
        """:meth:`release`, by a sweep that found the DLPack capsule dropped
        unconsumed. The sweep runs on a Trio loop at a point where the
        runtime's state may change (``statistics()``, a retirement pass, a
        conflicting access, a handle's close, the exit), so on this scope's
        own loop the release is finished at once where that needs no blocking
        fence and no submission is being enqueued (a then/map closure, a
        capture, an external's fn). Otherwise it is finished soon, as any
        release."""
        self.release()
        scope = self.scope
        if (
            self.state is not ExportState.RELEASING
            or threading.get_ident() != self._loop_thread
            or scope._closed
            or scope._enqueuing
            or self._blocking_fence()
        ):
            return
        self.finish()
        sub = self.sub
        if sub is not None and sub.state is SubState.IN_FLIGHT and sub.marker is None:
            # A retirement pass may be sweeping after its flush: record the
            # marker now, or that pass would not see the release's work.
            scope._completion.flush(sub.stream)

    def _blocking_fence(self) -> bool:
        """True if finishing needs a device-wide fence that blocks the caller."""
        return (
            self._fence is None
            and self.consumer is None
            and self.scope._driver.capabilities.foreign_fence_blocks
        )

    def _start_finish(self) -> None:
        """On the loop, soon after a release: finish now, or, when the fence is
        a blocking device-wide synchronisation, take it in a worker thread."""
        if self.state is not ExportState.RELEASING or self.scope._closed:
            return
        if self._blocking_fence():
            trio.lowlevel.spawn_system_task(self._finish_in_thread, name="trio_cuda export release")
        else:
            self.finish()

    async def _finish_in_thread(self) -> None:
        driver: Any = self.scope._driver
        try:
            fence = await trio.to_thread.run_sync(driver.foreign_fence, None, abandon_on_cancel=True)
        except Exception as exc:  # a system task must not raise; the memory is never freed
            if self.state is ExportState.RELEASING and not self.scope._closed:
                self.finish(error=exc)
            return
        if self.state is ExportState.RELEASING and not self.scope._closed:
            self.finish(fence, own_fence=False)

    def finish(
        self, fence: object = None, *, own_fence: bool = True, error: BaseException | None = None
    ) -> None:
        """On the loop: fence the consumer's work and put the lease in flight.
        With ``own_fence=False``, ``fence`` (a device-wide fence taken by the
        caller, or None for one already waited for) replaces the consumer's.
        ``error``: the fence could not be taken; the lease is quarantined."""
        with self._lock:
            if self.state is not ExportState.RELEASING:
                return
            self.state = ExportState.RELEASED
        self._done.set()
        scope = self.scope
        reg = scope._extensions.find(ExportRegistry)
        if reg is not None:
            reg.exports.pop(self, None)
        self.alloc.exports -= 1
        sub = self.sub
        if sub is None or scope._closed:
            return
        s = self.stream
        scope._completion.resume_exported(sub, s)
        driver: Any = scope._driver
        taken, self._fence = self._fence, None
        if error is not None:
            taken, own_fence = (None, error), True
        try:
            if own_fence:
                if taken is None:
                    fence = driver.foreign_fence(self.consumer)
                else:
                    fence, error = taken
                    if error is not None:
                        raise error
            elif taken is not None and taken[0] is not None:
                driver.drop_fence(taken[0])  # the caller's fence covers it
            if fence is not None:
                driver.wait_fence(s.handle, fence)
        except Exception as exc:
            # The consumer's work cannot be ordered: never free the memory.
            err = CompletionUnknownError(
                f"{self.kind} export of {self.label}: the consumer's work could not be fenced ({exc})"
            )
            err.__cause__ = exc
            sub.unknown = err
        finally:
            if own_fence and fence is not None:
                driver.drop_fence(fence)
        sub.dirty = True
        scope._completion.finish(sub, None)


# --------------------------------------------------------------------------- inside ops.external

_RUNNING = threading.local()


@final
class ExternalFrame:
    """An ``ops.external`` fn running on this thread: what its leases cover."""

    __slots__ = ("_address", "_table", "accesses", "capsules", "op", "scope", "stream")

    def __init__(
        self,
        scope: ResourceScope,
        stream: Stream,
        accesses: Sequence[tuple[DeviceArray, Access]],
        op: object,
    ) -> None:
        self.scope = scope
        self.stream = stream
        self.accesses = accesses
        self.op = op
        #: DLPack capsules made inside fn, expired when it returns if unconsumed
        self.capsules: list[object] = []
        #: per allocation: (bytes readable, bytes writable), built at the first export
        self._table: dict[Allocation, tuple[Extent, Extent]] | None = None
        self._address: int | None = None

    @property
    def label(self) -> str:
        return repr(self.op)

    def address(self) -> int:
        """The external's stream as consumers name it."""
        if self._address is None:
            self._address = self.scope._driver.stream_address(self.stream.handle)
        return self._address

    def access(self, arr: DeviceArray, what: str) -> Access:
        """The access an export of ``arr`` gets here: WRITE where ``writes``
        cover its bytes (and the handle is writable), READ where ``reads`` and
        ``writes`` do; otherwise raise :class:`AccessConflictError`."""
        arr._check_usable(what)
        table = self._table
        if table is None:
            spans: dict[Allocation, list[Extent]] = {}
            for a, acc in self.accesses:
                span = spans.setdefault(a._alloc, [EMPTY, EMPTY])
                i = 1 if acc is Access.WRITE else 0
                span[i] = union(span[i], array_extent(a))
            table = self._table = {al: (union(r, w), w) for al, (r, w) in spans.items()}
        ext = array_extent(arr)
        entry = table.get(arr._alloc)
        if entry is not None:
            readable, writable = entry
            if not arr._readonly and covers(writable, ext):
                return Access.WRITE
            if covers(readable, ext):
                return Access.READ
            detail = f" ({describe(ext)} of its allocation; the external covers {describe(readable)} of it)"
        else:
            detail = ""
        raise AccessConflictError(
            f"{what}: {arr!r}{detail} is not covered by this external's reads= or writes= "
            f"({self.label}), so no lease orders the foreign work on it; add it to reads= (to read "
            f"it) or writes= (to write it)"
        )


def enter_external(
    scope: ResourceScope, stream: Stream, accesses: Sequence[tuple[DeviceArray, Access]], op: object
) -> ExternalFrame:
    """Before the fn of ``op`` (an ``ops.external``) runs: exports of
    ``scope``'s arrays on this thread follow its leases until
    :func:`exit_external`."""
    frame = ExternalFrame(scope, stream, accesses, op)
    stack: list[ExternalFrame] | None = getattr(_RUNNING, "stack", None)
    if stack is None:
        stack = _RUNNING.stack = []
    stack.append(frame)
    return frame


def exit_external(frame: ExternalFrame) -> None:
    """After the fn returned or raised: its frame ends, and its DLPack
    capsules not consumed yet are expired."""
    stack: list[ExternalFrame] = _RUNNING.stack
    if stack and stack[-1] is frame:
        stack.pop()
    else:  # pragma: no cover - frames nest as the calls do
        stack.remove(frame)
    if frame.capsules:
        expire_unconsumed(frame.capsules)
        frame.capsules.clear()


def running_external(scope: ResourceScope) -> ExternalFrame | None:
    """The innermost ``ops.external`` fn running on this thread, if it runs in
    ``scope``."""
    stack: list[ExternalFrame] | None = getattr(_RUNNING, "stack", None)
    if not stack:
        return None
    top = stack[-1]
    return top if top.scope is scope else None


# --------------------------------------------------------------------------- open


def in_flight_conflicts(arr: DeviceArray, access: Access) -> bool:
    """True if in-flight work a consumer with ``access`` of ``arr``'s bytes
    must wait for exists (work on disjoint bytes of the allocation does not
    count)."""
    alloc = arr._alloc
    ext = array_extent(arr)
    if any(w.state not in TERMINAL for w in overlapping(alloc, True, ext)):
        return True
    if access is Access.WRITE:
        return any(r.state not in TERMINAL for r in overlapping(alloc, False, ext))
    return False


def open_export(
    arr: DeviceArray, access: Access, kind: str, consumer: int | None, what: str
) -> tuple[Export, Stream, bool]:
    """Take an export lease on ``arr``'s allocation. Returns the export, the
    stream the consumer must order after, and whether anything is in flight
    that it must wait for. Raises before anything was taken or enqueued."""
    arr._check_usable(what)
    if access is Access.WRITE and arr._readonly:
        raise ValueError(f"{what}: expected a writable array for a write export, got a read-only one")
    alloc = arr._alloc
    scope = alloc.scope
    scope._check_open(what)
    if scope._enqueuing:
        raise RuntimeError(
            f"{what}: cannot export {arr!r} from inside a then/map closure of a submission (nor inside "
            f"another scope's ops.external fn): its leases are being taken; export it inside "
            f"ops.external(fn, reads=..., writes=...), whose leases cover what fn exports, or after "
            f"the submission"
        )
    reg = _registry(scope)
    # The consumer orders after the stream of the latest in-flight writer of
    # the exported bytes when it is one of this scope's; other writers (other
    # streams, another scope's cross-scope copy) become device-side waits on
    # the export's own stream (take_leases, below).
    own = [
        w
        for w in overlapping(alloc, True, array_extent(arr))
        if w.scope is scope and w.state is SubState.IN_FLIGHT
    ]
    stream = own[-1].stream if own else scope._streams[0]
    pending = in_flight_conflicts(arr, access)
    export = Export(arr, access, kind, consumer, stream)
    scope._next_id += 1
    sub = Submission(scope, stream, scope._next_id, _ExportOp(export))
    take_leases(scope, stream, sub, ((arr, access),), what)  # may raise: nothing taken
    export.sub = sub
    scope._completion.hold_exported(sub, reg.foreign)
    alloc.exports += 1
    reg.exports[export] = None
    if sub.dirty:
        pending = True  # waits were enqueued on the stream: the consumer orders after them
    return export, stream, pending


def sync_consumer(export: Export, stream: Stream, consumer: int) -> None:
    """Make the consumer's stream wait, device-side, for ``stream``. On
    failure the export is released again (its lease retires normally)."""
    driver: Any = export.scope._driver
    try:
        driver.foreign_wait(consumer, stream.handle)
    except BaseException:
        export.consumer = None
        with export._lock:
            export.state = ExportState.RELEASING
        export.finish(None, own_fence=False)  # the consumer never got the memory
        raise


# --------------------------------------------------------------------------- conflicts


def conflict(
    scope: ResourceScope, other: Submission, arr: DeviceArray, access: Access, what: str
) -> Submission:
    """``other`` is an export's submission that a new access conflicts with.
    A released export is finished now (and returned, in flight); a live one
    raises :class:`AccessConflictError`."""
    op = other.op
    export = op._export if isinstance(op, _ExportOp) else None
    if export is not None and export.state is ExportState.LIVE and UNCONSUMED:
        sweep_dropped()  # a capsule its consumer refused or dropped releases it now
    if export is not None and export.state is ExportState.RELEASED:
        return other  # that sweep finished it: in flight
    if export is not None and export.state is ExportState.RELEASING and not export._blocking_fence():
        export.finish()
        return other
    if export is not None and export.state in (ExportState.RELEASING, ExportState.FENCING):
        raise AccessConflictError(
            f"{what}: {access.value} access to {arr!r} conflicts with a {export.kind} export whose "
            f"consumer just released it; its work is being fenced (a device-wide synchronisation, "
            f"in a worker thread, so the loop is not blocked). Await the access (scope.run, "
            f"to_host, to_device wait for the fence), or submit again after a checkpoint"
        )
    held = "write" if export is None or export.access is Access.WRITE else "read"
    kind = "an export" if export is None else f"a {export.kind} export"
    raise AccessConflictError(
        f"{what}: {access.value} access to {arr!r} conflicts with {kind} that holds a {held} lease "
        f"for a foreign consumer; trio_cuda cannot order after work the consumer has not enqueued "
        f"yet. Release the export first (drop the consumer's tensor, or close the exported "
        f"handle for the CUDA Array Interface), or export a read-only handle (arr.as_readonly())"
    )


# --------------------------------------------------------------------------- scope exit


async def finish_releases(scope: ResourceScope) -> None:
    """Wait until every export of ``scope`` that its consumer released is
    finished (its fence taken, in a worker thread where that blocks), so that
    an access conflicting with one is ordered instead of refused."""
    reg = scope._extensions.find(ExportRegistry)
    while reg is not None:
        pending = [e for e in reg.exports if e.state in (ExportState.RELEASING, ExportState.FENCING)]
        if not pending:
            break
        for e in pending:
            if e.state is ExportState.FENCING:
                await trio.sleep(0.001)  # the consumer's thread is taking the fence
            else:
                await e._done.wait()
    scope._extensions.exports_releasing = False


def abandon_exports(scope: ResourceScope, *, why: str, live_only: bool = False) -> int:
    """At scope exit: exports not released and finished by now (with
    ``live_only``, those their consumer still holds) are abandoned. Their
    memory is quarantined (leaked, never freed: a consumer may still use it)
    with one ResourceWarning. Returns how many."""
    reg = scope._extensions.find(ExportRegistry)
    if reg is None:
        return 0
    abandoned = []
    for e in list(reg.exports):
        with e._lock:
            if e.state in (ExportState.RELEASED, ExportState.ABANDONED):
                continue
            if live_only and e.state is not ExportState.LIVE:
                continue
            e.state = ExportState.ABANDONED
        e._done.set()
        reg.exports.pop(e, None)
        e.alloc.exports -= 1
        scope._completion.quarantine_exported(e.sub, e.alloc)
        abandoned.append(e.label)
    if abandoned:
        warnings.warn(
            ResourceWarning(
                f"trio_cuda scope exited while {len(abandoned)} export(s) were {why}: "
                f"{', '.join(abandoned[:5])}{' ...' if len(abandoned) > 5 else ''}; their memory is "
                f"quarantined (leaked, never freed) rather than freed under a consumer that may "
                f"still use it. Release exports (drop the consumer's tensor) before the scope exits"
            ),
            stacklevel=3,
        )
    return len(abandoned)


# --------------------------------------------------------------------------- protocols


def dlpack_device(arr: DeviceArray) -> tuple[int, int]:
    """``__dlpack_device__`` of ``arr``."""
    return arr._alloc.scope._driver.dlpack_device()


def cuda_array_interface(arr: DeviceArray) -> dict[str, Any]:
    """``__cuda_array_interface__`` of ``arr``: exports the handle (once)."""
    scope = arr._alloc.scope
    if scope._info.backend != "cuda":
        raise AttributeError(
            "__cuda_array_interface__: expected an array on the cuda backend, got one on the "
            f"{scope._info.backend!r} backend, whose memory has no CUDA address; use DLPack "
            "(trio_cuda.borrow) between scopes of one simulated device"
        )
    what = "__cuda_array_interface__"
    frame = running_external(scope)
    if frame is not None:
        # covered by the external's leases: no export, no stream to synchronise
        # with (the consumer works on the external's stream)
        access = frame.access(arr, what)
        return _cai(arr, arr._readonly or access is Access.READ, None)
    info = arr._info
    cached = arr._cai
    export = None if info is None else info.export
    if cached is not None and export is not None and export.state is ExportState.LIVE:
        return dict(cached)
    access = Access.READ if arr._readonly else Access.WRITE
    export, stream, pending = open_export(arr, access, "CUDA Array Interface", UNKNOWN_STREAM, what)
    info = arr._gc_info()
    info.export = export
    cai = _cai(arr, arr._readonly, scope._driver.stream_address(stream.handle) if pending else None)
    arr._cai = cai
    return dict(cai)


def _stream_name(stream: int | None) -> str:
    if stream is None or stream == 1:
        return f"{stream} (the legacy default stream)"
    if stream == 2:
        return "2 (the per-thread default stream)"
    return f"{stream:#x}"


def _cai(arr: DeviceArray, readonly: bool, stream: int | None) -> dict[str, Any]:
    dt = arr._dtype
    cai: dict[str, Any] = {
        "shape": arr._shape,
        "typestr": dt.str,
        "data": (arr.ptr, readonly),
        "version": 3,
        "strides": None if arr.c_contiguous else arr.strides,
        "stream": stream,
    }
    if dt.fields is not None:
        cai["descr"] = dt.descr
    return cai


def dlpack_export(
    arr: DeviceArray,
    *,
    stream: object,
    max_version: object,
    dl_device: object,
    copy: object,
) -> object:
    """``__dlpack__`` of ``arr``."""
    from ._dlpack import dl_dtype, kDLExtDev, make_capsule, no_release

    what = "__dlpack__"
    arr._check_usable(what)
    device = dlpack_device(arr)
    if copy is True:
        raise BufferError(
            f"{what}: copy: expected None or False (trio_cuda exports without copying), got True"
        )
    if copy not in (None, False):
        raise TypeError(f"{what}: copy: expected None, False or True, got {copy!r}")
    if dl_device is None and device[0] == kDLExtDev:
        # Only trio_cuda.borrow on the same SimDevice reads simulated memory, and it
        # names the device. Refuse anyone else before anything is taken: a consumer
        # that refused the capsule later (NumPy) would leave its lease behind.
        raise BufferError(
            f"{what}: dl_device: simulated memory can only be imported by trio_cuda.borrow on the same "
            f"SimDevice, which asks for dl_device={device}; got None (NumPy and other libraries cannot "
            f"read it: copy it to the host with 'await gpu.to_host(arr)')"
        )
    if dl_device is not None and tuple(dl_device) != device:  # type: ignore[arg-type]
        raise BufferError(
            f"{what}: dl_device: expected {device} (the array's own device), got {dl_device!r}; "
            f"copying to another device is not supported"
        )
    versioned = False
    if max_version is not None:
        if not (isinstance(max_version, tuple) and len(max_version) == 2):
            raise TypeError(f"{what}: max_version: expected a (major, minor) tuple, got {max_version!r}")
        versioned = max_version[0] >= 1
    dt = dl_dtype(arr._dtype)
    if dt is None:
        raise BufferError(
            f"{what}: expected a dtype DLPack can carry (bool, signed/unsigned int, float or complex, "
            f"native byte order), got {arr._dtype}"
        )
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
        raise TypeError(f"{what}: stream: expected None or an int stream handle, got {stream!r}")
    scope = arr._alloc.scope
    frame = running_external(scope)
    readonly = arr._readonly
    if frame is not None:
        readonly = readonly or frame.access(arr, what) is Access.READ
    if readonly and not versioned:
        if frame is not None and not arr._readonly:
            raise BufferError(
                f"{what}: {arr!r} is covered only by this external's reads= ({frame.label}), so it is "
                f"exported read-only, which only consumers of DLPack 1.0 or later (max_version=(1, 0)) "
                f"can be told; got max_version={max_version!r}. Add it to writes= to let the "
                f"consumer write it"
            )
        raise BufferError(
            f"{what}: a read-only array can only be exported to consumers of DLPack 1.0 or later "
            f"(max_version=(1, 0)), which can mark it read-only; got max_version={max_version!r}"
        )
    consumer: int | None
    if scope._info.backend == "cuda":
        if stream == 0:
            raise ValueError(
                f"{what}: stream: expected None, -1, 1 (legacy default), 2 (per-thread default) or a "
                f"stream handle; 0 is ambiguous and DLPack disallows it"
            )
        consumer = 1 if stream is None else (None if stream == -1 else stream)
    else:
        consumer = None if stream is None or stream == -1 else stream
    itemsize = arr._dtype.itemsize
    if frame is not None:
        own = frame.address()
        if consumer is not None and consumer != own:
            raise AccessConflictError(
                f"{what}: stream: expected the stream of the running ops.external ({own:#x}), on "
                f"which its leases order the consumer's work, or -1; got {_stream_name(stream)}. Adopt the "
                f"external's stream before the import (cupy.cuda.Stream.from_external(stream), "
                f"torch.cuda.stream(torch.cuda.ExternalStream(stream.__cuda_stream__()[1])))"
            )
        capsule = make_capsule(
            ptr=arr.ptr,
            shape=arr._shape,
            strides=tuple(b // itemsize for b in arr.strides),
            dtype=dt,
            device=device,
            versioned=versioned,
            read_only=readonly,
            release=no_release,
        )
        frame.capsules.append(capsule)
        return capsule
    if consumer is not None:
        scope._driver.check_foreign_stream(consumer)  # a bad stream fails here, not at the release
    access = Access.READ if arr._readonly else Access.WRITE
    export, s, pending = open_export(arr, access, "DLPack", consumer, what)
    try:
        if pending and consumer is not None:
            sync_consumer(export, s, consumer)
        return make_capsule(
            ptr=arr.ptr,
            shape=arr._shape,
            strides=tuple(b // itemsize for b in arr.strides),
            dtype=dt,
            device=device,
            versioned=versioned,
            read_only=arr._readonly,
            release=export.release,
            swept=export.release_swept,
        )
    except BaseException:
        export.release()
        raise
