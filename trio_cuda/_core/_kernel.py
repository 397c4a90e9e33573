"""Kernels, parameter specs, argument packing and launches.

Invariants:

* A :class:`Kernel` is device-independent; each scope loads it at most once.
* ``Kernel.launch`` checks everything (arity, dtypes, scalar ranges, access
  modes, closed or read-only arrays, launch configuration) before it returns a
  :class:`KernelLaunch`; a launch that fails these checks never reaches a stream.
* A :class:`KernelLaunch` is immutable. Its parameters are packed exactly once,
  into an arena laid out by the kernel's :class:`ParamPlan`, and reused by every
  submission of the same launch.
* :class:`LaunchBuilder` is inert: it is not a DeviceOp and cannot be scheduled
  until ``finalize_unchecked()`` turns it into a :class:`KernelLaunch`.
* The arena follows the C ABI of kernel parameters: each slot starts at a
  multiple of its alignment and takes ``sizeof`` bytes (a struct's size rounded
  up to its alignment); padding is zero. A by-value parameter's dtype is a
  native-order numeric, bool, complex (aligned like ``float2``/``double2``),
  ``ml_dtypes`` scalar or a structured dtype whose fields sit at C offsets;
  anything else is refused when the :class:`Scalar` is made.
* Device limits are checked before anything is enqueued and before any lease
  is taken: :func:`check_device_limits` (geometry, shared memory, clusters,
  cooperative support) by the scope, then ``DeviceContext.check_launch`` (what
  only the loaded kernel knows: its own thread limit, static shared memory,
  parameter layout, cooperative occupancy).
"""

from __future__ import annotations

import cmath
import importlib
import math
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, final

import attrs
import numpy as np

from ._array import AllocState, DeviceArray
from ._errors import KernelArgumentError
from ._ops import Access, DeviceOp

if TYPE_CHECKING:
    from ._driver import DeviceInfo
    from ._submit import EnqueueContext

Dim3 = tuple[int, int, int]
DTypeLike = Any
AccessName = Literal["read", "write", "readwrite"]

_POINTER = np.dtype(np.uint64)
#: the most parameter bytes a kernel can receive (CUDA 12.1+, Volta and newer)
MAX_PARAM_BYTES = 32764
#: the largest thread-block cluster that every device with clusters can run
PORTABLE_CLUSTER_SIZE = 8
#: clusters (and programmatic dependent launch) need sm_90 or newer
CLUSTER_MIN_CC = (9, 0)


def _as_dtype(value: DTypeLike) -> np.dtype[Any]:
    try:
        return np.dtype(value)
    except TypeError as exc:
        raise TypeError(f"dtype: expected a NumPy dtype or dtype string, got {value!r}") from exc


# --------------------------------------------------------------------------- params


def _is_ml_dtype(dtype: np.dtype[Any]) -> bool:
    """A scalar type of the optional ``ml_dtypes`` package (bfloat16, float8_*, int4, ...)."""
    return (
        dtype.kind == "V"
        and dtype.fields is None
        and dtype.subdtype is None
        and getattr(dtype.type, "__module__", "") == "ml_dtypes"
    )


def _param_dtype_problem(dtype: np.dtype[Any], *, field: bool = False) -> str | None:
    """Why ``dtype`` cannot be a by-value kernel parameter (or a field of
    one), or None when it can."""
    if dtype.subdtype is not None:
        if not field:
            return "a fixed-size array is not a C parameter type (wrap it in a structured dtype)"
        return _param_dtype_problem(dtype.subdtype[0], field=True)
    if not dtype.isnative:
        return "it is not in the native byte order"
    if dtype.fields is not None:
        for fname, spec in dtype.fields.items():
            fdt: np.dtype[Any] = spec[0]
            offset: int = spec[1]
            problem = _param_dtype_problem(fdt, field=True)
            if problem is not None:
                return f"field {fname!r}: {problem}"
            align = dtype_alignment(fdt)
            if offset % align:
                return (
                    f"field {fname!r} ({fdt}) is at offset {offset}, not a multiple of its "
                    f"alignment {align} as in C (build the dtype with align=True, or give C offsets)"
                )
        return None
    kind = dtype.kind
    if kind in "biu":
        return None
    if kind == "f" and dtype.itemsize in (2, 4, 8):
        return None
    if kind == "c" and dtype.itemsize in (8, 16):
        return None
    if kind in "fc":
        return f"{dtype.name} (long double) has no CUDA equivalent"
    if _is_ml_dtype(dtype):
        return None
    return f"{dtype.kind!r} dtypes are not kernel parameter types"


def _scalar_dtype(value: DTypeLike) -> np.dtype[Any]:
    dtype = _as_dtype(value)
    problem = _param_dtype_problem(dtype)
    if problem is not None:
        raise TypeError(
            f"dtype: expected a numeric, bool, complex or C-layout structured dtype, got {dtype}: {problem}"
        )
    return dtype


def _check_align(inst: Scalar, _attr: object, value: int | None) -> None:
    if value is None:
        return
    if type(value) is not int or value <= 0 or value & (value - 1):
        raise ValueError(f"align: expected a power of two, got {value!r}")
    natural = dtype_alignment(inst.dtype)
    if value < natural:
        raise ValueError(
            f"align: expected a power of two >= {natural} (the alignment of {inst.dtype}), got {value}"
        )


