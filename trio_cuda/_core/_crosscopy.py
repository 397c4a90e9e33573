"""Cross-scope copies: a copy between memory of two scopes (two devices, or
two scopes of one device), and the leases it takes on the other scope's memory.

Invariants:

* A cross-scope copy (``ops.copy(dst, src)`` where ``dst`` and ``src`` are
  owned by different scopes) runs on one stream of the scope it is submitted
  to, which must own ``dst`` or ``src``. It takes a write lease on ``dst`` and
  a read lease on ``src`` *on their own allocations*, whichever scope owns
  them, before anything is enqueued, exactly as a same-scope copy does.
* A conflict with another scope's in-flight work (its writer of ``src``, or
  its readers and writer of ``dst``) becomes a device-side wait of the copy's
  stream on that work's completion marker (``driver.wait_marker``: across
  devices within one process), never a host block; under
  ``conflicts="error"`` it raises ``AccessConflictError`` as on one device.
  Later work of the other scope orders after the copy the same way.
* Leases are released by the handoff task of the scope that *submitted* the
  work, in its completion order. Releasing a lease on another scope's memory
  hands the free decision back to the owning scope's memory table
  (``MemoryTable.release_foreign``): no memory is freed while any scope's
  in-flight work holds a lease on it, also when the owner's handles were
  closed or garbage-collected meanwhile.
* Scope exit waits, shielded and without blocking the loop, first for its own
  work and then for the *foreign leases* on its allocations (other scopes'
  in-flight copies), within ``drain_timeout``. Whatever foreign work still
  holds a lease then is not waited for: the memory it uses is quarantined
  (never freed) and the scope's driver state (context, streams, modules) is
  leaked with a ``ResourceWarning``, as for its own work after a timeout.
  A scope that is exiting refuses new cross-scope copies of its memory
  (``ScopeClosedError``), so the wait ends. The memory table keeps that
  count (``MemoryTable.foreign``).
* A foreign lease that is quarantined (completion of the copy unknown) is
  counted as quarantined where the memory lives, and its owner stops waiting
  for it; the memory is never freed.
* A cross-scope copy fails (at retirement) if the other scope's work that
  wrote ``src`` failed or has unknown completion: the data it copied cannot be
  trusted, and that must not pass silently into the other device's work.
* Everything runs on the one Trio loop thread; scopes that share memory must
  belong to the same Trio run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._array import DeviceArray
from ._driver import MarkerState
from ._errors import CompletionUnknownError, KernelArgumentError, ScopeClosedError, TrioCudaError
from ._extent import array_extent
from ._final import final
from ._ops import Access

if TYPE_CHECKING:
    from ._enqueue import EnqueueTarget
    from ._scope import ResourceScope
    from ._submit import Submission

__all__ = ["cross_scope_copy", "scope_label"]


def scope_label(scope: ResourceScope) -> str:
    info = scope._info
    return f"{info.backend}:{info.ordinal} ({info.name})"


def cross_scope_copy(ctx: EnqueueTarget, dst: DeviceArray, src: DeviceArray) -> None:
    """``EnqueueTarget.copy`` (tracked or unsafe) for two device arrays of which at least one is
    owned by another scope (see the module invariants)."""
    from ._leases import overlapping
    from ._submit import SubState, take_leases

    scope = ctx.scope
    d_owner = dst._alloc.scope
    s_owner = src._alloc.scope
    if d_owner is not scope and s_owner is not scope:
        raise KernelArgumentError(
            f"copy: expected dst or src owned by the scope the copy is submitted to "
            f"({scope_label(scope)}), got dst of {scope_label(d_owner)} and src of {scope_label(s_owner)}"
        )
    other = s_owner if d_owner is scope else d_owner
    label = "copy: src" if other is s_owner else "copy: dst"
    arr = src if other is s_owner else dst
    arr._check_usable(label)
    if other._closing:
        raise ScopeClosedError(
            f"{label}: expected an array of an open scope, got one of {scope_label(other)}, which is exiting"
        )
    if other._token is not scope._token:
        raise ValueError(f"{label}: expected an array of a scope in this Trio run, got one of another run")
    driver = ctx.driver
    if type(other._driver) is not type(driver):
        raise KernelArgumentError(
            f"copy: expected dst and src on devices of one backend that copies between devices, got "
            f"dst on {scope_label(d_owner)} and src on {scope_label(s_owner)}"
        )
    try:
        driver.check_copy_peer(d_owner._driver, s_owner._driver)
    except ValueError as exc:
        raise KernelArgumentError(str(exc)) from None
    sub = ctx.submission
    accesses = ((src, Access.READ), (dst, Access.WRITE))
    writers: list[Submission] = []
    if sub is None:  # unsafe.async_on: checks only, no leases
        take_leases(scope, ctx.stream, None, accesses, "copy", foreign=True)
    else:
        new = [
            a for a in {dst._alloc: None, src._alloc: None} if a.scope is not scope and a not in sub.leases
        ]
        if s_owner is not scope:  # the other scope's in-flight writers of the copied bytes
            writers = [
                w for w in overlapping(src._alloc, True, array_extent(src)) if w.state is SubState.IN_FLIGHT
            ]
        take_leases(scope, ctx.stream, sub, accesses, "copy", foreign=True)
        for a in new:
            a.table.add_foreign()
    token = driver.copy_peer(
        ctx.stream.handle, dst.ptr, d_owner._driver, src.ptr, s_owner._driver, dst.nbytes
    )
    if token is not None:
        ctx.retain(token)
    for w in writers:
        ctx.on_retire(_ProducerCheck(w, s_owner))
    ctx.enqueued()


@final
class _ProducerCheck:
    """At the copy's retirement: fail it if the other scope's work that wrote
    its source failed or has unknown completion."""

    __slots__ = ("owner", "writer")

    def __init__(self, writer: Submission, owner: ResourceScope) -> None:
        self.writer = writer
        self.owner = owner

    def __call__(self) -> None:
        from ._submit import SubState

        w = self.writer
        state = w.state
        unknown = state is SubState.QUARANTINED
        failed = state is SubState.FAILED
        if state is SubState.IN_FLIGHT and w.marker is not None:
            p = w.scope._driver.poll_marker(w.marker)
            unknown = p.state is MarkerState.UNKNOWN
            failed = p.state is MarkerState.FAILED
        if unknown:
            raise CompletionUnknownError(
                f"copy: src: completion of {w.label}, which wrote it on {scope_label(self.owner)}, is "
                f"unknown; the copied data cannot be trusted"
            )
        if failed:
            raise TrioCudaError(
                f"copy: src: {w.label}, which wrote it on {scope_label(self.owner)}, failed; the copied "
                f"data cannot be trusted"
            )
