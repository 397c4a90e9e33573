"""The inert launch builder, ``Kernel.builder()``.

Invariants:

* A :class:`LaunchBuilder` is not a DeviceOp: it cannot be scheduled until
  ``finalize_unchecked()`` turns it into an immutable :class:`KernelLaunch`.
* It checks nothing against the kernel's parameter list. Each argument is
  checked on its own when it is added (a closed array, a write to a read-only
  array, a scalar dtype, raw bytes and their alignment), and the geometry at
  ``finalize_unchecked()``, as ``Kernel.launch`` checks it (types, and the
  limits that need no device: "unchecked" is about the arguments, and a
  geometry no GPU runs is cheap to refuse); the device's own limits are
  checked at submission.
* Each argument is packed when it is added, at its C offset, into the
  builder's own ``bytearray`` (the bytes :func:`_arena._pack` lays out for
  the same ``(size, alignment)`` slots, padding zero); an argument that is
  refused changes nothing. ``finalize_unchecked()`` copies those bytes into
  the launch, so a builder can go on (or be finalized again) without
  touching the launches it made.
* A builder whose layout matches its kernel's uses the kernel's own
  :class:`ParamPlan`; other layouts share one plan each (bounded cache).
* The launch's argument views are made from a snapshot of the arguments the
  first time a backend asks for them (``PreparedLaunch.arg_views``), and are
  the views an eager build would have made.
* :class:`_PyBuilder` is the builder in pure Python: the reference. Where
  the compiled paths are used (``_compiled``), ``LaunchBuilder``'s base is
  the compiled ``_BuilderCore`` instead: the same fields under the same names, its hot
  methods compiled, and every case they do not cover (errors included)
  handed to the reference's method before anything changes, so both make
  the same launches and raise the same errors. The choice is made once, at
  import.
"""

from __future__ import annotations

import inspect
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from . import _compiled
from ._arena import _STRUCT_CODES, ParamPlan, _scalar_bytes
from ._array import AllocState, DeviceArray
from ._config import _CONFIG_CACHE, LaunchConfig, cached_config
from ._errors import KernelArgumentError
from ._final import NoPublicConstructor, final
from ._launch import ArgView, KernelLaunch, PreparedLaunch, _make_launch, _merge_accesses
from ._ops import Access
from ._params import AccessName, _access_from_name, _align_up, _param_dtype_problem, dtype_alignment

if TYPE_CHECKING:
    from ._kernel import Kernel

Layout = tuple[tuple[int, int], ...]

_PLAN_CACHE: dict[Layout, ParamPlan] = {}
#: id of a kernel's own plan -> (that plan, its layout); the plan is held, so
#: its id is not reused while it is a key
_OWN_LAYOUTS: dict[int, tuple[ParamPlan, Layout]] = {}


def _plan_for(kernel: Kernel, key: Layout) -> ParamPlan:
    """The arena plan of a builder's ``(size, alignment)`` layout: the kernel's
    own plan when they agree (backends cache per plan), else one shared by
    every builder of that layout."""
    own = kernel._plan
    entry = _OWN_LAYOUTS.get(id(own))
    if entry is None or entry[0] is not own:
        entry = (own, tuple((s.size, s.align) for s in own.slots))
        if len(_OWN_LAYOUTS) >= 1024:
            _OWN_LAYOUTS.clear()
        _OWN_LAYOUTS[id(own)] = entry
    if key == entry[1]:
        return own
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        plan = ParamPlan.from_layout(key)
        if len(_PLAN_CACHE) >= 1024:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = plan
    return plan


# --------------------------------------------------------------------------- packing

#: the slot of a pointer
_POINTER_SLOT = (8, 8)
_WRITE = Access.WRITE
_FREED = AllocState.FREED
#: ``_PTR_AFTER[pad].pack(ptr)``: ``pad`` zero bytes, then the pointer
_PTR_AFTER = tuple(struct.Struct(f"={pad}xQ") for pad in range(8))
_ZEROS = tuple(bytes(n) for n in range(16))


def _zeros(n: int) -> bytes:
    return _ZEROS[n] if n < 16 else bytes(n)


