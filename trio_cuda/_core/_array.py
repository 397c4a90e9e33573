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
* Leases are kept in the allocation's lease table, each with the byte extent
  of the view it was taken through (``_extent``): work through any view,
  slice or read-only handle is ordered against work through every other view
  whose extent overlaps it, and never against disjoint ones. ``active`` counts
  leases per allocation, so freeing stays per allocation.
* A handle is C- or F-contiguous (``order``); views that would not be are
  refused. ``_offset`` is the handle's byte offset into its allocation;
  ``_extent`` (the bytes it can touch, see ``_extent``) and ``_whole``
  (whether they are the whole allocation) are computed once, when the
  handle is made: a handle's layout never changes.
* A handle's dtype is never a sub-array dtype: its shape joins the array's
  (``normalize_shape(shape, dtype)``, as NumPy does). Every dimension, and
  the bytes a shape spans with every dimension counted at least once, fit
  int64 (``MAX_EXTENT``), so DLPack and the CUDA Array Interface carry them
  as they are: allocations and views check before anything is made, and a
  borrowed DLPack tensor is checked before it is taken over (``_dlpack``).
* A borrowed allocation (``borrowed``) is never freed: "freeing" it drops the
  reference to the foreign object (``owner``) that keeps its memory alive.
* When unclosed-array tracking is on (``-W error::ResourceWarning`` or any
  other ``-W``/``PYTHONWARNINGS`` option naming ``ResourceWarning``, ``-X dev``,
  or :data:`TRACK_UNCLOSED` set), an owning handle (from an allocating call)
  that is garbage-collected while its scope is open emits a
  ``ResourceWarning`` naming where it was created. Garbage collection stays a
  correct way to drop a handle; the warning is a debugging aid.
"""

from __future__ import annotations

import enum
import logging
import math
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from trio.lowlevel import enable_ki_protection

from ._errors import CompletionUnknownError, ScopeClosedError
from ._final import NoPublicConstructor, final
from ._ops import Access

if TYPE_CHECKING:
    from types import TracebackType

    from ._extent import Extent
    from ._leases import RangeIndex
    from ._memory import MemoryTable
    from ._scope import ResourceScope
    from ._submit import Submission


log = logging.getLogger("trio_cuda")


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
        "borrowed",
        "exports",
        "handles",
        "index",
        "nbytes",
        "owner",
        "ptr",
        "readers",
        "scope",
        "state",
        "table",
        "writers",
    )

    def __init__(self, scope: ResourceScope, table: MemoryTable, ptr: int, nbytes: int) -> None:
        self.scope = scope
        #: the scope's memory table: handles are released through it
        self.table = table
        self.ptr = ptr
        self.nbytes = nbytes
        self.handles = 0
        self.state = AllocState.LIVE
        #: number of in-flight submissions holding a lease on it
        self.active = 0
        #: in-flight work later accesses must order after, with the extent of
        #: its write or read; an entry covered by a later write is dropped
        self.writers: dict[Submission, Extent] = {}
        self.readers: dict[Submission, Extent] = {}
        #: the tables' range index once they grew large (see ``_leases``)
        self.index: RangeIndex | None = None
        #: exports a foreign consumer still holds (see ``_export``)
        self.exports = 0
        #: "" for own memory; "read" or "write" for another library's memory
        #: (``trio_cuda.borrow``), which is never freed here
        self.borrowed = ""
        #: what keeps borrowed memory alive; dropped when the allocation is "freed"
        self.owner: object = None

    def __repr__(self) -> str:
        kind = " borrowed" if self.borrowed else ""
        return f"<Allocation 0x{self.ptr:x} {self.nbytes} B{kind} {self.state.value}>"


@final
class _GcInfo:
    """What a handle's finalizer needs (it must not reference the handle)."""

    __slots__ = ("export", "label", "site")

    def __init__(self) -> None:
        self.site: str | None = None
        self.label = ""
        self.export: Any = None


def _release_handle_from_gc(alloc: Allocation, info: _GcInfo | None = None) -> None:
    table = alloc.table
    try:
        if info is not None and info.export is not None:
            info.export.release()
        table.release_handle_later(alloc)
    finally:
        unclosed = info is not None and info.site is not None
        if unclosed and not table.closed and alloc.state is AllocState.LIVE:
            assert info is not None
            log.warning(
                "unclosed %s, created at %s, was garbage-collected while its scope was open",
                info.label,
                info.site,
            )
            warnings.warn(
                ResourceWarning(
                    f"unclosed {info.label}, created at {info.site}: it was garbage-collected while its "
                    f"scope was open; close it (arr.close() or 'async with arr') to free its memory "
                    f"deterministically"
                ),
                stacklevel=2,
            )


