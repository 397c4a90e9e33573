"""The manager that ``open_scope`` returns: it opens one scope once.

Invariants:

* A :class:`ScopeManager` is single-use: entering it again raises
  ``RuntimeError``, and so does exiting it again.
* Options are checked when the manager is made, before any device is opened.
* Entry and exit may happen in different tasks of one Trio run, and in
  different contexts of one task (``python -m trio`` runs each input in a
  fresh context of the REPL's task, so a scope entered with an
  ``AsyncExitStack`` on one input exits on a later one; ``current_scope``
  finds it there). A scope's
  completion-handoff task therefore never runs in a nursery of the entering
  task, which may end while the scope is open: it runs in the nursery of the
  run's scope host (``_ScopeHost``), one system task per Trio run, started by
  the run's first scope. The current-scope ContextVar is reset with its token
  only in the context that set it; an exit elsewhere stops the exiting context
  from naming the scope and touches no other context. An exit from another
  thread or Trio run, or a second exit, is refused before anything changes.
* Exit drains the scope (shielded) whatever the reason, then releases what it
  owns; errors nobody observed come out as one ``BaseExceptionGroup``, with the
  body's own exception first. ``Cancelled`` is never wrapped. The exit returns
  only once the handoff task and its host have ended.
* A scope still open when its Trio run ends (a program that never closed its
  ``AsyncExitStack``, ``python -m trio`` left with a scope open) is drained
  and closed by the scope host as the run ends, innermost first, as an exit
  would (shielded, within ``drain_timeout``), with a warning logged and a
  ``ResourceWarning``; errors nobody observed are logged, since no task is
  left to raise them to. It never ends in ``TrioInternalError``.
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

import contextvars
import logging
import math
import numbers
import warnings
from _thread import get_ident
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, final

import attrs
import trio
from trio.lowlevel import RunVar, current_task, enable_ki_protection

from ._asynclib import require_trio
from ._policy import FollowWriter, SchedulingPolicy
from ._scope import ResourceScope
from ._trace import Tracer, process_tracer

if TYPE_CHECKING:
    from types import TracebackType

    from ._driver import DeviceContext

__all__ = ["ScopeManager", "entered_elsewhere", "scope_manager"]

log = logging.getLogger("trio_cuda")


_CONFLICTS = ("order", "error")


@final
@attrs.define(eq=False)
class _ScopeHost:
    """The system task of one Trio run whose nursery hosts the handoff
    tasks of the run's scopes, so that a scope may outlive the task that
    entered it. It sleeps until the run ends; Trio then cancels it, and it
    closes the scopes still open (``ScopeManager._close_at_run_end``) before
    its nursery waits for their handoff tasks."""

    #: managers whose scope is open (or exiting), in entry order
    open: list[ScopeManager] = attrs.Factory(list)
    nursery: trio.Nursery | None = None
    #: handoffs to start once the host runs, each in its entering context
    pending: list[tuple[ScopeManager, ResourceScope, contextvars.Context]] = attrs.Factory(list)
    #: the run is ending: no scope opens any more
    ending: bool = False

    def start(self, manager: ScopeManager, scope: ResourceScope) -> None:
        self.open.append(manager)
        if self.nursery is not None:  # the handoff sees the entering context, copied now
            self.nursery.start_soon(scope._run_handoff, name=_HANDOFF_NAME)
        else:
            self.pending.append((manager, scope, contextvars.copy_context()))

    @enable_ki_protection
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            for _, scope, context in self.pending:  # each sees the context it entered in
                context.run(partial(nursery.start_soon, scope._run_handoff, name=_HANDOFF_NAME))
            self.pending.clear()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:  # the run is ending (the handoffs never raise)
                self.ending = True
                with trio.CancelScope(shield=True):
                    while True:  # innermost first; exits under way end on their own
                        left = [m for m in self.open if m._scope is not None and not m._scope._closing]
                        if not left:
                            break
                        await left[-1]._close_at_run_end()
                raise


_HANDOFF_NAME = "trio_cuda completion handoff"

#: the scope host of this Trio run, once a scope opened in it
_HOST: RunVar[_ScopeHost | None] = RunVar("trio_cuda_scope_host", default=None)


def _scope_host() -> _ScopeHost:
    """The run's scope host, started by the first scope of the run."""
    host = _HOST.get()
    if host is None:
        host = _ScopeHost()
        try:
            trio.lowlevel.spawn_system_task(host.run, name="trio_cuda scope host")
        except RuntimeError as exc:  # the run's system nursery is closed: the run is ending
            raise RuntimeError("open_scope(): the Trio run is ending, so no scope can open in it") from exc
        _HOST.set(host)
    elif host.ending:
        raise RuntimeError("open_scope(): the Trio run is ending, so no scope can open in it")
    return host


#: the innermost scope entered in this context (None: none, or reset by an exit)
_current: contextvars.ContextVar[ResourceScope | None] = contextvars.ContextVar(
    "trio_cuda_scope", default=None
)


def current_scope() -> ResourceScope:
    """The innermost open scope of the calling task (``await op`` uses it).

    That is the scope the task's context entered last; failing that, a scope
    the task (or a task that started it) entered in a context it has since
    left and did not exit: each input of ``python -m trio`` runs in a fresh
    context of the REPL's task, so a scope entered with an ``AsyncExitStack``
    on one input is current on the later ones."""
    scope = _current.get()
    if scope is None:
        scope = entered_elsewhere()
        if scope is None:
            raise RuntimeError(
                "no trio_cuda scope is open in this task: use 'async with trio_cuda.open_scope() as gpu'"
            )
    return scope


