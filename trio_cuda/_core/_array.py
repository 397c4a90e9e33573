"""Device allocations and the DeviceArray handles that name them.

Invariants:

* An :class:`Allocation` is freed exactly once, and only when it has no open
  handle *and* no lease held by in-flight work (rule 9), or at scope exit once
  every submission of the scope retired.
* A quarantined allocation is never freed; work that touches it fails with
  :class:`~trio_cuda.CompletionUnknownError`.
* Closing a handle, or losing it to garbage collection, only drops the handle;
  the free is deferred to the retirement of the last use. Garbage collection
  never mutates runtime state directly: it queues the release for the scope's
  completion-handoff task.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any, final

import numpy as np

from ._errors import CompletionUnknownError, ScopeClosedError
from ._ops import Access

if TYPE_CHECKING:
    from types import TracebackType

    from ._scope import ResourceScope
    from ._submit import Submission


class AllocState(enum.Enum):
    LIVE = "live"
    FREED = "freed"
    QUARANTINED = "quarantined"


@final
class Allocation:
    """One device allocation and its lease table."""

    __slots__ = (
        "__weakref__",
        "active",
        "handles",
        "last_writer",
        "nbytes",
        "ptr",
        "readers",
        "scope",
        "state",
    )

    def __init__(self, scope: ResourceScope, ptr: int, nbytes: int) -> None:
        self.scope = scope
        self.ptr = ptr
        self.nbytes = nbytes
        self.handles = 0
        self.state = AllocState.LIVE
        #: number of in-flight submissions holding a lease on it
        self.active = 0
        #: in-flight work later accesses must order after
        self.last_writer: Submission | None = None
        self.readers: dict[Submission, None] = {}

    def __repr__(self) -> str:
        return f"<Allocation 0x{self.ptr:x} {self.nbytes} B {self.state.value}>"


def _release_handle_from_gc(alloc: Allocation) -> None:
    alloc.scope._release_handle_later(alloc)


class DeviceArray:
    """A typed, C-contiguous handle to device memory owned by a scope.

    Create one with ``scope.empty``, ``scope.zeros``, ``scope.full`` or
    ``await scope.to_device``. ``close()`` (or ``async with arr``) drops the
    handle; the memory is freed once no in-flight work uses it.
    """

    __slots__ = ("__weakref__", "_alloc", "_closed", "_dtype", "_finalizer", "_offset", "_readonly", "_shape")

    _alloc: Allocation
    _shape: tuple[int, ...]
    _dtype: np.dtype[Any]
    _readonly: bool
    _closed: bool
    _offset: int
    _finalizer: weakref.finalize[Any, Any]

    def __init__(self) -> None:
        raise TypeError("DeviceArray has no public constructor; use scope.empty() or scope.to_device()")

    @classmethod
    def _create(
        cls, alloc: Allocation, shape: tuple[int, ...], dtype: np.dtype[Any], *, readonly: bool = False
    ) -> DeviceArray:
        self = object.__new__(cls)
        self._alloc = alloc
        self._shape = shape
        self._dtype = dtype
        self._readonly = readonly
        self._closed = False
        self._offset = 0
        alloc.handles += 1
        self._finalizer = weakref.finalize(self, _release_handle_from_gc, alloc)
        self._finalizer.atexit = False
        return self

    # ------------------------------------------------------------------ facts
    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        """The NumPy dtype of the elements."""
        return self._dtype

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self._shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the array's elements."""
        return self.size * self._dtype.itemsize

    @property
    def ptr(self) -> int:
        """Device address of the first element."""
        return self._alloc.ptr + self._offset

    @property
    def readonly(self) -> bool:
        """True for a handle from :meth:`as_readonly`."""
        return self._readonly

    @property
    def closed(self) -> bool:
        """True once this handle was closed, or its scope exited."""
        return self._closed or self._alloc.state is AllocState.FREED or self._alloc.scope._closed

    @property
    def quarantined(self) -> bool:
        """True if completion of work on this memory is unknown."""
        return self._alloc.state is AllocState.QUARANTINED

    @property
    def scope(self) -> ResourceScope:
        """The scope that owns the memory."""
        return self._alloc.scope

    # ------------------------------------------------------------------ handles
    def as_readonly(self) -> DeviceArray:
        """A read-only handle to the same memory (no copy). Reads through it
        take ordinary shared read leases."""
        self._check_usable("as_readonly")
        arr = DeviceArray._create(self._alloc, self._shape, self._dtype, readonly=True)
        arr._offset = self._offset
        return arr

    def close(self) -> None:
        """Drop this handle. Idempotent. The memory is freed once every other
        handle is closed and no in-flight work holds a lease on it."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._alloc.scope._release_handle(self._alloc)

    async def __aenter__(self) -> DeviceArray:
        import trio

        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        import trio

        self.close()
        await trio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ checks
    def _check_usable(self, label: str) -> None:
        if self._closed:
            raise ScopeClosedError(f"{label}: the array is closed")
        alloc = self._alloc
        if alloc.scope._closed:
            raise ScopeClosedError(f"{label}: the array's scope has exited")
        if alloc.state is AllocState.QUARANTINED:
            raise CompletionUnknownError(
                f"{label}: completion of earlier work on this array is unknown; its memory is "
                f"quarantined (0x{alloc.ptr:x}, {alloc.nbytes} bytes)"
            )

    def _check_writable(self, label: str) -> None:
        self._check_usable(label)
        if self._readonly:
            raise ValueError(f"{label}: expected a writable array, got a read-only one (from as_readonly())")

    def __repr__(self) -> str:
        state = " closed" if self.closed else (" quarantined" if self.quarantined else "")
        ro = " readonly" if self._readonly else ""
        return f"<DeviceArray shape={self._shape} dtype={self._dtype}{ro}{state} at 0x{self.ptr:x}>"


def normalize_shape(shape: object) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        dims: tuple[object, ...] = (shape,)
    elif isinstance(shape, tuple | list):
        dims = tuple(shape)
    else:
        raise TypeError(f"shape: expected an int or a tuple of ints, got {shape!r}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(f"shape: expected non-negative ints, got {shape!r}")
        out.append(int(d))
    return tuple(out)


def normalize_dtype(dtype: object) -> np.dtype[Any]:
    try:
        dt: np.dtype[Any] = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"dtype: expected a NumPy dtype, got {dtype!r}") from None
    if dt.hasobject:
        raise TypeError(f"dtype: object dtypes cannot live on a device, got {dt}")
    if dt.itemsize == 0:
        raise TypeError(f"dtype: expected a dtype with a size, got {dt}")
    return dt


def check_copy(dst: object, src: object) -> None:
    """Validate an ``ops.copy`` pair; raises before anything is built."""
    for name, obj in (("dst", dst), ("src", src)):
        if isinstance(obj, DeviceArray):
            if name == "dst":
                obj._check_writable("copy: dst")
            else:
                obj._check_usable("copy: src")
        elif isinstance(obj, np.ndarray):
            if name == "dst" and not (obj.flags.c_contiguous and obj.flags.writeable):
                raise ValueError("copy: dst: expected a writable C-contiguous NumPy array")
        else:
            raise TypeError(
                f"copy: {name}: expected a DeviceArray or a NumPy array, got {type(obj).__name__}"
            )
    d_shape = dst.shape  # type: ignore[attr-defined]
    s_shape = src.shape  # type: ignore[attr-defined]
    if tuple(d_shape) != tuple(s_shape):
        raise ValueError(f"copy: expected dst and src of the same shape, got {d_shape} and {s_shape}")
    if dst.dtype != src.dtype:  # type: ignore[attr-defined]
        raise ValueError(
            f"copy: expected dst and src of the same dtype, got {dst.dtype} and {src.dtype}"  # type: ignore[attr-defined]
        )


__all__ = ["Access", "AllocState", "Allocation", "DeviceArray"]
