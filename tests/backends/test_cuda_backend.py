"""The cuda backend on a real GPU, through the public API.

Every test here is marked ``gpu`` and skips cleanly without a CUDA device
(``trio_cuda._backends.probe_cuda()``). Under compute-sanitizer (detected by
``tests/helpers/sanitizer.py`` from the variables the tool sets for the processes it
watches, or ``TRIO_CUDA_SANITIZER=1``) the tests that fault or fail a driver call on
purpose are skipped, so that the tool's report counts only real errors, and
timing thresholds are relaxed. Run it with ``--show-backtrace device`` (``nox
-s sanitizer``): host backtraces make the tool keep the Python frames of each
launching call, which pins their local arrays past retirement.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers import internals
from tests.helpers.sanitizer import SLOW, skip_under_sanitizer
from trio_cuda import In, InOut, Kernel, Out, Scalar, ops
from trio_cuda._backends import probe_cuda

_PROBE = probe_cuda()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}"),
]

SAXPY_SRC = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

SPIN_SRC = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// spin for `ns` nanoseconds, then y[0] = x[0] + add (reads x after the spin)
extern "C" __global__ void spin_copy(unsigned long long ns, const int* x, int* y, int add) {
    unsigned long long t0 = now_ns();
    while (now_ns() - t0 < ns) { }
    if (threadIdx.x == 0 && blockIdx.x == 0) y[0] = x[0] + add;
}
// spin for `ns` nanoseconds, then y[0] = value
extern "C" __global__ void spin_set(unsigned long long ns, int* y, int value) {
    unsigned long long t0 = now_ns();
    while (now_ns() - t0 < ns) { }
    if (threadIdx.x == 0 && blockIdx.x == 0) y[0] = value;
}
"""

ADD_ONE_SRC = r"""
extern "C" __global__ void add_one(const int* x, int* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + 1;
}
"""


def saxpy_ref(a: np.float32, x: np.ndarray, y: np.ndarray, n: np.int32) -> None:
    y[:n] = a * x[:n] + y[:n]


SAXPY = Kernel.from_source(
    SAXPY_SRC, "saxpy", params=[Scalar("f4"), In("f4"), InOut("f4"), Scalar("i4")], reference=saxpy_ref
)
SPIN_COPY = Kernel.from_source(
    SPIN_SRC, "spin_copy", params=[Scalar("u8"), In("i4"), Out("i4"), Scalar("i4")]
)
SPIN_SET = Kernel.from_source(SPIN_SRC, "spin_set", params=[Scalar("u8"), Out("i4"), Scalar("i4")])
ADD_ONE = Kernel.from_source(ADD_ONE_SRC, "add_one", params=[In("i4"), Out("i4"), Scalar("i4")])


async def _let_handoff_start() -> None:
    """A scope whose body does not yield can exit before its completion-handoff
    task first ran; with the core as of this writing that exit then waits
    forever (the handoff's cancel scope is not registered yet when the exit
    cancels it; reported to the core). Two checkpoints make sure it ran."""
    await trio.lowlevel.checkpoint()
    await trio.lowlevel.checkpoint()


def ms(x: float) -> np.uint64:
    return np.uint64(int(x * 1e6))