def entered_elsewhere() -> ResourceScope | None:
    """The innermost open scope that the calling task, or a task that
    started it, entered in a context it no longer runs in (``current_scope``
    when the calling context names none): the scope of an ``AsyncExitStack``
    entered on an earlier input of ``python -m trio``. None if there is none."""
    try:
        host = _HOST.get()
        task: trio.lowlevel.Task | None = current_task()
    except RuntimeError:  # outside a Trio run
        return None
    if host is None or not host.open:
        return None
    chain = []
    while task is not None:
        chain.append(task)
        parent = task.parent_nursery
        task = None if parent is None else parent.parent_task
    for m in reversed(host.open):
        scope = m._scope
        if scope is None or scope._closing:
            continue
        if m._task in chain and m._task.context is not m._context:
            return scope
    return None


@final
class ScopeManager:
    """What :func:`~trio_cuda.open_scope` returns: an async context manager
    that opens one :class:`ResourceScope` once. The device is opened on
    entry, by ``opener`` (``trio_cuda._open`` picks the backend)."""

    __slots__ = (
        "_conflicts",
        "_context",
        "_drain_timeout",
        "_entered",
        "_exited",
        "_host",
        "_opener",
        "_outer",
        "_policy",
        "_scope",
        "_streams",
        "_task",
        "_token",
        "_trace",
    )

    _token: contextvars.Token[ResourceScope | None]
    #: the entering task, the context it ran in then, and the scope that
    #: context named before (restored where an exit finds this one named)
    _task: trio.lowlevel.Task
    _context: contextvars.Context
    _outer: ResourceScope | None
    _host: _ScopeHost

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
        #: why the scope may not exit any more (None: it may)
        self._exited: str | None = None

    @enable_ki_protection
    async def __aenter__(self) -> ResourceScope:
        # KI-protected, like the exit: a Ctrl-C between starting the handoff
        # task and returning the scope would leave a scope nobody can exit;
        # it is delivered at the body's first checkpoint.
        require_trio("open_scope()")
        await trio.lowlevel.checkpoint()
        if self._entered:
            raise RuntimeError(
                "open_scope(): this manager was already entered; it opens one scope once "
                "(call open_scope() again for another scope)"
            )
        self._entered = True
        host = _scope_host()
        driver = self._opener()
        try:
            scope = ResourceScope._create(driver, self._streams, self._conflicts, self._policy)
        except BaseException:
            driver.close()
            raise
        self._host = host
        host.start(self, scope)
        self._scope = scope
        task = current_task()
        self._task = task
        self._context = task.context
        self._outer = _current.get()
        self._token = _current.set(scope)
        tracer = process_tracer() if self._trace is None or self._trace is True else self._trace
        if isinstance(tracer, Tracer):
            scope._start_tracing(tracer)
        log.debug("opened %r", scope)
        return scope

    async def _close_at_run_end(self) -> None:
        """Exit the scope for nobody: its Trio run ends with the scope open.
        It drains and closes as an exit would; what an exit would raise is
        logged instead, for no task is left to raise it to."""
        scope = self._scope
        assert scope is not None
        log.warning(
            "%r was still open when its Trio run ended (an AsyncExitStack never closed, or "
            "python -m trio left with the scope open): draining and closing it now",
            scope,
        )
        self._exited = "was closed when its Trio run ended"
        try:
            errors, _ = await self._close(scope)
        except BaseException as exc:  # the host must not raise: report and go on
            log.exception("closing %r at the end of its Trio run failed", scope, exc_info=exc)
            return
        for error in errors:
            log.error("an error from %r that nobody observed", scope, exc_info=error)
        try:
            warnings.warn(
                ResourceWarning(
                    f"trio_cuda scope {scope!r} was still open when its Trio run ended; it was "
                    "drained and closed then (exit it with 'async with', or 'await stack.aclose()' "
                    "for an AsyncExitStack)"
                ),
                stacklevel=1,
            )
        except Exception:  # a warning filter that raises: there is nobody to raise it to
            log.exception("warning that %r was left open", scope)

    async def _close(self, scope: ResourceScope) -> tuple[list[BaseException], KeyboardInterrupt | None]:
        """The exit's work (the scope's own exit sequence), then this
        manager's: the scope no longer counts as open in its host."""
        try:
            return await scope._close(self._drain_timeout)
        finally:
            if self in self._host.open:
                self._host.open.remove(self)

    def _check_exit(self) -> ResourceScope:
        """The scope to exit, once this call may exit it: refused (before
        anything changes) from another thread or Trio run, or a second time."""
        scope = self._scope
        if scope is None:
            raise RuntimeError("open_scope(): exit without an entry: this manager opened no scope")
        if self._exited is not None:
            state = self._exited if scope._closed else "is exiting"
            raise RuntimeError(f"open_scope(): {scope!r} {state}; a scope exits once")
        if get_ident() != scope._thread or trio.lowlevel.current_trio_token() is not scope._token:
            raise RuntimeError(
                f"open_scope(): expected the exit of {scope!r} in the Trio run that entered it, got "
                "one from another thread or Trio run; exit it in its own run (from a worker "
                "thread: trio.from_thread.run(stack.aclose))"
            )
        return scope

    def _forget_current(self, scope: ResourceScope) -> None:
        """Stop the exiting context from naming ``scope``: with the token in
        the context that set it, else (an exit in another task, or on a later
        input of ``python -m trio``) only where this context still names it."""
        task = current_task()
        if task is self._task and task.context is self._context:
            _current.reset(self._token)
        elif _current.get() is scope:
            _current.set(self._outer)

    @enable_ki_protection
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        require_trio("open_scope() exit")
        scope = self._check_exit()
        self._exited = "was already exited"
        self._forget_current(scope)
        errors, interrupt = await self._close(scope)
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