#: per scalar type whose dtype the type fixes (every type but ``np.void``):
#: its slot, and the packer of its bytes and the slot's trailing padding
#: (``struct`` for ints and bools, byte for byte ``_scalar_bytes``;
#: ``tobytes`` for the others, whose bit patterns (NaN payloads) a round
#: trip through a Python float could change)
_SCALAR_KINDS: dict[type, tuple[tuple[int, int], Callable[[Any], bytes]]] = {}


def _scalar_kind(value: np.generic) -> tuple[tuple[int, int], Callable[[Any], bytes]] | None:
    """The slot and packer of a scalar that passed the dtype check (cached
    per type when the type fixes the dtype), or None for a structured scalar
    (packed on the general path)."""
    dtype = value.dtype
    if dtype.fields is not None or type(value) is np.void:
        return None
    align = dtype_alignment(dtype)
    size = _align_up(dtype.itemsize, align)
    pad = size - dtype.itemsize
    code = _STRUCT_CODES.get(f"{dtype.kind}{dtype.itemsize}") if dtype.kind in "biu" else None
    packer: Callable[[Any], bytes]
    if code is not None and not dtype.metadata and dtype.isnative:
        packer = struct.Struct(f"={code}{pad}x").pack
    elif pad:
        tail = bytes(pad)

        def packer(v: Any) -> bytes:
            return _tobytes(v) + tail
    else:
        packer = _tobytes
    kind = (size, align), packer
    if len(_SCALAR_KINDS) >= 256:
        _SCALAR_KINDS.clear()
    _SCALAR_KINDS[type(value)] = kind
    return kind


def _tobytes(v: Any) -> bytes:
    raw: bytes = v.tobytes()
    return raw


# --------------------------------------------------------------------------- views


def _views(values: tuple[object, ...], accesses: Sequence[tuple[DeviceArray, Access]]) -> tuple[ArgView, ...]:
    """The argument views of a finalized builder: ``values`` are its
    arguments (arrays, NumPy scalars, boxed bytes), ``accesses`` the
    ``(array, access)`` of each array argument, in order."""
    modes = iter(accesses)
    out: list[ArgView] = []
    for value in values:
        if isinstance(value, DeviceArray):
            mode = next(modes)[1]
            out.append(ArgView("array", value.ptr, value.shape, value.dtype, access=mode, order=value.order))
        elif isinstance(value, np.generic):
            out.append(ArgView("scalar", dtype=value.dtype, value=value))
        else:
            out.append(ArgView("raw", value=value))
    return tuple(out)


def _lazy_views(
    values: tuple[object, ...], accesses: tuple[tuple[DeviceArray, Access], ...]
) -> Callable[[], tuple[ArgView, ...]]:
    return lambda: _views(values, accesses)


# --------------------------------------------------------------------------- builder


