"""CUresult -> trio_cuda errors, for every module of the cuda backend.

Invariants:

* :func:`cuda_error` maps a failed driver call to ``OutOfMemoryError`` (out of
  memory), ``LaunchError`` (a kernel could not run or faulted) or
  ``CudaError``; each carries the CUresult's code and name, the driver's text
  and the call that failed.
* The driver is asked for a code's name and text once (cached); asking never
  raises.
"""

from __future__ import annotations

from typing import Any, Final

from ..._core._errors import CudaError, LaunchError, OutOfMemoryError
from .bindings import cu

__all__ = ["LAUNCH_CODES", "NOT_READY", "OOM", "check", "cuda_error", "describe"]

# CUresult codes that mean "a kernel could not run or faulted"
LAUNCH_CODES: Final = frozenset({700, 701, 702, 703, 710, 714, 715, 716, 717, 718, 719, 720, 912})
OOM: Final = 2
NOT_READY: Final = 600

_names: dict[int, tuple[str, str]] = {}


def describe(err: Any) -> tuple[str, str]:
    """The name and the driver's text of a CUresult."""
    code = int(err)
    hit = _names.get(code)
    if hit is not None:
        return hit
    if type(err) is int and cu is not None:  # from a direct call (``direct``): the enum
        try:
            err = cu.CUresult(code)
        except ValueError:
            pass
    name = getattr(err, "name", "") or f"CUresult {code}"
    text = ""
    try:
        e, raw = cu.cuGetErrorName(err)
        if not e and raw:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        e, raw = cu.cuGetErrorString(err)
        if not e and raw:
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:  # pragma: no cover - best effort
        pass
    _names[code] = (name, text)
    return name, text


def cuda_error(err: Any, call: str, cls: type[CudaError] | None = None) -> CudaError:
    """The :class:`CudaError` (or subclass) for a failed driver call."""
    code = int(err)
    name, text = describe(err)
    if cls is None:
        if code == OOM:
            cls = OutOfMemoryError
        elif code in LAUNCH_CODES:
            cls = LaunchError
        else:
            cls = CudaError
    return cls(code, name, text, call=call)


def check(result: Any, call: str) -> Any:
    """Unpack ``(CUresult, *values)``; raise on error."""
    err = result[0]
    if err:
        raise cuda_error(err, call)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]
