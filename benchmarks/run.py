"""trio_cuda benchmarks: one command, one table of ratios.

    python3 benchmarks/run.py [--json PATH] [--quick] [--only SECTION,...]

Everything is measured in one process on one GPU, as medians over repeats:
raw cuda.bindings launches (and the argument-packing variants), the library's
launch paths (unsafe.async_on, safe submit, await run), many-task throughput
(and 100 tasks on 4 streams that all write the same two buffers),
idle CPU while awaiting a long kernel, the completion strategies A/B, the
cross-stream wait A/B, graph replay, the stream policy, disjoint chunks of
one buffer on 4 streams (``chunks``), tile kernels (``tile``: against SIMT
launches, the raw cubin and cuBLAS), and CuPy / Torch / cuda.core where
installed.
Needs a CUDA device; prints the reason and exits 0 without one.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trio

import trio_cuda
from trio_cuda import In, InOut, Kernel, Scalar
from trio_cuda._backends import probe_cuda

EMPTY_SRC = r"""
extern "C" __global__ void empty(const float* a, const float* b, const float* c, const float* d, int n) { }
"""
SPIN_SRC = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
EMPTY = Kernel.from_source(EMPTY_SRC, "empty", params=[In("f4"), In("f4"), In("f4"), In("f4"), Scalar("i4")])
WRITE2_SRC = r"""
extern "C" __global__ void write2(float* a, float* b, int n) { }
"""
#: writes both its arrays: on 4 streams, every launch conflicts with the last one
WRITE2 = Kernel.from_source(WRITE2_SRC, "write2", params=[InOut("f4"), InOut("f4"), Scalar("i4")])
SPIN = Kernel.from_source(SPIN_SRC, "spin", params=[Scalar("u8")])

perf = time.perf_counter
RESULTS: dict[str, Any] = {}
QUICK = False


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def record(key: str, value: float, unit: str, note: str = "") -> float:
    RESULTS[key] = {"value": value, "unit": unit, "note": note}
    print(f"  {key:<48} {value:12.3f} {unit} {note}", flush=True)
    return value


def reps(n: int) -> int:
    return max(3, n // 4) if QUICK else n


# --------------------------------------------------------------------------- raw driver


class Raw:
    """Raw cuda.bindings state: context, stream, the empty kernel, 4 buffers."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        from trio_cuda._backends.cuda import nvrtc as _cuda_nvrtc

        self.cu = cu
        (err,) = cu.cuInit(0)
        assert not err, err
        err, self.dev = cu.cuDeviceGet(0)
        err, self.ctx = cu.cuDevicePrimaryCtxRetain(self.dev)
        (err,) = cu.cuCtxSetCurrent(self.ctx)
        assert not err
        major = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev
        )[1]
        minor = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev
        )[1]
        self.cc = (int(major), int(minor))
        err, drv = cu.cuDriverGetVersion()
        img = _cuda_nvrtc.compile_source(EMPTY_SRC + SPIN_SRC, "raw", (), self.cc, int(drv)).image
        err, self.mod = cu.cuModuleLoadData(img)
        assert not err, err
        err, self.fn = cu.cuModuleGetFunction(self.mod, b"empty")
        err, self.spin = cu.cuModuleGetFunction(self.mod, b"spin")
        err, self.stream = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.bufs = [int(cu.cuMemAlloc(1024)[1]) for _ in range(4)]
        # prepacked arena: 4 pointers + 1 int, and the void** array
        self.arena = np.zeros(40, np.uint8)
        self.arena[:32] = np.array(self.bufs, np.uint64).view(np.uint8)
        self.arena[32:36] = np.array([256], np.int32).view(np.uint8)
        base = self.arena.ctypes.data
        self.ptrs = np.array([base, base + 8, base + 16, base + 24, base + 32], np.uint64)
        self.params = int(self.ptrs.ctypes.data)
        size = ctypes.c_size_t(36)
        self._size = size
        self.extra = np.array(
            [
                int(cu.CU_LAUNCH_PARAM_BUFFER_POINTER),
                base,
                int(cu.CU_LAUNCH_PARAM_BUFFER_SIZE),
                ctypes.addressof(size),
                int(cu.CU_LAUNCH_PARAM_END),
            ],
            np.uint64,
        )
        self.spin_arena = np.zeros(8, np.uint64)
        self.spin_ptrs = np.array([self.spin_arena.ctypes.data], np.uint64)

    def sync(self) -> None:
        (err,) = self.cu.cuStreamSynchronize(self.stream)
        assert not err, err

    def spin_params(self, ns: int) -> int:
        self.spin_arena[0] = ns
        return int(self.spin_ptrs.ctypes.data)


def burst(fn: Callable[[], object], n: int, sync: Callable[[], None], bursts: int) -> float:
    """Median host time per call (µs) over bursts of ``n`` calls."""
    per = []
    gc.collect()
    gc.disable()  # as timeit does: no collector pauses inside a timed burst
    try:
        for _ in range(bursts):
            sync()
            t0 = perf()
            for _ in range(n):
                fn()
            per.append((perf() - t0) / n * 1e6)
    finally:
        gc.enable()
    sync()
    return med(per)


BurstFn = Callable[[], Awaitable[float]]


def sync_burst(fn: Callable[[], object], sync: Callable[[], None]) -> BurstFn:
    """One burst of 1000 calls of ``fn`` as an awaitable row of ``in_turn``."""

    async def one() -> float:
        return burst(fn, 1000, sync, 1)

    return one


async def in_turn(
    rows: dict[str, BurstFn],
    rounds: int,
    prefix: str,
    note: str = "(in turn)",
    pairs: tuple[tuple[str, str], ...] = (),
) -> None:
    """Record the median of each row, the rows taken in turn, one burst of
    each per round: drift of the host within a run (clocks, other tenants)
    weighs on every row of the group alike, so ratios inside the group
    compare like with like. For each (a, b) of ``pairs`` also the median of
    the rounds' own ratios a / b, with its quartiles in the note."""
    per: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, one in rows.items():
            per[name].append(await one())
    for name, xs in per.items():
        record(prefix + name, med(xs), "us", note)
    for a, b in pairs:
        if a in per and b in per:
            ratios = [x / y for x, y in zip(per[a], per[b], strict=True)]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            record(f"{prefix}{a}/{b}", med(ratios), "x", f"(per round; quartiles {q[0]:.3f}-{q[2]:.3f})")


