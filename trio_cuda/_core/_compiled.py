"""The optional compiled hot paths of a kernel launch (``_claunch``): making
it (``Kernel.launch``, the builder, the typed-launch fast path), submitting
it (and ``unsafe.async_on``), ``run``'s start up to its first checkpoint,
an awaiting task's first look, the scan with its marker recording, and the
common cases of taking its leases and retiring it.

Invariants:

* The choice is made once per process, at import: the compiled paths are
  used when ``_claunch`` was built at install and imports, and
  ``TRIO_CUDA_PURE`` is not set (to anything but ``0``); otherwise :data:`ext`
  is None and the pure-Python paths run. Those are the reference: the
  compiled ones make the same launches and raise the same errors
  (``tests/core/test_builder_compiled.py``, ``test_launch_fast.py``,
  ``test_lease_paths.py`` compare them over random programs).
* ``_claunch`` is configured here, once, with the types and constants its
  paths read; the builder and the kernels ask it for their paths
  (``make_base``, ``typed``, ``launch_method``), and the submission, scope
  and completion modules configure and take theirs (``take_whole``,
  ``submit_launch``, ``enqueue_unsafe``, ``retire_done``, ``scan``,
  ``prepare``, ``look``, ``begin``).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

from ._array import Allocation, AllocState, DeviceArray
from ._launch import ArrayModes, KernelLaunch, PreparedLaunch, _merge_accesses
from ._memory import MemoryTable
from ._ops import Access

__all__ = ["ext", "pure_requested"]

log = logging.getLogger("trio_cuda")


def pure_requested() -> bool:
    """Whether ``TRIO_CUDA_PURE`` asks for the pure-Python paths."""
    return os.environ.get("TRIO_CUDA_PURE", "").strip() not in ("", "0")


def _load() -> ModuleType | None:
    if pure_requested():
        return None
    try:
        from . import _claunch  # type: ignore[attr-defined]
    except ImportError:  # not built: no compiler at install, or TRIO_CUDA_PURE=1 then
        return None
    module: ModuleType = _claunch
    try:
        _configure(module)
    except Exception as exc:  # a build that does not fit this interpreter: the pure-Python paths
        log.warning("the compiled launch paths are turned off (%s: %s)", type(exc).__name__, exc)
        return None
    return module


def _configure(module: ModuleType) -> None:
    module.configure(
        {
            "DeviceArray": DeviceArray,
            "Allocation": Allocation,
            "MemoryTable": MemoryTable,
            "FREED": AllocState.FREED,
            "LIVE": AllocState.LIVE,
            "WRITE": Access.WRITE,
            "merge_accesses": _merge_accesses,
            "PreparedLaunch": PreparedLaunch,
            "KernelLaunch": KernelLaunch,
            "ArrayModes": ArrayModes,
        }
    )


#: the compiled module, configured; None where the pure-Python paths run
ext: ModuleType | None = _load()