@attrs.frozen
class Scalar:
    """A by-value parameter: a NumPy scalar type (``"f2"``, ``"f4"``, ``"i8"``,
    ``"c8"``, ``ml_dtypes.bfloat16``...), or a structured dtype for a C struct.

    ``align`` over-aligns the parameter, as ``__align__(n)``/``alignas(n)``
    does in C (e.g. a struct holding a ``float4``); it must be a power of two
    no smaller than the dtype's own alignment. ``dtype.metadata["align"]`` does
    the same for a struct dtype."""

    dtype: np.dtype[Any] = attrs.field(converter=_scalar_dtype)
    name: str | None = attrs.field(default=None, kw_only=True)
    align: int | None = attrs.field(default=None, kw_only=True, validator=_check_align)

    @property
    def access(self) -> None:
        """Scalars take no lease."""
        return None

    @property
    def alignment(self) -> int:
        """The parameter's alignment in the argument arena (C ``alignof``)."""
        natural = dtype_alignment(self.dtype)
        return natural if self.align is None else max(natural, self.align)

    @property
    def size(self) -> int:
        """The parameter's size in the argument arena (C ``sizeof``: the
        dtype's size rounded up to :attr:`alignment`)."""
        return _align_up(self.dtype.itemsize, self.alignment)


@attrs.frozen
class _ArrayParam:
    dtype: np.dtype[Any] = attrs.field(converter=_as_dtype)
    name: str | None = attrs.field(default=None, kw_only=True)
    access: Access = attrs.field(init=False, default=Access.READ)


@attrs.frozen
class In(_ArrayParam):
    """A device array the kernel only reads (shared read lease)."""

    access: Access = attrs.field(init=False, default=Access.READ)


@attrs.frozen
class Out(_ArrayParam):
    """A device array the kernel writes (exclusive lease)."""

    access: Access = attrs.field(init=False, default=Access.WRITE)


@attrs.frozen
class InOut(_ArrayParam):
    """A device array the kernel reads and writes (exclusive lease)."""

    access: Access = attrs.field(init=False, default=Access.WRITE)


def _access_from_name(value: Access | str) -> Access:
    if isinstance(value, Access):
        return value
    table = {"read": Access.READ, "write": Access.WRITE, "readwrite": Access.WRITE}
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"access: expected 'read', 'write' or 'readwrite', got {value!r}") from None


def _check_len_dtype(_inst: object, _attr: object, value: np.dtype[Any]) -> None:
    if value.kind not in "iu" or not value.isnative:
        raise TypeError(f"len_dtype: expected a native integer dtype (e.g. 'u8' for size_t), got {value}")


@attrs.frozen
class Slice:
    """A device array passed as two parameters: a pointer and its length
    (``len_dtype``, ``size_t`` by default)."""

    dtype: np.dtype[Any] = attrs.field(converter=_as_dtype)
    access: Access = attrs.field(default=Access.WRITE, converter=_access_from_name, kw_only=True)
    len_dtype: np.dtype[Any] = attrs.field(
        default=np.dtype(np.uint64), converter=_as_dtype, kw_only=True, validator=_check_len_dtype
    )
    name: str | None = attrs.field(default=None, kw_only=True)


Param = Scalar | In | Out | InOut | Slice


def _param_label(index: int, param: Param | None) -> str:
    if param is None:
        return f"argument {index}"
    desc = f"{type(param).__name__}({param.dtype.str!r})"
    if param.name:
        return f"argument {index} ({param.name}: {desc})"
    return f"argument {index} ({desc})"


# --------------------------------------------------------------------------- packing


@attrs.frozen
class Slot:
    """One kernel parameter as the driver sees it."""

    offset: int
    size: int
    align: int


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def dtype_alignment(dtype: np.dtype[Any]) -> int:
    """C alignment of ``dtype``: its fields' largest alignment, or the value in
    ``dtype.metadata['align']`` for over-aligned structs."""
    meta: dict[str, Any] = dict(dtype.metadata or {})
    forced = int(meta.get("align", 0))
    if dtype.fields:
        natural = max(dtype_alignment(f[0]) for f in dtype.fields.values())
    elif dtype.subdtype is not None:
        natural = dtype_alignment(dtype.subdtype[0])
    elif dtype.kind == "c":
        natural = dtype.itemsize  # cuFloatComplex / cuDoubleComplex are float2 / double2
    else:
        natural = max(1, dtype.alignment)
    return max(natural, forced)


@attrs.frozen(cache_hash=True)
class ParamPlan:
    """Arena layout of a parameter list, built once per kernel (or builder)."""

    slots: tuple[Slot, ...]
    size: int

    @classmethod
    def from_layout(cls, layout: Sequence[tuple[int, int]]) -> ParamPlan:
        """``layout`` is (size, alignment) per slot, in kernel order."""
        offset = 0
        slots = []
        for size, align in layout:
            if align <= 0 or align & (align - 1):
                raise KernelArgumentError(f"align: expected a power of two, got {align}")
            offset = _align_up(offset, align)
            slots.append(Slot(offset, size, align))
            offset += size
        if offset > MAX_PARAM_BYTES:
            raise KernelArgumentError(
                f"params: expected at most {MAX_PARAM_BYTES} bytes of kernel parameters, got {offset}"
            )
        return cls(tuple(slots), offset)


def _slots_for(param: Param) -> list[tuple[int, int]]:
    if isinstance(param, Scalar):
        return [(param.size, param.alignment)]
    if isinstance(param, Slice):
        return [(8, 8), (param.len_dtype.itemsize, dtype_alignment(param.len_dtype))]
    return [(8, 8)]


# --------------------------------------------------------------------------- prepared


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
@attrs.frozen(eq=False)
class LaunchConfig:
    """Validated launch geometry and modes."""

    grid: Dim3
    block: Dim3
    shared_mem: int = 0
    cluster: Dim3 | None = None
    cooperative: bool = False
    pdl: bool = False