def bench_raw(raw: Raw) -> None:
    print("raw cuda.bindings cuLaunchKernel (host µs per launch, bursts of 1000)")
    cu = raw.cu
    L = cu.cuLaunchKernel
    fn, st, params = raw.fn, raw.stream, raw.params
    fn_i, st_i = int(fn), int(st)
    extra = int(raw.extra.ctypes.data)
    ptrs = raw.ptrs
    B = reps(15)

    def v_obj() -> object:
        return L(fn, 1, 1, 1, 1, 1, 1, 0, st, params, 0)

    def v_int() -> object:
        return L(fn_i, 1, 1, 1, 1, 1, 1, 0, st_i, params, 0)

    def v_extra() -> object:
        return L(fn, 1, 1, 1, 1, 1, 1, 0, st, None, extra)

    def v_buffer() -> object:
        return L(fn, 1, 1, 1, 1, 1, 1, 0, st, ptrs, 0)

    b0, b1, b2, b3 = raw.bufs
    vals = (b0, b1, b2, b3, 256)
    types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)

    def v_tuple() -> object:
        return L(fn, 1, 1, 1, 1, 1, 1, 0, st, (vals, types), 0)

    args = (fn, 1, 1, 1, 1, 1, 1, 0, st, params, 0)

    def v_star() -> object:
        return L(*args)

    for name, f in [
        ("raw_launch", v_obj),
        ("raw_launch_int_handles", v_int),
        ("raw_launch_star_args", v_star),
        ("raw_launch_extra_buffer", v_extra),
        ("raw_launch_numpy_voidpp", v_buffer),
        ("raw_launch_tuple_packing", v_tuple),
    ]:
        (err,) = f()  # type: ignore[misc]
        assert not err, (name, err)
        record(name, burst(f, 1000, raw.sync, B), "us")

    def launch_sync() -> None:
        L(fn, 1, 1, 1, 1, 1, 1, 0, st, params, 0)
        cu.cuStreamSynchronize(st)

    record("raw_launch_sync_roundtrip", burst(launch_sync, 200, raw.sync, B), "us")
    dptr = cu.CUdeviceptr(raw.bufs[0])
    W = cu.cuStreamWriteValue32
    record("raw_write_value32", burst(lambda: W(st, dptr, 1, 0), 1000, raw.sync, B), "us")
    record("raw_write_value32_int_addr", burst(lambda: W(st, raw.bufs[0], 1, 0), 1000, raw.sync, B), "us")
    err, ev = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    record("raw_event_record", burst(lambda: cu.cuEventRecord(ev, st), 1000, raw.sync, B), "us")
    record("raw_event_query", burst(lambda: cu.cuEventQuery(ev), 1000, raw.sync, B), "us")
    record("raw_launch+write_value32", burst(lambda: (v_obj(), W(st, dptr, 1, 0)), 1000, raw.sync, B), "us")
    # the same two calls by address, through the compiled module the backend
    # uses where it was built (for reference: the targets stay against the
    # wrapper's raw launch above)
    from trio_cuda._backends.cuda import direct

    direct.reset(pure=False)
    entries = direct.entries()
    direct.reset()
    if entries is None:
        print("  direct calls: not available (the extension is not built)")
    else:
        dl = direct.launcher(entries[0], fn_i, (1, 1, 1), (1, 1, 1), 0, st_i, params)
        dw = direct.writer(entries[1], st_i, raw.bufs[0])
        assert dl() == 0
        record("raw_launch_direct", burst(dl, 1000, raw.sync, B), "us")
        record("raw_write_value32_direct", burst(lambda: dw(1), 1000, raw.sync, B), "us")
    # the device-side gap: the flag write's system-wide fence (default flags)
    # against CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER, on the host and in a
    # launch + flag + host-spin round trip
    nb = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER)
    (err,) = W(st, dptr, 1, nb)
    raw.sync()
    if err:
        RESULTS["raw_write_value32_no_barrier"] = {"value": None, "note": f"refused: {err!r}"}
        print(f"  cuStreamWriteValue32(NO_MEMORY_BARRIER) refused: {err!r}")
    else:
        record("raw_write_value32_no_barrier", burst(lambda: W(st, dptr, 1, nb), 1000, raw.sync, B), "us")
    fl = Floor(raw, 1)
    fst = fl.streams[0]
    for tag, flags in (("fence", 0), ("no_barrier", nb)):
        if err and flags:
            continue

        def flag_rt(flags: int = flags, tag: str = tag) -> None:
            L(fn, 1, 1, 1, 1, 1, 1, 0, fst, params, 0)
            fl.seq[0] += 1
            seq = fl.seq[0]
            (e,) = W(fst, fl.dptr, seq, flags)
            assert not e, e
            mv = fl.mv
            end = perf() + 1.0
            while mv[0] < seq:
                if perf() > end:
                    raise TimeoutError(f"flag {seq} never written ({tag})")

        record(f"raw_launch+flag_spin_roundtrip_{tag}", burst(flag_rt, 200, fl.sync, B), "us")


# --------------------------------------------------------------------------- the Trio floor


class Floor:
    """The least any Trio runtime can do per await, with no library: a raw
    prepacked launch, a ``cuStreamWriteValue32`` of the stream's sequence
    number into a pinned, device-mapped flag, and a task that checkpoints
    until its flag reached its number (one Trio scheduling pass per look)."""

    def __init__(self, raw: Raw, nstreams: int = 4) -> None:
        cu = self.cu = raw.cu
        self.raw = raw
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        err, self.host = cu.cuMemHostAlloc(4096, flags)
        assert not err, err
        err, dptr = cu.cuMemHostGetDevicePointer(self.host, 0)
        assert not err, err
        self.dptr = int(dptr)
        self.mv = (ctypes.c_uint32 * 1024).from_address(int(self.host))
        for i in range(1024):
            self.mv[i] = 0
        non_blocking = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.streams = [cu.cuStreamCreate(non_blocking)[1] for _ in range(nstreams)]
        self.seq = [0] * nstreams

    def launch(self, i: int) -> int:
        """Launch on stream ``i`` and write its flag after; the seq to await."""
        cu, raw = self.cu, self.raw
        st = self.streams[i]
        cu.cuLaunchKernel(raw.fn, 1, 1, 1, 1, 1, 1, 0, st, raw.params, 0)
        seq = self.seq[i] = self.seq[i] + 1
        cu.cuStreamWriteValue32(st, self.dptr + 64 * i, seq, 0)
        return seq

    async def run(self, i: int) -> None:
        seq = self.launch(i)
        mv, slot = self.mv, 16 * i
        checkpoint = trio.lowlevel.checkpoint
        end = perf() + 5.0
        while True:
            await checkpoint()
            if mv[slot] >= seq:
                return
            if perf() > end:
                raise TimeoutError(f"floor: flag {seq} of stream {i} never written")

    def sync(self) -> None:
        for st in self.streams:
            self.cu.cuStreamSynchronize(st)


