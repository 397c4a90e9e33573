"""Kernels on the cuda backend: loading, the up-front launch checks and the launch path.

Invariants:

* ``load_kernel`` compiles (``nvrtc``, cached on disk) or loads an image once
  per context. It makes the context current in its own thread, so the core
  may call it in a worker thread. Module loading is refused on a capturing
  thread: a first load during a capture relaxes the capture mode for it.
* ``check_launch`` checks what only the loaded function knows (its thread and
  shared-memory limits, the parameter layout, a cooperative grid's
  co-residency, a cluster's schedulability) and enqueues nothing; a
  configuration that passed is remembered per function.
* The launch path is lean: a launch's first enqueue copies its packed
  parameters into the kernel's preallocated arena; a launch enqueued again
  gets stable memory of its own, cached per stream in ``PreparedLaunch.cache``.
  Nothing is created per call that could be cached.
* A kernel function of another context is a ``ValueError``, an unloaded one
  ``CUDA_ERROR_INVALID_HANDLE`` (``_common``). A launch error other than a
  resource or configuration one makes the context sticky.
* :class:`Kernels` owns the loaded functions (each names it as its ``owner``)
  and the tile descriptor buffers; it trusts a stream only if the stream
  table it was given owns it.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Final, Literal, NoReturn, final

import numpy as np
from trio.lowlevel import enable_ki_protection

from ..._core._arena import check_param_layout
from ..._core._config import check_cooperative_occupancy
from ..._core._driver import StreamHandle
from ..._core._errors import KernelArgumentError, LaunchError
from .. import _common, _nvrtc
from . import direct, nvrtc
from . import primary as _primary
from .bindings import cu
from .errors import cuda_error, describe
from .graphs import relaxed_capture
from .streams import CudaStream

if TYPE_CHECKING:
    from ..._core._kernel import Kernel
    from ..._core._launch import PreparedLaunch
    from .state import ContextState
    from .streams import StreamTable

__all__ = ["CudaFunction", "Kernels"]

_DEFAULT_SMEM: Final = 48 * 1024


@final
class CudaFunction:
    """What :meth:`CudaContext.load_kernel` returns: the module and function."""

    __slots__ = (
        "__weakref__",
        "addr",
        "arch",
        "argv",
        "dyn_smem",
        "fn",
        "from_cache",
        "image_kind",
        "kernel",
        "limits",
        "module",
        "ok",
        "owner",
        "packed",
        "params",
        "params_end",
        "unloaded",
    )

    def __init__(
        self,
        owner: Kernels,
        kernel: Kernel,
        module: Any,
        fn: Any,
        image_kind: str,
        arch: str,
        from_cache: bool,
    ) -> None:
        self.owner = owner
        self.kernel = kernel
        self.module = module
        self.fn = fn
        #: the CUfunction's address (the direct launch path's argument)
        self.addr = int(fn)
        self.image_kind = image_kind
        self.arch = arch
        self.from_cache = from_cache
        self.dyn_smem = _DEFAULT_SMEM
        self.unloaded = False
        #: (max threads per block, static shared bytes, parameter count or None), read on first check
        self.limits: tuple[int, int, int | None] | None = None
        #: the parameters' (offset, size) read so far, and the count where a query found the end
        self.params: list[tuple[int, int]] = []
        self.params_end: int | None = None
        #: (config, plan) pairs that passed :meth:`CudaContext.check_launch`
        self.ok: dict[tuple[object, object], None] = {}
        #: the kernel's preallocated parameter arena for first launches:
        #: (arena array, its address, void** array, its address), built on first use
        self.argv: tuple[Any, int, Any, int] | None = None
        #: the offsets of its parameters for ``direct.launch_packed`` (first
        #: launches through direct calls), False where not usable; None: not made yet
        self.packed: bytes | Literal[False] | None = None

    def __repr__(self) -> str:
        state = " unloaded" if self.unloaded else ""
        return f"<CudaFunction {self.kernel.name} ({self.image_kind}, {self.arch}){state}>"


def _param_count(fn: Any) -> int | None:
    """How many parameters a loaded kernel has (``cuFuncGetParamCount``), or
    None where the driver cannot tell (the bindings may know a function the
    installed driver lacks: calling it raises ``RuntimeError``)."""
    get_count = getattr(cu, "cuFuncGetParamCount", None)
    if get_count is None:
        return None
    try:
        err, n = get_count(fn)
    except Exception:  # not in this driver
        return None
    return None if err else int(n)


def _param_info(fn: Any, index: int) -> tuple[int, int] | bool | None:
    """``(offset, size)`` of parameter ``index`` of a loaded kernel
    (``cuFuncGetParamInfo``); False when the kernel has fewer parameters
    (``CUDA_ERROR_INVALID_VALUE``); None where the driver cannot report it."""
    try:
        err, offset, size = cu.cuFuncGetParamInfo(fn, index)
    except Exception:  # no such function in the bindings or the driver
        return None
    if err:
        return False if int(err) == 1 else None
    return int(offset), int(size)


def _module_entries(module: Any) -> tuple[str, ...] | None:
    """The names of the kernels in a loaded module, or None if the driver
    cannot list them (for an error message: never raises)."""
    try:
        err, count = cu.cuModuleGetFunctionCount(module)
        if err:
            return None
        if not count:
            return ()  # (enumerating none is an invalid value to the driver)
        err, functions = cu.cuModuleEnumerateFunctions(count, module)
        if err:
            return None
        names = []
        for fn in functions:
            err, raw = cu.cuFuncGetName(fn)
            if err:
                return None
            names.append(raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw))
        return tuple(names)
    except Exception:  # pragma: no cover - an older driver or binding
        return None


def _opt_in_shared_memory(function: CudaFunction, smem: int) -> None:
    """Let ``function`` use ``smem`` bytes of dynamic shared memory (more than
    the 48 KiB default needs an opt-in per kernel)."""
    attrib = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = cu.cuFuncSetAttribute(function.fn, attrib, smem)
    if err:
        call = f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={smem})"
        raise cuda_error(err, call, LaunchError)
    function.dyn_smem = smem


@final
class Kernels:
    """The loaded kernels of one context, their launch checks and the launch path."""

    __slots__ = (
        "_cu_ctx",
        "_direct",
        "_launch_packed",
        "_state",
        "_stream",
        "_table",
        "functions",
        "tile_descs",
    )

    def __init__(self, state: ContextState, table: StreamTable) -> None:
        self._state = state
        self._table = table
        self._stream = table.stream
        #: the CUcontext (the state's, copied: it never changes)
        self._cu_ctx = state.ctx
        #: the address of ``cuLaunchKernel`` for direct calls, or None: the
        #: wrapper (``direct.entries``, decided when the context opened)
        entries = direct.entries()
        self._direct = entries[0] if entries is not None else None
        self._launch_packed: Any = direct.launch_packed() if entries is not None else None
        #: the loaded kernels (their modules are unloaded at close)
        self.functions: dict[CudaFunction, None] = {}
        #: device buffers of tile launches' list arguments, by content (freed at close)
        self.tile_descs: dict[bytes, int] = {}

    # ------------------------------------------------------------------ kernels
    def load_kernel(self, kernel: Kernel) -> CudaFunction:
        if self._table.capturing is not None:
            # first launch of a kernel inside a capture: module loading is
            # refused on a capturing thread, so relax the mode just for it
            with relaxed_capture(self._table):
                return self._load_kernel(kernel)
        return self._load_kernel(kernel)

    def _load_kernel(self, kernel: Kernel) -> CudaFunction:
        state = self._state
        state.check_open()
        cu.cuCtxSetCurrent(self._cu_ctx)
        from_cache = False
        arch = ""
        symbol = ""
        if kernel.image_kind == "source":
            assert kernel.source is not None
            res = nvrtc.compile_source(
                kernel.source,
                kernel.name,
                tuple(kernel.options),
                state.info.compute_capability,
                state.driver_version,
            )
            image, kind, arch, from_cache = res.image, res.kind, res.arch, res.from_cache
        elif kernel.tile is not None:
            tile = kernel.tile
            if tile.kind != "specialisation":
                raise TypeError(f"kernel: tile kernel {kernel.name} is loaded through a launch of it")
            image, symbol = tile.cubin("cuda", state.info.compute_capability)
            kind = "cubin"
        else:
            assert kernel.image is not None
            image, kind = kernel.image, kernel.image_kind
        if kind == "ptx" and not image.endswith(b"\0"):
            image = image + b"\0"
        err, module = cu.cuModuleLoadData(image)
        if err:
            raise cuda_error(err, f"cuModuleLoadData({kernel.name}, {kind})")
        entry = symbol if kernel.tile is not None else kernel.name
        err, fn = cu.cuModuleGetFunction(module, entry.encode())
        if err:
            entries = _module_entries(module) if int(err) == _common.NOT_FOUND else None
            cu.cuModuleUnload(module)
            if int(err) == _common.NOT_FOUND:  # as the simulator's check says it
                if entries is None and kind == "ptx":
                    entries = _nvrtc.ptx_entries(image)
                where = {"source": "its source", "ptx": "its PTX"}.get(kernel.image_kind, "its cubin")
                raise _common.entry_not_found(kernel.name, entries, where)
            raise cuda_error(err, f"cuModuleGetFunction({kernel.name!r})")
        handle = CudaFunction(self, kernel, module, fn, kind, arch, from_cache)
        self.functions[handle] = None
        return handle

    def unload_kernel(self, function: object) -> None:
        """Unload the module of a :meth:`load_kernel` handle. The core calls it
        at scope exit, only when no submission using it is in flight."""
        if not isinstance(function, CudaFunction):
            raise _common.not_a("function", function, CudaFunction, " from load_kernel")
        if function.unloaded:
            return
        function.unloaded = True
        self.functions.pop(function, None)
        if self._state.sticky is not None:
            return  # leak: the context is broken
        (err,) = cu.cuModuleUnload(function.module)
        if err:
            raise cuda_error(err, "cuModuleUnload")

    def function_limits(self, function: CudaFunction) -> tuple[int, int, int | None]:
        """The kernel's own limits, read once: its maximum threads per block
        (registers, ``__launch_bounds__``), its static shared memory, and its
        parameter count (``cuFuncGetParamCount``; None where the driver cannot
        report it)."""
        limits = function.limits
        if limits is not None:
            return limits
        A = cu.CUfunction_attribute
        fn = function.fn

        def attr(which: Any, label: str) -> int:
            err, value = cu.cuFuncGetAttribute(which, fn)
            if err:
                raise cuda_error(err, f"cuFuncGetAttribute({label})")
            return int(value)

        threads = attr(A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "MAX_THREADS_PER_BLOCK")
        static = attr(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "SHARED_SIZE_BYTES")
        function.limits = limits = (threads, static, _param_count(fn))
        return limits

    def param_layout(self, function: CudaFunction, n: int) -> tuple[tuple[int, int], ...] | None:
        """The compiled kernel's ``(offset, size)`` per parameter, as far as a
        launch packing ``n`` parameters needs it: all of them where the driver
        reports the count, else the first ``n`` (fewer if the kernel has
        fewer). Only indices that exist are queried, so a matching launch
        makes no failing driver call. None: the driver cannot report it."""
        count = self.function_limits(function)[2]
        known = function.params
        want = count if count is not None else n
        while len(known) < want and function.params_end is None:
            info = _param_info(function.fn, len(known))
            if info is None:
                return None
            if info is False:
                function.params_end = len(known)
                break
            known.append(info)  # type: ignore[arg-type]
        return tuple(known[:want])

    def check_launch(self, function: object, launch: PreparedLaunch) -> None:
        """What only the loaded kernel knows, checked before anything is
        enqueued: its own thread limit, static plus dynamic shared memory
        (opting in to more than 48 KiB here), the parameter layout against the
        compiled kernel, the co-residency of a cooperative grid and the
        schedulability of a cluster. Raises ``KernelArgumentError``."""
        if type(function) is not CudaFunction or function.owner is not self:
            raise _common.wrong_handle("function", function, CudaFunction, "CUDA", " from load_kernel")
        c = launch.config
        tile = launch.kernel.tile
        if tile is not None and tile.has_list and "cu.lists" not in (launch.cache or ()):
            self._tile_lists(launch)
        key = (c, launch.plan)
        if key in function.ok:
            return
        self._state.check_open()
        cu.cuCtxSetCurrent(self._cu_ctx)
        max_threads, static, _ = self.function_limits(function)
        name = launch.kernel.name
        threads = c.block[0] * c.block[1] * c.block[2]
        if threads > max_threads:
            raise KernelArgumentError(
                f"{name}: block: the kernel allows at most {max_threads} threads per block "
                f"(its register use or __launch_bounds__), got {c.block} = {threads}"
            )
        info = self._state.info
        optin = info.max_shared_memory_per_block_optin
        smem = c.shared_mem
        if static + smem > optin:
            raise KernelArgumentError(
                f"{name}: shared_mem: expected at most {max(0, optin - static)} bytes (the kernel has "
                f"{static} bytes of static shared memory, the device {optin} per block), got {smem}"
            )
        if smem > function.dyn_smem:
            _opt_in_shared_memory(function, smem)
        layout = self.param_layout(function, len(launch.plan.slots))
        if layout is not None:
            check_param_layout(launch, layout)
        if c.cooperative:
            err, per_sm = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function.fn, threads, smem)
            if err:
                raise cuda_error(err, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            check_cooperative_occupancy(launch, info, int(per_sm))
        if c.cluster is not None:
            cfg = self._launch_config(None, launch)
            err, clusters = cu.cuOccupancyMaxActiveClusters(function.fn, cfg)
            if err or not clusters:
                why = describe(err)[0] if err else "0 clusters can be resident"
                raise KernelArgumentError(
                    f"{name}: cluster: the device cannot run clusters of {c.cluster} blocks of {c.block} "
                    f"threads with {smem} B of dynamic shared memory ({why})"
                )
        if len(function.ok) >= 1024:
            function.ok.clear()
        function.ok[key] = None

    def _tile_lists(self, launch: PreparedLaunch) -> None:
        """Point a tile launch's list arguments at their descriptor buffers:
        one device buffer per distinct content, uploaded once and kept until
        the context closes (after the scope's drain), so no launch can
        outlive it; the arena is patched in place (a launch's arrays, hence
        its lists, belong to one context)."""
        self._state.check_open()
        fixups = launch.kernel.tile.list_descriptors(launch)
        arena = bytearray(launch.arena)
        with relaxed_capture(self._table):
            cu.cuCtxSetCurrent(self._cu_ctx)
            for offset, data in fixups:
                ptr = self.tile_descs.get(data)
                if ptr is None:
                    err, dptr = cu.cuMemAlloc(len(data))
                    if err:
                        raise cuda_error(err, f"cuMemAlloc({len(data)}) for a list argument's descriptors")
                    ptr = int(dptr)
                    (err,) = cu.cuMemcpyHtoD(ptr, data, len(data))
                    if err:
                        cu.cuMemFree(ptr)
                        raise cuda_error(err, "cuMemcpyHtoD of a list argument's descriptors")
                    self.tile_descs[data] = ptr
                arena[offset : offset + 8] = ptr.to_bytes(8, "little")
        launch.arena = bytes(arena)
        launch.scratch()["cu.lists"] = True

    def _prepare_launch(
        self, stream: CudaStream, function: object, launch: PreparedLaunch
    ) -> tuple[Any, ...]:
        """Build (once per launch and stream) the argument tuple of
        ``cuLaunchKernel``: the parameter arena copied into stable memory and
        the ``void**`` array of slot addresses, both kept in ``launch.cache``."""
        if type(function) is not CudaFunction or function.owner is not self:
            raise _common.wrong_handle("function", function, CudaFunction, "CUDA", " from load_kernel")
        if function.unloaded:
            raise _common.invalid_handle(f"{function!r} was unloaded", "cuLaunchKernel")
        cache = launch.scratch()
        params = cache.get("cu.params")
        if params is None:
            slots = launch.plan.slots
            arena = np.frombuffer(bytearray(launch.arena) or bytearray(8), dtype=np.uint8).copy()
            base = int(arena.ctypes.data)
            ptrs = np.array([base + slot.offset for slot in slots], dtype=np.uint64)
            addr = int(ptrs.ctypes.data) if len(slots) else 0
            params = (arena, ptrs, addr)
            cache["cu.params"] = params
        c = launch.config
        smem = c.shared_mem
        if smem > function.dyn_smem:
            _opt_in_shared_memory(function, smem)
        if len(cache) > 64:  # bound the per-stream entries of long-lived launches
            for key in [k for k in cache if k.startswith("cu:")]:
                del cache[key]
        # (function, how, what): how 0: ``what()`` is a prepared direct call;
        # 1: ``what`` are the wrapper's arguments; 2: ``what`` is the
        # ``cuLaunchKernelEx`` (config, function, params) of a launch with modes
        entry: tuple[Any, ...]
        if c.cluster is not None or c.cooperative or c.pdl:
            entry = (function, 2, (self._launch_config(stream, launch), function.fn, params[2]))
        elif self._direct is not None:
            entry = (
                function,
                0,
                direct.launcher(self._direct, function.addr, c.grid, c.block, smem, stream.handle, params[2]),
            )
        else:
            entry = (function, 1, (function.fn, *c.grid, *c.block, smem, stream.cu, params[2], 0))
        cache[stream.key] = entry
        return entry

    def _launch_config(self, stream: CudaStream | None, launch: PreparedLaunch) -> Any:
        """The ``CUlaunchConfig`` of a launch with modes: clusters
        (``CLUSTER_DIMENSION``), cooperative (``COOPERATIVE``) and programmatic
        dependent launch (``PROGRAMMATIC_STREAM_SERIALIZATION``). ``stream``
        None: for occupancy queries."""
        c = launch.config
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = c.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = c.block
        cfg.sharedMemBytes = c.shared_mem
        if stream is not None:
            cfg.hStream = stream.cu
        ids = cu.CUlaunchAttributeID
        attrs = []
        if c.cluster is not None:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = c.cluster
            attrs.append(a)
        if c.cooperative:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            a.value.cooperative = 1
            attrs.append(a)
        if c.pdl:
            a = cu.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        return cfg

    @enable_ki_protection  # (a hot method's fallback: see direct._trust_hot_methods)
    def launch(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> None:
        cache = launch.cache
        try:
            hit = None if cache is None else cache.get(stream.key)  # type: ignore[attr-defined]
            destroyed = stream.destroyed  # type: ignore[attr-defined]
        except AttributeError:
            self._stream(stream)
            raise
        if hit is None or hit[0] is not function or destroyed:
            if not launch.enqueued and self._launch_first(stream, function, launch):
                return
            hit = self._prepare_launch(self._stream(stream), function, launch)
        if _primary.multi_device:
            cu.cuCtxSetCurrent(self._cu_ctx)
        how = hit[1]
        if how == 0:
            err = hit[2]()
        elif how == 1:
            (err,) = _cuLaunchKernel(*hit[2])
        else:
            (err,) = cu.cuLaunchKernelEx(*hit[2], 0)
        if err:
            self._launch_failed(err, launch)

    def _launch_first(self, stream: StreamHandle, function: object, launch: PreparedLaunch) -> bool:
        """The first enqueue of a plain launch (no launch attributes). Through
        direct calls, ``cuLaunchKernel`` reads the parameters where the launch
        packed them (``direct.launch_packed``); through the wrapper they are
        copied into the kernel's own preallocated arena and launched from
        there. Either way the driver reads them during the call only. Only a
        launch enqueued again gets stable memory of its own (see
        :meth:`_prepare_launch`), so a launch built, submitted once and
        dropped costs no per-launch buffers. False: take the general path."""
        if type(function) is not CudaFunction or function.owner is not self or function.unloaded:
            return False
        c = launch.config
        plan = launch.plan
        if (
            c.cluster is not None
            or c.cooperative
            or c.pdl
            or c.shared_mem > function.dyn_smem
            or plan is not launch.kernel.plan
        ):
            return False
        s = stream
        if type(s) is not CudaStream or s.owner is not self._table or s.destroyed:
            s = self._stream(stream)
        packed = function.packed
        if packed is None:
            made = direct.packed_offsets(plan.slots) if self._launch_packed is not None else None
            packed = function.packed = made if made is not None else False
        launch.enqueued = True
        if _primary.multi_device:
            cu.cuCtxSetCurrent(self._cu_ctx)
        if packed is not False and len(launch.arena) >= plan.size:  # direct: read where packed
            err = self._launch_packed(
                self._direct, function.addr, *c.grid, *c.block, c.shared_mem, s.handle, launch.arena, packed
            )
        else:
            argv = function.argv
            if argv is None:
                arena = np.zeros(max(plan.size, 8), dtype=np.uint8)
                base = int(arena.ctypes.data)
                ptrs = np.array([base + slot.offset for slot in plan.slots], dtype=np.uint64)
                argv = function.argv = (arena, base, ptrs, int(ptrs.ctypes.data) if plan.slots else 0)
            data = launch.arena
            _memmove(argv[1], data, len(data))
            (err,) = _cuLaunchKernel(function.fn, *c.grid, *c.block, c.shared_mem, s.cu, argv[3], 0)
        if err:
            self._launch_failed(err, launch)
        return True

    @enable_ki_protection  # (a hot method's fallback: see direct._trust_hot_methods)
    def _launch_failed(self, err: Any, launch: PreparedLaunch) -> NoReturn:
        self._state.fail(err, f"cuLaunchKernel({launch.kernel.name})", LaunchError)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """At close (not after a sticky error; after the graphs, whose kernel
        nodes use the modules): unload every module, free the tile descriptors."""
        for fn in list(self.functions):
            fn.unloaded = True
            cu.cuModuleUnload(fn.module)
        self.functions.clear()
        for ptr in self.tile_descs.values():
            cu.cuMemFree(ptr)
        self.tile_descs.clear()


_cuLaunchKernel: Any = cu.cuLaunchKernel if cu is not None else None
_memmove = ctypes.memmove
