"""Direct driver calls on the launch path: the compiled ``_direct`` module
where it was built at install, else cuda.bindings' wrappers (the reference).

Invariants:

* The choice is made once per process, when the first CUDA context opens
  (:func:`entries`): direct calls when ``_direct`` imports, the driver hands
  out both entry points (``cuGetProcAddress``), and ``TRIO_CUDA_PURE`` is not
  set (to anything but ``0``). Contexts read it when they open; tests may
  reset it between scopes (:func:`reset`).
* Both paths make the same driver calls with the same arguments, and return
  the same ``CUresult``; only the Python in between differs. With direct
  calls, the context's ``launch``, ``record_marker`` and ``poll_marker`` are
  compiled (:func:`hot_methods`, unless :data:`HOT` is off): each makes its
  Python method's steps for the common case and calls that method for the
  rest. A direct call is
  prepared once (a launch per launch and stream, a flag write per stream)
  from plain integers; the caller keeps the function, stream and argument
  memory alive, as it does for the wrappers' arguments.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Any

from .bindings import cu

try:
    from . import _direct as _ext  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install, or TRIO_CUDA_PURE=1 then)
    _ext = None

log = logging.getLogger("trio_cuda")

#: the driver API version whose entry points are asked for (12.0: the
#: ``_v2`` ABI of ``cuStreamWriteValue32``, the one cuda.bindings calls)
_API_VERSION = 12000
_UNDECIDED: Any = object()
#: whether a context with direct calls takes the compiled hot methods
#: (:func:`hot_methods`); read when a context opens (tests and A/Bs turn it off)
HOT = True
_entries: Any = _UNDECIDED


def pure_requested() -> bool:
    """Whether ``TRIO_CUDA_PURE`` asks for the wrappers."""
    return os.environ.get("TRIO_CUDA_PURE", "").strip() not in ("", "0")


def built() -> bool:
    """Whether the compiled module is present in this installation."""
    return _ext is not None


def entries() -> tuple[int, int, int] | None:
    """The addresses of ``cuLaunchKernel``, ``cuStreamWriteValue32`` and
    ``cuStreamWaitValue32`` for direct calls, or None: use the wrappers
    (decided once; see the module docstring)."""
    global _entries
    if _entries is _UNDECIDED:
        _entries = _resolve()
        log.debug(
            "CUDA launch path: %s",
            "direct driver calls" if _entries is not None else "cuda.bindings wrappers",
        )
    return _entries  # type: ignore[no-any-return]


def reset(*, pure: bool | None = None) -> None:
    """Decide again at the next context (tests): ``pure`` True forces the
    wrappers, False the direct calls where they are available, None reads
    the environment again."""
    global _entries
    _entries = None if pure else _UNDECIDED if pure is None else _resolve(force=True)


def _resolve(*, force: bool = False) -> tuple[int, int, int] | None:
    if _ext is None or cu is None or (pure_requested() and not force):
        return None
    found = []
    for name in (b"cuLaunchKernel", b"cuStreamWriteValue32", b"cuStreamWaitValue32"):
        try:
            err, pfn, _ = cu.cuGetProcAddress(name, _API_VERSION, 0)
        except Exception:  # an older binding or no driver: the wrappers work regardless
            log.debug("cuGetProcAddress(%r) failed; the launch path uses the wrappers", name, exc_info=True)
            return None
        if err or not pfn:
            return None
        found.append(int(pfn))
    return found[0], found[1], found[2]


def launcher(
    entry: int,
    function: int,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_mem: int,
    stream: int,
    params: int,
) -> Any:
    """A prepared ``cuLaunchKernel``: calling it launches, returning the ``CUresult`` as an int."""
    assert _ext is not None
    return _ext.Launch(entry, function, *grid, *block, shared_mem, stream, params)


def writer(entry: int, stream: int, addr: int) -> Any:
    """A prepared ``cuStreamWriteValue32`` of one flag: ``w(value)`` enqueues
    the write of ``value`` (modulo 2**32) and returns the ``CUresult`` as an
    int. With the entry of ``cuStreamWaitValue32`` (the same prototype; flags
    0 is ``CU_STREAM_WAIT_VALUE_GEQ``), ``w(value)`` makes ``stream`` wait
    until the flag is at least ``value``."""
    assert _ext is not None
    return _ext.Writer(entry, stream, addr)


def launch_packed() -> Any:
    """``cuLaunchKernel`` from packed parameters, for launches enqueued once:
    ``launch_packed(entry, function, gx, gy, gz, bx, by, bz, shared_mem,
    stream, arena, offsets)`` reads parameter i at ``offsets`` (native uint32
    each, see :func:`packed_offsets`) of ``arena`` (bytes), returning the
    ``CUresult`` as an int."""
    assert _ext is not None
    return _ext.launch_packed


def packed_offsets(slots: Any) -> bytes | None:
    """The ``offsets`` argument of :func:`launch_packed` for a parameter plan's
    slots, or None where a slot needs more than the 16-byte alignment a
    bytes object's data has."""
    if any(slot.align > 16 for slot in slots):
        return None
    return struct.pack(f"={len(slots)}I", *(slot.offset for slot in slots))


_trusted = False


def _trust_hot_methods() -> None:
    """Tell the core's compiled submission that the hot methods protect their
    own Python from Ctrl-C (each falls back to a method marked
    ``enable_ki_protection``), so that a frameless ``submit`` calls them
    directly rather than through its protected trampoline."""
    global _trusted
    if not _trusted:
        from ..._core import _compiled

        if _compiled.ext is not None:
            _compiled.ext.trust((_ext.HotLaunch, _ext.HotRecord, _ext.HotPoll, _ext.HotNotify))
        _trusted = True


def hot_methods(kernels: Any, table: Any) -> tuple[Any, Any, Any, Any] | None:
    """The compiled ``launch``, ``record_marker``, ``poll_marker`` and
    ``notify_submitted`` of a context (``kernels`` a
    :class:`~.launch.Kernels`, ``table`` its :class:`~.streams.StreamTable`),
    or None: the Python methods (no direct calls, or :data:`HOT` off). Each
    calls its Python method, the reference, for anything but the common
    case: a launch prepared on its stream or a plain launch's first enqueue;
    an eager flag write on a stream of the table; a plain marker's flag
    read; a notification with no new marker to tell of."""
    if _ext is None or not HOT or kernels._direct is None:
        return None
    from ..._core._driver import DONE, PENDING
    from . import primary
    from .launch import CudaFunction
    from .streams import CudaMarker, CudaStream

    _trust_hot_methods()
    entry = kernels._direct
    launch = _ext.HotLaunch(kernels, kernels.launch, table, CudaStream, CudaFunction, primary, entry)
    record = _ext.HotRecord(table, table.record_marker, CudaStream, CudaMarker, primary)
    poll = _ext.HotPoll(table, table.poll_marker, CudaStream, CudaMarker, DONE, PENDING)
    notify = _ext.HotNotify(table, table.notify_submitted)
    return launch, record, poll, notify
