"""``ops.external``, ``ops.after`` and ``Stream.__cuda_stream__`` on a real GPU,
with the CUDA driver API, CuPy (cuBLAS), PyTorch and cuda.core as the "other
library" (each skipped where it is not installed), and exports of an external's
arrays inside its fn (``cupy.asarray(x)``, ``torch.from_dlpack(x)``). Marked
``gpu``."""

import time

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers.sanitizer import SLOW
from trio_cuda import ops, unsafe
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
        # b's stream waits for a's kernel, device-side
        elapsed, ticks = await _ticking(lambda: b.run(ops.after(a.streams[0])))
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


# --------------------------------------------------------------------------- CuPy, PyTorch, cuda.core

N = 1 << 16


async def _ticking(fn):
    """Run ``await fn()`` while a ticker runs; return (seconds it took, ticks seen)."""
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        t0 = time.perf_counter()
        await fn()
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    return elapsed, ticks


async def test_other_libraries_adopt_a_trio_cuda_stream():
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        stream = gpu.streams[1]
        version, handle = stream.__cuda_stream__()
        assert version == 0
        assert isinstance(handle, int)
        assert handle != 0
        adopted = 0
        try:
            import cupy
        except ImportError:
            pass
        else:
            assert _cupy_stream(cupy, stream).ptr == handle
            adopted += 1
        try:
            import torch
        except ImportError:
            pass
        else:
            dev = torch.device("cuda", gpu.device.ordinal)
            assert torch.cuda.ExternalStream(handle, device=dev).cuda_stream == handle
            adopted += 1
        try:
            from cuda.core import Device
        except ImportError:
            pass
        else:
            dev = Device(gpu.device.ordinal)
            dev.set_current()
            core_stream = dev.create_stream(stream)  # through __cuda_stream__
            assert int(core_stream.handle) == handle
            adopted += 1
        if adopted == 0:
            pytest.skip("none of CuPy, PyTorch and cuda.core is installed")