#: Track where owning arrays were created and warn when one is collected
#: unclosed: None (default) decides from ``sys.warnoptions`` and ``-X dev``.
TRACK_UNCLOSED: bool | None = None


def _tracking_unclosed() -> bool:
    if TRACK_UNCLOSED is not None:
        return TRACK_UNCLOSED
    if sys.flags.dev_mode:
        return True
    return any("ResourceWarning" in opt and not opt.startswith("ignore") for opt in sys.warnoptions)


def _creation_site() -> str:
    """``file:line in function`` of the first caller outside trio_cuda."""
    f = sys._getframe(2)
    while f.f_back is not None and str(f.f_globals.get("__name__", "")).startswith("trio_cuda"):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


Order = Literal["C", "F"]


def _trivial(shape: tuple[int, ...]) -> bool:
    """Both C- and F-contiguous: at most one dimension longer than 1 (or empty)."""
    return sum(1 for d in shape if d != 1) <= 1 or 0 in shape


def contiguous_strides(shape: tuple[int, ...], itemsize: int, order: str) -> tuple[int, ...]:
    """Byte strides of a ``order``-contiguous layout."""
    strides = [0] * len(shape)
    step = itemsize
    axes = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
    for i in axes:
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)


def normalize_order(order: object, label: str = "order") -> Order:
    if order == "C" or order == "F":
        return order
    raise ValueError(f"{label}: expected 'C' or 'F', got {order!r}")


def _basic_index(
    shape: tuple[int, ...], itemsize: int, order: str, key: object
) -> tuple[tuple[int, ...], int, Order]:
    """Shape, byte offset and order of ``arr[key]`` for basic indexing; raises
    unless the result is contiguous."""
    items = key if isinstance(key, tuple) else (key,)
    for k in items:
        if k is None or k is Ellipsis or isinstance(k, slice):
            continue
        if isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
            continue
        raise TypeError(
            f"index: expected ints, slices, None or Ellipsis (basic indexing; views must share memory), "
            f"got {type(k).__name__} ({k!r})"
        )
    if not any(k is Ellipsis for k in items):
        items = (*items, Ellipsis)  # always a view, never a scalar read
    # A stand-in with the same layout over one element: indexing it computes the
    # view's layout without touching memory.
    base = np.zeros(1, dtype=np.dtype((np.void, itemsize)))
    strides = contiguous_strides(shape, itemsize, order)
    fake = np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)
    try:
        view = fake[items]
    except IndexError as exc:
        raise IndexError(f"index: {exc} (shape {shape})") from None
    offset = int(view.__array_interface__["data"][0]) - int(base.__array_interface__["data"][0])
    vshape = tuple(int(d) for d in view.shape)
    if view.flags.c_contiguous and (order == "C" or not view.flags.f_contiguous or _trivial(vshape)):
        return vshape, offset, "C"
    if view.flags.f_contiguous:
        return vshape, offset, "F"
    raise ValueError(
        f"index: expected a contiguous view, got strides {view.strides} for shape {vshape} "
        f"(key {key!r}); copy the data with a kernel or through the host instead"
    )


