"""CUDA graphs on the cuda backend: stream capture, instantiation, replay, update.

Invariants:

* One capture at a time per context, in thread-local mode: potentially unsafe
  calls from the capturing thread invalidate it. Allocations, markers, waits,
  gates and synchronising copies on the capturing stream raise
  ``GraphCaptureError`` before the driver sees them (``_common``);
  :func:`relaxed_capture` lets one necessary call through (module loading, a
  pinned allocation). The capturing stream is the stream table's
  ``capturing``, which only :class:`Graphs` sets.
* A template (``CUgraph``) is consumed by ``instantiate`` or ``graph_update``,
  also when they raise. ``instantiate``, ``graph_upload`` and ``graph_update``
  push and pop this context, so they may run in a worker thread (the core
  serialises every call on one executable graph).
* ``graph_upload`` uploads on a private stream and waits for it in its own
  (worker) thread: the executable graph reaches the loop already uploaded.
* An executable graph is destroyed by ``destroy_graph`` (once no launch of it
  can still run) or at close, before the modules its kernel nodes use; a
  destroyed one raises ``CUDA_ERROR_INVALID_HANDLE`` (``_common``).
* :class:`Graphs` owns the live executable graphs (``execs``); templates and
  executable graphs name it as their ``owner``, and one of another context
  is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, final

from ..._core._driver import StreamHandle
from ..._core._errors import GraphCaptureError
from .. import _common
from . import primary as _primary
from .bindings import cu
from .errors import check, cuda_error

if TYPE_CHECKING:
    from .state import ContextState
    from .streams import StreamTable

__all__ = ["CudaGraphExec", "CudaGraphTemplate", "Graphs", "relaxed_capture"]


@final
class CudaGraphTemplate:
    """A captured ``CUgraph`` (from :meth:`CudaContext.end_capture`), consumed
    by ``instantiate`` or ``graph_update``."""

    __slots__ = ("graph", "owner")

    def __init__(self, owner: Graphs, graph: Any) -> None:
        self.owner = owner
        self.graph: Any = graph

    def __repr__(self) -> str:
        return f"<CudaGraphTemplate {'consumed' if self.graph is None else 'captured'}>"


@final
class CudaGraphExec:
    """An executable graph (``CUgraphExec``) of one context."""

    __slots__ = ("__weakref__", "destroyed", "handle", "owner")

    def __init__(self, owner: Graphs, handle: Any) -> None:
        self.owner = owner
        self.handle = handle
        self.destroyed = False

    def __repr__(self) -> str:
        return f"<CudaGraphExec 0x{int(self.handle):x}{' destroyed' if self.destroyed else ''}>"


@contextlib.contextmanager
def relaxed_capture(table: StreamTable) -> Iterator[None]:
    """While this thread captures (a stream of ``table`` is capturing), let one
    potentially unsafe call through (``cuThreadExchangeStreamCaptureMode``);
    a no-op otherwise."""
    if table.capturing is None:
        yield
        return
    err, old = cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    if err:
        raise cuda_error(err, "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        cu.cuThreadExchangeStreamCaptureMode(old)


@final
class Graphs:
    """The captures and executable graphs of one context."""

    __slots__ = ("_state", "_stream", "_table", "execs")

    def __init__(self, state: ContextState, table: StreamTable) -> None:
        self._state = state
        self._table = table
        self._stream = table.stream
        #: the live executable graphs (destroyed at close, before the kernels' modules)
        self.execs: dict[CudaGraphExec, None] = {}

    def begin_capture(self, stream: StreamHandle) -> None:
        """``cuStreamBeginCapture`` in thread-local mode: potentially unsafe
        calls (allocations, synchronisations) from this thread invalidate the
        capture, and so do synchronising calls on the stream itself."""
        s = self._stream(stream)
        table = self._table
        if table.capturing is not None:
            raise _common.already_capturing(table.capturing.index)
        if self._state.sticky is not None:
            raise self._state.sticky
        table.flush_stream(s)  # a deferred marker write of earlier work must not be captured
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        (err,) = cu.cuStreamBeginCapture(s.cu, mode)
        if err:
            raise cuda_error(err, "cuStreamBeginCapture")
        table.capturing = s

    def _end(self, stream: StreamHandle) -> tuple[Any, Any]:
        s = self._stream(stream)
        if self._table.capturing is not s:
            raise _common.not_capturing(s.index)
        self._table.capturing = None
        return cu.cuStreamEndCapture(s.cu)  # type: ignore[no-any-return]

    def end_capture(self, stream: StreamHandle) -> CudaGraphTemplate:
        err, graph = self._end(stream)
        if err:
            if graph is not None and int(graph):
                cu.cuGraphDestroy(graph)
            cause = cuda_error(err, "cuStreamEndCapture")
            raise GraphCaptureError(
                f"the capture was invalidated ({cause.name}): an operation during it was not allowed "
                f"in stream capture (an allocation or a synchronising call)"
            ) from cause
        return CudaGraphTemplate(self, graph)

    def abort_capture(self, stream: StreamHandle) -> None:
        if self._table.capturing is not stream:
            return
        _err, graph = self._end(stream)  # an invalidated capture also leaves capture mode
        if graph is not None and int(graph):
            cu.cuGraphDestroy(graph)

    def _template(self, graph: object) -> CudaGraphTemplate:
        if type(graph) is not CudaGraphTemplate or graph.owner is not self:
            raise _common.not_of_this_context("graph", graph, CudaGraphTemplate, "end_capture")
        if graph.graph is None:
            raise _common.graph_consumed(graph)
        return graph

    @contextlib.contextmanager
    def _pushed(self, call: str) -> Iterator[None]:
        """This context, current on the calling thread (any thread) meanwhile."""
        check(cu.cuCtxPushCurrent(self._state.ctx), f"cuCtxPushCurrent ({call})")
        try:
            yield
        finally:
            cu.cuCtxPopCurrent()

    def instantiate(self, graph: object) -> CudaGraphExec:
        """``cuGraphInstantiate`` (milliseconds for large graphs: the core
        calls it in a worker thread, see ``instantiate_in_thread``). Pushes
        and pops this context, so it runs on any thread."""
        t = self._template(graph)
        g, t.graph = t.graph, None
        with self._pushed("cuGraphInstantiate"):
            try:
                err, graph_exec = cu.cuGraphInstantiate(g, 0)
                if err:
                    raise cuda_error(err, "cuGraphInstantiate")
            finally:
                cu.cuGraphDestroy(g)
        ge = CudaGraphExec(self, graph_exec)
        self.execs[ge] = None  # one dict store: atomic under the GIL
        return ge

    def graph_upload(self, graph_exec: object) -> None:
        """``cuGraphUpload`` of a new executable graph, so that its first
        ``cuGraphLaunch`` does not upload it; the core calls it right after
        :meth:`instantiate`, in the same worker thread.

        The upload is not ordered on one of the scope's streams: the first
        replay may go to any of them (the policy picks it at submit time),
        and a stream-ordered upload would have to be ordered before it with an
        extra event, or could be captured into another graph by a capture
        that the loop begins on that stream meanwhile. Instead it goes on a
        private non-blocking stream, made for it, which this (worker) thread
        synchronises: it holds nothing else (the graph was never launched, so
        the upload waits for nothing), and the executable graph reaches the
        loop only once the upload has completed, so every replay comes after
        it. Errors are the driver's ``CudaError`` (``cuda_error``; no sticky
        state is set from this thread: the loop finds a broken context
        itself); the caller destroys ``graph_exec`` then."""
        ge = self._graph_exec(graph_exec)
        if self._state.sticky is not None:
            raise self._state.sticky
        with self._pushed("cuGraphUpload"):
            flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
            stream = check(cu.cuStreamCreate(flags), "cuStreamCreate (cuGraphUpload)")
            try:
                (err,) = cu.cuGraphUpload(ge.handle, stream)
                if err:
                    raise cuda_error(err, "cuGraphUpload")
                (err,) = cu.cuStreamSynchronize(stream)
                if err:
                    raise cuda_error(err, "cuStreamSynchronize (cuGraphUpload)")
            finally:
                cu.cuStreamDestroy(stream)

    def _graph_exec(self, graph_exec: object) -> CudaGraphExec:
        if type(graph_exec) is not CudaGraphExec or graph_exec.owner is not self:
            raise _common.not_of_this_context("graph_exec", graph_exec, CudaGraphExec, "instantiate")
        if graph_exec.destroyed:
            raise _common.graph_exec_destroyed(graph_exec)
        return graph_exec

    def graph_launch(self, stream: StreamHandle, graph_exec: object) -> None:
        s = self._stream(stream)
        ge = graph_exec if type(graph_exec) is CudaGraphExec and not graph_exec.destroyed else None
        if ge is None or ge.owner is not self:
            ge = self._graph_exec(graph_exec)
        if _primary.multi_device:
            cu.cuCtxSetCurrent(self._state.ctx)
        (err,) = cu.cuGraphLaunch(ge.handle, s.cu)
        if err:
            self._state.fail(err, "cuGraphLaunch")

    def graph_update(self, graph_exec: object, graph: object) -> None:
        """``cuGraphExecUpdate``: the parameters of ``graph`` (kernel
        arguments, copy and fill operands) for later launches, when the
        topology is the same; ``GraphCaptureError`` naming the reason if not.
        Pushes and pops this context: the core calls it in a worker thread
        (``instantiate_in_thread``), and no other call on ``graph_exec`` runs
        meanwhile (CUDA graph objects are not thread-safe)."""
        ge = self._graph_exec(graph_exec)
        t = self._template(graph)
        g, t.graph = t.graph, None
        with self._pushed("cuGraphExecUpdate"):
            try:
                err, info = cu.cuGraphExecUpdate(ge.handle, g)
            finally:
                cu.cuGraphDestroy(g)
        if err:
            result = getattr(getattr(info, "result", None), "name", "") or "unknown reason"
            cause = cuda_error(err, "cuGraphExecUpdate")
            raise GraphCaptureError(
                f"cuGraphExecUpdate refused the update ({result}): the new capture must have the "
                f"same topology (the same kernel launches, copies and fills in the same order)"
            ) from cause

    def destroy_graph(self, graph_exec: object) -> None:
        if type(graph_exec) is not CudaGraphExec or graph_exec.owner is not self:
            raise _common.not_of_this_context("graph_exec", graph_exec, CudaGraphExec, "instantiate")
        if graph_exec.destroyed:
            return
        graph_exec.destroyed = True
        self.execs.pop(graph_exec, None)
        if self._state.sticky is not None:
            return  # leak: the context is broken
        (err,) = cu.cuGraphExecDestroy(graph_exec.handle)
        if err:
            raise cuda_error(err, "cuGraphExecDestroy")

    def close(self) -> None:
        """At close (not after a sticky error): destroy the live executable graphs."""
        for ge in list(self.execs):
            ge.destroyed = True
            cu.cuGraphExecDestroy(ge.handle)
        self.execs.clear()
