"""The simulator's handles: streams, markers, gates, loaded kernels and graphs.

Invariants:

* A :class:`SimStream` is a FIFO command queue of one :class:`~.context.SimContext`;
  the core only uses its ``index``. It owns everything the device knows
  about it: its queue, its counters (``_marker_seq``, the last marker
  recorded; ``_done_seq``, the last marker executed: what the host sees),
  the markers' results, the errors gathered for its next marker, the
  streams waiting on its markers, its clock (when its last command ended)
  and its graph capture. Nothing outside this module touches those fields:
  the engine and the context use its internal interface, the names without
  a leading underscore: ``context``, ``destroyed``, ``queued``; the queue
  (``push``, ``head``, ``pop``, ``clock``, ``ended``, ``due``); capture
  (``capturing``, ``begin_capture``, ``capture``, ``end_capture``); markers
  and errors (``new_marker``, ``reached``, ``poll``, ``add_waiter``,
  ``add_error``, ``mark_unknown``, ``complete_marker``); lifetime
  (``destroy``, ``context_closed``).
* Errors attach to the stream's next marker (``complete_marker``): the first
  one fails it, with a note counting the others; an unknown outcome makes it
  poll ``UNKNOWN`` forever. Either is forgotten after that marker. A capturing
  stream records work commands and refuses every other command and markers
  (``_common.not_capturable``).
* A :class:`SimGate` owns its state: it opens once (``open``), at a device time
  (``opened_at``) that the bookkeeping waiting on it starts from.
* Handles do not execute anything: the engine (``engine``) executes
  commands, the context (``context``) creates and checks handles.
* A :class:`SimFunction` and a :class:`SimGraphExec` carry a unique fake
  address, never inside device memory, so that a use after unload or destroy
  is a memcheck ``use_after_free`` at that address.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, final

import attrs

from ..._core._driver import DONE, PENDING, MarkerState, Poll
from ..._core._errors import CompletionUnknownError
from .. import _common

if TYPE_CHECKING:
    from ..._core._kernel import Kernel
    from .context import SimContext
    from .device import SimDevice
    from .engine import Command

__all__ = ["SimFunction", "SimGate", "SimGraph", "SimGraphExec", "SimMarker", "SimStream"]


@final
class SimStream:
    """A simulated stream: a FIFO command queue, and everything the device
    knows about it. The core only uses ``index``; the simulator uses the
    internal interface listed in the module invariants."""

    __slots__ = (
        "_capture",
        "_clock",
        "_context",
        "_destroyed",
        "_done_seq",
        "_error",
        "_extra_errors",
        "_marker_seq",
        "_queue",
        "_results",
        "_unknown",
        "_waiters",
        "index",
    )

    def __init__(self, index: int, context: SimContext) -> None:
        self.index = index
        self._context = context
        self._queue: deque[Command] = deque()
        self._marker_seq = 0  # last marker recorded
        self._done_seq = 0  # last marker executed (the host-visible counter)
        self._results: dict[int, Poll] = {}  # only markers that did not end DONE
        self._error: BaseException | None = None
        self._extra_errors = 0
        self._unknown = False
        self._waiters: dict[SimStream, None] = {}
        #: device time at which the last executed command ended
        self._clock = 0.0
        self._destroyed = False
        #: commands recorded instead of enqueued while a graph capture runs
        self._capture: list[Command] | None = None

    @property
    def context(self) -> SimContext:
        """The context that made the stream."""
        return self._context

    @property
    def device(self) -> SimDevice:
        return self._context.device

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def queued(self) -> int:
        """Commands enqueued on this stream and not executed yet."""
        return len(self._queue)

    def __repr__(self) -> str:
        state = " destroyed" if self._destroyed else ""
        return f"<SimStream {self.index} of {self._context.device.name}{state} queued={len(self._queue)}>"

    # ------------------------------------------------------------------ lifetime

    def destroy(self) -> None:
        """``destroy_stream``: refused while commands are queued (they would be lost)."""
        if self._queue:
            raise RuntimeError(
                f"destroy_stream: stream {self.index} still has {len(self._queue)} queued command(s); "
                f"destroying it would lose them"
            )
        self._destroyed = True
        # Failed markers' errors may carry tracebacks whose frames hold the
        # scope's arrays: drop them with the stream, or they pin the scope.
        self._results.clear()

    def context_closed(self) -> None:
        """Its context closed: destroyed unless commands are queued (those
        still execute, and the stream stays until they have)."""
        if not self._queue:
            self._destroyed = True

    # ------------------------------------------------------------------ the queue

    def push(self, cmd: Command) -> bool:
        """Queue ``cmd``; True if it is the only command (the stream became busy)."""
        q = self._queue
        q.append(cmd)
        return len(q) == 1

    def head(self) -> Command:
        """The oldest queued command (the stream must have one)."""
        return self._queue[0]

    def pop(self) -> Command:
        """Remove and return the head; executing it is the engine's."""
        return self._queue.popleft()

    @property
    def clock(self) -> float:
        """Device time at which the last executed command ended."""
        return self._clock

    def ended(self, t: float) -> None:
        """The command just popped ended at device time ``t``."""
        self._clock = t

    def due(self, cmd: Command) -> float:
        """When ``cmd``, at the head, ends if it starts as soon as it may."""
        return max(self._clock, cmd.t_enqueue) + cmd.duration

    # ------------------------------------------------------------------ capture

    @property
    def capturing(self) -> bool:
        return self._capture is not None

    def begin_capture(self) -> None:
        self._capture = []

    def capture(self, cmd: Command) -> None:
        """Record ``cmd`` in the running capture instead of queueing it; only
        work commands can be captured (``GraphCaptureError`` otherwise)."""
        assert self._capture is not None
        if not cmd.work:
            raise _common.not_capturable(cmd.label, self.index)
        self._capture.append(cmd)

    def end_capture(self) -> list[Command]:
        """End the running capture; its commands, in capture order."""
        nodes = self._capture
        if nodes is None:
            raise _common.not_capturing(self.index)
        self._capture = None
        return nodes

    # ------------------------------------------------------------------ markers and errors

    def new_marker(self) -> SimMarker:
        """The next marker of the stream (its command is the caller's to enqueue).
        A capturing stream refuses it, before the sequence number is taken."""
        if self._capture is not None:
            raise _common.not_capturable(f"marker {self._marker_seq + 1}", self.index)
        self._marker_seq += 1
        return SimMarker(self, self._marker_seq)

    def reached(self, seq: int) -> bool:
        """True once marker ``seq`` of the stream has executed."""
        return seq <= self._done_seq

    def poll(self, seq: int) -> Poll:
        """Marker ``seq``'s state as the host sees it."""
        if seq > self._done_seq:
            return PENDING
        if self._results:
            return self._results.get(seq, DONE)
        return DONE

    def add_waiter(self, waiter: SimStream) -> None:
        """``waiter``'s head waits for a marker of this stream not executed yet."""
        self._waiters[waiter] = None

    def add_error(self, error: BaseException) -> None:
        """Work on the stream failed: the next marker fails with the first error
        (and a note counting the others)."""
        if self._error is None:
            self._error = error
        else:
            self._extra_errors += 1

    def mark_unknown(self) -> None:
        """Work on the stream has an unknown outcome (an injected
        ``completion_unknown``): the next marker polls UNKNOWN forever."""
        self._unknown = True

    def complete_marker(self, seq: int) -> list[SimStream]:
        """Execute marker ``seq``: it takes the errors (or the unknown outcome)
        gathered since the last one. Returns the streams that waited for it,
        which no longer do; waking them is the engine's."""
        if self._unknown:
            self._results[seq] = Poll(
                MarkerState.UNKNOWN,
                CompletionUnknownError(
                    f"{self._context.device.name}: completion of work before marker {seq} on stream "
                    f"{self.index} cannot be established (injected completion_unknown)"
                ),
            )
        elif self._error is not None:
            error = self._error
            if self._extra_errors:
                error.add_note(
                    f"{self._extra_errors} more error(s) on stream {self.index} before this marker"
                )
            self._results[seq] = Poll(MarkerState.FAILED, error)
        self._unknown = False
        self._error = None
        self._extra_errors = 0
        self._done_seq = seq
        if not self._waiters:
            return []
        waiters = list(self._waiters)
        self._waiters.clear()
        return waiters