@final
class PreparedLaunch:
    """Everything a backend needs to enqueue one launch. ``arena`` holds the
    packed parameters at the offsets of ``plan``; :meth:`arg_views` describes
    them (built lazily from ``values``, one per kernel parameter, unless
    ``args`` was given). Immutable by convention; ``cache`` is the backends'
    scratch space (e.g. the ``void**`` array), filled on first launch."""

    __slots__ = ("arena", "args", "cache", "config", "kernel", "plan", "values")

    def __init__(
        self,
        kernel: Kernel,
        config: LaunchConfig,
        plan: ParamPlan,
        arena: bytes,
        args: tuple[ArgView, ...] | None = None,
        values: tuple[object, ...] = (),
    ) -> None:
        self.kernel = kernel
        self.config = config
        self.plan = plan
        self.arena = arena
        self.args = args
        self.values = values
        self.cache: dict[str, Any] = {}

    def arg_views(self) -> tuple[ArgView, ...]:
        """One :class:`ArgView` per kernel parameter (cached)."""
        if self.args is not None:
            return self.args
        views = self.cache.get("views")
        if views is None:
            views = self.cache["views"] = _views_of(self.kernel.params, self.values)
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


def _scalar_bytes(dtype: np.dtype[Any], value: object) -> bytes:
    """The bytes of one by-value argument; a struct's padding is zero (the
    fields are assigned into a zeroed buffer, whatever the source's padding
    held)."""
    if dtype.fields is None:
        return np.asarray(value, dtype=dtype).tobytes()
    buf = np.zeros(1, dtype=dtype)
    buf[0] = value
    return buf.tobytes()


def _pack(plan: ParamPlan, values: Sequence[bytes]) -> bytes:
    arena = bytearray(plan.size)
    for slot, raw in zip(plan.slots, values, strict=True):
        arena[slot.offset : slot.offset + len(raw)] = raw
    return bytes(arena)


# --------------------------------------------------------------------------- checks


def _dim3(name: str, value: object) -> Dim3:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        dims = [int(value)]
    elif isinstance(value, tuple | list) and 1 <= len(value) <= 3:
        dims = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise KernelArgumentError(f"{name}: expected an int or a tuple of 1 to 3 ints, got {value!r}")
            dims.append(int(v))
    else:
        raise KernelArgumentError(f"{name}: expected an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < 1 for d in dims):
        raise KernelArgumentError(f"{name}: every dimension must be >= 1, got {value!r}")
    while len(dims) < 3:
        dims.append(1)
    return (dims[0], dims[1], dims[2])


def make_config(
    grid: object,
    block: object,
    shared_mem: object = 0,
    cluster: object = None,
    cooperative: object = False,
    pdl: object = False,
) -> LaunchConfig:
    """Check the launch geometry and modes that do not depend on the device."""
    g = _dim3("grid", grid)
    b = _dim3("block", block)
    if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)) or shared_mem < 0:
        raise KernelArgumentError(f"shared_mem: expected a non-negative int, got {shared_mem!r}")
    for label, flag in (("cooperative", cooperative), ("pdl", pdl)):
        if not isinstance(flag, (bool, np.bool_)):
            raise KernelArgumentError(f"{label}: expected a bool, got {flag!r}")
    c = None
    if cluster is not None:
        c = _dim3("cluster", cluster)
        for axis, (gd, cd) in enumerate(zip(g, c, strict=True)):
            if gd % cd:
                raise KernelArgumentError(
                    f"cluster: dimension {axis} ({cd}) must divide grid dimension {gd}; "
                    f"got grid={g}, cluster={c}"
                )
    return LaunchConfig(g, b, int(shared_mem), c, bool(cooperative), bool(pdl))


_CONFIG_CACHE: dict[tuple[object, ...], LaunchConfig] = {}


def _plain(dims: object) -> bool:
    t = type(dims)
    return t is int or (t is tuple and all(type(d) is int for d in dims))  # type: ignore[attr-defined]


def cached_config(
    grid: object, block: object, shared_mem: object, cluster: object, cooperative: object, pdl: object
) -> LaunchConfig:
    """``make_config`` memoised on hashable arguments (the launch hot path)."""
    if not (
        _plain(grid)
        and _plain(block)
        and type(shared_mem) is int
        and (cluster is None or _plain(cluster))
        and type(cooperative) is bool
        and type(pdl) is bool
    ):
        # floats and bools compare equal to ints: only exact ints (and exact
        # bools for the modes) may hit the cache
        return make_config(grid, block, shared_mem, cluster, cooperative, pdl)
    key = (grid, block, shared_mem, cluster, cooperative, pdl)
    try:
        return _CONFIG_CACHE[key]
    except KeyError:
        config = make_config(grid, block, shared_mem, cluster, cooperative, pdl)
        if len(_CONFIG_CACHE) >= 4096:
            _CONFIG_CACHE.clear()
        _CONFIG_CACHE[key] = config
        return config
    except TypeError:  # unhashable (lists)
        return make_config(grid, block, shared_mem, cluster, cooperative, pdl)


# --------------------------------------------------------------------------- device limits


#: configurations that passed :func:`check_device_limits`, and for which device
_LIMITS_OK: dict[LaunchConfig, DeviceInfo] = {}


def check_device_limits(prepared: PreparedLaunch, info: DeviceInfo) -> None:
    """Check a launch's configuration against the device's limits (those that
    do not depend on the compiled kernel). Raises :class:`KernelArgumentError`
    naming the offending setting; the scope calls it before enqueueing.
    Memoised per configuration (typed launches of one geometry share one
    cached :class:`LaunchConfig`)."""
    c = prepared.config
    if _LIMITS_OK.get(c) is info:
        return
    _check_device_limits(prepared, info)
    if len(_LIMITS_OK) >= 4096:
        _LIMITS_OK.clear()
    _LIMITS_OK[c] = info


