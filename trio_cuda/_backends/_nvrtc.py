"""NVRTC for both backends: compiling CUDA C++, its errors, and the simulator's
check of a kernel's code.

Invariants:

* Importing this module never imports ``cuda``; ``cuda.bindings.nvrtc`` is
  imported (by :func:`load_nvrtc`) when something is compiled. NVRTC needs no
  driver and no GPU: where its library can be loaded (the ``nvidia-cuda-nvrtc``
  wheel, found by ``cuda.pathfinder``), the simulator compiles too.
* Both backends compile with :func:`compile_program`, so a compile error is the
  same :class:`CudaError` on both: named by NVRTC's result
  (``NVRTC_ERROR_COMPILATION``), its text carrying the NVRTC log. A kernel
  name that the code does not define is ``_common.entry_not_found`` on both.
* :func:`check_kernel` (the simulator's check) compiles a source once per
  (source, options, architecture) in a process, for a virtual architecture
  (PTX: no driver, no machine code), and keeps the outcome, success or error;
  it only reads the kernel entries of the result. PTX images are checked for
  their entries without compiling; cubins are not checked. When NVRTC cannot
  be loaded, the check is skipped: the first source kernel that the
  simulator runs unchecked in a process logs one WARNING naming the
  ``compiler`` extra (``pip install 'trio_cuda[compiler]'``), never more.
  ``TRIO_CUDA_SIM_COMPILE=0`` turns the check off, without a warning.
  :func:`check_status` says which of these holds (``python -m trio_cuda info``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import TYPE_CHECKING, Any

import attrs

from .._core._errors import CudaError
from . import _common

if TYPE_CHECKING:
    from .._core._kernel import Kernel

__all__ = [
    "SIM_COMPILE_ENV",
    "arch_option",
    "check_enabled",
    "check_kernel",
    "check_statistics",
    "check_status",
    "compile_program",
    "load_nvrtc",
    "nvrtc_available",
    "nvrtc_fail",
    "nvrtc_version",
    "ptx_entries",
    "supported_archs",
    "virtual_arch",
]

logger = logging.getLogger("trio_cuda")

#: the environment variable that turns the simulator's check off ("0", "false", "no", "off")
SIM_COMPILE_ENV = "TRIO_CUDA_SIM_COMPILE"
_OFF = frozenset({"0", "false", "no", "off"})

_lock = threading.Lock()
_nvrtc_version: tuple[int, int] | None = None
_supported_archs: tuple[int, ...] | None = None
#: whether NVRTC could be loaded in this process (None: not tried yet)
_available: bool | None = None
#: why NVRTC could not be loaded ("" while it could, or was not tried)
_unavailable: str = ""
#: whether the one warning about an unchecked kernel was logged in this process
_warned = False
#: how to get NVRTC
INSTALL_HINT = "pip install 'trio_cuda[compiler]'"
#: (source, options, arch) -> the kernel entries it defines, or its compile error
_checked: dict[tuple[str, tuple[str, ...], str], tuple[str, ...] | _Failed] = {}
_CHECKED_MAX = 4096
_stats = {"compiled": 0, "hits": 0, "skipped": 0}

#: a PTX kernel entry: ``.entry name(`` (``.visible``/``.weak`` before it)
_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$%][\w$]*)")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def load_nvrtc() -> Any:
    """``cuda.bindings.nvrtc`` (imported here, never at module import)."""
    from cuda.bindings import nvrtc

    return nvrtc


# --------------------------------------------------------------------------- errors


def nvrtc_fail(err: Any, call: str, log: str = "") -> CudaError:
    """The :class:`CudaError` of a failed NVRTC call, with the compile log."""
    nvrtc = load_nvrtc()
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


# --------------------------------------------------------------------------- the compiler


def nvrtc_version() -> tuple[int, int]:
    global _nvrtc_version
    if _nvrtc_version is None:
        err, major, minor = load_nvrtc().nvrtcVersion()
        if err:
            raise nvrtc_fail(err, "nvrtcVersion")
        _nvrtc_version = (int(major), int(minor))
    return _nvrtc_version


def supported_archs() -> tuple[int, ...]:
    global _supported_archs
    if _supported_archs is None:
        try:
            err, archs = load_nvrtc().nvrtcGetSupportedArchs()
            _supported_archs = tuple(int(a) for a in archs) if not err else ()
        except Exception:  # pragma: no cover - old NVRTC
            _supported_archs = ()
    return _supported_archs


def virtual_arch(cc: tuple[int, int]) -> str:
    """``compute_XY`` for compute capability ``cc``, or the newest virtual
    architecture NVRTC knows below it (its oldest one if none is)."""
    want = cc[0] * 10 + cc[1]
    archs = supported_archs()
    if not archs or want in archs:
        return f"compute_{want}"
    older = [a for a in archs if a <= want]
    return f"compute_{max(older) if older else min(archs)}"


def arch_option(options: tuple[str, ...]) -> str | None:
    """The architecture that ``options`` ask for, if they ask for one."""
    for i, opt in enumerate(options):
        for prefix in ("--gpu-architecture=", "-arch=", "--gpu-architecture", "-arch"):
            if opt.startswith(prefix):
                value = opt[len(prefix) :].lstrip("=")
                if not value and i + 1 < len(options):
                    value = options[i + 1]
                return value
    return None


def compile_program(source: str, name: str, opts: tuple[str, ...], kind: str) -> tuple[bytes, str]:
    """Compile ``source`` with ``opts`` to ``kind`` ("cubin" or "ptx"); the
    image and the NVRTC log. Raises :class:`CudaError` with the log."""
    nvrtc = load_nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    if err:
        raise nvrtc_fail(err, "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in opts]
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _program_log(nvrtc, prog)
        if cerr:
            raise nvrtc_fail(cerr, f"nvrtcCompileProgram({name})", log)
        if kind == "cubin":
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            if err:
                raise nvrtc_fail(err, "nvrtcGetCUBINSize")
            buf = bytearray(size)  # NVRTC writes into it: never an immutable (maybe shared) bytes
            (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
            if err:
                raise nvrtc_fail(err, "nvrtcGetCUBIN")
        else:
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            if err:
                raise nvrtc_fail(err, "nvrtcGetPTXSize")
            buf = bytearray(size)  # NVRTC writes into it: never an immutable (maybe shared) bytes
            (err,) = nvrtc.nvrtcGetPTX(prog, buf)
            if err:
                raise nvrtc_fail(err, "nvrtcGetPTX")
        return bytes(buf), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(nvrtc: Any, prog: Any) -> str:
    try:
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        if err or size <= 1:
            return ""
        buf = bytearray(size)
        (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
        if err:
            return ""
        return str(buf.rstrip(b"\0 ").decode(errors="replace"))
    except Exception:  # pragma: no cover - best effort
        return ""


def ptx_entries(ptx: bytes | str) -> tuple[str, ...]:
    """The kernel entries that PTX text declares, in order."""
    text = ptx.decode(errors="replace") if isinstance(ptx, bytes) else ptx
    return tuple(_ENTRY.findall(_COMMENT.sub(" ", text)))


# --------------------------------------------------------------------------- the simulator's check


def nvrtc_available() -> bool:
    """Whether NVRTC can be loaded in this process (tried once; a failure is
    logged at debug level)."""
    global _available, _unavailable
    if _available is None:
        try:
            nvrtc_version()
        except Exception as exc:
            logger.debug("the simulator does not compile kernels: NVRTC cannot be loaded (%r)", exc)
            _unavailable = _short(exc)
            _available = False
        else:
            _available = True
    return _available


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(text) > 100:
        text = text[:97] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_status() -> tuple[bool, str]:
    """Whether the simulator's compile check is on in this process, and why
    (or why not, with what to do about it). Loads NVRTC if it was not tried."""
    if not check_enabled():
        return False, f"turned off by {SIM_COMPILE_ENV}={os.environ.get(SIM_COMPILE_ENV, '')}"
    if not nvrtc_available():
        return False, (
            f"NVRTC cannot be loaded ({_unavailable}): kernel sources are not compiled, and a "
            f"kernel runs its reference= even if its source does not compile or does not define "
            f"it; {INSTALL_HINT} installs NVRTC"
        )
    major, minor = nvrtc_version()
    return True, f"NVRTC {major}.{minor} compiles each kernel's source once and checks its name"


def _warn_unchecked(kernel: Kernel) -> None:
    """Log, once per process, that a kernel runs on the simulator unchecked."""
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    logger.warning(
        "the simulator runs kernel %r without checking its source: NVRTC is not available (%s), "
        "so a source that does not compile or does not define the kernel goes unnoticed until it "
        "runs on a GPU; %s installs NVRTC (%s=0 turns the check off); this is said once per process",
        kernel.name,
        _unavailable or "not installed",
        INSTALL_HINT,
        SIM_COMPILE_ENV,
    )


def check_enabled() -> bool:
    """False when ``TRIO_CUDA_SIM_COMPILE`` turns the simulator's check off."""
    return os.environ.get(SIM_COMPILE_ENV, "1").strip().lower() not in _OFF


