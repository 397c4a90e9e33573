"""Several devices: cross-scope copies, their leases, and device pools.

One :class:`~trio_cuda.ResourceScope` runs on one device. Several scopes (one
per device, or several on one device) may be open at once in one Trio run;
:func:`open_device_pool` opens one per device and spreads work over them.

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
  hands the free decision back to the owning scope (``release_foreign``): no
  memory is freed while any scope's in-flight work holds a lease on it, also
  when the owner's handles were closed or garbage-collected meanwhile.
* Scope exit waits, shielded and without blocking the loop, first for its own
  work and then for the *foreign leases* on its allocations (other scopes'
  in-flight copies), within ``drain_timeout``. Whatever foreign work still
  holds a lease then is not waited for: the memory it uses is quarantined
  (never freed) and the scope's driver state (context, streams, modules) is
  leaked with a ``ResourceWarning``, as for its own work after a timeout.
  A scope that is exiting refuses new cross-scope copies of its memory
  (``ScopeClosedError``), so the wait ends.
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

import warnings
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import attrs
import trio

from ._array import Allocation, AllocState, DeviceArray
from ._asynclib import require_trio
from ._driver import MarkerState
from ._errors import CompletionUnknownError, KernelArgumentError, ScopeClosedError, TrioCudaError
from ._extent import array_extent
from ._final import NoPublicConstructor, final
from ._ops import Access, DeviceOp, HostResult

if TYPE_CHECKING:
    from types import TracebackType

    from ._future import DeviceFuture
    from ._manager import ScopeManager
    from ._scope import ResourceScope
    from ._statistics import ScopeStatistics
    from ._stream import Stream
    from ._submit import EnqueueContext, Submission

T = TypeVar("T")
U = TypeVar("U")


# --------------------------------------------------------------------------- foreign leases


@final
class ForeignLeases:
    """Leases that other scopes' in-flight work (cross-device copies) holds
    on one scope's memory: that scope's extension object."""

    __slots__ = ("count", "event", "scope")

    def __init__(self, scope: ResourceScope) -> None:
        self.scope = scope
        self.count = 0
        self.event: trio.Event | None = None

    async def drain(self) -> None:
        """Sleep until no other scope's in-flight work holds a lease on this
        scope's memory."""
        await trio.lowlevel.checkpoint()
        while self.count > 0:
            ev = self.event
            if ev is None:
                ev = self.event = trio.Event()
            await ev.wait()

    def abandon(self, after: str) -> None:
        abandon_foreign(self.scope, after)

    def close(self) -> None:
        pass


def _add_foreign(owner: ResourceScope) -> None:
    owner._extension(ForeignLeases).count += 1


def release_foreign(alloc: Allocation) -> None:
    """A lease of another scope's work on ``alloc`` was released (retired) or
    leaked (quarantined): let the owner free the memory if nothing else uses
    it, and wake its exit if it waits for this."""
    owner = alloc.scope
    if not owner._closed:
        owner._maybe_free(alloc)  # only frees LIVE memory without handles and leases
    st = owner._find_extension(ForeignLeases)
    if st is None or st.count <= 0:
        return
    st.count -= 1
    if st.count <= 0 and st.event is not None:
        st.event.set()
        st.event = None


def foreign_lease_count(scope: ResourceScope) -> int:
    """Leases other scopes' in-flight work holds on ``scope``'s memory."""
    st = scope._find_extension(ForeignLeases)
    return 0 if st is None else st.count


def _foreign_users(scope: ResourceScope, alloc: Allocation) -> list[Submission]:
    from ._submit import SubState

    users = [*alloc.readers, *alloc.writers]
    return [u for u in users if u.scope is not scope and u.state is SubState.IN_FLIGHT]