def grid_for(n: int, block: int = 256) -> int:
    return max(1, (n + block - 1) // block)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # one compilation cache for this test session, never the user's
    monkeypatch.setenv("TRIO_CUDA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "nvrtc-cache"))


async def test_device_info() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        info = gpu.device
        assert info.backend == "cuda"
        assert info.name
        assert info.compute_capability >= (7, 0)
        assert info.multiprocessor_count > 0
        assert info.total_memory > 1 << 30
        assert info.max_shared_memory_per_block_optin >= info.max_shared_memory_per_block
        assert info.max_block_dim[0] >= 1024
        assert gpu.statistics().backend == "cuda"
        await _let_handoff_start()


async def test_auto_picks_cuda() -> None:
    async with trio_cuda.open_scope() as gpu:
        assert gpu.backend == "cuda"
        await _let_handoff_start()


async def test_saxpy_matches_numpy() -> None:
    rng = np.random.default_rng(1)
    n = 100_003
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    async with trio_cuda.open_scope(device="cuda") as gpu:
        dx = await gpu.to_device(x)
        dy = await gpu.to_device(y)
        out = await gpu.run(SAXPY.launch(2.5, dx, dy, n, grid=grid_for(n), block=256))
        assert out is dy
        got = await gpu.to_host(dy)
    expect = y.copy()
    saxpy_ref(np.float32(2.5), x, expect, np.int32(n))
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((1,), np.float32),
        ((1000,), np.int64),
        ((3, 5, 7), np.float16),
        ((10_000_000,), np.float32),
        ((300 << 20,), np.uint8),
    ],
)
async def test_round_trip(shape: tuple[int, ...], dtype: Any) -> None:
    rng = np.random.default_rng(2)
    host = (rng.integers(0, 100, size=shape)).astype(dtype)
    async with trio_cuda.open_scope(device="cuda") as gpu:
        d = await gpu.to_device(host)
        assert d.shape == host.shape
        assert d.dtype == host.dtype
        back = await gpu.to_host(d)
        np.testing.assert_array_equal(back, host)
        # the staging buffers went back to the pool
        ctx = internals.driver_of(gpu)
        assert ctx.staging_statistics()["outstanding"] == 0  # type: ignore[attr-defined]


async def test_empty_array_round_trip() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        d = await gpu.to_device(np.zeros(0, np.float32))
        back = await gpu.to_host(d)
        assert back.shape == (0,)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (np.uint8, 0xAB),
        (np.int16, 0x1234),
        (np.float16, 1.5),
        (np.float32, -2.75),
        (np.int32, 0x01020304),
        (np.float64, 1.25),  # different 32-bit halves: two strided fills
        (np.int64, 0x0102030405060708),
        (np.uint64, 0x0000000500000005),  # equal halves: one 32-bit fill
        (np.float64, 0.0),
    ],
)
async def test_fill(dtype: Any, value: Any) -> None:
    n = 3_000_001
    async with trio_cuda.open_scope(device="cuda") as gpu:
        arr = gpu.full(n, value, dtype)
        got = await gpu.to_host(arr)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, np.full(n, value, dtype))
        # fill part of a live array through ops.fill
        await gpu.run(ops.fill(arr, 0))
        assert not (await gpu.to_host(arr)).any()


async def test_copy_d2d() -> None:
    src = np.arange(1 << 20, dtype=np.int32)
    async with trio_cuda.open_scope(device="cuda") as gpu:
        a = await gpu.to_device(src)
        b = gpu.empty(src.shape, src.dtype)
        await gpu.run(ops.copy(b, a))
        np.testing.assert_array_equal(await gpu.to_host(b), src)
        # host<->device through ops.copy too
        host = np.empty_like(src)
        await gpu.run(ops.copy(host, b))
        np.testing.assert_array_equal(host, src)


class Ticker:
    """A task that proves the loop is not blocked."""

    def __init__(self) -> None:
        self.ticks = 0
        self.max_gap = 0.0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            self.ticks += 1


