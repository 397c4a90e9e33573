"""Escape hatches that trade safety for speed.

Invariant: nothing here takes a lease, retains an owner or records a marker.
When a function returns (or raises), the runtime holds nothing of the work; the
caller keeps every array alive and orders every access itself.
"""

from __future__ import annotations

from typing import TypeVar

from ._core._ops import DeviceOp
from ._core._stream import Stream

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
    return stream.scope._enqueue_unsafe(op, stream)