@final
class DeviceArray(metaclass=NoPublicConstructor):
    """A typed, contiguous (C or F order) handle to device memory owned by a scope.

    Create one with ``scope.empty``, ``scope.zeros``, ``scope.full``,
    ``scope.empty_like`` or ``await scope.to_device``, or wrap another
    library's memory with :func:`trio_cuda.borrow`. ``close()`` (or ``async
    with arr``) drops the handle; the memory is freed once no other handle is
    open and no in-flight work uses it.

    Basic indexing (``arr[2:5]``, ``arr[i]``, ``arr[..., 0]`` on an F-order
    array), :meth:`reshape` and :attr:`T` return views that share the
    allocation and its leases; a view that would not be contiguous is refused.
    The array exports the CUDA Array Interface (v3) and DLPack; see
    :doc:`interop`.
    """

    __slots__ = (
        "__weakref__",
        "_alloc",
        "_cai",
        "_closed",
        "_dtype",
        "_extent",
        "_finalizer",
        "_info",
        "_offset",
        "_order",
        "_readonly",
        "_shape",
        "_whole",
    )

    _obtain = "use scope.empty() or scope.to_device()"

    _alloc: Allocation
    _shape: tuple[int, ...]
    _dtype: np.dtype[Any]
    _readonly: bool
    _closed: bool
    _offset: int
    _order: Order
    #: the bytes it can touch in its allocation (``_extent``), and whether
    #: that is all of the allocation, fixed when the handle is made
    _extent: Extent
    _whole: bool
    _info: _GcInfo | None
    _cai: dict[str, Any] | None
    _finalizer: weakref.finalize[Any, Any]

    @classmethod
    def _create(
        cls,
        alloc: Allocation,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        *,
        readonly: bool = False,
        order: Order = "C",
        offset: int = 0,
        track: bool = False,
    ) -> DeviceArray:
        """A new handle. ``track=True`` (owning handles): remember where it was
        created, for the ``ResourceWarning`` if it is collected unclosed."""
        self = object.__new__(cls)
        self._alloc = alloc
        self._shape = shape
        self._dtype = dtype
        self._readonly = readonly
        self._closed = False
        self._offset = offset
        self._order = "C" if order == "F" and _trivial(shape) else order
        n = dtype.itemsize
        for d in shape:
            n *= d
        if n:
            self._extent = (offset, offset + n)
            self._whole = not offset and n >= alloc.nbytes
        else:
            self._extent = ()
            self._whole = False
        self._cai = None
        alloc.handles += 1
        if track and _tracking_unclosed():
            info = self._info = _GcInfo()
            info.site = _creation_site()
            info.label = f"DeviceArray shape={shape} dtype={dtype}"
            self._finalizer = weakref.finalize(self, _release_handle_from_gc, alloc, info)
        else:
            self._info = None
            self._finalizer = weakref.finalize(self, _release_handle_from_gc, alloc)
        self._finalizer.atexit = False
        return self

    def _gc_info(self) -> _GcInfo:
        """This handle's finalizer info, created on demand (exports need it)."""
        info = self._info
        if info is None:
            info = self._info = _GcInfo()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _release_handle_from_gc, self._alloc, info)
            self._finalizer.atexit = False
        return info

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
    def order(self) -> Order:
        """``"C"`` (row-major) or ``"F"`` (column-major). An array that is both
        (at most one dimension longer than 1) reports ``"C"``."""
        return self._order

    @property
    def strides(self) -> tuple[int, ...]:
        """Byte strides, as NumPy reports them."""
        return contiguous_strides(self._shape, self._dtype.itemsize, self._order)

    @property
    def c_contiguous(self) -> bool:
        """True if the elements are laid out in C (row-major) order."""
        return self._order == "C" or _trivial(self._shape)

    @property
    def f_contiguous(self) -> bool:
        """True if the elements are laid out in Fortran (column-major) order."""
        return self._order == "F" or _trivial(self._shape)

    @property
    def borrowed(self) -> bool:
        """True for memory of another library wrapped by :func:`trio_cuda.borrow`."""
        return bool(self._alloc.borrowed)

    @property
    def readonly(self) -> bool:
        """True for a handle from :meth:`as_readonly`."""
        return self._readonly

    @property
    def closed(self) -> bool:
        """True once this handle was closed, or its scope exited."""
        return self._closed or self._alloc.state is AllocState.FREED or self._alloc.table.closed

    @property
    def quarantined(self) -> bool:
        """True if completion of work on this memory is unknown."""
        return self._alloc.state is AllocState.QUARANTINED

    @property
    def scope(self) -> ResourceScope:
        """The scope that owns the memory."""
        return self._alloc.scope

    # ------------------------------------------------------------------ views
    def _view(self, shape: tuple[int, ...], offset: int, order: Order) -> DeviceArray:
        return DeviceArray._create(
            self._alloc,
            shape,
            self._dtype,
            readonly=self._readonly,
            order=order,
            offset=self._offset + offset,
        )

    def __getitem__(self, key: object) -> DeviceArray:
        """A view of part of the array (basic indexing only: ints, slices,
        ``None``, ``...``). It shares the allocation and its leases, and is
        read-only if this handle is. Raises ``ValueError`` if the view would
        not be contiguous (e.g. a step, or a column of a C-order matrix)."""
        self._check_usable("index")
        shape, offset, order = _basic_index(self._shape, self._dtype.itemsize, self._order, key)
        return self._view(shape, offset, order)

    def reshape(self, *shape: object, order: Literal["C", "F", "A"] = "A") -> DeviceArray:
        """A view with another shape (one dimension may be -1). ``order`` is the
        index order of the reshape: "A" (default) is this array's own order;
        "C" needs a C-contiguous array and "F" an F-contiguous one."""
        self._check_usable("reshape")
        if order not in ("C", "F", "A"):
            raise ValueError(f"order: expected 'C', 'F' or 'A', got {order!r}")
        raw: object = shape[0] if len(shape) == 1 else shape
        if isinstance(raw, (int, np.integer)) and not isinstance(raw, bool):
            raw = (raw,)
        if not isinstance(raw, tuple | list):
            raise TypeError(f"shape: expected ints or a tuple of ints, got {raw!r}")
        dims = list(raw)
        unknown = [i for i, d in enumerate(dims) if isinstance(d, (int, np.integer)) and d == -1]
        if len(unknown) > 1:
            raise ValueError(f"shape: expected at most one -1, got {tuple(dims)}")
        if unknown:
            known = math.prod(int(d) for i, d in enumerate(dims) if i != unknown[0])
            if known == 0 or self.size % known:
                raise ValueError(f"shape: cannot reshape an array of size {self.size} into {tuple(dims)}")
            dims[unknown[0]] = self.size // known
        new = normalize_shape(tuple(dims), self._dtype)
        if math.prod(new) != self.size:
            raise ValueError(f"shape: cannot reshape an array of size {self.size} into {new}")
        want: Order = self._order if order == "A" else order
        if want == "C" and not self.c_contiguous:
            raise ValueError("reshape: order='C' needs a C-contiguous array, got an F-order one")
        if want == "F" and not self.f_contiguous:
            raise ValueError("reshape: order='F' needs an F-contiguous array, got a C-order one")
        return self._view(new, 0, want)

    def ravel(self) -> DeviceArray:
        """A one-dimensional view of the elements in memory order."""
        return self.reshape(-1)

    @property
    def T(self) -> DeviceArray:
        """The transposed view: reversed shape, the other order (no copy)."""
        self._check_usable("T")
        order: Order = "F" if self._order == "C" else "C"
        return self._view(self._shape[::-1], 0, order)

    def view(self, dtype: object) -> DeviceArray:
        """The same bytes as another dtype of the same item size (no copy). A
        sub-array dtype of that size adds its shape as trailing dimensions
        (as in NumPy: a ``(3,)`` float64 array viewed as ``("f4", (2,))`` is a
        ``(3, 2)`` float32 one); an F-order array cannot take them."""
        self._check_usable("view")
        dt, sub = split_dtype(dtype)
        itemsize = dt.itemsize * math.prod(sub)
        if itemsize != self._dtype.itemsize:
            given = dt if not sub else f"{np.dtype(dtype)}"  # type: ignore[call-overload]
            raise ValueError(
                f"dtype: expected a dtype of {self._dtype.itemsize} bytes (as {self._dtype}), "
                f"got {given} ({itemsize} bytes)"
            )
        shape = (*self._shape, *sub)
        if sub and self._order == "F" and not _trivial(self._shape):
            raise ValueError(
                f"dtype: a sub-array dtype adds trailing dimensions {sub}, which an F-order array cannot "
                f"take and stay contiguous; got {np.dtype(dtype)} for an F-order array of shape "  # type: ignore[call-overload]
                f"{self._shape} (view it as {dt} through a C-order array, e.g. arr.T)"
            )
        check_span(shape, dt)
        return DeviceArray._create(
            self._alloc, shape, dt, readonly=self._readonly, order=self._order, offset=self._offset
        )

    # ------------------------------------------------------------------ handles
    def as_readonly(self) -> DeviceArray:
        """A read-only handle to the same memory (no copy). Reads through it
        take ordinary shared read leases, so reads on several streams never
        conflict; writing through it raises."""
        self._check_usable("as_readonly")
        return DeviceArray._create(
            self._alloc, self._shape, self._dtype, readonly=True, order=self._order, offset=self._offset
        )

    def as_writable(self) -> DeviceArray:
        """Turn this read-only handle back into a writable one. Allowed only
        while it is the only open handle to its memory (no other handle, view
        or export, and not borrowed with ``access="read"``): then nobody can
        observe the memory change under them. This handle is closed and a
        writable one is returned. A writable handle returns itself."""
        self._check_usable("as_writable")
        if not self._readonly:
            return self
        alloc = self._alloc
        if alloc.borrowed == "read":
            raise ValueError(
                "as_writable: expected memory this scope may write, got memory borrowed with access='read'"
            )
        if alloc.handles != 1 or alloc.exports:
            others = alloc.handles - 1
            raise ValueError(
                f"as_writable: expected the only open handle to this memory, got {others} other open "
                f"handle(s) and {alloc.exports} export(s); close them first"
            )
        arr = DeviceArray._create(
            alloc, self._shape, self._dtype, order=self._order, offset=self._offset, track=True
        )
        if arr._info is not None and self._info is not None and self._info.site is not None:
            arr._info.site = self._info.site
        self.close()
        return arr

    @enable_ki_protection
    def close(self) -> None:
        """Drop this handle. Idempotent. The memory is freed once every other
        handle is closed and no in-flight work holds a lease on it.

        A handle exported through ``__cuda_array_interface__`` keeps its
        export until it is garbage-collected (the consumer holds a reference
        to it) or the scope exits, so that closing it never frees memory a
        consumer can still reach."""
        if self._closed:
            return
        self._closed = True
        info = self._info
        if info is not None and info.export is not None:
            info.site = None  # closed: no warning when it is collected later
            return  # the handle (and its export) is released when it is collected
        self._finalizer.detach()
        self._alloc.table.release_handle(self._alloc)

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
        if alloc.table.closed:
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
        order = " order=F" if self._order == "F" else ""
        kind = " borrowed" if self._alloc.borrowed else ""
        flags = f"{order}{ro}{kind}{state}"
        return f"<DeviceArray shape={self._shape} dtype={self._dtype}{flags} at 0x{self.ptr:x}>"

    # ------------------------------------------------------------------ interop
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface (version 3) of this handle.

        Reading it *exports* the handle: a read lease (read-only handle) or a
        write lease (writable handle) is taken and held until this handle is
        garbage-collected (consumers keep a reference to it); at scope exit an
        export still held is abandoned and its memory quarantined. ``stream``
        names a stream the consumer must synchronise with, or is None when no
        work on the memory is in flight. Inside an :func:`~trio_cuda.ops.external`
        fn whose ``reads``/``writes`` cover this view, it takes no lease and
        ``stream`` is None: the external's leases cover the consumer's work on
        the external's stream. Only on the
        ``cuda`` backend: on the simulator this raises ``AttributeError``, so
        ``hasattr`` is False. See :doc:`interop`."""
        from ._export import cuda_array_interface

        return cuda_array_interface(self)

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> object:
        """Export as a DLPack capsule (no copy). ``stream`` is the consumer's
        stream: it is made to wait, device-side, for in-flight work on the
        memory. The export holds a read (read-only handle) or write lease until
        the consumer deletes the tensor; at scope exit an export still held is
        abandoned and its memory quarantined. Inside an
        :func:`~trio_cuda.ops.external` fn whose ``reads``/``writes`` cover this
        view, it takes no lease: ``stream`` must be the external's (or -1),
        and a capsule not consumed when fn returns is expired. See
        :doc:`interop`."""
        from ._export import dlpack_export

        return dlpack_export(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(device_type, device_id)``: ``(2, ordinal)`` (kDLCUDA) on the cuda
        backend; ``(12, n)`` (kDLExtDev) for the simulator."""
        from ._export import dlpack_device

        return dlpack_device(self)


