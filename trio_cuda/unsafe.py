"""Escape hatches that trade safety for speed.

Invariant: nothing here takes a lease, retains an owner or records a marker.
When a function returns (or raises), the runtime holds nothing of the work; the
caller keeps every array alive and orders every access itself.
"""

from __future__ import annotations

from _thread import get_ident
from typing import Any, TypeVar

from ._core._builder import LaunchBuilder
from ._core._launch import KernelLaunch
from ._core._ops import DeviceOp
from ._core._stream import Stream
from ._core._submit import EnqueueContext

T = TypeVar("T")

__all__ = ["async_on"]


def async_on(op: DeviceOp[T], stream: Stream) -> T:
    """Enqueue ``op`` on ``stream`` synchronously and return its output.

    No lease, owner or completion marker is taken: the caller must keep every
    array, kernel and host buffer alive until the work completed, and order
    conflicting accesses on other streams. Only the checks that need no
    bookkeeping run (the scope is open; the launch fits the device).
    ``ops.host_closure`` is refused (it needs the completion handoff).
    """
    if type(stream) is not Stream:
        raise TypeError(f"stream: expected a Stream, got {type(stream).__name__}")
    if type(op) is KernelLaunch:
        scope = stream._scope
        if scope._closing or get_ident() != scope._thread:
            scope._check_open("async_on")
        prepared = op.prepared
        scope._driver.launch(stream.handle, scope._kernel_function(prepared), prepared)
        return op._output  # type: ignore[return-value]
    if not isinstance(op, DeviceOp):
        if isinstance(op, LaunchBuilder):
            raise TypeError(
                "op: a LaunchBuilder is inert and cannot be scheduled; call .finalize_unchecked() first"
            )
        raise TypeError(f"op: expected a DeviceOp, got {type(op).__name__}")
    stream._scope._check_open("async_on")
    out: Any = op._enqueue(EnqueueContext(stream._scope, stream, None))
    return out  # type: ignore[no-any-return]
