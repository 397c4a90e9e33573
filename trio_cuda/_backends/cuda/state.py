"""The state of a :class:`~.context.CudaContext`, declared once, and the helpers
every part of it uses.

Invariants:

* :class:`ContextState` is the base of every part of the context (``streams``,
  ``completion``, ``staging``, ``graphs``, ``launch``). It declares the
  attributes that :meth:`CudaContext.__init__ <.context.CudaContext>` sets;
  it holds no state and creates nothing itself.
* Each part subclasses the parts whose methods it calls, so the class graph
  is the call graph: ``streams`` over this module; ``completion``,
  ``staging`` and ``graphs`` over ``streams``; ``launch`` over ``graphs``;
  ``context`` over all of them.
* A failed driver call raises through :meth:`ContextState._fail`; a kernel
  fault (a launch error other than a resource or configuration one) makes
  the context sticky for good.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from .. import _common
from . import primary as _primary
from .bindings import cu
from .errors import LAUNCH_CODES, cuda_error

if TYPE_CHECKING:
    import trio

    from ..._core._driver import Capabilities, DeviceInfo
    from ..._core._errors import CudaError
    from .graphs import CudaGraphExec
    from .launch import CudaFunction
    from .staging import _StagingPool
    from .streams import CudaStream, _FlagPage
    from .waiters import WaiterPool

__all__ = ["ContextState"]


class ContextState:
    """What every part of a CUDA context shares."""

    # the device and the driver
    ordinal: int
    info: DeviceInfo
    capabilities: Capabilities
    driver_version: int
    _dev: Any
    _ctx: Any
    _pool: Any  # the device's default memory pool
    _aux: Any  # the internal stream of stream-ordered frees
    _closed: bool
    _sticky: CudaError | None
    # streams, markers, gates (``streams``)
    _pages: list[_FlagPage]
    _pages_shared: bool
    _streams: dict[CudaStream, None]
    _dirty: list[CudaStream]
    _hot: list[CudaStream]
    _new_head: bool
    _free_events: list[Any]
    _marker_events: list[Any]
    _all_events: list[Any]
    _scratch_event: Any
    marker_mode: str
    record_events: bool
    wait_marker_mode: str
    # completion waiting (``completion``)
    _waiters: WaiterPool
    _wake_ev: trio.Event | None
    _token: trio.lowlevel.TrioToken | None
    _last_error_check: float
    wait_strategy: str
    spin_budget: float
    inline_spin: float
    error_check_interval: float
    poll_interval: float
    max_poll_interval: float
    sleep_max_interval: float
    counters: dict[str, int]
    # staging, kernels, graphs
    _staging: _StagingPool
    _functions: dict[CudaFunction, None]
    _tile_descs: dict[bytes, int]
    _capturing: CudaStream | None
    _graph_execs: dict[CudaGraphExec, None]

    def _make_current_on_thread(self) -> None:
        cu.cuCtxSetCurrent(self._ctx)

    def _make_current_if_needed(self) -> None:
        if _primary.multi_device:
            cu.cuCtxSetCurrent(self._ctx)

    def _check_open(self) -> None:
        if self._closed:
            raise _common.context_closed(f"cuda:{self.ordinal}")

    def _fail(self, err: Any, call: str, cls: type[CudaError] | None = None) -> NoReturn:
        """Raise the error of a failed driver call; a kernel fault makes it sticky."""
        exc = cuda_error(err, call, cls)
        if exc.code in LAUNCH_CODES and exc.code != 701 and exc.code != 720 and exc.code != 912:
            self._sticky = self._sticky or exc
        raise exc
