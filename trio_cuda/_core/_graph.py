"""CUDA graphs: capture a DeviceOp once, replay it many times (rule 8).

``graph = await gpu.capture(op)`` runs ``op._enqueue`` once against a
*recorder* instead of a submission: the work goes through the driver's
capture (stream capture on the GPU, a command recording on the simulator)
and nothing executes. ``graph.launch()`` is a DeviceOp that replays it.

Invariants:

* Capture is synchronous between two checkpoints: no other task of the loop
  runs while a capture is in progress, so captures from several tasks are
  serialized, never interleaved. A capture started while another capture or
  submission is being enqueued (from a ``then``/``map`` closure) is refused,
  and so is capturing a ``graph.launch()`` into another graph.
* A failed capture leaves nothing behind: the driver's capture is ended and
  discarded (the stream is usable), and every handle and owner the recorder
  took is released before the error is raised. Capture, update and the step
  from a recorded capture to a graph are KI-protected: a Ctrl-C there is
  delivered at the next checkpoint, never between the driver's begin and
  end of a capture.
* A graph owns a *generation* of resources: one internal handle per captured
  allocation (so closing or dropping the user's arrays never frees them), the
  kernels' prepared launches and modules, and the captured argument storage
  (staging buffers of host-to-device copies). A generation is released only
  once it is no longer current (``close()``, ``update()``) *and* every replay
  that used it retired. The driver's executable graph is destroyed only once
  the graph is closed and no replay is in flight.
* Every replay is a normal submission: it takes the leases of the current
  generation again (cross-stream conflicts become device-side waits; a
  quarantined allocation fails it with ``CompletionUnknownError``) and
  retains a replay token; the token's release, when the handoff task retires
  the replay, is what lets a superseded generation or a closed graph go. A
  replay whose completion is unknown keeps its token, so its generation and
  the executable graph are leaked on purpose, like any quarantined owner.
* Only work whose effect is fixed at capture can be captured: kernel
  launches, device-to-device and host-to-device copies (the host data is
  staged at capture and copied again by every replay), and fills. Host
  closures, copies to host memory, allocations and synchronising calls are
  refused with :class:`~trio_cuda.GraphCaptureError`.
* Graphs still open when their scope exits are closed by the scope after its
  drain, before it frees memory and unloads modules.
* A new executable graph is uploaded (``graph_upload``) right after it is
  instantiated, by the same call, in a worker thread where the driver asks
  (``instantiate_in_thread``), so the first replay does not pay for it. An
  upload that fails destroys the executable graph and releases the
  generation before its error is raised: nothing is left behind.
* ``update()`` records on the loop (between two checkpoints, like a capture)
  and, where the driver asks, runs ``graph_update`` in a worker thread. The
  thread is shielded: once recorded, an update is carried through and applied
  (or, if the driver refused it, its generation released) before ``update()``
  returns, whatever happens to the caller. While it runs the graph has a
  *pending update*, and no other driver call touches the executable graph
  (CUDA graph objects are not thread-safe): another ``update()`` waits for it;
  ``close()`` defers destroying the executable graph until it ended; a replay
  enqueued meanwhile takes the pending update's lock, so it either goes first
  and runs the current generation (the driver step had not started; launches
  already enqueued are not affected by an update) or comes after the driver
  step and runs the new one (waiting for it, on the loop, only if the step is
  running at that moment). The scope's drain waits for pending updates; after
  ``drain_timeout`` they are leaked with the scope's driver state.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar

import attrs
import numpy as np
import trio
from trio.lowlevel import enable_ki_protection

from ._array import Allocation, DeviceArray, h2d_source
from ._errors import CudaError, GraphCaptureError, ScopeClosedError
from ._final import NoPublicConstructor, final
from ._ops import RUN, Access, DeviceOp, capture_refusal
from ._submit import take_leases

if TYPE_CHECKING:
    from types import TracebackType

    from ._driver import DeviceContext
    from ._enqueue import EnqueueTarget
    from ._launch import PreparedLaunch
    from ._scope import ResourceScope
    from ._stream import Stream
    from ._submit import Submission

__all__ = ["CudaGraph", "GraphStatistics", "OpenGraphs", "capture_graph"]

T = TypeVar("T")


@final
class OpenGraphs:
    """The graphs of one scope not closed yet (its extension object); the
    scope closes them after its drain, before it frees memory."""

    __slots__ = ("graphs", "scope", "updating")

    def __init__(self, scope: ResourceScope) -> None:
        self.scope = scope
        self.graphs: dict[CudaGraph[Any], None] = {}
        #: updates whose driver step runs (or may still run) in a worker thread
        self.updating: dict[_PendingUpdate, None] = {}

    async def drain(self) -> None:
        """Wait for the updates in progress: their worker threads use the
        executable graphs (and the driver context) until they return."""
        if not self.updating:
            await trio.lowlevel.checkpoint()
            return
        for pending in list(self.updating):
            await pending.finished.wait()

    def abandon(self, after: str) -> None:
        # A replay still in flight keeps its graph (and is quarantined with it).
        # An update still running in a worker thread uses its executable graph
        # and the driver context: leak them with the scope's driver state.
        if not self.updating:
            return
        self.scope._completion.leak_driver = True  # leak modules, streams and the context too
        warnings.warn(
            ResourceWarning(
                f"trio_cuda scope {self.scope!r} exited while {len(self.updating)} graph update(s) still "
                f"ran in a worker thread {after}; their executable graphs and the "
                f"scope's driver state are leaked (never destroyed)"
            ),
            stacklevel=3,
        )

    def close(self) -> None:
        """Close every graph still open. Errors are kept for the exit's group."""
        graphs, self.graphs = self.graphs, {}
        for graph in list(graphs):
            try:
                graph.close()
            except Exception as exc:
                self.scope._completion.add_error(exc)


