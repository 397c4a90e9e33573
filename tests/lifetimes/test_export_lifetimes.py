"""Exports and the memory behind them: when a released export lets the memory go.

Small deterministic programs on the simulator: the cores of programs the
adversarial generator (``tests/helpers/adversary.py``) once failed, and the places a
sweep may run:

* A DLPack capsule dropped without being consumed is found by the scope's
  next sweep (``statistics()``, a retirement pass, a conflicting access, the
  exit). A sweep on the loop finishes what it released at once, so the
  statistics it returns already count the export's release as work in
  flight: waiting until ``in_flight`` reads 0 then means the memory is freed.
* Closing the last handle of an allocation whose export's capsule was dropped
  unconsumed releases that export: the memory is freed without any other call
  of the scope.
* Such a sweep may run inside a retirement pass (the handoff's, or a host
  closure's): the release it finishes there records its own marker, with
  batched markers too, and retires. Inside a then-closure (a submission being
  enqueued) it is left to the loop.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from trio_cuda import ops
from trio_cuda.testing import SimDevice

F4 = np.float32


def capsule_of(x: trio_cuda.DeviceArray) -> object:
    """A DLPack capsule of ``x`` that only trio_cuda on the same device could consume."""
    return x.__dlpack__(max_version=(1, 0), dl_device=x.__dlpack_device__())


async def quiet(gpu: trio_cuda.ResourceScope) -> None:
    """Checkpoint until ``gpu.statistics()`` shows nothing in flight."""
    for _ in range(1000):
        if not gpu.statistics().in_flight:
            return
        await trio.sleep(0.0005)
    raise AssertionError(f"still in flight: {gpu.statistics()}")


async def test_statistics_counts_the_release_its_sweep_found(sim):
    """A capsule dropped unconsumed on an array already closed: the sweep in
    ``statistics()`` releases the export, and the same call reports its
    release in flight (not ``in_flight=0`` with the memory still held)."""
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.full(8, 3.0, F4)
        await gpu.run(ops.fill(x, 1.0))
        ptr = x.ptr
        capsule = capsule_of(x)
        x.close()  # the export keeps the memory
        assert ptr in {a.ptr for a in sim.live_allocations}
        del capsule  # dropped unconsumed: the export is released by the next sweep
        st = gpu.statistics()
        assert st.in_flight == 1, st  # the release, in flight behind its fence
        await quiet(gpu)
        assert ptr not in {a.ptr for a in sim.live_allocations}
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held, st.live_allocations) == (0, 0, 0), st


async def test_a_sweep_by_another_scope_of_the_loop_finishes_the_release(sim):
    """Capsules are swept globally: scope ``a``'s ``statistics()`` finds a
    capsule of scope ``b``. ``b``'s release is finished in that call too, so
    ``b.statistics()`` then shows it in flight."""
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = b.zeros(4, F4)
        await b.run(ops.fill(x, 2.0))
        ptr = x.ptr
        capsule = capsule_of(x)
        del capsule
        x.close()
        a.statistics()  # the sweep: b's export is released and finished
        assert b.statistics().in_flight == 1
        await quiet(b)
        assert ptr not in {al.ptr for al in sim.live_allocations}


async def test_closing_the_last_handle_releases_a_dropped_capsule(sim):
    """Drop the capsule, then close the array, and call nothing else of the
    scope: the close finds the export's capsule dropped and releases it, so
    the memory is freed once the release retired (the handoff does that)."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        await gpu.run(ops.fill(x, 2.0))
        await trio.testing.wait_all_tasks_blocked()  # the handoff is asleep: nothing else sweeps
        ptr = x.ptr
        capsule = capsule_of(x)
        del capsule
        gc.collect()
        x.close()
        for _ in range(1000):  # no call of the scope: only its handoff runs
            if ptr not in {a.ptr for a in sim.live_allocations}:
                break
            await trio.sleep(0.001)
        else:
            raise AssertionError("the memory is still allocated")
        assert gpu.statistics().leases_held == 0