@attrs.frozen
class SimMarker:
    """A recorded point in a stream's order: done once the stream's counter
    reaches ``seq``."""

    stream: SimStream
    seq: int


@final
class SimGate:
    """A stream-side wait that :meth:`SimContext.open_gate` opens."""

    __slots__ = ("_opened", "_opened_at", "stream")

    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        self._opened = False
        self._opened_at = 0.0

    @property
    def opened(self) -> bool:
        return self._opened

    @property
    def opened_at(self) -> float:
        """Device time at which it opened (0.0 while closed)."""
        return self._opened_at

    def open(self, at: float) -> None:
        """Open the gate at device time ``at`` (once; the engine's ``open_gate``)."""
        self._opened = True
        self._opened_at = at

    def __repr__(self) -> str:
        return f"<SimGate on stream {self.stream.index} {'open' if self._opened else 'closed'}>"


@final
class SimFunction:
    """What :meth:`SimContext.load_kernel` returns: the kernel's module, loaded in
    one context. ``handle`` is a unique fake module address; after
    :meth:`SimContext.unload_kernel` a launch of it that still executes is a
    ``use_after_free`` violation at that address."""

    __slots__ = ("context", "handle", "kernel", "unloaded")

    def __init__(self, kernel: Kernel, context: SimContext, handle: int) -> None:
        self.kernel = kernel
        self.context = context
        self.handle = handle
        self.unloaded = False

    def __repr__(self) -> str:
        state = " unloaded" if self.unloaded else ""
        return f"<SimFunction {self.kernel.name} at {self.handle:#x}{state}>"


@final
class SimGraph:
    """A captured command list (what :meth:`SimContext.end_capture` returns)."""

    __slots__ = ("consumed", "context", "nodes")

    def __init__(self, context: SimContext, nodes: tuple[Command, ...]) -> None:
        self.context = context
        self.nodes = nodes
        self.consumed = False

    def __repr__(self) -> str:
        return f"<SimGraph of {len(self.nodes)} commands>"


@final
class SimGraphExec:
    """An executable graph: its command list and a unique fake handle. A launch
    of it that executes after :meth:`SimContext.destroy_graph` is a
    ``use_after_free`` violation at that handle."""

    __slots__ = ("context", "destroyed", "handle", "nodes", "uploads")

    def __init__(self, context: SimContext, nodes: tuple[Command, ...], handle: int) -> None:
        self.context = context
        self.nodes = nodes
        self.handle = handle
        self.destroyed = False
        #: ``graph_upload`` calls so far
        self.uploads = 0

    def __repr__(self) -> str:
        state = " destroyed" if self.destroyed else ""
        return f"<SimGraphExec {self.handle:#x} of {len(self.nodes)} commands{state}>"