@final
@attrs.frozen
class GraphStatistics:
    """A snapshot of one graph (``graph.statistics()``)."""

    operations: int  #: captured work items: kernel launches, copies and fills
    kernels: int  #: captured kernel launches
    replays: int  #: replays submitted so far
    in_flight: int  #: replays submitted and not retired yet
    updates: int  #: successful ``update()`` calls
    retained_allocations: int  #: allocations the graph keeps alive (all generations)
    #: bytes of the ``retained_allocations`` (whole allocations, each counted
    #: once, though the captured work may touch only part of one)
    retained_bytes: int
    #: :meth:`~trio_cuda.CudaGraph.close` was called, or the scope exited: no more
    #: replays; what the graph retains goes once the replays in flight retired
    closed: bool
    destroyed: bool  #: the driver's executable graph was destroyed


def _label(op: object) -> str:
    text = repr(op)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------- generation


@final
class _Generation:
    """What one capture retains, and how many replays still use it."""

    __slots__ = (
        "accesses",
        "after",
        "handles",
        "in_flight",
        "kernels",
        "leases",
        "operations",
        "output",
        "owners",
        "released",
        "scope",
    )

    def __init__(self, scope: ResourceScope) -> None:
        self.scope = scope
        #: one internal handle and the strongest access per captured view
        #: extent (allocation, byte offset, bytes): each replay leases exactly
        #: the bytes the captured work touches
        self.leases: dict[tuple[Allocation, int, int], tuple[DeviceArray, Access]] = {}
        self.accesses: tuple[tuple[DeviceArray, Access], ...] = ()
        self.handles: list[DeviceArray] = []
        self.owners: list[object] = []
        #: submissions (of shared ops) every replay must order after
        self.after: list[Submission] = []
        self.output: object = None
        self.operations = 0
        self.kernels = 0
        self.in_flight = 0
        self.released = False

    def record(self, accesses: Sequence[tuple[DeviceArray, Access]]) -> None:
        leases = self.leases
        for arr, access in accesses:
            alloc = arr._alloc
            key = (alloc, arr._offset, arr.nbytes)
            held = leases.get(key)
            if held is None:
                handle = DeviceArray._create(alloc, arr.shape, arr.dtype, order=arr.order, offset=arr._offset)
                self.handles.append(handle)
                leases[key] = (handle, access)
            elif access is Access.WRITE and held[1] is not Access.WRITE:
                leases[key] = (held[0], access)

    def seal(self, output: object) -> None:
        self.output = output
        self.accesses = tuple(self.leases.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.allocations())

    def allocations(self) -> set[Allocation]:
        """The allocations the captured work touches."""
        return {key[0] for key in self.leases}

    def release(self) -> None:
        """Drop everything (idempotent). The allocations are freed once no
        other handle and no in-flight lease holds them."""
        if self.released:
            return
        self.released = True
        handles, self.handles = self.handles, []
        self.leases = {}
        self.accesses = ()
        self.owners = []
        self.after = []
        self.output = None
        for h in handles:
            h.close()


