"""Resource scopes, streams, futures and the completion-handoff task.

Invariants:

* A scope owns its streams, its allocations and every submission made on it.
* Exactly one completion-handoff task per scope, shielded from outside
  cancellation, polls markers, runs host closures and
  retires submissions, per stream in completion (FIFO) order. It never blocks
  the loop; it sleeps in the driver's ``wait_for_progress``. That nursery
  belongs to the Trio run's scope host, a system task, not to the entering
  task, so a scope may be entered and exited by different tasks
  (``_manager``); the exit waits until the handoff task ended.
* Awaiting a future never changes what is retained: cancelling, dropping or
  forgetting it leaves the submission to the handoff task.
* Scope exit, whatever the reason, first waits (shielded) for every submission;
  only then frees memory, unloads modules and destroys streams. Work still in
  flight after ``drain_timeout`` is quarantined with a ``ResourceWarning``: its
  memory, streams and driver state are leaked on purpose, never freed.
* Errors nobody observed (futures never awaited, failures after a partial
  submission) are raised at exit in an ``ExceptionGroup``. ``Cancelled`` is
  never wrapped into a trio_cuda error.
"""

from __future__ import annotations

import logging
import math
import sys
from _thread import get_ident
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import numpy as np
import trio
from trio.lowlevel import checkpoint, enable_ki_protection

from . import _compiled, _completion, _submit
from ._array import Allocation, AllocState, DeviceArray, normalize_dtype, normalize_order, normalize_shape
from ._completion import LOOK_AGAIN, LOOK_CHECK, LOOK_SETTLED, Completion, trace_awaited
from ._dlpack import UNCONSUMED, sweep_dropped
from ._driver import DeviceContext, DeviceInfo
from ._errors import ScopeClosedError
from ._extension import Extensions
from ._final import NoPublicConstructor, final
from ._future import DeviceFuture, outcome, wrong_caller
from ._kernel import Kernel
from ._kernels import KernelTable
from ._launch import KernelLaunch
from ._memory import MemoryTable
from ._ops import ALLOC_OP, COMPOSITE, Access, DeviceOp, HostResult, _Copy, _Fill, _ZeroBytes
from ._policy import FollowWriter, LeastLoaded, SchedulingPolicy
from ._statistics import ScopeStatistics
from ._stream import Stream
from ._submit import (
    EnqueueContext,
    Submission,
    SubState,
    enqueue_unsafe_py,
    preflight,
    take_launch_leases,
    take_leases,
)
from ._trace import Tracer, alloc_args, lease_args, op_name, trace_error, trace_submit

if TYPE_CHECKING:
    from ._graph import CudaGraph
    from ._launch import PreparedLaunch

log = logging.getLogger("trio_cuda")

T = TypeVar("T")
U = TypeVar("U")

# --------------------------------------------------------------------------- scope


