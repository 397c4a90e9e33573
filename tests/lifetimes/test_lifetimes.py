"""The lifetime rules of docs/lifetimes.rst, one section per rule, on the simulated device.

Work is put really in flight with ``sim.hold()``; each test checks leases,
retention, ``sim.violations`` and ``sim.live_allocations`` afterwards.
"""

import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import held
from tests.helpers.kernels import ADD, COPY, add, copy, saxpy, stub_source
from trio_cuda import ops, unsafe
from trio_cuda.testing import SimDevice

N = 256


def host(n=N, value=None):
    if value is None:
        return np.arange(n, dtype=np.float32)
    return np.full(n, value, dtype=np.float32)


def addrs(sim):
    return {a.ptr for a in sim.live_allocations}


async def release_after(sim, delay):
    await trio.sleep(delay)
    sim.release()


# --------------------------------------------------------------------------- rule 1


async def test_submission_retains_everything_before_enqueue(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host(value=1.0))
        op = saxpy(2.0, x, y)
        expected_prepared = op.prepared
        seen = []

        class Spy:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def launch(self, stream, function, prepared):
                st = gpu.statistics()
                seen.append((st.leases_held, prepared is expected_prepared))
                self.inner.launch(stream, function, prepared)

        internals.set_driver(gpu, Spy(internals.driver_of(gpu)))
        sim.hold()
        fut = gpu.submit(op)
        # the submission held its two leases before the driver call
        assert seen == [(2, True)]
        ptrs = {x.ptr, y.ptr}
        x.close()
        y.close()
        del op
        gc.collect()
        assert ptrs <= addrs(sim)
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held, st.retained_bytes) == (1, 2, 2 * N * 4)
        sim.release()
        await fut.wait()
        assert not (ptrs & addrs(sim))
    assert sim.live_allocations == []
    assert sim.statistics().kernel_unloads == sim.statistics().kernel_loads == 1


async def test_module_unloaded_only_after_last_use(sim):
    """The kernel's module outlives every submission that uses it, even after
    the user drops the Kernel object."""
    k = trio_cuda.Kernel.from_source(
        stub_source("tmp"), "tmp", params=[trio_cuda.InOut("f4")], reference=lambda x: None
    )
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, np.float32)
        sim.hold()
        gpu.submit(k.launch(y, grid=1, block=4))
        del k
        gc.collect()
        assert sim.statistics().kernel_unloads == 0
        sim.release()
    assert sim.statistics().kernel_unloads == 1
    assert sim.violations == []


# --------------------------------------------------------------------------- rule 2


def wait_labels(sim, stream):
    return [e.label for e in sim.trace if e.kind == "wait_marker" and e.stream == stream]