# --------------------------------------------------------------------------- recorder


@final
class GraphRecorder:
    """The enqueue target of a graph capture (``EnqueueTarget``). It takes no
    lease and records no marker: it checks the arrays, records the accesses
    and the owners into the generation, and sends the work to the driver's
    capture. What a replay could not repeat is refused, explicitly, method
    by method."""

    __slots__ = ("driver", "gen", "label", "scope", "stream")

    unsafe = False
    preflight = False
    capturing = True

    def recall(self) -> object:
        return RUN  # closures run as the capture reaches them

    def keep(self, value: object) -> object:
        return value

    def __init__(self, scope: ResourceScope, stream: Stream, gen: _Generation, label: str) -> None:
        self.scope = scope
        self.stream = stream
        self.gen = gen
        self.label = label
        self.driver: DeviceContext = scope._driver

    def _refuse(self, what: str) -> NoReturn:
        raise GraphCaptureError(f"{what} cannot be captured into a graph")

    @property
    def submission(self) -> NoReturn:
        # Only a shared() op that has not executed yet asks for its submission.
        self._refuse(
            "a shared() op that has not executed yet (a graph would run it at every replay; "
            "run it once before capturing, or capture the op without .shared())"
        )

    # ------------------------------------------------------------------ retention
    def retain(self, obj: object) -> None:
        self.gen.owners.append(obj)

    def on_retire(self, fn: object) -> None:
        self._refuse("work that runs a host step at retirement")

    def enqueued(self) -> None:
        pass

    def mark(self) -> None:
        return None  # a replay's device times are not the capture's

    def traced(self, name: str, mark: int | None = None) -> None:
        pass  # each replay is traced as one enqueue

    def use(self, accesses: Sequence[tuple[DeviceArray, Access]], *, what: str = "argument") -> None:
        take_leases(self.scope, self.stream, None, accesses, what)  # checks only
        self.gen.record(accesses)
        self.gen.operations += 1  # one piece of work per use()

    def after(self, other: Submission | None) -> None:
        if other is not None and other not in self.gen.after:
            self.gen.after.append(other)

    # ------------------------------------------------------------------ work
    def launch(self, prepared: PreparedLaunch, accesses: Sequence[tuple[DeviceArray, Access]]) -> None:
        function = self.scope._kernel_function(prepared)
        self.use(accesses, what=prepared.kernel.name)
        self.gen.owners += (prepared, function)
        self.driver.launch(self.stream.handle, function, prepared)
        self.gen.kernels += 1

    def copy(self, dst: object, src: object) -> None:
        d = self.driver
        h = self.stream.handle
        if isinstance(dst, DeviceArray) and isinstance(src, DeviceArray):
            if dst._alloc.scope is not self.scope or src._alloc.scope is not self.scope:
                self._refuse("ops.copy between the memory of two scopes")
            # exactly the leases a direct copy takes: two views of one
            # allocation are two extents, and each replay leases both
            self.use([(src, Access.READ), (dst, Access.WRITE)], what="copy")
            d.copy_d2d(h, dst.ptr, src.ptr, dst.nbytes)
        elif isinstance(dst, DeviceArray):
            assert isinstance(src, np.ndarray)
            host = h2d_source(dst, src)
            self.use([(dst, Access.WRITE)], what="copy: dst")
            token = d.copy_h2d(h, dst.ptr, host)
            if token is not None:
                self.gen.owners.append(token)  # the captured argument storage
        else:
            self._refuse(
                "ops.copy to a host array (a replay's host copy would race with the next replay; "
                "copy results out with gpu.to_host after the replay)"
            )

    def fill(self, arr: DeviceArray, pattern: bytes) -> None:
        self.use([(arr, Access.WRITE)], what="fill")
        self.driver.fill(self.stream.handle, arr.ptr, pattern, arr.size)

    def host_step(self, fn: object, args: tuple[Any, ...]) -> NoReturn:
        self._refuse("ops.host_closure (it needs the scope's completion handoff at every replay)")


def _is_capture_error(exc: BaseException) -> bool:
    """A refusal of the capture itself (by the core or the driver)."""
    if isinstance(exc, GraphCaptureError):
        return True
    return isinstance(exc, CudaError) and "CAPTURE" in exc.name


