"""NVRTC compilation for the cuda backend, with an on-disk cache.

Invariants:

* Importing this module never calls into CUDA; ``cuda.bindings.nvrtc`` is only
  imported when something is compiled. The compiler itself (and its errors) is
  ``_backends._nvrtc``, which the simulator's check uses too.
* The cache key covers everything that changes the output: the source, the
  options, the target architecture, the NVRTC version and the driver version
  (and a format number of this module). A cache entry is written atomically
  (temporary file + ``os.replace``); a damaged or unreadable entry is ignored
  and recompiled. A cache that cannot be written is not an error.
* The cache lives in ``$TRIO_CUDA_CACHE_DIR`` if set (an empty value disables
  it), else ``$XDG_CACHE_HOME/trio_cuda``, else ``~/.cache/trio_cuda``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from ..._cachefile import write_atomic
from .. import _nvrtc

__all__ = ["CompileResult", "cache_dir", "compile_source", "compile_statistics"]

_FORMAT = 1
_lock = threading.Lock()
_stats = {"compiled": 0, "disk_hits": 0, "disk_writes": 0, "disk_errors": 0}


def compile_statistics() -> dict[str, int]:
    """Counters of this process: NVRTC compilations, disk-cache hits and writes."""
    with _lock:
        return dict(_stats)


def cache_dir() -> Path | None:
    """The compilation cache directory, or None when caching is disabled."""
    env = os.environ.get("TRIO_CUDA_CACHE_DIR")
    if env is not None:
        return Path(env).expanduser() if env.strip() else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "trio_cuda"


class CompileResult:
    """An image ready for ``cuModuleLoadData``."""

    __slots__ = ("arch", "from_cache", "image", "kind", "log")

    def __init__(self, image: bytes, kind: str, arch: str, log: str, from_cache: bool) -> None:
        self.image = image
        self.kind = kind  # "cubin" or "ptx"
        self.arch = arch
        self.log = log
        self.from_cache = from_cache


# (shared with the simulator's check: one compiler, one error for both backends)
nvrtc_version = _nvrtc.nvrtc_version
supported_archs = _nvrtc.supported_archs
_has_arch_option = _nvrtc.arch_option
_compile = _nvrtc.compile_program


def pick_arch(cc: tuple[int, int]) -> str:
    """``sm_XY`` for the device, or ``compute_NN`` (PTX, JIT-compiled by the
    driver) for the newest architecture NVRTC knows when it does not know the
    device's."""
    want = cc[0] * 10 + cc[1]
    archs = supported_archs()
    if not archs or want in archs:
        return f"sm_{want}"
    return _nvrtc.virtual_arch(cc)


def _key(source: str, options: tuple[str, ...], arch: str, driver_version: int, name: str) -> str:
    payload = json.dumps(
        {
            "format": _FORMAT,
            "source": source,
            "options": list(options),
            "arch": arch,
            "nvrtc": list(nvrtc_version()),
            "driver": driver_version,
            "name": name,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _read_cache(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data or None


def _write_cache(path: Path, data: bytes) -> None:
    written = write_atomic(path, data)
    with _lock:
        _stats["disk_writes" if written else "disk_errors"] += 1


def compile_source(
    source: str,
    name: str,
    options: tuple[str, ...],
    cc: tuple[int, int],
    driver_version: int,
    *,
    use_cache: bool = True,
) -> CompileResult:
    """Compile CUDA C++ ``source`` for a device of compute capability ``cc``.

    Returns a cubin (``sm_XY``), or PTX when the options (or NVRTC's supported
    architectures) ask for ``compute_XY``. Raises :class:`CudaError` with the
    NVRTC log on failure."""
    arch = _has_arch_option(options)
    opts = tuple(options)
    if arch is None:
        arch = pick_arch(cc)
        opts = (f"--gpu-architecture={arch}", *opts)
    kind = "ptx" if arch.startswith("compute_") else "cubin"
    directory = cache_dir() if use_cache else None
    path = None
    if directory is not None:
        path = directory / f"{_key(source, opts, arch, driver_version, name)}.{kind}"
        data = _read_cache(path)
        if data is not None:
            with _lock:
                _stats["disk_hits"] += 1
            return CompileResult(data, kind, arch, "", True)
    image, log = _compile(source, name, opts, kind)
    with _lock:
        _stats["compiled"] += 1
    if path is not None:
        _write_cache(path, image)
    return CompileResult(image, kind, arch, log, False)


def compile_to_ptx(source: str, name: str, cc: tuple[int, int], options: tuple[str, ...] = ()) -> bytes:
    """PTX for ``source`` (``compute_XY`` of the device); used to test PTX loading."""
    arch = f"compute_{cc[0] * 10 + cc[1]}"
    image, _ = _compile(source, name, (f"--gpu-architecture={arch}", *options), "ptx")
    return image