#: the largest dimension, and the largest byte span, of an array: DLPack and
#: the CUDA Array Interface carry shapes and strides as int64
MAX_EXTENT = 2**63 - 1


def normalize_shape(shape: object, dtype: object = None) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, each in ``[0, MAX_EXTENT]``. With the
    array's ``dtype``, a sub-array dtype's shape is appended (as NumPy does:
    ``(3,)`` of ``("f4", (2,))`` is ``(3, 2)`` of float32; see
    :func:`normalize_dtype`) and the byte span is bounded (:func:`check_span`)."""
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
        if d > MAX_EXTENT:
            raise ValueError(f"shape: expected dimensions of at most 2**63 - 1 (int64), got {shape!r}")
        out.append(int(d))
    if dtype is None:
        return tuple(out)
    element, sub = split_dtype(dtype)
    full = (*out, *sub)
    check_span(full, element)
    return full


def check_span(shape: tuple[int, ...], dtype: np.dtype[Any], label: str = "shape") -> None:
    """Raise ``ValueError`` unless a contiguous ``shape`` of ``dtype`` spans at
    most ``MAX_EXTENT`` bytes, counting every dimension at least once (as
    NumPy does): its size and its strides then fit int64, even when it holds
    no element."""
    span = dtype.itemsize
    for d in shape:
        span *= max(d, 1)
    if span > MAX_EXTENT:
        raise ValueError(
            f"{label}: expected an array of at most 2**63 - 1 bytes (every dimension counted at least "
            f"once, as NumPy does), got shape {shape} of {dtype} ({span} bytes)"
        )


def split_dtype(dtype: object) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The element dtype of ``dtype`` (checked as :func:`normalize_dtype`
    does) and the shape a sub-array dtype adds to an array's (``()`` for
    others): ``("f4", (2,))`` is float32 and ``(2,)``."""
    try:
        dt: np.dtype[Any] = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"dtype: expected a NumPy dtype, got {dtype!r}") from None
    sub: tuple[int, ...] = ()
    while dt.subdtype is not None:  # nested sub-arrays: outer dimensions first
        dt, dims = dt.subdtype
        sub += tuple(int(d) for d in dims)
    if dt.hasobject:
        raise TypeError(f"dtype: object dtypes cannot live on a device, got {dt}")
    if dt.itemsize == 0:
        raise TypeError(f"dtype: expected a dtype with a size, got {dt}")
    return dt, sub