def abandon_foreign(scope: ResourceScope, after: str) -> None:
    """At exit, after the drain: memory that other scopes' in-flight work still
    uses is quarantined, and the scope's driver state is leaked with it."""
    if foreign_lease_count(scope) <= 0:
        return
    held = [a for a in scope._allocs if a.active and _foreign_users(scope, a)]
    users = {u.scope for a in held for u in _foreign_users(scope, a)}
    for a in held:
        if a.state is AllocState.LIVE:
            a.state = AllocState.QUARANTINED
    scope._timed_out += 1  # leak modules, streams and the context (see _release_everything)
    warnings.warn(
        ResourceWarning(
            f"trio_cuda scope {scope!r} exited while {foreign_lease_count(scope)} lease(s) of other scopes' "
            f"in-flight work ({', '.join(sorted(map(repr, users)))}) still held {len(held)} of its "
            f"allocation(s) {after}; that memory and the scope's driver state are "
            f"quarantined (leaked, never freed)"
        ),
        stacklevel=3,
    )


# --------------------------------------------------------------------------- cross-scope copies


def _scope_label(scope: ResourceScope) -> str:
    info = scope._info
    return f"{info.backend}:{info.ordinal} ({info.name})"


def cross_scope_copy(ctx: EnqueueContext, dst: DeviceArray, src: DeviceArray) -> None:
    """``EnqueueContext.copy`` for two device arrays of which at least one is
    owned by another scope (see the module invariants)."""
    from ._leases import overlapping
    from ._submit import SubState, take_leases

    scope = ctx.scope
    d_owner = dst._alloc.scope
    s_owner = src._alloc.scope
    if d_owner is not scope and s_owner is not scope:
        raise KernelArgumentError(
            f"copy: expected dst or src owned by the scope the copy is submitted to "
            f"({_scope_label(scope)}), got dst of {_scope_label(d_owner)} and src of {_scope_label(s_owner)}"
        )
    other = s_owner if d_owner is scope else d_owner
    label = "copy: src" if other is s_owner else "copy: dst"
    arr = src if other is s_owner else dst
    arr._check_usable(label)
    if other._closing:
        raise ScopeClosedError(
            f"{label}: expected an array of an open scope, got one of {_scope_label(other)}, which is exiting"
        )
    if other._token is not scope._token:
        raise ValueError(f"{label}: expected an array of a scope in this Trio run, got one of another run")
    driver = ctx.driver
    if type(other._driver) is not type(driver):
        raise KernelArgumentError(
            f"copy: expected dst and src on devices of one backend that copies between devices, got "
            f"dst on {_scope_label(d_owner)} and src on {_scope_label(s_owner)}"
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
            _add_foreign(a.scope)
    token = driver.copy_peer(
        ctx.stream.handle, dst.ptr, d_owner._driver, src.ptr, s_owner._driver, dst.nbytes
    )
    if token is not None:
        ctx.retain(token)
    for w in writers:
        ctx.on_retire(_ProducerCheck(w, s_owner))
    ctx._enqueued()


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
                f"copy: src: completion of {w.label}, which wrote it on {_scope_label(self.owner)}, is "
                f"unknown; the copied data cannot be trusted"
            )
        if failed:
            raise TrioCudaError(
                f"copy: src: {w.label}, which wrote it on {_scope_label(self.owner)}, failed; the copied "
                f"data cannot be trusted"
            )


# --------------------------------------------------------------------------- device pools


class DevicePolicy(Protocol):
    """Chooses the scope (device) of a pool submission that names no array."""

    def choose(self, scopes: Sequence[ResourceScope], op: DeviceOp[Any] | None) -> ResourceScope:
        """Return the scope ``op`` should run on (one of ``scopes``). ``op`` is
        None when the pool chooses a device for an allocation."""
        ...


@final
@attrs.define(eq=False)
class LeastLoadedDevice:
    """The default device policy: the scope with the fewest submissions in
    flight (the lowest index on ties)."""

    def choose(self, scopes: Sequence[ResourceScope], op: DeviceOp[Any] | None) -> ResourceScope:
        """The scope with the fewest submissions in flight."""
        best = scopes[0]
        load = best._in_flight
        for s in scopes[1:]:
            n = s._in_flight
            if n < load:
                best, load = s, n
        return best


