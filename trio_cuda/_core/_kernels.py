"""The scope's kernel table: the kernels loaded for it, and the launches
checked against its device.

Invariants:

* :class:`KernelTable` is a component of :class:`~trio_cuda.ResourceScope`
  and the one owner of its loaded functions (``functions``, kernel -> the
  driver's handle) and of the launch shapes already checked. The scope's
  launch hot path reads ``functions`` directly (the same dict).
* A kernel is loaded at most once per scope. ``load`` loads off the loop
  where the driver allows it (``Capabilities.load_in_thread``) and compiles a
  tile kernel's specialisation in a worker thread; a cancelled caller leaves
  at once, and a function loaded meanwhile, or while the scope exits, is
  unloaded again rather than kept twice.
* A launch is checked against the device (its limits, then what only the
  loaded kernel knows) before anything of it is enqueued. The result is kept
  on the launch with its loaded function (``PreparedLaunch.ready``, set only
  by :meth:`KernelTable.function_for`, the one place that reads it besides
  the scope's two hot entry points), and for a SIMT kernel also per launch
  shape (kernel, interned config, parameter plan), so a fresh launch of a
  checked shape is not checked again; a tile launch, whose check prepares its
  list arguments, is checked per launch. A refused shape is never kept.
  The compiled launch path remembers its last lookups in these tables
  (``hot``); every method here that changes them resets it.
* Functions are unloaded only after the scope's drain, and never while any of
  its work has unknown completion (``ResourceScope._release_everything``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import trio

from ._config import check_device_limits
from ._final import final
from ._kernel import Kernel, static_launches
from ._ops import DeviceOp

if TYPE_CHECKING:
    from ._driver import DeviceContext
    from ._launch import PreparedLaunch
    from ._scope import ResourceScope

__all__ = ["KernelTable"]

#: launch shapes kept per scope before the set starts again (configs are
#: interned in bounded caches too)
_SHAPES_KEPT = 4096


@final
class KernelTable:
    """A scope's loaded kernels and checked launch shapes (a component of
    :class:`~trio_cuda.ResourceScope`)."""

    __slots__ = (
        "checked",
        "driver",
        "functions",
        "hot",
        "info",
        "last_checked",
        "load_in_thread",
        "ready",
        "scope",
    )

    def __init__(self, scope: ResourceScope, driver: DeviceContext) -> None:
        self.scope = scope
        self.driver = driver
        self.info = driver.info
        #: the driver loads kernels in a worker thread (``load``)
        self.load_in_thread = driver.capabilities.load_in_thread
        self.functions: dict[Kernel, object] = {}
        #: (kernel, config, plan) of launches checked against this device (each
        #: but those of tile specialisations whose check runs per launch)
        self.checked: set[tuple[Kernel, object, object]] = set()
        #: the (config, plan) of each such kernel's last checked launch: a
        #: fresh launch of the same shape is found by identity, unhashed
        self.last_checked: dict[Kernel, tuple[object, object]] = {}
        #: per kernel, the (functions, function) pair its checked launches
        #: keep (``PreparedLaunch.ready``): one shared tuple, none per launch
        self.ready: dict[Kernel, tuple[dict[Kernel, object], object]] = {}
        #: the compiled launch path's memo of its last lookups in the three
        #: tables above, (kernel, config, plan, ready pair); every change to
        #: them here resets it
        self.hot: tuple[Kernel, object, object, tuple[dict[Kernel, object], object]] | None = None

    async def load(self, kernels: Iterable[Kernel | DeviceOp[Any]]) -> None:
        """``ResourceScope.load``: see its documentation."""
        await trio.lowlevel.checkpoint_if_cancelled()
        wanted: list[Kernel] = []
        for i, item in enumerate(kernels):
            if isinstance(item, DeviceOp):
                wanted.extend(p.kernel for p in static_launches(item))
            elif not isinstance(item, Kernel):
                raise TypeError(f"kernels[{i}]: expected a Kernel or a DeviceOp, got {type(item).__name__}")
            elif item.tile is not None and item.tile.kind == "kernel":
                raise TypeError(
                    f"kernels[{i}]: tile kernel {item.name} is compiled per argument signature: load a "
                    "launch of it instead (await gpu.load(k.launch(..., grid=...)))"
                )
            else:
                wanted.append(item)
        scope = self.scope
        scope._check_open("load")
        functions = self.functions
        info = self.info
        for kernel in wanted:
            if kernel in functions:
                continue
            tile = kernel.tile
            if tile is not None and not tile.ready(info.backend, info.compute_capability):
                # a compile takes up to seconds: a cancelled caller leaves at
                # once, and the compile finishes in its thread for the next use
                await trio.to_thread.run_sync(
                    tile.prepare, info.backend, info.compute_capability, abandon_on_cancel=True
                )
                if kernel in functions:
                    continue
                scope._check_open("load")
            if self.load_in_thread:
                fn = await trio.to_thread.run_sync(self.driver.load_kernel, kernel)
                if kernel in functions or scope._closing:  # loaded meanwhile, or exiting
                    self.driver.unload_kernel(fn)
                    continue
            else:
                fn = self.driver.load_kernel(kernel)
            self.hot = None
            functions[kernel] = fn
        await trio.lowlevel.checkpoint()

    async def load_tile_kernels(self, op: DeviceOp[Any]) -> None:
        """Compile (off the loop) and load the tile kernels ``op`` is known to
        launch, as :meth:`load` does; nothing when there are none."""
        pending = [
            p.kernel
            for p in static_launches(op)
            if p.kernel.tile is not None and p.kernel not in self.functions
        ]
        if pending:
            await self.load(pending)

    def load_static(self, op: DeviceOp[Any]) -> None:
        """Load and check the kernels ``op`` is known to launch before any of
        it is enqueued (``static_launches``): a kernel that cannot be loaded
        then fails the submission with nothing enqueued."""
        for prepared in static_launches(op):
            self.function_for(prepared)

    def function(self, kernel: Kernel) -> object:
        """``kernel``'s loaded function, loading it synchronously on first use."""
        fn = self.functions.get(kernel)
        if fn is None:
            fn = self.driver.load_kernel(kernel)
            self.hot = None
            self.functions[kernel] = fn
        return fn

    def function_for(self, prepared: PreparedLaunch) -> object:
        """The loaded function that ``prepared`` launches, once the launch was
        checked against this device; kept on the launch (``ready``), so a
        launch submitted again costs one attribute read and one identity test
        (which the scope's hot entry points make inline before calling this).
        Loads the kernel synchronously on first use."""
        functions = self.functions  # (the table's identity on the launch: pins no scope)
        ready = prepared.ready
        if ready is not None and ready[0] is functions:
            return ready[1]
        self.check(prepared)
        kernel = prepared.kernel
        fn = functions.get(kernel)
        if fn is None:
            fn = self.function(kernel)
        pair = self.ready.get(kernel)
        if pair is None or pair[1] is not fn:
            self.hot = None
            pair = self.ready[kernel] = (functions, fn)
        prepared.ready = pair
        return fn

    def check(self, prepared: PreparedLaunch) -> None:
        """Check a launch against this scope's device before anything is
        enqueued: the device's limits (``check_device_limits``), then what only
        the loaded kernel knows (``driver.check_launch``)."""
        kernel = prepared.kernel
        config = prepared.config
        plan = prepared.plan
        # What the checks read is the kernel, the config and the parameter
        # plan (configs are interned, compared by identity); a tile launch
        # with list arguments has them prepared by its check: it runs per launch.
        tile = kernel.tile
        if tile is None or not tile.per_launch_check:
            last = self.last_checked.get(kernel)
            if last is not None and last[0] is config and last[1] is plan:
                return
            shape = (kernel, config, plan)
            if shape not in self.checked:
                check_device_limits(prepared, self.info)
                self.driver.check_launch(self.function(kernel), prepared)
                if len(self.checked) >= _SHAPES_KEPT:
                    self.checked.clear()
                    self.last_checked.clear()
                self.checked.add(shape)
            self.hot = None
            self.last_checked[kernel] = (config, plan)
        else:
            check_device_limits(prepared, self.info)
            self.driver.check_launch(self.function(kernel), prepared)

    def unload_all(self) -> None:
        """After the drain: unload every function (the scope decides when)."""
        functions = self.functions
        self.hot = None
        self.ready.clear()
        for kernel, fn in list(functions.items()):
            del functions[kernel]
            self.driver.unload_kernel(fn)
