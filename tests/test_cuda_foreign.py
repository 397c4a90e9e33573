"""``ops.external``, ``ops.after`` and ``Stream.__cuda_stream__`` on a real GPU,
with the CUDA driver API as the "other library". Marked ``gpu``."""

import numpy as np
import pytest
import trio

import trio_cuda
from trio_cuda import ops
from trio_cuda._backends import probe_cuda

_PROBE = probe_cuda()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}"),
]

SPIN = r"""
extern "C" __global__ void spin(float* x, unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    x[0] += 1.0f;
}
"""


def _cu():
    from cuda.bindings import driver as cu

    return cu


async def test_external_enqueues_foreign_work_on_the_trio_cuda_stream():
    cu = _cu()
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        y = gpu.zeros(1024, np.uint32)

        def foreign(stream):
            version, handle = stream.__cuda_stream__()
            assert version == 0
            (err,) = cu.cuMemsetD32Async(y.ptr, 7, y.size, cu.CUstream(handle))
            assert int(err) == 0
            return "set"

        assert await gpu.run(ops.external(foreign, writes=[y]), stream=gpu.streams[1]) == "set"
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(1024, 7, np.uint32))
        assert gpu.statistics().leases_held == 0


async def test_after_awaits_a_foreign_stream_without_blocking():
    cu = _cu()
    spin = trio_cuda.Kernel.from_source(SPIN, "spin", params=[trio_cuda.InOut("f4"), trio_cuda.Scalar("u8")])
    async with trio_cuda.open_scope(device="cuda") as a, trio_cuda.open_scope(device="cuda") as b:
        x = await a.to_device(np.zeros(4, np.float32))
        await a.load(spin)
        fut = a.submit(spin.launch(x, np.uint64(30_000_000), grid=1, block=1))  # 30 ms
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.sleep(0.001)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            t0 = trio.current_time()
            await b.run(ops.after(a.streams[0]))  # b's stream waits for a's kernel, device-side
            elapsed = trio.current_time() - t0
            nursery.cancel_scope.cancel()
        assert elapsed >= 0.02  # it waited for the kernel
        assert ticks >= 5  # and the loop kept running meanwhile
        fut.wait_nowait()  # the kernel is complete
        # a raw CUstream of "another library", through __cuda_stream__
        stream = cu.cuStreamCreate(1)[1]

        class Foreign:
            def __cuda_stream__(self):
                return (0, int(stream))

        try:
            await b.run(ops.after(Foreign()))
        finally:
            cu.cuStreamDestroy(stream)


async def test_numpy_from_dlpack_of_a_gpu_array_leaves_nothing_behind():
    async with trio_cuda.open_scope(device="cuda") as gpu:
        x = await gpu.to_device(np.arange(4, dtype=np.float32))
        with pytest.raises((BufferError, RuntimeError, TypeError)):
            np.from_dlpack(x)
        await gpu.run(ops.fill(x, 1.0))  # no export lease left behind
        np.testing.assert_array_equal(await gpu.to_host(x), np.ones(4, np.float32))