@enable_ki_protection
def _record(scope: ResourceScope, op: object, stream: Stream | None, what: str) -> tuple[_Generation, object]:
    """Capture ``op`` into a new generation and a driver graph template.
    On any error, nothing is left behind (see the module invariants). It is
    KI-protected: a Ctrl-C between the driver's begin and end of the capture
    would leave the stream capturing for good, so Trio delivers it at the
    next checkpoint instead (the op's closures run protected too)."""
    if not isinstance(op, DeviceOp):
        from ._builder import LaunchBuilder

        if isinstance(op, LaunchBuilder):
            raise TypeError(
                f"{what}: op: a LaunchBuilder is inert and cannot be captured; "
                f"call .finalize_unchecked() first"
            )
        raise TypeError(f"{what}: op: expected a DeviceOp, got {type(op).__name__}")
    scope._check_open(what)
    label = _label(op)
    refusal = capture_refusal(op)
    if refusal is not None:  # declared by the op: refused before anything is recorded
        raise GraphCaptureError(f"{what}: op {label}: {refusal} cannot be captured into a graph")
    if scope._enqueuing:
        raise GraphCaptureError(
            f"{what}: op {label}: cannot capture while another capture or submission is being "
            f"enqueued (nested captures are not supported)"
        )
    s = scope._pick(op, stream)
    scope._completion.flush(s)  # the markers of earlier work on s must not end up in the graph
    driver = scope._driver
    gen = _Generation(scope)
    recorder = GraphRecorder(scope, s, gen, label)
    driver.begin_capture(s.handle)
    scope._enqueuing = True
    capturing = True
    try:
        out = op._enqueue(recorder)
        capturing = False
        template = driver.end_capture(s.handle)
    except BaseException as exc:
        if capturing:
            try:
                driver.abort_capture(s.handle)
            except Exception as abort_exc:  # pragma: no cover - best effort
                exc.add_note(f"ending the capture failed too: {abort_exc!r}")
        gen.release()
        if _is_capture_error(exc):
            raise GraphCaptureError(f"{what}: op {label}: {exc}") from exc
        raise
    finally:
        scope._enqueuing = False
    gen.seal(out)
    return gen, template


# --------------------------------------------------------------------------- replay


@final
class _Replay:
    """Retained by each replay submission; released when the handoff task
    retires it (never, if its completion is unknown)."""

    __slots__ = ("gen", "graph")

    def __init__(self, graph: CudaGraph[Any], gen: _Generation) -> None:
        self.graph = graph
        self.gen = gen
        gen.in_flight += 1
        graph._in_flight += 1

    def __del__(self) -> None:
        graph = self.graph
        try:
            if threading.get_ident() == graph._thread:
                graph._replay_done(self.gen)
            else:  # a garbage collection on another thread: hand it to the loop
                graph._scope._token.run_sync_soon(graph._replay_done, self.gen)
        except Exception:  # pragma: no cover - interpreter shutdown, loop gone
            pass


@final
class _PendingUpdate:
    """An update whose driver step (``graph_update``) runs in a worker thread.

    ``lock`` is held by the worker for the driver call, and on the loop by a
    replay enqueued meanwhile for its launch call, so that the two never
    overlap on the executable graph. ``ran`` and ``skipped`` change under it.
    """

    __slots__ = ("applied", "error", "finished", "gen", "lock", "ran", "skipped")

    def __init__(self, gen: _Generation) -> None:
        self.gen = gen
        self.lock = threading.Lock()
        self.ran = False  #: the driver step returned (``error`` says how)
        self.skipped = False  #: the step never started, and never will
        self.error: BaseException | None = None
        self.applied = False  #: settled on the loop (``CudaGraph._apply``)
        self.finished = trio.Event()  #: the updating task is done with it

    def step(self, driver: DeviceContext, graph_exec: object, template: object) -> None:
        """The worker thread's part. Errors are kept for the loop."""
        with self.lock:
            if self.skipped:
                return
            try:
                driver.graph_update(graph_exec, template)
            except BaseException as exc:
                self.error = exc
            finally:
                self.ran = True


