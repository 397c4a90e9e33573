"""Checks and errors that both backends (``cuda`` and ``sim``) raise alike.

Invariants:

* This module imports only the core's errors and NumPy: never ``cuda``, never
  a backend. Both backends call it; neither repeats what is here.
* A check runs before anything is enqueued, allocated or recorded: when it
  raises, the context and its streams are as they were.
* Handles follow one rule. An object of the wrong type is a ``TypeError``; a
  stream or kernel function of the right type but of another context is a
  ``ValueError``; a destroyed stream or a closed context is a
  ``ScopeClosedError``; a destroyed executable graph or an unloaded module is
  a ``CudaError`` named ``CUDA_ERROR_INVALID_HANDLE`` (as the driver names a
  dead handle). Graph templates and executable graphs of another context are
  a ``TypeError`` on both backends.
* Sizes (bytes, element counts) are non-negative ints (NumPy integers too,
  never bools); anything else is a ``ValueError`` naming the argument.
* While a stream captures a graph, an allocation, a completion marker, a wait,
  a gate and a synchronising copy on it raise ``GraphCaptureError``.
* Messages name the argument, what was expected and what was given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core._errors import CudaError, GraphCaptureError, ScopeClosedError

__all__ = [
    "already_capturing",
    "capture_refuses_alloc",
    "check_count",
    "check_host_dst",
    "check_pattern",
    "check_peer_contexts",
    "context_closed",
    "entry_not_found",
    "foreign_context",
    "graph_consumed",
    "graph_exec_destroyed",
    "invalid_handle",
    "not_a",
    "not_capturable",
    "not_capturing",
    "not_of_this_context",
    "stream_destroyed",
    "sync_copy_in_capture",
    "wrong_handle",
]

INVALID_HANDLE = 400  #: CUDA_ERROR_INVALID_HANDLE
NOT_FOUND = 500  #: CUDA_ERROR_NOT_FOUND


# --------------------------------------------------------------------------- arguments


def check_count(name: str, value: Any) -> int:
    """``value`` (a size in bytes or elements) as an int; ``ValueError``
    unless it is a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return int(value)


def check_pattern(pattern: bytes) -> bytes:
    """The fill pattern as bytes: 1, 2, 4 or 8 of them."""
    pattern = bytes(pattern)
    if len(pattern) not in (1, 2, 4, 8):
        raise ValueError(f"pattern: expected 1, 2, 4 or 8 bytes, got {len(pattern)}")
    return pattern


def check_host_dst(dst: object) -> None:
    """The destination of a device-to-host copy: a writeable C-contiguous array."""
    if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or not dst.flags.writeable:
        raise ValueError(f"dst: expected a writeable C-contiguous numpy array, got {type(dst).__name__}")


# --------------------------------------------------------------------------- handles


def not_a(arg: str, value: object, cls: type, origin: str = "") -> TypeError:
    """``value`` (passed as ``arg``) is no ``cls`` at all."""
    return TypeError(f"{arg}: expected a {cls.__name__}{origin}, got {type(value).__name__}")


def wrong_handle(
    arg: str, value: object, cls: type, backend: str, origin: str = ""
) -> TypeError | ValueError:
    """The error for ``value``, passed as ``arg`` where a ``cls`` of this
    context was expected: ``TypeError`` if it is no ``cls``, ``ValueError``
    if it is one of another context (of ``backend``: "CUDA", "simulator")."""
    if not isinstance(value, cls):
        return not_a(arg, value, cls, origin)
    return ValueError(f"{arg}: {value!r} belongs to another {backend} context")


def not_of_this_context(arg: str, value: object, cls: type, origin: str) -> TypeError:
    """A graph template or executable graph that is no ``cls`` of this context."""
    return TypeError(f"{arg}: expected a {cls.__name__} of this context from {origin}, got {value!r}")


def check_peer_contexts(dst_context: object, src_context: object, cls: type) -> None:
    """``copy_peer``: both contexts must be ``cls`` (contexts of this backend)."""
    for label, ctx in (("dst_context", dst_context), ("src_context", src_context)):
        if not isinstance(ctx, cls):
            raise not_a(label, ctx, cls)


def foreign_context(label: str, ctx: object, memory: str) -> ValueError:
    """``check_copy_peer``: ``ctx`` is no context of this backend (``memory``
    says whose memory was expected)."""
    return ValueError(f"copy: {label}: expected memory of {memory}, got {ctx!r}")


def stream_destroyed(index: int) -> ScopeClosedError:
    return ScopeClosedError(f"stream {index} was destroyed")


def context_closed(where: str) -> ScopeClosedError:
    return ScopeClosedError(f"{where}: this context is closed")


def invalid_handle(text: str, call: str) -> CudaError:
    """A driver object that is gone (unloaded, destroyed), as the driver says it."""
    return CudaError(INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", text, call=call)


def entry_not_found(name: str, entries: tuple[str, ...] | None, where: str) -> CudaError:
    """The kernel's code (``where``: "its source", "its PTX", "its module")
    defines no kernel ``name``; ``entries`` are those it does define, when
    known. The driver's ``CUDA_ERROR_NOT_FOUND``, with a message that says why."""
    if entries is None:
        found = ""
    elif entries:
        found = f" (it defines {', '.join(repr(e) for e in entries)})"
    else:
        found = " (it defines no kernel at all)"
    return CudaError(
        NOT_FOUND,
        "CUDA_ERROR_NOT_FOUND",
        f"kernel {name!r}: no kernel named {name!r} in {where}{found}; define it as "
        f'extern "C" __global__ void {name}(...), or pass the kernel\'s mangled name',
        call=f"cuModuleGetFunction({name!r})",
    )


def graph_exec_destroyed(graph_exec: object) -> CudaError:
    return invalid_handle(f"{graph_exec!r} was destroyed", "cuGraphLaunch")


def graph_consumed(graph: object) -> ValueError:
    return ValueError(f"graph: {graph!r} was already instantiated or used for an update")


# --------------------------------------------------------------------------- graph capture


def capture_refuses_alloc(nbytes: object, capturing: int) -> GraphCaptureError:
    return GraphCaptureError(
        f"allocating {nbytes} bytes while stream {capturing} captures a graph (allocate before capturing)"
    )


def already_capturing(capturing: int) -> GraphCaptureError:
    return GraphCaptureError(f"begin_capture: stream {capturing} of this context is already capturing")


def not_capturing(index: int) -> GraphCaptureError:
    return GraphCaptureError(f"end_capture: stream {index} is not capturing")


def not_capturable(label: str, index: int) -> GraphCaptureError:
    """A completion marker, wait or gate (``label``) on a capturing stream."""
    return GraphCaptureError(
        f"{label}: stream {index} is capturing a graph; completion markers, waits and gates "
        f"cannot be captured"
    )


def sync_copy_in_capture(index: int) -> GraphCaptureError:
    return GraphCaptureError(
        f"a synchronising device-to-host copy on stream {index} while it captures a graph"
    )
