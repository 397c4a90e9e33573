"""Device pools: one scope per device, and work spread over them.

One :class:`~trio_cuda.ResourceScope` runs on one device. Several scopes (one
per device, or several on one device) may be open at once in one Trio run;
:func:`open_device_pool` opens one per device and spreads work over them.
Copies between their memory are the runtime's (``_crosscopy``).

Invariants:

* A pool opens its scopes in device order and exits them in reverse, each
  with the exit a lone scope has (drained, shielded); errors of all of them
  come out together.
* A submission that names arrays runs on the scope that owns them; one that
  names none goes where the :class:`DevicePolicy` says, and what the policy
  returns is checked (one of the pool's scopes) before anything is enqueued.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import attrs
import trio

from ._array import DeviceArray
from ._asynclib import require_trio
from ._crosscopy import scope_label
from ._final import NoPublicConstructor, final
from ._ops import DeviceOp, HostResult

if TYPE_CHECKING:
    from types import TracebackType

    from ._future import DeviceFuture
    from ._manager import ScopeManager
    from ._scope import ResourceScope
    from ._statistics import ScopeStatistics
    from ._stream import Stream

T = TypeVar("T")
U = TypeVar("U")


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
        load = best._completion.in_flight
        for s in scopes[1:]:
            n = s._completion.in_flight
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
        return f"<DevicePool of {len(self._scopes)} scope(s): {', '.join(map(scope_label, self._scopes))}>"

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
