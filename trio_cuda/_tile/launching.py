"""The typed launch of tile kernels (``Kernel.from_tile(...).launch``) and
the registration of the tile support with the core.

A launch tries the fast paths of its kernel's most recent argument recipes
(``_core._tilefast``), then the checked path here: it reads a signature from
the arguments (``_spec_of``), finds the specialisation (``kernel.py``), flattens
and packs the arguments, takes each array's access from the specialisation's
plan and refuses arguments that overlap, one of them written.

Invariants: see ``kernel.py``'s (everything is checked before a launch is
returned; nothing is compiled, enqueued or retained here). A recipe's fast
path is made once, from the first checked launch of that recipe.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, final

import numpy as np

from .._core._arena import _code
from .._core._array import DeviceArray
from .._core._config import cached_config
from .._core._errors import KernelArgumentError
from .._core._kernel import Kernel, Reference, register_tile_support
from .._core._launch import KernelLaunch, PreparedLaunch, _merge_accesses
from .._core._ops import Access
from .._core._tilefast import FastTileLauncher, TileArg, compile_tile_fast
from . import access as _access
from .kernel import (
    _ALIGN_CAP,
    _FAST_MAX,
    _RECIPES_MAX,
    TileKernel,
    TileSpecialisation,
    _check_access,
    _check_cache,
    _constant_key,
    _ct,
    _Param,
    _params_of,
    _pyfunc,
    _strides,
)
from .signature import (
    ArraySpec,
    ConstantSpec,
    ListSpec,
    ParamSpec,
    ScalarSpec,
    TileSignature,
    TupleSpec,
    address_alignment,
    spec_of_array,
)

__all__ = ["install", "launch"]


# --------------------------------------------------------------------------- launching


def _scalar_dtype(value: object, declared: np.dtype[Any] | None, label: str) -> np.dtype[Any]:
    if isinstance(value, np.generic):
        dt = value.dtype
        if declared is not None and dt != declared:
            raise KernelArgumentError(f"{label}: expected a {declared} scalar (as annotated), got {dt}")
        if _code(dt) is None:
            raise KernelArgumentError(f"{label}: expected a bool, integer or float scalar, got {dt}")
        return dt
    if declared is not None:
        return declared
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int32) if -(2**31) <= value < 2**31 else np.dtype(np.int64)
    if isinstance(value, float):
        return np.dtype(np.float32)
    raise KernelArgumentError(
        f"{label}: expected a device array, a list or tuple of them, or a scalar, got {type(value).__name__}"
    )


def _check_scalar(value: object, dtype: np.dtype[Any], label: str) -> object:
    """The value as ``dtype`` would hold it exactly; an int out of range, a
    float for an integer or a finite float that overflows is refused."""
    if isinstance(value, np.generic) and value.dtype == dtype:
        return value.item()
    if dtype.kind == "b":
        if not isinstance(value, bool | np.bool_):
            raise KernelArgumentError(f"{label}: expected a bool, got {value!r}")
        return bool(value)
    if dtype.kind in "iu":
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
            raise KernelArgumentError(f"{label}: expected an integer ({dtype}), got {value!r}")
        info = np.iinfo(dtype)
        v = int(value)
        if not info.min <= v <= info.max:
            raise KernelArgumentError(f"{label}: {v} does not fit {dtype} ({info.min}..{info.max})")
        return v
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
        raise KernelArgumentError(f"{label}: expected a number ({dtype}), got {value!r}")
    f = float(value)
    with np.errstate(over="ignore"):
        narrowed = dtype.type(f)
    if np.isfinite(f) and not np.isfinite(narrowed):
        raise KernelArgumentError(f"{label}: {f} overflows {dtype}")
    return f


def _check_array(arr: DeviceArray, label: str) -> None:
    # a closed array (or one whose scope exited) is a bad argument, as a SIMT
    # launch reports it (KernelArgumentError, not ScopeClosedError); a
    # quarantined one keeps its CompletionUnknownError
    if arr.closed:
        raise KernelArgumentError(f"{label}: the array is closed")
    arr._check_usable(label)


def _array_spec(arr: DeviceArray, label: str) -> ArraySpec:
    _check_array(arr, label)
    return spec_of_array(
        arr.dtype, arr.shape, _strides(arr), alignment=address_alignment(arr.ptr, _ALIGN_CAP)
    )


def _list_spec(items: list[Any], label: str) -> ListSpec:
    if not items:
        raise KernelArgumentError(f"{label}: expected a non-empty list of device arrays, got []")
    specs = []
    for j, item in enumerate(items):
        if type(item) is not DeviceArray:
            raise KernelArgumentError(f"{label}[{j}]: expected a DeviceArray, got {type(item).__name__}")
        specs.append(_array_spec(item, f"{label}[{j}]"))
    first = specs[0]
    for j, s in enumerate(specs[1:], 1):
        if s.dtype != first.dtype or s.ndim != first.ndim:
            raise KernelArgumentError(
                f"{label}[{j}]: the elements of a list share one dtype and rank, got {s.dtype} of rank "
                f"{s.ndim} after {first.dtype} of rank {first.ndim}"
            )
    ndim = first.ndim
    wide = any(s.index_dtype == "int64" for s in specs)

    def per_dim(name: str) -> tuple[int, ...]:
        return tuple(min(getattr(s, name)[d] for s in specs) for d in range(ndim))

    element = ArraySpec(
        dtype=first.dtype,
        ndim=ndim,
        index_dtype="int64" if wide else "int32",
        strides=tuple(
            1 if all(s.strides and s.strides[d] == 1 for s in specs) else None for d in range(ndim)
        ),
        base_align=min(s.base_align for s in specs),
        shape_divisible_by=per_dim("shape_divisible_by"),
        stride_divisible_by=per_dim("stride_divisible_by"),
        may_alias_internally=any(s.may_alias_internally for s in specs),
    )
    return ListSpec(element)


def _spec_of(value: object, param: _Param | None, label: str) -> ParamSpec:
    if param is not None and param.constant:
        if isinstance(value, DeviceArray | list | tuple) or not isinstance(
            value, bool | int | float | np.bool_ | np.integer | np.floating
        ):
            raise KernelArgumentError(
                f"{label}: a ct.Constant parameter takes a bool, int or float, got {type(value).__name__}"
            )
        return ConstantSpec(value)
    if type(value) is DeviceArray:
        return _array_spec(value, label)
    if isinstance(value, list):
        return _list_spec(value, label)
    if isinstance(value, tuple):
        return TupleSpec([_spec_of(v, None, f"{label}[{j}]") for j, v in enumerate(value)])  # type: ignore[misc]
    dtype = _scalar_dtype(value, param.declared if param is not None else None, label)
    _check_scalar(value, dtype, label)
    return ScalarSpec(dtype)


@final
class _Recipe:
    """What launches with one quick key share: the specialisation kernel."""

    __slots__ = ("fast", "kernel", "spec")

    def __init__(self, kernel: Kernel, spec: TileSpecialisation) -> None:
        self.kernel = kernel
        self.spec = spec
        self.fast: FastTileLauncher | None = None


def _quick_key(value: object) -> object:
    t = type(value)
    if t is DeviceArray:
        a: DeviceArray = value  # type: ignore[assignment]
        return (a.dtype, a.shape, a.order, a.ptr & (_ALIGN_CAP - 1))
    if t is list:
        return ("l", *(_quick_key(v) for v in value))  # type: ignore[attr-defined]
    if t is tuple:
        return ("t", *(_quick_key(v) for v in value))  # type: ignore[attr-defined]
    if t is int:
        return (t, -(2**31) <= value < 2**31)  # type: ignore[operator]
    if t is float or t is bool:
        return t
    if isinstance(value, np.generic):
        return (t, value.dtype)
    return None  # anything else: the full path says what is wrong


def _flatten(
    value: object,
    spec: ParamSpec,
    mode: _access.ParamAccess,
    label: str,
    leaves: list[tuple[str, DeviceArray, bool]],
    packed: list[object],
) -> None:
    """Collect ``value``'s arrays (label, array, written) and its packed values."""
    if isinstance(spec, ArraySpec):
        arr: DeviceArray = value  # type: ignore[assignment]
        written = mode in ("write", "read_write")
        leaves.append((label, arr, written))
        packed.append(arr.ptr)
        packed.extend(arr.shape)
        packed.extend(_strides(arr))
    elif isinstance(spec, ListSpec):
        items: list[DeviceArray] = value  # type: ignore[assignment]
        written = mode in ("write", "read_write")
        for j, item in enumerate(items):
            leaves.append((f"{label}[{j}]", item, written))
        packed.append(0)  # the descriptor buffer: the simulator has no use for it
        packed.append(len(items))
    elif isinstance(spec, ScalarSpec):
        packed.append(value)
    elif isinstance(spec, TupleSpec):
        assert isinstance(value, tuple)
        assert isinstance(mode, tuple)
        for j, (v, s, m) in enumerate(zip(value, spec.items, mode, strict=True)):
            _flatten(v, s, m, f"{label}[{j}]", leaves, packed)


