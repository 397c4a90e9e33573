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
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, final

import attrs
import numpy as np

from ._array import AllocState, DeviceArray
from ._errors import KernelArgumentError
from ._ops import Access, DeviceOp

if TYPE_CHECKING:
    from ._submit import EnqueueContext

Dim3 = tuple[int, int, int]
DTypeLike = Any
AccessName = Literal["read", "write", "readwrite"]

_POINTER = np.dtype(np.uint64)


def _as_dtype(value: DTypeLike) -> np.dtype[Any]:
    try:
        return np.dtype(value)
    except TypeError as exc:
        raise TypeError(f"dtype: expected a NumPy dtype or dtype string, got {value!r}") from exc


# --------------------------------------------------------------------------- params


@attrs.frozen
class Scalar:
    """A by-value parameter: a NumPy scalar type, or a structured dtype for a
    C struct."""

    dtype: np.dtype[Any] = attrs.field(converter=_as_dtype)
    name: str | None = attrs.field(default=None, kw_only=True)

    @property
    def access(self) -> None:
        """Scalars take no lease."""
        return None


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


@attrs.frozen
class Slice:
    """A device array passed as two parameters: a pointer and its length
    (``len_dtype``, ``size_t`` by default)."""

    dtype: np.dtype[Any] = attrs.field(converter=_as_dtype)
    access: Access = attrs.field(default=Access.WRITE, converter=_access_from_name, kw_only=True)
    len_dtype: np.dtype[Any] = attrs.field(default=np.dtype(np.uint64), converter=_as_dtype, kw_only=True)
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
    else:
        natural = max(1, dtype.alignment)
    return max(natural, forced)


@attrs.frozen
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
        return cls(tuple(slots), offset)


def _slots_for(param: Param) -> list[tuple[int, int]]:
    if isinstance(param, Scalar):
        return [(param.dtype.itemsize, dtype_alignment(param.dtype))]
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
                )
            )
        else:
            out.append(ArgView("array", value.ptr, value.shape, value.dtype, access=param.access))
    return tuple(out)


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
    cooperative: bool = False,
    pdl: bool = False,
) -> LaunchConfig:
    """Check the launch geometry that does not depend on the device."""
    g = _dim3("grid", grid)
    b = _dim3("block", block)
    if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)) or shared_mem < 0:
        raise KernelArgumentError(f"shared_mem: expected a non-negative int, got {shared_mem!r}")
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
    grid: object, block: object, shared_mem: object, cluster: object, cooperative: bool, pdl: bool
) -> LaunchConfig:
    """``make_config`` memoised on hashable arguments (the launch hot path)."""
    if not (
        _plain(grid) and _plain(block) and type(shared_mem) is int and (cluster is None or _plain(cluster))
    ):
        # floats and bools compare equal to ints: only exact ints may hit the cache
        return make_config(grid, block, shared_mem, cluster, cooperative, pdl)
    key = (grid, block, shared_mem, cluster, cooperative is True, pdl is True)
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
            raise KernelArgumentError(
                f"{label}: expected a {dtype.name} scalar, got {value.dtype.name} "
                f"({value!r}); convert explicitly, e.g. np.{dtype.name}(x)"
            )
        return value
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
            with np.errstate(over="ignore"):
                converted = dtype.type(value)
            if np.isfinite(value) and not np.isfinite(converted):
                raise KernelArgumentError(
                    f"{label}: value {value!r} overflows {dtype.name} (max {np.finfo(dtype).max})"
                )
            return converted  # type: ignore[no-any-return]
    elif kind == "c" and isinstance(value, (int, float, complex)) and not isinstance(value, bool):
        return dtype.type(value)  # type: ignore[no-any-return]
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
                raws.append(np.asarray(scalar, dtype=param.dtype).tobytes())
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
                    )
                )
            else:
                views.append(ArgView("array", arr.ptr, arr.shape, arr.dtype, access=access))
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
    _cooperative: bool
    _pdl: bool
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
        """Make it a cooperative launch."""
        self._cooperative = bool(enabled)
        return self

    def pdl(self, enabled: bool = True) -> LaunchBuilder:
        """Allow programmatic dependent launch."""
        self._pdl = bool(enabled)
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
                (raw, ArgView("array", value.ptr, value.shape, value.dtype, access=mode), value)
            )
            self._layout.append((8, 8))
        elif isinstance(value, np.generic):
            raw = np.asarray(value).tobytes()
            self._args.append((raw, ArgView("scalar", dtype=value.dtype, value=value), None))
            self._layout.append((value.dtype.itemsize, dtype_alignment(value.dtype)))
        else:
            raise KernelArgumentError(
                f"argument {index}: expected a DeviceArray or a NumPy scalar "
                f"(use arg_boxed for raw bytes), got {type(value).__name__}"
            )
        return self

    def arg_boxed(self, raw: bytes | bytearray | memoryview, *, align: int) -> LaunchBuilder:
        """Append an opaque parameter of ``len(raw)`` bytes at alignment ``align``."""
        data = bytes(raw)
        index = len(self._args)
        if not data:
            raise KernelArgumentError(f"argument {index}: raw bytes must not be empty")
        if align <= 0 or align & (align - 1):
            raise KernelArgumentError(f"argument {index}: align must be a power of two, got {align}")
        self._args.append((data, ArgView("raw", value=data), None))
        self._layout.append((len(data), align))
        return self

    def finalize_unchecked(self) -> KernelLaunch:
        """Freeze into an immutable KernelLaunch. Only the geometry is checked."""
        config = make_config(
            self._grid, self._block, self._shared, self._cluster, self._cooperative, self._pdl
        )
        plan = ParamPlan.from_layout(self._layout)
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