async def _floor_bench(raw: Raw) -> None:
    print("the Trio floor (raw launch + pinned flag + checkpoints; no library)")
    fl = Floor(raw)
    await fl.run(0)
    per = []
    for _ in range(reps(15)):
        t0 = perf()
        for _ in range(200):
            await fl.run(0)
        per.append((perf() - t0) / 200 * 1e6)
    record("floor_roundtrip", med(per), "us")
    record("floor_tasks_100", med([await _floor_tasks(fl, 100, 200) for _ in range(reps(5))]), "launch/s")
    record("floor_tasks_10000", med([await _floor_tasks(fl, 10_000, 5) for _ in range(reps(3))]), "launch/s")
    fl.sync()


async def _start_line() -> None:
    """Checkpoint until every worker waits at the start line (nothing else runnable)."""
    for _ in range(100):
        await trio.lowlevel.checkpoint()
        if not trio.lowlevel.current_statistics().tasks_runnable:
            break


async def _floor_tasks(fl: Floor, ntasks: int, per_task: int) -> float:
    """Launches/s of the floor's ``ntasks`` tasks (task i on stream i % 4),
    each awaiting ``per_task`` launches; the clock starts at the start line."""
    go = trio.Event()

    async def worker(i: int) -> None:
        await go.wait()
        s = i % 4
        for _ in range(per_task):
            await fl.run(s)

    async with trio.open_nursery() as nursery:
        for i in range(ntasks):
            nursery.start_soon(worker, i)
        await _start_line()
        t0 = perf()
        go.set()
    return ntasks * per_task / (perf() - t0)


# --------------------------------------------------------------------------- library


async def empty_setup(gpu: Any) -> tuple[list[Any], Any, Any]:
    """Four 256-float buffers of ``gpu``, its first stream, and the empty
    kernel's launch over them, run once there (the launch rows' setup)."""
    bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
    s = gpu.streams[0]
    op = EMPTY.launch(*bufs, 256, grid=1, block=1)
    await gpu.run(op, stream=s)
    return bufs, s, op


async def _submit_burst(gpu: Any, op: Any, stream: Any, repeats: int) -> float:
    """Median host µs per ``gpu.submit`` in bursts of 1000 (GC off), each
    burst followed by a wait so the handoff retires it before the next."""
    per = []
    for _ in range(repeats):
        await gpu.run(trio_cuda.ops.value(None), stream=stream)
        gc.disable()
        t0 = perf()
        for _ in range(1000):
            fut = gpu.submit(op, stream=stream)
        per.append((perf() - t0) / 1000 * 1e6)
        gc.enable()
        await fut.wait()
    return med(per)


async def _floor_roundtrip(fl: Floor, n: int) -> float:
    """µs of one floor round trip, ``n`` in a row."""
    t0 = perf()
    for _ in range(n):
        await fl.run(0)
    return (perf() - t0) / n * 1e6


async def _roundtrip(gpu: Any, op: Any, stream: Any, repeats: int) -> float:
    """Median µs of one ``await gpu.run(op)``, 200 in a row per repeat."""
    per = []
    for _ in range(repeats):
        t0 = perf()
        for _ in range(200):
            await gpu.run(op, stream=stream)
        per.append((perf() - t0) / 200 * 1e6)
    return med(per)


async def _scope_bench(raw: Raw) -> None:
    async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
        ctx: Any = gpu._driver
        bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
        op = EMPTY.launch(*bufs, 256, grid=1, block=1)
        s = gpu.streams[0]
        await gpu.run(op, stream=s)
        fn = gpu._functions[EMPTY]
        handle = s.handle
        prepared = op.prepared
        B = reps(15)

        def sync() -> None:
            raw.cu.cuStreamSynchronize(handle.cu)

        print("library launch paths (host µs per launch, bursts of 1000, taken in turn)")
        async_on = trio_cuda.unsafe.async_on
        L, rfn, rst, params = raw.cu.cuLaunchKernel, raw.fn, raw.stream, raw.params

        async def submit_pinned() -> float:
            return await _submit_burst(gpu, op, s, 1)

        async def submit_policy() -> float:
            # unpinned: the default policy picks among the 4 streams
            return await _submit_burst(gpu, op, None, 1)

        await in_turn(
            {
                "scope_raw_launch": sync_burst(lambda: L(rfn, 1, 1, 1, 1, 1, 1, 0, rst, params, 0), raw.sync),
                "backend_launch": sync_burst(lambda: ctx.launch(handle, fn, prepared), sync),
                "unsafe_async_on": sync_burst(lambda: async_on(op, s), sync),
                "safe_submit": submit_pinned,
                "safe_submit_default_policy": submit_policy,
            },
            B,
            "",
        )
        # one task: await run round trip, in blocks alternating with the
        # Trio floor's (a slow phase of the host hits both alike)
        fl = Floor(raw)
        await fl.run(0)
        lib_rt, floor_rt = [], []
        for _ in range(B):
            floor_rt.append(await _floor_roundtrip(fl, 200))
            lib_rt.append(await _roundtrip(gpu, op, s, 1))
        fl.sync()
        record("await_run_roundtrip", med(lib_rt), "us")
        record("floor_roundtrip_paired", med(floor_rt), "us", "(alternating with the library's)")
        # the same with a lifetime trace recording (a scope of its own), in
        # blocks alternating with the untraced scope's
        trace = trio_cuda.trace.Trace(limit=1_000_000)
        async with trio_cuda.open_scope(device="cuda", streams=4, trace=trace) as traced:
            tbufs = [traced.zeros(256, np.float32) for _ in range(4)]
            top = EMPTY.launch(*tbufs, 256, grid=1, block=1)
            await traced.run(top, stream=traced.streams[0])
            on, off = [], []
            for _ in range(B):
                on.append(await _roundtrip(traced, top, traced.streams[0], 1))
                off.append(await _roundtrip(gpu, op, s, 1))
            record("traced_roundtrip", med(on), "us")
            record("untraced_roundtrip", med(off), "us", "(the same, in alternating blocks)")

        # A/B of the core's completion options: one marker per burst of
        # submissions (batch) or one per submission, and the awaiting task's
        # own spin on its marker before it parks (await_spin)
        variants = (
            ("batch+spin", True, 50e-6),
            ("batch", True, 0.0),
            ("per_sub+spin", False, 50e-6),
            ("per_sub", False, 0.0),
        )
        for tag, batch, spin in variants:
            gpu._completion.batch, gpu._completion.spin = batch, spin
            record(f"core_{tag}:safe_submit", await _submit_burst(gpu, op, s, B), "us")
            record(f"core_{tag}:roundtrip", await _roundtrip(gpu, op, s, B), "us")
            rates = [await _many_tasks(gpu, op, 100, 100) for _ in range(reps(5))]
            record(f"core_{tag}:100_tasks", med(rates), "launch/s")
        caps = ctx.capabilities
        gpu._completion.batch, gpu._completion.spin = caps.batch_markers, caps.await_spin


