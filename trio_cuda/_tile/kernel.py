"""Tile kernels as trio_cuda kernels: ``Kernel.from_tile``, their typed launch,
and their specialisations.

A ``@ct.kernel`` function becomes a :class:`~trio_cuda.Kernel` whose ``tile``
is a :class:`TileKernel`. Each launch reads a :class:`~.signature.TileSignature`
from its arguments (without the arch) and finds, or makes, the specialisation
kernel for it: a :class:`~trio_cuda.Kernel` whose ``tile`` is a
:class:`TileSpecialisation`, which knows its parameter layout, its packer and
what the kernel does to each array (:func:`.access.analyze`, then the
declared ``access=``). Launches name the specialisation kernel, so a scope
loads each specialisation once, as it loads any kernel.

Invariants:

* ``launch`` checks everything before it returns (arity, each argument's
  kind, dtype and usability, constants, scalar ranges, the grid, arrays whose
  memory overlaps with one written); nothing is compiled, enqueued or
  retained by it. A compile happens in :meth:`TileSpecialisation.prepare`,
  which the scope runs in a worker thread (``run``, ``load``, ``capture``);
  a backend that loads a specialisation not yet prepared prepares it on the
  calling thread and logs one warning per specialisation saying so.
* A specialisation is made once per signature (under a lock) and compiles
  once per arch (``compile.compile_tile``'s per-key lock and memory).
* Leases: an array the kernel writes (stores, scatters, atomics) takes an
  exclusive lease and is the launch's output; one it only reads, or never
  touches, a shared one. Where the analysis cannot answer, every array is
  written. A declared ``access=`` mode replaces the derived one.
* Two arguments (arrays, list elements, tuple items) whose bytes overlap,
  one of them written, are refused with a :class:`KernelArgumentError` naming
  both: cuTile compiles every array as not aliasing another.
* A list of arrays is passed as a pointer to a descriptor buffer in device
  memory (:meth:`TileSpecialisation.list_descriptors`); the arena packs 0
  there and the cuda backend fills in a buffer of its own, the simulator
  needs none.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import struct
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, final

import numpy as np

from .._core._arena import ParamPlan, _code
from .._core._array import DeviceArray
from .._core._kernel import Kernel
from .._core._launch import ArgView, PreparedLaunch
from .._core._ops import Access
from .._core._tilefast import FastTileLauncher
from . import access as _access
from .cache import TileCache, access_key, kernel_digest
from .signature import (
    ArraySpec,
    ConstantSpec,
    ListSpec,
    ParamSpec,
    ScalarSpec,
    TileSignature,
    TupleSpec,
    param_layout,
)

__all__ = ["TileKernel", "TileSpecialisation"]

logger = logging.getLogger("trio_cuda")

_INSTALL: Final = "pip install 'trio_cuda[tile]'"
#: the arch the simulator compiles for, unless the kernel names one
SIM_ARCH: Final = "sm_90"
#: alignment a base address is described with (cuTile gains nothing past 16)
_ALIGN_CAP: Final = 16
#: launch recipes kept per kernel (by the arguments' quick key)
_RECIPES_MAX: Final = 1024
#: recipes whose fast paths a launch tries before the checked path
_FAST_MAX: Final = 4
_MODES: Final = ("read", "write", "read_write", "none")
_SIM_COMPILE_ENV: Final = "TRIO_CUDA_SIM_COMPILE"


def _ct() -> Any:
    from .compile import _import_tile

    return _import_tile()


def _sim_compile_enabled() -> bool:
    return os.environ.get(_SIM_COMPILE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# --------------------------------------------------------------------------- parameters


@final
class _Param:
    """One parameter of the kernel's Python function."""

    __slots__ = ("constant", "declared", "name")

    def __init__(self, name: str, constant: bool, declared: np.dtype[Any] | None) -> None:
        self.name = name
        self.constant = constant
        self.declared = declared