def check_statistics() -> dict[str, int]:
    """Counters of this process: sources compiled by the check, outcomes
    reused from its cache, and checks skipped (no NVRTC)."""
    with _lock:
        return dict(_stats)


def check_kernel(kernel: Kernel, cc: tuple[int, int]) -> None:
    """The simulator's check of ``kernel``'s code, for a device of compute
    capability ``cc``: a source must compile (the cuda backend's error, with
    the NVRTC log) and define ``kernel.name``; a PTX image must declare it.
    Skipped where NVRTC cannot be loaded (sources only), or when turned off."""
    if not check_enabled():
        return
    if kernel.image_kind == "ptx":
        assert kernel.image is not None
        entries = ptx_entries(kernel.image)
        if kernel.name not in entries:
            raise _common.entry_not_found(kernel.name, entries, "its PTX")
        return
    if kernel.image_kind != "source" or kernel.source is None:
        return  # a cubin: machine code this check does not read
    if not nvrtc_available():
        with _lock:
            _stats["skipped"] += 1
        _warn_unchecked(kernel)
        return
    options = tuple(kernel.options)
    arch = arch_option(options)
    opts = options
    if arch is None:
        arch = virtual_arch(cc)
        opts = (f"--gpu-architecture={arch}", *options)
    key = (kernel.source, options, arch)
    with _lock:
        outcome = _checked.get(key)
        if outcome is not None:
            _stats["hits"] += 1
        else:
            if len(_checked) >= _CHECKED_MAX:
                _checked.clear()  # a program that makes sources without end: recompile
            outcome = _checked[key] = _compile_for_check(kernel.source, kernel.name, opts)
            _stats["compiled"] += 1
    if isinstance(outcome, _Failed):
        raise outcome.error(kernel.name)
    if outcome is not _UNREAD and kernel.name not in outcome:
        raise _common.entry_not_found(kernel.name, outcome, "its source")