async def test_a_kept_capsule_still_holds_the_memory_after_close(sim):
    """The close sweeps only capsules dropped unconsumed: one the program
    still holds keeps its export, and the memory, until it is dropped."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        ptr = x.ptr
        capsule = capsule_of(x)
        x.close()
        await trio.sleep(0.01)
        gpu.statistics()
        await trio.sleep(0.01)
        assert ptr in {a.ptr for a in sim.live_allocations}
        assert gpu.statistics().leases_held == 1
        del capsule
        gpu.statistics()
        await quiet(gpu)
        assert ptr not in {a.ptr for a in sim.live_allocations}


async def freed(sim, ptr: int) -> bool:
    """Checkpoint until ``ptr`` is no longer allocated on ``sim`` (False if it stays)."""
    for _ in range(400):
        if ptr not in {a.ptr for a in sim.live_allocations}:
            return True
        await trio.sleep(0.0005)
    return False


@pytest.mark.parametrize("batch", [False, True], ids=["marker_each", "batch_markers"])
async def test_a_release_the_handoff_sweeps_retires(batch):
    """The handoff's retirement pass sweeps after it recorded its markers; a
    release it finishes there records its own marker, so the pass that
    follows retires it even with batched markers and nothing else pending
    (it would otherwise stay in flight, and the memory allocated, for good)."""
    sim = SimDevice(batch_markers=batch)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        y = gpu.zeros(4, F4)
        await gpu.run(ops.fill(y, 1.0))
        await trio.testing.wait_all_tasks_blocked()
        ptr = x.ptr
        held = [capsule_of(x)]
        x.close()
        gpu.submit(ops.fill(y, 2.0))  # dropped: the handoff retires it, and sweeps
        held.clear()  # unconsumed: nothing sweeps before the handoff's pass
        assert await freed(sim, ptr), gpu.statistics()
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held) == (0, 0), st
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(4, 2.0, F4))
    assert sim.violations == []


@pytest.mark.parametrize("batch", [False, True], ids=["marker_each", "batch_markers"])
async def test_a_host_closure_that_closes_the_last_handle_releases_the_export(batch):
    """A host closure runs inside a retirement pass: closing an array there
    (its capsule dropped unconsumed) finishes the release at once, in stream
    order after the closure; work after the closure still runs, and the
    memory is freed."""
    sim = SimDevice(batch_markers=batch)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(4, F4)
        y = gpu.zeros(4, F4)
        await gpu.run(ops.fill(x, 1.0))
        ptr = x.ptr
        held = [capsule_of(x)]

        def fn() -> int:
            held.clear()
            x.close()
            return gpu.statistics().in_flight

        s = gpu.streams[0]
        closure = gpu.submit(ops.host_closure(fn), stream=s)
        after = gpu.submit(ops.fill(y, 3.0), stream=s)
        res = await closure.wait()
        await after.wait()
        assert res == 3  # the closure's submission, the fill after it, and the release
        assert await freed(sim, ptr), gpu.statistics()
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(4, 3.0, F4))
    assert sim.violations == []


async def test_a_sweep_inside_a_then_closure_leaves_the_release_to_the_loop(sim):
    """A then-closure runs while its submission is being enqueued: the sweep
    of a ``statistics()`` there releases the export but does not finish it
    in the middle of that submission; the loop finishes it, and the memory
    is freed once the submission's work and the release retired."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        y = gpu.zeros(4, F4)
        ptr = x.ptr
        held = [capsule_of(x)]
        x.close()
        seen: list[int] = []

        def nxt(_out: object) -> trio_cuda.DeviceOp[None]:
            held.clear()
            before = gpu.statistics().in_flight
            seen.append(before)
            return ops.fill(y, 2.0)

        await gpu.run(ops.fill(y, 1.0).then(nxt))
        assert len(seen) == 1
        await quiet(gpu)
        assert await freed(sim, ptr), gpu.statistics()
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(4, 2.0, F4))