@final
class ResourceScope(metaclass=NoPublicConstructor):
    """A nursery-scoped owner of GPU streams, memory and in-flight work.

    Open one with :func:`open_scope`. See the lifetime chapter of the docs for
    the rules it enforces.
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_closing",
        "_completion",
        "_conflicts",
        "_driver",
        "_enqueuing",
        "_extensions",
        "_functions",
        "_info",
        "_kernels",
        "_memory",
        "_next_id",
        "_policy",
        "_streams",
        "_thread",
        "_token",
        "_trace_cmds",
        "_trace_id",
        "_trace_timing",
        "_tracer",
    )

    _obtain = "use 'async with trio_cuda.open_scope()'"

    _driver: DeviceContext
    _info: DeviceInfo
    #: the components: how work completes, the memory, the features' state
    _completion: Completion
    _memory: MemoryTable
    #: the kernels loaded for this scope, and the launch shapes checked
    _kernels: KernelTable
    _extensions: Extensions
    _conflicts: str
    _policy: SchedulingPolicy
    _closed: bool
    _closing: bool
    _enqueuing: bool
    _functions: dict[Kernel, object]
    #: (kernel, config, plan) of SIMT launches already checked against this
    #: device: a fresh launch of the same shape skips the checks
    _next_id: int
    _token: trio.lowlevel.TrioToken
    _thread: int  #: the loop thread; a scope never outlives its Trio run
    _streams: tuple[Stream, ...]
    #: the lifetime trace this scope records into (see ``_trace``), or None
    _tracer: Tracer | None
    _trace_id: int
    #: the driver keeps device times of commands (``Capabilities.device_clock``)
    _trace_cmds: bool
    #: device timestamps (CUDA events) around each enqueue, for the trace
    _trace_timing: bool

    @classmethod
    def _create(
        cls,
        driver: DeviceContext,
        streams: int,
        conflicts: str,
        policy: SchedulingPolicy,
    ) -> ResourceScope:
        self = object.__new__(cls)
        self._driver = driver
        self._info = driver.info
        self._token = trio.lowlevel.current_trio_token()
        self._thread = get_ident()
        self._extensions = Extensions(self)
        self._memory = MemoryTable(self, driver, self._token, self._thread)
        self._completion = completion = Completion(self, driver, self._memory, self._extensions)
        self._memory.wake = completion.wake
        self._conflicts = conflicts
        self._policy = policy
        self._closed = False
        self._closing = False
        self._enqueuing = False
        self._kernels = KernelTable(self, driver)
        #: the kernel table's own dict: the launch hot path probes it directly
        self._functions = self._kernels.functions
        self._next_id = 0
        self._tracer = None
        self._trace_id = 0
        self._trace_cmds = False
        self._trace_timing = False
        self._streams = ()
        made: list[Stream] = []
        try:
            for i in range(streams):
                made.append(Stream._create(self, i, driver.create_stream(i)))
        except BaseException:
            for s in made:
                driver.destroy_stream(s.handle)
            raise
        self._streams = completion.streams = tuple(made)
        return self

    # ------------------------------------------------------------------ facts
    @property
    def streams(self) -> tuple[Stream, ...]:
        """The scope's stream pool, in index order."""
        return self._streams

    @property
    def device(self) -> DeviceInfo:
        """What the scope runs on (``device.backend`` is "cuda" or "sim")."""
        return self._info

    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"sim"``."""
        return self._info.backend

    @property
    def closed(self) -> bool:
        """True once the scope exited."""
        return self._closed

    def statistics(self) -> ScopeStatistics:
        """A snapshot of the scope's counters (see :class:`ScopeStatistics`).

        Like every synchronous call of an open scope, it belongs to the Trio
        run that opened the scope: the tables it reads change under that
        loop. From another thread or Trio run it raises ``RuntimeError``; a
        worker thread gets a consistent snapshot with
        ``trio.from_thread.run_sync(gpu.statistics)``. Once the scope has
        closed, its final statistics may be read from any thread."""
        if get_ident() != self._thread:
            if not self._closed:
                self._check_caller("statistics")
        elif UNCONSUMED:  # DLPack capsules dropped unconsumed release their exports
            sweep_dropped()
        retained: set[Allocation] = set()
        for s in self._streams:
            for e in (*s._pending, *s._unmarked):
                if type(e) is Submission:
                    retained.update(e.leases)
        # every lease taken and not yet released, the one being enqueued included
        c = self._completion
        memory = self._memory
        leases_held = sum(a.active for a in memory.allocs) - memory.quarantined_leases
        q_allocs = [a for a in memory.allocs if a.state is AllocState.QUARANTINED]
        live = [a for a in memory.allocs if a.state is not AllocState.FREED]
        return ScopeStatistics(
            backend=self._info.backend,
            device=self._info.name,
            streams=len(self._streams),
            in_flight=c.in_flight,
            submitted=c.completed + c.in_flight,
            completed=c.completed,
            failed=c.failed,
            quarantined=len(c.quarantined),
            leases_held=leases_held,
            quarantined_leases=memory.quarantined_leases,
            retained_bytes=sum(a.nbytes for a in retained),
            quarantined_bytes=sum(a.nbytes for a in q_allocs),
            live_allocations=len(live),
            live_bytes=sum(a.nbytes for a in live),
            pending_errors=len(c.unobserved) + len(c.orphan_errors),
            host_closures_pending=c.host_steps,
            foreign_leases=memory.foreign,
            retired_by_waiters=c.by_waiters,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        info = self._info
        return (
            f"<ResourceScope {info.backend}:{info.ordinal} {state}, {self._completion.in_flight} in flight>"
        )

    # ------------------------------------------------------------------ memory
    def _check_open(self, what: str) -> None:
        if get_ident() != self._thread:
            raise wrong_caller(what, self)
        if self._closing or self._closed:
            raise ScopeClosedError(f"{what}: the scope is closed")

    def _check_caller(self, what: str) -> None:
        """Refuse a call from another thread or Trio run, before anything is
        allocated, enqueued or read: the handoff task and the loop's
        bookkeeping would never learn of the work, and the loop changes what
        a read would see. ``what`` is the method's name; the message names the
        threads and, from a worker thread, the way to call it on the loop."""
        if get_ident() != self._thread:
            raise wrong_caller(what, self, how=f"trio.from_thread.run_sync(gpu.{what})")

    def _pick(self, op: DeviceOp[Any], stream: Stream | None) -> Stream:
        if stream is None:
            return self._check_choice(self._policy.choose(self._streams, op))
        if not isinstance(stream, Stream):
            raise TypeError(f"stream: expected a Stream of this scope, got {type(stream).__name__}")
        if stream._scope is not self:
            raise ValueError(f"stream: expected a stream of this scope, got {stream!r} of another scope")
        return stream

    def _check_choice(self, chosen: object) -> Stream:
        """``chosen``, the policy's choice, if it is one of this scope's streams."""
        if type(chosen) is Stream and chosen._scope is self:
            return chosen
        if not isinstance(chosen, Stream):
            raise TypeError(
                f"policy: expected {self._policy!r}.choose() to return one of the scope's streams, "
                f"got {chosen!r}"
            )
        raise ValueError(
            f"policy: expected {self._policy!r}.choose() to return one of the scope's streams, "
            f"got {chosen!r} of another scope"
        )

    @enable_ki_protection
    def empty(
        self,
        shape: object,
        dtype: object = np.float64,
        *,
        order: Literal["C", "F"] = "C",
        stream: Stream | None = None,
    ) -> DeviceArray:
        """A new uninitialised device array, allocated in stream order and
        owned by this scope. ``order`` is "C" (row-major) or "F"
        (column-major); ``dtype`` may be a structured NumPy dtype."""
        return self._empty(shape, dtype, order, stream)[0]

    def _empty(
        self, shape: object, dtype: object, order: Literal["C", "F"], stream: Stream | None
    ) -> tuple[DeviceArray, Stream]:
        """``empty``, and the stream it was allocated on: work that
        initialises the array goes there (the policy is asked once)."""
        self._check_open("empty")
        shp = normalize_shape(shape, dtype)  # folds a sub-array dtype in, bounds the bytes
        dt = normalize_dtype(dtype)
        layout = normalize_order(order)
        nbytes = math.prod(shp) * dt.itemsize
        s = self._pick(ALLOC_OP, stream)
        ptr = self._driver.alloc(nbytes, s.handle)
        arr = self._adopt(self._memory.new(ptr, nbytes), shp, dt, layout, s, ALLOC_OP, "empty", track=True)
        return arr, s

    def _adopt(
        self,
        alloc: Allocation,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        order: Literal["C", "F"],
        stream: Stream,
        op: DeviceOp[Any],
        what: str,
        *,
        track: bool = False,
        dirty: bool = False,
        readonly: bool = False,
    ) -> DeviceArray:
        """Register new memory (allocated here, or borrowed) and its first
        handle, and publish it as written on ``stream``: work on other streams
        orders after that point. ``dirty``: the publication enqueued work.
        ``readonly``: the handle is read-only once published (the publication
        itself writes)."""
        self._memory.register(alloc)
        tr = self._tracer
        if tr is not None:
            tr.emit("alloc", "alloc", self._trace_id, stream.index, alloc=alloc.ptr, args=alloc_args(alloc))
        arr = DeviceArray._create(alloc, shape, dtype, order=order, track=track)
        sub = self._new_submission(stream, op)
        take_leases(self, stream, sub, ((arr, Access.WRITE),), what)
        sub.dirty = dirty
        self._completion.finish(sub, None)
        if readonly:
            arr._readonly = True
        return arr

    def zeros(
        self,
        shape: object,
        dtype: object = np.float64,
        *,
        order: Literal["C", "F"] = "C",
        stream: Stream | None = None,
    ) -> DeviceArray:
        """A new device array of zero bytes (the fill is enqueued); any dtype,
        structured ones included."""
        arr, s = self._empty(shape, dtype, order, stream)
        try:
            self._submit_detached(_ZeroBytes(arr), s, "zeros")
        except BaseException:
            arr.close()
            raise
        return arr

    def full(
        self,
        shape: object,
        fill_value: object,
        dtype: object = np.float64,
        *,
        order: Literal["C", "F"] = "C",
        stream: Stream | None = None,
    ) -> DeviceArray:
        """A new device array filled with ``fill_value`` (the fill is enqueued)."""
        from ._ops import fill_pattern

        pattern = fill_pattern(normalize_dtype(dtype), fill_value)  # checked before allocating
        arr, s = self._empty(shape, dtype, order, stream)
        try:
            self._submit_detached(_Fill(arr, pattern), s, "full")
        except BaseException:
            arr.close()
            raise
        return arr

    async def to_device(
        self, host: object, *, order: Literal["C", "F", "K"] = "K", stream: Stream | None = None
    ) -> DeviceArray:
        """Copy a NumPy array to a new device array; returns once the copy
        completed. ``order`` is the device layout: "K" (default) keeps an
        F-contiguous host array in F order, anything else becomes C. If
        cancelled, the new array is closed (and freed once the copy retired)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open("to_device")
        if not isinstance(host, np.ndarray):
            if isinstance(host, DeviceArray):
                raise TypeError("to_device: host: expected a NumPy array, got a DeviceArray")
            host = np.asarray(host)
        assert isinstance(host, np.ndarray)
        if order == "K":
            order = "F" if host.flags.f_contiguous and not host.flags.c_contiguous else "C"
        elif order not in ("C", "F"):
            raise ValueError(f"to_device: order: expected 'C', 'F' or 'K', got {order!r}")
        s = self._pick(ALLOC_OP, stream)
        arr = self.empty(host.shape, host.dtype, order=order, stream=s)
        try:
            fut: DeviceFuture[DeviceArray] = self.submit(_Copy(arr, host), stream=s)
            await fut.wait()
        except BaseException:
            arr.close()
            raise
        return arr

    async def to_host(
        self, arr: DeviceArray, *, out: np.ndarray[Any, Any] | None = None, stream: Stream | None = None
    ) -> np.ndarray[Any, Any]:
        """Copy a device array to a new NumPy array (in the array's order) or
        into ``out`` (any writable array of the same shape and dtype); returns
        once the copy completed. The copy lands in pinned staging memory and
        is copied out when the GPU finished it, so it never blocks a stream."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not isinstance(arr, DeviceArray):
            raise TypeError(f"to_host: arr: expected a DeviceArray, got {type(arr).__name__}")
        if out is None:
            out = np.empty(arr.shape, arr.dtype, order=arr.order)
        from ._ops import copy

        op = copy(out, arr)
        if self._extensions.exports_releasing:  # a read after a consumer released a write export
            await self._extensions.finish_export_releases()
        fut: DeviceFuture[np.ndarray[Any, Any]] = self.submit(op, stream=stream)
        return await fut.wait()

    def empty_like(
        self,
        a: object,
        dtype: object = None,
        *,
        order: Literal["C", "F", "K"] = "K",
        shape: object = None,
        stream: Stream | None = None,
    ) -> DeviceArray:
        """A new uninitialised device array with the shape, dtype and order of
        ``a`` (a DeviceArray, a NumPy array or anything with ``shape`` and
        ``dtype``), unless ``dtype``, ``order`` or ``shape`` say otherwise."""
        a_shape = getattr(a, "shape", None)
        a_dtype = getattr(a, "dtype", None)
        if a_shape is None or a_dtype is None:
            raise TypeError(
                f"empty_like: a: expected an array (with shape and dtype), got {type(a).__name__}"
            )
        if order not in ("C", "F", "K"):
            raise ValueError(f"empty_like: order: expected 'C', 'F' or 'K', got {order!r}")
        if order == "K":
            if isinstance(a, DeviceArray):
                order = a.order
            else:
                flags = getattr(a, "flags", None)
                f_only = flags is not None and flags.f_contiguous and not flags.c_contiguous
                order = "F" if f_only else "C"
        return self.empty(
            a_shape if shape is None else shape,
            a_dtype if dtype is None else dtype,
            order=order,
            stream=stream,
        )

    # ------------------------------------------------------------------ submission
    def _new_submission(self, stream: Stream, op: object) -> Submission:
        self._next_id += 1
        return Submission(self, stream, self._next_id, op)

    @enable_ki_protection  # (the reference; the compiled one has no frame: see _protected_call)
    def submit(self, op: DeviceOp[T], *, stream: Stream | None = None) -> DeviceFuture[T]:
        """Retain and enqueue ``op`` now; return a :class:`DeviceFuture`.

        If the op fails part-way (a driver error, or a ``then`` closure
        raising), the error is raised here and the work already enqueued stays
        retained until it completed. Nothing is enqueued if the op is invalid
        from the start.
        """
        if submit_whole is not None:  # the steps below, compiled
            return submit_whole(self, op, stream)
        if type(op) is KernelLaunch and not (self._closing or self._enqueuing or get_ident() != self._thread):
            sub = (submit_launch or ResourceScope._submit_launch)(self, op, stream)  # the hot path
        else:
            sub = self._submit(op, stream, "submit")
        c = self._completion  # nobody may await it: the handoff is its retirer
        idle = c.idle
        if idle is not None:
            c.idle = None
            idle.set()
        fut: DeviceFuture[T] = future_of(sub)
        if self._tracer is not None:
            fut._watch()
        return fut

    @enable_ki_protection
    def _submit_detached(self, op: DeviceOp[Any], stream: Stream, what: str) -> None:
        """``submit`` for the scope's own work that nobody awaits (the fill of
        ``zeros``/``full``): no future to drop; the handoff retires it."""
        self._submit(op, stream, what)
        self._completion.wake()

    @enable_ki_protection
    def _submit(self, op: DeviceOp[Any], stream: Stream | None, what: str) -> Submission:
        """Enqueue ``op`` as one submission, in flight when this returns. The
        handoff is not woken (the caller does, or awaits the work itself),
        except after a partial error, whose work nobody awaits."""
        if type(op) is KernelLaunch and not (self._closing or self._enqueuing):
            if get_ident() != self._thread:
                raise wrong_caller(what, self)
            return self._submit_launch(op, stream)
        if not isinstance(op, DeviceOp):
            from ._builder import LaunchBuilder

            if isinstance(op, LaunchBuilder):
                raise TypeError(
                    "op: a LaunchBuilder is inert and cannot be scheduled; call .finalize_unchecked() first"
                )
            raise TypeError(f"op: expected a DeviceOp, got {type(op).__name__}")
        self._check_open(what)
        if self._enqueuing:
            raise RuntimeError(f"{what}: cannot submit from inside a then/map closure of another submission")
        self._kernels.load_static(op)
        s = self._pick(op, stream)
        memo = None
        if self._conflicts == "error" and type(op) in COMPOSITE:
            # a conflict anywhere refuses the whole op before any piece is enqueued
            self._enqueuing = True
            try:
                memo = preflight(self, s, op)
            finally:
                self._enqueuing = False
        sub = self._new_submission(s, op)
        ctx = EnqueueContext(self, s, sub)
        ctx.memo = memo
        tr = self._tracer
        if tr is not None:
            tr.emit("submit", op_name(op), self._trace_id, s.index, sub.id, args={"what": what})
        self._enqueuing = True
        try:
            out = op._enqueue(ctx)
        except BaseException as exc:
            self._enqueuing = False
            if tr is not None:
                trace_error(self, tr, sub, exc)
            if sub.dirty or sub.leases:
                # Partial error: keep what was enqueued behind a completion marker.
                sub.error = exc
                sub.observed = True
                self._completion.finish(sub, None)
            raise
        self._enqueuing = False
        self._completion.finish(sub, out, wake=False)
        if tr is not None:
            tr.emit("lease", "leases", self._trace_id, s.index, sub.id, args={"leases": lease_args(sub)})
        return sub

    @enable_ki_protection
    def _submit_launch(self, op: KernelLaunch, stream: Stream | None) -> Submission:
        """``_submit`` for a single kernel launch, the hot path: the same steps
        as ``EnqueueContext.launch`` without the generic op machinery, and
        leases from the launch's access plan (``take_launch_leases``). Where
        it was built, the compiled ``submit_launch`` makes these steps."""
        if submit_launch is not None:
            return submit_launch(self, op, stream)
        s = stream if type(stream) is Stream and stream._scope is self else self._pick(op, stream)
        prepared = op.prepared
        ready = prepared.ready  # ``KernelTable.function_for``, inline when it hits
        if ready is not None and ready[0] is self._functions:
            function = ready[1]
        else:
            function = self._kernels.function_for(prepared)
        self._next_id += 1
        sub = Submission(self, s, self._next_id, op)
        take_launch_leases(self, s, sub, op)
        tr = self._tracer
        mark = self._driver.timing_mark(s.handle) if tr is not None and self._trace_timing else None
        try:
            self._driver.launch(s.handle, function, prepared)
        except BaseException as exc:
            sub.error = exc  # leases were taken: retire them behind a marker
            sub.observed = True
            self._completion.finish(sub, None)
            if self._tracer is not None:
                trace_error(self, self._tracer, sub, exc)
            raise
        if tr is None:
            self._completion.launched(sub, op._output, False)
        else:
            c = self._completion
            c.launched(sub, op._output, True)
            trace_submit(self, tr, sub, op, mark)  # before the marker
            c.submitted(s)
        return sub

    @overload
    async def run(self, op: DeviceOp[HostResult[U]], *, stream: Stream | None = None) -> U: ...
    @overload
    async def run(self, op: DeviceOp[T], *, stream: Stream | None = None) -> T: ...
    @enable_ki_protection  # (Ctrl-C lands at its checkpoints; see the KI design record)
    async def run(self, op: DeviceOp[Any], *, stream: Stream | None = None) -> Any:
        """Submit ``op`` and wait for its output. If the calling task is
        cancelled first, nothing is submitted; if it is cancelled while
        waiting, ``Cancelled`` is raised promptly and the scope keeps the
        submission until the GPU finished it.

        The calling task observes the completion itself where it can, and
        retires the completed work in stream order (rule 10 of the lifetime
        chapter). A single kernel launch whose kernel this scope has not
        loaded yet is loaded first, as :meth:`load` does (off the loop on a
        real GPU)."""
        # (compiled: a lone launch's steps to its first checkpoint; else (a cancellation due too) below)
        sub = begin(self, op, stream) if begin is not None else None
        began = sub is not None
        c = self._completion
        if sub is None:
            await trio.lowlevel.checkpoint_if_cancelled()
            lone = op if type(op) is KernelLaunch else None
            if lone is not None:
                kernel = lone.prepared.kernel
                if kernel not in self._functions and (
                    self._kernels.load_in_thread or kernel.tile is not None
                ):
                    await self._kernels.load((kernel,))
            elif isinstance(op, DeviceOp):
                await self._kernels.load_tile_kernels(op)
            if self._extensions.exports_releasing:  # an access after a consumer released an export
                await self._extensions.finish_export_releases()
            if lone is not None and not (self._closing or self._enqueuing or get_ident() != self._thread):
                # (``_submit`` raises the reasons otherwise; this function is KI-protected)
                sub = (submit_launch or ResourceScope._submit_launch)(self, lone, stream)
            else:
                sub = self._submit(op, stream, "run")
            if look is None or prepare is None:
                await c.observe(sub)
                return outcome(sub)
        # ``observe``'s beginning and first look, without its frame (compiled): settled
        # work returns now; anything else waits on in ``observe``. A traced scope records the wait.
        t0 = perf_counter() if c.tracer is not None else 0.0
        try:
            if not began:
                prepare(c, sub)  # type: ignore[misc]
            seen = LOOK_CHECK if step is None else await step(c, sub)  # (compiled: checkpoint + look)
            if seen is LOOK_CHECK:  # (a cancellation may be due: Trio's checkpoint decides)
                await checkpoint()
                seen = look(c, sub)  # type: ignore[misc]
        except BaseException as exc:
            c.left(sub, exc)
            if t0:
                trace_awaited(c, sub, t0)
            raise
        if seen is LOOK_AGAIN:
            await c.observe(sub, t0)
            return outcome(sub)
        if t0:
            trace_awaited(c, sub, t0)
        return outcome(sub) if seen is LOOK_SETTLED else seen

    # ------------------------------------------------------------------ graphs
    async def capture(self, op: DeviceOp[T], *, stream: Stream | None = None) -> CudaGraph[T]:
        """Capture ``op`` into a :class:`~trio_cuda.CudaGraph` without running
        it: ``graph.output`` is the op's output, and ``await
        gpu.run(graph.launch())`` replays the work. The graph keeps what it
        captured alive until it is closed and its replays completed.

        Capturing runs the op's ``then``/``map`` closures once, now. An
        allocation, a host closure, a copy to host memory or a synchronising
        call during the capture raises :class:`~trio_cuda.GraphCaptureError`
        and leaves nothing captured. Captures never overlap (each runs between
        two checkpoints); nested captures are refused.
        """
        from ._graph import capture_graph

        await trio.lowlevel.checkpoint_if_cancelled()
        if isinstance(op, DeviceOp):
            await self._kernels.load_tile_kernels(op)
        graph = await capture_graph(self, op, stream)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return graph

    # ------------------------------------------------------------------ kernels
    async def load(self, *kernels: Kernel | DeviceOp[Any]) -> None:
        """Compile and load ``kernels`` for this scope now, without blocking
        the event loop: on a real GPU, NVRTC and module loading run in a worker
        thread, and a tile kernel's compile runs in one on every backend.
        ``run()`` does this for the kernels it is known to launch; any other
        first use (``submit``, a kernel inside a ``then`` chain) loads the
        kernel synchronously (a tile kernel not yet compiled then compiles on
        the calling thread, and says so in a log warning).

        Each item is a :class:`Kernel` or a :class:`DeviceOp`, whose kernels
        (those known before it runs: the launch itself, the parts of a
        ``zip``...) are loaded. A tile kernel is compiled per argument
        signature, so it is loaded through a launch: ``await
        gpu.load(k.launch(x, y, grid=g))``."""
        await self._kernels.load(kernels)

    def _kernel_function(self, prepared: PreparedLaunch) -> object:
        """The loaded function that ``prepared`` launches, checked against
        this device (``KernelTable.function_for``)."""
        return self._kernels.function_for(prepared)

    # ------------------------------------------------------------------ entry and exit
    def _start_tracing(self, tracer: Tracer) -> None:
        """Record this scope into ``tracer`` from now on (at entry). Tracing
        never fails the program: if it cannot start, the scope runs untraced."""
        driver = self._driver
        caps = driver.capabilities
        try:
            trace_id = tracer.open_scope(self)
            self._trace_id = self._completion.trace_id = self._memory.trace_id = trace_id
            self._trace_cmds = caps.device_clock != "host-observed"
            if tracer.timing and caps.device_timing:
                driver.timing_start(self._streams[0].handle)  # the scope's streams are idle
                self._trace_timing = True
            self._tracer = self._completion.tracer = self._memory.tracer = tracer
        except Exception:  # tracing must never fail the program: the scope runs untraced
            self._trace_timing = False
            log.exception("tracing %r failed when it opened; the scope runs untraced", self)

    async def _run_handoff(self) -> None:
        """The scope's completion-handoff task (see ``Completion.handoff``)."""
        await self._completion.run_handoff()

    async def _drain(self, timeout: float | None) -> tuple[KeyboardInterrupt | None, str]:
        """Drain within ``timeout``, through Ctrl-C. Trio delivers
        ``KeyboardInterrupt`` at the main task's next blocking wait even
        inside a shield; the first one is kept (and re-raised once the scope
        is settled) and the drain goes on; a second one stops the waiting,
        and what is still in flight is then quarantined. Returns the kept
        interrupt and the phrase that says why the drain gave up, if it did."""
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        interrupt: KeyboardInterrupt | None = None
        while True:
            try:
                await self._completion.drain(deadline)
            except KeyboardInterrupt as ki:
                if interrupt is not None:
                    return interrupt, "after a second Ctrl-C stopped the exit's drain"
                interrupt = ki
                log.warning(
                    "Ctrl-C while %r waits for its work in flight (%d submission(s) of its own): "
                    "still waiting for the device (Ctrl-C again to stop waiting; the work still in "
                    "flight is then quarantined, its memory leaked, never freed)",
                    self,
                    self._completion.in_flight,
                )
                continue
            return interrupt, f"after drain_timeout={timeout} s"

    @enable_ki_protection
    async def _close(
        self, drain_timeout: float | None
    ) -> tuple[list[BaseException], KeyboardInterrupt | None]:
        """The exit sequence, whatever the reason: drain (shielded, within
        ``drain_timeout``), quarantine what the drain gave up on, release what
        the scope owns, close, then wait (shielded) until the handoff task
        ended. Returns the errors nobody observed, the handoff's own error
        last, and a Ctrl-C kept while draining; raises what releasing raised."""
        self._closing = True
        c = self._completion
        c.exiting = True
        interrupt: KeyboardInterrupt | None = None
        try:
            with trio.CancelScope(shield=True):
                interrupt, after = await self._drain(drain_timeout)
                self._memory.abandon_foreign(after)  # other scopes' work still holds our memory
                for ext in self._extensions.all():
                    ext.abandon(after)  # still held when the drain gave up
                if c.work_remains():
                    c.abandon_in_flight(after, interrupted=interrupt is not None)
                if self._tracer is not None:
                    try:
                        self._tracer.collect_times(self, self._trace_id)
                    except Exception:  # a trace must never stop the release, nor fail the program
                        log.exception(
                            "tracing %r failed at its exit; the trace may lack its device times", self
                        )
                self._release_everything()
        finally:
            tracer = self._tracer
            if tracer is not None:
                try:
                    tracer.close_scope(self, self._trace_id)
                except Exception:  # a trace must never break the exit, nor fail the program
                    log.exception("tracing %r failed when it closed; the trace may lack its end", self)
            self._closed = c.closed = self._memory.closed = True
            if c.handoff_cs is not None:
                c.handoff_cs.cancel()
            # it ends at once (cancelled, or it sees the scope closed); a Ctrl-C
            # delivered at this wait is kept, as the drain keeps one
            with trio.CancelScope(shield=True):
                while not c.handoff_ended.is_set():
                    try:
                        await c.handoff_ended.wait()
                    except KeyboardInterrupt as ki:
                        if interrupt is None:
                            interrupt = ki
        errors = c.take_errors()
        if c.handoff_error is not None:  # the handoff task crashed
            errors.append(c.handoff_error)
            c.handoff_error = None
        return errors, interrupt

    @enable_ki_protection
    def _release_everything(self) -> None:
        """After the drain: free memory, unload modules, destroy streams."""
        driver = self._driver
        for ext in self._extensions.all():
            ext.close()  # e.g. graphs still open: release them first
        self._memory.free_unleased()
        c = self._completion
        if c.timed_out or c.leak_driver or self._memory.foreign_abandoned:
            # Work may still run: leak modules, streams and driver state too
            # (unloading a module can wait for the device, which may never come).
            return
        if not self._completion.quarantined:
            # With any submission quarantined, every module stays loaded: a
            # kernel of work whose completion is unknown may still run, and it
            # can be reached in many ways (a launch, a graph replay, a shared
            # op); a leaked module is harmless, an unloaded one is not.
            self._kernels.unload_all()
        for s in self._streams:
            driver.destroy_stream(s.handle)
        driver.close()