@pytest.mark.parametrize("wait_mode", ["event", "flag"])
async def test_cross_stream_raw_with_long_kernel(wait_mode: str) -> None:
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu, trio.open_nursery() as nursery:
        internals.driver_of(gpu).wait_marker_mode = wait_mode
        s0, s1 = gpu.streams
        ticker = Ticker()
        x = await gpu.to_device(np.array([5], np.int32), stream=s0)
        y = gpu.zeros(1, np.int32, stream=s1)
        # load (compile) both kernels before timing
        await gpu.run(SPIN_SET.launch(np.uint64(0), y, 0, grid=1, block=1), stream=s1)
        await gpu.run(ADD_ONE.launch(x, y, 1, grid=1, block=32), stream=s1)
        # (NVRTC compiles and module loads run on the loop thread: start the
        # ticker only now)
        await nursery.start(ticker.run)
        # (a full garbage collection late in a big test process pauses the
        # loop for 100-300 ms on the GPU host: not this library's gap)
        gc.disable()
        try:
            t0 = time.perf_counter()
            # s0: a 300 ms kernel writes x = 42; s1 reads x (RAW) -> must see 42
            f1 = gpu.submit(SPIN_SET.launch(ms(300), x, 42, grid=1, block=1), stream=s0)
            submit_time = time.perf_counter() - t0
            got = await gpu.run(ADD_ONE.launch(x, y, 1, grid=1, block=32), stream=s1)
            elapsed = time.perf_counter() - t0
        finally:
            gc.enable()
        assert got is y
        await f1.wait()
        assert (await gpu.to_host(y))[0] == 43
        assert elapsed >= 0.29
        assert submit_time < 0.05 * SLOW
        # the loop kept ticking while the GPU worked
        assert ticker.ticks >= 100 / SLOW
        assert ticker.max_gap < 0.05 * SLOW
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("wait_mode", ["event", "flag"])
async def test_cross_stream_war_with_long_kernel(wait_mode: str) -> None:
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        internals.driver_of(gpu).wait_marker_mode = wait_mode
        s0, s1 = gpu.streams
        x = await gpu.to_device(np.array([5], np.int32), stream=s0)
        y = gpu.zeros(1, np.int32, stream=s0)
        await gpu.run(ops.value(None), stream=s0)
        # s0 reads x after 300 ms; s1 overwrites x (WAR) -> the read sees 5
        f1 = gpu.submit(SPIN_COPY.launch(ms(300), x, y, 0, grid=1, block=1), stream=s0)
        await gpu.run(ops.fill(x, 7), stream=s1)
        assert f1.done()
        assert (await gpu.to_host(y))[0] == 5
        assert (await gpu.to_host(x))[0] == 7


async def test_cancellation_keeps_leases_until_the_kernel_finished() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        y = gpu.zeros(1 << 20, np.int32)
        x = gpu.zeros(1, np.int32)
        await gpu.load(SPIN_COPY)  # compiling (the first time in a process) is not the kernel's time
        await gpu.run(ops.value(None))
        before = gpu.statistics()
        t0 = time.perf_counter()
        with trio.move_on_after(0.05) as cs:
            await gpu.run(SPIN_COPY.launch(ms(500), x, y, 3, grid=1, block=1))
        assert cs.cancelled_caught
        assert time.perf_counter() - t0 < 0.2 * SLOW  # Cancelled promptly
        st = gpu.statistics()
        assert st.in_flight == 1
        assert st.leases_held == 2
        assert st.retained_bytes == y.nbytes + x.nbytes
        # dropping the handles does not free memory the kernel still uses
        y.close()
        x.close()
        assert gpu.statistics().live_allocations == before.live_allocations
        while gpu.statistics().in_flight:  # noqa: ASYNC110 - polling public statistics
            await trio.sleep(0.01)
        assert time.perf_counter() - t0 >= 0.49
        st = gpu.statistics()
        assert st.leases_held == 0
        assert st.live_allocations == before.live_allocations - 2


async def test_cancelled_before_submission_submits_nothing() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        x = gpu.zeros(1, np.int32)
        submitted = gpu.statistics().submitted
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.run(SPIN_SET.launch(ms(1), x, 1, grid=1, block=1))
        assert gpu.statistics().submitted == submitted


async def test_dropped_futures_are_retained_and_drained() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        y = gpu.zeros(1, np.int32)
        gpu.submit(SPIN_SET.launch(ms(100), y, 9, grid=1, block=1))  # dropped at once
        y.close()  # and the array handle too
        assert gpu.statistics().in_flight >= 1
        assert gpu.statistics().live_allocations == 1
    assert gpu.statistics().in_flight == 0
    assert gpu.statistics().live_allocations == 0


