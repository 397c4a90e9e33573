"""CUDA graphs on the simulated device (rule 8 of docs/lifetimes.rst).

``gpu.capture(op)`` records what the op enqueues without running it; each
``graph.launch()`` replays the recording as one device command. Work is put
really in flight with ``sim.hold()``; every test ends with the ``sim``
fixture's ``sim.violations == []`` check (memcheck runs at every replay).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import AsyncIterator

import attrs
import numpy as np
import pytest
import trio
from trio.testing import assert_checkpoints

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import ADD, add, copy, saxpy, stub_source
from trio_cuda import GraphCaptureError, ops, unsafe
from trio_cuda._core._graph import OpenGraphs
from trio_cuda.testing import SimDevice

F4 = np.float32
N = 64


def host(value: float | None = None, n: int = N) -> np.ndarray:
    if value is None:
        return np.arange(n, dtype=F4)
    return np.full(n, value, dtype=F4)


def live(sim: SimDevice) -> set[int]:
    return {a.ptr for a in sim.live_allocations}


async def settle(gpu: trio_cuda.ResourceScope) -> None:
    with trio.fail_after(5):
        while gpu.statistics().in_flight:  # noqa: ASYNC110 - polling public statistics
            await trio.sleep(0.001)


@contextlib.asynccontextmanager
async def releasing(sim: SimDevice) -> AsyncIterator[None]:
    """Release a held device on the way out, so that a failing assertion
    fails the test instead of hanging the scope's exit drain."""
    try:
        yield
    finally:
        if sim.held:
            sim.release()


async def until(predicate) -> None:
    with trio.fail_after(5):
        while not predicate():  # noqa: ASYNC110 - polling public state
            await trio.sleep(0.001)


# --------------------------------------------------------------------------- capture and replay


async def test_capture_records_without_running_and_replays_match_the_reference(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host(1.0))
        launches = sim.statistics().launches
        op = saxpy(2.0, x, y).then(lambda y: add(y, 0.5))
        graph = await gpu.capture(op)
        assert isinstance(graph, trio_cuda.CudaGraph)
        assert graph.output is y
        # capturing ran nothing, and holds no lease
        assert sim.statistics().launches == launches
        np.testing.assert_array_equal(await gpu.to_host(y), host(1.0))
        assert gpu.statistics().leases_held == 0
        st = graph.statistics()
        assert (st.operations, st.kernels, st.replays, st.in_flight) == (2, 2, 0, 0)
        assert (st.retained_allocations, st.retained_bytes) == (2, 2 * N * 4)

        expected = host(1.0)
        for _ in range(3):
            out = await gpu.run(graph.launch())
            assert out is y
            expected = 2.0 * host() + expected + 0.5  # the kernels' reference, in NumPy
        np.testing.assert_allclose(await gpu.to_host(y), expected)
        assert sim.graph_launches == 3
        assert sim.statistics().launches == launches + 6
        assert graph.statistics().replays == 3
        graph.close()