@final
@attrs.define(eq=False)
class RoundRobinDevices:
    """Devices in turn, whatever their load."""

    _next: int = attrs.field(default=0, init=False)

    def choose(self, scopes: Sequence[ResourceScope], op: DeviceOp[Any] | None) -> ResourceScope:
        """The next scope in turn."""
        i = self._next
        self._next = (i + 1) % len(scopes)
        return scopes[i % len(scopes)]


@final
@attrs.frozen
class DevicePoolStatistics:
    """A snapshot of a pool (``pool.statistics()``)."""

    devices: tuple[ScopeStatistics, ...]  #: one per scope, in pool order
    in_flight: int  #: submissions in flight on all devices
    completed: int  #: submissions retired on all devices, successfully or not
    failed: int  #: of ``completed``: those that failed
    quarantined: int  #: quarantined submissions on all devices


def _arrays_of(op: object, out: list[DeviceArray | ResourceScope], depth: int = 0) -> None:
    """What ``op`` names up front that has a home scope: device arrays
    (kernel arguments, copy and fill operands; the first op of a
    ``then``/``map`` chain) and, for a graph replay, the scope that captured
    the graph. Closures are not run: what they return is not known before
    submission."""
    from ._graph import _GraphLaunch
    from ._launch import KernelLaunch
    from ._ops import _Copy, _Fill, _Map, _Shared, _Then, _ZeroBytes, _Zip

    if depth > 64:
        return
    if isinstance(op, KernelLaunch):
        out.extend(a for a, _ in op._accesses)
    elif isinstance(op, _GraphLaunch):
        out.append(op._graph._scope)  # a replay runs where it was captured
    elif isinstance(op, _Copy):
        for x in (op._dst, op._src):  # dst first: a cross-device copy runs where it lands
            if isinstance(x, DeviceArray):
                out.append(x)
    elif isinstance(op, _Fill | _ZeroBytes):
        out.append(op._arr)
    elif isinstance(op, _Zip):
        for o in op._ops:
            _arrays_of(o, out, depth + 1)
    elif isinstance(op, _Then | _Map | _Shared):
        _arrays_of(op._op, out, depth + 1)