async def _strategy_bench(
    raw: Raw, strategy: str, spin: float | None, inline: float | None, tag: str
) -> None:
    async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
        ctx: Any = gpu._driver
        ctx.set_wait_strategy(strategy, spin_budget=spin, inline_spin=inline)
        bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
        op = EMPTY.launch(*bufs, 256, grid=1, block=1)
        s = gpu.streams[0]
        await gpu.run(op, stream=s)
        B = reps(9)
        per = []
        for _ in range(B):
            t0 = perf()
            for _ in range(200):
                await gpu.run(op, stream=s)
            per.append((perf() - t0) / 200 * 1e6)
        record(f"{tag}:roundtrip", med(per), "us")

        rates = []
        for _ in range(reps(5)):
            rates.append(await _many_tasks(gpu, op, 100, 100))
        record(f"{tag}:100_tasks", med(rates), "launch/s")

        # idle CPU and wake-up latency while awaiting a long kernel
        long_op = SPIN.launch(np.uint64(100_000_000), grid=1, block=1)
        await gpu.run(SPIN.launch(np.uint64(1000), grid=1, block=1), stream=s)
        cpu = []
        for _ in range(reps(5)):
            gc.collect()
            c0, w0 = time.process_time(), perf()
            await gpu.run(long_op, stream=s)
            cpu.append((time.process_time() - c0) / (perf() - w0) * 100)
        record(f"{tag}:cpu_100ms_kernel", med(cpu), "%core")
        over = []
        short = SPIN.launch(np.uint64(2_000_000), grid=1, block=1)
        for _ in range(reps(9)):
            w0 = perf()
            await gpu.run(short, stream=s)
            over.append((perf() - w0 - 0.002) * 1e6)
        record(f"{tag}:wake_2ms_overshoot", med(over), "us")


async def _many_tasks(gpu: Any, op: Any, ntasks: int, per_task: int, *, spawn: bool = True) -> float:
    """Launches/s of ``ntasks`` tasks, each awaiting ``per_task`` launches of
    its own, one after the other (``op``, or ``op()`` per await where it is a
    function). With ``spawn=False`` the clock starts once every task exists
    and waits at a start line, so Trio's cost of creating the tasks is left
    out and only the awaiting is measured."""
    go = trio.Event()
    make = op if callable(op) else None

    async def worker() -> None:
        if not spawn:
            await go.wait()
        if make is None:
            for _ in range(per_task):
                await gpu.run(op)
        else:
            for _ in range(per_task):
                await gpu.run(make())

    t0 = perf()
    async with trio.open_nursery() as nursery:
        for _ in range(ntasks):
            nursery.start_soon(worker)
        if not spawn:
            await _start_line()
            t0 = perf()
            go.set()
    return ntasks * per_task / (perf() - t0)


async def _conflict_tasks(gpu: Any, a: Any, b: Any, ntasks: int, per_task: int) -> float:
    """Launches/s of ``ntasks`` tasks, task i on stream i % 4, each awaiting
    ``per_task`` typed launches (built per await) that write ``a`` and ``b``:
    every launch is a cross-stream conflict, ordered device-side. The clock
    starts once every task waits at the start line."""
    go = trio.Event()
    streams = gpu.streams

    async def worker(i: int) -> None:
        s = streams[i % len(streams)]
        await go.wait()
        for _ in range(per_task):
            await gpu.run(WRITE2.launch(a, b, 256, grid=1, block=1), stream=s)

    async with trio.open_nursery() as nursery:
        for i in range(ntasks):
            nursery.start_soon(worker, i)
        await _start_line()
        t0 = perf()
        go.set()
    return ntasks * per_task / (perf() - t0)


async def _tasks_bench(raw: Raw) -> None:
    async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
        bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
        op = EMPTY.launch(*bufs, 256, grid=1, block=1)
        await gpu.run(op)
        print("many tasks (each awaiting its own launches)")
        # 100 tasks, a typed launch built per await, rounds alternating with
        # the Trio floor's 100 tasks
        fl = Floor(raw)

        b0, b1, b2, b3 = bufs

        def typed() -> Any:
            return EMPTY.launch(b0, b1, b2, b3, 256, grid=1, block=1)

        rt, rf = [], []
        for _ in range(reps(5)):
            rf.append(await _floor_tasks(fl, 100, 200))
            rt.append(await _many_tasks(gpu, typed, 100, 200, spawn=False))
        fl.sync()
        record("tasks_100_typed", med(rt), "launch/s", "(a typed launch built per await)")
        record("floor_tasks_100_paired", med(rf), "launch/s", "(alternating with the library's)")
        # 100 and 10,000 tasks in turn (the same prebuilt launch)
        r100, r10k = [], []
        for _ in range(reps(5)):
            r100.append(await _many_tasks(gpu, op, 100, 200, spawn=False))
            r10k.append(await _many_tasks(gpu, op, 10_000, 5, spawn=False))
        record("tasks_100", med(r100), "launch/s", "(one prebuilt launch)")
        record("tasks_10000", med(r10k), "launch/s", "(in turn with 100 tasks)")
        # the same, with Trio's task creation inside the clock
        r100 = [await _many_tasks(gpu, op, 100, 200) for _ in range(reps(5))]
        record("tasks_100_with_spawn", med(r100), "launch/s")
        r10k = [await _many_tasks(gpu, op, 10_000, 5) for _ in range(reps(3))]
        record("tasks_10000_with_spawn", med(r10k), "launch/s")
        # 4 streams that all write the same two buffers, a typed launch per await
        a, b = bufs[:2]
        await gpu.run(WRITE2.launch(a, b, 256, grid=1, block=1))
        rc, rp = [], []
        for _ in range(reps(5)):  # (in turn with the typed 100-task rate it is a ratio of)
            rc.append(await _conflict_tasks(gpu, a, b, 100, 200))
            rp.append(await _many_tasks(gpu, typed, 100, 200, spawn=False))
        record("tasks_100_conflict_4_streams", med(rc), "launch/s")
        record("tasks_100_typed_paired_conflict", med(rp), "launch/s", "(in turn with the row above)")

        # per-op memory: peak traced bytes per concurrently awaited op
        for n in (100, 10_000):
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            await _many_tasks(gpu, op, n, 1)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            record(f"mem_per_op_{n}_tasks", (peak - base) / n, "B")


