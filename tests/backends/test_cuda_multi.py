"""Several real GPUs of one host: per-device scopes, peer copies with leases on
both sides, cross-device ordering, scope exit with foreign leases, and pools.

Marked ``gpu`` and ``multigpu``; skips cleanly with fewer than two devices.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import In, Kernel, Out, Scalar, ops
from trio_cuda._backends import probe_cuda

_PROBE = probe_cuda()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(
        _PROBE.device_count < 2,
        reason=f"needs 2 CUDA devices, found {_PROBE.device_count} ({_PROBE.reason or 'ok'})",
    ),
]

SRC = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// spin for `ns` nanoseconds (thread 0 of block 0), then y[i] = x[i] + add for all i
extern "C" __global__ void spin_add(unsigned long long ns, const float* x, float* y, float add, int n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t0 = now_ns();
        while (now_ns() - t0 < ns) { }
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i] + add;
    }
}
"""


def _spin_add_ref(ns, x, y, add, n):
    y[:n] = x[:n] + add


SPIN_ADD = Kernel.from_source(
    SRC,
    "spin_add",
    params=[Scalar("u8"), In("f4"), Out("f4"), Scalar("f4"), Scalar("i4")],
    reference=_spin_add_ref,
)
N = 1 << 16


def spin_add(x, y, add: float, ms: float = 0.0):
    return SPIN_ADD.launch(np.uint64(int(ms * 1e6)), x, y, np.float32(add), x.size, grid=1, block=256)


def arange(n: int = N, start: float = 0.0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.float32)


def test_two_scopes_on_two_devices_at_once() -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device="cuda:0") as a, trio_cuda.open_scope(device="cuda:1") as b:
            assert (a.device.ordinal, b.device.ordinal) == (0, 1)
            xa = await a.to_device(arange())
            xb = await b.to_device(arange(start=1))
            ya = a.empty(N, np.float32)
            yb = b.empty(N, np.float32)
            # interleaved submissions: each context must be made current around its calls
            fa = a.submit(spin_add(xa, ya, 1.0, ms=5))
            fb = b.submit(spin_add(xb, yb, 2.0, ms=5))
            await fa.wait()
            await fb.wait()
            np.testing.assert_array_equal(await a.to_host(ya), arange() + 1)
            np.testing.assert_array_equal(await b.to_host(yb), arange(start=1) + 2)

    trio.run(main)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_peer_copy_orders_after_the_other_devices_writer(direction: str) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device="cuda:0") as a, trio_cuda.open_scope(device="cuda:1") as b:
            x = await a.to_device(arange())
            x2 = a.empty(N, np.float32)
            y = await b.to_device(np.zeros(N, np.float32))
            w = a.submit(spin_add(x, x2, 7.0, ms=50))  # a slow writer of x2 on device 0
            copy = ops.copy(y, x2)
            c = b.submit(copy) if direction == "pull" else a.submit(copy)
            assert not w.done()
            sa = a.statistics()
            if direction == "pull":
                assert sa.foreign_leases == 1
            await c.wait()  # the copy waited device-side for the writer
            assert w.done()
            np.testing.assert_array_equal(await b.to_host(y), arange() + 7)

    trio.run(main)


def test_other_devices_writer_waits_for_an_in_flight_peer_read() -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device="cuda:0") as a, trio_cuda.open_scope(device="cuda:1") as b:
            x = await a.to_device(arange())
            zb = await b.to_device(arange())
            tb = b.empty(N, np.float32)
            y = b.empty(N, np.float32)
            slow = b.submit(spin_add(zb, tb, 0.0, ms=50))  # keeps b's stream 0 busy
            c = b.submit(ops.copy(y, x), stream=slow.stream)  # reads x after that
            w = a.submit(ops.fill(x, -1.0))  # write-after-read: must wait for the copy
            await w.wait()
            await c.wait()
            np.testing.assert_array_equal(await b.to_host(y), arange())
            np.testing.assert_array_equal(await a.to_host(x), np.full(N, -1.0, np.float32))

    trio.run(main)


def test_owner_keeps_a_dropped_source_until_the_peer_copy_retired() -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device="cuda:0") as a, trio_cuda.open_scope(device="cuda:1") as b:
            zb = await b.to_device(arange())
            tb = b.empty(N, np.float32)
            x = await a.to_device(arange(start=3))
            y = b.empty(N, np.float32)
            # long enough to outlast a full collection of a big test process
            slow = b.submit(spin_add(zb, tb, 0.0, ms=1000))
            c = b.submit(ops.copy(y, x), stream=slow.stream)
            del x
            gc.collect()
            await trio.sleep(0.005)
            sa = a.statistics()
            assert (sa.foreign_leases, sa.live_allocations) == (1, 1)
            await c.wait()
            np.testing.assert_array_equal(await b.to_host(y), arange(start=3))
            await trio.sleep(0.005)
            assert a.statistics().live_allocations == 0

    trio.run(main)


def test_scope_exit_waits_for_a_foreign_copy() -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device="cuda:1") as b:
            zb = await b.to_device(arange())
            tb = b.empty(N, np.float32)
            y = b.empty(N, np.float32)
            async with trio_cuda.open_scope(device="cuda:0") as a:
                x = await a.to_device(arange(start=5))
                slow = b.submit(spin_add(zb, tb, 0.0, ms=100))
                c = b.submit(ops.copy(y, x), stream=slow.stream)
            assert c.done()  # a's exit waited for b's copy of its memory
            np.testing.assert_array_equal(await b.to_host(y), arange(start=5))

    trio.run(main)


def test_cancelled_peer_copy_keeps_leases_on_both_devices() -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device="cuda:0") as a, trio_cuda.open_scope(device="cuda:1") as b:
            zb = await b.to_device(arange())
            tb = b.empty(N, np.float32)
            x = await a.to_device(arange())
            y = b.empty(N, np.float32)
            slow = b.submit(spin_add(zb, tb, 0.0, ms=200))
            t0 = trio.current_time()
            with trio.move_on_after(0.01):
                await b.run(ops.copy(y, x), stream=slow.stream)
            assert trio.current_time() - t0 < 0.1  # promptly, long before the GPU is done
            assert a.statistics().foreign_leases == 1
            assert b.statistics().leases_held >= 1
            await slow.wait()
            await trio.sleep(0.01)
            assert a.statistics().foreign_leases == 0
            np.testing.assert_array_equal(await b.to_host(y), arange())

    trio.run(main)


def test_device_pool_spreads_work_and_overlaps_devices() -> None:
    async def main() -> None:
        async with trio_cuda.open_device_pool(["cuda:0", "cuda:1"]) as pool:
            xs = [await s.to_device(arange()) for s in pool]
            ys = [s.empty(N, np.float32) for s in pool]
            for s in pool:
                await s.load(SPIN_ADD)  # compile and load outside the timed part
            t0 = trio.current_time()
            futs = [pool.submit(spin_add(x, y, 1.0, ms=100)) for x, y in zip(xs, ys, strict=True)]
            assert [f.stream.scope for f in futs] == list(pool.scopes)
            for f in futs:
                await f.wait()
            elapsed = trio.current_time() - t0
            assert elapsed < 0.18, elapsed  # the two 100 ms kernels ran at the same time
            for s, y in zip(pool, ys, strict=True):
                np.testing.assert_array_equal(await s.to_host(y), arange() + 1)

    trio.run(main)
