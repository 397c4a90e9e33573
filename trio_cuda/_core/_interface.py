"""The core's internal interface: what other trio_cuda modules may use of
the core's public classes.

Invariants:

* The public classes (:class:`~trio_cuda.ResourceScope`,
  :class:`~trio_cuda.DeviceArray`, :class:`~trio_cuda.Stream`,
  :class:`~trio_cuda.KernelLaunch`) keep their state in underscore members.
  Only the members declared by the protocols below may be used from another
  module; everything else is private to the module that defines the class.
  The protocols are checked against the classes by the type checker (the
  ``_conforms`` functions), and ``tests/core/test_layers.py`` counts every
  other use of a private member across modules and holds it under a budget.
* Public modules (``ops``, ``unsafe``, ``interop``, ``trace``, ``ray``,
  ``testing``) use none of them: they go through functions of the core's
  modules (``_scope.enqueue_unsafe``, ``_array.check_usable``, ...).
* Internal classes (the scope's components ``Completion``, ``MemoryTable``
  and ``Extensions``, ``Submission``, ``Allocation``, the enqueue targets)
  need no such declaration: their interface is their members without a
  leading underscore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np
    import trio

    from ._array import Allocation, DeviceArray
    from ._completion import Completion
    from ._driver import DeviceContext, DeviceInfo
    from ._enqueue import EnqueueTarget
    from ._extension import Extensions
    from ._launch import KernelLaunch, PreparedLaunch
    from ._memory import MemoryTable
    from ._ops import Access, DeviceOp
    from ._scope import ResourceScope
    from ._stream import Stream
    from ._submit import Submission
    from ._trace import Tracer

__all__ = [
    "ArrayInternals",
    "LaunchInternals",
    "OpInternals",
    "RuntimeCreated",
    "ScopeInternals",
    "StreamInternals",
    "declared_names",
]


class ScopeInternals(Protocol):
    """What the core's other modules and the features use of a scope."""

    #: the device context the scope runs on, and what it is
    _driver: DeviceContext
    _info: DeviceInfo
    #: the components: how work completes, the memory, the features' state
    _completion: Completion
    _memory: MemoryTable
    _extensions: Extensions
    #: the lifetime trace the scope records into, and its id there
    _tracer: Tracer | None
    _trace_id: int
    #: the loop thread and Trio run the scope belongs to
    _thread: int
    _token: trio.lowlevel.TrioToken
    #: True once the scope exited
    _closed: bool

    def _check_open(self, what: str) -> None:
        """Raise unless called on the scope's loop thread with the scope open."""
        ...

    def _pick(self, op: DeviceOp[Any], stream: Stream | None) -> Stream:
        """The stream ``op`` runs on (``stream``, checked, or the policy's)."""
        ...

    def _kernel_function(self, prepared: PreparedLaunch) -> object:
        """The loaded function ``prepared`` launches, checked against the device."""
        ...


class ArrayInternals(Protocol):
    """What the core's other modules and the features use of an array."""

    #: the allocation it is a view of, and the view's layout in it
    _alloc: Allocation
    _offset: int
    _shape: tuple[int, ...]
    _dtype: np.dtype[Any]
    _order: Literal["C", "F"]
    #: the bytes it can touch in its allocation, and whether that is all of it
    _extent: tuple[int, ...]
    _whole: bool
    #: a read-only handle (``as_readonly``), and a closed one
    _readonly: bool
    _closed: bool

    def _check_usable(self, label: str) -> None:
        """Raise unless the handle is open, its memory live and its scope open."""
        ...


class StreamInternals(Protocol):
    """What the completion and the policies use of a stream."""

    _scope: ResourceScope
    #: submissions behind a marker, oldest first, and those not yet marked
    _pending: Any
    _unmarked: list[Submission]
    _in_flight: int


class OpInternals(Protocol):
    """What the enqueue targets and the scope use of every op."""

    def _enqueue(self, ctx: EnqueueTarget) -> Any:
        """Enqueue the op's work through ``ctx`` and return its output."""
        ...


class RuntimeCreated(Protocol):
    """Objects the runtime creates (futures, streams, scopes, graphs...)
    have no public constructor (``_final.NoPublicConstructor``): the runtime
    makes them with ``cls._create(...)``."""

    @classmethod
    def _create(cls, *args: Any, **kwargs: Any) -> Any: ...


class LaunchInternals(Protocol):
    """What the scope, the leases and the traces use of a kernel launch."""

    @property
    def _accesses(self) -> tuple[tuple[DeviceArray, Access], ...]: ...

    _output: Any


_PROTOCOLS = (ScopeInternals, ArrayInternals, StreamInternals, OpInternals, RuntimeCreated, LaunchInternals)


def declared_names() -> frozenset[str]:
    """Every member the protocols above declare."""
    names: set[str] = set()
    for proto in _PROTOCOLS:
        members = vars(proto)
        names.update(
            n
            for n, v in members.items()
            if n.startswith("_")
            and not n.startswith("__")
            and (callable(v) or isinstance(v, (classmethod, property)))
        )
        names.update(n for n in members.get("__annotations__", {}) if n.startswith("_"))
    return frozenset(names)


if TYPE_CHECKING:  # the classes provide what the protocols declare

    def _conforms(
        scope: ResourceScope, arr: DeviceArray, stream: Stream, launch: KernelLaunch
    ) -> tuple[ScopeInternals, ArrayInternals, StreamInternals, LaunchInternals]:
        return scope, arr, stream, launch

    _unused: Callable[..., object] = _conforms