def bench_wait_marker(raw: Raw) -> None:
    """Cross-stream dependency A/B: a chain of empty kernels alternating
    between two streams, each waiting on the other's marker."""
    print("cross-stream wait (µs per dependent hop; host and device)")

    async def main() -> None:
        async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
            ctx: Any = gpu._driver
            bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
            op = EMPTY.launch(*bufs, 256, grid=1, block=1)
            await gpu.run(op)
            fn = gpu._functions[EMPTY]
            a, b = (s.handle for s in gpu.streams)
            N = 2000
            for mode in ("same_stream", "flag", "event"):
                ctx.wait_marker_mode = mode if mode != "same_stream" else "flag"
                host, dev = [], []
                for _ in range(reps(7)):
                    raw.cu.cuCtxSynchronize()
                    t0 = perf()
                    for i in range(N):
                        src, dst = (a, b) if i % 2 else (b, a)
                        if mode == "same_stream":
                            ctx.launch(a, fn, op.prepared)
                            continue
                        m = ctx.record_marker(src)
                        ctx.wait_marker(dst, m)
                        ctx.launch(dst, fn, op.prepared)
                    t1 = perf()
                    raw.cu.cuCtxSynchronize()
                    t2 = perf()
                    host.append((t1 - t0) / N * 1e6)
                    dev.append((t2 - t0) / N * 1e6)
                record(f"hop_{mode}_host", med(host), "us")
                record(f"hop_{mode}_wall", med(dev), "us")
            ctx.wait_marker_mode = "flag"

    trio.run(main)


# --------------------------------------------------------------------------- peers


def bench_peers(raw: Raw) -> None:
    print("peers (host µs per launch, bursts of 1000)")
    B = reps(15)
    try:
        launch, cs = _cupy_launch()
        with cs:
            record("cupy_rawkernel", burst(launch, 1000, cs.synchronize, B), "us")
    except Exception as exc:
        RESULTS["cupy_rawkernel"] = {"value": None, "note": repr(exc)[:200]}
        print("  cupy:", repr(exc)[:200])
    try:
        import torch

        x = torch.zeros(256, device="cuda")
        y = torch.zeros(256, device="cuda")
        z = torch.zeros(256, device="cuda")
        torch.add(x, y, out=z)
        torch.cuda.synchronize()
        record("torch_add", burst(lambda: torch.add(x, y, out=z), 1000, torch.cuda.synchronize, B), "us")
    except Exception as exc:
        RESULTS["torch_add"] = {"value": None, "note": repr(exc)[:200]}
        print("  torch:", repr(exc)[:200])
    try:
        try:
            from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
        except ImportError:
            from cuda.core.experimental import Device, LaunchConfig, Program, ProgramOptions, launch
        dev = Device(0)
        dev.set_current()
        stream = dev.create_stream()
        prog = Program(EMPTY_SRC, code_type="c++", options=ProgramOptions(arch=f"sm_{raw.cc[0]}{raw.cc[1]}"))
        mod = prog.compile("cubin")
        ker = mod.get_kernel("empty")
        cfg = LaunchConfig(grid=1, block=1)
        ptrs = [np.uintp(b) for b in raw.bufs]
        n = np.int32(256)
        launch(stream, cfg, ker, *ptrs, n)
        stream.sync()
        record(
            "cuda_core_launch", burst(lambda: launch(stream, cfg, ker, *ptrs, n), 1000, stream.sync, B), "us"
        )
    except Exception as exc:
        RESULTS["cuda_core_launch"] = {"value": None, "note": repr(exc)[:200]}
        print("  cuda.core:", repr(exc)[:200])


# --------------------------------------------------------------------------- launch modes


async def _submit_burst_of(gpu: Any, make: Callable[[], Any], stream: Any, repeats: int) -> float:
    """Like ``_submit_burst``, but each submission's op is made by ``make()``
    inside the timed loop (the typed launch's checks and packing included)."""
    per = []
    for _ in range(repeats):
        await gpu.run(trio_cuda.ops.value(None), stream=stream)
        gc.disable()
        t0 = perf()
        for _ in range(1000):
            fut = gpu.submit(make(), stream=stream)
        per.append((perf() - t0) / 1000 * 1e6)
        gc.enable()
        await fut.wait()
    return med(per)


