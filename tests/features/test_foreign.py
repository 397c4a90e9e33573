"""Foreign work inside the lifetime contract: ``Stream.__cuda_stream__``,
``ops.external`` and ``ops.after``, on the simulator."""

import itertools
import time

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import held
from tests.helpers.kernels import add
from trio_cuda import AccessConflictError, ops, unsafe
from trio_cuda.testing import SimDevice

F4 = np.float32


async def test_streams_follow_the_cuda_stream_protocol(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s = gpu.streams[1]
        version, handle = s.__cuda_stream__()
        assert version == 0
        assert isinstance(handle, int)
        assert handle == internals.driver_of(gpu).stream_address(s.handle)
        assert handle != gpu.streams[0].__cuda_stream__()[1]
    with pytest.raises(trio_cuda.ScopeClosedError, match="__cuda_stream__"):
        s.__cuda_stream__()


async def test_external_runs_on_its_stream_under_leases(sim):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        x = await gpu.to_device(np.arange(4, dtype=F4))
        y = gpu.zeros(4, F4)
        seen = []

        def foreign(stream):
            seen.append(stream)
            # "another library" enqueueing on the stream it was given
            unsafe.async_on(ops.copy(y, x), stream)
            unsafe.async_on(add(y, 10.0), stream)
            return "done"

        await gpu.run(ops.value(None))
        with held(sim):
            fut = gpu.submit(ops.external(foreign, reads=[x], writes=[y]), stream=gpu.streams[1])
            assert seen == [gpu.streams[1]]
            assert fut.statistics().leases == 2
            # the leases are real: a write to x or a read of y elsewhere is refused
            with pytest.raises(AccessConflictError):
                gpu.submit(ops.fill(x, 0.0), stream=gpu.streams[0])
            with pytest.raises(AccessConflictError):
                gpu.submit(ops.copy(np.zeros(4, F4), y), stream=gpu.streams[0])
            # reads of x alongside are fine
            r = gpu.submit(ops.copy(np.zeros(4, F4), x), stream=gpu.streams[0])
        assert await fut.wait() == "done"
        await r.wait()
        np.testing.assert_array_equal(await gpu.to_host(y), np.arange(4, dtype=F4) + 10)
        assert gpu.statistics().leases_held == 0


async def test_an_external_that_raises_keeps_what_it_enqueued(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        await gpu.run(ops.value(None))

        def half_done(stream):
            unsafe.async_on(add(y, 1.0), stream)
            raise RuntimeError("foreign library failed after enqueueing")

        with held(sim):
            with pytest.raises(RuntimeError, match="after enqueueing"):
                await gpu.run(ops.external(half_done, writes=[y]))
            # rule 6: the enqueued work is retained behind a marker, its lease held
            assert gpu.statistics().in_flight == 1
            assert gpu.statistics().leases_held == 1
            y.close()
            assert len(sim.live_allocations) == 1  # not freed under the running work
        await trio.testing.wait_all_tasks_blocked()
        assert gpu.statistics().in_flight == 0
    assert sim.live_allocations == []


async def test_external_composes_and_can_be_captured(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        op = ops.external(lambda s: unsafe.async_on(add(y, 1.0), s) and 7, writes=y).then(
            lambda out: add(y, float(out))
        )
        await gpu.run(op)
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(4, 8, F4))
        graph = await gpu.capture(ops.external(lambda s: unsafe.async_on(add(y, 2.0), s), writes=[y]))
        await gpu.run(graph.launch())
        await gpu.run(graph.launch())
        graph.close()
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(4, 12, F4))


async def test_external_that_blocks_stalls_the_loop_but_frees_nothing_early():
    sim = SimDevice(kernel_time=0.01)
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.perf_counter())
                await trio.sleep(0.001)

        def blocking(stream):
            unsafe.async_on(add(y, 1.0), stream)
            time.sleep(0.05)  # a synchronising call inside fn: the loop stops meanwhile

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.01)
            await gpu.run(ops.external(blocking, writes=[y]))
            await trio.sleep(0.005)  # the ticker ticks again after the stall
            nursery.cancel_scope.cancel()
        gaps = [b - a for a, b in itertools.pairwise(ticks)]
        assert max(gaps) >= 0.045  # the documented stall
        np.testing.assert_array_equal(await gpu.to_host(y), np.ones(4, F4))
    assert sim.violations == []


