"""What every component of a :class:`~.context.CudaContext` shares: the
device, its primary context, and whether the context is broken.

Invariants:

* :class:`ContextState` is built first, by :class:`~.context.CudaContext`,
  and handed to each component's constructor. It retains the device's
  primary context (released by :meth:`ContextState.release_primary`, once,
  at close) and makes it current on the calling thread; if anything after
  the retain fails, it releases it again before raising.
* ``ordinal``, ``dev``, ``ctx``, ``info``, ``driver_version``, ``pool`` (the
  device's default memory pool) and ``aux`` (the internal stream of
  stream-ordered frees) are set once and never change. ``closed`` turns True
  once, in :meth:`CudaContext.close <.context.CudaContext.close>`.
* ``sticky`` is the error that broke the context (a kernel fault, or a
  failure of the completion machinery); once set, it stays. A failed driver
  call raises through :meth:`ContextState.fail`; a kernel fault (a launch
  error other than a resource or configuration one) sets ``sticky``.
* The components (``streams``: :class:`~.streams.StreamTable`,
  ``completion``: :class:`~.completion.CompletionWaiter`, ``staging``:
  :class:`~.staging.StagingPool`, ``graphs``: :class:`~.graphs.Graphs`,
  ``launch``: :class:`~.launch.Kernels`, ``timing``:
  :class:`~.timing.Timing`) each own their state; they reach each other only
  through the references their constructors were given and the methods and
  attributes without a leading underscore.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn, final

from trio.lowlevel import enable_ki_protection

from .. import _common
from . import primary as _primary
from .bindings import cu
from .errors import LAUNCH_CODES, check, cuda_error

if TYPE_CHECKING:
    from ..._core._driver import DeviceInfo
    from ..._core._errors import CudaError

__all__ = ["ContextState"]


@final
class ContextState:
    """The device, its primary context and the sticky error of one context."""

    __slots__ = ("aux", "closed", "ctx", "dev", "driver_version", "info", "ordinal", "pool", "sticky")

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.closed = False
        self.sticky: CudaError | None = None
        dev, ctx = _primary.retain_primary(ordinal)
        self.dev: Any = dev
        self.ctx: Any = ctx
        try:
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            self.info: DeviceInfo = _primary.device_info(self.dev, ordinal)
            self.driver_version = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
            self.pool: Any = check(cu.cuDeviceGetDefaultMemPool(self.dev), "cuDeviceGetDefaultMemPool")
            flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
            self.aux: Any = check(cu.cuStreamCreate(flags), "cuStreamCreate")
        except BaseException:
            self.release_primary()
            raise

    def make_current(self) -> None:
        """Make the context current on the calling thread (a waiter thread)."""
        cu.cuCtxSetCurrent(self.ctx)

    def make_current_if_needed(self) -> None:
        """Make the context current where scopes on several devices are open."""
        if _primary.multi_device:
            cu.cuCtxSetCurrent(self.ctx)

    def check_open(self) -> None:
        if self.closed:
            raise _common.context_closed(f"cuda:{self.ordinal}")

    @enable_ki_protection  # (a hot method's fallback: see direct._trust_hot_methods)
    def fail(self, err: Any, call: str, cls: type[CudaError] | None = None) -> NoReturn:
        """Raise the error of a failed driver call; a kernel fault makes it sticky."""
        exc = cuda_error(err, call, cls)
        if exc.code in LAUNCH_CODES and exc.code != 701 and exc.code != 720 and exc.code != 912:
            self.sticky = self.sticky or exc
        raise exc

    def release_primary(self) -> None:
        _primary.release_primary(self.ordinal, self.dev)