async def test_replay_through_submit_and_async_on(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(N, F4)
        async with await gpu.capture(add(x, 1.0)) as graph:
            futs = [gpu.submit(graph.launch()) for _ in range(4)]
            assert [await f.wait() for f in futs] == [x] * 4
            s = gpu.streams[0]
            await gpu.run(ops.value(None), stream=s)
            assert unsafe.async_on(graph.launch(), s) is x
            assert graph.statistics().in_flight == 0  # async_on retains nothing
            await gpu.run(ops.value(None), stream=s)  # stream order: after the unsafe replay
            np.testing.assert_array_equal(await gpu.to_host(x, stream=s), host(5.0))
        assert graph.closed


async def test_capture_of_host_to_device_copies_replays_the_captured_bytes(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        y = gpu.zeros(N, F4)
        data = host()
        graph = await gpu.capture(ops.copy(x, data).then(lambda x: copy(x, y)).then(lambda y: add(y, 1.0)))
        data[:] = -1  # the bytes were staged at capture
        assert await gpu.run(graph.launch()) is y
        np.testing.assert_array_equal(await gpu.to_host(y), host() + 1)
        np.testing.assert_array_equal(await gpu.to_host(x), host())
        await gpu.run(ops.fill(x, 7.0))
        await gpu.run(graph.launch())  # the copy runs again: x is overwritten
        np.testing.assert_array_equal(await gpu.to_host(x), host())
        graph.close()


async def test_fill_and_zip_are_captured(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = gpu.empty(N, F4)
        b = gpu.empty(N, np.int32)
        graph = await gpu.capture(trio_cuda.zip(ops.fill(a, 3.0), ops.fill(b, -2)).map(lambda t: t[::-1]))
        assert graph.output == (b, a)
        assert await gpu.run(graph.launch()) == (b, a)
        np.testing.assert_array_equal(await gpu.to_host(a), host(3.0))
        np.testing.assert_array_equal(await gpu.to_host(b), np.full(N, -2, np.int32))
        graph.close()


async def test_a_100_kernel_graph(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        xs = [gpu.zeros(N, F4) for _ in range(4)]
        await gpu.load(ADD)
        op: trio_cuda.DeviceOp = ops.value(None)
        for i in range(100):
            op = op.then(lambda _, i=i: add(xs[i % 4], float(i)))
        graph = await gpu.capture(op)
        st = graph.statistics()
        assert (st.operations, st.kernels, st.retained_allocations) == (100, 100, 4)
        before = sim.statistics().launches
        for _ in range(2):
            await gpu.run(graph.launch())
        assert sim.statistics().launches == before + 200
        for j, x in enumerate(xs):
            want = 2 * sum(float(i) for i in range(100) if i % 4 == j)
            np.testing.assert_array_equal(await gpu.to_host(x), host(want))
        graph.close()


async def test_replays_order_against_other_streams_through_leases():
    sim = SimDevice(kernel_time=0.005)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        y = gpu.zeros(N, F4, stream=s0)
        graph = await gpu.capture(copy(x, y), stream=s1)  # reads x, writes y
        await settle(gpu)
        sim.clear_trace()
        gpu.submit(add(x, 100.0), stream=s0)  # a writer of x in flight on s0
        await gpu.run(graph.launch(), stream=s1)  # RAW on x: waits device-side
        waits = [e for e in sim.trace if e.kind == "wait_marker" and e.stream == 1]
        assert waits, "the replay must wait for the writer on the other stream"
        np.testing.assert_array_equal(await gpu.to_host(y), host() + 100)
        # and the other way round: a later writer of y waits for the replay (WAW)
        sim.clear_trace()
        fut = gpu.submit(graph.launch(), stream=s1)
        await gpu.run(ops.fill(y, 1.0), stream=s0)
        await fut.wait()
        assert [e for e in sim.trace if e.kind == "wait_marker" and e.stream == 0]
        np.testing.assert_array_equal(await gpu.to_host(y), host(1.0))
        graph.close()
    assert sim.violations == []


def _views_op(kind: str, x: trio_cuda.DeviceArray) -> trio_cuda.DeviceOp:
    """Work between two views of one allocation: reads x[0:4], writes x[4:8]."""
    if kind == "copy":
        return ops.copy(x[4:8], x[0:4])
    if kind == "launch":
        return copy(x[0:4], x[4:8])  # the kernel: In src, Out dst
    return trio_cuda.zip(ops.fill(x[6:8], 2.0), ops.copy(x[4:6], x[0:2]))


@pytest.mark.parametrize("kind", ["copy", "launch", "zip"])
async def test_a_replay_leases_every_view_it_captured_order(sim, kind):
    """Rules 8 and 11: a graph of work between two views of one allocation
    takes, at every replay, the lease of each view it captured: a replay
    submitted after another stream's write of the source view waits for it
    device-side and copies the new data (before, a captured copy between
    views of one allocation leased only its destination)."""
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(np.arange(8, dtype=F4), stream=s0)
        graph = await gpu.capture(_views_op(kind, x), stream=s0)
        await settle(gpu)
        sim.clear_trace()
        sim.hold()
        async with releasing(sim):
            gpu.submit(ops.fill(x[0:4], 7.0), stream=s1)  # a writer of the source view, in flight
            replay = gpu.submit(graph.launch(), stream=s0)
        await replay.wait()
        assert [e for e in sim.trace if e.kind == "wait_marker" and e.stream == 0], (
            "the replay must wait for the other stream's writer of its source view"
        )
        got = await gpu.to_host(x)
        np.testing.assert_array_equal(got[0:4], 7.0)
        assert got[4] == 7.0, got  # copied after the write
        graph.close()
    assert sim.violations == []


@pytest.mark.parametrize("kind", ["copy", "launch", "zip"])
async def test_a_replay_leases_every_view_it_captured_error(kind):
    """The same under conflicts="error": the replay is refused with
    AccessConflictError, with nothing enqueued or retained."""
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(np.arange(8, dtype=F4), stream=s0)
        graph = await gpu.capture(_views_op(kind, x), stream=s0)
        await settle(gpu)
        sim.hold()
        async with releasing(sim):
            gpu.submit(ops.fill(x[0:4], 7.0), stream=s1)
            before = gpu.statistics()
            with pytest.raises(trio_cuda.AccessConflictError, match="read-after-write"):
                gpu.submit(graph.launch(), stream=s0)
            after = gpu.statistics()
            assert after.in_flight == before.in_flight
            assert after.leases_held == before.leases_held
            assert graph.statistics().replays == 0
        await gpu.run(ops.value(None), stream=s1)
        graph.close()
    assert sim.violations == []


async def test_capture_and_update_are_checkpoints(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        with assert_checkpoints():
            graph = await gpu.capture(add(x, 1.0))
        with assert_checkpoints():
            await graph.update(add(x, 2.0))
        with assert_checkpoints():
            async with graph:
                pass


async def test_pre_cancelled_capture_captures_nothing(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.capture(add(x, 1.0))
        assert cs.cancelled_caught
        assert sim.live_graphs == 0


# --------------------------------------------------------------------------- lifetimes


async def test_cancellation_while_a_replay_is_in_flight(sim):
    async with trio_cuda.open_scope(device=sim) as gpu, releasing(sim):
        x = await gpu.to_device(host())
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(saxpy(1.0, x, y))
        await settle(gpu)
        sim.hold()
        t0 = time.perf_counter()
        with trio.move_on_after(0.05) as cs:
            await gpu.run(graph.launch())
        assert cs.cancelled_caught
        assert time.perf_counter() - t0 < 1.0, "Cancelled must be raised promptly"
        # the scope kept the replay: its leases and the graph's retention hold
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held, st.retained_bytes) == (1, 2, 2 * N * 4)
        assert graph.statistics().in_flight == 1
        ptrs = {x.ptr, y.ptr}
        graph.close()
        x.close()
        assert ptrs <= live(sim)
        assert sim.live_graphs == 1
        sim.release()
        await settle(gpu)
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held) == (0, 0)
        assert graph.statistics().destroyed
        assert sim.live_graphs == 0
        assert x_freed(sim, ptrs, keep=y)
        np.testing.assert_array_equal(await gpu.to_host(y), host())
    assert sim.violations == []
    assert sim.live_allocations == []


def x_freed(sim: SimDevice, ptrs: set[int], keep: trio_cuda.DeviceArray) -> bool:
    """Only ``keep`` (still open) of ``ptrs`` is alive."""
    return ptrs & live(sim) == {keep.ptr}


async def test_closing_a_graph_with_replays_in_flight_defers_the_release(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu, releasing(sim):
        x = await gpu.to_device(host())
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(copy(x, y).then(lambda y: add(y, 1.0)))
        await settle(gpu)
        ptrs = {x.ptr, y.ptr}
        sim.hold()
        futs = [gpu.submit(graph.launch()) for _ in range(2)]
        x.close()
        y.close()
        graph.close()
        graph.close()  # idempotent
        assert graph.closed
        with pytest.raises(trio_cuda.ScopeClosedError, match="graph is closed"):
            graph.launch()
        st = graph.statistics()
        assert (st.in_flight, st.destroyed, st.retained_allocations) == (2, False, 2)
        gc.collect()
        assert ptrs <= live(sim)
        assert sim.live_graphs == 1
        assert sim.complete_next()  # the first replay ran
        await trio.sleep(0.01)
        assert ptrs <= live(sim), "the second replay still uses the memory"
        assert sim.live_graphs == 1
        sim.release()
        for f in futs:
            await f.wait()
        await settle(gpu)
        assert graph.statistics().destroyed
        assert sim.live_graphs == 0
        assert not (ptrs & live(sim))
    assert sim.violations == []


async def test_replay_after_the_input_handles_were_dropped(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(saxpy(3.0, x, y))
        x_ptr = x.ptr
        x.close()
        del x
        gc.collect()
        await settle(gpu)
        assert x_ptr in live(sim)  # the graph's own handle keeps it
        for _ in range(2):
            await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(y), 6.0 * host())
        graph.close()
        gc.collect()
        await until(lambda: x_ptr not in live(sim))  # the dropped handle's release is queued
        assert y.ptr in live(sim)
    assert sim.violations == []


async def test_scope_exit_closes_open_graphs(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        graph = await gpu.capture(add(x, 1.0))
        sim.hold()
        gpu.submit(graph.launch())
        trio.lowlevel.current_task().parent_nursery.start_soon(_release_later, sim)
    assert graph.closed
    assert graph.statistics().destroyed
    assert sim.live_graphs == 0
    assert sim.live_allocations == []
    assert sim.statistics().kernel_unloads == sim.statistics().kernel_loads


async def _release_later(sim: SimDevice) -> None:
    await trio.sleep(0.02)
    sim.release()


async def test_drain_timeout_leaks_a_graph_with_a_replay_in_flight(sim):
    with pytest.warns(ResourceWarning, match="drain_timeout"):
        async with trio_cuda.open_scope(device=sim, drain_timeout=0.02) as gpu:
            x = gpu.zeros(N, F4)
            await settle(gpu)
            graph = await gpu.capture(add(x, 1.0))
            sim.hold()
            gpu.submit(graph.launch())
    assert graph.closed
    assert not graph.statistics().destroyed  # quarantined with its replay: never destroyed
    assert sim.live_graphs == 1
    assert len(sim.live_allocations) == 1
    sim.release()  # the replay runs on memory that was never freed
    assert sim.violations == []


async def test_quarantined_arrays_fail_the_replay(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(copy(x, y))
        sim.inject_fault("completion_unknown")
        with pytest.raises(trio_cuda.CompletionUnknownError):
            await gpu.run(add(y, 1.0))
        graph_launches = sim.graph_launches
        with pytest.raises(trio_cuda.CompletionUnknownError, match="quarantined"):
            await gpu.run(graph.launch())
        assert sim.graph_launches == graph_launches
        assert gpu.statistics().quarantined == 1
        graph.close()
        assert graph.statistics().destroyed


async def test_a_replay_whose_completion_is_unknown_quarantines_its_leases(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        graph = await gpu.capture(add(x, 1.0))
        sim.inject_fault("completion_unknown")
        with pytest.raises(trio_cuda.CompletionUnknownError):
            await gpu.run(graph.launch())
        assert x.quarantined
        with pytest.raises(trio_cuda.CompletionUnknownError):
            await gpu.run(graph.launch())
        graph.close()
        assert not graph.statistics().destroyed  # the quarantined replay keeps it
        assert sim.live_graphs == 1


async def test_faults_hit_the_replay_not_the_capture(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        sim.inject_fault("kernel_fault")
        graph = await gpu.capture(add(x, 1.0))  # a capture runs nothing: the fault waits
        with pytest.raises(trio_cuda.LaunchError, match="kernel_fault"):
            await gpu.run(graph.launch())
        await gpu.run(graph.launch())  # not sticky
        np.testing.assert_array_equal(await gpu.to_host(x), host(1.0))
        sim.inject_fault("launch_error")
        with pytest.raises(trio_cuda.LaunchError, match="launch_error"):
            await gpu.run(graph.launch())
        await settle(gpu)
        assert gpu.statistics().leases_held == 0
        assert graph.statistics().in_flight == 0
        graph.close()
        assert sim.live_graphs == 0


# --------------------------------------------------------------------------- refusals


async def _assert_nothing_captured(sim: SimDevice, gpu: trio_cuda.ResourceScope) -> None:
    await settle(gpu)
    assert sim.live_graphs == 0
    st = gpu.statistics()
    assert (st.in_flight, st.leases_held) == (0, 0)
    for s in gpu.streams:
        assert internals.capture_of(s) is None  # the simulated capture was ended


async def test_allocation_during_capture_raises_and_leaves_nothing(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(N, F4)
        allocs = sim.statistics().allocations
        op = add(x, 1.0).then(lambda x: copy(x, gpu.empty(N, F4)))
        with pytest.raises(GraphCaptureError, match="allocat") as info:
            await gpu.capture(op)
        assert "add_f4" in str(info.value)  # names the op
        assert sim.statistics().allocations == allocs
        await _assert_nothing_captured(sim, gpu)
        # every stream is usable, and x was not kept by the failed capture
        for s in gpu.streams:
            await gpu.run(add(x, 1.0), stream=s)
        np.testing.assert_array_equal(await gpu.to_host(x), host(2.0))
        ptr = x.ptr
        x.close()
        await settle(gpu)
        assert ptr not in live(sim)
        # zeros/full allocate too
        with pytest.raises(GraphCaptureError):
            await gpu.capture(ops.value(None).then(lambda _: ops.fill(gpu.zeros(4, F4), 1.0)))
        await _assert_nothing_captured(sim, gpu)


async def test_synchronising_call_during_capture_raises(sim):
    async with trio_cuda.open_scope(device=sim, streams=1) as gpu:
        x = gpu.zeros(N, F4)
        out = np.empty(N, F4)
        s = gpu.streams[0]

        def sync_copy(x):
            unsafe.async_on(ops.copy(out, x), s)  # a synchronising copy on the capturing stream
            return add(x, 1.0)

        with pytest.raises(GraphCaptureError, match="synchronising"):
            await gpu.capture(add(x, 1.0).then(sync_copy), stream=s)
        await _assert_nothing_captured(sim, gpu)
        await gpu.run(add(x, 1.0), stream=s)
        np.testing.assert_array_equal(await gpu.to_host(x), host(1.0))


@pytest.mark.parametrize("what", ["host_closure", "to_host_copy", "unexecuted_shared", "submit"])
async def test_work_that_cannot_be_captured_is_refused(sim, what):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        if what == "host_closure":
            op = add(x, 1.0).then(lambda _: ops.host_closure(print))
            err, match = GraphCaptureError, "host_closure"
        elif what == "to_host_copy":
            op = add(x, 1.0).then(lambda x: ops.copy(np.empty(N, F4), x))
            err, match = GraphCaptureError, "host array"
        elif what == "unexecuted_shared":
            op = add(x, 1.0).shared()
            err, match = GraphCaptureError, "shared"
        else:
            op = add(x, 1.0).then(lambda x: gpu.submit(add(x, 1.0)) and add(x, 1.0))
            err, match = RuntimeError, "cannot submit"
        with pytest.raises(err, match=match):
            await gpu.capture(op)
        await _assert_nothing_captured(sim, gpu)
        np.testing.assert_array_equal(await gpu.to_host(x), host(0.0))


async def test_executed_shared_op_is_captured_as_an_ordering_dependency(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        x = gpu.zeros(N, F4, stream=s0)
        y = gpu.zeros(N, F4, stream=s0)
        shared = add(x, 5.0).shared()
        await gpu.run(shared, stream=s0)
        graph = await gpu.capture(shared.then(lambda x: copy(x, y)), stream=s1)
        await gpu.run(graph.launch(), stream=s1)
        np.testing.assert_array_equal(await gpu.to_host(y), host(5.0))  # the shared op ran once
        graph.close()


async def test_nested_graphs_are_refused_and_captures_from_two_tasks_serialize(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(N, F4)
        y = gpu.zeros(N, F4)
        inner = await gpu.capture(add(x, 1.0))
        with pytest.raises(GraphCaptureError, match="nested"):
            await gpu.capture(add(y, 1.0).then(lambda _: inner.launch()))
        assert sim.live_graphs == 1
        graphs: dict[str, trio_cuda.CudaGraph] = {}

        async def capture(name, op):
            graphs[name] = await gpu.capture(op)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(capture, "x", add(x, 10.0))
            nursery.start_soon(capture, "y", add(y, 20.0))
        await gpu.run(trio_cuda.zip(graphs["x"].launch(), graphs["y"].launch()))
        np.testing.assert_array_equal(await gpu.to_host(x), host(10.0))
        np.testing.assert_array_equal(await gpu.to_host(y), host(20.0))
        for g in (inner, *graphs.values()):
            g.close()
        assert sim.live_graphs == 0


async def test_bad_inputs(sim):
    async with trio_cuda.open_scope(device=sim) as gpu, trio_cuda.open_scope(device=sim) as other:
        x = gpu.zeros(N, F4)
        with pytest.raises(TypeError, match="op: expected a DeviceOp, got int"):
            await gpu.capture(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="finalize_unchecked"):
            await gpu.capture(ADD.builder().grid(1).block(1).arg(x).arg(F4(1)).arg(np.int32(N)))
        with pytest.raises(trio_cuda.KernelArgumentError, match="another scope"):
            await other.capture(add(x, 1.0))
        with pytest.raises(TypeError, match="no public constructor"):
            trio_cuda.CudaGraph()
        graph = await gpu.capture(add(x, 1.0))
        with pytest.raises(ValueError, match="scope that captured the graph"):
            await other.run(graph.launch())
        with pytest.raises(TypeError, match="update: op: expected a DeviceOp"):
            await graph.update("nope")  # type: ignore[arg-type]
        graph.close()
        with pytest.raises(trio_cuda.ScopeClosedError, match="graph is closed"):
            await graph.update(add(x, 1.0))
        assert sim.live_graphs == 0
    with pytest.raises(trio_cuda.ScopeClosedError, match="capture"):
        await gpu.capture(ops.value(None))


# --------------------------------------------------------------------------- update


async def test_update_copies_new_inputs_and_kernel_parameters(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        y = gpu.zeros(N, F4)

        def step(data, a):
            return ops.copy(x, data).then(lambda x: ops.fill(y, 0.0)).then(lambda _: saxpy(a, x, y))

        graph = await gpu.capture(step(host(), 2.0))
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(y), 2.0 * host())
        await graph.update(step(host(10.0), 3.0))
        assert graph.statistics().updates == 1
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(y), host(30.0))
        # the topology must match: the graph is unchanged when it does not
        with pytest.raises(GraphCaptureError, match="topology") as info:
            await graph.update(ops.copy(x, host(1.0)).then(lambda x: saxpy(1.0, x, y)))
        assert "ops.copy" in str(info.value)  # names the op
        with pytest.raises(GraphCaptureError, match="topology"):
            await graph.update(step(host(), 1.0).then(lambda y: add(y, 1.0)))
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(y), host(30.0))
        assert graph.statistics().updates == 1
        graph.close()


async def test_update_while_a_replay_is_in_flight(sim):
    async with trio_cuda.open_scope(device=sim) as gpu, releasing(sim):
        a = await gpu.to_device(host())
        b = await gpu.to_device(host(100.0))
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(copy(a, y))
        await settle(gpu)
        sim.hold()
        first = gpu.submit(graph.launch())
        await graph.update(copy(b, y))  # the replay in flight still copies a
        a_ptr = a.ptr
        a.close()
        st = graph.statistics()
        assert (st.in_flight, st.retained_allocations) == (1, 3)  # a (old) + b, y (new)
        assert a_ptr in live(sim)
        second = gpu.submit(graph.launch())
        assert sim.complete_next()
        await first.wait()
        np.testing.assert_array_equal(np.frombuffer(sim.peek(y.ptr, y.nbytes), F4), host())
        sim.release()
        await second.wait()
        await settle(gpu)
        assert a_ptr not in live(sim)  # the old generation went with its last replay
        assert graph.statistics().retained_allocations == 2
        np.testing.assert_array_equal(await gpu.to_host(y), host(100.0))
        graph.close()
    assert sim.violations == []


async def test_update_with_an_allocation_is_refused_and_keeps_the_graph(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        graph = await gpu.capture(add(x, 1.0))
        with pytest.raises(GraphCaptureError, match="allocat"):
            await graph.update(ops.value(None).then(lambda _: add(gpu.zeros(N, F4), 1.0)))
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(x), host(1.0))
        assert sim.live_graphs == 1
        graph.close()


async def test_graph_kernels_stay_loaded_until_the_graph_is_released(sim):
    k = trio_cuda.Kernel.from_source(
        stub_source("tmp"), "tmp", params=[trio_cuda.InOut("f4")], reference=lambda x: None
    )
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        graph = await gpu.capture(k.launch(y, grid=1, block=4))
        del k
        gc.collect()
        await gpu.run(graph.launch())
    # unloaded at exit only after the graph was closed (a later replay would be a violation)
    assert sim.statistics().kernel_unloads == sim.statistics().kernel_loads
    assert sim.violations == []


async def test_layouts_and_cross_scope_copies(sim):
    async with trio_cuda.open_scope(device=sim) as gpu, trio_cuda.open_scope(device=sim) as other:
        f = gpu.zeros((4, 3), F4, order="F")
        data = np.arange(12, dtype=F4).reshape(4, 3)
        graph = await gpu.capture(ops.copy(f, data))  # staged in the device array's order
        data[:] = 0
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(f), np.arange(12, dtype=F4).reshape(4, 3))
        graph.close()
        a = gpu.zeros(N, F4)
        b = other.zeros(N, F4)
        with pytest.raises(GraphCaptureError, match="two scopes"):
            await gpu.capture(ops.copy(a, b))
        await _assert_nothing_captured(sim, gpu)


async def test_instantiation_runs_in_a_worker_thread_where_the_driver_asks(sim, monkeypatch):
    import threading

    threads = []
    async with trio_cuda.open_scope(device=sim) as gpu:
        cls = type(internals.driver_of(gpu))
        instantiate = cls.instantiate

        def recording(self, graph):
            threads.append(threading.current_thread())
            return instantiate(self, graph)

        monkeypatch.setattr(cls, "instantiate", recording)
        caps = cls.capabilities
        monkeypatch.setattr(
            cls,
            "capabilities",
            property(lambda self: attrs.evolve(caps.fget(self), instantiate_in_thread=True)),
        )
        await gpu.load(ADD)
        x = gpu.zeros(N, np.float32)
        graph = await gpu.capture(add(x, 1.0))
        await gpu.run(graph.launch())
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(x), host(2.0))
        graph.close()
    assert len(threads) == 1
    assert threads[0] is not threading.main_thread()


# --------------------------------------------------------------------------- upload, and update off the loop

#: host seconds a simulated instantiation or update takes when the test needs
#: them to run (observably) in a worker thread, as on a GPU
SLOW_STEP = 0.2


async def _pending_in_driver(graph: trio_cuda.CudaGraph) -> None:
    """Wait until ``graph``'s pending update is inside the driver call."""
    await until(
        lambda: internals.pending_update(graph) is not None and internals.pending_update(graph).lock.locked()
    )


@pytest.mark.parametrize("graph_host_time", [0.0, 0.001])
async def test_each_graph_is_uploaded_once_before_its_first_replay(graph_host_time, monkeypatch):
    import threading

    from trio_cuda._backends.sim import SimContext

    sim = SimDevice(graph_host_time=graph_host_time)
    calls: list[tuple[str, threading.Thread]] = []
    for name in ("instantiate", "graph_upload", "graph_update"):
        real = getattr(SimContext, name)

        def recording(self, *args, _real=real, _name=name):
            calls.append((_name, threading.current_thread()))
            return _real(self, *args)

        monkeypatch.setattr(SimContext, name, recording)
    async with trio_cuda.open_scope(device=sim) as gpu:
        assert internals.driver_of(gpu).capabilities.instantiate_in_thread is (graph_host_time > 0)
        x = gpu.zeros(N, F4)
        assert sim.graph_uploads == 0
        graph = await gpu.capture(add(x, 1.0))
        # uploaded once, right after instantiation, before any replay was submitted
        assert sim.graph_uploads == 1
        assert internals.executable_of(graph).uploads == 1
        assert sim.graph_launches == 0
        assert [c[0] for c in calls] == ["instantiate", "graph_upload"]
        assert calls[0][1] is calls[1][1]  # in the same call (one worker thread where it runs off the loop)
        for _ in range(3):
            await gpu.run(graph.launch())
        await graph.update(add(x, 2.0))
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(x), host(5.0))
        assert sim.graph_uploads == 1  # replays and updates upload nothing
        assert internals.executable_of(graph).uploads == 1
        assert [c[0] for c in calls] == ["instantiate", "graph_upload", "graph_update"]
        off_loop = {c[1] is not threading.current_thread() for c in calls}
        assert off_loop == {graph_host_time > 0}
        async with await gpu.capture(add(x, 1.0)):
            assert sim.graph_uploads == 2
        graph.close()
    assert sim.live_graphs == 0
    assert sim.violations == []


@pytest.mark.parametrize("graph_host_time", [0.0, 0.001])
async def test_a_failed_upload_raises_the_driver_error_and_leaks_nothing(graph_host_time, monkeypatch):
    from trio_cuda._backends.sim import SimContext

    sim = SimDevice(graph_host_time=graph_host_time)
    real_upload = SimContext.graph_upload

    def failing(self, graph_exec):
        raise trio_cuda.CudaError(999, "CUDA_ERROR_UNKNOWN", "injected", call="cuGraphUpload")

    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = gpu.zeros(N, F4)
        await settle(gpu)
        monkeypatch.setattr(SimContext, "graph_upload", failing)
        with pytest.raises(trio_cuda.CudaError, match="cuGraphUpload") as info:
            await gpu.capture(saxpy(2.0, x, y))
        assert type(info.value) is trio_cuda.CudaError
        assert info.value.name == "CUDA_ERROR_UNKNOWN"
        assert sim.live_graphs == 0  # the executable graph was destroyed
        assert sim.graph_uploads == 0
        # nothing retained: the arrays go as soon as their handles are closed
        x_ptr = x.ptr
        x.close()
        await until(lambda: x_ptr not in live(sim))
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held) == (0, 0)
        monkeypatch.setattr(SimContext, "graph_upload", real_upload)
        graph = await gpu.capture(add(y, 1.0))
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(y), host(1.0))
        graph.close()
    assert sim.live_graphs == 0
    assert sim.live_allocations == []
    assert sim.violations == []


async def test_update_does_not_block_the_loop():
    sim = SimDevice(graph_host_time=SLOW_STEP)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.005)
            ticks += 1

    async with trio_cuda.open_scope(device=sim) as gpu, trio.open_nursery() as nursery:
        x = gpu.zeros(N, F4)
        y = gpu.zeros(N, F4)
        nursery.start_soon(ticker)
        t0, before = time.perf_counter(), ticks
        graph = await gpu.capture(add(x, 1.0))  # instantiated off the loop as well
        assert time.perf_counter() - t0 >= SLOW_STEP
        assert ticks - before >= 5, "the loop kept running while the graph was instantiated"
        t0, before = time.perf_counter(), ticks
        await graph.update(add(y, 2.0))
        assert time.perf_counter() - t0 >= SLOW_STEP
        assert ticks - before >= 5, "the loop kept running while the driver updated the graph"
        assert graph.output is y
        assert internals.pending_update(graph) is None
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(y), host(2.0))
        np.testing.assert_array_equal(await gpu.to_host(x), host(0.0))
        nursery.cancel_scope.cancel()
        graph.close()
    assert sim.live_graphs == 0
    assert sim.live_allocations == []
    assert sim.violations == []


async def test_cancelling_an_update_never_leaves_it_half_done():
    sim = SimDevice(graph_host_time=SLOW_STEP)
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = await gpu.to_device(host())
        b = await gpu.to_device(host(100.0))
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(copy(a, y))

        # cancelled before anything was recorded: the graph is unchanged
        with trio.CancelScope() as cs:
            cs.cancel()
            await graph.update(copy(b, y))
        assert cs.cancelled_caught
        assert graph.statistics().updates == 0
        assert internals.pending_update(graph) is None

        # cancelled while the driver works: the update is carried through and applied
        t0 = time.perf_counter()
        with trio.move_on_after(0.02) as cs:
            await graph.update(copy(b, y))
        assert cs.cancel_called
        assert time.perf_counter() - t0 >= SLOW_STEP
        assert graph.statistics().updates == 1
        assert internals.pending_update(graph) is None
        assert not internals.extension_of(gpu, OpenGraphs).updating
        a_ptr = a.ptr
        a.close()  # only the old generation still held a
        await until(lambda: a_ptr not in live(sim))
        assert await gpu.run(graph.launch()) is y
        np.testing.assert_array_equal(await gpu.to_host(y), host(100.0))

        # cancelled while waiting for another update in progress: nothing recorded
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.update, copy(y, b))
            await _pending_in_driver(graph)
            first = internals.pending_update(graph)
            with trio.move_on_after(0.02) as cs:
                await graph.update(copy(b, y))
            assert cs.cancelled_caught
            assert internals.pending_update(graph) is first  # the cancelled one recorded nothing
        assert graph.statistics().updates == 2
        assert graph.statistics().retained_allocations == 2  # y and b: one generation
        graph.close()
    assert sim.live_graphs == 0
    assert sim.live_allocations == []
    assert sim.violations == []


async def test_a_replay_during_an_update_runs_before_or_after_the_driver_step():
    sim = SimDevice(graph_host_time=SLOW_STEP)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(N, F4)
        graph = await gpu.capture(ops.fill(x, 1.0))

        # The driver step has not started (no worker thread free): the replay
        # goes first and runs the current generation.
        limiter = trio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = 1
        async with trio.open_nursery() as nursery, limiter:
            nursery.start_soon(graph.update, ops.fill(x, 2.0))
            await trio.testing.wait_all_tasks_blocked()
            assert internals.pending_update(graph) is not None
            assert not internals.pending_update(graph).ran
            await gpu.run(graph.launch())
            np.testing.assert_array_equal(await gpu.to_host(x), host(1.0))
            assert graph.statistics().updates == 0
            # the limiter's token is given back: the update proceeds
        assert graph.statistics().updates == 1
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(x), host(2.0))

        # The driver step is running: the replay waits for it, then runs the new work
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.update, ops.fill(x, 3.0))
            await _pending_in_driver(graph)
            t0 = time.perf_counter()
            fut = gpu.submit(graph.launch(), stream=gpu.streams[1])
            assert time.perf_counter() - t0 > 0.01  # it waited for the driver (a replay must not overlap it)
            assert internals.pending_update(graph) is None  # the replay applied the update
            assert graph.statistics().updates == 2
            await fut.wait()
            np.testing.assert_array_equal(await gpu.to_host(x), host(3.0))
        graph.close()
    assert sim.live_graphs == 0
    assert sim.live_allocations == []
    assert sim.violations == []