def _annotation_facts(ct: Any, annotation: Any) -> tuple[bool, np.dtype[Any] | None]:
    """(is a ``ct.Constant``, the scalar dtype it declares or None)."""
    if annotation is ct.Constant:
        return True, None
    meta = getattr(annotation, "__metadata__", ())
    if any(isinstance(m, ct.ConstantAnnotation) for m in meta):
        return True, None
    for m in meta:
        dtype = getattr(m, "dtype", None)
        if isinstance(dtype, ct.DType):
            try:
                return False, np.dtype(str(dtype.name).rstrip("_"))
            except TypeError:  # a dtype NumPy lacks (bfloat16, tf32...): read from the value
                return False, None
    return False, None


def _params_of(ct: Any, fn: types.FunctionType) -> tuple[_Param, ...]:
    import typing

    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # unresolvable annotations: read them as written
        hints = dict(getattr(fn, "__annotations__", {}))
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise TypeError(f"fn: a tile kernel takes positional parameters only, {fn.__name__} has {p}")
        constant, declared = _annotation_facts(ct, hints.get(p.name))
        out.append(_Param(p.name, constant, declared))
    return tuple(out)


def _check_access(access: object, params: Sequence[_Param]) -> dict[str, str]:
    if access is None:
        return {}
    if not isinstance(access, Mapping):
        raise TypeError(
            f"access: expected a mapping of parameter names to 'read', 'write', 'read_write' or 'none', "
            f"got {type(access).__name__}"
        )
    names = [p.name for p in params]
    out: dict[str, str] = {}
    for key, mode in access.items():
        if key not in names:
            raise ValueError(
                f"access: {key!r} is not a parameter of the kernel (its parameters: {', '.join(names)})"
            )
        if mode not in _MODES:
            raise ValueError(
                f"access[{key!r}]: expected 'read', 'write', 'read_write' or 'none', got {mode!r}"
            )
        if next(p for p in params if p.name == key).constant:
            raise ValueError(f"access[{key!r}]: {key} is a ct.Constant parameter, which is not memory")
        out[key] = mode
    return out


def _check_cache(cache: object) -> TileCache | Literal["default"] | None:
    """``"default"`` stays so: :meth:`TileKernel.disk_cache` reads the
    environment at each compile (a program may set it after making kernels)."""
    if cache is None:
        return None
    if isinstance(cache, str) and cache == "default":
        return "default"
    if isinstance(cache, TileCache):
        return cache
    if isinstance(cache, str | os.PathLike):
        return TileCache(Path(cache))
    raise TypeError(f"cache: expected 'default', a directory, a TileCache or None, got {cache!r}")


# --------------------------------------------------------------------------- the kernel


