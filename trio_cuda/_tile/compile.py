"""Ahead-of-time compilation of tile kernels to a cubin: the toolchain
preflight, the compile errors, :class:`TileImage` and :func:`compile_tile`
with its in-process memory of images.

A tile kernel (a ``@ct.kernel`` function) is compiled once per
:class:`~.signature.TileSignature` (see :mod:`.signature` for the specs and
the ``cutile_python_v2`` parameter layout). :func:`compile_tile` turns a
kernel and a signature into a :class:`TileImage`: the cubin, its symbol, and
the byte layout of its parameter buffer, from memory, from a
:class:`~.cache.TileCache` (see :mod:`.cache` for the key and the entry
format), or from ``tileiras``. The names of :mod:`.signature` and
:mod:`.cache` are importable from here too.

Invariants:

* Importing this module imports neither ``cuda.tile`` nor ``tileiras``;
  :func:`compile_tile` imports ``cuda.tile`` when called. It runs
  synchronously (callers run it in a worker thread), is thread-safe, and
  compiles one (kernel, signature, options) at most once per process: a
  per-key lock makes concurrent callers wait for the first one, whose image
  every later call gets from memory (and is written to a given cache that
  lacks it). A failed compile is not remembered.
* A cache hit runs neither ``tileiras`` nor cuTile's front end: everything
  in the key is known without ``tileiras``.
* Errors: a malformed signature (wrong arity, a spec cuTile refuses for its
  parameter) is a :class:`~trio_cuda.KernelArgumentError`; cuTile's
  syntax, type and compiler errors are a :class:`TileCompileError` carrying
  cuTile's message and source location; a missing or broken toolchain is a
  :class:`TileToolchainError` whose one-line message names
  ``pip install 'trio_cuda[tile]'``.
* cuda.tile internals (the toolchain preflight, the compiler version) are used
  only with cuda-tile 1.7; with another version only its public API is used:
  the preflight is skipped and a toolchain failure surfaces as a
  :class:`TileCompileError` that names the extra.
"""

from __future__ import annotations

import inspect
import io
import os
import re
import tempfile
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from .._core._errors import KernelArgumentError, TrioCudaError
from .cache import TileCache, cache_key, compile_statistics, count, kernel_digest, pyfunc
from .signature import (
    ArraySpec,
    ConstantSpec,
    ListSpec,
    ParamLayout,
    ParamSpec,
    ScalarSpec,
    Slot,
    TileSignature,
    TupleSpec,
    address_alignment,
    param_layout,
    spec_of_array,
)

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
    "toolchain_status",
]

#: the cuda-tile minor version whose internals this module relies on
#: the cuda-tile minor version whose internals this module relies on
PINNED_CUTILE = (1, 7)
_INSTALL = "pip install 'trio_cuda[tile]'"


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


def toolchain_status(arch: str = "sm_90") -> str:
    """One line on what tile kernels can do here (``python -m trio_cuda
    info``): compile for ``arch``, run cached cubins only, or nothing. Never
    raises."""
    try:
        version = _cutile_version()
    except TileToolchainError:
        return f"not available (cuda.tile is not installed: {_INSTALL})"
    except Exception as exc:  # pragma: no cover - a broken install
        return f"not available ({type(exc).__name__}: {exc})"
    cache = TileCache.default()
    where = f"cache {cache.path}" if cache is not None else "no disk cache"
    try:
        _preflight(arch)
    except TileToolchainError as exc:
        return (
            f"cuda-tile {version} without a working compiler ({exc.reason}): runs cubins found in the "
            f"cache only ({where}); {_INSTALL} compiles"
        )
    except Exception as exc:  # pragma: no cover - a broken install
        return f"cuda-tile {version}, compiler check failed ({type(exc).__name__}: {exc})"
    tileiras = _tileiras_version()
    compiler = f"tileiras {tileiras}" if tileiras else "tileiras"
    return f"cuda-tile {version}, {compiler}: compiles for {arch} ({where})"


def _cache_key(kernel: object, signature: TileSignature, compiler_version: str | None) -> str:
    return cache_key(kernel, signature, cutile_version=_cutile_version(), compiler_version=compiler_version)


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
    fn = pyfunc(kernel)
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
    fn = pyfunc(kernel)
    if not isinstance(kernel, ct.kernel):
        raise TypeError(f"kernel: expected a @ct.kernel function, got {kernel!r}")
    key = _cache_key(kernel, signature, cache.compiler_version if cache else None)
    with _memory_lock:
        image = _memory.get(key)
        if image is not None:
            count("memory_hits")
        else:
            lock = _key_locks.setdefault(key, threading.Lock())
    if image is None:
        with lock:
            with _memory_lock:
                image = _memory.get(key)
                if image is not None:
                    count("memory_hits")
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
            count("disk_hits")
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
    except OSError as exc:  # inspect could not find the source (python -c, exec, a prompt)
        raise TileCompileError(
            f"cuTile reads a kernel's source to compile it, and could not ({exc}): define "
            "@ct.kernel functions in a file (not under python -c, exec or an interactive prompt)",
            kernel=fn.__name__,
        ) from exc
    count("compiled")
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