@pytest.mark.parametrize("graph_host_time", [0.0, 0.01])
async def test_update_while_a_replay_is_in_flight_on_or_off_the_loop(graph_host_time):
    sim = SimDevice(graph_host_time=graph_host_time)
    async with trio_cuda.open_scope(device=sim) as gpu, releasing(sim):
        a = await gpu.to_device(host())
        b = await gpu.to_device(host(100.0))
        y = gpu.zeros(N, F4)
        graph = await gpu.capture(copy(a, y))
        await settle(gpu)
        sim.hold()
        first = gpu.submit(graph.launch())
        await graph.update(copy(b, y))  # the replay in flight still copies a
        a_ptr = a.ptr
        a.close()
        st = graph.statistics()
        assert (st.in_flight, st.retained_allocations, st.updates) == (1, 3, 1)
        assert a_ptr in live(sim)
        second = gpu.submit(graph.launch())
        assert sim.complete_next()
        await first.wait()
        np.testing.assert_array_equal(np.frombuffer(sim.peek(y.ptr, y.nbytes), F4), host())
        sim.release()
        await second.wait()
        await settle(gpu)
        assert a_ptr not in live(sim)
        assert graph.statistics().retained_allocations == 2
        np.testing.assert_array_equal(await gpu.to_host(y), host(100.0))
        graph.close()
    assert sim.live_allocations == []
    assert sim.violations == []