async def test_drain_at_scope_exit() -> None:
    t0 = time.perf_counter()
    async with trio_cuda.open_scope(device="cuda") as gpu:
        y = gpu.zeros(1, np.int32)
        fut = gpu.submit(SPIN_SET.launch(ms(300), y, 4, grid=1, block=1))
    assert time.perf_counter() - t0 >= 0.29
    assert fut.done()
    st = gpu.statistics()
    assert st.completed == st.submitted
    assert st.live_allocations == 0


async def test_host_closure_runs_in_stream_order() -> None:
    events: list[tuple[str, float]] = []
    async with trio_cuda.open_scope(device="cuda", streams=1) as gpu:
        y = gpu.zeros(1, np.int32)
        await gpu.run(ops.value(None))
        t0 = time.perf_counter()
        op = (
            SPIN_SET.launch(ms(100), y, 1, grid=1, block=1)
            .then(lambda _: ops.host_closure(lambda: events.append(("a", time.perf_counter() - t0))))
            .then(lambda _: SPIN_SET.launch(ms(1), y, 2, grid=1, block=1))
            .then(lambda _: ops.host_closure(lambda: events.append(("b", time.perf_counter() - t0))))
        )
        f1 = gpu.submit(op)
        f2 = gpu.submit(ops.host_closure(lambda: events.append(("c", time.perf_counter() - t0)) or 17))
        assert await f2.wait() == 17
        await f1.wait()
        assert [e[0] for e in events] == ["a", "b", "c"]
        assert events[0][1] >= 0.099  # after the kernel before it
        assert (await gpu.to_host(y))[0] == 2


@skip_under_sanitizer("a deliberate failing driver call, which compute-sanitizer reports")
async def test_out_of_memory() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        with pytest.raises(trio_cuda.OutOfMemoryError) as info:
            gpu.empty(1 << 50, np.uint8)
        assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
        # the scope still works
        d = await gpu.to_device(np.arange(10))
        np.testing.assert_array_equal(await gpu.to_host(d), np.arange(10))


async def test_compile_error_carries_the_log() -> None:
    bad = Kernel.from_source('extern "C" __global__ void bad() { this is not c++; }', "bad", params=[])
    async with trio_cuda.open_scope(device="cuda") as gpu:
        await _let_handoff_start()
        with pytest.raises(trio_cuda.CudaError) as info:
            await gpu.run(bad.launch(grid=1, block=1))
        assert "NVRTC" in info.value.name
        assert "error" in info.value.text
        assert gpu.statistics().in_flight == 0