def _check_device_limits(prepared: PreparedLaunch, info: DeviceInfo) -> None:
    c = prepared.config
    name = prepared.kernel.name
    threads = c.block[0] * c.block[1] * c.block[2]
    if threads > info.max_threads_per_block:
        raise KernelArgumentError(
            f"{name}: block: expected at most {info.max_threads_per_block} threads per block, "
            f"got {c.block} = {threads}"
        )
    for axis, (b, mb) in enumerate(zip(c.block, info.max_block_dim, strict=True)):
        if b > mb:
            raise KernelArgumentError(f"{name}: block: dimension {axis} is {b}, the device allows {mb}")
    for axis, (g, mg) in enumerate(zip(c.grid, info.max_grid_dim, strict=True)):
        if g > mg:
            raise KernelArgumentError(f"{name}: grid: dimension {axis} is {g}, the device allows {mg}")
    if c.shared_mem > info.max_shared_memory_per_block_optin:
        raise KernelArgumentError(
            f"{name}: shared_mem: expected at most {info.max_shared_memory_per_block_optin} bytes, "
            f"got {c.shared_mem}"
        )
    cc = tuple(info.compute_capability)
    if c.cluster is not None:
        if cc < CLUSTER_MIN_CC:
            raise KernelArgumentError(
                f"{name}: cluster: thread-block clusters need compute capability "
                f"{CLUSTER_MIN_CC[0]}.{CLUSTER_MIN_CC[1]} or newer, the device ({info.name}) has "
                f"{cc[0]}.{cc[1]}; got cluster={c.cluster}"
            )
        size = c.cluster[0] * c.cluster[1] * c.cluster[2]
        if size > PORTABLE_CLUSTER_SIZE:
            raise KernelArgumentError(
                f"{name}: cluster: expected at most {PORTABLE_CLUSTER_SIZE} blocks per cluster, got {size}"
            )
    if c.pdl and cc < CLUSTER_MIN_CC:
        raise KernelArgumentError(
            f"{name}: pdl: programmatic dependent launch needs compute capability "
            f"{CLUSTER_MIN_CC[0]}.{CLUSTER_MIN_CC[1]} or newer, the device ({info.name}) has {cc[0]}.{cc[1]}"
        )
    if c.cooperative and not info.cooperative_launch:
        raise KernelArgumentError(
            f"{name}: cooperative: the device ({info.name}) does not support cooperative launches"
        )