@final
class _GraphLaunch(DeviceOp[T]):
    __slots__ = ("_graph",)

    def __init__(self, graph: CudaGraph[T]) -> None:
        self._graph = graph

    def _enqueue(self, ctx: EnqueueTarget) -> T:
        g = self._graph
        if ctx.capturing:
            raise GraphCaptureError(
                f"{g!r}.launch(): a graph launch cannot be captured into another graph "
                f"(nested graphs are not supported)"
            )
        if g._closed:
            raise ScopeClosedError(f"graph.launch(): the graph is closed ({g!r})")
        if ctx.scope is not g._scope:
            raise ValueError(
                f"graph.launch(): expected a submission on the scope that captured the graph, "
                f"got one on {ctx.scope!r}"
            )
        if ctx.preflight:  # conflicts="error": the leases a replay takes, checked only
            ctx.use(g._gen.accesses, what=f"graph.launch() of {g._label}")
            for other in g._gen.after:
                ctx.after(other)
            return g._gen.output  # type: ignore[return-value]
        pending = g._pending
        if pending is None:
            return self._replay(ctx, g)
        # An update's driver step may run in a worker thread: the launch call
        # must not overlap it. Holding the lock, either the step returned (the
        # executable graph has the new parameters: apply the update now and
        # replay the new generation), or it has not started and waits for this
        # replay, which runs the current generation (an update does not affect
        # launches already enqueued). The lock is only contended, and the loop
        # only waits, while the driver step runs.
        with pending.lock:
            if pending.ran:
                g._apply(pending)
            return self._replay(ctx, g)

    def _replay(self, ctx: EnqueueTarget, g: CudaGraph[T]) -> T:
        gen = g._gen
        ctx.use(gen.accesses, what=f"graph.launch() of {g._label}")
        for other in gen.after:
            ctx.after(other)
        if ctx.submission is not None:
            ctx.retain(_Replay(g, gen))
        mark = ctx.mark()
        ctx.driver.graph_launch(ctx.stream.handle, g._exec)
        ctx.enqueued()
        ctx.traced(f"graph {g._label}", mark)
        g._replays += 1
        return gen.output  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"{self._graph._label}.launch()"


# --------------------------------------------------------------------------- graph