class _PyBuilder:
    """The builder's fields and methods in pure Python: the reference (and
    the base of :class:`LaunchBuilder` where the compiled one is not used)."""

    __slots__ = (
        "_accesses",
        "_arena",
        "_block",
        "_cluster",
        "_cooperative",
        "_grid",
        "_kernel",
        "_layout",
        "_outputs",
        "_pdl",
        "_shared",
        "_values",
    )

    _kernel: Kernel
    _grid: object
    _block: object
    _shared: int
    _cluster: object
    _cooperative: object
    _pdl: object
    #: the arguments, in order: arrays, NumPy scalars and boxed bytes
    _values: list[object]
    #: ``(array, access)`` of each array argument, in order
    _accesses: list[tuple[DeviceArray, Access]]
    #: the array arguments with write access, in order
    _outputs: list[DeviceArray]
    #: ``(size, alignment)`` of each argument's slot
    _layout: list[tuple[int, int]]
    #: the arguments packed so far, each at its C offset
    _arena: bytearray

    @classmethod
    def _create(cls, kernel: Kernel) -> Self:
        self = object.__new__(cls)
        self._kernel = kernel
        self._grid = 1
        self._block = 1
        self._shared = 0
        self._cluster = None
        self._cooperative = False
        self._pdl = False
        self._values = []
        self._accesses = []
        self._outputs = []
        self._layout = []
        self._arena = bytearray()
        return self

    def grid(self, *dims: int) -> Self:
        """Set the grid dimensions (1 to 3 ints)."""
        self._grid = dims
        return self

    def block(self, *dims: int) -> Self:
        """Set the block dimensions (1 to 3 ints)."""
        self._block = dims
        return self

    def shared_mem(self, nbytes: int) -> Self:
        """Set the dynamic shared memory in bytes."""
        self._shared = nbytes
        return self

    def cluster(self, *dims: int) -> Self:
        """Set the thread-block cluster dimensions."""
        self._cluster = dims
        return self

    def cooperative(self, enabled: bool = True) -> Self:
        """Make it a cooperative launch (checked at finalize: a bool)."""
        self._cooperative = enabled
        return self

    def pdl(self, enabled: bool = True) -> Self:
        """Allow programmatic dependent launch (checked at finalize: a bool)."""
        self._pdl = enabled
        return self

    def arg(self, value: object, *, access: AccessName | None = None) -> Self:
        """Append a DeviceArray (passed as its pointer) or a NumPy scalar."""
        values = self._values
        index = len(values)
        if isinstance(value, DeviceArray):
            alloc = value._alloc  # (``closed``, ``readonly`` and ``ptr``, read inline)
            if value._closed or alloc.state is _FREED or alloc.table.closed:
                raise KernelArgumentError(f"argument {index}: the array is closed")
            if access is not None:
                mode = _access_from_name(access)
            else:
                params = self._kernel.params
                declared = params[index].access if index < len(params) else None
                mode = declared if declared is not None else _WRITE
            if mode is _WRITE:
                if value._readonly:
                    raise KernelArgumentError(f"argument {index}: write access to a read-only array")
                self._outputs.append(value)
            arena = self._arena
            arena += _PTR_AFTER[-len(arena) & 7].pack(alloc.ptr + value._offset)
            self._layout.append(_POINTER_SLOT)
            self._accesses.append((value, mode))
        elif isinstance(value, np.generic):
            kind = _SCALAR_KINDS.get(type(value))
            if kind is None:
                problem = _param_dtype_problem(value.dtype)
                if problem is not None:
                    raise KernelArgumentError(
                        f"argument {index}: expected a numeric, bool, complex or C-layout struct scalar, "
                        f"got {value.dtype}: {problem}"
                    )
                kind = _scalar_kind(value)
            if kind is not None:
                slot = kind[0]
                raw = kind[1](value)
            else:  # a structured scalar: its padding is zeroed
                dtype = value.dtype
                align = dtype_alignment(dtype)
                size = _align_up(dtype.itemsize, align)
                slot = (size, align)
                raw = _scalar_bytes(dtype, value)
                raw += _zeros(size - len(raw))
            arena = self._arena
            lead = -len(arena) & (slot[1] - 1)
            if lead:
                arena += _zeros(lead)
            arena += raw
            self._layout.append(slot)
        else:
            raise KernelArgumentError(
                f"argument {index}: expected a DeviceArray or a NumPy scalar "
                f"(use arg_boxed for raw bytes), got {type(value).__name__}"
            )
        values.append(value)
        return self

    def arg_boxed(self, raw: bytes | bytearray | memoryview, *, align: int) -> Self:
        """Append an opaque parameter of ``len(raw)`` bytes at alignment ``align``."""
        values = self._values
        index = len(values)
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise KernelArgumentError(
                f"argument {index}: expected bytes, bytearray or memoryview, got {type(raw).__name__}"
            )
        data = raw.tobytes() if isinstance(raw, memoryview) else bytes(raw)
        if not data:
            raise KernelArgumentError(f"argument {index}: raw bytes must not be empty")
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise KernelArgumentError(f"argument {index}: align must be a power of two, got {align}")
        arena = self._arena
        lead = -len(arena) & (align - 1)
        if lead:
            arena += _zeros(lead)
        arena += data
        self._layout.append((len(data), align))
        values.append(data)
        return self

    def _config(self) -> LaunchConfig:
        """``cached_config`` of the geometry and modes (the same object). In
        the common case (grid and block each one exact int, as set by
        ``.grid(n)`` and ``.block(n)``; no cluster, no modes) the cache entry
        that ``cached_config`` would return is looked up directly, without
        its per-dimension type checks (done here on the one element)."""
        grid = self._grid
        block = self._block
        shared = self._shared
        if (
            type(grid) is tuple
            and type(block) is tuple
            and len(grid) == 1
            and len(block) == 1
            and type(grid[0]) is int
            and type(block[0]) is int
            and type(shared) is int
            and self._cluster is None
            and self._cooperative is False
            and self._pdl is False
        ):
            # exact ints: the key ``cached_config`` files these arguments under
            config = _CONFIG_CACHE.get((grid, block, shared, None, False, False))
            if config is not None:
                return config
        return cached_config(grid, block, shared, self._cluster, self._cooperative, self._pdl)

    def finalize_unchecked(self) -> KernelLaunch:
        """Freeze into an immutable KernelLaunch. The arguments are not checked
        against the kernel's parameters; the geometry is, as ``Kernel.launch``
        checks it (a block of at most 1024 threads, grid and block dimensions,
        dynamic shared memory and cluster size within what some GPU allows, a
        cluster dividing the grid), raising :class:`KernelArgumentError`."""
        config = self._config()
        kernel = self._kernel
        plan = _plan_for(kernel, tuple(self._layout))
        accesses = tuple(self._accesses)
        outputs = self._outputs
        if len(accesses) > 1 and len({id(arr._alloc) for arr, _ in accesses}) < len(accesses):
            merged = _merge_accesses(accesses)  # views of one allocation: one entry per extent
        else:
            merged = accesses
        prepared = PreparedLaunch(
            kernel, config, plan, bytes(self._arena), _lazy_views(tuple(self._values), accesses)
        )
        output = None if not outputs else outputs[0] if len(outputs) == 1 else tuple(outputs)
        return _make_launch(prepared, merged, output)


