"""The error hierarchy.

Invariants: every error trio_cuda raises on purpose derives from
:class:`TrioCudaError`, except ``TypeError`` for objects of the wrong kind and
``trio.Cancelled``, which is never wrapped. Messages name the argument, what was
expected and what was given.
"""

from __future__ import annotations


class TrioCudaError(Exception):
    """Base class of every trio_cuda error."""


class CudaError(TrioCudaError):
    """A driver call failed. ``code`` is the numeric CUresult, ``name`` its name
    (``"CUDA_ERROR_LAUNCH_FAILED"``) and ``text`` the driver's description."""

    def __init__(self, code: int, name: str, text: str = "", *, call: str = "") -> None:
        self.code = code
        self.name = name
        self.text = text
        self.call = call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}{name} ({code}): {text}" if text else f"{where}{name} ({code})")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_cuda_error, (type(self), self.code, self.name, self.text, self.call))


def _rebuild_cuda_error(cls: type[CudaError], code: int, name: str, text: str, call: str) -> CudaError:
    return cls(code, name, text, call=call)


class OutOfMemoryError(CudaError):
    """The device (or pinned host memory) could not satisfy an allocation."""


class LaunchError(CudaError):
    """A kernel could not be launched, or faulted while it ran."""


class KernelArgumentError(TrioCudaError, ValueError):
    """A kernel argument or launch configuration does not match the kernel."""


class AccessConflictError(TrioCudaError):
    """Under ``conflicts="error"``, a submission would race with in-flight work
    on another stream. Nothing was enqueued or retained."""


class CompletionUnknownError(TrioCudaError):
    """Completion of some work could not be established (sticky error, lost
    context). Its resources are quarantined and never freed; work that touches
    them fails with this error."""


class GraphCaptureError(TrioCudaError):
    """An operation cannot be captured into a CUDA graph."""


class ScopeClosedError(TrioCudaError):
    """The resource scope (or the array or stream) is closed."""


class MissingReferenceError(TrioCudaError):
    """A kernel without a ``reference=`` was submitted to the simulator, which
    runs a kernel's CPU behaviour and has nothing to run. Nothing was enqueued
    or retained. Give the kernel a ``reference=`` function, or
    ``reference=trio_cuda.NO_REFERENCE`` to run it there as a no-op on purpose."""


class DeviceUnavailableError(TrioCudaError, RuntimeError):
    """The device asked for is not there: no CUDA driver or device answers, the
    cuda backend is not installed, or the ordinal is out of range. The message
    names what was asked for, why it cannot be used, and what to do instead
    (``device="auto"`` falls back to the simulator, ``device="sim"`` forces it).
    ``device`` is what was asked for (``"cuda:1"``) and ``reason`` why it is not
    there, in a few words (``"no CUDA driver: libcuda.so.1 not found"``).
    Nothing was opened."""

    def __init__(self, message: str, *, device: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.device = device
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_unavailable, (type(self), str(self), self.device, self.reason))


def _rebuild_unavailable(
    cls: type[DeviceUnavailableError], message: str, device: str, reason: str
) -> DeviceUnavailableError:
    return cls(message, device=device, reason=reason)
