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
* The class is assembled from one base class per concept (``streams``,
  ``completion``, ``staging``, ``graphs``, ``launch``); this module sets the
  attributes that ``state`` declares, and holds memory, copies between
  devices, interop and close. Argument checks shared with the simulator come
  from ``_common``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, final

import trio

from ..._core._driver import Capabilities, StreamHandle
from ..._core._errors import CudaError
from .. import _common
from . import primary as _primary
from .bindings import cu
from .completion import CompletionMixin
from .errors import check, cuda_error
from .graphs import CudaGraphExec
from .launch import CudaFunction, KernelsMixin
from .staging import StagingMixin, _StagingPool
from .streams import CudaStream, _FlagPage
from .timing import TimingMixin
from .waiters import WaiterPool

if TYPE_CHECKING:
    from ..._core._driver import DeviceContext

__all__ = ["CudaContext", "open_context"]

log = logging.getLogger("trio_cuda")


@final
class CudaContext(CompletionMixin, StagingMixin, KernelsMixin, TimingMixin):
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
    * ``wait_marker_mode``: ``"event"`` (default: when the marker is the
      newest point of its stream, record an event there now and
      ``cuStreamWaitEvent``; else as "flag") or ``"flag"``
      (``cuStreamWaitValue32(GEQ)`` on the marker's pinned slot).
    * ``marker_mode``: ``"hybrid"`` (default), ``"deferred"`` or ``"eager"``
      flag writes (see ``record_marker``).

    ``docs/design/completion.md`` has the measurements behind the defaults.
    """

    def __init__(self, ordinal: int = 0) -> None:
        if cu is None:  # pragma: no cover
            raise RuntimeError("cuda.bindings is not importable")
        self._closed = False
        self._sticky: CudaError | None = None
        self.ordinal = ordinal
        self._dev, self._ctx = _primary.retain_primary(ordinal)
        try:
            check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self.info = _primary.device_info(self._dev, ordinal)
            self.driver_version = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
            self._pool = check(cu.cuDeviceGetDefaultMemPool(self._dev), "cuDeviceGetDefaultMemPool")
            self._aux = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        except BaseException:
            self._release_primary()
            raise
        self._pages: list[_FlagPage] = []
        #: another context's stream waited on one of our flags: never free the pages
        self._pages_shared = False
        self._streams: dict[CudaStream, None] = {}
        self._staging = _StagingPool(self)
        self._functions: dict[CudaFunction, None] = {}
        #: device buffers of tile launches' list arguments, by content (freed at close)
        self._tile_descs: dict[bytes, int] = {}
        self._free_events: list[Any] = []  # blocking-sync, timing-disabled events
        self._marker_events: list[Any] = []  # returned by CudaMarker.__del__
        self._all_events: list[Any] = []
        self._scratch_event: Any = None
        self._waiters = WaiterPool(cu, self._make_current_on_thread)
        self._wake_ev: trio.Event | None = None
        self._new_head = False
        self._dirty: list[CudaStream] = []  # streams with a deferred marker write
        self._token: trio.lowlevel.TrioToken | None = None
        self._last_error_check = 0.0
        # tunables
        self.wait_strategy = "adaptive"
        self.record_events = False
        self.spin_budget = 200e-6
        self.inline_spin = 20e-6
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
        self.error_check_interval = 0.02
        self.poll_interval = 50e-6
        self.max_poll_interval = 1e-3
        self.sleep_max_interval = 5e-3
        self.wait_marker_mode = "flag"  # measured: 6.9 vs 14.6 us per dependent hop (see completion.md)
        #: "hybrid" (default): the first marker of a stream after each flush is
        #: written at once (so the write queues right behind the work and adds
        #: no latency), later ones are deferred and coalesced until the next
        #: flush; "deferred": always deferred; "eager": a write per marker
        self.marker_mode = "eager"  # the core already coalesces markers (batch_markers)
        self._hot: list[CudaStream] = []  # streams that wrote a marker since the last flush
        #: the stream capturing a graph (one capture at a time), and the live executable graphs
        self._capturing: CudaStream | None = None
        self._graph_execs: dict[CudaGraphExec, None] = {}
        # counters (statistics for tests and benchmarks)
        self.counters = {"handoffs": 0, "event_waits": 0, "poll_waits": 0, "loop_sleeps": 0, "spins": 0}

    # ------------------------------------------------------------------ facts
    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._streams)} streams"
        return f"<CudaContext {self.info.name!r} (cuda:{self.ordinal}) {state}>"

    @property
    def sticky_error(self) -> CudaError | None:
        """The sticky error that broke this context, if any."""
        return self._sticky

    # ------------------------------------------------------------------ memory
    def alloc(self, nbytes: int, stream: StreamHandle) -> int:
        s = self._stream(stream)
        if self._capturing is not None:
            raise _common.capture_refuses_alloc(nbytes, self._capturing.index)
        nbytes = _common.check_count("nbytes", nbytes)
        if nbytes == 0:
            return 0
        if _primary.multi_device:
            cu.cuCtxSetCurrent(self._ctx)
        err, ptr = cu.cuMemAllocFromPoolAsync(nbytes, self._pool, s.cu)
        if err:
            raise cuda_error(err, f"cuMemAllocFromPoolAsync({nbytes})")
        return int(ptr)

    def free(self, ptr: int, nbytes: int) -> None:
        if ptr == 0:
            return
        if self._sticky is not None:
            raise self._sticky  # the core quarantines the allocation: never freed
        if _primary.multi_device:  # another device's scope may retire our memory's last use
            cu.cuCtxSetCurrent(self._ctx)
        (err,) = cu.cuMemFreeAsync(ptr, self._aux)
        if err:
            self._fail(err, "cuMemFreeAsync")

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
            self._fail(err, "cuMemcpyDtoDAsync")

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
            self._fail(err, call)

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
        self._make_current_if_needed()
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
        check(cu.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent (interop fence)")
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
        self._make_current_if_needed()
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
        if self._closed:
            return
        self._closed = True
        self._make_current_if_needed()
        self._waiters.close()
        self._staging.close()
        if self._sticky is not None:
            log.warning(
                "cuda:%d closed after a sticky error (%s); its driver state is leaked",
                self.ordinal,
                self._sticky,
            )
            self._release_primary()
            return
        self._close_timing()
        for s in list(self._streams):
            if not s.destroyed:
                s.destroyed = True
                cu.cuStreamDestroy(s.cu)
        self._streams.clear()
        for ge in list(self._graph_execs):  # before the modules their kernel nodes use
            ge.destroyed = True
            cu.cuGraphExecDestroy(ge.handle)
        self._graph_execs.clear()
        for fn in list(self._functions):
            fn.unloaded = True
            cu.cuModuleUnload(fn.module)
        self._functions.clear()
        for ptr in self._tile_descs.values():
            cu.cuMemFree(ptr)
        self._tile_descs.clear()
        cu.cuStreamDestroy(self._aux)
        # events still held by waiter threads (or markers) are left alone
        for ev in self._free_events:
            cu.cuEventDestroy(ev)
        self._free_events.clear()
        for page in self._pages:
            page.mv.release()
            if not self._pages_shared:
                cu.cuMemFreeHost(page.host)
        self._pages.clear()
        self._release_primary()

    def _release_primary(self) -> None:
        _primary.release_primary(self.ordinal, self._dev)


def open_context(ordinal: int = 0) -> CudaContext:
    """A new :class:`CudaContext` on device ``ordinal`` (``open_scope(device="cuda:N")``)."""
    return CudaContext(ordinal)


if TYPE_CHECKING:

    def _implements_protocol(ctx: CudaContext) -> DeviceContext:
        return ctx