#: the methods the compiled base writes out (the others are the reference's)
_COMPILED_METHODS = (
    "_create",
    "grid",
    "block",
    "shared_mem",
    "cluster",
    "cooperative",
    "pdl",
    "arg",
    "finalize_unchecked",
)


def _compiled_base() -> type[_PyBuilder] | None:
    """The compiled builder base, or None where the pure-Python paths run
    (``_compiled``)."""
    if _compiled.ext is None:
        return None
    docs = {}
    for name in _COMPILED_METHODS:
        method = inspect.getattr_static(_PyBuilder, name)
        function = method.__func__ if isinstance(method, classmethod) else method
        sig = inspect.signature(function)
        plain = sig.replace(
            parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
            return_annotation=sig.empty,
        )
        text = str(plain).replace("(self", "($self", 1).replace("(cls", "($cls", 1)
        docs[name] = f"{name}{text}\n--\n\n{inspect.getdoc(function) or ''}"
    env = {
        "POINTER_SLOT": _POINTER_SLOT,
        "SCALAR_KINDS": _SCALAR_KINDS,
        "CONFIG_CACHE": _CONFIG_CACHE,
        "OWN_LAYOUTS": _OWN_LAYOUTS,
        "cached_config": cached_config,
        "plan_for": _plan_for,
        "views": _views,
    }
    base: type[_PyBuilder] = _compiled.ext.make_base(_PyBuilder, env, docs)
    # what is not compiled is the reference's own
    for name, member in vars(_PyBuilder).items():
        if callable(member) and name not in _COMPILED_METHODS and not name.startswith("__"):
            setattr(base, name, member)
    return base


_COMPILED = _compiled_base()
if TYPE_CHECKING:
    _BuilderBase = _PyBuilder
else:
    _BuilderBase = _PyBuilder if _COMPILED is None else _COMPILED


@final
class LaunchBuilder(_BuilderBase, metaclass=NoPublicConstructor):
    """Inert launch builder: collects geometry, modes and raw arguments, checks
    nothing against the kernel's parameter list, and cannot be scheduled.
    ``finalize_unchecked()`` returns an immutable :class:`KernelLaunch`.

    ``arg(array, access=...)`` takes the access mode from the kernel's matching
    parameter when it declares one, else ``"readwrite"``.
    """

    __slots__ = ()

    _obtain = "use Kernel.builder()"

    def __repr__(self) -> str:
        return f"<LaunchBuilder {self._kernel.name} ({len(self._values)} args, not finalized)>"


def compiled() -> bool:
    """Whether :class:`LaunchBuilder` uses the compiled base in this process."""
    return _COMPILED is not None