async def test_updates_of_one_graph_run_one_at_a_time():
    sim = SimDevice(graph_host_time=SLOW_STEP)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        graph = await gpu.capture(ops.fill(x, 1.0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.update, ops.fill(x, 2.0))
            await _pending_in_driver(graph)
            first = internals.pending_update(graph)
            nursery.start_soon(graph.update, ops.fill(x, 3.0))  # waits for the first
            await trio.testing.wait_all_tasks_blocked()
            assert internals.pending_update(graph) is first
        assert graph.statistics().updates == 2
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(x), host(3.0))
        graph.close()
    assert sim.live_graphs == 0
    assert sim.violations == []


async def test_a_refused_update_off_the_loop_keeps_the_graph():
    sim = SimDevice(graph_host_time=0.01)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        z = gpu.zeros(N, F4)
        graph = await gpu.capture(add(x, 1.0))
        with pytest.raises(GraphCaptureError, match="topology"):
            await graph.update(add(z, 1.0).then(lambda z: add(z, 1.0)))
        assert internals.pending_update(graph) is None
        st = graph.statistics()
        assert (st.updates, st.retained_allocations) == (0, 1)  # z was not kept
        await gpu.run(graph.launch())
        np.testing.assert_array_equal(await gpu.to_host(x), host(1.0))
        graph.close()
    assert sim.live_graphs == 0
    assert sim.live_allocations == []
    assert sim.violations == []