def _cupy_stream(cupy, stream):
    """CuPy's view of a trio_cuda stream: through the stream protocol where CuPy has it."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.__cuda_stream__()[1])


def _spin_cupy(cupy):
    return cupy.RawKernel(SPIN, "spin")


async def test_cublas_through_cupy_in_external_is_ordered_by_its_leases():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    rng = np.random.default_rng(3)
    n = 256
    w_h = rng.standard_normal((n, n)).astype(np.float32)
    x_h = rng.standard_normal(n).astype(np.float32)
    spin = _spin_cupy(cupy)
    with cupy.cuda.Device(0):
        scratch = cupy.zeros(4, cupy.float32)
        cupy.cuda.Device().synchronize()
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        w, x = await gpu.to_device(w_h), await gpu.to_device(x_h)
        y = gpu.zeros(n, np.float32)

        spin_ns = 0

        def gemv(stream):
            with cupy.cuda.Device(gpu.device.ordinal), _cupy_stream(cupy, stream):
                if spin_ns:
                    spin((1,), (1,), (scratch, np.uint64(spin_ns)))  # delays cuBLAS's write of y
                w_cp = cupy.asarray(unsafe.cuda_view(w))
                x_cp = cupy.asarray(unsafe.cuda_view(x))
                y_cp = cupy.asarray(unsafe.cuda_view(y))
                assert y_cp.data.ptr == y.ptr  # a view, no copy
                cupy.matmul(w_cp, x_cp, out=y_cp)
            return "gemv"

        # the result, and a read on the other stream ordered after cuBLAS's write (RAW)
        await gpu.run(ops.external(gemv, reads=[w, x], writes=[y]), stream=gpu.streams[1])
        np.testing.assert_allclose(await gpu.to_host(y), w_h @ x_h, rtol=1e-4, atol=1e-4)
        # now warm (cuBLAS loaded): a write on the other stream waits, device-side, for cuBLAS's
        # write (WAW), delayed 100 ms by a spin before it: the fill lands last
        spin_ns = 100_000_000
        fut = gpu.submit(ops.external(gemv, reads=[w, x], writes=[y]), stream=gpu.streams[1])
        assert gpu.statistics().leases_held >= 1
        elapsed, ticks = await _ticking(lambda: gpu.run(ops.fill(y, 0.0), stream=gpu.streams[0]))
        assert elapsed >= 0.05, elapsed
        assert ticks >= 10, ticks  # the loop ran while the device worked
        assert await fut.wait() == "gemv"
        np.testing.assert_array_equal(await gpu.to_host(y), np.zeros(n, np.float32))
        assert gpu.statistics().leases_held == 0


async def test_cupy_work_in_external_is_captured_and_replayed_under_leases():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        x = gpu.zeros(N, np.float32)
        y = gpu.zeros(N, np.float32)
        x_cp = cupy.asarray(unsafe.cuda_view(x))
        y_cp = cupy.asarray(unsafe.cuda_view(y))

        def scale(stream):
            with cupy.cuda.Device(gpu.device.ordinal), _cupy_stream(cupy, stream):
                cupy.multiply(x_cp, 2.0, out=y_cp)  # an elementwise kernel, no allocation

        graph = await gpu.capture(ops.external(scale, reads=[x], writes=[y]))
        try:
            for k in (1.0, 5.0):
                await gpu.run(ops.fill(x, k))
                await gpu.run(graph.launch())
                np.testing.assert_array_equal(await gpu.to_host(y), np.full(N, 2 * k, np.float32))
        finally:
            graph.close()


async def test_torch_in_external_and_after_torch_streams_and_events():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        dev = torch.device("cuda", gpu.device.ordinal)
        a = await gpu.to_device(np.arange(N, dtype=np.float32))
        out = gpu.zeros(N, np.float32)

        def torch_mul(stream):
            s = torch.cuda.ExternalStream(stream.__cuda_stream__()[1], device=dev)
            with torch.cuda.stream(s):
                torch.cuda._sleep(50_000_000)  # the write lands late
                a_t = torch.as_tensor(unsafe.cuda_view(a), device=dev)
                out_t = torch.as_tensor(unsafe.cuda_view(out), device=dev)
                torch.mul(a_t, 2.0, out=out_t)
            return out

        got = await gpu.run(ops.external(torch_mul, reads=[a], writes=[out]), stream=gpu.streams[1])
        assert got is out
        np.testing.assert_array_equal(await gpu.to_host(out), 2 * np.arange(N, dtype=np.float32))

        # ops.after: Torch enqueues on its own stream; trio_cuda waits for it device-side
        side = torch.cuda.Stream(device=dev)
        for _round in range(2):  # the first round loads Torch's kernels (slow on the host)
            with torch.cuda.stream(side):
                t = torch.zeros(N, device=dev)
                torch.cuda._sleep(200_000_000)  # about 100 ms
                t.add_(3.0)
                done = torch.cuda.Event()
                done.record(side)
            elapsed, ticks = await _ticking(lambda: gpu.run(ops.after(side)))
        assert elapsed >= 0.05, elapsed
        assert ticks >= 10, ticks
        assert side.query()  # everything Torch had enqueued is complete
        await gpu.run(ops.after(done))  # an event: already complete, no wait
        # the README's form: the current (default) stream
        with torch.cuda.device(dev):
            u = torch.ones(N, device=dev)
            u.mul_(7.0)
            torch.cuda._sleep(200_000_000)
            elapsed, _ = await _ticking(lambda: gpu.run(ops.after(torch.cuda.current_stream())))
            assert elapsed >= 0.05, elapsed
            assert torch.cuda.current_stream().query()
        view = trio_cuda.borrow(t, access="read")
        np.testing.assert_array_equal(await gpu.to_host(view), np.full(N, 3.0, np.float32))
        with pytest.raises(ValueError, match="never recorded"):
            ops.after(torch.cuda.Event())
        del view


async def test_after_cupy_streams_and_events():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    spin = _spin_cupy(cupy)
    async with trio_cuda.open_scope(device="cuda") as gpu:
        with cupy.cuda.Device(gpu.device.ordinal):
            scratch = cupy.zeros(4, cupy.float32)
            cs = cupy.cuda.Stream(non_blocking=True)
            with cs:
                spin((1,), (1,), (scratch, np.uint64(100_000_000)))
                event = cs.record()
            elapsed, ticks = await _ticking(lambda: gpu.run(ops.after(cs)))
            assert elapsed >= 0.05, elapsed
            assert ticks >= 10, ticks
            assert cs.done
            with cs:
                spin((1,), (1,), (scratch, np.uint64(100_000_000)))
                event = cs.record()
            elapsed, _ = await _ticking(lambda: gpu.run(ops.after(event)))
            assert elapsed >= 0.05, elapsed
            assert event.done


# --------------------------------------------------------------------------- exports inside ops.external


async def test_cupy_wraps_the_arrays_of_an_external_directly():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    rng = np.random.default_rng(5)
    n = 256
    w_h = rng.standard_normal((n, n)).astype(np.float32)
    x_h = rng.standard_normal(n).astype(np.float32)
    spin = _spin_cupy(cupy)
    with cupy.cuda.Device(0):
        scratch = cupy.zeros(4, cupy.float32)
        cupy.cuda.Device().synchronize()
    double = cupy.ElementwiseKernel("float32 a", "float32 b", "b = 2 * a + 1", "trio_cuda_test_double")
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        w, x = await gpu.to_device(w_h), await gpu.to_device(x_h)
        y = gpu.zeros(n, np.float32)
        z = gpu.zeros(2 * n, np.float32)
        seen = {}

        def foreign(stream):
            with cupy.cuda.Device(gpu.device.ordinal), _cupy_stream(cupy, stream):
                before = gpu.statistics().leases_held
                spin((1,), (1,), (scratch, np.uint64(100_000_000)))  # 100 ms ahead on our stream
                t0 = time.perf_counter()
                w_cp, x_cp, y_cp = cupy.asarray(w), cupy.asarray(x), cupy.asarray(y)
                lo = cupy.from_dlpack(z[:n])  # DLPack: CuPy names its current stream, ours
                seen["export_s"] = time.perf_counter() - t0  # no host synchronisation on our stream
                seen["ptrs"] = (w_cp.data.ptr, x_cp.data.ptr, y_cp.data.ptr, lo.data.ptr)
                cai = w.__cuda_array_interface__
                seen["w"] = (cai["stream"], cai["data"])
                seen["y"] = y.__cuda_array_interface__["data"]
                cupy.matmul(w_cp, x_cp, out=y_cp)  # cuBLAS writes y
                double(y_cp, lo)  # a CuPy kernel reads y's new values and writes z[:n]
                seen["leases"] = gpu.statistics().leases_held - before
                try:
                    z[n:].__cuda_array_interface__  # noqa: B018 - not covered
                except trio_cuda.AccessConflictError as exc:
                    seen["uncovered"] = str(exc)
                try:
                    cupy.from_dlpack(z[n:])
                except trio_cuda.AccessConflictError as exc:
                    seen["uncovered_dlpack"] = str(exc)
            return "done"

        op = ops.external(foreign, reads=[w, x], writes=[y, z[:n]])
        assert await gpu.run(op, stream=gpu.streams[1]) == "done"
        assert seen["export_s"] < 0.05 * SLOW, seen["export_s"]
        assert seen["ptrs"] == (w.ptr, x.ptr, y.ptr, z.ptr)  # views, no copies
        assert seen["w"] == (None, (w.ptr, True))  # no stream to synchronise with; reads=: read-only
        assert seen["y"] == (y.ptr, False)
        assert seen["leases"] == 0  # the external's leases cover them
        assert "add it to reads= (to read it) or writes= (to write it)" in seen["uncovered"]
        assert "is not covered by this external's reads= or writes=" in seen["uncovered_dlpack"]
        expected = w_h @ x_h
        np.testing.assert_allclose(await gpu.to_host(y), expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(await gpu.to_host(z[:n]), 2 * expected + 1, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(await gpu.to_host(z[n:]), np.zeros(n, np.float32))
        assert gpu.statistics().leases_held == 0
        # outside fn the same call is an ordinary export again, with a lease of its own
        await gpu.run(ops.fill(z, 0.0))
        held = cupy.from_dlpack(z)
        assert gpu.statistics().leases_held == 1
        del held
        await gpu.run(ops.fill(z, 1.0))  # ordered after CuPy's (no) work on it, once released
        np.testing.assert_array_equal(await gpu.to_host(z), np.ones(2 * n, np.float32))


async def test_torch_wraps_the_arrays_of_an_external_directly():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        dev = torch.device("cuda", gpu.device.ordinal)
        a = await gpu.to_device(np.arange(N, dtype=np.float32))
        out = gpu.zeros(N, np.float32)
        seen = {}

        def torch_mul(stream):
            s = torch.cuda.ExternalStream(stream.__cuda_stream__()[1], device=dev)
            with torch.cuda.stream(s):
                before = gpu.statistics().leases_held
                out_t = torch.as_tensor(out, device=dev)  # CUDA Array Interface, writable (writes=)
                try:
                    a_t = torch.from_dlpack(a)  # DLPack 1.x, read-only flag (reads=)
                except BufferError as exc:  # a PyTorch that imports without max_version
                    seen["legacy"] = str(exc)
                    return None
                seen["ptrs"] = (a_t.data_ptr(), out_t.data_ptr())
                torch.mul(a_t, 2.0, out=out_t)
                seen["leases"] = gpu.statistics().leases_held - before
            return out

        got = await gpu.run(ops.external(torch_mul, reads=[a], writes=[out]), stream=gpu.streams[1])
        if "legacy" in seen:
            assert "covered only by this external's reads=" in seen["legacy"]
            pytest.skip("this PyTorch imports DLPack without max_version (read-only arrays refused)")
        assert got is out
        assert seen["ptrs"] == (a.ptr, out.ptr)
        assert seen["leases"] == 0
        np.testing.assert_array_equal(await gpu.to_host(out), 2 * np.arange(N, dtype=np.float32))
        assert gpu.statistics().leases_held == 0