@final
class CudaGraph(Generic[T], metaclass=NoPublicConstructor):
    """A captured DeviceOp that can be replayed cheaply; ``T`` is the
    captured op's output type.

    Create one with ``graph = await gpu.capture(op)``. ``graph.output`` is
    the captured op's output; ``await gpu.run(graph.launch())`` replays the
    work and returns it. Each replay takes the leases of everything the graph
    touches again, so it is ordered against other work like any submission.

    The graph keeps every resource it captured (arrays, kernels and their
    modules, argument storage) alive until :meth:`close` and until every
    replay in flight has completed; closing the user's array handles does
    not free them. ``async with graph`` closes it on the way out; a graph
    still open when its scope exits is closed then.
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_destroyed",
        "_exec",
        "_gen",
        "_in_flight",
        "_label",
        "_launch",
        "_old",
        "_pending",
        "_replays",
        "_scope",
        "_thread",
        "_updates",
    )

    _obtain = "use 'await scope.capture(op)'"

    _scope: ResourceScope
    _exec: object
    _gen: _Generation
    _old: list[_Generation]
    _pending: _PendingUpdate | None
    _label: str
    _launch: _GraphLaunch[T]
    _closed: bool
    _destroyed: bool
    _in_flight: int
    _replays: int
    _updates: int
    _thread: int

    @classmethod
    def _create(cls, scope: ResourceScope, graph_exec: object, gen: _Generation, label: str) -> CudaGraph[T]:
        self = object.__new__(cls)
        self._scope = scope
        self._exec = graph_exec
        self._gen = gen
        self._old = []
        self._pending = None
        self._label = label
        self._launch = _GraphLaunch(self)
        self._closed = False
        self._destroyed = False
        self._in_flight = 0
        self._replays = 0
        self._updates = 0
        self._thread = threading.get_ident()
        scope._extensions.get(OpenGraphs).graphs[self] = None
        return self

    # ------------------------------------------------------------------ facts
    @property
    def output(self) -> T:
        """The output of the captured op (of the last :meth:`update`): what
        ``await gpu.run(graph.launch())`` returns."""
        return self._gen.output  # type: ignore[return-value]

    @property
    def scope(self) -> ResourceScope:
        """The scope the graph was captured in (replays must run there)."""
        return self._scope

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (or the scope exited)."""
        return self._closed

    def statistics(self) -> GraphStatistics:
        """A snapshot of the graph's counters and retention.

        It reads tables the scope's loop changes: from another thread or Trio
        run of an open scope it raises ``RuntimeError`` (a worker thread uses
        ``trio.from_thread.run_sync(graph.statistics)``); once the scope has
        closed, it may be read from any thread."""
        from ._future import check_reader

        check_reader("statistics", self._scope, "trio.from_thread.run_sync(graph.statistics)")
        gens = [g for g in (self._gen, *self._old) if not g.released]
        return GraphStatistics(
            operations=self._gen.operations,
            kernels=self._gen.kernels,
            replays=self._replays,
            in_flight=self._in_flight,
            updates=self._updates,
            retained_allocations=len(allocs := {a for g in gens for a in g.allocations()}),
            retained_bytes=sum(a.nbytes for a in allocs),
            closed=self._closed,
            destroyed=self._destroyed,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        ops = self._gen.operations
        return f"<CudaGraph of {self._label} ({ops} ops, {state}, {self._in_flight} in flight)>"

    # ------------------------------------------------------------------ replay
    def launch(self) -> DeviceOp[T]:
        """A DeviceOp that replays the graph: submit it with ``gpu.run``,
        ``gpu.submit`` or ``unsafe.async_on`` (then the caller keeps the
        graph open until the replay completed). Its output is
        :attr:`output`."""
        if self._closed:
            raise ScopeClosedError(f"graph.launch(): the graph is closed ({self!r})")
        return self._launch

    @enable_ki_protection
    async def update(self, op: DeviceOp[T], *, stream: Stream | None = None) -> None:
        """Capture ``op`` and make later replays run its work instead.

        ``op`` must have the same topology as the captured work (the same
        sequence of kernel launches, copies and fills); its parameters may
        differ: kernel arguments, the arrays used, the host data of
        host-to-device copies (e.g. new inputs copied into the captured
        buffers before the kernels run). On the GPU this is
        ``cuGraphExecUpdate``, run in a worker thread so that a large update
        never blocks the event loop. If the topology differs,
        :class:`~trio_cuda.GraphCaptureError` is raised and the graph is
        unchanged. Replays already submitted run the old work; its resources
        are released once they retired. A replay submitted while an update
        is in progress runs the old work if the driver has not started
        updating yet, and otherwise the new work, once the driver is done.

        Updates of one graph run one at a time (a second one waits for the
        first). A cancellation before the op is recorded leaves the graph
        unchanged; one that arrives while the driver works does not interrupt
        it: the update is applied, and ``update()`` returns normally.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while self._pending is not None:  # one update at a time
            await self._pending.finished.wait()
        if self._closed:
            raise ScopeClosedError(f"update: the graph is closed ({self!r})")
        scope = self._scope
        driver = scope._driver
        gen, template = _record(scope, op, stream, "update")
        error: BaseException | None = None
        if driver.capabilities.instantiate_in_thread:
            error = await self._update_in_thread(driver, gen, template)
        else:
            try:
                driver.graph_update(self._exec, template)
            except BaseException as exc:
                error = exc
                gen.release()
            else:
                self._install(gen)
        if error is not None:
            if _is_capture_error(error):
                why = f"update: op {_label(op)}: cannot update {self!r}: {error}"
                raise GraphCaptureError(why) from error
            raise error
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def _update_in_thread(
        self, driver: DeviceContext, gen: _Generation, template: object
    ) -> BaseException | None:
        """Run ``graph_update`` in a worker thread and apply its result;
        return the driver's error, if any.

        The wait is shielded (and the thread never abandoned): a cancellation
        cannot stop the driver call, and giving up on it would leave the
        executable graph with parameters that the graph's current generation
        does not retain (or release a generation that replays use), so the
        caller waits for the step, and its result is applied on the way out.
        Should the thread never start (an error of ``to_thread`` itself), the
        step is marked skipped under its lock and never runs; its template is
        then left to the garbage collector."""
        pending = _PendingUpdate(gen)
        self._pending = pending
        updating = self._scope._extensions.get(OpenGraphs).updating
        updating[pending] = None
        try:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(pending.step, driver, self._exec, template)
        finally:
            with pending.lock:  # free at once, unless the thread is in the driver call
                if not pending.ran:
                    pending.skipped = True
            self._apply(pending)  # unless a replay applied it already
            updating.pop(pending, None)
            pending.finished.set()
        return pending.error

    def _install(self, gen: _Generation) -> None:
        """Make ``gen`` current (its update succeeded)."""
        old = self._gen
        self._gen = gen
        self._updates += 1
        if old.in_flight:
            self._old.append(old)
        else:
            old.release()

    def _apply(self, pending: _PendingUpdate) -> None:
        """Settle an update whose driver step returned (or never ran), once,
        on the loop: by the updating task, or by a replay that came first."""
        if pending.applied:
            return
        pending.applied = True
        if self._pending is pending:
            self._pending = None
        if self._scope._closed:
            return  # exited past drain_timeout: the graph was leaked with the driver state
        if pending.ran and pending.error is None:
            self._install(pending.gen)
        else:
            pending.gen.release()
        if self._closed:  # closed meanwhile: release what it deferred
            self._release_closed()

    def _replay_done(self, gen: _Generation) -> None:
        """A replay of ``gen`` retired (its token was released)."""
        gen.in_flight -= 1
        self._in_flight -= 1
        scope = self._scope
        if scope._closed:
            return  # the scope released (or leaked) everything already
        try:
            if not gen.in_flight and (gen is not self._gen or self._closed):
                gen.release()
                if gen in self._old:
                    self._old.remove(gen)
            if self._closed and not self._in_flight:
                self._destroy()
        except Exception as exc:
            scope._completion.add_error(exc)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Close the graph (idempotent). Its resources are released, and the
        driver's executable graph destroyed, once every replay in flight has
        completed; later ``launch()`` calls raise ``ScopeClosedError``.
        From another thread, the close is handed to the scope's loop."""
        if self._closed:
            return
        if threading.get_ident() != self._thread:
            try:
                self._scope._token.run_sync_soon(self.close)
            except trio.RunFinishedError:  # pragma: no cover - the scope exited with its run
                pass
            return
        self._closed = True
        graphs = self._scope._extensions.find(OpenGraphs)
        if graphs is not None:
            graphs.graphs.pop(self, None)
        self._release_closed()

    def _release_closed(self) -> None:
        """The graph is closed: release the generations no replay uses, and
        destroy the executable graph once no replay is in flight."""
        for gen in (self._gen, *self._old):
            if not gen.in_flight:
                gen.release()
        self._old = [g for g in self._old if not g.released]
        if not self._in_flight:
            self._destroy()

    def _destroy(self) -> None:
        if self._destroyed or self._pending is not None:
            return  # an update's worker thread may use it: its end destroys it (``_apply``)
        self._destroyed = True
        graph_exec, self._exec = self._exec, None
        self._scope._driver.destroy_graph(graph_exec)

    async def __aenter__(self) -> CudaGraph[T]:
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


# --------------------------------------------------------------------------- scope side


def _instantiate(driver: DeviceContext, template: object) -> tuple[object, Exception | None]:
    """``instantiate``, then ``graph_upload`` of the new executable graph, in
    one call (so in one worker thread where the driver asks). An upload error
    comes back with the executable graph, which the loop destroys."""
    graph_exec = driver.instantiate(template)
    try:
        driver.graph_upload(graph_exec)
    except Exception as exc:
        return graph_exec, exc
    return graph_exec, None


@enable_ki_protection
async def capture_graph(scope: ResourceScope, op: DeviceOp[T], stream: Stream | None) -> CudaGraph[T]:
    """``scope.capture`` after its first checkpoint: record now, then
    instantiate and upload, in a worker thread where the driver asks for it
    (milliseconds for large graphs on a GPU). The thread is shielded: its
    result is kept (or destroyed) whatever happens to the caller. A failed
    upload destroys the executable graph and releases what the capture
    retained, then raises the driver's error."""
    gen, template = _record(scope, op, stream, "capture")
    driver = scope._driver
    try:
        if driver.capabilities.instantiate_in_thread:
            with trio.CancelScope(shield=True):
                graph_exec, failed = await trio.to_thread.run_sync(_instantiate, driver, template)
        else:
            graph_exec, failed = _instantiate(driver, template)
        if failed is not None:
            try:
                driver.destroy_graph(graph_exec)
            except Exception as exc:  # pragma: no cover - best effort
                failed.add_note(f"destroying the executable graph failed too: {exc!r}")
            raise failed
    except BaseException:
        gen.release()
        raise
    return CudaGraph._create(scope, graph_exec, gen, _label(op))
