"""The simulator's handles: streams, markers, gates, loaded kernels and graphs.

Invariants:

* A :class:`SimStream` is a FIFO command queue of one :class:`~.context.SimContext`;
  the core only uses its ``index``. Its counters: ``_marker_seq`` (last marker
  recorded), ``_done_seq`` (last marker executed: what the host sees).
* Handles hold no behaviour of their own: the engine (``engine``) executes
  commands, the context (``context``) creates and checks handles.
* A :class:`SimFunction` and a :class:`SimGraphExec` carry a unique fake
  address, never inside device memory, so that a use after unload or destroy
  is a memcheck ``use_after_free`` at that address.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, final

import attrs

from ..._core._driver import Poll

if TYPE_CHECKING:
    from ..._core._kernel import Kernel
    from .context import SimContext
    from .device import SimDevice
    from .engine import _Cmd

__all__ = ["SimFunction", "SimGate", "SimGraph", "SimGraphExec", "SimMarker", "SimStream"]


@final
class SimStream:
    """A simulated stream: a FIFO command queue. The core only uses ``index``."""

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
        self._queue: deque[_Cmd] = deque()
        self._marker_seq = 0  # last marker recorded
        self._done_seq = 0  # last marker executed (the host-visible counter)
        self._results: dict[int, Poll] = {}  # only markers that did not end DONE
        self._error: BaseException | None = None
        self._extra_errors = 0
        self._unknown = False
        self._waiters: dict[SimStream, None] = {}
        self._clock = 0.0
        self._destroyed = False
        #: commands recorded instead of enqueued while a graph capture runs
        self._capture: list[_Cmd] | None = None

    @property
    def device(self) -> SimDevice:
        return self._context.device

    @property
    def queued(self) -> int:
        """Commands enqueued on this stream and not executed yet."""
        return len(self._queue)

    def __repr__(self) -> str:
        state = " destroyed" if self._destroyed else ""
        return f"<SimStream {self.index} of {self._context.device.name}{state} queued={len(self._queue)}>"

    def _add_error(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        else:
            self._extra_errors += 1


@attrs.frozen
class SimMarker:
    """A recorded point in a stream's order: done once the stream's counter
    reaches ``seq``."""

    stream: SimStream
    seq: int


@final
class SimGate:
    """A stream-side wait that :meth:`SimContext.open_gate` opens."""

    __slots__ = ("_opened_at", "opened", "stream")

    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        self.opened = False
        self._opened_at = 0.0

    def __repr__(self) -> str:
        return f"<SimGate on stream {self.stream.index} {'open' if self.opened else 'closed'}>"


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

    def __init__(self, context: SimContext, nodes: tuple[_Cmd, ...]) -> None:
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

    def __init__(self, context: SimContext, nodes: tuple[_Cmd, ...], handle: int) -> None:
        self.context = context
        self.nodes = nodes
        self.handle = handle
        self.destroyed = False
        #: ``graph_upload`` calls so far
        self.uploads = 0

    def __repr__(self) -> str:
        state = " destroyed" if self.destroyed else ""
        return f"<SimGraphExec {self.handle:#x} of {len(self.nodes)} commands{state}>"
