"""The simulator's DeviceContext: :class:`SimContext`, one scope's view of a
:class:`~.device.SimDevice`.

Invariants:

* Commands from every context of a device share the device's engine; a
  context checks its arguments and enqueues commands, the engine executes
  them (``engine``). A check that raises leaves nothing enqueued.
* Argument checks and errors shared with the cuda backend come from
  ``_common`` (a stream or kernel function of another context is a
  ``ValueError``, a capturing stream refuses allocations, markers, waits,
  gates and synchronising copies, ...).
* ``load_kernel`` hands out a module with a unique fake address; a launch that
  executes after ``unload_kernel`` is a ``use_after_free`` at that address.
  It refuses a kernel whose code does not compile or lacks its entry (where
  NVRTC can be loaded; ``_nvrtc.check_kernel``) and a kernel without a
  ``reference`` (``MissingReferenceError``): the simulator never runs a
  kernel that it silently does nothing for.
  Destroyed executable graphs likewise. ``graph_upload`` only counts
  (``SimDevice.graph_uploads``); ``instantiate`` and ``graph_update`` take
  ``SimDevice.graph_host_time`` of host time, in a worker thread when it is
  set (the contexts then declare ``instantiate_in_thread``).
* Closing a context leaves streams with queued commands in the engine: they
  still execute, and their memory is never touched here.
* Foreign streams (interop) are streams of any context of the same device,
  named by the fake address :meth:`SimContext.stream_address` gives them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

import numpy as np
import trio

from ..._core._config import check_cooperative_occupancy, modeled_blocks_per_sm
from ..._core._driver import (
    PENDING,
    Capabilities,
    DeviceInfo,
    Finisher,
    Gate,
    Marker,
    Poll,
    StreamHandle,
)
from ..._core._errors import GraphCaptureError, LaunchError, MissingReferenceError
from ..._core._kernel import signature
from .. import _common, _nvrtc
from .engine import ALIGN, Command
from .handles import SimFunction, SimGate, SimGraph, SimGraphExec, SimMarker, SimStream
from .records import Violation

if TYPE_CHECKING:
    from ..._core._driver import DeviceContext
    from ..._core._kernel import Kernel
    from ..._core._launch import PreparedLaunch
    from .device import SimDevice
    from .engine import SimEngine

__all__ = ["DLPACK_SIM_DEVICE", "SimContext"]

_MODULE_BASE = 0x7E00_0000_0000  # fake module handles: never inside device memory
_STREAM_ADDRESS_BASE = 0x7D00_0000_0000  # fake stream handles for interop (stream_address)
#: DLPack device type of simulated memory: kDLExtDev, which no real consumer accepts
DLPACK_SIM_DEVICE = 12
_GRAPH_BASE = 0x7D00_0000_0000  # fake executable-graph handles


def missing_reference(kernel: Kernel) -> MissingReferenceError:
    """The error for a kernel without a ``reference`` on the simulator."""
    return MissingReferenceError(
        f"kernel {kernel.name!r} has no reference=, and the simulator cannot run it: it runs a "
        f"kernel's CPU behaviour, not its CUDA code. Give the kernel one, "
        f"Kernel.from_{kernel.image_kind}(..., reference=fn), where fn takes one argument per "
        f"kernel parameter ({signature(kernel)}): an array as a NumPy view (write outputs in "
        f"place), a Slice as a view then its length, a scalar as a NumPy scalar. Or pass "
        f"reference=trio_cuda.NO_REFERENCE to run it here as a no-op on purpose. The launch was "
        f"refused before it was enqueued."
    )


@final
class SimContext:
    """One scope's view of a :class:`SimDevice` (the DeviceContext protocol).
    Commands from every context of a device share the device's engine."""

    __slots__ = ("_capturing", "_closed", "_device", "_streams", "engine", "info")

    info: DeviceInfo
    #: the device's engine (``engine``'s internal interface), which every
    #: context of the device shares
    engine: SimEngine

    def __init__(self, device: SimDevice, engine: SimEngine) -> None:
        self._device = device
        self.engine = engine
        self.info = engine.info
        self._streams: dict[SimStream, None] = {}
        self._closed = False
        self._capturing: SimStream | None = None

    @property
    def device(self) -> SimDevice:
        return self._device

    @property
    def capabilities(self) -> Capabilities:
        dev = self._device
        return Capabilities(
            batch_markers=dev.batch_markers,
            await_spin=dev.await_spin,
            instantiate_in_thread=dev.graph_host_time > 0,
            device_clock="simulated",
        )

    # ------------------------------------------------------------------ traces
    def last_command(self) -> int | None:
        return self.engine.last_seq()

    def timing_start(self, stream: StreamHandle) -> None:
        pass  # the simulator's commands carry their own times (command_times)

    def timing_mark(self, stream: StreamHandle) -> int | None:
        return None

    def mark_times(self, ids: Sequence[int]) -> dict[int, float]:
        return {}

    def command_times(self, ids: Sequence[int]) -> dict[int, tuple[float, float]]:
        wanted = set(ids)
        return {e.seq: (e.t_start, e.t_end) for e in self.engine.trace() if e.seq in wanted}

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._streams)} streams"
        return f"<SimContext on {self._device.name!r} {state}>"

    # ------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._closed:
            raise _common.context_closed(self._device.name)

    def _stream(self, stream: StreamHandle) -> SimStream:
        if not isinstance(stream, SimStream) or stream.context is not self:
            raise _common.wrong_handle("stream", stream, SimStream, "simulator")
        if stream.destroyed:
            raise _common.stream_destroyed(stream.index)
        if self._closed:
            raise _common.context_closed(self._device.name)
        return stream

    def _marker(self, marker: Marker) -> SimMarker:
        if not isinstance(marker, SimMarker):
            raise _common.not_a("marker", marker, SimMarker)
        eng = marker.stream.context.engine
        if eng is not self.engine and (eng.host is None or eng.host is not self.engine.host):
            raise ValueError(
                f"marker: {marker!r} was recorded on another simulated device, not of this one's SimHost"
            )
        return marker

    # ------------------------------------------------------------------ streams

    def create_stream(self, index: int) -> SimStream:
        self._check_open()
        stream = SimStream(index, self)
        self._streams[stream] = None
        return stream

    def destroy_stream(self, stream: StreamHandle) -> None:
        s = self._stream(stream)
        s.destroy()  # refused while commands are queued
        del self._streams[s]

    # ------------------------------------------------------------------ memory

    def alloc(self, nbytes: int, stream: StreamHandle) -> int:
        self._stream(stream)
        if self._capturing is not None:
            raise _common.capture_refuses_alloc(nbytes, self._capturing.index)
        return self.engine.alloc(nbytes)

    def free(self, ptr: int, nbytes: int) -> None:
        self.engine.free(ptr, nbytes)

    def copy_h2d(self, stream: StreamHandle, dst: int, src: np.ndarray[Any, Any]) -> object | None:
        s = self._stream(stream)
        eng = self.engine
        staged = np.frombuffer(np.ascontiguousarray(src).tobytes(), dtype=np.uint8)
        n = staged.nbytes
        eng.enqueue(
            s, Command("h2d", eng.next_seq(), f"h2d {n} B", self._device.copy_time, staged, dst=dst, nbytes=n)
        )
        return None

    def copy_d2h(
        self, stream: StreamHandle, dst: np.ndarray[Any, Any], src: int, *, direct: bool = False
    ) -> Finisher | None:
        s = self._stream(stream)
        _common.check_host_dst(dst)
        if direct and s.capturing:
            raise _common.sync_copy_in_capture(s.index)
        eng = self.engine
        n = dst.nbytes
        eng.enqueue(
            s, Command("d2h", eng.next_seq(), f"d2h {n} B", self._device.copy_time, dst, src=src, nbytes=n)
        )
        return None

    def copy_d2d(self, stream: StreamHandle, dst: int, src: int, nbytes: int) -> None:
        s = self._stream(stream)
        nbytes = _common.check_count("nbytes", nbytes)
        eng = self.engine
        eng.enqueue(
            s,
            Command(
                "d2d",
                eng.next_seq(),
                f"d2d {nbytes} B",
                self._device.copy_time,
                dst=dst,
                src=src,
                nbytes=nbytes,
            ),
        )

    def copy_peer(
        self,
        stream: StreamHandle,
        dst: int,
        dst_context: object,
        src: int,
        src_context: object,
        nbytes: int,
    ) -> object | None:
        """Enqueue on ``stream`` a copy of ``nbytes`` from ``src`` (memory of
        ``src_context``'s device) to ``dst`` (``dst_context``'s device): a
        ``d2d`` on one device, else a peer copy between devices of one
        :class:`~trio_cuda.testing.SimHost` (see ``host``)."""
        from .host import copy_peer

        return copy_peer(self, self._stream(stream), dst, dst_context, src, src_context, nbytes)

    def check_copy_peer(self, dst_context: object, src_context: object) -> None:
        """Raise ``ValueError`` unless :meth:`copy_peer` can copy between the
        devices of these contexts (one device, or devices of one SimHost).
        Enqueues nothing."""
        from .host import check_copy_peer

        check_copy_peer(self, dst_context, src_context)

    def fill(self, stream: StreamHandle, dst: int, pattern: bytes, count: int) -> None:
        s = self._stream(stream)
        pattern = _common.check_pattern(pattern)
        count = _common.check_count("count", count)
        eng = self.engine
        n = len(pattern) * count
        eng.enqueue(
            s,
            Command(
                "fill", eng.next_seq(), f"fill {n} B", self._device.copy_time, pattern, dst=dst, nbytes=n
            ),
        )

    # ------------------------------------------------------------------ kernels

    def load_kernel(self, kernel: Kernel) -> SimFunction:
        """Load ``kernel``: check its code (``_nvrtc.check_kernel``: a source
        must compile and define the kernel, as on a GPU), then refuse it
        without a ``reference`` (:class:`MissingReferenceError`); the core
        loads before it enqueues anything, so nothing is."""
        self._check_open()
        tile = kernel.tile
        if tile is not None:
            # a tile kernel runs on NumPy tiles; its compile is checked where
            # the toolchain (or a cached image) is there
            if tile.kind != "specialisation":
                raise TypeError(f"kernel: tile kernel {kernel.name} is loaded through a launch of it")
            tile.prepare_here("sim", self.info.compute_capability)
        else:
            _nvrtc.check_kernel(kernel, self.info.compute_capability)
            if kernel.reference is None:
                raise missing_reference(kernel)
        return SimFunction(kernel, self, _MODULE_BASE + self.engine.kernel_loaded() * ALIGN)

    def unload_kernel(self, function: object) -> None:
        """Unload a module from :meth:`load_kernel`. A launch of it that executes
        later is a ``use_after_free`` violation; unloading twice a ``double_free``."""
        if not isinstance(function, SimFunction):
            raise _common.not_a("function", function, SimFunction, " from load_kernel")
        eng = self.engine
        if function.unloaded:
            eng.record_violation(Violation("double_free", function.handle, 0, "unload_kernel", None))
            return
        function.unloaded = True
        eng.kernel_unloaded()

    def check_launch(self, function: object, launch: PreparedLaunch) -> None:
        """The simulator's share of the up-front launch checks: a cooperative
        grid must be co-resident under the occupancy model of
        ``modeled_blocks_per_sm`` (the device's per-SM thread, block and shared
        memory limits; registers and static shared memory are not modelled).
        Raises ``KernelArgumentError``; enqueues nothing."""
        if not isinstance(function, SimFunction) or function.context is not self:
            raise _common.wrong_handle("function", function, SimFunction, "simulator", " from load_kernel")
        c = launch.config
        if c.cooperative:
            info = self.info
            check_cooperative_occupancy(launch, info, modeled_blocks_per_sm(info, c.block, c.shared_mem))

    def launch(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> None:
        s = self._stream(stream)
        if not isinstance(function, SimFunction) or function.context is not self:
            raise _common.wrong_handle("function", function, SimFunction, "simulator", " from load_kernel")
        kernel = launch.kernel
        if function.kernel is not kernel or function.unloaded:
            raise _common.invalid_handle(
                f"{function!r} is not loaded in this context for kernel {kernel.name}", "cuLaunchKernel"
            )
        info = self.info
        config = launch.config
        bx, by, bz = config.block
        if (
            bx * by * bz > info.max_threads_per_block
            or config.shared_mem > info.max_shared_memory_per_block_optin
        ):
            raise LaunchError(
                1,
                "CUDA_ERROR_INVALID_VALUE",
                f"kernel {kernel.name}: block {config.block} / shared_mem {config.shared_mem} exceeds "
                f"{info.max_threads_per_block} threads / {info.max_shared_memory_per_block_optin} bytes",
                call="cuLaunchKernel",
            )
        eng = self.engine
        fault: str | None = None
        if not s.capturing:  # a capture runs nothing: faults wait for a replay
            fault = eng.launch_fault("kernel", kernel.name, "cuLaunchKernel")
        eng.enqueue(
            s,
            Command(
                "launch",
                eng.next_seq(),
                kernel.name,
                self._device.kernel_time,
                launch,
                fault=fault,
                fn=function,
            ),
        )

    # ------------------------------------------------------------------ ordering

    def record_marker(self, stream: StreamHandle) -> SimMarker:
        return self._mark(self._stream(stream))

    def poll_marker(self, marker: Marker) -> Poll:
        m = self._marker(marker)
        self.engine.pump_due()
        return m.stream.poll(m.seq)

    def wait_marker(self, stream: StreamHandle, marker: Marker) -> None:
        s = self._stream(stream)
        m = self._marker(marker)
        eng = self.engine
        label = f"wait stream {m.stream.index} marker {m.seq}"
        eng.enqueue(s, Command("wait_marker", eng.next_seq(), label, 0.0, m))

    def create_gate(self, stream: StreamHandle) -> SimGate:
        s = self._stream(stream)
        eng = self.engine
        gate = SimGate(s)
        eng.enqueue(s, Command("gate", eng.next_seq(), "gate", 0.0, gate))
        return gate

    def open_gate(self, gate: Gate) -> None:
        if not isinstance(gate, SimGate):
            raise _common.not_a("gate", gate, SimGate)
        if gate.stream.context.engine is not self.engine:
            raise ValueError(f"gate: {gate!r} was created on another simulated device")
        if gate.opened:
            return
        self.engine.open_gate(gate)

    async def wait_for_progress(self, pending: Sequence[Marker]) -> None:
        eng = self.engine
        # Register for the wakeup before looking: polling can itself complete
        # timed work, and progress made while we look must not be lost.
        event = eng.progress_event()
        if (
            eng.pump_due() or any(self.poll_marker(m) is not PENDING for m in pending) or event.is_set()
        ):  # progress, or a marker that completed before the call
            await trio.lowlevel.checkpoint()
            return
        due = eng.next_due()
        if due is None:
            await event.wait()
            return
        # Wait on the run's own clock (MockClock too): the device clock follows it.
        with trio.move_on_at(eng.deadline(due)) as cs:
            await event.wait()
        eng.pump(due if cs.cancelled_caught else 0.0)

    def notify_submitted(self) -> None:
        """Nothing to do: enqueueing already wakes timed waiters."""

    # ------------------------------------------------------------------ interop
    # Foreign streams are streams of any context of the same SimDevice, named by
    # the fake address stream_address() gives them (as a CUstream would be).

    # foreign_fence(None) never blocks here: it is device-side (markers).

    def stream_address(self, stream: StreamHandle) -> int:
        """A fake handle naming ``stream`` to consumers (``__dlpack__(stream=)``)."""
        s = self._stream(stream)
        return self.engine.stream_address(s, _STREAM_ADDRESS_BASE)

    def _foreign_stream(self, address: object) -> SimStream:
        s = self.engine.stream_at(address) if isinstance(address, int) else None
        if s is None or s.destroyed:
            raise ValueError(
                f"stream: expected the address of a live stream of simulated device "
                f"{self._device.name!r} (from stream_address()), got {address!r}"
            )
        return s

    def check_foreign_stream(self, address: int) -> None:
        """Raise ``ValueError`` unless ``address`` names a live stream of this device."""
        self._foreign_stream(address)

    def _mark(self, s: SimStream) -> SimMarker:
        marker = s.new_marker()  # a capturing stream refuses it
        eng = self.engine
        eng.enqueue(s, Command("marker", eng.next_seq(), f"marker {marker.seq}", 0.0, marker.seq))
        return marker

    def foreign_wait(self, foreign: int, stream: StreamHandle) -> None:
        """Make the foreign stream wait, device-side, for the work enqueued so
        far on ``stream``."""
        s = self._stream(stream)
        fs = self._foreign_stream(foreign)
        marker = self._mark(s)
        eng = self.engine
        label = f"wait stream {s.index} marker {marker.seq}"
        eng.enqueue(fs, Command("wait_marker", eng.next_seq(), label, 0.0, marker))

    def foreign_fence(self, foreign: int | None) -> tuple[SimMarker, ...]:
        """A point after the work enqueued so far on the foreign stream, or,
        for None, on every stream of the device (any context)."""
        self._check_open()
        if foreign is None:
            streams = self.engine.busy_streams()
        else:
            fs = self.engine.stream_at(foreign)
            if fs is not None and fs.destroyed:
                return ()  # a destroyed stream had no queued work left
            streams = [self._foreign_stream(foreign)]
        return tuple(self._mark(fs) for fs in streams if not fs.destroyed)

    def wait_fence(self, stream: StreamHandle, fence: object) -> None:
        """Make ``stream`` wait, device-side, for a fence of :meth:`foreign_fence`."""
        s = self._stream(stream)
        if not isinstance(fence, tuple):
            raise TypeError(f"fence: expected what foreign_fence() returned, got {type(fence).__name__}")
        eng = self.engine
        for m in fence:
            label = f"wait stream {m.stream.index} marker {m.seq}"
            eng.enqueue(s, Command("wait_marker", eng.next_seq(), label, 0.0, m))

    def drop_fence(self, fence: object) -> None:
        """Nothing to free on the simulator."""

    def wait_foreign_event(self, stream: StreamHandle, event: int) -> None:
        raise TypeError(
            "ops.after: the simulator has no foreign events; order after a stream instead "
            "(anything with __cuda_stream__, such as another scope's trio_cuda.Stream)"
        )

    def dlpack_device(self) -> tuple[int, int]:
        """``(kDLExtDev, n)``: simulated memory is no real device's; only
        ``trio_cuda.borrow`` on the same SimDevice accepts it."""
        return (DLPACK_SIM_DEVICE, self.engine.dl_id)

    def pointer_device(self, ptr: int, nbytes: int) -> str | None:
        """None if ``[ptr, ptr + nbytes)`` is live memory of this device, else
        what it is instead."""
        if nbytes == 0 or self.engine.find_live(ptr, nbytes) is not None:
            return None
        return (
            f"no live allocation of simulated device {self._device.name!r} holds {nbytes} bytes at {ptr:#x}"
        )

    # ------------------------------------------------------------------ graphs

    def begin_capture(self, stream: StreamHandle) -> None:
        """Record the work commands enqueued on ``stream`` instead of running
        them. Until the capture ends, ``alloc`` raises GraphCaptureError, and so
        do markers, waits, gates and synchronising copies on the stream.
        Faults injected with ``inject_fault`` are not consumed by a capture:
        they hit the next replay."""
        s = self._stream(stream)
        if self._capturing is not None:
            raise _common.already_capturing(self._capturing.index)
        s.begin_capture()
        self._capturing = s

    def _end(self, stream: StreamHandle) -> list[Command]:
        s = self._stream(stream)
        nodes = s.end_capture()  # raises unless capturing
        self._capturing = None
        return nodes

    def end_capture(self, stream: StreamHandle) -> SimGraph:
        return SimGraph(self, tuple(self._end(stream)))

    def abort_capture(self, stream: StreamHandle) -> None:
        s = self._stream(stream)
        if s.capturing:
            self._end(s)

    def instantiate(self, graph: object) -> SimGraphExec:
        """An executable graph of the captured commands. Takes
        ``graph_host_time`` (then the core calls it in a worker thread)."""
        g = self._graph(graph)
        g.consumed = True
        dev = self._device
        if dev.graph_host_time:
            time.sleep(dev.graph_host_time)
        handle = _GRAPH_BASE + self.engine.graph_made() * ALIGN
        return SimGraphExec(self, g.nodes, handle)

    def graph_upload(self, graph_exec: object) -> None:
        """Nothing to upload on the simulator: the upload is counted
        (``SimDevice.graph_uploads`` and the executable graph's ``uploads``),
        so that tests see the core upload each graph once, before its first
        replay."""
        ge = self._exec(graph_exec)
        self.engine.graph_uploaded(ge)

    def graph_launch(self, stream: StreamHandle, graph_exec: object) -> None:
        s = self._stream(stream)
        ge = self._exec(graph_exec)
        eng = self.engine
        fault: str | None = None
        if not s.capturing:
            fault = eng.launch_fault("graph", f"{ge.handle:#x}", "cuGraphLaunch")
        nodes = ge.nodes  # a snapshot: graph_update only affects later launches
        duration = sum(n.duration for n in nodes)
        label = f"graph {ge.handle:#x} ({len(nodes)} commands)"
        eng.enqueue(s, Command("graph", eng.next_seq(), label, duration, (ge, nodes), fault=fault))

    def graph_update(self, graph_exec: object, graph: object) -> None:
        """Take the parameters of ``graph``: it must have the same topology (the
        same command kinds in the same order, fills of the same element size).
        Takes ``graph_host_time`` (then the core calls it in a worker thread)."""
        ge = self._exec(graph_exec)
        g = self._graph(graph)
        g.consumed = True
        dev = self._device
        if dev.graph_host_time:
            time.sleep(dev.graph_host_time)
        old, new = ge.nodes, g.nodes
        if len(old) != len(new):
            raise GraphCaptureError(
                f"graph_update: the topology changed: {len(old)} commands were captured, the update has "
                f"{len(new)}"
            )
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            if a.kind != b.kind or (a.kind == "fill" and len(a.data) != len(b.data)):
                raise GraphCaptureError(
                    f"graph_update: the topology changed: command {i} was {a.label!r}, the update has "
                    f"{b.label!r}"
                )
        ge.nodes = new

    def destroy_graph(self, graph_exec: object) -> None:
        """Destroy an executable graph. A launch of it that still executes later
        is a ``use_after_free``; destroying it twice a ``double_free``."""
        ge = self._exec(graph_exec, destroyed_ok=True)
        if ge.destroyed:
            self.engine.record_violation(Violation("double_free", ge.handle, 0, "destroy_graph", None))
            return
        ge.destroyed = True
        ge.nodes = ()  # drop the captured launches (and the arrays they name)
        self.engine.graph_destroyed()

    def _graph(self, graph: object) -> SimGraph:
        if not isinstance(graph, SimGraph) or graph.context is not self:
            raise _common.not_of_this_context("graph", graph, SimGraph, "end_capture")
        if graph.consumed:
            raise _common.graph_consumed(graph)
        return graph

    def _exec(self, graph_exec: object, *, destroyed_ok: bool = False) -> SimGraphExec:
        if not isinstance(graph_exec, SimGraphExec) or graph_exec.context is not self:
            raise _common.not_of_this_context("graph_exec", graph_exec, SimGraphExec, "instantiate")
        if graph_exec.destroyed and not destroyed_ok:
            raise _common.graph_exec_destroyed(graph_exec)
        return graph_exec

    def close(self) -> None:
        """Close the context. Streams with queued commands stay in the device's
        engine and still execute; their memory is never touched here."""
        if self._closed:
            return
        self._closed = True
        for s in self._streams:
            s.context_closed()
        self._streams.clear()


if TYPE_CHECKING:

    def _implements_protocol(ctx: SimContext) -> DeviceContext:
        return ctx