def modeled_blocks_per_sm(info: DeviceInfo, block: Dim3, shared_mem: int) -> int:
    """How many blocks of ``block`` threads and ``shared_mem`` bytes of dynamic
    shared memory one SM can hold, from the device's per-SM limits alone (the
    simulator's occupancy model; registers and static shared memory are not
    modelled)."""
    threads = block[0] * block[1] * block[2]
    warps = -(-threads // 32)
    fit = min(info.max_blocks_per_multiprocessor, info.max_threads_per_multiprocessor // (warps * 32))
    if shared_mem:
        per_block = shared_mem + info.reserved_shared_memory_per_block
        fit = min(fit, info.max_shared_memory_per_multiprocessor // per_block)
    return max(0, fit)


def check_cooperative_occupancy(prepared: PreparedLaunch, info: DeviceInfo, blocks_per_sm: int) -> None:
    """Refuse a cooperative launch whose blocks cannot all be resident at once
    (``blocks_per_sm`` of this kernel and configuration, times the SM count):
    a grid-wide barrier in it would never complete."""
    c = prepared.config
    blocks = c.grid[0] * c.grid[1] * c.grid[2]
    sms = info.multiprocessor_count
    limit = blocks_per_sm * sms
    if blocks > limit:
        # (the limit is blocks_per_sm x SMs; a grid-stride loop fits any size)
        raise KernelArgumentError(
            f"{prepared.kernel.name}: cooperative launch of {blocks} blocks exceeds the "
            f"co-resident limit {limit} ({sms} SMs)"
        )


_KIND_LABELS = {"array": "an array", "scalar": "a scalar", "raw": "boxed bytes", "slice": "a slice"}


def slot_labels(prepared: PreparedLaunch) -> list[str]:
    """A label for each slot of ``prepared.plan``: the argument it belongs to."""
    kernel = prepared.kernel
    if prepared.plan is kernel._plan:
        labels = []
        for i, p in enumerate(kernel.params):
            label = _param_label(i, p)
            if isinstance(p, Slice):
                labels += [f"{label} pointer", f"{label} length"]
            else:
                labels.append(label)
        return labels
    out = []
    for i, view in enumerate(prepared.arg_views()):
        out.append(f"argument {i} ({_KIND_LABELS[view.kind]})")
    return out


def check_param_layout(prepared: PreparedLaunch, layout: Sequence[tuple[int, int]]) -> None:
    """Compare the arena's slots with the compiled kernel's own parameter
    layout, ``(offset, size)`` per parameter (as ``cuFuncGetParamInfo`` reports
    it). Raises :class:`KernelArgumentError` naming the first argument that
    differs."""
    slots = prepared.plan.slots
    name = prepared.kernel.name
    if len(slots) == len(layout) and all(
        s.offset == off and s.size == size for s, (off, size) in zip(slots, layout, strict=True)
    ):
        return
    labels = slot_labels(prepared)
    for i, (slot, (off, size)) in enumerate(zip(slots, layout, strict=False)):
        if slot.offset != off or slot.size != size:
            raise KernelArgumentError(
                f"{name}: {labels[i]}: the compiled kernel's parameter {i} takes {size} bytes at offset "
                f"{off}, the argument packs {slot.size} bytes at offset {slot.offset} "
                f"(check the dtype, or the align of a struct or boxed argument)"
            )
    raise KernelArgumentError(
        f"{name}: params: expected {len(layout)} kernel parameters (as compiled), "
        f"the launch packs {len(slots)}"
    )


def _convert_scalar(label: str, dtype: np.dtype[Any], value: object) -> np.generic:
    if dtype.fields is not None:
        if isinstance(value, np.void) and value.dtype == dtype:
            return value
        if isinstance(value, np.ndarray) and value.shape == () and value.dtype == dtype:
            item: np.generic = value[()]  # type: ignore[assignment]
            return item
        if isinstance(value, tuple):
            try:
                made: np.generic = np.array(value, dtype=dtype)[()]  # type: ignore[assignment]
                return made
            except (TypeError, ValueError) as exc:
                raise KernelArgumentError(
                    f"{label}: expected a tuple matching {dtype}, got {value!r} ({exc})"
                ) from None
        raise KernelArgumentError(
            f"{label}: expected a NumPy structured scalar of dtype {dtype} or a tuple, "
            f"got {type(value).__name__}"
        )
    if isinstance(value, np.generic):
        if value.dtype != dtype:
            how = f"ml_dtypes.{dtype.name}(x)" if _is_ml_dtype(dtype) else f"np.{dtype.name}(x)"
            raise KernelArgumentError(
                f"{label}: expected a {dtype.name} scalar, got {value.dtype.name} "
                f"({value!r}); convert explicitly, e.g. {how}"
            )
        return value
    if _is_ml_dtype(dtype):
        return _convert_ml(label, dtype, value)
    kind = dtype.kind
    if kind == "b":
        if isinstance(value, bool):
            return np.bool_(value)
    elif kind in "iu":
        if isinstance(value, int) and not isinstance(value, bool):
            info = np.iinfo(dtype)
            if not info.min <= value <= info.max:
                raise KernelArgumentError(
                    f"{label}: value {value} is out of range for {dtype.name} [{info.min}, {info.max}]"
                )
            return dtype.type(value)  # type: ignore[no-any-return]
    elif kind == "f":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _convert_float(label, dtype, value, np.finfo(dtype).max)
    elif kind == "c" and isinstance(value, (int, float, complex)) and not isinstance(value, bool):
        return _convert_float(label, dtype, value, np.finfo(dtype).max)
    raise KernelArgumentError(
        f"{label}: expected a {dtype.name} scalar, got {type(value).__name__} ({value!r})"
    )


def _finite(value: complex | float) -> bool:
    try:
        return cmath.isfinite(value) if isinstance(value, complex) else math.isfinite(value)
    except OverflowError:  # an int too large for a double
        return True


def _convert_float(label: str, dtype: np.dtype[Any], value: complex | float, top: object) -> np.generic:
    """``value`` as a ``dtype`` scalar; refuses a finite value that would
    become infinite (or NaN, for float8 types without infinities)."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            converted: np.generic = dtype.type(value)
        ok = _finite(complex(converted)) if dtype.kind == "c" else math.isfinite(float(converted))
    except OverflowError:
        ok = False
        converted = dtype.type(0)
    if _finite(value) and not ok:
        raise KernelArgumentError(f"{label}: value {value!r} overflows {dtype.name} (max {top})")
    return converted


def _convert_ml(label: str, dtype: np.dtype[Any], value: object) -> np.generic:
    """A Python number as a scalar of an ``ml_dtypes`` type (the package is
    importable: ``dtype`` is one of its types)."""
    ml_dtypes: Any = importlib.import_module("ml_dtypes")
    try:
        finfo: Any = ml_dtypes.finfo(dtype)
    except (TypeError, ValueError, KeyError):
        finfo = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if finfo is not None:
            return _convert_float(label, dtype, value, finfo.max)
        if isinstance(value, int):
            info = ml_dtypes.iinfo(dtype)
            if not int(info.min) <= value <= int(info.max):
                raise KernelArgumentError(
                    f"{label}: value {value} is out of range for {dtype.name} [{info.min}, {info.max}]"
                )
            made: np.generic = dtype.type(value)
            return made
    raise KernelArgumentError(
        f"{label}: expected a {dtype.name} scalar, got {type(value).__name__} ({value!r})"
    )


def _check_array(label: str, param: Param, value: object, access: Access) -> DeviceArray:
    if not isinstance(value, DeviceArray):
        raise KernelArgumentError(f"{label}: expected a trio_cuda DeviceArray, got {type(value).__name__}")
    if value.closed:
        raise KernelArgumentError(f"{label}: the array is closed")
    if value.dtype != param.dtype:
        raise KernelArgumentError(f"{label}: expected dtype {param.dtype.name}, got {value.dtype.name}")
    if access is Access.WRITE and value.readonly:
        raise KernelArgumentError(
            f"{label}: the kernel writes this argument, but the array is read-only (made by as_readonly())"
        )
    return value


# --------------------------------------------------------------------------- kernel


def _check_params(params: Sequence[object]) -> tuple[Param, ...]:
    out = []
    for i, p in enumerate(params):
        if not isinstance(p, Scalar | In | Out | InOut | Slice):
            raise TypeError(f"params[{i}]: expected Scalar, In, Out, InOut or Slice, got {p!r}")
        out.append(p)
    return tuple(out)


@final
@attrs.define(eq=False)
class Kernel:
    """A GPU kernel with a typed parameter list.

    Use :meth:`from_source` (CUDA C++, compiled with NVRTC), :meth:`from_ptx`
    or :meth:`from_cubin`. ``reference`` is the kernel's behaviour on the CPU:
    the simulator runs it on NumPy views, and tests use it as an oracle.
    """

    name: str
    params: tuple[Param, ...]
    source: str | None = None
    image: bytes | None = None
    image_kind: Literal["source", "ptx", "cubin"] = "source"
    options: tuple[str, ...] = ()
    reference: Callable[..., object] | None = None
    _plan: ParamPlan = attrs.field(init=False, repr=False)
    _fast: tuple[tuple[Any, ...], ...] | None = attrs.field(init=False, repr=False)
    _struct: struct.Struct | None = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        layout: list[tuple[int, int]] = []
        for p in self.params:
            layout.extend(_slots_for(p))
        self._plan = ParamPlan.from_layout(layout)
        self._fast, self._struct = _fast_packer(self.params, self._plan)

    @classmethod
    def from_source(
        cls,
        source: str,
        name: str,
        *,
        params: Sequence[Param],
        reference: Callable[..., object] | None = None,
        options: Sequence[str] = (),
    ) -> Kernel:
        """A kernel in CUDA C++ source. ``name`` is the (``extern "C"``)
        function name; ``options`` are extra NVRTC options."""
        if not isinstance(source, str):
            raise TypeError(f"source: expected str, got {type(source).__name__}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name: expected a non-empty str, got {name!r}")
        return cls(
            name=name,
            params=_check_params(params),
            source=source,
            image_kind="source",
            options=tuple(options),
            reference=reference,
        )

    @classmethod
    def from_ptx(
        cls,
        ptx: str | bytes,
        name: str,
        *,
        params: Sequence[Param],
        reference: Callable[..., object] | None = None,
    ) -> Kernel:
        """A kernel in PTX, loaded (JIT-compiled) by the driver."""
        image = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
        return cls(
            name=name, params=_check_params(params), image=image, image_kind="ptx", reference=reference
        )

    @classmethod
    def from_cubin(
        cls,
        cubin: bytes,
        name: str,
        *,
        params: Sequence[Param],
        reference: Callable[..., object] | None = None,
    ) -> Kernel:
        """A kernel in a compiled cubin (or fatbin) image."""
        return cls(
            name=name,
            params=_check_params(params),
            image=bytes(cubin),
            image_kind="cubin",
            reference=reference,
        )

    @property
    def plan(self) -> ParamPlan:
        """The arena layout of this kernel's parameters."""
        return self._plan

    def launch(
        self,
        *args: object,
        grid: object,
        block: object,
        shared_mem: int = 0,
        cluster: object = None,
        cooperative: bool = False,
        pdl: bool = False,
    ) -> KernelLaunch:
        """Check ``args`` against the parameter list and return an immutable,
        schedulable :class:`KernelLaunch`. Raises :class:`KernelArgumentError`
        naming the offending argument; nothing is enqueued."""
        config = cached_config(grid, block, shared_mem, cluster, cooperative, pdl)
        fast = self._fast
        if fast is not None and len(args) == len(fast):
            made = _launch_fast(self, fast, args, config)
            if made is not None:
                return made
        return self._launch_checked(args, config)

    def _launch_checked(self, args: tuple[object, ...], config: LaunchConfig) -> KernelLaunch:
        """The reference path: checks every argument with a precise error."""
        if len(args) != len(self.params):
            raise KernelArgumentError(
                f"{self.name}: expected {len(self.params)} arguments "
                f"({', '.join(_param_label(i, p) for i, p in enumerate(self.params))}), "
                f"got {len(args)}"
            )
        raws: list[bytes] = []
        views: list[ArgView] = []
        accesses: list[tuple[DeviceArray, Access]] = []
        outputs: list[DeviceArray] = []
        for i, (param, value) in enumerate(zip(self.params, args, strict=True)):
            label = f"{self.name}: {_param_label(i, param)}"
            if isinstance(param, Scalar):
                scalar = _convert_scalar(label, param.dtype, value)
                raws.append(_scalar_bytes(param.dtype, scalar))
                views.append(ArgView("scalar", dtype=param.dtype, value=scalar))
                continue
            access = param.access
            assert access is not None
            arr = _check_array(label, param, value, access)
            accesses.append((arr, access))
            if access is Access.WRITE:
                outputs.append(arr)
            raws.append(_POINTER.type(arr.ptr).tobytes())
            if isinstance(param, Slice):
                length = arr.size
                info = np.iinfo(param.len_dtype)
                if length > info.max:
                    raise KernelArgumentError(f"{label}: length {length} does not fit {param.len_dtype.name}")
                raws.append(np.asarray(length, dtype=param.len_dtype).tobytes())
                views.append(
                    ArgView(
                        "slice",
                        arr.ptr,
                        arr.shape,
                        arr.dtype,
                        length=length,
                        access=access,
                        len_dtype=param.len_dtype,
                        order=arr.order,
                    )
                )
            else:
                views.append(ArgView("array", arr.ptr, arr.shape, arr.dtype, access=access, order=arr.order))
        prepared = PreparedLaunch(self, config, self._plan, _pack(self._plan, raws), tuple(views))
        return KernelLaunch._create(prepared, _merge_accesses(accesses), outputs)

    def builder(self) -> LaunchBuilder:
        """An inert, unchecked launch builder; see :class:`LaunchBuilder`."""
        return LaunchBuilder._create(self)


def _merge_accesses(
    accesses: Sequence[tuple[DeviceArray, Access]],
) -> tuple[tuple[DeviceArray, Access], ...]:
    """One entry per allocation, with the strongest access."""
    merged: dict[int, tuple[DeviceArray, Access]] = {}
    for arr, access in accesses:
        key = id(arr._alloc)
        prev = merged.get(key)
        if prev is None or (access is Access.WRITE and prev[1] is Access.READ):
            merged[key] = (arr, access)
    return tuple(merged.values())


# --------------------------------------------------------------------------- fast path

_STRUCT_CODES = {
    "i1": "b",
    "u1": "B",
    "i2": "h",
    "u2": "H",
    "i4": "i",
    "u4": "I",
    "i8": "q",
    "u8": "Q",
    "f2": "e",
    "f4": "f",
    "f8": "d",
    "b1": "?",
}
_K_INT, _K_FLOAT, _K_BOOL, _K_ARRAY, _K_SLICE = range(5)
_LIVE = AllocState.LIVE


def _code(dtype: np.dtype[Any]) -> str | None:
    if dtype.fields is not None or dtype.subdtype is not None or dtype.metadata:
        return None
    if dtype.byteorder not in ("=", "|", "<"):
        return None
    return _STRUCT_CODES.get(f"{dtype.kind}{dtype.itemsize}")


def _fast_packer(
    params: Sequence[Param], plan: ParamPlan
) -> tuple[tuple[tuple[Any, ...], ...] | None, struct.Struct | None]:
    """A per-kernel table and ``struct.Struct`` for the common parameter kinds
    (numeric scalars, arrays, slices). None when a parameter needs the general
    path (structs, complex, exotic dtypes)."""
    table: list[tuple[Any, ...]] = []
    codes: list[str] = []
    for p in params:
        if isinstance(p, Scalar):
            code = _code(p.dtype)
            if code is None:
                return None, None
            kind = p.dtype.kind
            if kind in "iu":
                info = np.iinfo(p.dtype)
                table.append((_K_INT, p.dtype.type, int(info.min), int(info.max), None))
            elif kind == "f":
                table.append((_K_FLOAT, p.dtype.type, 0, 0, None))
            else:
                table.append((_K_BOOL, p.dtype.type, 0, 0, None))
            codes.append(code)
        elif isinstance(p, Slice):
            code = _code(p.len_dtype)
            if code is None or p.len_dtype.kind not in "iu":
                return None, None
            table.append((_K_SLICE, p.dtype, 0, int(np.iinfo(p.len_dtype).max), p.access))
            codes.extend(("Q", code))
        else:
            table.append((_K_ARRAY, p.dtype, 0, 0, p.access))
            codes.append("Q")
    fmt = ["<"]
    offset = 0
    for slot, code in zip(plan.slots, codes, strict=True):
        if slot.offset > offset:
            fmt.append(f"{slot.offset - offset}x")
        fmt.append(code)
        offset = slot.offset + slot.size
    if plan.size > offset:
        fmt.append(f"{plan.size - offset}x")
    packer = struct.Struct("".join(fmt))
    assert packer.size == plan.size
    return tuple(table), packer


def _launch_fast(
    kernel: Kernel, table: tuple[tuple[Any, ...], ...], args: tuple[object, ...], config: LaunchConfig
) -> KernelLaunch | None:
    """Validate and pack the common case; None sends the caller to the
    checked path, which raises the precise error (or handles the rest)."""
    flat: list[object] = []
    accesses: list[tuple[DeviceArray, Access]] = []
    outputs: list[DeviceArray] = []
    write = Access.WRITE
    for (kind, dt, lo, hi, access), v in zip(table, args):
        t = type(v)
        if kind in (_K_ARRAY, _K_SLICE):
            if t is not DeviceArray:
                return None
            arr: DeviceArray = v  # type: ignore[assignment]
            if arr._closed or arr._alloc.state is not _LIVE or not (arr._dtype is dt or arr._dtype == dt):
                return None
            if access is write:
                if arr._readonly:
                    return None
                outputs.append(arr)
            accesses.append((arr, access))
            flat.append(arr._alloc.ptr + arr._offset)
            if kind == _K_SLICE:
                n = arr.size
                if n > hi:
                    return None
                flat.append(n)
        elif kind == _K_INT:
            if t is int:
                if not lo <= v <= hi:
                    return None
            elif t is not dt:
                return None
            flat.append(v)
        elif kind == _K_FLOAT:
            if t is not float and t is not dt and t is not int:
                return None
            flat.append(v)
        else:
            if t is not bool and t is not dt:
                return None
            flat.append(v)
    st = kernel._struct
    assert st is not None
    try:
        arena = st.pack(*flat)
    except (struct.error, OverflowError):
        return None
    prepared = PreparedLaunch(kernel, config, kernel._plan, arena, None, args)
    n = len(accesses)
    if n > 1 and (
        accesses[0][0]._alloc is accesses[1][0]._alloc
        if n == 2
        else len({id(a._alloc) for a, _ in accesses}) < n
    ):
        merged = _merge_accesses(accesses)
    else:
        merged = tuple(accesses)
    return KernelLaunch._create(prepared, merged, outputs)


# --------------------------------------------------------------------------- launch op


def _output_of(outputs: Sequence[DeviceArray]) -> object:
    if not outputs:
        return None
    if len(outputs) == 1:
        return outputs[0]
    return tuple(outputs)


@final
class KernelLaunch(DeviceOp[Any]):
    """One immutable, reusable kernel launch (a DeviceOp). Its output is the
    array it writes, a tuple of them if several, or None."""

    __slots__ = ("_accesses", "_output", "prepared")

    prepared: PreparedLaunch
    _accesses: tuple[tuple[DeviceArray, Access], ...]
    _output: object

    def __init__(self) -> None:
        raise TypeError("KernelLaunch has no public constructor; use Kernel.launch() or a builder")

    @classmethod
    def _create(
        cls,
        prepared: PreparedLaunch,
        accesses: tuple[tuple[DeviceArray, Access], ...],
        outputs: Sequence[DeviceArray],
    ) -> KernelLaunch:
        self = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(self, "prepared", prepared)
        setattr_(self, "_accesses", accesses)
        setattr_(self, "_output", _output_of(outputs))
        return self

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

    def _enqueue(self, ctx: EnqueueContext) -> object:
        ctx.launch(self.prepared, self._accesses)
        return self._output


# --------------------------------------------------------------------------- builder


_PLAN_CACHE: dict[tuple[tuple[int, int], ...], ParamPlan] = {}


def _plan_for(kernel: Kernel, layout: Sequence[tuple[int, int]]) -> ParamPlan:
    """The arena plan of a builder's ``(size, alignment)`` layout: the kernel's
    own plan when they agree (backends cache per plan), else one shared by
    every builder of that layout."""
    key = tuple(layout)
    own = kernel._plan
    slots = own.slots
    if len(slots) == len(key) and all(
        s.size == size and s.align == align for s, (size, align) in zip(slots, key, strict=True)
    ):
        return own
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        plan = ParamPlan.from_layout(key)
        if len(_PLAN_CACHE) >= 1024:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = plan
    return plan


@final
class LaunchBuilder:
    """Inert launch builder: collects geometry, modes and raw arguments, checks
    nothing against the kernel's parameter list, and cannot be scheduled.
    ``finalize_unchecked()`` returns an immutable :class:`KernelLaunch`.

    ``arg(array, access=...)`` takes the access mode from the kernel's matching
    parameter when it declares one, else ``"readwrite"``.
    """

    __slots__ = (
        "_args",
        "_block",
        "_cluster",
        "_cooperative",
        "_grid",
        "_kernel",
        "_layout",
        "_pdl",
        "_shared",
    )

    _kernel: Kernel
    _grid: object
    _block: object
    _shared: int
    _cluster: object
    _cooperative: object
    _pdl: object
    _args: list[tuple[bytes, ArgView, DeviceArray | None]]
    _layout: list[tuple[int, int]]

    def __init__(self) -> None:
        raise TypeError("LaunchBuilder has no public constructor; use Kernel.builder()")

    @classmethod
    def _create(cls, kernel: Kernel) -> LaunchBuilder:
        self = object.__new__(cls)
        self._kernel = kernel
        self._grid = 1
        self._block = 1
        self._shared = 0
        self._cluster = None
        self._cooperative = False
        self._pdl = False
        self._args = []
        self._layout = []
        return self

    def grid(self, *dims: int) -> LaunchBuilder:
        """Set the grid dimensions (1 to 3 ints)."""
        self._grid = dims
        return self

    def block(self, *dims: int) -> LaunchBuilder:
        """Set the block dimensions (1 to 3 ints)."""
        self._block = dims
        return self

    def shared_mem(self, nbytes: int) -> LaunchBuilder:
        """Set the dynamic shared memory in bytes."""
        self._shared = nbytes
        return self

    def cluster(self, *dims: int) -> LaunchBuilder:
        """Set the thread-block cluster dimensions."""
        self._cluster = dims
        return self

    def cooperative(self, enabled: bool = True) -> LaunchBuilder:
        """Make it a cooperative launch (checked at finalize: a bool)."""
        self._cooperative = enabled
        return self

    def pdl(self, enabled: bool = True) -> LaunchBuilder:
        """Allow programmatic dependent launch (checked at finalize: a bool)."""
        self._pdl = enabled
        return self

    def arg(self, value: object, *, access: AccessName | None = None) -> LaunchBuilder:
        """Append a DeviceArray (passed as its pointer) or a NumPy scalar."""
        index = len(self._args)
        if isinstance(value, DeviceArray):
            if value.closed:
                raise KernelArgumentError(f"argument {index}: the array is closed")
            if access is not None:
                mode = _access_from_name(access)
            else:
                declared = self._kernel.params[index].access if index < len(self._kernel.params) else None
                mode = declared if declared is not None else Access.WRITE
            if mode is Access.WRITE and value.readonly:
                raise KernelArgumentError(f"argument {index}: write access to a read-only array")
            raw = _POINTER.type(value.ptr).tobytes()
            self._args.append(
                (
                    raw,
                    ArgView("array", value.ptr, value.shape, value.dtype, access=mode, order=value.order),
                    value,
                )
            )
            self._layout.append((8, 8))
        elif isinstance(value, np.generic):
            problem = _param_dtype_problem(value.dtype)
            if problem is not None:
                raise KernelArgumentError(
                    f"argument {index}: expected a numeric, bool, complex or C-layout struct scalar, "
                    f"got {value.dtype}: {problem}"
                )
            raw = _scalar_bytes(value.dtype, value)
            align = dtype_alignment(value.dtype)
            self._args.append((raw, ArgView("scalar", dtype=value.dtype, value=value), None))
            self._layout.append((_align_up(value.dtype.itemsize, align), align))
        else:
            raise KernelArgumentError(
                f"argument {index}: expected a DeviceArray or a NumPy scalar "
                f"(use arg_boxed for raw bytes), got {type(value).__name__}"
            )
        return self

    def arg_boxed(self, raw: bytes | bytearray | memoryview, *, align: int) -> LaunchBuilder:
        """Append an opaque parameter of ``len(raw)`` bytes at alignment ``align``."""
        index = len(self._args)
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise KernelArgumentError(
                f"argument {index}: expected bytes, bytearray or memoryview, got {type(raw).__name__}"
            )
        data = raw.tobytes() if isinstance(raw, memoryview) else bytes(raw)
        if not data:
            raise KernelArgumentError(f"argument {index}: raw bytes must not be empty")
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise KernelArgumentError(f"argument {index}: align must be a power of two, got {align}")
        self._args.append((data, ArgView("raw", value=data), None))
        self._layout.append((len(data), align))
        return self

    def finalize_unchecked(self) -> KernelLaunch:
        """Freeze into an immutable KernelLaunch. Only the geometry is checked."""
        config = cached_config(
            self._grid,
            self._block,
            self._shared,
            self._cluster,
            self._cooperative,
            self._pdl,
        )
        plan = _plan_for(self._kernel, self._layout)
        raws = [a[0] for a in self._args]
        views = tuple(a[1] for a in self._args)
        accesses = []
        outputs = []
        for raw_view_arr in self._args:
            arr = raw_view_arr[2]
            if arr is not None:
                mode = raw_view_arr[1].access
                assert mode is not None
                accesses.append((arr, mode))
                if mode is Access.WRITE:
                    outputs.append(arr)
        prepared = PreparedLaunch(self._kernel, config, plan, _pack(plan, raws), views)
        return KernelLaunch._create(prepared, _merge_accesses(accesses), outputs)

    def __repr__(self) -> str:
        return f"<LaunchBuilder {self._kernel.name} ({len(self._args)} args, not finalized)>"
