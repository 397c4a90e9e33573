"""The cuda backend's DeviceContext: :class:`CudaContext` and :func:`open_context`.

Invariants:

* One :class:`CudaContext` per scope. It retains the device's primary context
  (``primary``; released in :meth:`CudaContext.close`) and makes it current on
  the calling thread.
* Every method runs on the Trio loop thread, except where
  :attr:`CudaContext.capabilities` says otherwise (``load_kernel``,
  ``instantiate``, ``foreign_fence``): those make the context current in
  their own thread.
* ``free`` is only called by the core when no enqueued work can touch the
  memory; it is stream-ordered (``cuMemFreeAsync``) on an internal stream.
* A sticky error (a kernel fault) breaks the context for good: nothing of it
  is freed afterwards (its pinned memory, streams and modules are leaked on
  purpose).
* The class has no base classes. It holds its components as fields, each
  owning its state: ``_state`` (:class:`~.state.ContextState`: device,
  CUcontext, sticky error), ``_table`` (:class:`~.streams.StreamTable`),
  ``_completion`` (:class:`~.completion.CompletionWaiter`), ``_staging``
  (:class:`~.staging.StagingPool`), ``_graphs`` (:class:`~.graphs.Graphs`),
  ``_kernels`` (:class:`~.launch.Kernels`) and ``_timing``
  (:class:`~.timing.Timing`). Each protocol method delegates to the
  component that owns it; this module itself holds memory, copies between
  devices (with ``peer``), interop and close. Argument checks shared with
  the simulator come from ``_common``.
* The hot path adds no call: ``launch``, ``record_marker``,
  ``poll_marker``, ``notify_submitted``, ``wait_for_progress`` and
  ``timing_mark`` are the components' bound methods, set on the instance at
  construction (shadowing the delegating methods of the class, which do the
  same thing one call later). With direct driver calls, ``launch``,
  ``record_marker``, ``poll_marker`` and ``notify_submitted`` are their
  compiled forms (:func:`.direct.hot_methods`), which call those bound
  methods for all but the common case. Two reads take one attribute hop more than
  when the context was one object: the sticky error of ``poll_marker`` on a
  pending marker (through the state) and the stream check of a launch's
  first enqueue (through the table).
* The tunables (``wait_strategy``, ``spin_budget``, ``marker_mode``, ...)
  are properties that read and write the component owning them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, final, overload

import numpy as np

from ..._core._driver import Capabilities, Finisher, Gate, Marker, Poll, StreamHandle
from ..._core._errors import CudaError
from .. import _common
from . import direct
from . import primary as _primary
from .bindings import cu
from .completion import CompletionWaiter
from .errors import check, cuda_error
from .graphs import CudaGraphExec, CudaGraphTemplate, Graphs
from .launch import CudaFunction, Kernels
from .staging import StagingPool
from .state import ContextState
from .streams import CudaGate, CudaMarker, CudaStream, StreamTable
from .timing import Timing

if TYPE_CHECKING:
    from ..._core._driver import DeviceContext
    from ..._core._kernel import Kernel
    from ..._core._launch import PreparedLaunch

__all__ = ["CudaContext", "open_context"]

log = logging.getLogger("trio_cuda")


T = TypeVar("T")


class _Setting(Generic[T]):
    """A setting of one of the context's components (named by the
    attribute that holds it), read and written through the context."""

    __slots__ = ("component", "name")

    def __init__(self, component: str) -> None:
        self.component = component
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, ctx: None, owner: type | None = None) -> _Setting[T]: ...
    @overload
    def __get__(self, ctx: object, owner: type | None = None) -> T: ...
    def __get__(self, ctx: object, owner: type | None = None) -> T | _Setting[T]:
        if ctx is None:  # on the class: the descriptor itself
            return self
        value: T = getattr(getattr(ctx, self.component), self.name)
        return value

    def __set__(self, ctx: object, value: T) -> None:
        setattr(getattr(ctx, self.component), self.name, value)


@final
class CudaContext:
    """One scope's view of a CUDA device (the DeviceContext protocol).

    Tunables (attributes, for experiments and benchmarks):

    * ``wait_strategy``: ``"adaptive"`` (default: spin, then a waiter thread),
      ``"sleep"`` (spin, then poll flags from the loop with ``trio.sleep``
      backoff), ``"event"`` (markers also record events; poll them with
      ``cuEventQuery`` from the loop), ``"thread"`` (markers also record
      blocking-sync events; a waiter thread blocks on the oldest head's).
    * ``spin_budget``: seconds of cooperative spinning (``checkpoint()``
      between flag reads) before handing off.
    * ``inline_spin``: seconds of busy-waiting without yielding, only while no
      other Trio task is runnable (0 disables it).
    * ``wait_marker_mode``: ``"event"`` (when the marker is the
      newest point of its stream, record an event there now and
      ``cuStreamWaitEvent``; else as "flag") or ``"flag"`` (default:
      ``cuStreamWaitValue32(GEQ)`` on the marker's pinned slot).
    * ``marker_mode``: ``"hybrid"``, ``"deferred"`` or ``"eager"`` (default)
      flag writes (see ``record_marker``).

    ``docs/design/completion.md`` has the measurements behind the defaults.
    """

    def __init__(self, ordinal: int = 0) -> None:
        if cu is None:  # pragma: no cover
            raise RuntimeError("cuda.bindings is not importable")
        state = self._state = ContextState(ordinal)
        self.ordinal = ordinal
        self.info = state.info
        self.driver_version = state.driver_version
        table = self._table = StreamTable(state)
        self._stream = table.stream
        self._completion = CompletionWaiter(state, table)
        self._staging = StagingPool(state, table)
        self._graphs = Graphs(state, table)
        kernels = self._kernels = Kernels(state, table)
        timing = self._timing = Timing(table)
        #: the core's per-await spin and look budgets (``Completion._observe``) and marker
        #: batching; load_kernel makes the context current in its thread, so it
        #: may run in a worker thread, and so may instantiate.
        #: foreign_fence(None) synchronises the context: the core runs it in a
        #: worker thread where it can; foreign_fence(stream) may be called from
        #: any thread (a DLPack deleter)
        self.capabilities = Capabilities(
            batch_markers=True,
            await_spin=50e-6,
            await_budget=500e-6,
            load_in_thread=True,
            instantiate_in_thread=True,
            foreign_fence_blocks=True,
            foreign_fence_threadsafe=True,
            device_timing=True,
        )
        # The hot path: the components' own bound methods, so that no call is
        # added (they shadow the delegating methods of the class, below);
        # with direct driver calls, the compiled forms of three of them.
        hot = direct.hot_methods(kernels, table)
        if hot is not None:
            self.launch, self.record_marker, self.poll_marker, self.notify_submitted = hot  # type: ignore[method-assign]
        else:
            self.launch = kernels.launch  # type: ignore[method-assign]
            self.record_marker = table.record_marker  # type: ignore[method-assign]
            self.poll_marker = table.poll_marker  # type: ignore[method-assign]
            self.notify_submitted = table.notify_submitted  # type: ignore[method-assign]
        self.wait_for_progress = self._completion.wait_for_progress  # type: ignore[method-assign]
        self.timing_mark = timing.mark  # type: ignore[method-assign]

    # ------------------------------------------------------------------ facts
    def __repr__(self) -> str:
        state = "closed" if self._state.closed else f"{len(self._table.streams)} streams"
        return f"<CudaContext {self.info.name!r} (cuda:{self.ordinal}) {state}>"

    @property
    def sticky_error(self) -> CudaError | None:
        """The sticky error that broke this context, if any."""
        return self._state.sticky

    @property
    def state(self) -> ContextState:
        """The facts this context's components share (device, CUcontext,
        default memory pool, sticky error), for copies between devices."""
        return self._state

    # ------------------------------------------------------------------ tunables
    # settings of the components, read and written through the context (tests
    # and benchmarks tune them; see the class docs)
    wait_strategy = _Setting[str]("_completion")
    spin_budget = _Setting[float]("_completion")
    inline_spin = _Setting[float]("_completion")
    error_check_interval = _Setting[float]("_completion")
    poll_interval = _Setting[float]("_completion")
    max_poll_interval = _Setting[float]("_completion")
    sleep_max_interval = _Setting[float]("_completion")
    record_events = _Setting[bool]("_table")
    wait_marker_mode = _Setting[str]("_table")
    marker_mode = _Setting[str]("_table")

    @property
    def counters(self) -> dict[str, int]:
        """Statistics of the completion waiter (for tests and benchmarks)."""
        return self._completion.counters

    def set_wait_strategy(
        self, strategy: str, *, spin_budget: float | None = None, inline_spin: float | None = None
    ) -> None:
        """Choose how :meth:`wait_for_progress` sleeps (see the class docs).
        "event" and "thread" make markers record events too."""
        self._completion.set_wait_strategy(strategy, spin_budget=spin_budget, inline_spin=inline_spin)

    # ------------------------------------------------------------------ streams (``streams``)
    def create_stream(self, index: int) -> CudaStream:
        return self._table.create_stream(index)

    def destroy_stream(self, stream: StreamHandle) -> None:
        self._table.destroy_stream(stream)

    def record_marker(self, stream: StreamHandle) -> CudaMarker:
        return self._table.record_marker(stream)

    def poll_marker(self, marker: Marker) -> Poll:
        return self._table.poll_marker(marker)

    def wait_marker(self, stream: StreamHandle, marker: Marker) -> None:
        self._table.wait_marker(stream, marker)

    def create_gate(self, stream: StreamHandle) -> CudaGate:
        return self._table.create_gate(stream)

    def open_gate(self, gate: Gate) -> None:
        self._table.open_gate(gate)

    def notify_submitted(self) -> None:
        self._table.notify_submitted()

    # ------------------------------------------------------------------ completion (``completion``)
    async def wait_for_progress(self, pending: Sequence[Marker]) -> None:
        await self._completion.wait_for_progress(pending)

    # ------------------------------------------------------------------ traces (``timing``)
    def last_command(self) -> int | None:
        return None  # no device times kept: traces show host-observed times

    def command_times(self, ids: Sequence[int]) -> dict[int, tuple[float, float]]:
        return {}

    def timing_start(self, stream: StreamHandle) -> None:
        self._timing.start(stream)

    def timing_mark(self, stream: StreamHandle) -> int | None:
        return self._timing.mark(stream)

    def mark_times(self, ids: Sequence[int]) -> dict[int, float]:
        return self._timing.times(ids)

    # ------------------------------------------------------------------ host copies (``staging``)
    def staging_statistics(self) -> dict[str, int]:
        return self._staging.statistics()

    def copy_h2d(self, stream: StreamHandle, dst: int, src: np.ndarray[Any, Any]) -> object | None:
        return self._staging.copy_h2d(stream, dst, src)

    def copy_d2h(
        self, stream: StreamHandle, dst: np.ndarray[Any, Any], src: int, *, direct: bool = False
    ) -> Finisher | None:
        return self._staging.copy_d2h(stream, dst, src, direct=direct)

    # ------------------------------------------------------------------ kernels (``launch``)
    def load_kernel(self, kernel: Kernel) -> CudaFunction:
        return self._kernels.load_kernel(kernel)

    def unload_kernel(self, function: object) -> None:
        """Unload the module of a :meth:`load_kernel` handle. The core calls it
        at scope exit, only when no submission using it is in flight."""
        self._kernels.unload_kernel(function)

    def param_layout(self, function: CudaFunction, n: int) -> tuple[tuple[int, int], ...] | None:
        """The compiled kernel's ``(offset, size)`` per parameter (see
        :meth:`Kernels.param_layout <.launch.Kernels.param_layout>`)."""
        return self._kernels.param_layout(function, n)

    def check_launch(self, function: object, launch: PreparedLaunch) -> None:
        """What only the loaded kernel knows, checked before anything is
        enqueued (see :meth:`Kernels.check_launch <.launch.Kernels.check_launch>`)."""
        self._kernels.check_launch(function, launch)

    def launch(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> None:
        self._kernels.launch(stream, function, launch)

    # ------------------------------------------------------------------ graphs (``graphs``)
    def begin_capture(self, stream: StreamHandle) -> None:
        """``cuStreamBeginCapture`` in thread-local mode (see ``graphs``)."""
        self._graphs.begin_capture(stream)

    def end_capture(self, stream: StreamHandle) -> CudaGraphTemplate:
        return self._graphs.end_capture(stream)

    def abort_capture(self, stream: StreamHandle) -> None:
        self._graphs.abort_capture(stream)

    def instantiate(self, graph: object) -> CudaGraphExec:
        """``cuGraphInstantiate``; pushes and pops this context, so it runs on any thread."""
        return self._graphs.instantiate(graph)

    def graph_upload(self, graph_exec: object) -> None:
        """``cuGraphUpload`` of a new executable graph, on a private stream
        that this (worker) thread synchronises (see ``graphs``)."""
        self._graphs.graph_upload(graph_exec)

    def graph_launch(self, stream: StreamHandle, graph_exec: object) -> None:
        self._graphs.graph_launch(stream, graph_exec)

    def graph_update(self, graph_exec: object, graph: object) -> None:
        """``cuGraphExecUpdate`` (see ``graphs``); pushes and pops this context."""
        self._graphs.graph_update(graph_exec, graph)

    def destroy_graph(self, graph_exec: object) -> None:
        self._graphs.destroy_graph(graph_exec)

    # ------------------------------------------------------------------ memory
    def alloc(self, nbytes: int, stream: StreamHandle) -> int:
        s = self._stream(stream)
        capturing = self._table.capturing
        if capturing is not None:
            raise _common.capture_refuses_alloc(nbytes, capturing.index)
        nbytes = _common.check_count("nbytes", nbytes)
        if nbytes == 0:
            return 0
        state = self._state
        if _primary.multi_device:
            cu.cuCtxSetCurrent(state.ctx)
        err, ptr = cu.cuMemAllocFromPoolAsync(nbytes, state.pool, s.cu)
        if err:
            raise cuda_error(err, f"cuMemAllocFromPoolAsync({nbytes})")
        return int(ptr)

    def free(self, ptr: int, nbytes: int) -> None:
        if ptr == 0:
            return
        state = self._state
        if state.sticky is not None:
            raise state.sticky  # the core quarantines the allocation: never freed
        if _primary.multi_device:  # another device's scope may retire our memory's last use
            cu.cuCtxSetCurrent(state.ctx)
        (err,) = cu.cuMemFreeAsync(ptr, state.aux)
        if err:
            state.fail(err, "cuMemFreeAsync")

    def check_copy_peer(self, dst_context: object, src_context: object) -> None:
        """Any two contexts of this backend can copy (through peer access, or
        staged through the host); only a context of another backend cannot."""
        for name, ctx in (("dst", dst_context), ("src", src_context)):
            if not isinstance(ctx, CudaContext):
                raise _common.foreign_context(name, ctx, "a CUDA device")

    def check_foreign_stream(self, address: int) -> None:
        """A foreign CUstream cannot be checked without using it: accepted."""

    def copy_peer(
        self,
        stream: StreamHandle,
        dst: int,
        dst_context: object,
        src: int,
        src_context: object,
        nbytes: int,
    ) -> object | None:
        """Enqueue on ``stream`` a copy between memory of two contexts (two
        devices, or one): see ``peer``."""
        from .peer import copy_peer

        copy_peer(self, self._stream(stream), dst, dst_context, src, src_context, nbytes)
        return None

    def copy_d2d(self, stream: StreamHandle, dst: int, src: int, nbytes: int) -> None:
        s = self._stream(stream)
        nbytes = _common.check_count("nbytes", nbytes)
        if nbytes == 0:
            return
        (err,) = cu.cuMemcpyDtoDAsync(dst, src, nbytes, s.cu)
        if err:
            self._state.fail(err, "cuMemcpyDtoDAsync")

    def fill(self, stream: StreamHandle, dst: int, pattern: bytes, count: int) -> None:
        s = self._stream(stream)
        pattern = _common.check_pattern(pattern)
        size = len(pattern)
        count = _common.check_count("count", count)
        if count == 0:
            return
        h = s.cu
        if pattern == pattern[:1] * size:
            (err,) = cu.cuMemsetD8Async(dst, pattern[0], count * size, h)
            call = "cuMemsetD8Async"
        elif size == 2:
            (err,) = cu.cuMemsetD16Async(dst, int.from_bytes(pattern, "little"), count, h)
            call = "cuMemsetD16Async"
        elif size == 4:
            (err,) = cu.cuMemsetD32Async(dst, int.from_bytes(pattern, "little"), count, h)
            call = "cuMemsetD32Async"
        else:
            lo = int.from_bytes(pattern[:4], "little")
            hi = int.from_bytes(pattern[4:], "little")
            if lo == hi:
                (err,) = cu.cuMemsetD32Async(dst, lo, count * 2, h)
                call = "cuMemsetD32Async"
            else:
                # two strided 32-bit fills: low words, then high words (pitch 8)
                call = "cuMemsetD2D32Async"
                (err,) = cu.cuMemsetD2D32Async(dst, 8, lo, 1, count, h)
                if not err:
                    (err,) = cu.cuMemsetD2D32Async(dst + 4, 8, hi, 1, count, h)
        if err:
            self._state.fail(err, call)

    # ------------------------------------------------------------------ interop
    # Foreign streams are CUstream handles of other libraries (or 1: legacy
    # default, 2: per-thread default). These calls may wait device-side on
    # them, never on the host, except foreign_fence(None).

    def stream_address(self, stream: StreamHandle) -> int:
        """The CUstream handle of ``stream``, as consumers name streams."""
        return self._stream(stream).handle

    def _foreign_event(self, on: Any) -> Any:
        ev = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        (err,) = cu.cuEventRecord(ev, on)
        if err:
            cu.cuEventDestroy(ev)
            raise cuda_error(err, "cuEventRecord (interop)")
        return ev

    def foreign_wait(self, foreign: int, stream: StreamHandle) -> None:
        """Make the foreign stream wait, device-side, for the work enqueued so
        far on ``stream``."""
        s = self._stream(stream)
        self._state.make_current_if_needed()
        ev = self._foreign_event(s.cu)
        try:
            (err,) = cu.cuStreamWaitEvent(cu.CUstream(foreign), ev, 0)
            if err:
                raise cuda_error(err, f"cuStreamWaitEvent(consumer stream {foreign:#x})")
        finally:
            cu.cuEventDestroy(ev)  # released once the wait has seen it complete

    def foreign_fence(self, foreign: int | None) -> Any:
        """An event after the work enqueued so far on the foreign stream; for
        None (stream unknown), synchronise the whole context and return None."""
        # May run on a consumer's thread (a DLPack deleter) or a worker thread:
        # push our context and pop it again, leaving that thread's current
        # context (another library's device) as it was.
        check(cu.cuCtxPushCurrent(self._state.ctx), "cuCtxPushCurrent (interop fence)")
        try:
            if foreign is None:
                check(cu.cuCtxSynchronize(), "cuCtxSynchronize (interop fence)")
                return None
            return self._foreign_event(cu.CUstream(foreign))
        finally:
            cu.cuCtxPopCurrent()

    def wait_fence(self, stream: StreamHandle, fence: object) -> None:
        """Make ``stream`` wait, device-side, for a fence of :meth:`foreign_fence`."""
        s = self._stream(stream)
        (err,) = cu.cuStreamWaitEvent(s.cu, fence, 0)
        if err:
            raise cuda_error(err, "cuStreamWaitEvent (interop fence)")

    def drop_fence(self, fence: object) -> None:
        """Destroy a fence's event (a wait already enqueued is unaffected)."""
        cu.cuEventDestroy(fence)

    def wait_foreign_event(self, stream: StreamHandle, event: int) -> None:
        """Make ``stream`` wait, device-side, for another library's CUevent."""
        s = self._stream(stream)
        (err,) = cu.cuStreamWaitEvent(s.cu, cu.CUevent(event), 0)
        if err:
            raise cuda_error(err, "cuStreamWaitEvent (foreign event)")

    def dlpack_device(self) -> tuple[int, int]:
        """``(kDLCUDA, ordinal)``."""
        return (2, self.ordinal)

    def pointer_device(self, ptr: int, nbytes: int) -> str | None:
        """None if ``ptr`` is device (or managed) memory of this context's
        device, else what it is instead."""
        if nbytes == 0:
            return None
        self._state.make_current_if_needed()
        attr = cu.CUpointer_attribute
        err, mtype = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        if err:
            return f"{ptr:#x} is not memory the CUDA driver knows (host memory?)"
        mtype = int(mtype)
        kinds = cu.CUmemorytype
        if mtype not in (int(kinds.CU_MEMORYTYPE_DEVICE), int(kinds.CU_MEMORYTYPE_UNIFIED)):
            return f"{ptr:#x} is host memory (CUmemorytype {mtype}), not device memory"
        err, ordinal = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        if err:
            return f"the device of {ptr:#x} is unknown ({err!r})"
        if int(ordinal) != self.ordinal:
            return f"{ptr:#x} is memory of cuda:{int(ordinal)}, not of this scope's cuda:{self.ordinal}"
        return None

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        state = self._state
        if state.closed:
            return
        state.closed = True
        state.make_current_if_needed()
        self._completion.close()
        self._staging.close()
        if state.sticky is not None:
            log.warning(
                "cuda:%d closed after a sticky error (%s); its driver state is leaked",
                self.ordinal,
                state.sticky,
            )
            state.release_primary()
            return
        self._timing.close()
        self._table.destroy_streams()
        self._graphs.close()  # before the modules their kernel nodes use
        self._kernels.close()
        cu.cuStreamDestroy(state.aux)
        self._table.release()
        state.release_primary()


def open_context(ordinal: int = 0) -> CudaContext:
    """A new :class:`CudaContext` on device ``ordinal`` (``open_scope(device="cuda:N")``)."""
    return CudaContext(ordinal)


if TYPE_CHECKING:

    def _implements_protocol(ctx: CudaContext) -> DeviceContext:
        return ctx
