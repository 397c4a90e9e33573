"""CUDA graphs on a real GPU: stream capture, replay, retention and update.

Every test is marked ``gpu`` and skips cleanly without a CUDA device. Work is
kept in flight with a driver *gate* (``create_gate``: a ``cuStreamWaitValue32``
on a pinned host flag) enqueued before it and opened later. Under
compute-sanitizer (detected by ``tests/_sanitizer.py``, no variable needed) the
tests that make a driver call fail on purpose are skipped and timing limits are
relaxed.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import pytest
import trio
from _kernels import ADD, COPY, SAXPY, add, copy, saxpy
from _sanitizer import SLOW, skip_under_sanitizer

import trio_cuda
from trio_cuda import GraphCaptureError, Kernel, Out, Scalar, ops, unsafe
from trio_cuda._backends import probe_cuda

_PROBE = probe_cuda()
#: tests that make a driver call fail on purpose, which compute-sanitizer reports as an error
deliberate_driver_error = skip_under_sanitizer(
    "a deliberately failing driver call, which compute-sanitizer reports"
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}"),
]

F4 = np.float32
N = 1000

SPIN_SRC = r"""
extern "C" __global__ void spin_fill(unsigned long long ns, float* y, float value, int n) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = value;
}
"""
SPIN_FILL = Kernel.from_source(
    SPIN_SRC, "spin_fill", params=[Scalar("u8"), Out("f4"), Scalar("f4"), Scalar("i4")]
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_CUDA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "nvrtc-cache"))


def host(value: float | None = None) -> np.ndarray:
    if value is None:
        return np.arange(N, dtype=F4)
    return np.full(N, value, dtype=F4)


async def settle(gpu: trio_cuda.ResourceScope) -> None:
    with trio.fail_after(10 * SLOW):
        while gpu.statistics().in_flight:  # noqa: ASYNC110 - polling public statistics
            await trio.sleep(0.001)


class Gate:
    """Holds one stream until :meth:`open` (or the end of ``async with``)."""

    def __init__(self, gpu: trio_cuda.ResourceScope, stream: Any) -> None:
        self.driver = gpu._driver
        self.gate = self.driver.create_gate(stream.handle)

    def open(self) -> None:
        self.driver.open_gate(self.gate)

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()


def graph_execs(gpu: trio_cuda.ResourceScope) -> int:
    return len(gpu._driver._graphs.execs)  # type: ignore[attr-defined]


async def test_capture_and_replay_match_the_reference() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host(1.0))
        # the kernels are not loaded yet: the capture loads them (relaxed capture mode)
        graph = await gpu.capture(saxpy(2.0, x, y).then(lambda y: add(y, 0.5)))
        assert graph.output is y
        np.testing.assert_array_equal(await gpu.to_host(y), host(1.0))  # capture ran nothing
        assert graph.statistics().kernels == 2
        expected = host(1.0)
        for _ in range(5):
            assert await gpu.run(graph.launch()) is y
            expected = 2.0 * host() + expected + 0.5
        np.testing.assert_allclose(await gpu.to_host(y), expected, rtol=1e-6)
        assert graph_execs(gpu) == 1
        graph.close()
        assert graph.statistics().destroyed
        assert graph_execs(gpu) == 0


async def test_a_100_kernel_graph_with_copies_and_fills() -> None:
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        await gpu.load(ADD, COPY, SAXPY)
        xs = [gpu.zeros(N, F4) for _ in range(4)]
        src = gpu.zeros(N, F4)
        op: trio_cuda.DeviceOp[Any] = ops.copy(src, host()).then(lambda _: ops.fill(xs[0], 0.0))
        for i in range(100):
            op = op.then(lambda _, i=i: add(xs[i % 4], float(i)))
        op = op.then(lambda _: copy(src, xs[1]))
        graph = await gpu.capture(op)
        assert (graph.statistics().kernels, graph.statistics().operations) == (101, 103)
        for _ in range(3):
            await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(xs[0]), host(float(sum(range(0, 100, 4)))))
        np.testing.assert_array_equal(await gpu.to_host(xs[1]), host())
        for j in (2, 3):
            want = 3 * sum(float(i) for i in range(100) if i % 4 == j)
            np.testing.assert_array_equal(await gpu.to_host(xs[j]), host(want))
        graph.close()


async def test_replay_through_submit_and_async_on() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        x = gpu.zeros(N, F4)
        async with await gpu.capture(add(x, 1.0)) as graph:
            futs = [gpu.submit(graph.launch()) for _ in range(8)]
            for f in futs:
                assert await f.wait() is x
            s = gpu.streams[0]
            await gpu.run(ops.value(None), stream=s)
            for _ in range(2):
                unsafe.async_on(graph.launch(), s)
            np.testing.assert_array_equal(await gpu.to_host(x, stream=s), host(10.0))
        assert graph_execs(gpu) == 0


async def test_allocation_during_capture_raises_and_the_stream_stays_usable() -> None:
    async with trio_cuda.open_scope(device="cuda", streams=1) as gpu:
        await gpu.load(ADD, COPY)
        x = gpu.zeros(N, F4)
        with pytest.raises(GraphCaptureError, match="allocat") as info:
            await gpu.capture(add(x, 1.0).then(lambda x: copy(x, gpu.empty(N, F4))))
        assert "add_f4" in str(info.value)
        assert graph_execs(gpu) == 0
        await gpu.run(add(x, 2.0))
        np.testing.assert_array_equal(await gpu.to_host(x), host(2.0))
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held) == (0, 0)


@deliberate_driver_error
async def test_synchronising_call_during_capture_invalidates_it_cleanly() -> None:
    from cuda.bindings import driver as cu

    async with trio_cuda.open_scope(device="cuda", streams=1) as gpu:
        await gpu.load(ADD)
        x = gpu.zeros(N, F4)
        s = gpu.streams[0]
        seen: list[Any] = []

        def synchronise(x: trio_cuda.DeviceArray) -> Any:
            (err,) = cu.cuStreamSynchronize(s.handle.cu)  # not allowed while capturing
            seen.append(err)
            return add(x, 1.0)

        with pytest.raises(GraphCaptureError, match="capture"):
            await gpu.capture(add(x, 1.0).then(synchronise), stream=s)
        assert seen
        assert int(seen[0]) != 0
        assert gpu._driver.sticky_error is None  # type: ignore[attr-defined]
        err, status = cu.cuStreamIsCapturing(s.handle.cu)
        assert not err
        assert status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        await gpu.run(add(x, 3.0), stream=s)
        np.testing.assert_array_equal(await gpu.to_host(x, stream=s), host(3.0))


async def test_cancellation_while_a_replay_is_in_flight() -> None:
    async with trio_cuda.open_scope(device="cuda", streams=1) as gpu:
        await gpu.load(SAXPY)
        x = await gpu.to_device(host())
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(saxpy(1.0, x, y))
        await settle(gpu)
        with Gate(gpu, gpu.streams[0]) as gate:
            t0 = time.perf_counter()
            with trio.move_on_after(0.05) as cs:
                await gpu.run(graph.launch())
            assert cs.cancelled_caught
            assert time.perf_counter() - t0 < 2.0 * SLOW
            st = gpu.statistics()
            assert (st.in_flight, st.leases_held) == (1, 2)
            assert graph.statistics().in_flight == 1
            graph.close()
            x.close()
            assert not graph.statistics().destroyed
            gate.open()
            await settle(gpu)
        assert graph.statistics().destroyed
        assert gpu.statistics().leases_held == 0
        np.testing.assert_array_equal(await gpu.to_host(y), host())


async def test_closing_with_replays_in_flight_and_dropped_inputs() -> None:
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        await gpu.load(COPY, ADD)
        x = await gpu.to_device(host())
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(copy(x, y).then(lambda y: add(y, 1.0)))
        x.close()  # the graph keeps its own handle
        del x
        gc.collect()
        await settle(gpu)
        s = gpu.streams[1]
        with Gate(gpu, s) as gate:
            futs = [gpu.submit(graph.launch(), stream=s) for _ in range(3)]
            graph.close()
            assert graph_execs(gpu) == 1
            await trio.sleep(0.01)
            gate.open()
            for f in futs:
                await f.wait()
        await settle(gpu)
        assert graph_execs(gpu) == 0
        np.testing.assert_array_equal(await gpu.to_host(y), host() + 1)


async def test_replays_order_against_a_writer_on_another_stream() -> None:
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        await gpu.load(SPIN_FILL, COPY)
        s0, s1 = gpu.streams
        x = gpu.zeros(N, F4, stream=s0)
        y = gpu.zeros(N, F4, stream=s0)
        graph = await gpu.capture(copy(x, y), stream=s1)
        await settle(gpu)
        spin = SPIN_FILL.launch(np.uint64(20_000_000), x, F4(7.0), N, grid=(N + 255) // 256, block=256)
        gpu.submit(spin, stream=s0)  # writes x after 20 ms
        await gpu.run(graph.launch(), stream=s1)  # RAW: waits device-side
        np.testing.assert_array_equal(await gpu.to_host(y, stream=s1), host(7.0))
        graph.close()


async def test_update_changes_inputs_and_kernel_parameters() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        await gpu.load(SAXPY)
        x = gpu.zeros(N, F4)
        y = gpu.zeros(N, F4)
        y2 = gpu.zeros(N, F4)

        def step(data: np.ndarray, a: float, out: trio_cuda.DeviceArray) -> Any:
            return ops.copy(x, data).then(lambda x: ops.fill(out, 0.0)).then(lambda _: saxpy(a, x, out))

        graph = await gpu.capture(step(host(), 2.0, y))
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(y), 2.0 * host())
        await graph.update(step(host(10.0), 3.0, y2))  # new host data, scalar and output array
        assert graph.output is y2
        assert await gpu.run(graph.launch()) is y2
        np.testing.assert_array_equal(await gpu.to_host(y2), host(30.0))
        np.testing.assert_array_equal(await gpu.to_host(y), 2.0 * host())
        graph.close()


@deliberate_driver_error
async def test_update_with_another_topology_is_refused_and_changes_nothing() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        await gpu.load(SAXPY)
        x = gpu.zeros(N, F4)
        y = gpu.zeros(N, F4)

        def step(data: np.ndarray, a: float) -> Any:
            return ops.copy(x, data).then(lambda x: ops.fill(y, 0.0)).then(lambda _: saxpy(a, x, y))

        graph = await gpu.capture(step(host(10.0), 3.0))
        with pytest.raises(GraphCaptureError, match="topology|cuGraphExecUpdate"):
            await graph.update(saxpy(1.0, x, y))
        await gpu.run(graph.launch())  # unchanged
        np.testing.assert_array_equal(await gpu.to_host(y), host(30.0))
        graph.close()


async def test_update_while_a_replay_is_in_flight() -> None:
    async with trio_cuda.open_scope(device="cuda", streams=1) as gpu:
        await gpu.load(COPY)
        a = await gpu.to_device(host())
        b = await gpu.to_device(host(5.0))
        ya = gpu.zeros(N, F4)
        yb = gpu.zeros(N, F4)
        graph = await gpu.capture(copy(a, ya))
        await settle(gpu)
        with Gate(gpu, gpu.streams[0]) as gate:
            first = gpu.submit(graph.launch())
            await graph.update(copy(b, yb))
            a.close()  # still used by the replay in flight
            second = gpu.submit(graph.launch())
            gate.open()
            await first.wait()
            await second.wait()
        np.testing.assert_array_equal(await gpu.to_host(ya), host())
        np.testing.assert_array_equal(await gpu.to_host(yb), host(5.0))
        await settle(gpu)
        assert graph.statistics().retained_allocations == 2
        graph.close()


async def test_scope_exit_destroys_open_graphs() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        x = gpu.zeros(N, F4)
        graph = await gpu.capture(add(x, 1.0))
        gpu.submit(graph.launch())
        ctx = gpu._driver
    assert graph.closed
    assert graph.statistics().destroyed
    assert not ctx._graphs.execs  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- upload, and update off the loop


async def test_replays_are_correct_after_upload_and_after_update(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from trio_cuda._backends.cuda.context import CudaContext

    calls: list[tuple[str, threading.Thread]] = []
    for name in ("graph_upload", "graph_update"):
        real = getattr(CudaContext, name)

        def recording(self: Any, *args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append((_name, threading.current_thread()))
            return _real(self, *args)

        monkeypatch.setattr(CudaContext, name, recording)
    loop_thread = threading.current_thread()
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        await gpu.load(SAXPY, ADD)
        x = await gpu.to_device(host())
        y = gpu.zeros(N, F4)
        y2 = gpu.zeros(N, F4)

        def step(a: float, out: trio_cuda.DeviceArray) -> Any:
            return ops.fill(out, 1.0).then(lambda out: saxpy(a, x, out)).then(lambda out: add(out, 0.5))

        graph = await gpu.capture(step(2.0, y))
        # uploaded once, in the worker thread that instantiated it, before any replay
        assert [c[0] for c in calls] == ["graph_upload"]
        assert calls[0][1] is not loop_thread
        np.testing.assert_array_equal(await gpu.to_host(y), host(0.0))  # the upload ran nothing
        for s in gpu.streams:  # the first replay may go to any stream
            assert await gpu.run(graph.launch(), stream=s) is y
            np.testing.assert_allclose(await gpu.to_host(y), 2.0 * host() + 1.5, rtol=1e-6)
        await graph.update(step(-1.0, y2))  # new scalar and output array
        assert [c[0] for c in calls] == ["graph_upload", "graph_update"]
        assert calls[1][1] is not loop_thread  # cuGraphExecUpdate ran off the loop
        assert graph.statistics().updates == 1
        assert await gpu.run(graph.launch()) is y2
        np.testing.assert_allclose(await gpu.to_host(y2), 1.5 - host(), rtol=1e-6)
        np.testing.assert_allclose(await gpu.to_host(y), 2.0 * host() + 1.5, rtol=1e-6)
        graph.close()
        assert graph_execs(gpu) == 0


async def test_replays_from_another_task_while_updates_run_off_the_loop() -> None:
    async with trio_cuda.open_scope(device="cuda", streams=2) as gpu:
        await gpu.load(ADD)
        x = gpu.zeros(N, F4)

        def op(value: float) -> Any:
            chain: Any = ops.fill(x, value)
            for _ in range(50):
                chain = chain.then(lambda x: add(x, 1.0))
            return chain

        graph = await gpu.capture(op(0.0))
        replays = 0

        async def replayer() -> None:
            nonlocal replays
            for _ in range(100):
                assert await gpu.run(graph.launch()) is x
                replays += 1

        with trio.fail_after(60 * SLOW):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(replayer)
                for value in range(1, 21):
                    await graph.update(op(float(value)))
        assert replays == 100
        assert graph.statistics().updates == 20
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(x), host(70.0))  # 20 + 50 x 1
        await settle(gpu)
        assert graph.statistics().retained_allocations == 1
        graph.close()
        assert graph_execs(gpu) == 0
