"""Prepared launches: what a backend enqueues, and the DeviceOp that carries it.

Invariants:

* A :class:`KernelLaunch` is immutable (no public constructor, no attribute
  assignment) and reusable. Its parameters are packed exactly once, into the
  arena of its :class:`PreparedLaunch`, and reused by every submission of the
  same launch.
* A launch's accesses hold one entry per view extent (an allocation and a
  byte range), with the strongest mode (:func:`_merge_accesses`); its output
  is the array it writes, a tuple of them, or None.
* A :class:`PreparedLaunch` is a launch's one description: its kernel,
  configuration, parameter plan and packed arguments. It is immutable by
  convention; only ``ready`` (the scope's kernel table sets it: the loaded
  function, once the launch was checked against that scope's device) and
  ``cache``, the backends' scratch space, are filled, on first launch. Its
  argument views are given, made once by the function given (a builder's),
  or derived once from the argument values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import attrs
import numpy as np

from ._array import DeviceArray
from ._final import NoPublicConstructor, final
from ._ops import Access, DeviceOp
from ._params import Param, Scalar, Slice

if TYPE_CHECKING:
    from ._arena import ParamPlan
    from ._array import Allocation
    from ._config import LaunchConfig
    from ._enqueue import EnqueueTarget
    from ._kernel import Kernel


#: what a kernel launch outputs: the array it writes (an ``Out``, ``InOut`` or
#: writable ``Slice`` argument), a tuple of them if it writes several, or None
LaunchOutput: TypeAlias = DeviceArray | tuple[DeviceArray, ...] | None


@attrs.frozen
class ArgView:
    """What a backend needs to know about one kernel parameter.

    ``kind`` is ``"array"`` (``ptr``, ``shape``, ``dtype``), ``"slice"`` (the
    same plus ``length``), ``"scalar"`` (``value``) or ``"raw"`` (``value`` is
    ``bytes``)."""

    kind: Literal["array", "slice", "scalar", "raw"]
    ptr: int = 0
    shape: tuple[int, ...] = ()
    dtype: np.dtype[Any] | None = None
    value: Any = None
    length: int = 0
    access: Access | None = None
    #: dtype of a ``"slice"``'s length parameter
    len_dtype: np.dtype[Any] | None = None
    #: memory order of an ``"array"`` or ``"slice"``: ``"C"`` or ``"F"``
    order: Literal["C", "F"] = "C"

    @property
    def nbytes(self) -> int:
        if self.dtype is None:
            return 0
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@final
class PreparedLaunch:
    """Everything a backend needs to enqueue one launch. ``arena`` holds the
    packed parameters at the offsets of ``plan``; :meth:`arg_views` describes
    them (``args``; or made lazily: by ``args`` when it is a function, else
    from ``values``, one per kernel parameter). Immutable by convention;
    ``cache`` is the backends' scratch space (e.g. the ``void**`` array),
    None until something is kept there (:meth:`scratch` makes it), and
    ``enqueued`` says a backend enqueued it once from its arena without
    memory of its own (the cuda backend's first enqueue)."""

    __slots__ = ("arena", "args", "cache", "config", "enqueued", "kernel", "plan", "ready", "values")

    kernel: Kernel
    config: LaunchConfig
    plan: ParamPlan
    arena: bytes
    args: tuple[ArgView, ...] | Callable[[], tuple[ArgView, ...]] | None
    values: tuple[object, ...]
    cache: dict[str, Any] | None
    enqueued: bool
    #: (the kernel table's function dict, standing for the table; the loaded
    #: function) of the last scope that checked this launch against its
    #: device (``KernelTable.function_for``), or None
    ready: tuple[object, object] | None

    def __init__(
        self,
        kernel: Kernel,
        config: LaunchConfig,
        plan: ParamPlan,
        arena: bytes,
        args: tuple[ArgView, ...] | Callable[[], tuple[ArgView, ...]] | None = None,
        values: tuple[object, ...] = (),
    ) -> None:
        # (the typed launch's generated fast path sets these same fields
        # directly, see ``_kernel._compile_fast``)
        self.kernel = kernel
        self.config = config
        self.plan = plan
        self.arena = arena
        self.args = args
        self.values = values
        self.cache = None
        self.enqueued = False
        self.ready = None

    def scratch(self) -> dict[str, Any]:
        """``cache``, made on first use (most launches never need one)."""
        cache = self.cache
        if cache is None:
            cache = self.cache = {}
        return cache

    def arg_views(self) -> tuple[ArgView, ...]:
        """One :class:`ArgView` per kernel parameter (cached)."""
        args = self.args
        if type(args) is tuple:
            return args
        cache = self.scratch()
        views = cache.get("views")
        if views is None:
            tile = self.kernel.tile
            if args is not None:  # a builder's launch: its views, made on first use
                views = cache["views"] = args()  # type: ignore[operator]
            elif tile is not None:  # a tile launch: its specialisation lays the views out
                views = cache["views"] = tile.views(self)
            else:
                views = cache["views"] = _views_of(self.kernel.params, self.values)
        return views

    def __repr__(self) -> str:
        return f"<PreparedLaunch {self.kernel.name} {len(self.arena)} B of parameters>"


def _views_of(params: Sequence[Param], values: Sequence[object]) -> tuple[ArgView, ...]:
    out: list[ArgView] = []
    for param, value in zip(params, values, strict=True):
        if isinstance(param, Scalar):
            scalar = value if isinstance(value, np.generic) else param.dtype.type(value)
            out.append(ArgView("scalar", dtype=param.dtype, value=scalar))
            continue
        assert isinstance(value, DeviceArray)
        if isinstance(param, Slice):
            out.append(
                ArgView(
                    "slice",
                    value.ptr,
                    value.shape,
                    value.dtype,
                    length=value.size,
                    access=param.access,
                    len_dtype=param.len_dtype,
                    order=value.order,
                )
            )
        else:
            out.append(
                ArgView("array", value.ptr, value.shape, value.dtype, access=param.access, order=value.order)
            )
    return tuple(out)


def _merge_accesses(
    accesses: Sequence[tuple[DeviceArray, Access]],
) -> tuple[tuple[DeviceArray, Access], ...]:
    """One entry per allocation and byte extent, with the strongest access
    (views of one allocation with different extents keep their own entries:
    their leases cover different bytes)."""
    merged: dict[tuple[int, int, int], tuple[DeviceArray, Access]] = {}
    for arr, access in accesses:
        key = (id(arr._alloc), arr._offset, arr.nbytes)
        prev = merged.get(key)
        if prev is None or (access is Access.WRITE and prev[1] is Access.READ):
            merged[key] = (arr, access)
    return tuple(merged.values())


def _output_of(outputs: Sequence[DeviceArray]) -> LaunchOutput:
    if not outputs:
        return None
    if len(outputs) == 1:
        return outputs[0]
    return tuple(outputs)


@final
class ArrayModes(tuple["Access | None", ...]):
    """A typed launch path's access per argument (None for a scalar): what
    a launch it makes keeps instead of its accesses, one shared object for
    all of them. ``KernelLaunch._accesses`` makes the (array, access) pairs
    from it and the launch's values when they are first asked for."""

    __slots__ = ()


def _accesses_from(modes: ArrayModes, values: tuple[object, ...]) -> tuple[tuple[DeviceArray, Access], ...]:
    pairs: list[tuple[DeviceArray, Access]] = []
    for value, mode in zip(values, modes, strict=True):
        if mode is not None:
            assert isinstance(value, DeviceArray)
            pairs.append((value, mode))
    return tuple(pairs)


@final
class KernelLaunch(DeviceOp[LaunchOutput], metaclass=NoPublicConstructor):
    """One immutable, reusable kernel launch (a DeviceOp). Its output is the
    array it writes, a tuple of them if several, or None: to a type checker,
    ``DeviceArray | tuple[DeviceArray, ...] | None``, whatever the kernel.
    The arrays written are the ones passed in, so a program usually keeps
    its own names for them; ``.map(lambda _: y)`` gives an op typed by ``y``."""

    __slots__ = ("_acc", "_lease_plan", "_lease_simple", "_output", "prepared")

    _obtain = "use Kernel.launch() or a builder"

    #: what the backends enqueue: the kernel, the configuration and the
    #: parameters, packed once into an argument arena that every submission
    #: of this launch reuses (an internal type: :attr:`kernel` and
    #: :attr:`config` are its public parts)
    prepared: PreparedLaunch
    #: its accesses (see :attr:`_accesses`), or a typed path's modes they
    #: are made from (an :class:`ArrayModes`: no objects per launch)
    _acc: tuple[tuple[DeviceArray, Access], ...] | ArrayModes
    #: its lease plan, shared by every submission of this launch (made with
    #: it by the compiled typed path, else by its first safe submission from
    #: its arrays' extents: ``launch_lease_plan``): the allocations it leases,
    #: each once, or None until made; and whether every access is a whole
    #: allocation of its own (two slots: no object per launch for the pair)
    _lease_plan: tuple[Allocation, ...] | None
    _lease_simple: bool
    _output: LaunchOutput

    @classmethod
    def _create(
        cls,
        prepared: PreparedLaunch,
        accesses: tuple[tuple[DeviceArray, Access], ...],
        outputs: Sequence[DeviceArray],
    ) -> KernelLaunch:
        return _make_launch(prepared, accesses, _output_of(outputs))

    @property
    def _accesses(self) -> tuple[tuple[DeviceArray, Access], ...]:
        """(array, access) per array argument, merged where arrays share an
        allocation (one entry per extent, the strongest access)."""
        acc = self._acc
        if not isinstance(acc, ArrayModes):
            return acc
        made = _accesses_from(acc, self.prepared.values)
        object.__setattr__(self, "_acc", made)  # (kept: Python asks again)
        return made

    @property
    def kernel(self) -> Kernel:
        """The kernel this launch runs."""
        return self.prepared.kernel

    @property
    def config(self) -> LaunchConfig:
        """The launch geometry and modes."""
        return self.prepared.config

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("KernelLaunch is immutable")

    def __repr__(self) -> str:
        c = self.prepared.config
        return f"<KernelLaunch {self.prepared.kernel.name} grid={c.grid} block={c.block}>"

    def _enqueue(self, ctx: EnqueueTarget) -> LaunchOutput:
        ctx.launch(self.prepared, self._accesses)
        return self._output


class _LaunchUnderConstruction(DeviceOp[LaunchOutput]):
    """A :class:`KernelLaunch` being made: the same slots (hence the same
    object layout), without the immutability. :func:`_make_launch` fills one
    with plain attribute stores, then makes it a ``KernelLaunch`` by setting
    its class (cheaper than four ``object.__setattr__`` calls); nothing else
    ever sees one."""

    __slots__ = KernelLaunch.__slots__


def _make_launch(
    prepared: PreparedLaunch, accesses: tuple[tuple[DeviceArray, Access], ...], output: LaunchOutput
) -> KernelLaunch:
    self = object.__new__(_LaunchUnderConstruction)
    self.prepared = prepared  # type: ignore[attr-defined]
    self._acc = accesses  # type: ignore[attr-defined]
    self._lease_plan = None  # type: ignore[attr-defined]
    self._lease_simple = False  # type: ignore[attr-defined]
    self._output = output  # type: ignore[attr-defined]
    self.__class__ = KernelLaunch  # type: ignore[assignment]
    return self  # type: ignore[return-value]