async def test_nvrtc_disk_cache_hit(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda._backends import cuda as backend

    monkeypatch.setenv("TRIO_CUDA_CACHE_DIR", str(tmp_path))
    src = ADD_ONE_SRC + f"\n// {uuid.uuid4()}\n"
    hits = []
    for _ in range(2):
        k = Kernel.from_source(src, "add_one", params=[In("i4"), Out("i4"), Scalar("i4")])
        before = backend.compile_statistics()
        async with trio_cuda.open_scope(device="cuda") as gpu:
            x = await gpu.to_device(np.arange(64, dtype=np.int32))
            y = gpu.empty(64, np.int32)
            await gpu.run(k.launch(x, y, 64, grid=1, block=64))
            np.testing.assert_array_equal(await gpu.to_host(y), np.arange(64) + 1)
            fn = internals.loaded_function(gpu, k)
            hits.append(fn.from_cache)  # type: ignore[attr-defined]
        after = backend.compile_statistics()
        hits.append(after["disk_hits"] - before["disk_hits"])
    assert hits == [False, 0, True, 1]
    assert len(list(tmp_path.glob("*.cubin"))) == 1


async def test_ptx_and_cubin_loading() -> None:
    from trio_cuda._backends import cuda as backend
    from trio_cuda._backends.cuda import nvrtc as _cuda_nvrtc

    async with trio_cuda.open_scope(device="cuda") as gpu:
        cc = gpu.device.compute_capability
        ptx = _cuda_nvrtc.compile_to_ptx(ADD_ONE_SRC, "add_one", cc)
        assert b".entry add_one" in ptx
        cubin = _cuda_nvrtc.compile_source(
            ADD_ONE_SRC,
            "add_one",
            (),
            cc,
            internals.driver_of(gpu).driver_version,
            use_cache=False,  # type: ignore[attr-defined]
        ).image
        params = [In("i4"), Out("i4"), Scalar("i4")]
        x = await gpu.to_device(np.arange(100, dtype=np.int32))
        kernels = (
            Kernel.from_ptx(ptx.decode(), "add_one", params=params),
            Kernel.from_cubin(cubin, "add_one", params=params),
        )
        for k in kernels:
            y = gpu.empty(100, np.int32)
            await gpu.run(k.launch(x, y, 100, grid=1, block=128))
            np.testing.assert_array_equal(await gpu.to_host(y), np.arange(100) + 1)
            fn = internals.loaded_function(gpu, k)
            assert isinstance(fn, backend.CudaFunction)
            assert fn.image_kind == k.image_kind


async def test_async_on() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        s = gpu.streams[0]
        n = 4096
        x = await gpu.to_device(np.arange(n, dtype=np.float32), stream=s)
        y = await gpu.to_device(np.ones(n, dtype=np.float32), stream=s)
        launch = SAXPY.launch(3.0, x, y, n, grid=grid_for(n), block=256)
        submitted = gpu.statistics().submitted
        for _ in range(10):
            out = trio_cuda.unsafe.async_on(launch, s)
            assert out is y
        assert gpu.statistics().submitted == submitted  # nothing retained or tracked
        got = await gpu.to_host(y, stream=s)  # same stream: FIFO after the launches
        np.testing.assert_allclose(got, 1 + 30 * np.arange(n, dtype=np.float32))
        # the unsafe h2d path: staging is not reused before the stream passed it
        host = np.full(n, 5, np.float32)
        trio_cuda.unsafe.async_on(ops.copy(y, host), s)
        host[:] = 6  # the backend staged the data
        np.testing.assert_array_equal(await gpu.to_host(y, stream=s), np.full(n, 5, np.float32))


async def test_cluster_and_large_shared_memory() -> None:
    cluster_src = r"""
    extern "C" __global__ void rank(unsigned int* out) {
        unsigned int r;
        asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
        if (threadIdx.x == 0) out[blockIdx.x] = r;
    }
    extern "C" __global__ void smem(int* out, int n) {
        extern __shared__ int buf[];
        for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = i;
        __syncthreads();
        int s = 0;
        if (threadIdx.x == 0) { for (int i = 0; i < n; ++i) s += buf[i]; out[0] = s; }
    }
    """
    rank = Kernel.from_source(cluster_src, "rank", params=[Out("u4")])
    smem = Kernel.from_source(cluster_src, "smem", params=[Out("i4"), Scalar("i4")])
    async with trio_cuda.open_scope(device="cuda") as gpu:
        if gpu.device.compute_capability < (9, 0):
            pytest.skip("clusters need sm_90")
        out = gpu.zeros(8, np.uint32)
        await gpu.run(rank.launch(out, grid=8, block=32, cluster=4))
        np.testing.assert_array_equal(await gpu.to_host(out), [0, 1, 2, 3, 0, 1, 2, 3])
        n = 100 * 1024 // 4
        res = gpu.zeros(1, np.int32)
        await gpu.run(smem.launch(res, n, grid=1, block=256, shared_mem=n * 4))
        assert (await gpu.to_host(res))[0] == sum(range(n))


@pytest.mark.parametrize("strategy", ["adaptive", "sleep", "event", "thread"])
async def test_wait_strategies(strategy: str) -> None:
    async with trio_cuda.open_scope(device="cuda", streams=3) as gpu:
        internals.driver_of(gpu).set_wait_strategy(strategy)
        ys = [gpu.zeros(1, np.int32, stream=s) for s in gpu.streams]
        await gpu.run(ops.value(None))
        async with trio.open_nursery() as nursery:
            for i, (s, y) in enumerate(zip(gpu.streams, ys, strict=True)):
                op = SPIN_SET.launch(ms(20 * (i + 1)), y, i + 10, grid=1, block=1)
                nursery.start_soon(functools.partial(gpu.run, op, stream=s))
        for i, y in enumerate(ys):
            assert (await gpu.to_host(y))[0] == i + 10
        # many short round trips
        x = gpu.zeros(1, np.int32)
        for _ in range(50):
            await gpu.run(SPIN_SET.launch(np.uint64(0), x, 1, grid=1, block=1))


async def test_many_tasks() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        x = await gpu.to_device(np.arange(32, dtype=np.int32))
        outs = [gpu.empty(32, np.int32) for _ in range(200)]

        async def one(i: int) -> None:
            for _ in range(5):
                await gpu.run(ADD_ONE.launch(x, outs[i], 32, grid=1, block=32))

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, i)
        for o in outs[:5]:
            np.testing.assert_array_equal(await gpu.to_host(o), np.arange(32) + 1)
        assert gpu.statistics().in_flight == 0


