"""Streams, completion markers and gates of the cuda backend.

Invariants:

* Markers are sequence numbers written by the GPU into pinned, device-mapped
  host memory (``cuStreamWriteValue32``; per stream one slot on a
  :class:`_FlagPage`). Polling one is a memory read, not a driver call.
  Sequence numbers compare modulo 2**32 (``_M32``, ``_HALF``).
* Writes may be deferred and coalesced (``marker_mode``): the newest sequence
  number of each stream is written before anything waits on it
  (``wait_for_progress``, ``wait_marker``, ``create_gate``), which places the
  write at or after the marker's point in the stream, so a marker never
  completes early. Markers of one stream complete in the order recorded.
* A gate is a ``cuStreamWaitValue32`` on the stream's gate slot, opened by the
  host writing the slot. Gates of a stream open in order; the slot never
  moves backwards.
* A context hit by a sticky error polls every pending marker ``UNKNOWN``.
* Markers, waits and gates on a capturing stream raise ``GraphCaptureError``
  (``_common.not_capturable``) before the driver sees them.
* :class:`StreamTable` owns all of this for one context: its streams, flag
  pages, event pools, the deferred writes, which stream captures
  (``capturing``, set only by ``graphs``) and the marker tunables. Each
  handle's ``owner`` is its table; a table only trusts streams whose owner it
  is, and reaches another context's table (a cross-device wait) only
  through its methods. ``new_head`` and ``wake_ev`` are the signal between
  recording and the completion waiter: a marker on a stream nobody watches
  sets ``new_head``, and :meth:`StreamTable.notify_submitted` then sets the
  event the waiter parked on.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import TYPE_CHECKING, Any, Final, final

import numpy as np
import trio
from trio.lowlevel import enable_ki_protection

from ..._core._driver import DONE, PENDING, Gate, Marker, MarkerState, Poll, StreamHandle
from ..._core._errors import OutOfMemoryError
from .. import _common
from . import direct
from . import primary as _primary
from .bindings import cu
from .errors import OOM, check, cuda_error

if TYPE_CHECKING:
    from .state import ContextState

__all__ = ["CudaGate", "CudaMarker", "CudaStream", "StreamTable"]

_M32: Final = 0xFFFFFFFF
_HALF: Final = 0x80000000
#: flag slots: per stream one 64-byte line holding the marker slot and, 16
#: slots (64 bytes) further, the gate slot
_PAGE_BYTES: Final = 4096
_SLOTS_PER_PAGE: Final = _PAGE_BYTES // 4
_STREAMS_PER_PAGE: Final = _SLOTS_PER_PAGE // 32
_stream_ids = itertools.count(1)


# --------------------------------------------------------------------------- handles


class _FlagPage:
    """One page of pinned, device-mapped host memory holding flag slots."""

    __slots__ = ("array", "dptr", "host", "mv", "used")

    def __init__(self) -> None:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        err, host = cu.cuMemHostAlloc(_PAGE_BYTES, flags)
        if err:
            raise cuda_error(err, "cuMemHostAlloc(flags)", OutOfMemoryError if int(err) == OOM else None)
        self.host = int(host)
        ctypes.memset(self.host, 0, _PAGE_BYTES)
        err, dptr = cu.cuMemHostGetDevicePointer(self.host, 0)
        if err:
            cu.cuMemFreeHost(self.host)
            raise cuda_error(err, "cuMemHostGetDevicePointer")
        self.dptr = int(dptr)
        carr = (ctypes.c_uint32 * _SLOTS_PER_PAGE).from_address(self.host)
        self.mv = memoryview(carr).cast("B").cast("I")
        #: a NumPy view of the same slots (for inspection and tests)
        self.array: np.ndarray[Any, Any] = np.frombuffer(carr, dtype=np.uint32)  # type: ignore[call-overload]
        self.used = 0


@final
class CudaStream:
    """A non-blocking stream of one context, with its marker and gate slots."""

    __slots__ = (
        "__weakref__",
        "cu",
        "destroyed",
        "dirty",
        "gate_dptr",
        "gate_seq",
        "gate_slot",
        "handle",
        "hot",
        "index",
        "key",
        "mv",
        "owner",
        "page",
        "seq",
        "slot",
        "slot_dptr",
        "waits",
        "watched",
        "write",
    )

    def __init__(
        self, owner: StreamTable, index: int, stream: Any, page: _FlagPage, line: int, entry: int | None
    ) -> None:
        # (entry: the address of cuStreamWriteValue32 for direct calls, or None)
        self.owner = owner
        self.index = index
        self.cu = stream
        self.handle = int(stream)
        #: key of this stream's entries in ``PreparedLaunch.cache`` (unique per process)
        self.key = f"cu:{next(_stream_ids)}"
        self.page = page
        self.mv = page.mv
        self.slot = line * 32
        self.gate_slot = line * 32 + 16
        self.slot_dptr = cu.CUdeviceptr(page.dptr + 4 * self.slot)
        self.gate_dptr = cu.CUdeviceptr(page.dptr + 4 * self.gate_slot)
        #: the marker flag's write as a prepared direct call (``write(seq)``
        #: returns the CUresult), or None: through the wrapper (``direct``)
        self.write: Any = (
            direct.writer(entry, self.handle, page.dptr + 4 * self.slot) if entry is not None else None
        )
        #: prepared direct waits of this stream on another stream's flag
        #: (same context), by that stream: ``wait(seq)``, made on first use
        self.waits: dict[CudaStream, Any] = {}
        self.seq = 0  # last marker sequence recorded (the GPU writes it when it gets there)
        self.gate_seq = 0
        self.watched = False
        self.destroyed = False
        self.dirty = False  # a deferred marker write is pending
        self.hot = False  # a marker was written since the last flush (hybrid mode)

    @property
    def completed_seq(self) -> int:
        """The last marker sequence (mod 2**32) the GPU wrote."""
        return int(self.mv[self.slot])

    def __repr__(self) -> str:
        return f"<CudaStream {self.index} 0x{self.handle:x} seq={self.seq}>"


class CudaMarker:
    """A point in a stream's order: done once the stream's slot reached ``seq``."""

    __slots__ = ("event", "seq", "stream")

    def __init__(self, stream: CudaStream, seq: int, event: Any = None) -> None:
        self.stream = stream
        self.seq = seq
        self.event = event

    def __repr__(self) -> str:
        return f"<CudaMarker stream {self.stream.index} seq {self.seq}>"


@final
class _EventMarker(CudaMarker):
    """A marker that also recorded an event (``record_events``); the event
    goes back to its stream table's pool when the marker is dropped."""

    __slots__ = ()

    def __del__(self) -> None:
        try:
            self.stream.owner.return_marker_event(self.event)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


