"""The statistics of a scope: a frozen snapshot, ``gpu.statistics()``.

Invariants: a snapshot never changes after it was taken; ``submitted ==
in_flight + completed``; ``failed`` and ``quarantined`` count parts of
``completed`` (but for exports abandoned at exit, never in flight);
``quarantined_bytes`` is part of ``live_bytes``.
"""

from __future__ import annotations

import attrs

from ._final import final

__all__ = ["ScopeStatistics"]


@final
@attrs.frozen
class ScopeStatistics:
    """A snapshot of a scope (``gpu.statistics()``).

    Work is counted in submissions: one per op run or submitted (``gpu.run``,
    ``gpu.submit``, ``await op``, a graph's replay, the copy of
    ``gpu.to_device`` or ``gpu.to_host``; an op of several pieces, ``then`` and
    ``zip`` included, is one), one per array the scope adopts (``gpu.empty``,
    the allocation ``gpu.to_device`` makes, ``trio_cuda.borrow``), and one per
    DLPack or CUDA Array Interface export once its consumer released it; work
    enqueued with ``unsafe.async_on`` is not counted. ``submitted == in_flight + completed``,
    and ``failed`` and ``quarantined`` are parts of ``completed`` (but for
    exports abandoned at exit, which were never in flight). Leases are
    counted per allocation and holder; bytes per whole allocation."""

    #: the backend that runs the scope: ``"cuda"`` or ``"sim"`` (``gpu.device.backend``)
    backend: str
    #: the device's name, as the driver reports it (``gpu.device.name``)
    device: str
    #: the scope's streams (``open_scope(streams=...)``, fixed for its life)
    streams: int
    #: submissions enqueued and not yet retired; one that raised while it was
    #: enqueued, after it took leases or enqueued part of its work, stays in
    #: flight until that retires (one that raised before is not counted)
    in_flight: int
    #: every submission so far: ``in_flight + completed``
    submitted: int
    #: submissions retired, successfully or not: ``failed`` and ``quarantined``
    #: ones included
    completed: int
    #: of ``completed``: those that ended with an error (the device work
    #: failed, the submission raised while it was enqueued, or a host-side
    #: part of it raised, a host closure say) or whose completion is unknown
    #: (the quarantined ones, but for abandoned exports)
    failed: int
    #: submissions whose completion could not be established, or that were
    #: still in flight when the exit's drain gave up (``drain_timeout``, or a
    #: second Ctrl-C), and exports their consumer still held at exit: their
    #: leases and memory are leaked on purpose, never released
    quarantined: int
    #: leases on this scope's allocations not yet released: those of in-flight
    #: work (other scopes' cross-device copies included, see
    #: ``foreign_leases``) and of exports a consumer still holds; quarantined
    #: leases are counted in ``quarantined_leases`` instead
    leases_held: int
    #: leases on this scope's allocations that quarantined work or an
    #: abandoned export holds (this scope's or another's): never released
    quarantined_leases: int
    #: bytes of the allocations this scope's in-flight submissions lease
    #: (whole allocations, each counted once)
    retained_bytes: int
    #: bytes of this scope's quarantined allocations (leased by quarantined
    #: work or an abandoned export, or whose free failed), which are never
    #: freed; a part of ``live_bytes``
    quarantined_bytes: int
    #: allocations not yet freed: this scope's own and the memory it borrowed
    #: (``trio_cuda.borrow``), quarantined ones included
    live_allocations: int
    #: bytes of the ``live_allocations``
    live_bytes: int
    #: errors nobody has observed yet (failed work no task awaited, errors of
    #: the completion handoff); the scope's exit raises them
    pending_errors: int
    #: host closures (``ops.host_closure``) enqueued and not yet run: each runs
    #: once the work before it on its stream completed, and the stream's later
    #: work waits for it
    host_closures_pending: int
    #: leases that other scopes' in-flight work (cross-device copies) holds on
    #: this scope's allocations; exit waits for them (see :doc:`multigpu`)
    foreign_leases: int = 0
    #: of ``completed``: retired by an awaiting task that observed the
    #: completion itself (the rest by the completion-handoff task, the exit,
    #: or ``wait_nowait``)
    retired_by_waiters: int = 0
