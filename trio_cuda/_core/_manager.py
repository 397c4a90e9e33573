"""The manager that ``open_scope`` returns: it opens one scope once.

Invariants:

* A :class:`ScopeManager` is single-use: entering it again raises
  ``RuntimeError``.
* Options are checked when the manager is made, before any device is opened.
* Exit drains the scope (shielded) whatever the reason, then releases what it
  owns; errors nobody observed come out as one ``BaseExceptionGroup``, with the
  body's own exception first. ``Cancelled`` is never wrapped.
* Entry and exit are KI-protected, and a Ctrl-C that Trio delivers at one of
  the drain's waits (it does, even inside the shield) does not end the drain:
  the exit keeps waiting, then re-raises it once the scope is settled. A
  second one stops the waiting: what is still in flight is quarantined, with
  a ``ResourceWarning``, never freed. Either way the exit ends drained or
  quarantined, never half-closed.
* A failure of the tracer is logged, never raised: tracing never makes a
  program fail.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, final

import trio
from trio.lowlevel import enable_ki_protection

from ._asynclib import require_trio
from ._policy import FollowWriter, SchedulingPolicy
from ._scope import ResourceScope, _current
from ._trace import Tracer, process_tracer

if TYPE_CHECKING:
    from types import TracebackType

    from ._driver import DeviceContext

__all__ = ["ScopeManager", "scope_manager"]

log = logging.getLogger("trio_cuda")


_CONFLICTS = ("order", "error")


@final
class ScopeManager:
    """What :func:`~trio_cuda.open_scope` returns: an async context manager
    that opens one :class:`ResourceScope` once. The device is opened on
    entry, by ``opener`` (``trio_cuda._open`` picks the backend)."""

    __slots__ = (
        "_conflicts",
        "_drain_timeout",
        "_entered",
        "_nursery_cm",
        "_opener",
        "_policy",
        "_scope",
        "_streams",
        "_token",
        "_trace",
    )

    _nursery_cm: contextlib.AbstractAsyncContextManager[trio.Nursery]
    _token: contextvars.Token[ResourceScope]

    def __init__(
        self,
        opener: Callable[[], DeviceContext],
        streams: int,
        conflicts: str,
        drain_timeout: float | None,
        policy: SchedulingPolicy,
        trace: Tracer | bool | None = None,
    ) -> None:
        self._opener = opener
        self._trace = trace
        self._streams = streams
        self._conflicts = conflicts
        self._drain_timeout = drain_timeout
        self._policy = policy
        self._scope: ResourceScope | None = None
        self._entered = False

    @enable_ki_protection
    async def __aenter__(self) -> ResourceScope:
        # KI-protected, like the exit: a Ctrl-C between opening the nursery
        # and returning the scope would leave the handoff task running in a
        # nursery nobody closes; it is delivered at the body's first checkpoint.
        require_trio("open_scope()")
        await trio.lowlevel.checkpoint()
        if self._entered:
            raise RuntimeError(
                "open_scope(): this manager was already entered; it opens one scope once "
                "(call open_scope() again for another scope)"
            )
        self._entered = True
        driver = self._opener()
        try:
            scope = ResourceScope._create(driver, self._streams, self._conflicts, self._policy)
        except BaseException:
            driver.close()
            raise
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        nursery.start_soon(scope._handoff)
        self._scope = scope
        self._token = _current.set(scope)
        tracer = process_tracer() if self._trace is None or self._trace is True else self._trace
        if isinstance(tracer, Tracer):
            caps = driver.capabilities
            try:
                scope._trace_id = tracer.open_scope(scope)
                scope._trace_cmds = caps.device_clock != "host-observed"
                if tracer.timing and caps.device_timing:
                    driver.timing_start(scope._streams[0].handle)  # the scope's streams are idle
                    scope._trace_timing = True
                scope._tracer = tracer
            except Exception:  # tracing must never fail the program: the scope runs untraced
                scope._trace_timing = False
                log.exception("tracing %r failed when it opened; the scope runs untraced", scope)
        log.debug("opened %r", scope)
        return scope

    @staticmethod
    async def _drain(scope: ResourceScope, timeout: float | None) -> tuple[KeyboardInterrupt | None, str]:
        """Drain ``scope`` within ``timeout``, through Ctrl-C. Trio delivers
        ``KeyboardInterrupt`` at the main task's next blocking wait even
        inside a shield; the first one is kept (and re-raised once the scope
        is settled) and the drain goes on; a second one stops the waiting,
        and what is still in flight is then quarantined. Returns the kept
        interrupt and the phrase that says why the drain gave up, if it did."""
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        interrupt: KeyboardInterrupt | None = None
        while True:
            try:
                await scope._drain(deadline)
            except KeyboardInterrupt as ki:
                if interrupt is not None:
                    return interrupt, "after a second Ctrl-C stopped the exit's drain"
                interrupt = ki
                log.warning(
                    "Ctrl-C while %r waits for its work in flight (%d submission(s) of its own): "
                    "still waiting for the device (Ctrl-C again to stop waiting; the work still in "
                    "flight is then quarantined, its memory leaked, never freed)",
                    scope,
                    scope._in_flight,
                )
                continue
            return interrupt, f"after drain_timeout={timeout} s"

    @enable_ki_protection
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        scope = self._scope
        assert scope is not None
        _current.reset(self._token)
        scope._closing = True
        timeout = self._drain_timeout
        internal: list[BaseException] = []
        interrupt: KeyboardInterrupt | None = None
        try:
            with trio.CancelScope(shield=True):
                interrupt, after = await self._drain(scope, timeout)
                for ext in list(scope._extensions.values()):
                    ext.abandon(after)  # still held when the drain gave up
                if scope._work_remains():
                    scope._abandon_in_flight(after, interrupted=interrupt is not None)
                if scope._tracer is not None:
                    try:
                        scope._tracer.collect_times(scope, scope._trace_id)
                    except Exception:  # a trace must never stop the release, nor fail the program
                        log.exception(
                            "tracing %r failed at its exit; the trace may lack its device times", scope
                        )
                scope._release_everything()
        finally:
            tracer = scope._tracer
            if tracer is not None:
                try:
                    tracer.close_scope(scope, scope._trace_id)
                except Exception:  # a trace must never break the exit, nor fail the program
                    log.exception("tracing %r failed when it closed; the trace may lack its end", scope)
            scope._closed = True
            if scope._handoff_cs is not None:
                scope._handoff_cs.cancel()
            try:
                await self._nursery_cm.__aexit__(None, None, None)
            except trio.Cancelled:
                if exc is None:
                    raise
            except BaseException as nursery_exc:  # the handoff task crashed
                internal.append(nursery_exc)
        errors: list[BaseException] = [s.error for s in scope._unobserved if s.error is not None]
        errors.extend(scope._orphan_errors)
        errors.extend(internal)
        scope._unobserved.clear()
        scope._orphan_errors.clear()
        if interrupt is not None:
            if not errors and exc is None:
                raise interrupt  # as if the body had been interrupted: the scope is settled
            errors.append(interrupt)
        if not errors:
            if exc is None:
                await trio.lowlevel.checkpoint()
            return False
        if exc is not None:
            errors.insert(0, exc)
        raise BaseExceptionGroup(
            "errors from trio_cuda scope (work nobody awaited, or that failed late)", errors
        )


def scope_manager(
    opener: Callable[[], DeviceContext],
    streams: int = 4,
    conflicts: str = "order",
    drain_timeout: float | None = None,
    policy: SchedulingPolicy | None = None,
    trace: Tracer | bool | None = None,
) -> ScopeManager:
    """Check the options of :func:`~trio_cuda.open_scope` up front and make
    its manager; ``opener`` opens the device on entry. ``trace``: a tracer to
    record into, False (none), or None/True (the process tracer, if any)."""
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams: expected an int >= 1, got {streams!r}")
    if conflicts not in _CONFLICTS:
        raise ValueError(f"conflicts: expected 'order' or 'error', got {conflicts!r}")
    if drain_timeout is not None:
        if (
            isinstance(drain_timeout, bool)
            or not isinstance(drain_timeout, numbers.Real)
            or math.isnan(drain_timeout)
            or drain_timeout < 0
        ):
            raise ValueError(f"drain_timeout: expected None or a number >= 0, got {drain_timeout!r}")
        drain_timeout = None if math.isinf(drain_timeout) else float(drain_timeout)
    if policy is None:
        policy = FollowWriter()
    elif not callable(getattr(policy, "choose", None)):
        raise TypeError(f"policy: expected a SchedulingPolicy (with a choose() method), got {policy!r}")
    if trace is not None and not isinstance(trace, (bool, Tracer)):
        raise TypeError(f"trace: expected None, a bool or a trio_cuda.trace.Trace, got {trace!r}")
    return ScopeManager(opener, streams, conflicts, drain_timeout, policy, trace)