@final
class CudaGate:
    """A ``cuStreamWaitValue32`` on the stream's gate slot, opened by the host."""

    __slots__ = ("opened", "seq", "stream")

    def __init__(self, stream: CudaStream, seq: int) -> None:
        self.stream = stream
        self.seq = seq
        self.opened = False

    def __repr__(self) -> str:
        return f"<CudaGate stream {self.stream.index} seq {self.seq} {'open' if self.opened else 'closed'}>"


@final
class StreamTable:
    """The streams, flag pages, markers and gates of one context, and the
    signal that wakes its parked completion waiter."""

    __slots__ = (
        "_all_events",
        "_cu_ctx",
        "_direct",
        "_direct_wait",
        "_dirty",
        "_free_events",
        "_hot",
        "_marker_events",
        "_pages",
        "_pages_shared",
        "_scratch_event",
        "_state",
        "capturing",
        "marker_mode",
        "new_head",
        "record_events",
        "streams",
        "wait_marker_mode",
        "wake_ev",
    )

    def __init__(self, state: ContextState) -> None:
        self._state = state
        #: the CUcontext, made current before each call once scopes on several
        #: devices are open (the state's, copied: it never changes)
        self._cu_ctx = state.ctx
        #: the address of ``cuStreamWriteValue32`` for direct calls, or None
        #: (``direct.entries``, decided when the context opened)
        entries = direct.entries()
        self._direct = entries[1] if entries is not None else None
        #: the address of ``cuStreamWaitValue32`` for direct calls, or None
        self._direct_wait = entries[2] if entries is not None else None
        self._pages: list[_FlagPage] = []
        #: another context's stream waited on one of our flags: never free the pages
        self._pages_shared = False
        #: the live streams
        self.streams: dict[CudaStream, None] = {}
        self._free_events: list[Any] = []  # blocking-sync, timing-disabled events
        self._marker_events: list[Any] = []  # returned by dropped _EventMarkers
        self._all_events: list[Any] = []
        self._scratch_event: Any = None
        #: a marker landed on a stream no waiter watches since the waiter parked
        self.new_head = False
        #: the event the parked completion waiter sleeps on (set by it; a new head sets it)
        self.wake_ev: trio.Event | None = None
        self._dirty: list[CudaStream] = []  # streams with a deferred marker write
        self._hot: list[CudaStream] = []  # streams that wrote a marker since the last flush
        #: the stream capturing a graph (one capture at a time; set by ``graphs``)
        self.capturing: CudaStream | None = None
        # tunables
        #: markers also record events (the "event" and "thread" wait strategies)
        self.record_events = False
        self.wait_marker_mode = "flag"  # measured: 6.9 vs 14.6 us per dependent hop (see completion.md)
        #: "hybrid": the first marker of a stream after each flush is
        #: written at once (so the write queues right behind the work and adds
        #: no latency), later ones are deferred and coalesced until the next
        #: flush; "deferred": always deferred; "eager": a write per marker
        self.marker_mode = "eager"  # the core already coalesces markers (batch_markers)

    def stream(self, stream: StreamHandle) -> CudaStream:
        """``stream``, checked to be a live stream of this table (and the
        context made current where several devices are in use)."""
        if type(stream) is not CudaStream or stream.owner is not self:
            raise _common.wrong_handle("stream", stream, CudaStream, "CUDA")
        if stream.destroyed:
            raise _common.stream_destroyed(stream.index)
        if _primary.multi_device:  # scopes on several devices: each call runs in its own context
            cu.cuCtxSetCurrent(self._cu_ctx)
        return stream

    def make_current(self) -> None:
        """Make this table's context current (before recording in it from another context)."""
        cu.cuCtxSetCurrent(self._cu_ctx)

    # ------------------------------------------------------------------ events
    def new_event(self) -> Any:
        """A blocking-sync, timing-disabled event from the pool (or a new one)."""
        if self._free_events:
            return self._free_events.pop()
        self._state.make_current_if_needed()  # the event belongs to the current context
        flags = cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        ev = check(cu.cuEventCreate(flags), "cuEventCreate")
        self._all_events.append(ev)
        return ev

    def recycle_event(self, ev: Any) -> None:
        """Return an event of :meth:`new_event` to the pool."""
        self._free_events.append(ev)

    def return_marker_event(self, ev: Any) -> None:
        """Return the event of a dropped marker (``record_events``) to the pool."""
        self._marker_events.append(ev)

    def _take_event(self) -> Any:
        if self._marker_events:
            return self._marker_events.pop()
        return self.new_event()

    def record_scratch(self, stream: CudaStream) -> tuple[Any, Any]:
        """Record this table's scratch event at the tail of ``stream`` (one of
        its streams): ``(CUresult, event)``. Re-recording it later does not
        affect a wait already enqueued on it."""
        ev = self._scratch_event
        if ev is None:
            ev = self._scratch_event = self.new_event()
        (err,) = cu.cuEventRecord(ev, stream.cu)
        return err, ev

    def share_pages(self) -> None:
        """A stream of another context waits on one of our flags: never free the pages."""
        self._pages_shared = True

    # ------------------------------------------------------------------ streams
    def create_stream(self, index: int) -> CudaStream:
        self._state.check_open()
        self._state.make_current_if_needed()
        page = self._pages[-1] if self._pages and self._pages[-1].used < _STREAMS_PER_PAGE else None
        if page is None:
            page = _FlagPage()
            self._pages.append(page)
        handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        s = CudaStream(self, index, handle, page, page.used, self._direct)
        page.used += 1
        self.streams[s] = None
        return s

    def destroy_stream(self, stream: StreamHandle) -> None:
        s = self.stream(stream)
        s.destroyed = True
        self.streams.pop(s, None)
        if self._state.sticky is None:
            (err,) = cu.cuStreamDestroy(s.cu)
            if err:
                raise cuda_error(err, "cuStreamDestroy")

    # ------------------------------------------------------------------ ordering
    @enable_ki_protection  # (a hot method's fallback: see direct._trust_hot_methods)
    def record_marker(self, stream: StreamHandle) -> CudaMarker:
        s = stream
        if type(s) is not CudaStream or s.owner is not self or s.destroyed:
            s = self.stream(stream)
        elif _primary.multi_device:
            cu.cuCtxSetCurrent(self._cu_ctx)
        seq = s.seq + 1
        if s is self.capturing:
            raise _common.not_capturable(f"marker {seq}", s.index)
        mode = self.marker_mode
        if mode == "hybrid" and not s.hot and not self.record_events:
            # first marker since the last flush: write it now
            w = s.write
            if w is not None:
                err = w(seq)
            else:
                (err,) = _cuStreamWriteValue32(s.cu, s.slot_dptr, seq & _M32, 0)
            if err:
                self._state.fail(err, "cuStreamWriteValue32")
            s.seq = seq
            s.hot = True
            self._hot.append(s)
            if not s.watched:
                self.new_head = True
            return CudaMarker(s, seq)
        if mode != "eager" and not self.record_events:
            # Deferred and coalesced: the flag write for the newest marker of
            # the stream is enqueued by flush (before anyone waits on it). It
            # lands at the stream's tail then, i.e. at or after this point.
            s.seq = seq
            if not s.dirty:
                s.dirty = True
                self._dirty.append(s)
            if not s.watched:
                self.new_head = True
            return CudaMarker(s, seq)
        w = s.write
        if w is not None:
            err = w(seq)
        else:
            (err,) = _cuStreamWriteValue32(s.cu, s.slot_dptr, seq & _M32, 0)
        if err:
            self._state.fail(err, "cuStreamWriteValue32")
        s.seq = seq
        if not s.watched:
            self.new_head = True
        if self.record_events:
            ev = self._take_event()
            (err,) = cu.cuEventRecord(ev, s.cu)
            if err:
                self._marker_events.append(ev)
                self._state.fail(err, "cuEventRecord")
            return _EventMarker(s, seq, ev)
        return CudaMarker(s, seq)

    @enable_ki_protection  # (a hot method's fallback: see direct._trust_hot_methods)
    def poll_marker(self, marker: Marker) -> Poll:
        s = marker.stream
        if ((s.mv[s.slot] - marker.seq) & _M32) < _HALF:  # type: ignore[attr-defined, unused-ignore]
            return DONE
        sticky = self._state.sticky
        if sticky is not None:
            return Poll(MarkerState.UNKNOWN, sticky)
        return PENDING

    def wait_marker(self, stream: StreamHandle, marker: Marker) -> None:
        s = self.stream(stream)
        m = marker
        if not isinstance(m, CudaMarker):
            raise _common.not_a("marker", m, CudaMarker)
        other = m.stream
        if s is self.capturing:
            raise _common.not_capturable(f"wait stream {other.index} marker {m.seq}", s.index)
        ev = m.event
        owner = other.owner  # another device's context for cross-device waits
        if owner is not self:  # record (below) in the marker's context, wait in ours
            owner.make_current()
            owner.flush_stream(other)
        if (
            ev is None
            and (self.wait_marker_mode == "event" or owner is not self)
            and m.seq == other.seq
            and not other.destroyed
        ):
            # The marker is the newest point of its stream: an event recorded
            # now completes with it. Re-recording the scratch event later does
            # not affect a wait already enqueued. The event belongs to the
            # recording stream's context; across devices (cuEventRecord there,
            # cuStreamWaitEvent here) this is the default, flags the fallback.
            err, ev = owner.record_scratch(other)
            if err:
                self._state.fail(err, "cuEventRecord")
        if owner is not self:
            cu.cuCtxSetCurrent(self._cu_ctx)
        if ev is not None:
            (err,) = cu.cuStreamWaitEvent(s.cu, ev, 0)
            if err:
                self._state.fail(err, "cuStreamWaitEvent")
            return
        owner.flush_stream(other)
        if owner is not self:
            # Our stream will read the other context's flag page, perhaps after
            # that context closed: it must never free its pages (a leak of a
            # few KiB, rather than a wait on freed memory).
            owner.share_pages()
        wait = s.waits.get(other) if owner is self else None
        if wait is None and owner is self and self._direct_wait is not None:
            wait = s.waits[other] = direct.writer(self._direct_wait, s.handle, int(other.slot_dptr))
        if wait is not None:
            err = wait(m.seq)  # cuStreamWaitValue32(..., CU_STREAM_WAIT_VALUE_GEQ), directly
        else:
            geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
            (err,) = cu.cuStreamWaitValue32(s.cu, other.slot_dptr, m.seq & _M32, geq)
        if err:
            self._state.fail(err, "cuStreamWaitValue32")

    def flush(self) -> None:
        """Enqueue the pending (deferred) marker writes: one
        ``cuStreamWriteValue32`` per stream, of its newest sequence number."""
        hot = self._hot
        while hot:
            hot.pop().hot = False
        dirty = self._dirty
        while dirty:
            s = dirty.pop()
            s.dirty = False
            if s.destroyed:
                continue
            err = _write_flag(s)
            if err:
                self._state.fail(err, "cuStreamWriteValue32")

    def has_deferred(self) -> bool:
        """Whether :meth:`flush` has anything to do."""
        return bool(self._dirty or self._hot)

    def flush_stream(self, s: CudaStream) -> None:
        """Enqueue the deferred marker write of ``s`` (one of this table's streams), if any."""
        if s.dirty:
            s.dirty = False
            self._dirty.remove(s)
            err = _write_flag(s)
            if err:
                self._state.fail(err, "cuStreamWriteValue32")

    @enable_ki_protection  # (a hot method's fallback: see direct._trust_hot_methods)
    def notify_submitted(self) -> None:
        """Wake the parked completion waiter if a marker landed on a stream it does not watch."""
        if self.new_head:
            ev = self.wake_ev
            if ev is not None:
                self.wake_ev = None
                ev.set()

    def create_gate(self, stream: StreamHandle) -> CudaGate:
        s = self.stream(stream)
        if s is self.capturing:
            raise _common.not_capturable("gate", s.index)
        # The marker before a gate must be written before the stream waits on
        # the host, or the host would wait for the gate it has to open.
        self.flush_stream(s)
        seq = s.gate_seq + 1
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        (err,) = cu.cuStreamWaitValue32(s.cu, s.gate_dptr, seq & _M32, geq)
        if err:
            self._state.fail(err, "cuStreamWaitValue32(gate)")
        s.gate_seq = seq
        return CudaGate(s, seq)

    def open_gate(self, gate: Gate) -> None:
        if type(gate) is not CudaGate:
            raise _common.not_a("gate", gate, CudaGate)
        if gate.opened:
            return
        gate.opened = True
        s = gate.stream
        cur = s.mv[s.gate_slot]
        # gates of a stream open in order; never move the slot backwards
        if ((gate.seq - cur) & _M32) < _HALF:
            s.mv[s.gate_slot] = gate.seq & _M32

    # ------------------------------------------------------------------ close
    def destroy_streams(self) -> None:
        """At close (not after a sticky error): destroy every live stream."""
        for s in list(self.streams):
            if not s.destroyed:
                s.destroyed = True
                cu.cuStreamDestroy(s.cu)
        self.streams.clear()

    def release(self) -> None:
        """At close, last (not after a sticky error): destroy the pooled
        events and free the flag pages, unless another context's stream may
        still read them. Events still held by waiter threads (or markers) are
        left alone."""
        for ev in self._free_events:
            cu.cuEventDestroy(ev)
        self._free_events.clear()
        for page in self._pages:
            page.mv.release()
            if not self._pages_shared:
                cu.cuMemFreeHost(page.host)
        self._pages.clear()


_cuStreamWriteValue32: Any = cu.cuStreamWriteValue32 if cu is not None else None


def _write_flag(s: CudaStream) -> Any:
    """Enqueue the write of ``s``'s newest marker sequence to its flag; the CUresult."""
    w = s.write
    if w is not None:
        return w(s.seq)
    (err,) = _cuStreamWriteValue32(s.cu, s.slot_dptr, s.seq & _M32, 0)
    return err
