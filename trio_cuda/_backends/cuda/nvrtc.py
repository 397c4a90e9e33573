"""NVRTC compilation for the cuda backend, with an on-disk cache.

Invariants:

* Importing this module never calls into CUDA; ``cuda.bindings.nvrtc`` is only
  imported when something is compiled.
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
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..._core._errors import CudaError

__all__ = ["CompileResult", "cache_dir", "compile_source", "compile_statistics"]

_FORMAT = 1
_lock = threading.Lock()
_stats = {"compiled": 0, "disk_hits": 0, "disk_writes": 0, "disk_errors": 0}
_nvrtc_version: tuple[int, int] | None = None
_supported_archs: tuple[int, ...] | None = None


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


def _nvrtc() -> Any:
    from cuda.bindings import nvrtc

    return nvrtc


def _nvrtc_fail(err: Any, call: str, log: str = "") -> CudaError:
    nvrtc = _nvrtc()
    name = getattr(err, "name", str(err))
    text = ""
    try:
        res = nvrtc.nvrtcGetErrorString(err)
        raw = res[1] if isinstance(res, tuple) else res
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    except Exception:  # pragma: no cover - best effort
        text = ""
    if log:
        text = f"{text}\n{log}" if text else log
    return CudaError(int(err), name, text, call=call)


def nvrtc_version() -> tuple[int, int]:
    global _nvrtc_version
    if _nvrtc_version is None:
        err, major, minor = _nvrtc().nvrtcVersion()
        if err:
            raise _nvrtc_fail(err, "nvrtcVersion")
        _nvrtc_version = (int(major), int(minor))
    return _nvrtc_version


def supported_archs() -> tuple[int, ...]:
    global _supported_archs
    if _supported_archs is None:
        try:
            err, archs = _nvrtc().nvrtcGetSupportedArchs()
            _supported_archs = tuple(int(a) for a in archs) if not err else ()
        except Exception:  # pragma: no cover - old NVRTC
            _supported_archs = ()
    return _supported_archs


def pick_arch(cc: tuple[int, int]) -> str:
    """``sm_XY`` for the device, or ``compute_NN`` (PTX, JIT-compiled by the
    driver) for the newest architecture NVRTC knows when it does not know the
    device's."""
    want = cc[0] * 10 + cc[1]
    archs = supported_archs()
    if not archs or want in archs:
        return f"sm_{want}"
    older = [a for a in archs if a <= want]
    return f"compute_{max(older) if older else min(archs)}"


def _has_arch_option(options: tuple[str, ...]) -> str | None:
    for i, opt in enumerate(options):
        for prefix in ("--gpu-architecture=", "-arch=", "--gpu-architecture", "-arch"):
            if opt.startswith(prefix):
                value = opt[len(prefix) :].lstrip("=")
                if not value and i + 1 < len(options):
                    value = options[i + 1]
                return value
    return None


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
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
        with _lock:
            _stats["disk_errors"] += 1
        return
    with _lock:
        _stats["disk_writes"] += 1


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


def _compile(source: str, name: str, opts: tuple[str, ...], kind: str) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    if err:
        raise _nvrtc_fail(err, "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in opts]
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _log(nvrtc, prog)
        if cerr:
            raise _nvrtc_fail(cerr, f"nvrtcCompileProgram({name})", log)
        if kind == "cubin":
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            if err:
                raise _nvrtc_fail(err, "nvrtcGetCUBINSize")
            buf = b" " * size
            (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
            if err:
                raise _nvrtc_fail(err, "nvrtcGetCUBIN")
        else:
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            if err:
                raise _nvrtc_fail(err, "nvrtcGetPTXSize")
            buf = b" " * size
            (err,) = nvrtc.nvrtcGetPTX(prog, buf)
            if err:
                raise _nvrtc_fail(err, "nvrtcGetPTX")
        return bytes(buf), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _log(nvrtc: Any, prog: Any) -> str:
    try:
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        if err or size <= 1:
            return ""
        buf = b" " * size
        (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
        if err:
            return ""
        return str(buf.rstrip(b"\0 ").decode(errors="replace"))
    except Exception:  # pragma: no cover - best effort
        return ""
