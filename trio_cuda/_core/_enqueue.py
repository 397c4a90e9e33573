"""The enqueue target: what an op's ``_enqueue`` may call.

Invariants:

* An op enqueues its work only through an :class:`EnqueueTarget`, never by
  calling the driver or the scope around it (``ctx.driver`` is for the work
  itself, after ``ctx.use`` took its leases).
* There are exactly four targets, each explicit about what it does:

  - ``_submit.EnqueueContext``, the tracked enqueue of a submission: leases,
    owners and finishers are recorded on the submission *before* the driver
    call that enqueues the work;
  - ``_submit.UnsafeEnqueue``, ``unsafe.async_on``: arrays are checked, no
    lease is taken, nothing is retained, no wait is added;
  - ``_submit.Preflight``, the dry run of ``conflicts="error"``: every lease
    is checked, nothing is enqueued or recorded;
  - ``_graph.GraphRecorder``, a graph capture: the accesses and owners go to
    the graph, and what a replay cannot repeat is refused with
    :class:`~trio_cuda.GraphCaptureError`.
* Whether an op can be captured is declared by the op
  (``DeviceOp._capture_refusal``, walked by ``_ops.capture_refusal``) and
  checked before a capture records anything; the recorder's refusals are the
  backstop for what ``then`` closures return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._array import DeviceArray
    from ._driver import DeviceContext, Finisher
    from ._launch import PreparedLaunch
    from ._ops import Access, HostResult
    from ._scope import ResourceScope
    from ._stream import Stream
    from ._submit import Submission

__all__ = ["EnqueueTarget"]


class EnqueueTarget(Protocol):
    """What an op's ``_enqueue(ctx)`` may use."""

    @property
    def scope(self) -> ResourceScope: ...

    @property
    def stream(self) -> Stream: ...

    @property
    def submission(self) -> Submission | None:
        """The submission being enqueued (None: unsafe, preflight or recording)."""
        ...

    #: a dry run (``Preflight``): check, keep closure results, enqueue nothing
    preflight: bool
    #: a graph recording (``GraphRecorder``)
    capturing: bool
    #: ``unsafe.async_on``
    unsafe: bool

    @property
    def driver(self) -> DeviceContext: ...

    def recall(self) -> object:
        """A closure result a preflight kept for this enqueue, or ``RUN``."""
        ...

    def keep(self, value: object) -> object:
        """Keep a closure's result for the real enqueue (a preflight); returns it."""
        ...

    def retain(self, obj: object) -> None:
        """Keep ``obj`` alive until the work retired."""
        ...

    def on_retire(self, fn: Finisher) -> None:
        """Run ``fn`` at retirement, once the work completed successfully."""
        ...

    def enqueued(self) -> None:
        """A driver call enqueued work."""
        ...

    def mark(self) -> int | None:
        """A device timestamp before an enqueue (traced scopes), else None."""
        ...

    def traced(self, name: str, mark: int | None = None) -> None:
        """Record the enqueue of ``name`` in the scope's trace, if any."""
        ...

    def use(self, accesses: Sequence[tuple[DeviceArray, Access]], *, what: str = "argument") -> None:
        """Check (and, when tracked, take) the leases of one piece of work."""
        ...

    def after(self, other: Submission | None) -> None:
        """Order this work after ``other`` (shared ops)."""
        ...

    def launch(self, prepared: PreparedLaunch, accesses: Sequence[tuple[DeviceArray, Access]]) -> None: ...

    def copy(self, dst: object, src: object) -> None: ...

    def fill(self, arr: DeviceArray, pattern: bytes) -> None: ...

    def host_step(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> HostResult[Any]: ...
