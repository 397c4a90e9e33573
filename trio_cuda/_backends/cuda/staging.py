"""Pinned host staging of the cuda backend: host->device and device->host copies.

Invariants:

* ``copy_h2d`` copies the source into a pinned buffer before it returns, so
  the caller may change the source at once. ``copy_d2h`` copies into a pinned
  buffer; its finisher copies that into the destination at retirement
  (``direct=True``: straight into pageable memory, which the driver completes
  before the call returns).
* A pinned buffer is reused only once the GPU is done with it: it returns to
  the pool when the core drops its token or finisher (after retirement), and
  carries a guard (stream, marker sequence) that must have completed before it
  is handed out again. This also covers ``unsafe.async_on``, which drops
  tokens at once.
* Finalizers only return buffers to the pool; a broken (sticky) context leaks
  them. At most ``max_cached`` bytes stay cached.
* :class:`StagingPool` owns the buffers, their counts and the copies through
  them; tokens and finishers hold the pool, never the context.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, final

import numpy as np

from ..._core._driver import Finisher, StreamHandle
from ..._core._errors import OutOfMemoryError
from .. import _common
from .bindings import cu
from .errors import OOM, cuda_error
from .graphs import relaxed_capture
from .streams import _HALF, _M32, CudaStream

if TYPE_CHECKING:
    from .state import ContextState
    from .streams import StreamTable

__all__ = ["StagingPool"]


class _Pinned:
    __slots__ = ("addr", "guard", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size
        self.guard: tuple[CudaStream, int] | None = None


def _size_class(n: int) -> int:
    if n <= 4096:
        return 4096
    if n <= 1 << 26:
        return 1 << (n - 1).bit_length()
    step = 1 << 24
    return (n + step - 1) // step * step


@final
class StagingPool:
    """The pinned host buffers of one context, reused by size class (powers
    of two up to 64 MiB, then multiples of 16 MiB), and the host copies that
    go through them. At most ``max_cached`` bytes stay cached."""

    __slots__ = (
        "_state",
        "_stream",
        "_table",
        "allocated",
        "cached",
        "closed",
        "free",
        "max_cached",
        "outstanding",
    )

    def __init__(self, state: ContextState, table: StreamTable, max_cached: int = 256 << 20) -> None:
        self._state = state
        self._table = table
        self._stream = table.stream
        self.max_cached = max_cached
        self.free: dict[int, list[_Pinned]] = {}
        self.cached = 0
        self.outstanding = 0
        self.allocated = 0
        self.closed = False

    def get(self, n: int) -> _Pinned:
        size = _size_class(n)
        bucket = self.free.get(size)
        if bucket:
            for i in range(len(bucket) - 1, -1, -1):
                buf = bucket[i]
                g = buf.guard
                if g is None or ((g[0].mv[g[0].slot] - g[1]) & _M32) < _HALF:
                    del bucket[i]
                    self.cached -= size
                    self.outstanding += 1
                    buf.guard = None
                    return buf
        self._state.make_current_if_needed()
        with relaxed_capture(self._table):  # a pinned allocation is refused on a capturing thread
            err, addr = cu.cuMemHostAlloc(size, cu.CU_MEMHOSTALLOC_PORTABLE)
        if err:
            raise cuda_error(err, f"cuMemHostAlloc({size})", OutOfMemoryError if int(err) == OOM else None)
        self.allocated += size
        self.outstanding += 1
        return _Pinned(int(addr), size)

    def put(self, buf: _Pinned) -> None:
        self.outstanding -= 1
        if self.closed:
            self._release(buf)
            return
        g = buf.guard
        reusable = g is None or ((g[0].mv[g[0].slot] - g[1]) & _M32) < _HALF
        if reusable and self.cached + buf.size > self.max_cached:
            self._release(buf)
            return
        self.free.setdefault(buf.size, []).append(buf)
        self.cached += buf.size

    def _release(self, buf: _Pinned) -> None:
        if self._state.sticky is not None:
            return  # leak: the context is broken
        try:
            cu.cuMemFreeHost(buf.addr)
            self.allocated -= buf.size
        except Exception:  # pragma: no cover - best effort
            pass

    def close(self) -> None:
        self.closed = True
        for bucket in self.free.values():
            for buf in bucket:
                self._release(buf)
        self.free.clear()
        self.cached = 0

    # ------------------------------------------------------------------ copies
    def statistics(self) -> dict[str, int]:
        return {"allocated": self.allocated, "cached": self.cached, "outstanding": self.outstanding}

    def copy_h2d(self, stream: StreamHandle, dst: int, src: np.ndarray[Any, Any]) -> object | None:
        s = self._stream(stream)
        n = src.nbytes
        if n == 0:
            return None
        buf = self.get(n)
        token = _StagingToken(self, buf)
        ctypes.memmove(buf.addr, src.ctypes.data, n)
        (err,) = cu.cuMemcpyHtoDAsync(dst, buf.addr, n, s.cu)
        if err:
            self._state.fail(err, "cuMemcpyHtoDAsync")
        buf.guard = (s, s.seq + 1)
        return token

    def copy_d2h(
        self, stream: StreamHandle, dst: np.ndarray[Any, Any], src: int, *, direct: bool = False
    ) -> Finisher | None:
        s = self._stream(stream)
        _common.check_host_dst(dst)
        if direct and s is self._table.capturing:
            raise _common.sync_copy_in_capture(s.index)
        n = dst.nbytes
        if n == 0:
            return None
        if direct:
            # Unsafe path: into pageable memory the driver returns only once the
            # copy (and the work before it on the stream) completed.
            (err,) = cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, n, s.cu)
            if err:
                self._state.fail(err, "cuMemcpyDtoHAsync")
            return None
        buf = self.get(n)
        token = _StagingToken(self, buf)
        (err,) = cu.cuMemcpyDtoHAsync(buf.addr, src, n, s.cu)
        if err:
            self._state.fail(err, "cuMemcpyDtoHAsync")
        buf.guard = (s, s.seq + 1)
        return _D2HFinisher(token, dst.ctypes.data, n)


class _StagingToken:
    """Retained by the core until the copy completed; dropping it returns the
    pinned buffer to the pool."""

    __slots__ = ("buf", "pool")

    def __init__(self, pool: StagingPool, buf: _Pinned) -> None:
        self.pool = pool
        self.buf = buf

    def __del__(self) -> None:
        try:
            self.pool.put(self.buf)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class _D2HFinisher:
    """Copies pinned staging into the destination at retirement. Dropping it
    (after it ran, or when the work failed) returns the buffer to the pool."""

    __slots__ = ("dst", "nbytes", "token")

    def __init__(self, token: _StagingToken, dst: int, nbytes: int) -> None:
        self.token = token
        self.dst = dst
        self.nbytes = nbytes

    def __call__(self) -> None:
        ctypes.memmove(self.dst, self.token.buf.addr, self.nbytes)