async def _launchmodes_bench(raw: Raw) -> None:
    """Host µs per launch of each way to launch a kernel, taken in turn with
    a raw prepacked cuLaunchKernel and (where installed) CuPy's RawKernel in
    the same section, one burst of each per round (the table shows ratios to
    that raw launch, and the typed row's bound is CuPy's ratio to it)."""
    cu = raw.cu
    L = cu.cuLaunchKernel
    fn, st, params = raw.fn, raw.stream, raw.params
    B = reps(15)
    print("launch modes (host µs per launch, bursts of 1000, taken in turn)")
    # raw cuLaunchKernelEx with the programmatic-dependent-launch attribute, prebuilt
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1
    cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1
    cfg.hStream = st
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    LX = cu.cuLaunchKernelEx
    rows: dict[str, BurstFn] = {
        "raw_launch": sync_burst(lambda: L(fn, 1, 1, 1, 1, 1, 1, 0, st, params, 0), raw.sync),
        "raw_launch_ex_pdl": sync_burst(lambda: LX(cfg, fn, params, 0), raw.sync),
    }
    cupy = _cupy_row()
    if cupy is not None:
        rows["cupy_rawkernel"] = cupy

    async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
        bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
        s = gpu.streams[0]
        handle = s.handle
        op = EMPTY.launch(*bufs, 256, grid=1, block=1)
        await gpu.run(op, stream=s)
        async_on = trio_cuda.unsafe.async_on

        def sync() -> None:
            cu.cuStreamSynchronize(handle.cu)

        b0, b1, b2, b3 = bufs

        def typed() -> Any:  # (the arguments written out, as CuPy's row passes its tuple)
            return EMPTY.launch(b0, b1, b2, b3, 256, grid=1, block=1)

        def typed_star() -> Any:  # (unpacked from a list: Python builds a tuple and a dict per call)
            return EMPTY.launch(*bufs, 256, grid=1, block=1)

        def build() -> Any:
            b = EMPTY.builder().grid(1).block(1)
            for x in bufs:
                b.arg(x)
            return b.arg(np.int32(256)).finalize_unchecked()

        built = build()
        pdl = EMPTY.launch(*bufs, 256, grid=1, block=1, pdl=True)
        for warm in (built, pdl):
            await gpu.run(warm, stream=s)

        def submits(make: Callable[[], Any] | None, target: Any) -> BurstFn:
            async def one() -> float:
                if make is None:
                    return await _submit_burst(gpu, target, s, 1)
                return await _submit_burst_of(gpu, make, s, 1)

            return one

        rows.update(
            {
                "typed_launch_only": sync_burst(typed, sync),
                "typed_launch+submit": submits(typed, None),
                "typed_launch_star+submit": submits(typed_star, None),
                "typed_launch+async_on": sync_burst(lambda: async_on(typed(), s), sync),
                "builder_finalize+async_on": sync_burst(lambda: async_on(build(), s), sync),
                "builder_finalized+submit": submits(None, built),
                "builder_finalized+async_on": sync_burst(lambda: async_on(built, s), sync),
                "prebuilt+submit": submits(None, op),
                "async_on": sync_burst(lambda: async_on(op, s), sync),
                "async_on_pdl": sync_burst(lambda: async_on(pdl, s), sync),
            }
        )
        await in_turn(rows, B, "launchmodes:", pairs=(("typed_launch+submit", "cupy_rawkernel"),))


def _cupy_launch() -> tuple[Callable[[], object], Any]:
    """A CuPy RawKernel launch of the empty kernel (4 arrays + 1 int), made
    once, and the non-blocking stream to time it on: the caller enters the
    stream (``with stream:``) around its burst, outside the timed calls, and
    syncs it with ``stream.synchronize``. Raises without CuPy."""
    import cupy as cp

    k = cp.RawKernel(EMPTY_SRC, "empty")
    arrs = [cp.zeros(256, cp.float32) for _ in range(4)]
    args = (*arrs, np.int32(256))
    cs = cp.cuda.Stream(non_blocking=True)

    def launch() -> object:
        return k((1,), (1,), args)

    with cs:
        launch()
    cs.synchronize()
    return launch, cs


def _cupy_row() -> BurstFn | None:
    """One burst of ``_cupy_launch``'s launches, or None without CuPy."""
    try:
        launch, cs = _cupy_launch()
    except Exception as exc:
        print("  launch modes: no CuPy row:", repr(exc)[:200])
        return None

    async def one() -> float:
        with cs:
            return burst(launch, 1000, cs.synchronize, 1)

    return one


def bench_launchmodes(raw: Raw) -> None:
    trio.run(_launchmodes_bench, raw)


# --------------------------------------------------------------------------- graphs


async def _graph_bench(raw: Raw) -> None:
    """Host time of one replay of a 100-kernel graph against 100 safe
    launches of the same kernel (both ``gpu.submit``, bursts with GC off,
    the GPU drained between bursts), plus round trips and the raw
    ``cuGraphLaunch`` for reference."""
    async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
        bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
        k = EMPTY.launch(*bufs, 256, grid=1, block=1)
        s = gpu.streams[0]
        await gpu.run(k, stream=s)
        chain: Any = k
        for _ in range(99):
            chain = chain.then(lambda _: k)
        t0 = perf()
        graph = await gpu.capture(chain, stream=s)
        record("graph_capture_100_kernels", (perf() - t0) * 1e6, "us", "capture + instantiate")
        replay = graph.launch()
        await gpu.run(replay, stream=s)
        B = reps(15)
        print("graphs (host µs; one replay of 100 kernels vs 100 safe launches)")

        async def burst_of(n: int, fn: Callable[[], Any]) -> float:
            """Median host µs per call of ``fn`` in bursts of ``n`` (GC off),
            the scope drained before each burst."""
            per = []
            for _ in range(B):
                await gpu.run(trio_cuda.ops.value(None), stream=s)
                await _settle(gpu)
                gc.disable()
                t0 = perf()
                for _ in range(n):
                    fn()
                per.append((perf() - t0) / n * 1e6)
                gc.enable()
                await gpu.run(trio_cuda.ops.value(None), stream=s)
            return med(per)

        safe = await burst_of(100, lambda: gpu.submit(k, stream=s))
        record("graph_base_100_safe_launches", safe * 100, "us", "100 x gpu.submit(launch)")
        record("graph_replay_submit", await burst_of(100, lambda: gpu.submit(replay, stream=s)), "us")
        async_on = trio_cuda.unsafe.async_on
        record("graph_replay_async_on", await burst_of(100, lambda: async_on(replay, s)), "us")
        for key, op, note in (
            ("graph_replay_roundtrip", replay, "await gpu.run(graph.launch())"),
            ("graph_base_100_kernel_roundtrip", chain, "await gpu.run(the 100-kernel op)"),
        ):
            per = []
            for _ in range(B):
                t0 = perf()
                for _ in range(20):
                    await gpu.run(op, stream=s)
                per.append((perf() - t0) / 20 * 1e6)
            record(key, med(per), "us", note)
        # the raw cuGraphLaunch of the same executable graph
        cu = raw.cu
        ge = graph._exec.handle
        cus = s.handle.cu  # type: ignore[attr-defined]
        await _settle(gpu)
        record(
            "raw_graph_launch",
            burst(lambda: cu.cuGraphLaunch(ge, cus), 100, lambda: cu.cuStreamSynchronize(cus), B),
            "us",
        )
        graph.close()


async def _settle(gpu: Any) -> None:
    """Until the scope retired everything (leases released)."""
    while gpu.statistics().in_flight:  # noqa: ASYNC110 - polling public statistics
        await trio.sleep(0.0001)