def _check_aliasing(name: str, leaves: Sequence[tuple[str, DeviceArray, bool]]) -> None:
    n = len(leaves)
    for i in range(n):
        la, a, wa = leaves[i]
        a0 = a.ptr
        a1 = a0 + a.nbytes
        for j in range(i + 1, n):
            lb, b, wb = leaves[j]
            if not (wa or wb):
                continue
            b0 = b.ptr
            if a0 < b0 + b.nbytes and b0 < a1 and a.scope is b.scope and a.nbytes and b.nbytes:
                which = la if wa else lb
                raise KernelArgumentError(
                    f"{name}: {la} and {lb} overlap in memory and the kernel writes {which}; a tile "
                    "kernel is compiled for arguments that do not alias: pass arrays that do not overlap "
                    "(or a copy of one)"
                )


def launch(kernel: Kernel, args: tuple[object, ...], grid: object, pdl: bool) -> KernelLaunch:
    """A launch of tile kernel ``kernel`` (``Kernel.launch``): from the fast
    path of a recent recipe when one matches, else from the checked path."""
    tk: TileKernel = kernel.tile
    config = cached_config(grid, 1, 0, None, False, pdl)
    for fast in tk._fast:
        made = fast(args, config)
        if made is not None:
            return made
    return _launch_checked(tk, args, config)


