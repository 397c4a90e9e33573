"""Every public async function of trio_cuda is a Trio checkpoint: it yields to
the scheduler and is a cancellation point, whether or not it has to wait; and
a call that is cancelled before it starts submits nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from trio.testing import assert_checkpoints

import trio_cuda
from tests.helpers.kernels import add, saxpy
from trio_cuda import ops
from trio_cuda.testing import SimDevice

F4 = np.float32
N = 32


@pytest.fixture(
    params=[
        {},
        {"await_spin": 1e-3},  # the inline spin path of DeviceFuture.wait
        {"batch_markers": True},
        {"kernel_time": 1e-3, "copy_time": 1e-3},  # work that takes (simulated) time
    ],
    ids=["plain", "spin", "batched", "timed"],
)
def dev(request: pytest.FixtureRequest):
    d = SimDevice(**request.param)
    yield d
    assert d.violations == []


def counters(sim: SimDevice, gpu: trio_cuda.ResourceScope) -> tuple[Any, ...]:
    s, g = sim.statistics(), gpu.statistics()
    return (
        s.launches,
        s.copies,
        s.fills,
        s.allocations,
        s.live_allocations,
        sim.pending,
        g.submitted,
        g.in_flight,
        g.live_allocations,
        g.leases_held,
    )


# --------------------------------------------------------------------------- checkpoints


async def test_run_is_a_checkpoint(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        x = gpu.zeros(N, F4)
        with assert_checkpoints():
            assert await gpu.run(add(x, 1.0)) is x
        with assert_checkpoints():
            assert await gpu.run(ops.value(3)) == 3  # no GPU work at all
        with assert_checkpoints():
            assert await gpu.run(ops.host_closure(lambda: 4)) == 4


async def test_transfers_are_checkpoints(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        with assert_checkpoints():
            x = await gpu.to_device(np.arange(N, dtype=F4))
        with assert_checkpoints():
            got = await gpu.to_host(x)
        np.testing.assert_array_equal(got, np.arange(N, dtype=F4))
        with assert_checkpoints():
            empty = await gpu.to_device(np.zeros(0, F4))  # nothing to copy
        with assert_checkpoints():
            assert (await gpu.to_host(empty)).shape == (0,)


async def test_wait_is_a_checkpoint_pending_or_done(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        x = gpu.zeros(N, F4)
        fut = gpu.submit(add(x, 1.0))
        with assert_checkpoints():
            assert await fut.wait() is x  # pending (or completing) when called
        assert fut.done()
        with assert_checkpoints():
            assert await fut.wait() is x  # already done
        failed_kind = "kernel_fault"
        dev.inject_fault(failed_kind)
        bad = gpu.submit(add(x, 1.0))
        with pytest.raises(trio_cuda.LaunchError):
            await bad.wait()
        assert bad.done()
        with assert_checkpoints(), pytest.raises(trio_cuda.LaunchError):
            await bad.wait()  # done with an error: still a checkpoint


async def test_await_op_is_a_checkpoint(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        x = gpu.zeros(N, F4)
        y = gpu.zeros(N, F4)
        with assert_checkpoints():
            assert await add(x, 1.0) is x
        with assert_checkpoints():
            assert await saxpy(2.0, x, y).map(lambda out: out.size) == N
        with assert_checkpoints():
            assert await ops.value(None) is None


async def test_array_context_manager_is_a_checkpoint(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        arr = gpu.zeros(N, F4)
        with assert_checkpoints():
            entered = await arr.__aenter__()
        assert entered is arr
        with assert_checkpoints():
            await arr.__aexit__(None, None, None)
        assert arr.closed


async def test_open_scope_enter_and_exit_are_checkpoints(dev):
    cm = trio_cuda.open_scope(device=dev)
    with assert_checkpoints():
        gpu = await cm.__aenter__()
    x = gpu.zeros(N, F4)
    gpu.submit(add(x, 1.0))
    with assert_checkpoints():
        assert await cm.__aexit__(None, None, None) is False
    assert gpu.closed
    # an empty scope too: nothing to drain, still a checkpoint
    cm = trio_cuda.open_scope(device=dev)
    with assert_checkpoints():
        await cm.__aenter__()
    with assert_checkpoints():
        await cm.__aexit__(None, None, None)
    assert dev.live_allocations == []


# --------------------------------------------------------------------------- cancellation points


async def test_done_wait_and_run_are_cancellation_points(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        x = gpu.zeros(N, F4)
        fut = gpu.submit(add(x, 1.0))
        await fut.wait()
        with trio.CancelScope() as cs:
            cs.cancel()
            await fut.wait()  # done, but the caller was cancelled
        assert cs.cancelled_caught
        with trio.CancelScope() as cs:
            cs.cancel()
            await ops.value(1)
        assert cs.cancelled_caught


async def test_array_aexit_closes_even_when_cancelled(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        with trio.CancelScope() as cs:
            async with gpu.zeros(N, F4) as arr:
                cs.cancel()
        assert cs.cancelled_caught
        assert arr.closed
        with trio.CancelScope() as cs:
            cs.cancel()
            async with gpu.zeros(N, F4):  # __aenter__ raises Cancelled
                pytest.fail("the body must not run")  # pragma: no cover
        assert cs.cancelled_caught
    assert dev.live_allocations == []


async def test_scope_enter_and_exit_are_cancellation_points(dev):
    with trio.CancelScope() as cs:
        cs.cancel()
        async with trio_cuda.open_scope(device=dev):
            pytest.fail("a cancelled task must not open a scope")  # pragma: no cover
    assert cs.cancelled_caught
    with trio.CancelScope() as cs:
        async with trio_cuda.open_scope(device=dev) as gpu:
            x = gpu.zeros(N, F4)
            gpu.submit(add(x, 1.0))
            cs.cancel()  # no checkpoint in the body: the exit is the cancellation point
    assert cs.cancelled_caught
    assert gpu.closed
    assert gpu.statistics().in_flight == 0  # exit still drained first
    assert dev.live_allocations == []


async def test_cancellation_at_scope_exit_loses_no_error(dev):
    # The exit is where a cancellation lands when the body never yields; the
    # error of a dropped future must still come out (rule 4), next to it.
    with pytest.raises(ExceptionGroup) as info, trio.CancelScope() as cs:
        async with trio_cuda.open_scope(device=dev) as gpu:
            x = gpu.zeros(N, F4)
            dev.inject_fault("kernel_fault")
            gpu.submit(add(x, 1.0))  # dropped; fails on the device
            cs.cancel()
    # The allocation, its zero fill (on the allocation's stream) and the kernel
    # (the default policy puts it behind the fill it depends on) share one
    # stream; with batched markers all three share the kernel's failed burst
    # and report the same error. Nothing else may come out.
    errors = info.value.exceptions
    assert [type(e) for e in errors] == [trio_cuda.LaunchError] * (3 if dev.batch_markers else 1)
    assert all("kernel_fault in kernel add_f4" in str(e) for e in errors)
    assert gpu.statistics().in_flight == 0
    assert dev.live_allocations == []


# --------------------------------------------------------------------------- pre-cancelled calls


async def test_pre_cancelled_run_submits_nothing(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        x = gpu.zeros(N, F4)
        await gpu.run(ops.value(None))
        # the zero fill may be on another stream than the value, and takes
        # (simulated) time: wait for it, or it completes between the counts
        await gpu.to_host(x)
        calls = []
        op = add(x, 1.0).then(lambda out: calls.append(out) or ops.value(out))
        before = counters(dev, gpu)
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.run(op)
        assert cs.cancelled_caught
        with trio.CancelScope() as cs:
            cs.cancel()
            await op  # `await op` too
        assert cs.cancelled_caught
        assert counters(dev, gpu) == before
        assert calls == []  # the lazy rest never ran
        np.testing.assert_array_equal(await gpu.to_host(x), np.zeros(N, F4))


async def test_pre_cancelled_to_device_allocates_nothing(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        await gpu.run(ops.value(None))
        before = counters(dev, gpu)
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.to_device(np.arange(N, dtype=F4))
        assert cs.cancelled_caught
        assert counters(dev, gpu) == before
    assert dev.live_allocations == []


async def test_pre_cancelled_to_host_copies_nothing(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        x = await gpu.to_device(np.arange(N, dtype=F4))
        await trio.testing.wait_all_tasks_blocked()
        before = counters(dev, gpu)
        out = np.full(N, -1, F4)
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.to_host(x, out=out)
        assert cs.cancelled_caught
        assert counters(dev, gpu) == before
        assert (out == -1).all()


async def test_pre_cancelled_wait_leaves_the_work_in_flight(dev):
    async with trio_cuda.open_scope(device=dev) as gpu:
        x = gpu.zeros(N, F4)
        dev.hold()
        try:
            fut = gpu.submit(add(x, 1.0))
            with trio.CancelScope() as cs:
                cs.cancel()
                await fut.wait()
            assert cs.cancelled_caught
            assert not fut.done()
            assert gpu.statistics().in_flight >= 1
        finally:
            dev.release()
        assert await fut.wait() is x
        np.testing.assert_array_equal(await gpu.to_host(x), np.ones(N, F4))