# --------------------------------------------------------------------------- table


def v(key: str) -> float | None:
    e = RESULTS.get(key)
    return None if e is None else e.get("value")


def table() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def row(
        name: str,
        value: float | None,
        unit: str,
        base: float | None,
        target: str,
        ok: Callable[[float], bool] | None,
    ) -> None:
        ratio = None if value is None or not base else value / base
        met = None if ratio is None or ok is None else ok(ratio)
        rows.append(
            {"benchmark": name, "value": value, "unit": unit, "ratio": ratio, "target": target, "met": met}
        )

    raw = v("raw_launch")
    raw_rate = 1e6 / raw if raw else None
    row("raw prepacked cuLaunchKernel", raw, "us/launch", raw, "(baseline)", None)
    # measured in turn with a raw launch of their own (the first section's drifts)
    sraw = v("scope_raw_launch") or raw
    row("unsafe.async_on", v("unsafe_async_on"), "us/launch", sraw, "<= 1.10 x raw", lambda r: r <= 1.10)
    row("safe gpu.submit", v("safe_submit"), "us/launch", sraw, "<= 1.5 x raw", lambda r: r <= 1.5)
    row(
        "await gpu.run round trip",
        v("await_run_roundtrip"),
        "us",
        v("floor_roundtrip_paired") or v("floor_roundtrip"),
        "<= 1.15 x Trio floor",
        lambda r: r <= 1.15,
    )
    row(
        "round trip, x launch+sync",
        v("await_run_roundtrip"),
        "us",
        v("raw_launch_sync_roundtrip"),
        "(report)",
        None,
    )
    row("Trio floor round trip", v("floor_roundtrip"), "us", v("raw_launch_sync_roundtrip"), "(floor)", None)
    if v("floor_roundtrip_paired"):  # (the round trip's bound: its blocks alternate with the library's)
        row(
            "Trio floor, paired with the round trip",
            v("floor_roundtrip_paired"),
            "us",
            v("raw_launch_sync_roundtrip"),
            "(the round trip's floor)",
            None,
        )
    row(
        "tracing on, round trip",
        v("traced_roundtrip"),
        "us",
        v("untraced_roundtrip"),
        "<= 1.2 x tracing off",
        lambda r: r <= 1.2,
    )
    t100 = v("tasks_100_typed")
    f100 = v("floor_tasks_100_paired") or v("floor_tasks_100")
    row("Trio floor, 100 tasks", f100, "launch/s", raw_rate, "(floor; x raw rate)", None)
    row(
        "Trio floor, 10,000 tasks",
        v("floor_tasks_10000"),
        "launch/s",
        v("floor_tasks_100"),
        "(floor; x floor 100)",
        None,
    )
    row(
        "100 tasks, typed launch per await",
        t100,
        "launch/s",
        f100,
        ">= 0.85 x Trio floor",
        lambda r: r >= 0.85,
    )
    row("100 tasks, x raw launch rate", t100, "launch/s", raw_rate, "(report)", None)
    row("100 tasks, one prebuilt launch", v("tasks_100"), "launch/s", f100, "(report; x Trio floor)", None)
    row(
        "10,000 tasks",
        v("tasks_10000"),
        "launch/s",
        v("tasks_100"),
        ">= 0.8 x 100-task rate",
        lambda r: r >= 0.8,
    )
    row(
        "100 tasks on 4 streams, same 2 bufs",
        v("tasks_100_conflict_4_streams"),
        "launch/s",
        v("tasks_100_typed_paired_conflict") or t100,
        ">= 0.5 x 100-task rate",
        lambda r: r >= 0.5,
    )
    m100, m10k = v("mem_per_op_100_tasks"), v("mem_per_op_10000_tasks")
    row("memory per op, 10k vs 100 tasks", m10k, "B/op", m100, "no growth (<= 1.2x)", lambda r: r <= 1.2)
    cpu = v("adaptive:cpu_100ms_kernel")
    row("idle CPU awaiting a 100 ms kernel", cpu, "% core", 100.0, "< 5 % of a core", lambda r: r < 0.05)
    row(
        "graph replay, 100-kernel op",
        v("graph_replay_submit"),
        "us/replay",
        v("graph_base_100_safe_launches"),
        ">= 10 x less host time",
        lambda r: r <= 0.1,
    )
    one = v("chunks:one_kernel")
    row(
        "4 disjoint chunks, 20 ms, 4 streams",
        v("chunks:disjoint"),
        "s",
        one,
        "<= 1.3 x one kernel",
        lambda r: r <= 1.3,
    )
    row("4 overlapping chunks (control)", v("chunks:overlapping"), "s", one, "(ordered: ~4 x)", None)
    lm_raw = v("launchmodes:raw_launch")
    # the typed row and CuPy measured in turn against one raw baseline where
    # CuPy is present; else CuPy's own section, else the H200 host's figure
    lm_cupy = v("launchmodes:cupy_rawkernel")
    cupy = lm_cupy or v("cupy_rawkernel")
    cupy_base = lm_raw if lm_cupy else raw
    cupy_ratio = cupy / cupy_base if cupy and cupy_base else None
    bound = cupy_ratio if cupy_ratio is not None else 1.9
    row(
        "typed k.launch + gpu.submit",
        v("launchmodes:typed_launch+submit"),
        "us/launch",
        lm_raw,
        f"<= CuPy ratio ({bound:.2f}{'' if cupy_ratio else ', measured on the H200 host'})",
        lambda r: r <= bound,
    )
    paired = v("launchmodes:typed_launch+submit/cupy_rawkernel")
    if paired is not None:
        row("typed row / CuPy, per round", paired, "x", 1.0, "(report; <= 1: faster)", None)
    row(
        "builder + finalize + async_on",
        v("launchmodes:builder_finalize+async_on"),
        "us/launch",
        lm_raw,
        "<= 2 x raw",
        lambda r: r <= 2.0,
    )
    for key, name in (
        ("launchmodes:typed_launch+submit", "launch modes: typed launch + submit"),
        ("launchmodes:typed_launch_star+submit", "launch modes: typed launch(*list) + submit"),
        ("launchmodes:typed_launch+async_on", "launch modes: typed launch + async_on"),
        ("launchmodes:builder_finalize+async_on", "launch modes: build+finalize+async_on"),
        ("launchmodes:builder_finalized+submit", "launch modes: finalized builder submit"),
        ("launchmodes:builder_finalized+async_on", "launch modes: finalized builder async_on"),
        ("launchmodes:async_on", "launch modes: async_on"),
        ("launchmodes:async_on_pdl", "launch modes: async_on, pdl (LaunchEx)"),
        ("launchmodes:raw_launch_ex_pdl", "launch modes: raw cuLaunchKernelEx, pdl"),
    ):
        if v(key) is not None:
            row(name, v(key), "us/launch", lm_raw, "(vs raw, same section)", None)
    row(
        "tile typed launch + submit",
        v("tile:typed_launch+submit"),
        "us/launch",
        v("tile:simt_typed_launch+submit"),
        "<= 1.2 x SIMT, same arity",
        lambda r: r <= 1.2,
    )
    row(
        "tile device time, trio vs raw cubin",
        v("tile:device_trio"),
        "ms/launch",
        v("tile:device_raw"),
        "<= 1.02 x raw",
        lambda r: r <= 1.02,
    )
    row(
        "tile GEMM f16 8192^3",
        v("tile:example_tflops"),
        "TFLOP/s",
        v("tile:cublas_tflops"),
        ">= 0.8 x cuBLAS (CuPy)",
        lambda r: r >= 0.8,
    )
    for key, name in (
        ("cupy_rawkernel", "CuPy RawKernel"),
        ("torch_add", "torch.add"),
        ("cuda_core_launch", "cuda.core launch"),
    ):
        row(name, v(key), "us/launch", raw, "(reference)", None)
    row("CuPy RawKernel, launch modes section", lm_cupy, "us/launch", lm_raw, "(the typed row's bound)", None)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print(f"{'benchmark':<36} {'value':>12} {'unit':<10} {'ratio':>7}  {'target':<24} met")
    print("-" * 100)
    for r in rows:
        val = "n/a" if r["value"] is None else f"{r['value']:.2f}"
        unit = r["unit"]
        if r["value"] is None and "n/a" in unit:
            val, unit = "n/a", unit
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "MISSED")
        print(f"{r['benchmark']:<36} {val:>12} {unit:<10} {ratio:>7}  {r['target']:<24} {met}")