def _recipe_args(
    args: Sequence[object], specs: Sequence[ParamSpec], modes: Sequence[Any]
) -> list[TileArg] | None:
    """The fast path's description of these arguments, or None (lists and tuples)."""
    out: list[TileArg] = []
    for value, spec, mode in zip(args, specs, modes, strict=True):
        if isinstance(spec, ConstantSpec):
            out.append(TileArg("constant", value=value))
        elif isinstance(spec, ArraySpec):
            arr: DeviceArray = value  # type: ignore[assignment]
            access = Access.WRITE if mode in ("write", "read_write") else Access.READ
            out.append(
                TileArg(
                    "array",
                    dtype=arr.dtype,
                    shape=arr.shape,
                    order=arr.order,
                    align=arr.ptr & (_ALIGN_CAP - 1),
                    access=access,
                    packed=(*arr.shape, *_strides(arr)),
                )
            )
        elif isinstance(spec, ScalarSpec):
            t = type(value)
            if t is int:  # (an int's recipe depends on whether it fits int32: ``_quick_key``)
                out.append(TileArg("int", fits32=-(2**31) <= value < 2**31))  # type: ignore[operator]
            elif t is float or t is bool:
                out.append(TileArg(t.__name__))
            elif isinstance(value, np.generic):
                out.append(TileArg("np", type_=t))
            else:
                return None
        else:
            return None
    return out