@enable_ki_protection
def _protected_call(fn: Callable[..., T], /, *args: object) -> T:
    """``fn(*args)``, KI-protected: the compiled ``submit`` has no frame of its
    own, and calls the Python it needs through this (``_claunch_protect.c``)."""
    return fn(*args)


#: the compiled ``_submit_launch`` (``_claunch.submit_launch``);
#: None where the pure-Python path runs (tests turn it off)
submit_launch: Callable[[ResourceScope, KernelLaunch, Stream | None], Submission] | None = None
#: a submission's future: ``DeviceFuture._create``, compiled where built
future_of: Callable[[Submission], DeviceFuture[Any]] = DeviceFuture._create
#: ``submit``'s steps after its frame, compiled (``_claunch.submit_whole``;
#: it honours ``submit_launch`` as set here); None where the pure-Python path runs
submit_whole: Callable[[ResourceScope, DeviceOp[Any], Stream | None], DeviceFuture[Any]] | None = None
_Begin = Callable[[ResourceScope, DeviceOp[Any], Stream | None], Submission | None]
if _compiled.ext is not None:
    _names = ("ResourceScope", "Stream", "Submission", "Completion", "Kernel", "DeviceFuture")
    _compiled.ext.configure_submit(
        {n: globals()[n] for n in (*_names, "KernelTable", "take_launch_leases", "enqueue_unsafe_py")}
        | {"Allocation": Allocation, "FollowWriter": FollowWriter, "LeastLoaded": LeastLoaded}
        | {"ENQUEUING": SubState.ENQUEUING, "IN_FLIGHT": SubState.IN_FLIGHT}
        | {"scope_module": sys.modules[__name__], "submit_module": _submit}
    )
    submit_launch, future_of = _compiled.ext.submit_launch, _compiled.ext.future_of
    submit_whole = _compiled.ext.submit_whole
    # ``scope.submit(op[, stream=s])`` straight to ``submit_whole``, with no frame (the method above
    # is the reference, called for anything else and while ``submit_whole`` is turned off)
    ResourceScope.submit = _compiled.ext.submit_method(  # type: ignore[method-assign]
        ResourceScope.submit, _protected_call, sys.modules[__name__]
    )
    _compiled.ext.configure_trace(  # (a trace's records on the awaited path: _claunch_trace.c)
        {name: globals()[name] for name in (*_names, "Tracer", "perf_counter", "trace_submit")}
        | {"trace_await": Completion.trace_await, "trace_retire": Completion.trace_retire}
        | {"IN_FLIGHT": SubState.IN_FLIGHT, "RUN_CONTEXT": _completion.RUN_CONTEXT}
    )

#: ``unsafe.async_on``'s enqueue: the compiled one (``_claunch.enqueue_unsafe``)
#: where it was built, else the Python one
enqueue_unsafe: Callable[[DeviceOp[Any], Stream], Any] = (
    enqueue_unsafe_py if _compiled.ext is None else _compiled.ext.enqueue_unsafe
)

#: the compiled first look of ``run`` at its work (``_claunch.look``); None
#: where the pure-Python path runs (``observe`` looks; tests turn it off)
look: Callable[[Completion, Submission], object] | None = _completion.look
prepare: Callable[[Completion, Submission], None] | None = _completion.prepare
#: ``run``'s checkpoint and first look in one awaitable (``_claunch.step``), or None
step: Callable[[Completion, Submission], Awaitable[object]] | None = _completion.step
#: ``run``'s steps for a lone launch up to its first checkpoint, compiled (``_claunch.begin``,
#: while the three above are the compiled ones); None where the pure-Python path runs
begin: _Begin | None = None if _compiled.ext is None else _compiled.ext.begin