async def test_external_bad_arguments(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        with pytest.raises(TypeError, match="fn: expected a callable taking the stream, got int"):
            ops.external(3)
        with pytest.raises(TypeError, match=r"reads\[1\]: expected a DeviceArray"):
            ops.external(lambda s: None, reads=[x, np.zeros(4)])
        with pytest.raises(TypeError, match="writes: expected a DeviceArray or a sequence"):
            ops.external(lambda s: None, writes="x")


async def test_after_orders_a_stream_after_another_scopes_stream():
    sim = SimDevice(kernel_time=0.02)
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = await a.to_device(np.zeros(4, F4))
        t0 = time.perf_counter()
        fa = a.submit(add(x, 1.0), stream=a.streams[0])  # "foreign" work, 20 ms
        await b.run(ops.after(a.streams[0]))  # awaits it without blocking the loop
        waited = time.perf_counter() - t0
        assert waited >= 0.015  # b's op completed only after a's 20 ms kernel
        fa.wait_nowait()  # a's work is complete (raises WouldBlock if not)
        np.testing.assert_array_equal(await a.to_host(x), np.ones(4, F4))
    assert sim.violations == []


async def test_after_refuses_what_it_cannot_order_after(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        with pytest.raises(TypeError, match="obj: expected a stream"):
            ops.after(42)

        class Bad:
            def __cuda_stream__(self):
                return (1, 5)

        with pytest.raises(TypeError, match=r"__cuda_stream__\(\) must return \(0, handle: int\)"):
            ops.after(Bad())
        with pytest.raises(trio_cuda.GraphCaptureError, match="ops.after"):
            await gpu.capture(ops.after(gpu.streams[1]))


async def test_external_checks_its_arrays_before_fn_runs_and_works_unsafe(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        called = []
        closed = gpu.zeros(4, F4)
        closed.close()
        with pytest.raises(trio_cuda.ScopeClosedError, match="ops.external: the array is closed"):
            await gpu.run(ops.external(called.append, reads=[closed]))
        assert called == []  # refused before fn ran
        # through unsafe.async_on: no lease, fn runs at once
        out = unsafe.async_on(
            ops.external(lambda s: unsafe.async_on(add(x, 1.0), s) and "ok", writes=[x]), gpu.streams[0]
        )
        assert out == "ok"
        await gpu.run(ops.value(None), stream=gpu.streams[0])
        np.testing.assert_array_equal(await gpu.to_host(x), np.ones(4, F4))


async def test_external_raising_a_base_exception_is_still_retained(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        await gpu.run(ops.value(None))

        def interrupted(stream):
            unsafe.async_on(add(y, 1.0), stream)
            raise KeyboardInterrupt

        with held(sim):
            with pytest.raises(KeyboardInterrupt):
                gpu.submit(ops.external(interrupted, writes=y))
            assert gpu.statistics().leases_held == 1
        await trio.testing.wait_all_tasks_blocked()
        assert gpu.statistics().in_flight == 0
        np.testing.assert_array_equal(await gpu.to_host(y), np.ones(4, F4))


async def test_foreign_ops_from_a_worker_thread_or_another_run_are_refused(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        called = []
        op = ops.external(called.append, writes=[y])
        with pytest.raises(RuntimeError, match="thread"):
            await trio.to_thread.run_sync(gpu.submit, op)

        def other_run():
            async def main():
                gpu.submit(ops.after(gpu.streams[1]))

            trio.run(main)

        with pytest.raises(RuntimeError):
            await trio.to_thread.run_sync(other_run)
        assert called == []  # fn never ran
        assert gpu.statistics().in_flight == 0


async def test_unsafe_cuda_view_is_refused_for_simulated_memory_and_bad_input(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        before = gpu.statistics()
        with pytest.raises(ValueError, match="cuda backend"):
            unsafe.cuda_view(y)
        with pytest.raises(TypeError, match="DeviceArray"):
            unsafe.cuda_view(np.zeros(4, F4))  # type: ignore[arg-type]
        assert gpu.statistics() == before


async def test_after_refuses_an_event_never_recorded():
    class Event:  # what a Torch event looks like before its first record()
        __module__ = "torch.cuda.streams"
        cuda_event = 0

    with pytest.raises(ValueError, match="never recorded"):
        ops.after(Event())
