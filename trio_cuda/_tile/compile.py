"""Specialisation signatures of tile kernels, their ahead-of-time compilation
to a cubin, and the on-disk cubin cache.

A tile kernel (a ``@ct.kernel`` function) is compiled once per
:class:`TileSignature`: per parameter an :class:`ArraySpec` (dtype, rank,
index width, the layout and alignment the runtime guarantees), a
:class:`ScalarSpec`, a :class:`ConstantSpec`, a :class:`TupleSpec` or a
:class:`ListSpec`, plus the target architecture. :func:`compile_tile` turns a
kernel and a signature into a :class:`TileImage`: the cubin, its symbol, and
the byte layout of its parameter buffer in the ``cutile_python_v2`` calling
convention (each array: an 8-byte pointer, then ``ndim`` shape values, then
``ndim`` strides in elements, 4 or 8 bytes each by the index dtype; a scalar:
one slot of its dtype; a constant: nothing; a tuple: its items in order; a
list of arrays: an 8-byte device pointer and an int32 length; every slot at
its natural alignment).

Invariants:

* Importing this module imports neither ``cuda.tile`` nor ``tileiras``;
  :func:`compile_tile` imports ``cuda.tile`` when called. It runs
  synchronously (callers run it in a worker thread), is thread-safe, and
  compiles one (kernel, signature, options) at most once per process: a
  per-key lock makes concurrent callers wait for the first one, whose image
  every later call gets from memory (and is written to a given cache that
  lacks it). A failed compile is not remembered.
* A spec never claims more than it is given: :func:`spec_of_array` declares a
  unit stride constant only where the stride is 1, a divisibility only as the
  largest power of two (at most 16) that divides the value, an alignment only
  as given, and ``may_alias_internally`` wherever two indices could reach one
  element (zero strides, overlapping dimensions).
* Errors: a malformed signature (wrong arity, a spec cuTile refuses for its
  parameter) is a :class:`~trio_cuda.KernelArgumentError`; cuTile's
  syntax, type and compiler errors are a :class:`TileCompileError` carrying
  cuTile's message and source location; a missing or broken toolchain is a
  :class:`TileToolchainError` whose one-line message names
  ``pip install 'trio_cuda[tile]'``.
* The disk cache (:class:`TileCache`) is keyed by the SHA-256 of: a format
  number, the kernel's module-qualified name, the source text of the kernel
  and of the Python helpers, module-level constants and closure values it
  refers to (source text, not bytecode, so the key does not depend on the
  Python version or on where the file lives), the signature's key, the arch,
  the kernel's compiler options for that arch, the calling convention, the
  ``cuda-tile`` version, and the cache's ``compiler_version`` tag (``None``
  unless configured). Everything in the key is known without ``tileiras``, so
  a cache filled on a machine with the toolchain serves a machine without it:
  a hit runs neither ``tileiras`` nor cuTile's front end. The ``tileiras``
  version that built an entry is recorded in the entry, not in the key: a
  cubin stays valid for its arch whichever compiler made it; set
  ``compiler_version`` (or use a fresh directory) to rebuild with a new one.
  Entries are single files written atomically (temporary file +
  ``os.replace``) and checked on read (magic, header, length, SHA-256, ELF
  magic); a damaged entry is ignored and replaced; a cache that cannot be
  written (read-only, full) is not an error.
* cuda.tile internals (the toolchain preflight, the compiler version) are used
  only with cuda-tile 1.7; with another version only its public API is used:
  the preflight is skipped and a toolchain failure surfaces as a
  :class:`TileCompileError` that names the extra.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import re
import struct
import tempfile
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeAlias

import attrs
import numpy as np

from .._core._errors import KernelArgumentError, TrioCudaError

__all__ = [
    "ArraySpec",
    "ConstantSpec",
    "ListSpec",
    "ParamLayout",
    "ScalarSpec",
    "Slot",
    "TileCache",
    "TileCompileError",
    "TileImage",
    "TileSignature",
    "TileToolchainError",
    "TupleSpec",
    "address_alignment",
    "clear_memory_cache",
    "compile_statistics",
    "compile_tile",
    "kernel_digest",
    "param_layout",
    "spec_of_array",
]

#: the cuda-tile minor version whose internals this module relies on
PINNED_CUTILE = (1, 7)
_FORMAT = 1
_INSTALL = "pip install 'trio_cuda[tile]'"
_CCONV = "cutile_python_v2"

IndexDtype = Literal["int32", "int64"]
SlotKind = Literal["pointer", "shape", "stride", "scalar", "list_pointer", "list_length"]


# --------------------------------------------------------------------------- errors


class TileCompileError(TrioCudaError):
    """cuTile refused or failed to compile a tile kernel. ``message`` is
    cuTile's message; ``filename``, ``line`` and ``column`` locate it in the
    kernel's source where cuTile knows (else ``None``); ``kernel`` names the
    kernel."""

    def __init__(
        self,
        message: str,
        *,
        kernel: str = "",
        filename: str | None = None,
        line: int | None = None,
        column: int | None = None,
        detail: str = "",
    ) -> None:
        self.message = message
        self.kernel = kernel
        self.filename = filename
        self.line = line
        self.column = column
        where = f"{filename}:{line}:{column}: " if filename and line else ""
        head = f"tile kernel {kernel!r} failed to compile: " if kernel else ""
        text = f"{head}{where}{message}"
        if detail and detail.strip() not in text:
            text += "\n" + detail.rstrip()
        super().__init__(text)

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_compile_error,
            (type(self), self.message, self.kernel, self.filename, self.line, self.column),
        )


def _rebuild_compile_error(
    cls: type[TileCompileError],
    message: str,
    kernel: str,
    filename: str | None,
    line: int | None,
    column: int | None,
) -> TileCompileError:
    return cls(message, kernel=kernel, filename=filename, line=line, column=column)


class TileToolchainError(TrioCudaError, RuntimeError):
    """The cuTile toolchain (``cuda.tile`` and its compiler ``tileiras`` with a
    matching ``ptxas`` and ``libnvvm``) is not installed or does not work. The
    message is one line naming ``pip install 'trio_cuda[tile]'``; ``reason``
    says what is missing in a few words."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"tile kernels need the cuTile toolchain ({reason}): {_INSTALL}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.reason,))