def _compile_for_check(source: str, name: str, opts: tuple[str, ...]) -> tuple[str, ...] | _Failed:
    """The entries ``source`` defines (``_UNREAD`` if no PTX comes out, as
    with ``-dlto``), or how compiling it failed. A failure to create the
    program (NVRTC out of memory) is raised, not kept."""
    try:
        image, _ = compile_program(source, name, opts, "ptx")
    except CudaError as exc:
        if exc.call.startswith("nvrtcCompileProgram"):
            return _Failed(exc.code, exc.name, exc.text, exc.call, name)
        if exc.call.startswith("nvrtcCreateProgram"):
            raise
        return _UNREAD
    if b".version" not in image:  # no PTX (LTO IR instead): entries unknown
        return _UNREAD
    return ptx_entries(image)


@attrs.frozen
class _Failed:
    """A compile error, kept to be raised anew (a fresh traceback each time).
    ``kernel`` is the kernel it was compiled for: NVRTC names the program
    after it (``kernel.cu``), as the cuda backend does."""

    code: int
    name: str
    text: str
    call: str
    kernel: str

    def error(self, kernel: str) -> CudaError:
        """The error, as compiling the source for ``kernel`` reports it."""
        text, call = self.text, self.call
        if kernel != self.kernel:
            text = text.replace(f"{self.kernel}.cu", f"{kernel}.cu")
            call = call.replace(f"({self.kernel})", f"({kernel})")
        return CudaError(self.code, self.name, text, call=call)


#: the outcome of a compilation whose PTX could not be read: no entry check
_UNREAD: tuple[str, ...] = ("<unread>",)