STICKY_SCRIPT = textwrap.dedent(
    r"""
    import json, warnings
    import numpy as np
    import trio
    import trio_cuda
    from tests.helpers import internals
    from trio_cuda import InOut, Kernel, Scalar

    SRC = '''
    extern "C" __global__ void poke(unsigned long long addr, int* y) {
        y[0] = 1;
        *(volatile int*)addr = 1;   // illegal address: a sticky error
    }
    '''
    poke = Kernel.from_source(SRC, "poke", params=[Scalar("u8"), InOut("i4")])
    out = {}

    async def main():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            async with trio_cuda.open_scope(device="cuda") as gpu:
                other = await gpu.to_device(np.arange(10))
                y = gpu.zeros(1 << 20, np.int32)
                live = gpu.statistics().live_allocations
                try:
                    await gpu.run(poke.launch(np.uint64(16), y, grid=1, block=1))
                except trio_cuda.CompletionUnknownError as exc:
                    out["error"] = type(exc).__name__
                    out["cause"] = getattr(exc.__cause__, "name", repr(exc.__cause__))
                st = gpu.statistics()
                out["quarantined"] = st.quarantined
                out["quarantined_bytes"] = st.quarantined_bytes
                out["live_before"] = live
                out["live_after"] = st.live_allocations
                out["y_quarantined"] = y.quarantined
                try:
                    await gpu.run(trio_cuda.ops.fill(y, 0))
                except trio_cuda.CompletionUnknownError:
                    out["reuse_refused"] = True
                out["sticky"] = internals.driver_of(gpu).sticky_error.name
                out["frees_seen"] = 0
            out["live_at_exit"] = gpu.statistics().live_allocations
        except BaseException as exc:
            out["exit_error"] = repr(exc)[:300]

    trio.run(main)
    print("RESULT " + json.dumps(out))
    """
)


@skip_under_sanitizer("a deliberate illegal address, which compute-sanitizer reports (in the subprocess too)")
def test_sticky_illegal_address_in_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", STICKY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, (proc.stdout, proc.stderr)
    res = json.loads(line[0][len("RESULT ") :])
    assert res["error"] == "CompletionUnknownError", res
    assert res["cause"] == "CUDA_ERROR_ILLEGAL_ADDRESS", res
    assert res["quarantined"] >= 1
    assert res["quarantined_bytes"] >= 4 << 20
    assert res["y_quarantined"] is True
    assert res["reuse_refused"] is True
    assert res["live_after"] == res["live_before"]  # nothing was freed
    assert res["live_at_exit"] == res["live_before"]  # not even at scope exit
    assert res["sticky"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