@final
class TileKernel:
    """The ``tile`` of a :meth:`Kernel.from_tile` kernel: the ``@ct.kernel``,
    its parameters, the declared access modes, the arch and the cache, and its
    specialisations by signature."""

    kind: Final = "kernel"
    #: (never launched itself: its specialisations are)
    per_launch_check: Final = True

    def __init__(
        self,
        fn: Any,
        pyfunc: types.FunctionType,
        params: tuple[_Param, ...],
        access: dict[str, str],
        arch: str | None,
        cache: TileCache | Literal["default"] | None,
    ) -> None:
        self.fn = fn
        self.pyfunc = pyfunc
        self.params = params
        self.access = access
        self.arch = arch
        self.cache = cache
        self.name = pyfunc.__name__
        self.digest = kernel_digest(fn)
        self._lock = threading.Lock()
        self._specs: dict[tuple[object, ...], Kernel] = {}  # by _exact(params)
        self._recipes: dict[tuple[object, ...], Any] = {}  # quick key -> launching._Recipe
        #: the fast paths of the most recently used recipes, newest first
        self._fast: tuple[FastTileLauncher, ...] = ()
        #: the user-facing Kernel (set by make_kernel)
        self.kernel: Kernel | None = None

    def __repr__(self) -> str:
        where = f"{self.pyfunc.__module__}.{self.pyfunc.__qualname__}"
        return f"<tile kernel {where}, {len(self._specs)} specialisations>"

    # A kernel pickles as its definition (Kernel.__getstate__). A @ct.kernel
    # object does not pickle, so the function goes by reference (module and
    # qualified name, as pickle sends functions); the user-facing Kernel goes
    # along (pickle's memo resolves the cycle), so that reference= still
    # reaches the specialisations made after unpickling.
    def __getstate__(self) -> dict[str, object]:
        return {
            "fn": _kernel_ref(self.fn, self.pyfunc),
            "access": self.access,
            "arch": self.arch,
            "cache": self.cache,
            "kernel": self.kernel,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        ct = _ct()
        fn = state["fn"]
        if isinstance(fn, tuple):
            fn = _resolve_kernel_ref(*fn)
        pyfunc = _pyfunc(ct, fn)
        self.__init__(fn, pyfunc, _params_of(ct, pyfunc), state["access"], state["arch"], state["cache"])
        self.kernel = state.get("kernel")

    def disk_cache(self) -> TileCache | None:
        """The cache compiles use: the one given, or the default one now."""
        cache = self.cache
        return TileCache.default() if cache == "default" else cache

    def specialisation(self, params: tuple[ParamSpec, ...]) -> Kernel:
        """The specialisation kernel of ``params`` (made once)."""
        key = _exact(params)
        with self._lock:
            found = self._specs.get(key)
        if found is not None:
            return found
        spec = TileSpecialisation(self, params)  # the analysis runs here, outside the lock
        reference = self.kernel.reference if self.kernel is not None else None
        made = Kernel(name=self.name, params=(), image_kind="tile", reference=reference, tile=spec)
        # the kernel's own plan is the signature's layout, so that backends
        # treat its launches as typed ones (the cuda backend's first-launch path)
        made._plan = spec.plan
        with self._lock:
            return self._specs.setdefault(key, made)

    def specialisations(self) -> tuple[Kernel, ...]:
        """The specialisation kernels made so far."""
        with self._lock:
            return tuple(self._specs.values())


def _exact(params: tuple[ParamSpec, ...]) -> tuple[object, ...]:
    """``params`` as a key that tells apart constants Python calls equal: 1,
    True and 1.0, 0.0 and -0.0 (``ConstantSpec`` compares by ``==``, cuTile
    types and folds them apart). Tuple items are never constants."""
    return tuple(_constant_key(p.value) if isinstance(p, ConstantSpec) else p for p in params)


def _constant_key(value: object) -> tuple[object, ...]:
    # the type tells 1, True and 1.0 apart; repr a float's sign (-0.0)
    return ("c", type(value), repr(value) if isinstance(value, float | np.floating) else value)


def _kernel_ref(fn: object, pyfunc: types.FunctionType) -> tuple[str, str]:
    """(module, qualified name) of a @ct.kernel that unpickling can import."""
    module, qualname = pyfunc.__module__, pyfunc.__qualname__
    try:
        found = _resolve_kernel_ref(module, qualname)
    except (ImportError, AttributeError):
        found = None
    if found is not fn:
        raise TypeError(
            f"tile kernel {module}.{qualname}: a tile kernel pickles by reference to its @ct.kernel "
            "function, which must be importable at module level by that name"
        )
    return (module, qualname)


def _resolve_kernel_ref(module: str, qualname: str) -> object:
    import importlib

    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _pyfunc(ct: Any, fn: object) -> types.FunctionType:
    if not isinstance(fn, ct.kernel):
        raise TypeError(f"fn: expected a @cuda.tile.kernel function, got {fn!r}")
    from .cache import pyfunc

    return pyfunc(fn)


# --------------------------------------------------------------------------- specialisations


def _access_params(params: Sequence[ParamSpec]) -> list[_access.ParamSpec]:
    def one(p: ParamSpec) -> _access.ParamSpec:
        if isinstance(p, ArraySpec):
            return _access.ArrayParam(_ct_name(p.dtype), p.ndim)
        if isinstance(p, ListSpec):
            return _access.ListParam(_ct_name(p.element.dtype), p.element.ndim)
        if isinstance(p, ScalarSpec):
            return _access.ScalarParam(_ct_name(p.dtype))
        if isinstance(p, ConstantSpec):
            return _access.ConstantParam(p.value)
        return _access.TupleParam([one(i) for i in p.items])

    return [one(p) for p in params]


def _ct_name(dtype: np.dtype[Any]) -> str:
    return "bool_" if dtype.kind == "b" else dtype.name


def _override(mode: _access.ParamAccess, declared: str) -> _access.ParamAccess:
    """``declared`` for every array leaf of ``mode``."""
    if isinstance(mode, tuple):
        return tuple(_override(m, declared) for m in mode)
    return mode if mode in ("scalar", "constant") else declared  # type: ignore[return-value]


def _access_plan(
    owner: TileKernel, params: tuple[ParamSpec, ...]
) -> tuple[tuple[_access.ParamAccess, ...], bool, str | None]:
    """(modes, exact, reason) of the kernel for ``params``: from the disk
    cache where it holds the plan, else from :func:`.access.analyze` (an
    exact plan is then stored there)."""
    aparams = _access_params(params)
    cache = owner.disk_cache()
    key = None
    if cache is not None:
        from .compile import _cutile_version

        key = access_key(owner.fn, json.dumps([repr(p) for p in aparams]), cutile_version=_cutile_version())
        stored = cache.load_plan(key)
        if stored is not None and len(stored) == len(params):
            return stored, True, None  # type: ignore[return-value]
    plan = _access.analyze(owner.fn, aparams)
    if plan.exact and cache is not None and key is not None:
        cache.store_plan(key, plan.modes)
    if not plan.exact:
        logger.warning(
            "tile kernel %r: the access analysis could not answer (%s), so every array it takes is "
            "leased as written; access={...} on Kernel.from_tile declares the real modes",
            owner.name,
            plan.reason,
        )
    return plan.modes, plan.exact, plan.reason


@final
class TileSpecialisation:
    """The ``tile`` of one specialisation kernel: its signature's parameter
    specs, what it does to each parameter (``modes``, a
    :class:`.access.AccessPlan`'s with the declared overrides applied), the
    parameter layout and packer, and its compiled images by arch."""

    kind: Final = "specialisation"

    def __init__(self, owner: TileKernel, params: tuple[ParamSpec, ...]) -> None:
        self.owner = owner
        self.params = params
        derived, self.exact, self.reason = _access_plan(owner, params)
        modes = list(derived)
        for i, p in enumerate(owner.params):
            declared = owner.access.get(p.name)
            if declared is not None:
                modes[i] = _override(modes[i], declared)
        self.modes: tuple[_access.ParamAccess, ...] = tuple(modes)
        layout, size = param_layout(TileSignature(params, SIM_ARCH))  # type: ignore[arg-type]
        self.layout = layout
        self.size = size
        slots = [s for pl in layout for s in pl.slots]
        self.plan = ParamPlan.from_layout([(s.size, s.dtype.alignment) for s in slots])
        codes = [_code(s.dtype) for s in slots]
        self.packer: struct.Struct | None = None
        if all(c is not None for c in codes):
            fmt, offset = "=", 0
            for s, c in zip(slots, codes, strict=True):
                fmt += "x" * (s.offset - offset) + str(c)
                offset = s.offset + s.size
            fmt += "x" * (size - offset)
            self.packer = struct.Struct(fmt)
        self.slots = tuple(slots)
        self.has_list = any(s.kind == "list_pointer" for s in slots)
        #: a backend's check of a launch prepares its list arguments: it runs per launch
        self.per_launch_check = self.has_list
        self._lock = threading.Lock()
        self._images: dict[str, Any] = {}
        self._checked: set[str] = set()  # the simulator's archs: compiled or skipped
        self._warned = False

    def __repr__(self) -> str:
        return f"<specialisation of {self.owner.name}: {len(self.slots)} parameter slots, {self.size} B>"

    # -------------------------------------------------------------- compiling

    def arch_for(self, backend: str, cc: tuple[int, int]) -> str:
        """The arch a device of ``backend`` and compute capability ``cc`` runs."""
        if self.owner.arch is not None:
            return self.owner.arch
        if backend == "sim" or cc == (0, 0):
            return SIM_ARCH
        return f"sm_{cc[0]}{cc[1]}"

    def ready(self, backend: str, cc: tuple[int, int]) -> bool:
        arch = self.arch_for(backend, cc)
        if backend == "sim":
            return arch in self._checked or not _sim_compile_enabled()
        return arch in self._images

    def prepare(self, backend: str, cc: tuple[int, int]) -> None:
        """Compile (or load from the cache) the image for ``backend``'s arch.
        On the simulator, only where the toolchain (or the cache's entry) is
        there: otherwise one log warning per process, and the kernel runs
        unchecked."""
        arch = self.arch_for(backend, cc)
        if backend == "sim":
            if arch in self._checked or not _sim_compile_enabled():
                return
            from .compile import TileToolchainError

            try:
                self.image(arch)
            except TileToolchainError as exc:
                _warn_sim_unchecked(self.owner.name, exc.reason)
            self._checked.add(arch)
            return
        self.image(arch)

    def image(self, arch: str) -> Any:
        """The :class:`~.compile.TileImage` for ``arch`` (compiling it, blocking)."""
        found = self._images.get(arch)
        if found is not None:
            return found
        from .compile import compile_tile

        signature = TileSignature(self.params, arch)  # type: ignore[arg-type]
        made = compile_tile(self.owner.fn, signature, cache=self.owner.disk_cache())
        with self._lock:
            return self._images.setdefault(arch, made)

    def _warn_calling_thread(self, backend: str, cc: tuple[int, int]) -> None:
        """Once per specialisation: a backend is about to compile it on the
        calling thread (the event loop's, when ``submit`` loaded it first)."""
        if self._warned or self.ready(backend, cc):
            return
        self._warned = True
        logger.warning(
            "tile kernel %r: compiling a specialisation on the calling thread (submit() or a "
            "then-chain loaded it first); await gpu.load(launch) or gpu.run(launch) compile it in a "
            "worker thread",
            self.owner.name,
        )

    def prepare_here(self, backend: str, cc: tuple[int, int]) -> None:
        """:meth:`prepare` on the calling thread (a backend's load), saying so
        once where it compiles."""
        self._warn_calling_thread(backend, cc)
        self.prepare(backend, cc)

    def cubin(self, backend: str, cc: tuple[int, int]) -> tuple[bytes, str]:
        """The cubin and kernel symbol for a device (the cuda backend's load).
        Compiles on the calling thread when not prepared, saying so once."""
        self._warn_calling_thread(backend, cc)
        img = self.image(self.arch_for(backend, cc))
        return img.cubin, img.symbol

    # -------------------------------------------------------------- launches

    def slot_labels(self) -> list[str]:
        """A label per parameter slot, for errors: ``argument 0 (a) shape[1]``."""
        names = self.owner.params
        out = []
        for pl in self.layout:
            base = f"argument {pl.index} ({names[pl.index].name})"
            for slot in pl.slots:
                path = "".join(f"[{j}]" for j in slot.path)
                what = {
                    "pointer": "pointer",
                    "shape": f"shape[{slot.dim}]",
                    "stride": f"stride[{slot.dim}]",
                    "scalar": "value",
                    "list_pointer": "list descriptors",
                    "list_length": "list length",
                }[slot.kind]
                out.append(f"{base}{path} {what}")
        return out

    def list_descriptors(self, prepared: PreparedLaunch) -> list[tuple[int, bytes]]:
        """For each list argument of ``prepared`` (in slot order): the offset
        of its pointer slot in the arena, and the descriptor buffer the
        pointer must address in device memory (per element, 64-bit words: the
        element's address, its shape, its strides in elements)."""
        found: list[bytes] = []

        def walk(value: object, spec: ParamSpec) -> None:
            if isinstance(spec, ListSpec):
                assert isinstance(value, list)
                words: list[int] = []
                for arr in value:
                    words.append(arr.ptr)
                    words.extend(arr.shape)
                    words.extend(_strides(arr))
                found.append(np.array(words, dtype=np.uint64).tobytes())
            elif isinstance(spec, TupleSpec):
                assert isinstance(value, tuple)
                for v, s in zip(value, spec.items, strict=True):
                    walk(v, s)

        for value, spec in zip(prepared.values, self.params, strict=True):
            walk(value, spec)
        offsets = [slot.offset for slot in self.slots if slot.kind == "list_pointer"]
        return list(zip(offsets, found, strict=True))

    def views(self, prepared: PreparedLaunch) -> tuple[ArgView, ...]:
        """One view per array (list elements and tuple items included) and
        scalar of ``prepared``, in the kernel's argument order; constants
        have none."""
        out: list[ArgView] = []

        def walk(value: object, spec: ParamSpec, mode: _access.ParamAccess) -> None:
            if isinstance(spec, ArraySpec):
                assert isinstance(value, DeviceArray)
                out.append(_array_view(value, mode))
            elif isinstance(spec, ListSpec):
                assert isinstance(value, list)
                for item in value:
                    out.append(_array_view(item, mode))
            elif isinstance(spec, ScalarSpec):
                out.append(ArgView("scalar", dtype=spec.dtype, value=spec.dtype.type(value)))
            elif isinstance(spec, TupleSpec):
                assert isinstance(value, tuple)
                assert isinstance(mode, tuple)
                for v, s, m in zip(value, spec.items, mode, strict=True):
                    walk(v, s, m)

        for value, spec, mode in zip(prepared.values, self.params, self.modes, strict=True):
            walk(value, spec, mode)
        return tuple(out)

    def run_on_cpu(self, prepared: PreparedLaunch, flat: Sequence[object]) -> None:
        """Run ``prepared`` on the simulator: ``flat`` has one item per view
        (arrays as bounds-checked NumPy views, scalars as NumPy scalars); the
        kernel's ``reference=`` gets them regrouped per parameter, otherwise
        the kernel runs on NumPy tiles (:func:`.emulate.run_tile_kernel`)."""
        items = iter(flat)

        def rebuild(value: object, spec: ParamSpec) -> object:
            if isinstance(spec, ArraySpec | ScalarSpec):
                return next(items)
            if isinstance(spec, ListSpec):
                assert isinstance(value, list)
                return [next(items) for _ in value]
            if isinstance(spec, TupleSpec):
                assert isinstance(value, tuple)
                return tuple(rebuild(v, s) for v, s in zip(value, spec.items, strict=True))
            return value  # a constant

        args = [rebuild(v, s) for v, s in zip(prepared.values, self.params, strict=True)]
        reference = self.owner.kernel.reference if self.owner.kernel is not None else None
        if callable(reference):
            reference(*args)
            return
        from .emulate import run_tile_kernel

        run_tile_kernel(self.owner.fn, prepared.config.grid, args)


def _array_view(arr: DeviceArray, mode: object) -> ArgView:
    access = Access.READ if mode in ("read", "none") else Access.WRITE
    return ArgView("array", arr.ptr, arr.shape, arr.dtype, access=access, order=arr.order)


_warned_sim = False
_warn_lock = threading.Lock()


def _warn_sim_unchecked(name: str, reason: str) -> None:
    global _warned_sim
    with _warn_lock:
        if _warned_sim:
            return
        _warned_sim = True
    logger.warning(
        "the simulator runs tile kernel %r without compiling it (%s), so a kernel that does not "
        "compile goes unnoticed until it runs on a GPU; %s installs the tile toolchain (%s=0 turns "
        "the check off); this is said once per process",
        name,
        reason,
        _INSTALL,
        _SIM_COMPILE_ENV,
    )


# --------------------------------------------------------------------------- shared with launching


def _strides(arr: DeviceArray) -> tuple[int, ...]:
    item = arr.itemsize
    return tuple(s // item for s in arr.strides)
