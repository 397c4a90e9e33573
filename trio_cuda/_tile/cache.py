"""The on-disk cache of compiled tile kernels: what identifies a compile (the
kernel digest and the cache key), where the cache lives, its entry format, and
the process's compile counters.

Invariants:

* This module imports neither ``cuda.tile`` nor ``tileiras``; the key is
  computed from the kernel object, the signature and the versions it is
  given, so a cache filled on a machine with the toolchain serves a machine
  without it.
* The key (:func:`cache_key`) is the SHA-256 of: a format number, the
  kernel's qualified name, the source text of the kernel and of the Python
  helpers, module-level constants and closure values it refers to (source
  text, not bytecode, so the key does not depend on the Python version or on
  where the file lives; the kernel's own module is not named, so a script run
  as ``__main__`` and the same file imported by name share entries), the
  signature's key, the arch, the
  kernel's compiler options for that arch, the calling convention, the
  ``cuda-tile`` version, and the cache's ``compiler_version`` tag (``None``
  unless configured). The ``tileiras`` version that built an entry is
  recorded in the entry, not in the key: a cubin stays valid for its arch
  whichever compiler made it; set ``compiler_version`` (or use a fresh
  directory) to rebuild with a new one.
* Entries (:class:`TileCache`) are single files written atomically
  (temporary file + ``os.replace``) and checked on read (magic, header,
  length, SHA-256, ELF magic); a damaged entry reads as missing (and counts
  as a disk error); a cache that cannot be written (read-only, full) is not
  an error.
* Beside the cubins, a kernel's exact access plans (which arrays it reads
  and writes, per access signature; :func:`access_key`, arch-independent) are
  stored as ``KEY.access.json``, so that a machine with the cache runs no
  analysis either; a malformed one reads as missing.
* The counters (:func:`compile_statistics`) are per process and thread-safe.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct
import threading
import types
from pathlib import Path
from typing import Any

import attrs

from .._cachefile import write_atomic
from .signature import CCONV, TileSignature

__all__ = ["TileCache", "access_key", "cache_key", "compile_statistics", "count", "kernel_digest", "pyfunc"]

_FORMAT = 2
_MAGIC = b"trio_cuda tile cubin\n"
_stats_lock = threading.Lock()
_stats = {"compiled": 0, "memory_hits": 0, "disk_hits": 0, "disk_writes": 0, "disk_errors": 0}


def count(name: str) -> None:
    """Add one to the counter ``name`` of :func:`compile_statistics`."""
    with _stats_lock:
        _stats[name] += 1


def compile_statistics() -> dict[str, int]:
    """Counters of this process: compilations, memory and disk hits, disk
    writes and disk errors (damaged entries, failed writes)."""
    with _stats_lock:
        return dict(_stats)


# --------------------------------------------------------------------------- kernel digest


def pyfunc(kernel: object) -> types.FunctionType:
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
    fn = pyfunc(kernel)
    parts: list[str] = []
    seen: set[int] = set()
    home = fn.__module__

    def where(module: str | None) -> str:
        # the kernel's own module is named by a placeholder: a program run as
        # __main__ and the same file imported by name make one digest
        return "." if module == home else str(module)

    def value_text(value: object, names: set[str]) -> str:
        inner = _inner_function(value)
        if inner is not None and not _is_tile_module(inner.__module__ or ""):
            visit(inner)
            return f"function {where(inner.__module__)}.{inner.__qualname__}"
        if isinstance(value, types.ModuleType):
            if not _is_tile_module(value.__name__):
                for attr in sorted(names):
                    sub = getattr(value, attr, None)
                    if sub is not None and not isinstance(sub, types.ModuleType):
                        parts.append(f"{where(value.__name__)}.{attr}={value_text(sub, set())}")
            return f"module {where(value.__name__)}"
        if _plain(value):
            return repr(value)
        return f"object {where(type(value).__module__)}.{type(value).__qualname__}"

    def visit(f: types.FunctionType) -> None:
        if id(f) in seen:
            return
        seen.add(id(f))
        try:
            text = inspect.getsource(f)
        except (OSError, TypeError):
            text = "code:" + _code_text(f.__code__)
        parts.append(f"def {where(f.__module__)}.{f.__qualname__}\n{text}")
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


def cache_key(
    kernel: object, signature: TileSignature, *, cutile_version: str, compiler_version: str | None
) -> str:
    """The key of ``kernel`` compiled for ``signature`` by ``cuda-tile``
    ``cutile_version`` under the cache tag ``compiler_version`` (see the
    module's invariants)."""
    fn = pyfunc(kernel)
    payload = json.dumps(
        {
            "format": _FORMAT,
            "kernel": fn.__qualname__,
            "code": kernel_digest(kernel),
            "signature": signature.key(),
            "arch": signature.arch,
            "options": _options_text(kernel, signature.arch),
            "cconv": CCONV,
            "cuda_tile": cutile_version,
            "compiler": compiler_version,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def access_key(kernel: object, signature_key: str, *, cutile_version: str) -> str:
    """The key of ``kernel``'s access plan for an access signature (its
    ``signature_key``, a stable text): the plan is the same for every arch."""
    fn = pyfunc(kernel)
    payload = json.dumps(
        {
            "format": _FORMAT,
            "what": "access plan",
            "kernel": fn.__qualname__,
            "code": kernel_digest(kernel),
            "signature": signature_key,
            "cuda_tile": cutile_version,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _modes(value: object) -> object:
    """A plan's modes from JSON (lists back to tuples), or None if malformed."""
    if isinstance(value, str):
        return value if value in _ACCESS_MODES else None
    if isinstance(value, list):
        items = [_modes(v) for v in value]
        return None if any(i is None for i in items) else tuple(items)
    return None


_ACCESS_MODES = frozenset({"read", "write", "read_write", "none", "scalar", "constant"})


# --------------------------------------------------------------------------- disk cache


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
            count("disk_errors")
            return None
        header["cubin"] = cubin
        return header

    def load_plan(self, key: str) -> tuple[object, ...] | None:
        """The access modes stored under ``key`` (see :func:`access_key`), or
        None when missing or damaged."""
        try:
            data = (self.path / f"{key}.access.json").read_bytes()
        except OSError:
            return None
        try:
            entry = json.loads(data.decode())
            modes = _modes(entry["modes"]) if isinstance(entry, dict) and entry.get("key") == key else None
        except (ValueError, KeyError, UnicodeDecodeError):
            modes = None
        if not isinstance(modes, tuple):
            count("disk_errors")
            return None
        return modes

    def store_plan(self, key: str, modes: tuple[object, ...]) -> bool:
        """Write an exact access plan's modes under ``key``, atomically."""
        data = json.dumps({"key": key, "modes": modes}, sort_keys=True).encode()
        if not write_atomic(self.path / f"{key}.access.json", data):
            count("disk_errors")
            return False
        return True

    def store(self, key: str, cubin: bytes, header: dict[str, Any]) -> bool:
        """Write the entry atomically; ``False`` (and nothing written) where the
        directory cannot be written."""
        head = dict(header, key=key, size=len(cubin), sha256=hashlib.sha256(cubin).hexdigest())
        blob = json.dumps(head, sort_keys=True).encode()
        data = _MAGIC + struct.pack("<I", len(blob)) + blob + cubin
        if not write_atomic(self.entry_path(key), data):
            count("disk_errors")
            return False
        count("disk_writes")
        return True