def normalize_dtype(dtype: object) -> np.dtype[Any]:
    """The element dtype of an array of ``dtype``: a sub-array dtype (``("f4",
    (2,))``) gives its element (float32), whose shape the array's shape takes
    (``normalize_shape(shape, dtype)``), as in NumPy."""
    return split_dtype(dtype)[0]


def check_copy(dst: object, src: object) -> None:
    """Validate an ``ops.copy`` pair; raises before anything is built."""
    for name, obj in (("dst", dst), ("src", src)):
        if isinstance(obj, DeviceArray):
            if name == "dst":
                obj._check_writable("copy: dst")
            else:
                obj._check_usable("copy: src")
        elif isinstance(obj, np.ndarray):
            if name == "dst" and not obj.flags.writeable:
                raise ValueError("copy: dst: expected a writable NumPy array, got a read-only one")
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
    if isinstance(dst, DeviceArray) and isinstance(src, DeviceArray):
        if dst._order != src._order and not _trivial(dst._shape):
            raise ValueError(
                f"copy: expected dst and src in the same memory order, got dst order {dst._order} and "
                f"src order {src._order} (a device-side transpose needs a kernel)"
            )
        if dst._alloc is src._alloc and dst.nbytes:
            lo, hi = dst._offset, dst._offset + dst.nbytes
            if lo < src._offset + src.nbytes and src._offset < hi and dst._offset != src._offset:
                raise ValueError(
                    "copy: dst and src overlap (views of one allocation); copy through a temporary"
                )


def host_layout(arr: DeviceArray, host: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """A C-contiguous array whose bytes are ``host``'s elements in ``arr``'s
    memory order, sharing ``host``'s memory; None if that needs a copy."""
    if arr._order == "C" or _trivial(arr._shape):
        return host if host.flags.c_contiguous else None
    return host.T if host.flags.f_contiguous else None


def h2d_source(dst: DeviceArray, src: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """What a host-to-device copy into ``dst`` reads: ``src``'s own memory
    when it is already in ``dst``'s order, else a copy staged in that order."""
    host = host_layout(dst, src)
    if host is None:
        host = host_layout(dst, np.array(src, order=dst._order))
        assert host is not None
    return host


__all__ = ["Access", "AllocState", "Allocation", "DeviceArray"]


def check_usable(arr: DeviceArray, label: str) -> None:
    """Raise unless ``arr`` may be used now: open, its memory live and its
    scope open (``label`` names the caller in the message)."""
    arr._check_usable(label)
