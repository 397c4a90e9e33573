"""Kernels and their typed launch.

Invariants:

* A :class:`Kernel` is device-independent; each scope loads it at most once.
  Its arena plan and its fast path (generated for its parameter list) are
  built once, when it is made.
* ``Kernel.launch`` checks everything (arity, dtypes, scalar ranges, access
  modes, closed or read-only arrays, the launch configuration as far as it
  needs no device, see ``_config.make_config``) before it returns a
  :class:`KernelLaunch`; a launch that fails these checks never reaches a stream.
* The fast path (:func:`_compile_fast`) either returns the launch the checked
  path would build, or None; then the checked path runs, and raises the
  precise error.
* ``reference`` is a callable, :data:`NO_REFERENCE` (no CPU behaviour, on
  purpose) or None (not given); anything else is refused when the kernel is
  made. What a backend does without one is the backend's business (the
  simulator refuses to load such a kernel).
* A kernel's repr never prints its source or image, only their size and hash.
* A tile kernel (``image_kind == "tile"``, :meth:`Kernel.from_tile`) carries
  its tile code as ``tile``, an object of the tile support that
  ``trio_cuda._tile`` registers (:func:`register_tile_support`); the core only
  calls the :class:`TileSupport` and :class:`TileCode` methods below on it,
  never imports it. A user's tile kernel makes one specialisation kernel per
  argument signature, and launches name that kernel; both have no ``params``
  (the signature is read from the arguments).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Literal, Protocol, TypeAlias

import attrs
import numpy as np

from . import _compiled, _config, _fastgen
from ._arena import (
    _K_ARRAY,
    _K_FLOAT,
    _K_INT,
    _K_SLICE,
    _POINTER,
    ParamPlan,
    _code,
    _fast_packer,
    _pack,
    _scalar_bytes,
    _slots_for,
)
from ._array import DeviceArray
from ._builder import LaunchBuilder
from ._config import LaunchConfig, cached_config
from ._errors import KernelArgumentError
from ._final import final
from ._launch import ArgView, KernelLaunch, PreparedLaunch, _merge_accesses
from ._ops import Access, DeviceOp, _Map, _Shared, _Then, _Zip
from ._params import In, InOut, Out, Param, Scalar, Slice, _check_array, _convert_scalar, _param_label

__all__ = [
    "NO_REFERENCE",
    "Kernel",
    "NoReference",
    "Reference",
    "TileCode",
    "TileSupport",
    "register_tile_support",
    "signature",
    "static_launches",
]

#: a kernel's generated fast path, ``fast(args, config)`` (see :func:`_compile_fast`)
FastLauncher = Callable[[tuple[object, ...], LaunchConfig], "KernelLaunch | None"]


class NoReference(enum.Enum):
    """``reference=trio_cuda.NO_REFERENCE`` says that a kernel has no CPU
    behaviour on purpose: the simulator runs it as a no-op (it still takes its
    leases and its simulated time) instead of refusing it with
    :class:`~trio_cuda.MissingReferenceError`. On a GPU it changes nothing.
    (``NoReference`` is its type, an enum of this one member.)"""

    NO_REFERENCE = "NO_REFERENCE"

    def __repr__(self) -> str:
        return "trio_cuda.NO_REFERENCE"


#: a kernel's ``reference=`` that says "no CPU behaviour, on purpose" (see :class:`NoReference`)
NO_REFERENCE: Final = NoReference.NO_REFERENCE

#: what ``reference=`` accepts: a function run on NumPy views, :data:`NO_REFERENCE`, or None
Reference: TypeAlias = "Callable[..., object] | Literal[NoReference.NO_REFERENCE] | None"


def _check_reference(reference: object) -> Reference:
    if reference is None or reference is NO_REFERENCE or callable(reference):
        return reference
    raise TypeError(
        "reference: expected a function of one argument per kernel parameter (run on NumPy views), "
        f"trio_cuda.NO_REFERENCE or None, got {type(reference).__name__}"
    )


class TileSupport(Protocol):
    """What ``trio_cuda._tile`` provides for tile kernels (registered with
    :func:`register_tile_support`; the core never imports it)."""

    def make_kernel(
        self, fn: object, *, access: object, arch: object, cache: object, reference: Reference
    ) -> Kernel:
        """The :class:`Kernel` of a ``@ct.kernel`` function (``TypeError`` for anything else)."""
        ...

    def launch(self, kernel: Kernel, args: tuple[object, ...], grid: object, pdl: bool) -> KernelLaunch:
        """A checked launch of the tile kernel ``kernel``."""
        ...


class TileCode(Protocol):
    """The ``tile`` of a tile kernel, as backends and the scope use it: of the
    user's kernel (``kind == "kernel"``, which is never loaded) or of one of
    its specialisations (``kind == "specialisation"``)."""

    @property
    def kind(self) -> Literal["kernel", "specialisation"]: ...

    @property
    def per_launch_check(self) -> bool:
        """Whether a backend's check of a launch of it depends on the launch
        itself (a specialisation with list arguments prepares them there),
        so the scope checks each launch rather than each launch shape."""
        ...

    def ready(self, backend: str, cc: tuple[int, int]) -> bool:
        """Whether :meth:`prepare` has nothing left to do (no compile needed)."""
        ...

    def prepare(self, backend: str, cc: tuple[int, int]) -> None:
        """Compile (or find in a cache) what a device of ``backend`` and
        compute capability ``cc`` needs; blocking, thread-safe, once per arch."""
        ...


_tile_support: TileSupport | None = None


def register_tile_support(support: TileSupport) -> None:
    """Install the tile support (``trio_cuda._tile`` does, when ``trio_cuda`` is imported)."""
    global _tile_support
    _tile_support = support


def _tile() -> TileSupport:
    if _tile_support is None:  # pragma: no cover - trio_cuda's import registers it
        raise RuntimeError("tile kernels: the tile support is not registered (import trio_cuda first)")
    return _tile_support


def _short_param(param: Param) -> str:
    dt = param.dtype
    kind = f"struct of {dt.itemsize} B" if dt.fields else dt.name
    name = f"{param.name}: " if param.name else ""
    return f"{name}{type(param).__name__}({kind})"


def signature(kernel: Kernel) -> str:
    """``name(a: Scalar(float32), In(float32), ...)``: the kernel as its
    repr and its errors show it."""
    return f"{kernel.name}({', '.join(_short_param(p) for p in kernel.params)})"


def _check_params(params: Sequence[object]) -> tuple[Param, ...]:
    out = []
    for i, p in enumerate(params):
        if not isinstance(p, Scalar | In | Out | InOut | Slice):
            raise TypeError(f"params[{i}]: expected Scalar, In, Out, InOut or Slice, got {p!r}")
        out.append(p)
    return tuple(out)


#: what a pickled Kernel carries: its definition, not its caches
_KERNEL_FIELDS = ("name", "params", "source", "image", "image_kind", "options", "reference")


@final
@attrs.define(eq=False, repr=False)
class Kernel:
    """A GPU kernel with a typed parameter list.

    Use :meth:`from_source` (CUDA C++, compiled with NVRTC), :meth:`from_ptx`
    or :meth:`from_cubin`. ``reference`` is the kernel's behaviour on the CPU:
    the simulator runs it on NumPy views, and tests use it as an oracle. It
    receives one argument per kernel parameter, as the kernel sees it: an
    array as a NumPy view (read-only for ``In``), a ``Slice`` as a view
    followed by its length, a scalar as a NumPy scalar. The simulator refuses
    a kernel without one (:class:`~trio_cuda.MissingReferenceError`);
    ``reference=trio_cuda.NO_REFERENCE`` runs it there as a no-op on purpose.
    """

    #: the kernel function's name in its module (``extern "C"``, so unmangled),
    #: looked up when a scope loads it; errors, reprs and traces name it
    name: str
    #: one spec per kernel parameter, in order: :meth:`launch` takes one
    #: argument per spec (a :class:`Slice` fills two C parameters)
    params: tuple[Param, ...]
    #: the CUDA C++ source (:meth:`from_source`), else None
    source: str | None = None
    #: the PTX text, as bytes (:meth:`from_ptx`), or the cubin or fatbin image
    #: (:meth:`from_cubin`); None for a source
    image: bytes | None = None
    #: what the code is: ``"source"`` (compiled by NVRTC when a scope loads
    #: the kernel), ``"ptx"`` (compiled by the driver when it loads it) or
    #: ``"cubin"``
    image_kind: Literal["source", "ptx", "cubin", "tile"] = "source"
    #: extra NVRTC options for a source (:meth:`from_source`); unused for PTX
    #: and cubin
    options: tuple[str, ...] = ()
    #: the kernel's behaviour on the CPU, which the simulator runs: a function
    #: called with the arguments as NumPy views and scalars,
    #: :data:`~trio_cuda.NO_REFERENCE`, or None when none was given
    reference: Reference = attrs.field(default=None, converter=_check_reference)
    #: a tile kernel's code (:meth:`from_tile`): the tile support's object for
    #: the ``@ct.kernel`` function, or for one specialisation of it; None
    #: for every other kernel
    tile: Any = None
    _plan: ParamPlan = attrs.field(init=False)
    _fast: FastLauncher | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        layout: list[tuple[int, int]] = []
        for p in self.params:
            layout.extend(_slots_for(p))
        self._plan = ParamPlan.from_layout(layout)
        self._fast = _compile_fast(self)

    # A kernel pickles as its definition (to send it to another process, a Ray
    # worker's say); the packing plan and fast path are rebuilt there.
    def __getstate__(self) -> dict[str, object]:
        state = {f: getattr(self, f) for f in _KERNEL_FIELDS}
        state["tile"] = self.tile
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        for f in _KERNEL_FIELDS:
            object.__setattr__(self, f, state[f])
        object.__setattr__(self, "tile", state.get("tile"))
        self.__attrs_post_init__()

    def __repr__(self) -> str:
        if self.source is not None:
            data = self.source.encode()
            code = f"source=<{len(self.source)} chars, sha256 {hashlib.sha256(data).hexdigest()[:12]}>"
        elif self.image is not None:
            digest = hashlib.sha256(self.image).hexdigest()[:12]
            code = f"{self.image_kind}=<{len(self.image)} bytes, sha256 {digest}>"
        elif self.tile is not None:
            code = f"tile={self.tile!r}"
        else:  # pragma: no cover - every constructor gives one
            code = "no code"
        options = f", options={self.options!r}" if self.options else ""
        ref = self.reference
        if ref is None or ref is NO_REFERENCE:
            shown = repr(ref)
        else:
            shown = getattr(ref, "__qualname__", None) or type(ref).__name__
        head = self.name if self.tile is not None else signature(self)
        return f"<Kernel {head} {code}{options} reference={shown}>"

    @classmethod
    def from_source(
        cls,
        source: str,
        name: str,
        *,
        params: Sequence[Param],
        reference: Reference = None,
        options: Sequence[str] = (),
    ) -> Kernel:
        """A kernel in CUDA C++ source. ``name`` is the (``extern "C"``)
        function name; ``options`` are extra NVRTC options. ``reference`` is
        the kernel's CPU behaviour (see :class:`Kernel`).

        The source is compiled when a scope first loads the kernel: on a GPU
        for its device, and on the simulator too where NVRTC can be loaded
        without a driver, so that a compile error or a missing ``name``
        surfaces there as well (``TRIO_CUDA_SIM_COMPILE=0`` turns that off)."""
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
        reference: Reference = None,
    ) -> Kernel:
        """A kernel in PTX, loaded (JIT-compiled) by the driver. The simulator
        checks that the PTX declares an entry ``name``."""
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
        reference: Reference = None,
    ) -> Kernel:
        """A kernel in a compiled cubin (or fatbin) image."""
        return cls(
            name=name,
            params=_check_params(params),
            image=bytes(cubin),
            image_kind="cubin",
            reference=reference,
        )

    @classmethod
    def from_tile(
        cls,
        fn: object,
        *,
        access: object = None,
        arch: str | None = None,
        cache: object = "default",
        reference: Reference = None,
    ) -> Kernel:
        """A tile kernel: ``fn`` is a ``@cuda.tile.kernel`` function (cuTile
        Python; ``pip install 'trio_cuda[tile]'``). ``launch(*args, grid=...)``
        takes one argument per parameter of ``fn`` (device arrays, lists and
        tuples of them, scalars, and the values of ``ct.Constant``
        parameters) and returns a :class:`KernelLaunch` like any kernel's.

        The kernel is specialised per argument signature (dtypes, ranks, the
        layout and alignment the runtime guarantees, constants) and compiled
        to a cubin once per signature and architecture, in a worker thread
        where a scope can (``run``, ``load``, ``capture``), from the disk
        cache where it has the image. Each array's lease follows what the
        kernel does to it (its loads, stores, atomics); ``access=`` maps
        parameter names to ``"read"``, ``"write"``, ``"read_write"`` or
        ``"none"`` to override that. Arguments whose memory overlaps, one of
        them written, are refused.

        ``arch`` (``"sm_90"``...) pins the architecture compiled for (by
        default the device's; the simulator checks ``sm_90``). ``cache`` is a
        directory for compiled cubins, a ``TileCache``, ``"default"`` (see
        :doc:`tile`) or None. ``reference`` replaces the simulator's own
        execution of the kernel on NumPy tiles."""
        return _tile().make_kernel(fn, access=access, arch=arch, cache=cache, reference=reference)

    @property
    def plan(self) -> ParamPlan:
        """The arena layout of this kernel's parameters."""
        return self._plan

    def launch(
        self,
        *args: object,
        grid: object,
        block: object = None,
        shared_mem: int | None = None,
        cluster: object = None,
        cooperative: bool | None = None,
        pdl: bool = False,
    ) -> KernelLaunch:
        """Check ``args`` against the parameter list, and the geometry as far
        as it needs no device (a block of at most 1024 threads, at most 64 in
        z; a grid of at most 2**31 - 1 x 65535 x 65535 blocks; ``shared_mem``
        from 0 to 232448 bytes; a cluster of at most 16 blocks that divides
        the grid), and return an immutable, schedulable :class:`KernelLaunch`.
        Raises :class:`KernelArgumentError` naming the offending argument;
        nothing is enqueued. The device's own limits are checked when the
        launch is submitted.

        A tile kernel (:meth:`from_tile`) takes ``grid`` and ``pdl`` only: its
        block size and shared memory are compiled into it."""
        if self.tile is not None:
            if block is not None or shared_mem is not None or cluster is not None or cooperative is not None:
                given = [
                    n
                    for n, v in (
                        ("block", block),
                        ("shared_mem", shared_mem),
                        ("cluster", cluster),
                        ("cooperative", cooperative),
                    )
                    if v is not None
                ]
                raise KernelArgumentError(
                    f"{self.name}: {given[0]}: a tile kernel takes only grid= and pdl= (its block size, "
                    f"shared memory and cluster shape are compiled into it), got {', '.join(given)}"
                )
            return _tile().launch(self, args, grid, pdl)
        config = cached_config(
            grid,
            block,
            0 if shared_mem is None else shared_mem,
            cluster,
            False if cooperative is None else cooperative,
            pdl,
        )
        fast = self._fast
        if fast is not None:
            made = fast(args, config)
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
        """An inert, unchecked launch builder; see :class:`LaunchBuilder`.
        Not for tile kernels, whose parameter layout comes from their
        signature: use :meth:`launch`."""
        if self.tile is not None:
            raise TypeError(
                f"{self.name}: builder(): a tile kernel's parameters are laid out from its argument "
                "signature; use launch(*args, grid=...)"
            )
        return LaunchBuilder._create(self)


def static_launches(op: DeviceOp[Any]) -> Iterator[PreparedLaunch]:
    """The kernel launches that submitting ``op`` will enqueue, as far as they
    are known before it runs: the op itself, the parts of a ``zip``, the op
    under a ``map`` or ``shared()`` (not yet executed), and the first part of a
    ``then`` (what its closure returns is only known once it ran). A scope
    loads their kernels before it enqueues anything, so that a kernel that
    cannot be loaded fails the submission with nothing enqueued."""
    stack: list[DeviceOp[Any]] = [op]
    while stack:
        cur = stack.pop()
        if isinstance(cur, KernelLaunch):
            yield cur.prepared
        elif isinstance(cur, _Zip):
            stack.extend(reversed(cur._ops))
        elif isinstance(cur, _Then | _Map) or (isinstance(cur, _Shared) and not cur._done):
            stack.append(cur._op)


# --------------------------------------------------------------------------- fast path

#: every int of this magnitude converts to a double exactly, so NumPy and
#: ``struct`` round it to a narrower float the same way
_EXACT_INT_FLOAT = 2**53
#: with up to this many arrays, a shared allocation is found by comparing
#: pairs; with more, by a set
_PAIRWISE = 6


def _compile_fast(kernel: Kernel) -> FastLauncher | None:
    """The kernel's fast path (see :func:`_compile_fast_py`): compiled where
    the compiled paths are used (``_compiled``), else generated Python."""
    if _compiled.ext is not None:
        return _compile_fast_c(kernel)
    return _compile_fast_py(kernel)


def _compile_fast_c(kernel: Kernel) -> FastLauncher | None:
    """The compiled fast path: ``_claunch.typed``, given each parameter's
    kind, type, access, struct code and offsets in the arena; it makes what
    :func:`_compile_fast_py`'s function makes (None where that returns None).
    None where a parameter needs the general path, or nothing is compiled."""
    ext = _compiled.ext
    table, _ = _fast_packer(kernel.params, kernel._plan)
    if table is None or ext is None:
        return None
    entries: list[tuple[object, ...]] = []
    slots = iter(kernel._plan.slots)
    for param, (kind, dt, _lo, _hi, access) in zip(kernel.params, table, strict=True):
        at = next(slots).offset
        if kind == _K_SLICE:
            assert isinstance(param, Slice)
            entries.append((kind, dt, access, _code(param.len_dtype), at, next(slots).offset, None))
        elif kind == _K_ARRAY:
            entries.append((kind, dt, access, "Q", at, 0, None))
        else:
            assert isinstance(param, Scalar)
            entries.append((kind, dt, None, _code(param.dtype), at, 0, None))
    fast: FastLauncher = ext.typed(kernel, kernel._plan, kernel._plan.size, tuple(entries))
    return fast


def _compile_fast_py(kernel: Kernel) -> FastLauncher | None:
    """The kernel's fast path: a function ``fast(args, config)`` specialised
    to its parameter list, that returns the launch the checked path would
    build, or None (then the checked path raises the precise error, or
    handles the case). None when a parameter needs the general path.

    Each check is specialised to its parameter, and ``struct.Struct.pack``
    itself refuses an int (or a slice's length) out of its C type's range and
    a finite float that overflows it. The source is generated from the
    kernel's own parameter kinds only; every value in it is a name bound in
    its namespace or a constant of this module (never text from the user)."""
    table, packer = _fast_packer(kernel.params, kernel._plan)
    if table is None or packer is None:
        return None
    ns = _fastgen.namespace(kernel, kernel._plan, packer)
    ns["prod"] = math.prod
    names = [f"a{i}" for i in range(len(table))]
    body = [_fastgen.unpack(names)]
    packed: list[str] = []
    accesses: list[str] = []
    allocs: list[str] = []
    outputs: list[str] = []
    for i, (kind, dt, _lo, _hi, access) in enumerate(table):
        a = names[i]
        ns[f"dt{i}"] = dt
        if kind in (_K_ARRAY, _K_SLICE):
            m = f"m{i}"
            body.append(_fastgen.array_guard(a, m, i))
            if access is Access.WRITE:
                body.append(f"    if {a}._readonly:\n        return None")
                outputs.append(a)
            packed.append(f"{m}.ptr + {a}._offset")
            if kind == _K_SLICE:  # (``pack`` refuses a length out of its range)
                body.append(f"    n{i} = prod({a}._shape)")
                packed.append(f"n{i}")
            ns[f"access{i}"] = access
            accesses.append(f"({a}, access{i})")
            allocs.append(m)
            continue
        body.append(f"    t = type({a})")
        if kind == _K_INT:  # (``pack`` refuses an int out of range)
            body.append(f"    if t is not int and t is not dt{i}:\n        return None")
        elif kind == _K_FLOAT:
            # NaN: NumPy keeps payloads that ``struct`` may not (half floats,
            # NumPy scalars' signalling NaNs), so the checked path packs them
            half = np.dtype(dt).itemsize == 2
            body.append(
                "    if t is float:\n"
                + (f"        if {a} != {a}:\n            return None\n" if half else "        pass\n")
                + "    elif t is int:\n"
                f"        if not {-_EXACT_INT_FLOAT} <= {a} <= {_EXACT_INT_FLOAT}:\n            return None\n"
                f"    elif t is dt{i}:\n        if {a} != {a}:\n            return None\n"
                "    else:\n        return None"
            )
        else:
            body.append(f"    if t is not bool and t is not dt{i}:\n        return None")
        packed.append(a)
    body.append(_fastgen.pack(packed))
    body.append(f"    accesses = ({''.join(x + ', ' for x in accesses)})")
    n = len(allocs)
    if n > 1:
        if n <= _PAIRWISE:
            same = " or ".join(f"{allocs[i]} is {allocs[j]}" for i in range(n) for j in range(i + 1, n))
        else:
            same = f"len({{{', '.join(f'id({m})' for m in allocs)}}}) < {n}"
        body.append(f"    if {same}:\n        accesses = merge(accesses)")
    body.append(_fastgen.launch_tail(outputs))
    fast: FastLauncher = _fastgen.build(body, ns, f"fast launch of {kernel.name}")
    return fast


# Where the compiled paths are used, ``Kernel.launch`` on a kernel is the
# compiled method (``_claunch.launch_method``): the common call straight to
# the typed fast path, every other through the function above, which stays
# what ``Kernel.launch`` is on the class (documentation, signature).
if _compiled.ext is not None:
    Kernel.launch = _compiled.ext.launch_method(Kernel.launch, Kernel, _config)  # type: ignore[method-assign]