async def test_closing_a_graph_while_it_updates_defers_the_destroy():
    sim = SimDevice(graph_host_time=SLOW_STEP)
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = gpu.zeros(N, F4)
        b = gpu.zeros(N, F4)
        graph = await gpu.capture(add(a, 1.0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.update, add(b, 1.0))
            await _pending_in_driver(graph)
            graph.close()
            assert graph.closed
            with pytest.raises(trio_cuda.ScopeClosedError, match="graph is closed"):
                graph.launch()
            # the worker thread still uses the executable graph
            assert not graph.statistics().destroyed
            assert sim.live_graphs == 1
        assert graph.statistics().destroyed
        assert sim.live_graphs == 0
        assert graph.statistics().retained_allocations == 0  # both generations released
        ptrs = {a.ptr, b.ptr}
        a.close()
        b.close()
        await until(lambda: not (ptrs & live(sim)))
    assert sim.violations == []


async def test_scope_exit_waits_for_an_update_in_progress():
    sim = SimDevice(graph_host_time=SLOW_STEP)
    async with trio.open_nursery() as outer:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = gpu.zeros(N, F4)
            graph = await gpu.capture(add(x, 1.0))
            outer.start_soon(graph.update, add(x, 2.0))  # a task outside the scope
            await _pending_in_driver(graph)
        assert internals.pending_update(graph) is None
        assert graph.statistics().updates == 1
        assert graph.closed
        assert graph.statistics().destroyed
        assert sim.live_graphs == 0
        assert sim.live_allocations == []
    assert sim.violations == []


async def test_drain_timeout_leaks_a_graph_whose_update_still_runs():
    sim = SimDevice(graph_host_time=SLOW_STEP)
    async with trio.open_nursery() as outer:
        with pytest.warns(ResourceWarning, match="graph update"):
            async with trio_cuda.open_scope(device=sim, drain_timeout=0.01) as gpu:
                x = gpu.zeros(N, F4)
                graph = await gpu.capture(add(x, 1.0))
                outer.start_soon(graph.update, add(x, 2.0))
                await _pending_in_driver(graph)
        assert graph.closed
        assert not graph.statistics().destroyed  # leaked with the scope's driver state
        assert sim.live_graphs == 1
    # the update returned (the outer nursery waited for it) and touched nothing
    assert internals.pending_update(graph) is None
    assert not graph.statistics().destroyed
    assert sim.live_graphs == 1
    assert sim.violations == []


async def test_an_update_still_running_at_an_abandoned_exit_leaks_the_driver_state():
    # The exit's drain gives up (drain_timeout=0) while another task's graph
    # update runs its driver step in a worker thread: that thread uses the
    # executable graph and the driver context, so the scope must not close
    # its driver (nor destroy streams or unload modules) under it.
    class Closing:
        def __init__(self, inner):
            self.inner = inner
            self.closed = 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def close(self):
            self.closed += 1
            self.inner.close()

    sim = SimDevice(graph_host_time=SLOW_STEP)
    manager = trio_cuda.open_scope(device=sim, drain_timeout=0)
    gpu = await manager.__aenter__()
    spy = Closing(internals.driver_of(gpu))
    internals.set_driver(gpu, spy)
    a = await gpu.to_device(host())
    y = gpu.zeros(N, F4)
    graph = await gpu.capture(copy(a, y))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(graph.update, copy(a, y))
        await until(lambda: bool(internals.extension_of(gpu, OpenGraphs).updating))
        with pytest.warns(ResourceWarning, match="graph update"):
            await manager.__aexit__(None, None, None)
        assert gpu.closed
        assert spy.closed == 0  # leaked with the thread that may still use it
    # the update's task ended (its step finished in its thread)
    assert not internals.extension_of(gpu, OpenGraphs).updating