def _launch_checked(tk: TileKernel, args: tuple[object, ...], config: Any) -> KernelLaunch:
    """The checked launch: every error is raised here, with its argument named."""
    name = tk.name
    params = tk.params
    if len(args) != len(params):
        raise KernelArgumentError(
            f"{name}: expected {len(params)} arguments ({', '.join(p.name for p in params)}), got {len(args)}"
        )
    try:
        quick: tuple[object, ...] | None = tuple(
            _constant_key(v) if p.constant else _quick_key(v) for v, p in zip(args, params, strict=True)
        )
        hash(quick)
    except TypeError:
        quick = None
    recipe = tk._recipes.get(quick) if quick is not None else None
    if recipe is None:
        specs = tuple(
            _spec_of(v, p, f"{name}: argument {i} ({p.name})")
            for i, (v, p) in enumerate(zip(args, params, strict=True))
        )
        spec_kernel = tk.specialisation(specs)
        recipe = _Recipe(spec_kernel, spec_kernel.tile)
        if quick is not None:
            if len(tk._recipes) >= _RECIPES_MAX:
                tk._recipes.clear()
            tk._recipes[quick] = recipe
    spec = recipe.spec
    leaves: list[tuple[str, DeviceArray, bool]] = []
    packed: list[object] = []
    for i, (value, pspec, mode, p) in enumerate(zip(args, spec.params, spec.modes, params, strict=True)):
        label = f"argument {i} ({p.name})"
        if isinstance(pspec, ScalarSpec):
            packed.append(_check_scalar(value, pspec.dtype, f"{name}: {label}"))
            continue
        _flatten(value, pspec, mode, label, leaves, packed)
    for label, arr, written in leaves:
        _check_array(arr, f"{name}: {label}")
        if written and arr.readonly:
            raise KernelArgumentError(
                f"{name}: {label}: the kernel writes it (its stores or atomics), got a read-only array "
                "(declare access={...: 'read'} on from_tile if it does not)"
            )
    if len(leaves) > 1:
        _check_aliasing(name, leaves)
    if spec.packer is not None:
        try:
            arena = spec.packer.pack(*packed)
        except (struct.error, OverflowError) as exc:
            raise KernelArgumentError(f"{name}: arguments: {exc}") from None
    else:  # pragma: no cover - every tile dtype has a struct code
        arena = _pack_slow(spec, packed)
    accesses = _merge_accesses([(arr, Access.WRITE if w else Access.READ) for _, arr, w in leaves])
    outputs = [arr for _, arr, w in leaves if w]
    prepared = PreparedLaunch(recipe.kernel, config, spec.plan, arena, None, args)
    made = KernelLaunch._create(prepared, accesses, outputs)
    if recipe.fast is None and spec.packer is not None:
        described = _recipe_args(args, spec.params, spec.modes)
        if described is not None:
            recipe.fast = compile_tile_fast(recipe.kernel, spec.plan, spec.packer, described)
    if recipe.fast is not None:
        fast = tk._fast
        if not fast or fast[0] is not recipe.fast:
            tk._fast = (recipe.fast, *(f for f in fast if f is not recipe.fast))[:_FAST_MAX]
    return made


def _pack_slow(spec: TileSpecialisation, packed: Sequence[object]) -> bytes:
    out = bytearray(spec.size)
    for slot, value in zip(spec.slots, packed, strict=True):
        raw = np.asarray(value, dtype=slot.dtype).tobytes()
        out[slot.offset : slot.offset + len(raw)] = raw
    return bytes(out)


# --------------------------------------------------------------------------- registration


@final
class _Support:
    """The tile support the core calls (``_core._kernel.TileSupport``)."""

    def make_kernel(
        self, fn: object, *, access: object, arch: object, cache: object, reference: Reference
    ) -> Kernel:
        ct = _ct()
        pyfunc = _pyfunc(ct, fn)
        if arch is not None:
            TileSignature((), arch)  # type: ignore[arg-type]  # checks the spelling
        params = _params_of(ct, pyfunc)
        # cuTile's front end (the access analysis) imports its compiler modules and
        # self-tests once per process (about 1 s): here, where kernels are made
        # (usually at import), rather than in the first launch, on the event loop
        _access.warm_up()
        tk = TileKernel(fn, pyfunc, params, _check_access(access, params), arch, _check_cache(cache))  # type: ignore[arg-type]
        k = Kernel(name=tk.name, params=(), image_kind="tile", reference=reference, tile=tk)
        tk.kernel = k
        return k

    def launch(self, kernel: Kernel, args: tuple[object, ...], grid: object, pdl: bool) -> KernelLaunch:
        return launch(kernel, args, grid, pdl)


def install() -> None:
    """Register the tile support with the core (``trio_cuda`` does, on import)."""
    register_tile_support(_Support())