# --------------------------------------------------------------------------- specs


def _as_dtype(value: Any) -> np.dtype[Any]:
    try:
        dt: np.dtype[Any] = np.dtype(value)
    except TypeError as exc:
        raise TypeError(f"dtype: expected a NumPy dtype or dtype string, got {value!r}") from exc
    return dt


def _opt_tuple(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


def _pow2(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise ValueError(f"{name}: expected a positive power of two, got {value!r}")


@attrs.frozen
class ArraySpec:
    """What the runtime guarantees about an array parameter.

    ``strides``: per dimension the stride (in elements) every launch has, or
    ``None`` where it varies; ``base_align``: bytes the base address is always
    divisible by; ``shape_divisible_by``/``stride_divisible_by``: per
    dimension a factor every launch's value is divisible by; ``may_alias``:
    the array may overlap other ``may_alias`` arrays of the launch;
    ``may_alias_internally``: two indices may reach one element."""

    dtype: np.dtype[Any] = attrs.field(converter=_as_dtype)
    ndim: int
    index_dtype: IndexDtype = "int32"
    strides: tuple[int | None, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    base_align: int = 1
    shape_divisible_by: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    stride_divisible_by: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    may_alias: bool = False
    may_alias_internally: bool = False

    def __attrs_post_init__(self) -> None:
        if isinstance(self.ndim, bool) or not isinstance(self.ndim, int) or self.ndim < 0:
            raise ValueError(f"ndim: expected a non-negative int, got {self.ndim!r}")
        if self.index_dtype not in ("int32", "int64"):
            raise ValueError(f"index_dtype: expected 'int32' or 'int64', got {self.index_dtype!r}")
        _pow2("base_align", self.base_align)
        for name in ("strides", "shape_divisible_by", "stride_divisible_by"):
            value = getattr(self, name)
            if value is not None and len(value) != self.ndim:
                raise ValueError(f"{name}: expected {self.ndim} values (one per dimension), got {value!r}")
        for name in ("shape_divisible_by", "stride_divisible_by"):
            for v in getattr(self, name) or ():
                _pow2(name, v)
        for s in self.strides or ():
            if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
                raise ValueError(f"strides: expected non-negative ints or None, got {self.strides!r}")
        if self.strides is not None and self.stride_divisible_by is not None:
            for s, d in zip(self.strides, self.stride_divisible_by, strict=True):
                if s is not None and s % d:
                    raise ValueError(
                        f"strides: a constant stride must be divisible by its stride_divisible_by, "
                        f"got strides={self.strides!r}, stride_divisible_by={self.stride_divisible_by!r}"
                    )

    def key(self) -> list[Any]:
        return [
            "array",
            self.dtype.str if self.dtype.names is None else str(self.dtype),
            self.dtype.name,
            self.ndim,
            self.index_dtype,
            self.strides,
            self.base_align,
            self.shape_divisible_by,
            self.stride_divisible_by,
            self.may_alias,
            self.may_alias_internally,
        ]


@attrs.frozen
class ScalarSpec:
    """A scalar parameter of a NumPy dtype (one slot of that dtype)."""

    dtype: np.dtype[Any] = attrs.field(converter=_as_dtype)

    def key(self) -> list[Any]:
        return ["scalar", self.dtype.name]


def _as_constant(value: Any) -> bool | int | float:
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating) and not isinstance(value, np.longdouble):
        return float(value)
    raise TypeError(f"value: expected a bool, int or float constant, got {value!r}")


@attrs.frozen
class ConstantSpec:
    """A compile-time constant (a ``ct.Constant`` parameter); it takes no slot.
    ``1``, ``True`` and ``1.0`` are three different constants; NumPy scalars
    become the Python bool, int or float of the same value."""

    value: bool | int | float = attrs.field(converter=_as_constant)

    def key(self) -> list[Any]:
        v: object = self.value
        shown = struct.pack("=d", v).hex() if isinstance(v, float) else v
        return ["constant", type(v).__name__, shown]


@attrs.frozen
class TupleSpec:
    """A tuple parameter; its items are laid out in order."""

    items: tuple[ParamSpec, ...] = attrs.field(converter=tuple)

    def key(self) -> list[Any]:
        return ["tuple", [item.key() for item in self.items]]


@attrs.frozen
class ListSpec:
    """A list of arrays: a device pointer to ``(1 + 2 * ndim)`` 64-bit words per
    element, and an int32 length. ``elements_may_alias``: two elements may
    overlap."""

    element: ArraySpec
    elements_may_alias: bool = False

    def key(self) -> list[Any]:
        return ["list", self.element.key(), self.elements_may_alias]


ParamSpec: TypeAlias = "ArraySpec | ScalarSpec | ConstantSpec | TupleSpec | ListSpec"
_SPEC_TYPES = (ArraySpec, ScalarSpec, ConstantSpec, TupleSpec, ListSpec)


def _check_params(_: object, __: object, params: tuple[object, ...]) -> None:
    def check(p: object) -> None:
        if not isinstance(p, _SPEC_TYPES):
            raise TypeError(
                "params: expected ArraySpec, ScalarSpec, ConstantSpec, TupleSpec or ListSpec "
                f"items, got {p!r}"
            )
        if isinstance(p, TupleSpec):
            for item in p.items:
                check(item)

    for p in params:
        check(p)


def _check_arch(_: object, __: object, arch: str) -> None:
    if not isinstance(arch, str) or not arch.startswith("sm_") or not arch[3:].rstrip("af").isdigit():
        raise ValueError(f"arch: expected a GPU architecture such as 'sm_90', got {arch!r}")


@attrs.frozen
class TileSignature:
    """One specialisation of a tile kernel: a spec per parameter and the
    target architecture (a cubin is specific to it)."""

    params: tuple[ParamSpec, ...] = attrs.field(converter=tuple, validator=_check_params)
    arch: str = attrs.field(default="sm_90", validator=_check_arch)

    def key(self) -> str:
        """A stable text naming this signature (equal for equal signatures,
        across processes and machines)."""
        return json.dumps([self.arch, [p.key() for p in self.params]], separators=(",", ":"))


def address_alignment(address: int, guaranteed: int = 256) -> int:
    """The largest power of two, at most ``guaranteed``, dividing ``address``."""
    _pow2("guaranteed", guaranteed)
    if address == 0:
        return guaranteed
    return min(address & -address, guaranteed)


def _divisor(value: int, cap: int = 16) -> int:
    if value == 0:
        return cap
    return min(abs(value) & -abs(value), cap)


def _overlaps(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether two distinct indices may reach one element (conservative)."""
    dims = sorted((abs(s), n) for n, s in zip(shape, strides, strict=True) if n > 1)
    reach = 0  # the furthest offset the smaller dimensions reach
    for s, n in dims:
        if s <= reach:
            return True
        reach += s * (n - 1)
    return False


def spec_of_array(
    dtype: Any,
    shape: Sequence[int],
    strides: Sequence[int] | None = None,
    *,
    alignment: int = 1,
    index_dtype: IndexDtype | None = None,
    may_alias: bool = False,
) -> ArraySpec:
    """The :class:`ArraySpec` of one array as the runtime sees it: ``strides``
    in elements (C-contiguous when ``None``), ``alignment`` the bytes its base
    address is guaranteed to be divisible by (see :func:`address_alignment`).
    The index dtype is int32 where every shape, stride and offset fits, else
    int64, unless given. Raises :class:`KernelArgumentError` for a negative
    stride (cuTile supports none) or an index dtype too narrow."""
    dt = _as_dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise KernelArgumentError(f"shape: expected non-negative extents, got {shape}")
    if strides is None:
        acc, out = 1, []
        for n in reversed(shape):
            out.append(acc)
            acc *= max(n, 1)
        strides = tuple(reversed(out))
    strides = tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise KernelArgumentError(f"strides: expected {len(shape)} values for shape {shape}, got {strides}")
    if any(s < 0 for s, n in zip(strides, shape, strict=True) if n > 1):
        raise KernelArgumentError(
            f"strides: tile kernels take no negative strides, got {strides} for shape {shape}"
        )
    strides = tuple(0 if n <= 1 and s < 0 else s for s, n in zip(strides, shape, strict=True))
    extent = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if n > 0)
    fits32 = all(v < 2**31 for v in (*shape, *strides, extent))
    if index_dtype is None:
        index_dtype = "int32" if fits32 else "int64"
    elif index_dtype == "int32" and not fits32:
        raise KernelArgumentError(
            f"index_dtype: an array of shape {shape} and strides {strides} needs 'int64', got 'int32'"
        )
    return ArraySpec(
        dtype=dt,
        ndim=len(shape),
        index_dtype=index_dtype,
        strides=tuple(1 if s == 1 else None for s in strides),
        base_align=alignment,
        shape_divisible_by=tuple(_divisor(n) for n in shape),
        stride_divisible_by=tuple(1 if s == 1 else _divisor(s) for s in strides),
        may_alias=may_alias,
        may_alias_internally=_overlaps(shape, strides),
    )


# --------------------------------------------------------------------------- layout


@attrs.frozen
class Slot:
    """One value of the parameter buffer: what it is, its dtype, its byte
    offset, the dimension it describes (shape/stride) and the path of tuple
    item indices below its parameter."""

    kind: SlotKind
    dtype: np.dtype[Any]
    offset: int
    dim: int | None = None
    path: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return self.dtype.itemsize


@attrs.frozen
class ParamLayout:
    """The slots of one kernel parameter (none for a constant)."""

    index: int
    slots: tuple[Slot, ...]


_U64 = np.dtype(np.uint64)
_I32 = np.dtype(np.int32)


def param_layout(signature: TileSignature) -> tuple[tuple[ParamLayout, ...], int]:
    """The ``cutile_python_v2`` parameter layout of ``signature`` and the
    buffer's total size in bytes (each slot at its natural alignment)."""
    offset = 0
    slots: list[Slot] = []

    def put(kind: SlotKind, dtype: np.dtype[Any], dim: int | None, path: tuple[int, ...]) -> None:
        nonlocal offset
        align = dtype.alignment
        offset = (offset + align - 1) // align * align
        slots.append(Slot(kind, dtype, offset, dim, path))
        offset += dtype.itemsize

    def walk(spec: ParamSpec, path: tuple[int, ...]) -> None:
        if isinstance(spec, ArraySpec):
            idx = np.dtype(spec.index_dtype)
            put("pointer", _U64, None, path)
            for d in range(spec.ndim):
                put("shape", idx, d, path)
            for d in range(spec.ndim):
                put("stride", idx, d, path)
        elif isinstance(spec, ScalarSpec):
            put("scalar", spec.dtype, None, path)
        elif isinstance(spec, TupleSpec):
            for i, item in enumerate(spec.items):
                walk(item, (*path, i))
        elif isinstance(spec, ListSpec):
            put("list_pointer", _U64, None, path)
            put("list_length", _I32, None, path)

    layouts = []
    for i, p in enumerate(signature.params):
        start = len(slots)
        walk(p, ())
        layouts.append(ParamLayout(i, tuple(slots[start:])))
    return tuple(layouts), offset


# --------------------------------------------------------------------------- images


@attrs.frozen
class TileImage:
    """A compiled specialisation: the cubin (for ``cuModuleLoadData``), its
    kernel symbol, arch, the parameter layout and buffer size, the versions
    that built it, and where it came from (``"compiled"``, ``"disk"``)."""

    cubin: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    symbol: str
    arch: str
    layout: tuple[ParamLayout, ...] = attrs.field(repr=False)
    param_size: int
    cutile_version: str
    compiler_version: str | None
    key: str
    origin: Literal["compiled", "disk"] = "compiled"


# --------------------------------------------------------------------------- toolchain


def _import_tile() -> Any:
    try:
        import cuda.tile as ct
        import cuda.tile.compilation  # noqa: F401
    except ImportError as exc:
        raise TileToolchainError(f"cuda.tile is not importable: {exc}") from None
    return ct


def _cutile_version() -> str:
    ct = _import_tile()
    return str(getattr(ct, "__version__", None) or _dist_version("cuda-tile"))


def _dist_version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _pinned() -> bool:
    parts = _cutile_version().split(".")
    try:
        return (int(parts[0]), int(parts[1])) == PINNED_CUTILE
    except (IndexError, ValueError):
        return False


_preflight_lock = threading.Lock()
_preflight_ok: set[str] = set()


def _preflight(arch: str) -> None:
    """Raise :class:`TileToolchainError` unless ``tileiras`` is found and
    compiles an empty module for ``arch`` (it needs a matching ptxas and
    libnvvm). Success is remembered per arch."""
    with _preflight_lock:
        if arch in _preflight_ok or not _pinned():
            return
        import cuda.tile._bytecode as bc
        from cuda.tile._bytecode.version import BytecodeVersion
        from cuda.tile._compile import _find_compiler_bin
        from cuda.tile._exception import TileCompilerError

        try:
            binary = _find_compiler_bin()
        except FileNotFoundError:
            raise TileToolchainError("the tileiras compiler is not installed") from None
        probe = bytearray()
        with bc.write_bytecode(num_functions=0, buf=probe, version=BytecodeVersion.V_13_1):
            pass
        with tempfile.TemporaryDirectory(prefix="trio_cuda-tile-") as tmp:
            src = os.path.join(tmp, "probe.tileirbc")
            with open(src, "wb") as f:
                f.write(probe)
            try:
                binary.run([src, "-o", os.path.join(tmp, "probe.cubin")], ["--gpu-name", arch])
            except TileCompilerError as exc:
                first = (exc.message.strip().splitlines() or ["no output"])[-1]
                raise TileToolchainError(
                    f"tileiras at {binary.path} cannot compile for {arch}, its ptxas or libnvvm is "
                    f"missing or older than it: {first}"
                ) from None
            except OSError as exc:
                raise TileToolchainError(f"tileiras at {binary.path} does not run: {exc}") from None
        _preflight_ok.add(arch)


def _tileiras_version() -> str | None:
    if not _pinned():
        return None
    try:
        from cuda.tile._compile import _get_compiler_version_string

        text = _get_compiler_version_string()
    except Exception:
        return None
    if not text:
        return None
    found = re.search(r"release [0-9.]+, V[0-9.]+", text)
    return found.group(0) if found else " ".join(text.split())


# --------------------------------------------------------------------------- kernel digest


def _pyfunc(kernel: object) -> types.FunctionType:
    ann = getattr(kernel, "_annotated_function", None)
    fn = getattr(ann, "pyfunc", None)
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"kernel: expected a @ct.kernel function, got {kernel!r}")
    return fn


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _code_text(code: types.CodeType) -> str:
    parts = [code.co_code.hex(), repr(code.co_names), repr(code.co_varnames)]
    for const in code.co_consts:
        parts.append(_code_text(const) if isinstance(const, types.CodeType) else repr(const))
    return "|".join(parts)


def _is_tile_module(name: str) -> bool:
    return name == "cuda" or name.startswith("cuda.")


def _inner_function(value: object) -> types.FunctionType | None:
    """The Python function behind a helper: itself, the function a decorator
    (``@ct.function``, ``functools.wraps``) wraps, or a kernel's function."""
    ann = getattr(value, "_annotated_function", None)
    fn = getattr(ann, "pyfunc", None) or value
    for _ in range(16):  # a decorator chain, bounded against cycles
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return fn if isinstance(fn, types.FunctionType) else None


def _plain(value: object) -> bool:
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return True
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return _is_tile_module(type(value).__module__ or "")


def kernel_digest(kernel: object) -> str:
    """SHA-256 of what a kernel's code is made of: the source of its function
    and of the Python helpers it calls, and the constants and closure values
    it reads from module globals (see the module's invariants)."""
    fn = _pyfunc(kernel)
    parts: list[str] = []
    seen: set[int] = set()

    def value_text(value: object, names: set[str]) -> str:
        inner = _inner_function(value)
        if inner is not None and not _is_tile_module(inner.__module__ or ""):
            visit(inner)
            return f"function {inner.__module__}.{inner.__qualname__}"
        if isinstance(value, types.ModuleType):
            if not _is_tile_module(value.__name__):
                for attr in sorted(names):
                    sub = getattr(value, attr, None)
                    if sub is not None and not isinstance(sub, types.ModuleType):
                        parts.append(f"{value.__name__}.{attr}={value_text(sub, set())}")
            return f"module {value.__name__}"
        if _plain(value):
            return repr(value)
        return f"object {type(value).__module__}.{type(value).__qualname__}"

    def visit(f: types.FunctionType) -> None:
        if id(f) in seen:
            return
        seen.add(id(f))
        try:
            text = inspect.getsource(f)
        except (OSError, TypeError):
            text = "code:" + _code_text(f.__code__)
        parts.append(f"def {f.__module__}.{f.__qualname__}\n{text}")
        names = _code_names(f.__code__)
        for name in sorted(names):
            if name in f.__globals__:
                parts.append(f"global {name}={value_text(f.__globals__[name], names)}")
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=False):
            try:
                contents = cell.cell_contents
            except ValueError:
                contents = None
            parts.append(f"closure {name}={value_text(contents, names)}")
        if f.__defaults__:
            parts.append(f"defaults {value_text(f.__defaults__, set())}")

    visit(fn)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _options_text(kernel: object, arch: str) -> str:
    options = getattr(kernel, "_compiler_options", None)
    if options is None:
        return ""
    try:
        hints = options.hints_by_target()
        opt = options.opt_level_for_target(arch)
    except Exception:
        return repr(options)
    return json.dumps(
        {"hints": {k: hints[k] for k in ("default", arch) if k in hints}, "opt": opt},
        sort_keys=True,
        default=repr,
    )


def _cache_key(kernel: object, signature: TileSignature, compiler_version: str | None) -> str:
    fn = _pyfunc(kernel)
    payload = json.dumps(
        {
            "format": _FORMAT,
            "kernel": f"{fn.__module__}.{fn.__qualname__}",
            "code": kernel_digest(kernel),
            "signature": signature.key(),
            "arch": signature.arch,
            "options": _options_text(kernel, signature.arch),
            "cconv": _CCONV,
            "cuda_tile": _cutile_version(),
            "compiler": compiler_version,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


# --------------------------------------------------------------------------- disk cache

_MAGIC = b"trio_cuda tile cubin\n"
_stats_lock = threading.Lock()
_stats = {"compiled": 0, "memory_hits": 0, "disk_hits": 0, "disk_writes": 0, "disk_errors": 0}


def _count(name: str) -> None:
    with _stats_lock:
        _stats[name] += 1


def compile_statistics() -> dict[str, int]:
    """Counters of this process: compilations, memory and disk hits, disk
    writes and disk errors (damaged entries, failed writes)."""
    with _stats_lock:
        return dict(_stats)


def _default_path() -> Path | None:
    env = os.environ.get("TRIO_CUDA_TILE_CACHE")
    if env is not None:
        return Path(env).expanduser() if env.strip() else None
    env = os.environ.get("TRIO_CUDA_CACHE_DIR")
    if env is not None:
        return Path(env).expanduser() / "tile" if env.strip() else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "trio_cuda" / "tile"


def _as_path(value: str | os.PathLike[str]) -> Path:
    return Path(value).expanduser()


@attrs.frozen
class TileCache:
    """A directory of compiled tile kernels, one file per key (see the module's
    invariants). ``compiler_version``, when set, joins the key: entries made
    under another tag are not used."""

    path: Path = attrs.field(converter=_as_path)
    compiler_version: str | None = None

    @classmethod
    def default(cls) -> TileCache | None:
        """``$TRIO_CUDA_TILE_CACHE`` if set (empty disables the cache), else
        ``tile`` under ``$TRIO_CUDA_CACHE_DIR`` if set (empty disables), else
        ``$XDG_CACHE_HOME/trio_cuda/tile`` or ``~/.cache/trio_cuda/tile``."""
        path = _default_path()
        return None if path is None else cls(path)

    def entry_path(self, key: str) -> Path:
        return self.path / f"{key}.cubin"

    def load(self, key: str) -> dict[str, Any] | None:
        """The entry ``key`` (its header, with the cubin under ``"cubin"``), or
        ``None`` when it is missing or damaged."""
        path = self.entry_path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            if not data.startswith(_MAGIC):
                raise ValueError("magic")
            (hlen,) = struct.unpack_from("<I", data, len(_MAGIC))
            start = len(_MAGIC) + 4
            header = json.loads(data[start : start + hlen].decode())
            cubin = data[start + hlen :]
            if (
                not isinstance(header, dict)
                or header.get("key") != key
                or header.get("size") != len(cubin)
                or header.get("sha256") != hashlib.sha256(cubin).hexdigest()
                or not cubin.startswith(b"\x7fELF")
                or not isinstance(header.get("symbol"), str)
            ):
                raise ValueError("content")
        except (ValueError, struct.error, UnicodeDecodeError):
            _count("disk_errors")
            return None
        header["cubin"] = cubin
        return header

    def store(self, key: str, cubin: bytes, header: dict[str, Any]) -> bool:
        """Write the entry atomically; ``False`` (and nothing written) where the
        directory cannot be written."""
        head = dict(header, key=key, size=len(cubin), sha256=hashlib.sha256(cubin).hexdigest())
        blob = json.dumps(head, sort_keys=True).encode()
        data = _MAGIC + struct.pack("<I", len(blob)) + blob + cubin
        path = self.entry_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError:
            _count("disk_errors")
            return False
        _count("disk_writes")
        return True


# --------------------------------------------------------------------------- compile

_memory_lock = threading.Lock()
_memory: dict[str, TileImage] = {}  # by key
_key_locks: dict[str, threading.Lock] = {}  # held while one key is loaded or compiled
_stored: set[tuple[str, Path]] = set()  # (key, cache directory) known to hold the entry


def clear_memory_cache() -> None:
    """Forget the images compiled or loaded in this process (the disk cache stays)."""
    with _memory_lock:
        _memory.clear()
        _stored.clear()


def _constraint(spec: ParamSpec, ct: Any, comp: Any, alias: set[int], ident: int) -> Any:
    if isinstance(spec, ArraySpec):
        return comp.ArrayConstraint(
            _ct_dtype(ct, spec.dtype),
            spec.ndim,
            index_dtype=getattr(ct, spec.index_dtype),
            stride_lower_bound_incl=0,
            alias_groups=("may_alias",) if ident in alias else (),
            may_alias_internally=spec.may_alias_internally,
            stride_constant=spec.strides,
            stride_divisible_by=spec.stride_divisible_by or 1,
            shape_divisible_by=spec.shape_divisible_by or 1,
            base_addr_divisible_by=spec.base_align,
        )
    if isinstance(spec, ScalarSpec):
        return comp.ScalarConstraint(_ct_dtype(ct, spec.dtype))
    if isinstance(spec, ConstantSpec):
        return comp.ConstantConstraint(spec.value)
    if isinstance(spec, TupleSpec):
        return comp.TupleConstraint(
            [_constraint(item, ct, comp, alias, ident * 1000 + i + 1) for i, item in enumerate(spec.items)]
        )
    return comp.ListConstraint(
        _constraint(spec.element, ct, comp, set(), 0),
        alias_groups=(),
        elements_may_alias=spec.elements_may_alias,
    )


def _ct_dtype(ct: Any, dtype: np.dtype[Any]) -> Any:
    name = "bool_" if dtype.kind == "b" else dtype.name
    if not dtype.isnative and dtype.itemsize > 1:
        name = ""
    found = getattr(ct, name, None) if name else None
    if not isinstance(found, ct.DType):
        raise KernelArgumentError(f"dtype: expected a dtype tile kernels support, got {dtype}")
    return found


def _aliasing(params: Sequence[ParamSpec]) -> set[int]:
    """Identities of the arrays sharing the ``may_alias`` group (only when two
    or more ask for it: one alone has nothing to alias)."""
    found: set[int] = set()

    def walk(spec: ParamSpec, ident: int) -> None:
        if isinstance(spec, ArraySpec) and spec.may_alias:
            found.add(ident)
        elif isinstance(spec, TupleSpec):
            for i, item in enumerate(spec.items):
                walk(item, ident * 1000 + i + 1)

    for i, p in enumerate(params):
        walk(p, i + 1)
    return found if len(found) > 1 else set()


def _kernel_signature(kernel: object, signature: TileSignature, ct: Any, comp: Any) -> Any:
    fn = _pyfunc(kernel)
    names = list(inspect.signature(fn).parameters)
    if len(names) != len(signature.params):
        raise KernelArgumentError(
            f"signature: kernel {fn.__name__!r} takes {len(names)} parameters ({', '.join(names)}), "
            f"got {len(signature.params)} specs"
        )
    alias = _aliasing(signature.params)
    try:
        constraints = [_constraint(p, ct, comp, alias, i + 1) for i, p in enumerate(signature.params)]
        sig = comp.KernelSignature(constraints, comp.CallingConvention.cutile_python_v2())
        return sig.with_mangled_symbol(fn.__name__)
    except (TypeError, ValueError) as exc:
        raise KernelArgumentError(f"signature: cuTile refuses it for kernel {fn.__name__!r}: {exc}") from None


def _compile_error(exc: BaseException, kernel_name: str, ct: Any) -> TrioCudaError:
    loc = getattr(exc, "loc", None)
    message = str(getattr(exc, "message", exc))
    filename = getattr(loc, "filename", None) if loc is not None else None
    line = getattr(loc, "line", None) or None
    column = getattr(loc, "col", None)
    if not filename:
        filename = line = column = None
    detail = ""
    if isinstance(exc, ct.TileInternalError) and not _pinned():
        detail = f"(if the tile toolchain is missing or broken: {_INSTALL})"
    return TileCompileError(
        message, kernel=kernel_name, filename=filename, line=line, column=column, detail=detail
    )


def compile_tile(kernel: object, signature: TileSignature, *, cache: TileCache | None = None) -> TileImage:
    """Compile ``kernel`` (a ``@ct.kernel`` function) for ``signature``, or get
    it from this process's memory or from ``cache``. Synchronous and
    thread-safe; one compile per key at most."""
    if not isinstance(signature, TileSignature):
        raise TypeError(f"signature: expected a TileSignature, got {signature!r}")
    if cache is not None and not isinstance(cache, TileCache):
        raise TypeError(f"cache: expected a TileCache or None, got {cache!r}")
    ct = _import_tile()
    fn = _pyfunc(kernel)
    if not isinstance(kernel, ct.kernel):
        raise TypeError(f"kernel: expected a @ct.kernel function, got {kernel!r}")
    key = _cache_key(kernel, signature, cache.compiler_version if cache else None)
    with _memory_lock:
        image = _memory.get(key)
        if image is not None:
            _stats["memory_hits"] += 1
        else:
            lock = _key_locks.setdefault(key, threading.Lock())
    if image is None:
        with lock:
            with _memory_lock:
                image = _memory.get(key)
                if image is not None:
                    _stats["memory_hits"] += 1
            if image is None:
                image = _load_or_compile(kernel, fn, signature, cache, key, ct)
                with _memory_lock:
                    _memory[key] = image
                    _key_locks.pop(key, None)
                    if cache is not None:
                        _stored.add((key, cache.path))
    if cache is not None:
        with _memory_lock:
            known = (key, cache.path) in _stored
            _stored.add((key, cache.path))
        if not known and cache.load(key) is None:
            cache.store(key, image.cubin, _header(fn, signature, image.symbol, image.compiler_version))
    return image


def _header(
    fn: types.FunctionType, signature: TileSignature, symbol: str, tileiras: str | None
) -> dict[str, Any]:
    return {
        "symbol": symbol,
        "arch": signature.arch,
        "kernel": f"{fn.__module__}.{fn.__qualname__}",
        "signature": signature.key(),
        "cuda_tile": _cutile_version(),
        "tileiras": tileiras,
    }


def _load_or_compile(
    kernel: object,
    fn: types.FunctionType,
    signature: TileSignature,
    cache: TileCache | None,
    key: str,
    ct: Any,
) -> TileImage:
    layout, size = param_layout(signature)
    cutile_version = _cutile_version()
    if cache is not None:
        entry = cache.load(key)
        if entry is not None:
            _count("disk_hits")
            return TileImage(
                cubin=entry["cubin"],
                symbol=entry["symbol"],
                arch=signature.arch,
                layout=layout,
                param_size=size,
                cutile_version=cutile_version,
                compiler_version=entry.get("tileiras"),
                key=key,
                origin="disk",
            )
    import cuda.tile.compilation as comp

    ksig = _kernel_signature(kernel, signature, ct, comp)
    _preflight(signature.arch)
    out = io.BytesIO()
    try:
        comp.export_kernel(kernel, [ksig], out, gpu_code=signature.arch, output_format="cubin")
    except ct.TileError as exc:
        raise _compile_error(exc, fn.__name__, ct) from exc
    except TypeError as exc:
        if str(exc).startswith("Invalid kernel parameter"):
            raise KernelArgumentError(f"signature: {exc} (kernel {fn.__name__!r})") from None
        raise
    except FileNotFoundError as exc:
        raise TileToolchainError(f"the tileiras compiler is not installed: {exc}") from None
    _count("compiled")
    cubin = out.getvalue()
    tileiras = _tileiras_version()
    if cache is not None:
        cache.store(key, cubin, _header(fn, signature, ksig.symbol, tileiras))
    return TileImage(
        cubin=cubin,
        symbol=ksig.symbol,
        arch=signature.arch,
        layout=layout,
        param_size=size,
        cutile_version=cutile_version,
        compiler_version=tileiras,
        key=key,
    )