@final
class DevicePool(metaclass=NoPublicConstructor):
    """Scopes on several devices, opened and closed together, with a
    :class:`DevicePolicy` that spreads work over them.

    Open one with :func:`open_device_pool`. ``pool.submit(op)`` runs ``op`` on
    the scope that owns the arrays it names (a cross-device copy: the scope of
    ``dst``); an op that names no array goes where the policy says (by
    default the device with the fewest submissions in flight). Each scope
    keeps its own rules (streams, leases, exit); ``pool[i]`` or
    ``pool.scopes`` reach them directly.
    """

    __slots__ = ("_policy", "_scopes")

    _obtain = "use 'async with trio_cuda.open_device_pool()'"

    _scopes: tuple[ResourceScope, ...]
    _policy: DevicePolicy

    @classmethod
    def _create(cls, scopes: tuple[ResourceScope, ...], policy: DevicePolicy) -> DevicePool:
        self = object.__new__(cls)
        self._scopes = scopes
        self._policy = policy
        return self

    @property
    def scopes(self) -> tuple[ResourceScope, ...]:
        """One scope per device, in the order the devices were given."""
        return self._scopes

    @property
    def policy(self) -> DevicePolicy:
        """The policy that places ops naming no array."""
        return self._policy

    def __len__(self) -> int:
        return len(self._scopes)

    def __getitem__(self, index: int) -> ResourceScope:
        return self._scopes[index]

    def __iter__(self) -> Iterator[ResourceScope]:
        return iter(self._scopes)

    def __repr__(self) -> str:
        return f"<DevicePool of {len(self._scopes)} scope(s): {', '.join(map(_scope_label, self._scopes))}>"

    def choose(self, op: DeviceOp[Any] | None = None) -> ResourceScope:
        """The scope ``op`` would run on: the owner of the arrays it names, or
        the policy's choice (``op`` None: for new memory)."""
        if op is not None:
            arrays: list[DeviceArray | ResourceScope] = []
            _arrays_of(op, arrays)
            for a in arrays:
                owner = a._alloc.scope if isinstance(a, DeviceArray) else a
                if owner in self._scopes:
                    return owner
        scope = self._policy.choose(self._scopes, op)
        if scope not in self._scopes:
            raise ValueError(
                f"policy: expected one of the pool's scopes, got {scope!r} from {self._policy!r}"
            )
        return scope

    def _scope_for(self, op: object, stream: Stream | None) -> ResourceScope:
        if stream is not None:
            scope = getattr(stream, "scope", None)
            if scope not in self._scopes:
                raise ValueError(f"stream: expected a stream of one of the pool's scopes, got {stream!r}")
            return scope  # type: ignore[no-any-return]
        if not isinstance(op, DeviceOp):
            raise TypeError(f"op: expected a DeviceOp, got {type(op).__name__}")
        return self.choose(op)

    def submit(self, op: DeviceOp[T], *, stream: Stream | None = None) -> DeviceFuture[T]:
        """Submit ``op`` on the scope :meth:`choose` picks (``stream`` pins it
        to a stream, and so to that stream's scope); returns its future."""
        return self._scope_for(op, stream).submit(op, stream=stream)

    @overload
    async def run(self, op: DeviceOp[HostResult[U]], *, stream: Stream | None = None) -> U: ...
    @overload
    async def run(self, op: DeviceOp[T], *, stream: Stream | None = None) -> T: ...
    async def run(self, op: DeviceOp[Any], *, stream: Stream | None = None) -> Any:
        """Run ``op`` on the scope :meth:`submit` would pick, with that
        scope's ``run`` (which loads its kernels first, compiling off the loop;
        cancelling the wait leaves the work to its scope)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        return await self._scope_for(op, stream).run(op, stream=stream)

    async def to_device(self, host: object, **kwargs: Any) -> DeviceArray:
        """Copy a NumPy array to a new array on the device the policy picks
        (``scope.to_device`` there; keyword arguments pass through)."""
        scope = self.choose(None)
        return await scope.to_device(host, **kwargs)

    def statistics(self) -> DevicePoolStatistics:
        """Per-device scope statistics and their totals."""
        per = tuple(s.statistics() for s in self._scopes)
        return DevicePoolStatistics(
            devices=per,
            in_flight=sum(p.in_flight for p in per),
            completed=sum(p.completed for p in per),
            failed=sum(p.failed for p in per),
            quarantined=sum(p.quarantined for p in per),
        )


@final
class PoolManager:
    """What :func:`~trio_cuda.open_device_pool` returns: an async context
    manager that opens one :class:`DevicePool` once, entering its scopes'
    managers in order and exiting them in reverse."""

    __slots__ = ("_entered", "_managers", "_policy", "_stack")

    def __init__(self, managers: Sequence[ScopeManager], policy: DevicePolicy) -> None:
        self._managers = tuple(managers)
        self._policy = policy
        self._stack: AsyncExitStack | None = None
        self._entered = False

    async def __aenter__(self) -> DevicePool:
        require_trio("open_device_pool()")
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._entered:
            raise RuntimeError(
                "open_device_pool(): this manager was already entered; it opens one pool once "
                "(call open_device_pool() again for another pool)"
            )
        self._entered = True
        scopes: list[ResourceScope] = []
        async with AsyncExitStack() as stack:
            for cm in self._managers:
                scopes.append(await stack.enter_async_context(cm))
            self._stack = stack.pop_all()
        return DevicePool._create(tuple(scopes), self._policy)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        stack = self._stack
        assert stack is not None
        self._stack = None
        return bool(await stack.__aexit__(exc_type, exc, tb))