# --------------------------------------------------------------------------- multigpu


def _bench_multigpu() -> None:
    """Peer-copy bandwidth vs one device's d2d rate, and compute overlap on
    two devices (``benchmarks/multigpu.py``; needs two GPUs)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multigpu import bench_multigpu

    bench_multigpu(record, reps)


def _bench_chunks() -> None:
    """Disjoint chunks of one buffer on 4 streams (``benchmarks/chunks.py``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from chunks import bench_chunks

    bench_chunks(record, reps)


def _bench_tile() -> None:
    """Tile kernels (cuTile) against SIMT launches, raw launches of the same
    cubin and cuBLAS (``benchmarks/tile.py``; needs cuda-tile and the cubins
    in the tile cache)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tile import bench_tile

    bench_tile(record, reps, _submit_burst_of)


def _bench_policy() -> None:
    """The default stream policy against the others on independent work
    (``benchmarks/policy.py``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from policy import bench_policy

    bench_policy(record, reps)


# --------------------------------------------------------------------------- main


STRATEGIES = [
    # tag, strategy, spin budget, inline spin
    ("adaptive", "adaptive", None, None),
    ("adaptive_no_inline", "adaptive", None, 0.0),
    # the waiter-thread threshold: cooperative spin before the handoff parks
    ("adaptive_spin50us", "adaptive", 50e-6, None),
    ("adaptive_spin1ms", "adaptive", 1e-3, None),
    ("sleep_poll", "sleep", None, 0.0),
    ("event_poll", "event", None, 0.0),
    ("thread_block", "thread", 0.0, 0.0),
    ("thread_block+spin", "thread", 200e-6, 20e-6),
]


def main() -> int:
    global QUICK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the results as JSON to this path")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated sections: raw,floor,lib,tasks,strategies,hops,graphs,peers,launchmodes,"
        "multigpu,policy,chunks,tile",
    )
    args = ap.parse_args()
    QUICK = args.quick
    probe = probe_cuda()
    if not probe.available:
        print(f"no CUDA device: {probe.reason}")
        return 0
    only = set(filter(None, args.only.split(",")))

    def want(name: str) -> bool:
        return not only or name in only

    raw = Raw()
    sections: list[tuple[str, Callable[[], None]]] = [
        ("raw", lambda: bench_raw(raw)),
        ("floor", lambda: trio.run(_floor_bench, raw)),
        ("lib", lambda: trio.run(_scope_bench, raw)),
        ("tasks", lambda: trio.run(_tasks_bench, raw)),
        ("hops", lambda: bench_wait_marker(raw)),
    ]
    for tag, strat, spin, inline in STRATEGIES:
        sections.append(
            (
                "strategies",
                lambda tag=tag, strat=strat, spin=spin, inline=inline: (  # type: ignore[misc]
                    print(f"completion strategy {tag}"),
                    trio.run(_strategy_bench, raw, strat, spin, inline, tag),
                ),
            )
        )
    sections.append(("graphs", lambda: trio.run(_graph_bench, raw)))
    sections.append(("peers", lambda: bench_peers(raw)))
    sections.append(("launchmodes", lambda: bench_launchmodes(raw)))
    sections.append(("multigpu", lambda: _bench_multigpu()))
    sections.append(("policy", lambda: _bench_policy()))
    sections.append(("chunks", lambda: _bench_chunks()))
    sections.append(("tile", lambda: _bench_tile()))
    t0 = perf()
    for name, fn in sections:
        if not want(name):
            continue
        try:
            fn()
        except Exception as exc:  # keep going: one broken section must not hide the rest
            import traceback

            traceback.print_exc()
            RESULTS[f"error:{name}"] = repr(exc)[:300]
    rows = table()
    print_table(rows)
    from trio_cuda._backends.cuda import direct

    path = "direct driver calls" if direct.entries() is not None else "cuda.bindings wrappers"
    if direct.pure_requested():
        path += " (TRIO_CUDA_PURE is set)"
    elif not direct.built():
        path += " (the extension is not built)"
    RESULTS["launch_path"] = path
    from trio_cuda.__main__ import launch_making_line

    RESULTS["launch_making"] = making = launch_making_line()
    print(
        f"\n(total {perf() - t0:.1f} s; device: {probe.device_count} GPU(s), driver {probe.driver_version}; "
        f"launch path: {path}; {making})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": RESULTS, "table": rows}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