async def test_raw_across_streams_becomes_device_side_wait(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        y = await gpu.to_device(host(value=0.0), stream=s0)
        z = await gpu.to_device(host(value=-1.0), stream=s1)
        sim.clear_trace()
        with held(sim):  # the writer is in flight when the reader is submitted
            gpu.submit(add(x, 100.0), stream=s0)
            writer = gpu.submit(saxpy(1.0, x, y), stream=s0)  # writes y
            reader = gpu.submit(copy(y, z), stream=s1)  # reads y on another stream
            assert not writer.done()
            assert not reader.done()
        assert await reader.wait() is z
        got = await gpu.to_host(z)
        np.testing.assert_array_equal(got, host() + 100.0)
        assert wait_labels(sim, 1), "the reader's stream must wait device-side"


async def test_same_stream_needs_no_wait(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0 = gpu.streams[0]
        x = await gpu.to_device(host(), stream=s0)
        y = await gpu.to_device(host(), stream=s0)
        sim.clear_trace()
        sim.hold()
        gpu.submit(add(y, 1.0), stream=s0)
        gpu.submit(copy(y, x), stream=s0)
        sim.release()
        await gpu.run(ops.value(None), stream=s0)
        assert wait_labels(sim, 0) == []
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)


async def test_reads_never_conflict_across_streams(sim):
    async with trio_cuda.open_scope(device=sim, streams=3, conflicts="error") as gpu:
        s0, s1, s2 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        outs = [gpu.empty(N, np.float32, stream=s) for s in (s1, s2)]
        await gpu.run(ops.value(None), stream=s1)
        await gpu.run(ops.value(None), stream=s2)
        sim.clear_trace()
        sim.hold()
        f1 = gpu.submit(copy(x, outs[0]), stream=s1)
        f2 = gpu.submit(copy(x, outs[1]), stream=s2)  # no AccessConflictError
        assert gpu.statistics().leases_held == 4  # x twice (shared read) + 2 outputs
        assert wait_labels(sim, 1) == wait_labels(sim, 2) == []
        sim.release()
        await f1.wait()
        await f2.wait()
        for o in outs:
            np.testing.assert_array_equal(await gpu.to_host(o), host())


@pytest.mark.parametrize("kind", ["war", "waw"])
async def test_write_conflicts_are_ordered(sim, kind):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        y = await gpu.to_device(host(value=0.0), stream=s0)
        sim.clear_trace()
        with held(sim):  # the first access is in flight when the write is submitted
            if kind == "war":
                first = gpu.submit(copy(x, y), stream=s0)  # reads x
                last = gpu.submit(ops.fill(x, 5.0), stream=s1)  # writes x: must wait for the read
            else:
                first = gpu.submit(ops.fill(x, 1.0), stream=s0)  # writes x
                last = gpu.submit(ops.fill(x, 2.0), stream=s1)  # must land last
            assert not first.done()
        await last.wait()
        if kind == "war":
            np.testing.assert_array_equal(await gpu.to_host(y), host())
        else:
            np.testing.assert_array_equal(await gpu.to_host(x), host(value=2.0))
        assert wait_labels(sim, 1)


async def test_conflicts_error_raises_and_enqueues_nothing(sim):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        y = await gpu.to_device(host(), stream=s1)
        sim.hold()
        fut = gpu.submit(add(x, 1.0), stream=s0)
        before = (gpu.statistics(), sim.pending)
        with pytest.raises(trio_cuda.AccessConflictError, match=r"read-after-write .* stream 0"):
            gpu.submit(copy(x, y), stream=s1)
        with pytest.raises(trio_cuda.AccessConflictError, match="write-after-write"):
            gpu.submit(ops.fill(x, 0.0), stream=s1)
        assert (gpu.statistics(), sim.pending) == before
        sim.release()
        await fut.wait()
        await gpu.run(copy(x, y), stream=s1)  # fine once retired
        np.testing.assert_array_equal(await gpu.to_host(y), host() + 1)


async def test_leases_released_at_gpu_completion_not_task_return(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        sim.hold()
        with trio.move_on_after(0.01):
            await gpu.run(add(x, 1.0))
        assert gpu.statistics().leases_held == 1
        await trio.sleep(0.02)
        assert gpu.statistics().leases_held == 1  # still: the GPU has not run it
        sim.release()
        await gpu.run(ops.value(None))
        await trio.testing.wait_all_tasks_blocked()
        assert gpu.statistics().leases_held == 0


# --------------------------------------------------------------------------- rule 3


async def test_pre_cancelled_run_submits_nothing(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        before = gpu.statistics().submitted
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.run(add(x, 1.0))
        assert cs.cancelled_caught
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.to_device(host())
        assert gpu.statistics().submitted == before
        assert sim.statistics().launches == 0
        np.testing.assert_array_equal(await gpu.to_host(x), host())


async def test_deadline_cancels_promptly_and_keeps_leases(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host(value=1.0))
        sim.hold()
        t0 = time.perf_counter()
        with trio.move_on_after(0.02) as cs:
            await gpu.run(saxpy(3.0, x, y))
        assert cs.cancelled_caught
        assert time.perf_counter() - t0 < 1.0
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held) == (1, 2)
        x.close()
        y.close()
        assert len(sim.live_allocations) == 2
        sim.release()
        await gpu.run(ops.value(None))
        await trio.testing.wait_all_tasks_blocked()
        assert gpu.statistics().leases_held == 0
        assert sim.live_allocations == []
        assert sim.statistics().launches == 1  # the cancelled launch did run


async def test_shielded_wait_survives_cancellation(sim):
    async with trio_cuda.open_scope(device=sim) as gpu, trio.open_nursery() as nursery:
        x = await gpu.to_device(host())
        sim.hold()
        nursery.start_soon(release_after, sim, 0.05)
        with trio.CancelScope() as outer:
            outer.cancel()
            with trio.CancelScope(shield=True):
                out = await gpu.run(add(x, 1.0))
        assert out is x
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)


async def test_nested_scope_exit_drains_under_outer_cancellation(sim):
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        with trio.move_on_after(0.02):
            async with trio_cuda.open_scope(device=sim) as outer_gpu:
                x = await outer_gpu.to_device(host())
                async with trio_cuda.open_scope(device=sim) as inner_gpu:
                    y = await inner_gpu.to_device(host())
                    sim.hold()
                    nursery.start_soon(release_after, sim, 0.1)
                    outer_gpu.submit(add(x, 1.0))
                    await inner_gpu.run(add(y, 1.0))  # cancelled by the deadline
                    pytest.fail("not reached")
        # both exits waited, shielded, for the held work
        assert time.perf_counter() - t0 >= 0.09
    assert sim.live_allocations == []
    assert sim.statistics().launches == 2


async def test_cancelled_to_device_frees_its_array_after_retirement(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        sim.hold()
        with trio.move_on_after(0.01):
            await gpu.to_device(host())
        assert len(sim.live_allocations) == 1  # the copy is still in flight
        sim.release()
        await gpu.run(ops.value(None))
        await trio.testing.wait_all_tasks_blocked()
        assert sim.live_allocations == []


# --------------------------------------------------------------------------- rule 4


async def test_dropped_future_keeps_submission(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host(value=0.0))
        sim.hold()
        fut = gpu.submit(saxpy(1.0, x, y))
        del fut
        x.close()
        y.close()
        gc.collect()
        assert gpu.statistics().leases_held == 2
        assert len(sim.live_allocations) == 2
        sim.release()
    assert sim.live_allocations == []


async def test_forgotten_future_error_surfaces_at_exit(sim):
    with pytest.RaisesGroup(pytest.RaisesExc(trio_cuda.LaunchError, match="CUDA_ERROR_LAUNCH_FAILED")):
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            sim.inject_fault("kernel_fault")
            gpu.submit(add(x, 1.0))
    assert sim.live_allocations == []


async def test_observed_error_is_not_raised_again(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        sim.inject_fault("kernel_fault")
        fut = gpu.submit(add(x, 1.0))
        with pytest.raises(trio_cuda.LaunchError):
            await fut.wait()
        assert gpu.statistics().pending_errors == 0
        # the stream goes on (kernel faults are not sticky on the simulator)
        await gpu.run(add(x, 1.0))
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)


# --------------------------------------------------------------------------- rule 5


async def test_exit_waits_for_in_flight_work(sim):
    async with trio.open_nursery() as nursery:
        t0 = time.perf_counter()
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            sim.hold()
            gpu.submit(add(x, 1.0))
            nursery.start_soon(release_after, sim, 0.05)
        assert time.perf_counter() - t0 >= 0.04
        assert gpu.statistics().in_flight == 0
        assert x.closed
    assert sim.live_allocations == []


async def test_exit_on_error_waits_and_reraises_unwrapped(sim):
    async with trio.open_nursery() as nursery:
        with pytest.raises(KeyError, match="boom"):
            async with trio_cuda.open_scope(device=sim) as gpu:
                x = await gpu.to_device(host())
                sim.hold()
                gpu.submit(add(x, 1.0))
                nursery.start_soon(release_after, sim, 0.03)
                raise KeyError("boom")
        assert gpu.statistics().in_flight == 0
    assert sim.live_allocations == []
    assert sim.statistics().launches == 1


async def test_exit_on_error_with_unobserved_failure_is_a_group(sim):
    with pytest.RaisesGroup(KeyError, trio_cuda.LaunchError):
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            sim.inject_fault("kernel_fault")
            gpu.submit(add(x, 1.0))
            raise KeyError("boom")
    assert sim.live_allocations == []


async def test_exit_on_cancellation_drains_shielded(sim):
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as cs:
            async with trio_cuda.open_scope(device=sim) as gpu:
                x = await gpu.to_device(host())
                sim.hold()
                gpu.submit(add(x, 1.0))
                nursery.start_soon(release_after, sim, 0.03)
                cs.cancel()
                await trio.sleep_forever()
        assert cs.cancelled_caught
        assert gpu.statistics().in_flight == 0
    assert sim.live_allocations == []


async def test_drain_timeout_quarantines_with_resource_warning(sim):
    with pytest.warns(ResourceWarning, match="drain_timeout=0.05"):
        async with trio_cuda.open_scope(device=sim, drain_timeout=0.05) as gpu:
            x = await gpu.to_device(host())
            ptr = x.ptr
            sim.hold()
            fut = gpu.submit(add(x, 1.0))
            with trio.move_on_after(0.01):
                await fut.wait()
            cancelled_fut = fut
    st = gpu.statistics()
    assert (st.in_flight, st.quarantined, st.quarantined_leases) == (0, 1, 1)
    assert st.live_allocations == 1
    assert ptr in addrs(sim)  # never freed
    with pytest.raises(trio_cuda.CompletionUnknownError, match="drain_timeout"):
        cancelled_fut.wait_nowait()
    sim.release()  # the GPU finishes later: it touches memory that is still live
    assert sim.violations == []
    assert ptr in addrs(sim)
    sim.clear_violations()


# --------------------------------------------------------------------------- rule 6


async def test_then_closure_raising_keeps_enqueued_work_retained(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        sim.hold()

        def boom(out):
            raise ValueError("closure failed")

        with pytest.raises(ValueError, match="closure failed"):
            gpu.submit(add(x, 1.0).then(boom))
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held) == (1, 1)
        x.close()
        assert len(sim.live_allocations) == 1
        sim.release()
        await gpu.run(ops.value(None))
        await trio.testing.wait_all_tasks_blocked()
        assert sim.live_allocations == []
        assert gpu.statistics().pending_errors == 0  # the caller saw the error
    assert sim.statistics().launches == 1


async def test_driver_failure_part_way_keeps_first_part(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        sim.hold()

        def second(out):
            sim.inject_fault("launch_error")
            return add(y, 1.0)

        with pytest.raises(trio_cuda.LaunchError, match="CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
            await gpu.run(add(x, 1.0).then(second))
        assert gpu.statistics().in_flight == 1
        assert sim.pending >= 1
        sim.release()
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)  # first part ran
        np.testing.assert_array_equal(await gpu.to_host(y), host())  # second never enqueued


async def test_then_returning_non_op_is_a_partial_error(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        with pytest.raises(TypeError, match="must return a DeviceOp, got int"):
            gpu.submit(add(x, 1.0).then(lambda out: 3))
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)


async def test_invalid_op_from_the_start_retains_nothing(sim):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        sim.hold()
        fut = gpu.submit(add(x, 1.0), stream=s0)
        before = gpu.statistics()
        with pytest.raises(trio_cuda.AccessConflictError):
            gpu.submit(add(x, 1.0), stream=s1)
        assert gpu.statistics() == before
        sim.release()
        await fut.wait()


# --------------------------------------------------------------------------- rule 7


async def test_unknown_completion_quarantines_and_poisons(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        sim.inject_fault("completion_unknown")
        with pytest.raises(trio_cuda.CompletionUnknownError, match="could not be established"):
            await gpu.run(saxpy(2.0, x, y))
        st = gpu.statistics()
        assert (st.quarantined, st.quarantined_leases, st.leases_held) == (1, 2, 0)
        assert x.quarantined
        assert y.quarantined
        with pytest.raises(trio_cuda.CompletionUnknownError, match="quarantined"):
            gpu.submit(add(x, 1.0))
        with pytest.raises(trio_cuda.CompletionUnknownError):
            await gpu.to_host(y)
        ptrs = {x.ptr, y.ptr}
        x.close()
        y.close()
        # other work still runs
        z = await gpu.to_device(host())
        await gpu.run(add(z, 1.0))
    assert addrs(sim) == ptrs  # quarantined memory is never freed
    assert gpu.statistics().quarantined_bytes == 2 * N * 4


# --------------------------------------------------------------------------- rule 9


async def test_close_while_in_flight_defers_the_free(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        sim.hold()
        gpu.submit(add(x, 1.0))
        x.close()
        assert x.closed
        assert len(sim.live_allocations) == 1
        sim.release()
        await gpu.run(ops.value(None))
        await trio.testing.wait_all_tasks_blocked()
        assert sim.live_allocations == []


async def test_async_with_array_and_gc_defer_the_free(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        sim.hold()
        async with gpu.empty(N, np.float32) as a:
            gpu.submit(ops.fill(a, 1.0))
        b = gpu.empty(N, np.float32)
        gpu.submit(ops.fill(b, 2.0))
        del b
        gc.collect()
        await trio.testing.wait_all_tasks_blocked()
        assert len(sim.live_allocations) == 2
        sim.release()
        await gpu.run(ops.value(None))
        await trio.testing.wait_all_tasks_blocked()
        assert sim.live_allocations == []


async def test_readonly_handle_keeps_memory_and_shares_reads(sim):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        ro = x.as_readonly()
        assert ro.ptr == x.ptr
        assert ro.readonly
        x.close()
        assert len(sim.live_allocations) == 1
        out = gpu.empty(N, np.float32, stream=s1)
        await gpu.run(copy(ro, out), stream=s1)
        np.testing.assert_array_equal(await gpu.to_host(out), host())
        with pytest.raises(trio_cuda.KernelArgumentError, match="read-only"):
            add(ro, 1.0)
        ro.close()
        await trio.testing.wait_all_tasks_blocked()
        assert len(sim.live_allocations) == 1  # only `out`


async def test_async_on_retains_nothing(sim):
    """The unsafe path gives the caller every lifetime duty: closing an array
    while its kernel is in flight frees it at once, and the simulator's
    memcheck catches the use after free."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        op = add(x, 1.0)
        sim.hold()
        before = gpu.statistics()
        assert unsafe.async_on(op, gpu.streams[0]) is x
        after = gpu.statistics()
        assert (after.in_flight, after.leases_held, after.submitted) == (0, 0, before.submitted)
        x.close()
        assert sim.live_allocations == []  # freed at once: nothing retained it
        sim.release()
        assert [v.kind for v in sim.violations] == ["use_after_free"]
        sim.clear_violations()


async def test_async_on_with_caller_kept_lifetimes_is_clean(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        s = gpu.streams[0]
        for _ in range(3):
            unsafe.async_on(add(x, 1.0), s)
        out = np.empty(N, np.float32)
        unsafe.async_on(ops.copy(out, x), s)
        np.testing.assert_array_equal(out, host() + 3)
        with pytest.raises(TypeError, match="host_closure cannot run through unsafe.async_on"):
            unsafe.async_on(ops.host_closure(print), s)


# --------------------------------------------------------------------------- rule 10


async def test_handoff_retires_in_completion_order(autojump_clock):
    # kernel times are virtual (the autojump clock): loading kernels takes no
    # simulated time, so the order is the device's, not the host's speed
    sim = SimDevice(kernel_time=0.01)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        a = await gpu.to_device(host(), stream=s0)
        b = await gpu.to_device(host(), stream=s1)
        order = []

        async def waiter(name, fut):
            await fut.wait()
            order.append(name)

        async with trio.open_nursery() as nursery:
            f0 = gpu.submit(
                add(a, 1.0).then(lambda out: add(out, 1.0)).then(lambda out: add(out, 1.0)), stream=s0
            )
            f1 = gpu.submit(add(b, 1.0), stream=s1)
            nursery.start_soon(waiter, "slow s0", f0)
            nursery.start_soon(waiter, "fast s1", f1)
        assert order == ["fast s1", "slow s0"]


async def test_waiting_never_blocks_the_loop(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        sim.hold()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.sleep(0.001)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            nursery.start_soon(release_after, sim, 0.05)
            await gpu.run(add(x, 1.0))
            nursery.cancel_scope.cancel()
        assert ticks >= 10


async def test_host_closure_runs_in_stream_order_on_the_loop_thread():
    sim = SimDevice(kernel_time=0.005)
    async with trio_cuda.open_scope(device=sim, streams=1) as gpu:
        x = await gpu.to_device(host())
        sim.clear_trace()
        seen = {}

        def probe(tag):
            seen["thread"] = threading.get_ident()
            seen["t"] = time.perf_counter()
            return tag * 2

        op = add(x, 1.0).then(lambda out: ops.host_closure(probe, 21)).then(lambda r: add(x, 1.0))
        result = await gpu.run(op.map(lambda out: out))
        assert result is x
        assert seen["thread"] == threading.get_ident()
        launches = [e for e in sim.trace if e.kind == "launch"]
        assert len(launches) == 2
        assert launches[0].t_end <= seen["t"] <= launches[1].t_start
        assert await gpu.run(ops.host_closure(probe, 5)) == 10


async def test_host_closure_error_reaches_caller_and_stream_goes_on(sim):
    async with trio_cuda.open_scope(device=sim, streams=1) as gpu:
        x = await gpu.to_device(host())

        def bad():
            raise RuntimeError("closure exploded")

        with pytest.raises(RuntimeError, match="closure exploded"):
            await gpu.run(ops.host_closure(bad).then(lambda r: add(x, 1.0)))
        # the gate opened: the work after it ran
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)
        assert gpu.statistics().host_closures_pending == 0


async def test_many_completions_batch_into_few_wakeups(sim):
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        arrs = [await gpu.to_device(host(8)) for _ in range(8)]
        wakeups = 0

        class Counting:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            async def wait_for_progress(self, pending):
                nonlocal wakeups
                wakeups += 1
                await self.inner.wait_for_progress(pending)

        internals.set_driver(gpu, Counting(internals.driver_of(gpu)))
        sim.hold()
        futs = [gpu.submit(add(a, 1.0)) for a in arrs for _ in range(25)]
        await trio.testing.wait_all_tasks_blocked()
        assert wakeups == 1  # the handoff task sleeps in the driver
        wakeups = 0
        sim.release()
        await trio.testing.wait_all_tasks_blocked()
        # one wakeup retired all 200 completions: the handoff did not sleep again
        assert all(f.done() for f in futs)
        assert wakeups == 0
        for a in arrs:
            np.testing.assert_array_equal(await gpu.to_host(a), host(8) + 25)


# --------------------------------------------------------------------------- misc


async def test_many_tasks_awaiting_their_own_launches(sim):
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        arrs = [await gpu.to_device(host(16)) for _ in range(100)]

        async def worker(a):
            for _ in range(5):
                await gpu.run(add(a, 1.0))

        async with trio.open_nursery() as nursery:
            for a in arrs:
                nursery.start_soon(worker, a)
        for a in arrs[:5]:
            np.testing.assert_array_equal(await gpu.to_host(a), host(16) + 5)
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held) == (0, 0)


# --------------------------------------------------------------------------- batching


async def test_batched_markers_share_one_marker_per_burst_and_keep_the_rules():
    sim = SimDevice(batch_markers=True)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        arrs = [await gpu.to_device(host(16), stream=s0) for _ in range(4)]
        sim.clear_trace()
        sim.hold()
        futs = [gpu.submit(add(a, 1.0), stream=s0) for a in arrs for _ in range(5)]
        # a conflicting reader on another stream forces the burst's marker out
        out = gpu.empty(16, np.float32, stream=s1)
        reader = gpu.submit(copy(arrs[0], out), stream=s1)
        markers = [e for e in sim.trace if e.kind == "marker"]
        assert markers == []  # nothing executed yet: held
        sim.release()
        await reader.wait()
        for f in futs:
            await f.wait()
        stream0_markers = [e for e in sim.trace if e.kind == "marker" and e.stream == 0]
        assert len(stream0_markers) == 1  # 20 submissions, one completion marker
        assert wait_labels(sim, 1)
        np.testing.assert_array_equal(await gpu.to_host(out), host(16) + 5)
        # cancellation still leaves leases held until the GPU is done
        sim.hold()
        with trio.move_on_after(0.01):
            await gpu.run(add(arrs[1], 1.0), stream=s0)
        assert gpu.statistics().leases_held == 1
        sim.release()
    assert sim.live_allocations == []
    assert sim.violations == []


async def test_batched_marker_error_fails_the_whole_burst():
    sim = SimDevice(batch_markers=True)
    with pytest.RaisesGroup(trio_cuda.LaunchError, trio_cuda.LaunchError):
        async with trio_cuda.open_scope(device=sim, streams=1) as gpu:
            a = await gpu.to_device(host(16))
            sim.hold()
            sim.inject_fault("kernel_fault")
            f1 = gpu.submit(add(a, 1.0))
            f2 = gpu.submit(add(a, 1.0))
            sim.release()
            del f1, f2
    assert sim.live_allocations == []


async def test_waiter_observes_and_retires_its_own_completion():
    # Rule 10: the awaiting task saw its marker complete and retired the work
    # itself, in stream order: leases are released when wait() returns, with
    # no pass of the handoff task in between.
    # a spin budget far past the kernel's time: the waiter sees it complete
    # however slowly the host runs
    sim = SimDevice(kernel_time=0.0005, await_spin=5.0)
    async with trio_cuda.open_scope(device=sim, streams=1) as gpu:
        a = await gpu.to_device(host(16))
        before = gpu.statistics().retired_by_waiters
        fut = gpu.submit(add(a, 1.0))
        assert await fut.wait() is a
        assert internals.submission_of(fut).waiter is None
        st = gpu.statistics()
        assert (st.leases_held, st.in_flight) == (0, 0)  # no checkpoint since the wait returned
        assert st.retired_by_waiters == before + 1
        assert await gpu.run(add(a, 1.0)) is a
        assert gpu.statistics().retired_by_waiters == before + 2
        np.testing.assert_array_equal(await gpu.to_host(a), host(16) + 2)  # finisher path
    assert sim.live_allocations == []


async def test_waiter_retires_the_completed_prefix_of_every_stream_in_order():
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        a = await gpu.to_device(host(16))
        b = await gpu.to_device(host(16))
        sim.hold()
        dropped = [gpu.submit(add(b, 1.0), stream=s1) for _ in range(3)]
        first = gpu.submit(add(a, 1.0), stream=s0)
        mine = gpu.submit(add(a, 1.0), stream=s0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mine.wait)
            await trio.testing.wait_all_tasks_blocked()
            assert internals.submission_of(mine).waiter is not None  # parked: its marker is pending
            assert sim.run_until_idle() == 5  # done on the device, nothing retired yet
            assert gpu.statistics().in_flight == 5
        # whoever looked first retired all five, in stream order, exactly once
        assert all(f.done() for f in [*dropped, first, mine])
        st = gpu.statistics()
        assert (st.in_flight, st.completed - st.failed, st.leases_held) == (0, st.completed, 0)
        sim.release()
    assert sim.violations == []


async def test_waiter_parks_when_its_work_is_held_and_is_rescheduled():
    sim = SimDevice(await_spin=0.001)
    async with trio_cuda.open_scope(device=sim) as gpu, trio.open_nursery() as nursery:
        a = await gpu.to_device(host(16))
        sim.hold()
        nursery.start_soon(release_after, sim, 0.05)
        t0 = time.perf_counter()
        fut = gpu.submit(add(a, 1.0))
        parked = []

        async def watch() -> None:
            await trio.testing.wait_all_tasks_blocked()
            parked.append(internals.submission_of(fut).waiter)

        nursery.start_soon(watch)
        await fut.wait()
        assert time.perf_counter() - t0 >= 0.04
        assert parked  # the watcher ran while the waiter was blocked
        assert parked[0] is not None  # it parked after the spin budget
        assert internals.submission_of(fut).waiter is None


async def test_two_tasks_awaiting_one_future_both_wake():
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = await gpu.to_device(host(16))
        sim.hold()
        fut = gpu.submit(add(a, 1.0))
        got = []
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(lambda: _append(got, fut.wait()))
                await trio.testing.wait_all_tasks_blocked()
                assert isinstance(internals.submission_of(fut).waiter, list)
                assert len(internals.submission_of(fut).waiter) == 3
                sim.release()
        finally:
            sim.release()
        assert got == [a, a, a]


async def test_cancelled_parked_waiter_is_taken_off_its_submission():
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = await gpu.to_device(host(16))
        sim.hold()
        try:
            fut = gpu.submit(add(a, 1.0))
            got = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: _append(got, fut.wait()))
                await trio.testing.wait_all_tasks_blocked()
                other = internals.submission_of(fut).waiter
                assert isinstance(other, trio.lowlevel.Task)
                with trio.move_on_after(0.01) as cs:
                    await fut.wait()
                assert cs.cancelled_caught
                w = internals.submission_of(fut).waiter  # only the other task is left to reschedule
                assert (w if isinstance(w, list) else [w]) == [other]
                assert gpu.statistics().leases_held == 1  # still held: the GPU has not run it
                sim.release()
            assert got == [a]
        finally:
            sim.release()
    assert sim.violations == []


async def _append(out: list[object], aw: Any) -> None:
    out.append(await aw)


async def test_scope_whose_body_never_yields_exits():
    with trio.fail_after(5):
        async with trio_cuda.open_scope(device="sim"):
            pass
        async with trio_cuda.open_scope(device="sim") as gpu:
            gpu.zeros(4, np.float32)


async def test_load_compiles_ahead_and_is_a_checkpoint(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        with trio.testing.assert_checkpoints():
            await gpu.load(ADD, COPY)
        assert sim.statistics().kernel_loads == 2
        await gpu.load(ADD)  # already loaded: nothing more
        x = await gpu.to_device(host())
        await gpu.run(add(x, 1.0))
        assert sim.statistics().kernel_loads == 2
        with pytest.raises(TypeError, match=r"kernels\[0\]: expected a Kernel or a DeviceOp, got str"):
            await gpu.load("add_f4")


async def test_many_awaiting_tasks_retire_their_own_work_without_the_handoff():
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        arrs = [await gpu.to_device(host(16)) for _ in range(8)]
        before = gpu.statistics()

        async def worker(a: trio_cuda.DeviceArray) -> None:
            for _ in range(5):
                await gpu.run(add(a, 1.0))

        async with trio.open_nursery() as nursery:
            for a in arrs:
                nursery.start_soon(worker, a)
        st = gpu.statistics()
        assert st.completed - before.completed == 40
        assert st.retired_by_waiters - before.retired_by_waiters == 40  # every one by its waiter
        assert (st.in_flight, st.leases_held) == (0, 0)
        for a in arrs:
            np.testing.assert_array_equal(await gpu.to_host(a), host(16) + 5)
    assert sim.violations == []


async def test_partial_error_in_run_wakes_the_handoff():
    # run() leaves the handoff asleep; a submission that fails part-way has
    # work in flight that nobody awaits, so it must wake the handoff itself.
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = await gpu.to_device(host(16))
        sim.hold()

        def boom(_: object) -> trio_cuda.DeviceOp[object]:
            raise ValueError("then closure failed")

        with pytest.raises(ValueError, match="then closure failed"):
            await gpu.run(add(a, 1.0).then(boom))
        assert gpu.statistics().leases_held == 1  # the enqueued kernel still uses a
        sim.release()
        with trio.fail_after(5):
            while gpu.statistics().in_flight:  # noqa: ASYNC110 - polling the scope's counters
                await trio.sleep(0.001)  # retired with no waiter: the handoff did it
        assert gpu.statistics().leases_held == 0
    assert sim.violations == []


async def test_wait_nowait_observes_and_retires_a_completion():
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = await gpu.to_device(host(16))
        sim.hold()
        try:
            fut = gpu.submit(add(a, 1.0))
            with pytest.raises(trio.WouldBlock):
                fut.wait_nowait()
            assert sim.run_until_idle() == 1  # done on the device; nobody looked yet
            assert not fut.done()
            assert gpu.statistics().leases_held == 1
            assert fut.wait_nowait() is a  # looked, observed, retired: no checkpoint
            assert fut.done()
            assert gpu.statistics().leases_held == 0
        finally:
            sim.release()
        np.testing.assert_array_equal(await gpu.to_host(a), host(16) + 1)
    assert sim.violations == []
