"""DeviceOp combinators, the ``trio_cuda.ops`` helpers, launch builders and
parameter marshalling, scheduling policies, statistics, futures and arrays,
on the simulated device."""

from __future__ import annotations

import threading
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers.guard import held
from tests.helpers.kernels import ADD, COPY, add, copy, saxpy, stub_source
from trio_cuda import In, InOut, KernelLaunch, Scalar, Slice, ops
from trio_cuda.testing import SimDevice

F4 = np.float32
N = 64


def host(n: int = N, start: float = 0.0) -> np.ndarray:
    return np.arange(n, dtype=F4) + F4(start)


def work_counts(sim: SimDevice) -> tuple[int, int, int]:
    s = sim.statistics()
    return (s.launches, s.copies, s.fills)


def launch_streams(sim: SimDevice, *names: str) -> list[int]:
    """Streams on which the launches of the named kernels executed, in order."""
    return [ev.stream for ev in sim.trace if ev.kind == "launch" and ev.label in names]


# --------------------------------------------------------------------------- then / map / zip


@pytest.mark.parametrize("pinned", [None, 2])
async def test_then_chains_on_the_same_stream_with_the_output_handle(sim, pinned):
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host(start=1))
        seen: list[Any] = []

        def second(out):
            seen.append(out)
            return add(out, 10.0)

        def third(out):
            seen.append(out)
            return saxpy(2.0, out, y)

        sim.clear_trace()
        stream = None if pinned is None else gpu.streams[pinned]
        fut = gpu.submit(add(x, 1.0).then(second).then(third), stream=stream)
        out = await fut.wait()
        assert out is y
        assert seen[0] is x
        assert seen[1] is x
        if pinned is not None:
            assert fut.stream is gpu.streams[pinned]
        # all three launches ran on the submission's stream, in chain order
        assert [ev.label for ev in sim.trace if ev.kind == "launch"] == ["add_f4", "add_f4", "saxpy"]
        assert launch_streams(sim, "add_f4", "saxpy") == [fut.stream.index] * 3
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 11)
        np.testing.assert_array_equal(await gpu.to_host(y), 2 * (host() + 11) + host(start=1))


async def test_then_closure_runs_at_submission_not_at_build(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        calls: list[Any] = []
        op = add(x, 1.0).then(lambda out: calls.append(out) or add(out, 1.0))
        assert calls == []  # lazy
        assert sim.statistics().launches == 0
        await gpu.run(op)
        await gpu.run(op)  # a chain is reusable: each submission runs the closure again
        assert calls == [x, x]
        np.testing.assert_array_equal(await gpu.to_host(x), np.full(N, 4, F4))


async def test_map_changes_the_output_without_gpu_work(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        before = work_counts(sim)
        assert await gpu.run(ops.value(21).map(lambda v: v * 2)) == 42
        assert work_counts(sim) == before
        out = await gpu.run(add(x, 1.0).map(lambda a: (a.shape, a)))
        assert out == ((N,), x)
        assert out[1] is x
        assert work_counts(sim) == (before[0] + 1, before[1], before[2])  # only the launch
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)
        calls = []
        op = ops.value(1).map(calls.append)
        assert calls == []  # map is lazy too
        assert await gpu.run(op) is None
        assert calls == [1]


async def test_zip_outputs_a_tuple_and_runs_on_one_stream(sim):
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host(start=5))
        z = gpu.zeros(N, F4)
        sim.clear_trace()
        fut = gpu.submit(trio_cuda.zip(add(x, 1.0), copy(y, z), ops.value("tag")))
        out = await fut.wait()
        assert isinstance(out, tuple)
        assert len(out) == 3
        assert out[0] is x
        assert out[1] is z
        assert out[2] == "tag"
        assert launch_streams(sim, "add_f4", "copy_f4") == [fut.stream.index] * 2
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)
        np.testing.assert_array_equal(await gpu.to_host(z), host(start=5))
        assert await gpu.run(trio_cuda.zip()) == ()
        nested = await gpu.run(trio_cuda.zip(ops.value(1), trio_cuda.zip(ops.value(2), ops.value(3))))
        assert nested == (1, (2, 3))


# --------------------------------------------------------------------------- shared


async def test_shared_executes_once_in_one_zip_and_across_submissions(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(N, F4)
        s = add(x, 1.0).shared()
        assert s.shared() is s
        launches = sim.statistics().launches
        out = await gpu.run(trio_cuda.zip(s, s, s.map(lambda a: a.size)))
        assert out == (x, x, N)
        assert out[0] is x
        assert sim.statistics().launches == launches + 1
        assert await gpu.run(s, stream=gpu.streams[1]) is x  # reused, not re-run
        assert await gpu.run(s.then(lambda a: add(a, 10.0))) is x
        assert sim.statistics().launches == launches + 2
        np.testing.assert_array_equal(await gpu.to_host(x), np.full(N, 11, F4))


async def test_shared_reuse_on_another_stream_orders_after_the_first(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        x = gpu.zeros(N, F4)
        z = gpu.zeros(N, F4)
        w = gpu.zeros(N, F4)
        await gpu.run(ops.value(None), stream=s0)
        await trio.testing.wait_all_tasks_blocked()
        ran = []
        # stream 0: a host closure (a gate the loop opens once it ran), then s
        gate = gpu.submit(ops.host_closure(ran.append, "gate"), stream=s0)
        s = add(x, 1.0).shared()
        first = gpu.submit(s, stream=s0)
        control = gpu.submit(add(w, 1.0), stream=s1)  # stream 1 itself is free
        # stream 1 reuses s: its own work (on z, no lease conflict) must wait for s
        second = gpu.submit(trio_cuda.zip(s, add(z, 1.0)), stream=s1)
        sim.run_until_idle()  # synchronously: the loop has not run the closure yet
        assert ran == []
        assert sim.peek(w.ptr, w.nbytes) == np.ones(N, F4).tobytes()
        assert sim.peek(z.ptr, z.nbytes) == bytes(z.nbytes)  # add(z) waits behind s
        assert not second.done()
        assert not first.done()
        assert (await second.wait()) == (x, z)
        assert ran == ["gate"]
        assert first.done()
        assert await gate.wait() is None
        await control.wait()
        order = [ev.label for ev in sim.trace if ev.kind in ("launch", "wait_marker")]
        i_s = order.index("add_f4")
        waits = [i for i, lab in enumerate(order) if lab.startswith("wait stream 0 marker")]
        assert waits
        assert min(waits) > i_s
        np.testing.assert_array_equal(await gpu.to_host(x), np.ones(N, F4))  # s ran once
        np.testing.assert_array_equal(await gpu.to_host(z), np.ones(N, F4))


# --------------------------------------------------------------------------- helpers


async def test_value_does_no_gpu_work(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        token = object()
        before = work_counts(sim)
        submitted = gpu.statistics().submitted
        assert await gpu.run(ops.value(token)) is token
        fut = gpu.submit(ops.value([1, 2]))
        assert await fut.wait() == [1, 2]
        assert work_counts(sim) == before
        assert gpu.statistics().submitted == submitted + 2
        assert repr(ops.value(3)) == "ops.value(3)"


async def test_copy_host_to_device_stages_the_source(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros((4, 8), F4)
        src = host(32).reshape(4, 8)
        expected = src.copy()
        with held(sim):
            fut = gpu.submit(ops.copy(x, src))
            src[:] = -1  # the caller may reuse its buffer as soon as submit returned
        assert await fut.wait() is x
        np.testing.assert_array_equal(await gpu.to_host(x), expected)


async def test_copy_device_to_host_fills_dst_on_completion(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        dst = np.full(N, -1, F4)
        with held(sim):
            fut = gpu.submit(ops.copy(dst, x))
            assert (dst == -1).all()
        assert await fut.wait() is dst
        np.testing.assert_array_equal(dst, host())
        out = np.empty(N, F4)
        assert await gpu.to_host(x, out=out) is out
        np.testing.assert_array_equal(out, host())


async def test_copy_device_to_device(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(host(), stream=gpu.streams[0])
        y = gpu.empty(N, F4, stream=gpu.streams[1])
        assert await gpu.run(ops.copy(y, x), stream=gpu.streams[1]) is y
        np.testing.assert_array_equal(await gpu.to_host(y), host())
        await gpu.run(ops.copy(x, x))  # to itself: a no-op copy
        np.testing.assert_array_equal(await gpu.to_host(x), host())
        s = sim.statistics()
        assert s.bytes_copied >= 3 * x.nbytes


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        ("u1", 255),
        ("i1", -7),
        ("?", True),
        ("i2", -2),
        ("u2", 65535),
        ("f2", 1.5),
        ("i4", -(2**31)),
        ("f4", 1.25),
        ("u4", 2**32 - 1),
        ("i8", 2**40 + 3),
        ("u8", 2**64 - 1),
        ("f8", -2.5e300),
    ],
)
async def test_fill_every_element_size(sim, dtype, value):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.empty((3, 5), dtype)
        assert await gpu.run(ops.fill(x, value)) is x
        got = await gpu.to_host(x)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, np.full((3, 5), value, dtype))
        full = gpu.full((3, 5), value, dtype)
        np.testing.assert_array_equal(await gpu.to_host(full), np.full((3, 5), value, dtype))
    assert sim.statistics().fills == 2


async def test_fill_of_a_structured_scalar_value_kind(sim):
    # a numpy scalar of the exact dtype is accepted as is
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.empty(4, np.int16)
        await gpu.run(ops.fill(x, np.int16(-300)))
        np.testing.assert_array_equal(await gpu.to_host(x), np.full(4, -300, np.int16))


async def test_host_closure_runs_on_the_loop_thread_in_stream_order(sim):
    loop_thread = threading.get_ident()
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(N, F4)
        seen = []

        def fn(a, b, *, _seen=seen):
            # work before it on the stream has completed: x already holds 1s
            _seen.append((threading.get_ident(), a, b, sim.peek(x.ptr, 4)))
            return a + b

        with held(sim):
            fut = gpu.submit(add(x, 1.0).then(lambda _: ops.host_closure(fn, 40, 2)))
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []  # the launch before it has not run
            assert gpu.statistics().host_closures_pending == 1
        assert await fut.wait() == 42
        assert seen == [(loop_thread, 40, 2, np.float32(1).tobytes())]
        assert gpu.statistics().host_closures_pending == 0
        # alone, and through `await op`
        assert await ops.host_closure(lambda: "alone") == "alone"


@pytest.mark.parametrize("gated", [0, 1])
async def test_work_waiting_on_a_gated_stream_completes(sim, gated):
    # Stream `gated` holds a host closure, then a write of x; the other stream
    # copies x, so it waits device-side for that write. Once the loop ran the
    # closure, everything completes and must be retired, whichever of the
    # two streams the completion-handoff task looks at first.
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        g, other = gpu.streams[gated], gpu.streams[1 - gated]
        x = gpu.zeros(N, F4, stream=g)
        y = gpu.zeros(N, F4, stream=other)
        await trio.testing.wait_all_tasks_blocked()
        closure = gpu.submit(ops.host_closure(lambda: "ran"), stream=g)
        gpu.submit(add(x, 1.0), stream=g)  # behind the closure's gate
        fut = gpu.submit(copy(x, y), stream=other)  # waits for add(x)
        with trio.move_on_after(5):
            assert await fut.wait() is y
        done = fut.done()
        sim.release()  # (wakes a handoff task that slept through the completion)
        assert done, "the copy completed on the device but was never retired"
        assert await closure.wait() == "ran"
        np.testing.assert_array_equal(await gpu.to_host(y), np.ones(N, F4))


async def test_host_closure_error_fails_its_submission(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:

        def boom():
            raise KeyError("closure")

        with pytest.raises(KeyError, match="closure"):
            await gpu.run(ops.host_closure(boom))
        assert gpu.statistics().failed == 1
        assert await gpu.run(ops.host_closure(lambda: 1)) == 1  # the stream goes on


# --------------------------------------------------------------------------- await op


async def test_await_op_uses_the_current_scope(sim):
    with pytest.raises(RuntimeError, match="no trio_cuda scope is open in this task"):
        await ops.value(1)
    async with trio_cuda.open_scope(device=sim) as outer:
        x = outer.zeros(N, F4)
        assert trio_cuda.current_scope() is outer
        assert await add(x, 1.0) is x
        async with trio_cuda.open_scope(device=sim) as inner:
            assert trio_cuda.current_scope() is inner
            before = (outer.statistics().submitted, inner.statistics().submitted)
            assert await ops.value(3) == 3
            assert (outer.statistics().submitted, inner.statistics().submitted) == (before[0], before[1] + 1)
            with pytest.raises(trio_cuda.KernelArgumentError, match="expected an array of this scope"):
                await add(x, 1.0)  # x belongs to the outer scope
        assert trio_cuda.current_scope() is outer
        assert await add(x, 1.0) is x

        async def in_task():
            assert trio_cuda.current_scope() is outer
            return await add(x, 1.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_task)
        np.testing.assert_array_equal(await outer.to_host(x), np.full(N, 3, F4))
    with pytest.raises(RuntimeError, match="no trio_cuda scope is open"):
        trio_cuda.current_scope()


# --------------------------------------------------------------------------- builder and marshalling


async def test_finalized_builder_is_an_immutable_reusable_launch(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(N, F4)
        b = ADD.builder().grid(1).block(N).arg(x).arg(F4(2)).arg(np.int32(N))
        launch = b.finalize_unchecked()
        assert type(launch) is KernelLaunch
        assert isinstance(launch, trio_cuda.DeviceOp)
        assert launch.kernel is ADD
        assert launch.config.grid == (1, 1, 1)
        assert launch.config.block == (N, 1, 1)
        with pytest.raises(AttributeError, match="immutable"):
            launch.prepared = None
        with pytest.raises(AttributeError, match="immutable"):
            launch.anything = 1
        with pytest.raises(TypeError, match="no public constructor"):
            KernelLaunch()
        assert await gpu.run(launch) is x  # the written array is the output
        assert await gpu.run(launch) is x
        # the builder stays inert and independent of what it produced
        b.arg(np.int32(0))
        assert len(launch.prepared.arena) == ADD.plan.size
        np.testing.assert_array_equal(await gpu.to_host(x), np.full(N, 4, F4))
        # and the typed path packs exactly the same arena
        assert ADD.launch(x, F4(2), N, grid=1, block=N).prepared.arena == launch.prepared.arena


async def test_arg_boxed_honours_alignment_in_the_arena(sim):
    got: list[tuple[Any, ...]] = []
    k = trio_cuda.Kernel.from_source(stub_source("raw"), "raw", params=[], reference=lambda *a: got.append(a))
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        launch = (
            k.builder()
            .arg(np.int8(-1))
            .arg_boxed(b"\x01\x02\x03", align=8)
            .arg(np.float64(2.5))
            .arg_boxed(bytearray(b"\xaa" * 16), align=16)
            .arg(x, access="read")
            .arg_boxed(memoryview(b"\x07"), align=1)
            .finalize_unchecked()
        )
        slots = [(s.offset, s.size, s.align) for s in launch.prepared.plan.slots]
        assert slots == [(0, 1, 1), (8, 3, 8), (16, 8, 8), (32, 16, 16), (48, 8, 8), (56, 1, 1)]
        assert launch.prepared.plan.size == 57
        arena = launch.prepared.arena
        assert len(arena) == 57
        assert arena[0:1] == np.int8(-1).tobytes()
        assert arena[1:8] == bytes(7)  # padding
        assert arena[8:11] == b"\x01\x02\x03"
        assert arena[16:24] == np.float64(2.5).tobytes()
        assert arena[32:48] == b"\xaa" * 16
        assert arena[48:56] == np.uint64(x.ptr).tobytes()
        assert arena[56:57] == b"\x07"
        assert await gpu.run(launch) is None  # it writes nothing
        ((a, raw1, f, raw2, view, raw3),) = got
        assert a == np.int8(-1)
        assert raw1 == b"\x01\x02\x03"
        assert f == np.float64(2.5)
        assert raw2 == b"\xaa" * 16
        assert raw3 == b"\x07"
        assert view.shape == (4,)
        assert not view.flags.writeable  # read access


@pytest.mark.parametrize(("len_dtype", "len_type"), [(None, np.uint64), ("u4", np.uint32), ("i8", np.int64)])
async def test_slice_passes_view_and_length(sim, len_dtype, len_type):
    got: list[tuple[Any, ...]] = []

    def ref(view, length, v):
        got.append((view.shape, view.dtype, type(length), int(length), view.flags.writeable))
        view[:length] += v

    params = [Slice("f4") if len_dtype is None else Slice("f4", len_dtype=len_dtype), Scalar("f4")]
    k = trio_cuda.Kernel.from_source(stub_source("slice_add"), "slice_add", params=params, reference=ref)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host(10))
        launch = k.launch(x, F4(3), grid=1, block=10)
        slots = launch.prepared.plan.slots
        ln = np.dtype(len_type).itemsize
        assert [(s.offset, s.size) for s in slots] == [(0, 8), (8, ln), (_up(8 + ln, 4), 4)]
        arena = launch.prepared.arena
        assert arena[0:8] == np.uint64(x.ptr).tobytes()
        assert arena[8 : 8 + ln] == np.asarray(10, dtype=len_type).tobytes()
        assert await gpu.run(launch) is x  # a Slice is written unless access="read"
        assert got == [((10,), np.dtype(F4), len_type, 10, True)]
        np.testing.assert_array_equal(await gpu.to_host(x), host(10) + 3)


def _up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


async def test_read_slice_gets_a_read_only_view_and_a_shared_lease(sim):
    got = []
    k = trio_cuda.Kernel.from_source(
        stub_source("sum"),
        "sum",
        params=[Slice("f4", access="read"), InOut("f4")],
        reference=lambda v, n, out: (got.append(v.flags.writeable), out.__setitem__(0, v[:n].sum())),
    )
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host(8))
        out = gpu.zeros(1, F4)
        assert await gpu.run(k.launch(x.as_readonly(), out, grid=1, block=1)) is out
        assert got == [False]
        np.testing.assert_array_equal(await gpu.to_host(out), [host(8).sum()])


async def test_structured_scalar_params(sim):
    pair = np.dtype([("a", "f4"), ("b", "f8")], align=True)
    assert pair.itemsize == 16
    got = []

    def ref(out, p, tail):
        got.append((p["a"], p["b"], tail))
        out[:] = p["a"] + p["b"] + tail

    k = trio_cuda.Kernel.from_source(
        stub_source("struct_k"), "struct_k", params=[InOut("f8"), Scalar(pair), Scalar("i1")], reference=ref
    )
    assert [(s.offset, s.size, s.align) for s in k.plan.slots] == [(0, 8, 8), (8, 16, 8), (24, 1, 1)]
    async with trio_cuda.open_scope(device=sim) as gpu:
        out = gpu.zeros(2, np.float64)
        launch = k.launch(out, (1.5, 2.25), np.int8(3), grid=1, block=1)
        arena = launch.prepared.arena
        assert arena[8:24] == np.array((1.5, 2.25), dtype=pair).tobytes()
        await gpu.run(launch)
        value = np.zeros((), dtype=pair)[()]
        value["a"], value["b"] = -1.0, 0.5
        await gpu.run(k.launch(out, value, np.int8(0), grid=1, block=1))
        assert got == [(F4(1.5), 2.25, 3), (F4(-1.0), 0.5, 0)]
        np.testing.assert_array_equal(await gpu.to_host(out), [-0.5, -0.5])


async def test_over_aligned_struct_scalar():
    aligned = np.dtype(np.dtype([("v", "f4")]), metadata={"align": 32})
    k = trio_cuda.Kernel.from_source(
        stub_source("s"), "s", params=[Scalar("u1"), Scalar(aligned), Scalar("u1")]
    )
    # C: sizeof of a struct is a multiple of its alignment, so the slot takes 32 bytes
    assert [(s.offset, s.size, s.align) for s in k.plan.slots] == [(0, 1, 1), (32, 32, 32), (64, 1, 1)]
    assert k.plan.size == 65
    arena = k.launch(np.uint8(1), (2.0,), np.uint8(3), grid=1, block=1).prepared.arena
    assert arena[0] == 1
    assert arena[1:32] == bytes(31)
    assert arena[32:36] == F4(2.0).tobytes()
    assert arena[36:64] == bytes(28)
    assert arena[64] == 3


# --------------------------------------------------------------------------- streams and policies


async def test_pinned_submissions_count_on_their_stream(sim):
    async with trio_cuda.open_scope(device=sim, streams=3) as gpu:
        x = gpu.zeros(N, F4)
        await trio.testing.wait_all_tasks_blocked()
        before = [s.statistics() for s in gpu.streams]
        for _ in range(5):
            fut = gpu.submit(add(x, 1.0), stream=gpu.streams[2])
            assert fut.stream is gpu.streams[2]
        sim.clear_trace()
        await gpu.run(add(x, 1.0), stream=gpu.streams[2])
        assert launch_streams(sim, "add_f4") == [2]
        await trio.testing.wait_all_tasks_blocked()
        after = [s.statistics() for s in gpu.streams]
        assert [a.submitted - b.submitted for a, b in zip(after, before, strict=True)] == [0, 0, 6]
        assert [a.completed - b.completed for a, b in zip(after, before, strict=True)] == [0, 0, 6]
        assert [a.in_flight for a in after] == [0, 0, 0]
        assert [a.index for a in after] == [0, 1, 2]
        assert isinstance(after[0], trio_cuda.StreamStatistics)
        assert gpu.streams[2].scope is gpu
        assert repr(gpu.streams[2]) == "<Stream 2 of sim:0>"
        np.testing.assert_array_equal(await gpu.to_host(x), np.full(N, 6, F4))


async def test_round_robin_takes_streams_in_turn(sim):
    async with trio_cuda.open_scope(device=sim, streams=3, policy=trio_cuda.RoundRobin()) as gpu:
        picks = [gpu.submit(ops.value(i)).stream.index for i in range(7)]
        assert picks == [0, 1, 2, 0, 1, 2, 0]
    async with trio_cuda.open_scope(device=sim, streams=2, policy=trio_cuda.RoundRobin()) as gpu:
        gpu.submit(ops.value(0), stream=gpu.streams[1])  # pinning does not advance the turn
        assert [gpu.submit(ops.value(i)).stream.index for i in range(3)] == [0, 1, 0]


async def test_least_loaded_picks_the_stream_with_least_in_flight(sim):
    async with trio_cuda.open_scope(device=sim, streams=3, policy=trio_cuda.LeastLoaded()) as gpu:
        x = gpu.zeros(N, F4)
        await trio.testing.wait_all_tasks_blocked()
        with held(sim):
            s0 = gpu.streams[0]
            gpu.submit(add(x, 1.0), stream=s0)
            gpu.submit(add(x, 1.0), stream=s0)
            picks = []
            for _ in range(4):
                y = gpu.zeros(4, F4, stream=gpu.streams[0])
                picks.append(gpu.submit(ops.fill(y, 1.0)).stream.index)
            # s0 holds the launches and the allocations; s1 and s2 take turns
            assert picks == [1, 2, 1, 2]
            assert [s.statistics().in_flight for s in gpu.streams] == [10, 2, 2]


async def test_custom_policy_sees_streams_and_op(sim):
    seen = []

    class Last:
        def choose(self, streams, op):
            seen.append((len(streams), op))
            return streams[-1]

    async with trio_cuda.open_scope(device=sim, streams=3, policy=Last()) as gpu:
        op = ops.value(7)
        fut = gpu.submit(op)
        assert fut.stream is gpu.streams[2]
        assert (3, op) in seen


# --------------------------------------------------------------------------- statistics and futures


async def test_scope_statistics_fields(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        st = gpu.statistics()
        assert isinstance(st, trio_cuda.ScopeStatistics)
        assert (st.backend, st.device, st.streams) == ("sim", "sim0", 2)
        assert (st.in_flight, st.submitted, st.completed, st.failed, st.quarantined) == (0, 0, 0, 0, 0)
        assert (st.live_allocations, st.live_bytes, st.leases_held, st.retained_bytes) == (0, 0, 0, 0)
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        st = gpu.statistics()
        assert (st.live_allocations, st.live_bytes) == (2, 2 * x.nbytes)
        with held(sim):
            gpu.submit(saxpy(2.0, x, y))
            gpu.submit(ops.host_closure(lambda: None), stream=gpu.streams[0])
            await trio.testing.wait_all_tasks_blocked()
            st = gpu.statistics()
            assert st.in_flight >= 1
            assert st.leases_held == 2
            assert st.retained_bytes == x.nbytes + y.nbytes
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                st.in_flight = 0
        await trio.testing.wait_all_tasks_blocked()
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held, st.retained_bytes, st.host_closures_pending) == (0, 0, 0, 0)
        assert st.completed == st.submitted
        sim.inject_fault("kernel_fault")
        failed = gpu.submit(add(x, 1.0))
        await trio.testing.wait_all_tasks_blocked()
        st = gpu.statistics()
        assert (st.failed, st.pending_errors) == (1, 1)
        with pytest.raises(trio_cuda.LaunchError):
            failed.wait_nowait()  # observed: no longer pending for the exit
        assert gpu.statistics().pending_errors == 0
        sim.inject_fault("completion_unknown")
        with pytest.raises(trio_cuda.CompletionUnknownError):
            await gpu.run(add(y, 1.0))
        st = gpu.statistics()
        assert (st.quarantined, st.quarantined_leases, st.quarantined_bytes) == (1, 1, y.nbytes)
        assert st.failed == 2
    st = gpu.statistics()
    assert (st.in_flight, st.pending_errors, st.live_allocations, st.live_bytes) == (0, 0, 1, y.nbytes)


async def test_future_before_and_after_completion(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        with held(sim):
            fut = gpu.submit(saxpy(2.0, x, y), stream=gpu.streams[1])
            assert isinstance(fut, trio_cuda.DeviceFuture)
            assert not fut.done()
            with pytest.raises(trio.WouldBlock):
                fut.wait_nowait()
            st = fut.statistics()
            assert isinstance(st, trio_cuda.FutureStatistics)
            expected = ("in_flight", 1, 2, x.nbytes + y.nbytes)
            assert (st.state, st.stream, st.leases, st.retained_bytes) == expected
            assert "in_flight" in repr(fut)
            with pytest.raises(TypeError, match="no public constructor"):
                trio_cuda.DeviceFuture()
        assert await fut.wait() is y
        assert fut.done()
        assert fut.wait_nowait() is y
        assert await fut.wait() is y  # awaiting again is fine
        st = fut.statistics()
        assert (st.state, st.stream, st.leases, st.retained_bytes) == ("done", 1, 0, 0)


@pytest.mark.parametrize("await_spin", [0.0, 1e-3])
async def test_wait_returns_only_once_the_future_is_done(await_spin):
    # After `await fut.wait()` returned the output, the future is done and
    # wait_nowait() gives the same output, whichever way wait() got it (the
    # inline spin of the CUDA backend, modelled by await_spin, included).
    # Trio runs ready tasks in a random order: repeat to leave no luck.
    sim = SimDevice(await_spin=await_spin)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(N, F4)
        for _ in range(50):
            fut = gpu.submit(add(x, 1.0))
            assert await fut.wait() is x
            assert fut.done()
            assert fut.wait_nowait() is x
            assert fut.statistics().state == "done"
        np.testing.assert_array_equal(await gpu.to_host(x), np.full(N, 50, F4))
    assert sim.violations == []


async def test_failed_future_reports_its_error_every_time(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        sim.inject_fault("kernel_fault")
        fut = gpu.submit(add(x, 1.0))
        with pytest.raises(trio_cuda.LaunchError, match="CUDA_ERROR_LAUNCH_FAILED") as first:
            await fut.wait()
        assert first.value.name == "CUDA_ERROR_LAUNCH_FAILED"
        assert first.value.code == 719
        with pytest.raises(trio_cuda.LaunchError):
            fut.wait_nowait()
        assert fut.done()
        assert fut.statistics().state == "failed"
        np.testing.assert_array_equal(await gpu.to_host(x), np.zeros(4, F4))  # the kernel did not run


# --------------------------------------------------------------------------- arrays


async def test_allocation_helpers(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        z = gpu.zeros(5)
        assert (z.shape, z.dtype) == ((5,), np.dtype(np.float64))  # float64 by default
        np.testing.assert_array_equal(await gpu.to_host(z), np.zeros(5))
        f = gpu.full([2, 3], 7, np.int16)
        assert (f.shape, f.dtype) == ((2, 3), np.dtype(np.int16))
        np.testing.assert_array_equal(await gpu.to_host(f), np.full((2, 3), 7, np.int16))
        e = gpu.empty(np.int64(4), "u1")
        assert (e.shape, e.dtype, e.nbytes) == ((4,), np.dtype(np.uint8), 4)
        empty0 = gpu.empty((0, 3), F4)
        assert (empty0.size, empty0.nbytes) == (0, 0)
        assert (await gpu.to_host(empty0)).shape == (0, 3)
        h = np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::-1]  # not contiguous
        d = await gpu.to_device(h)
        np.testing.assert_array_equal(await gpu.to_host(d), h)
        lst = await gpu.to_device([1.0, 2.0])
        assert lst.dtype == np.dtype(np.float64)
        np.testing.assert_array_equal(await gpu.to_host(lst), [1.0, 2.0])
        rec = np.dtype([("a", "u1"), ("b", "f8")])
        r = await gpu.to_device(np.array([(1, 2.5), (3, 4.5)], dtype=rec))
        got = await gpu.to_host(r)
        assert got.dtype == rec
        assert got.tolist() == [(1, 2.5), (3, 4.5)]


async def test_device_array_properties(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros((2, 3), F4)
        assert x.shape == (2, 3)
        assert x.dtype == np.dtype(F4)
        assert (x.size, x.nbytes, x.ndim, x.itemsize) == (6, 24, 2, 4)
        assert (x.readonly, x.closed, x.quarantined) == (False, False, False)
        assert x.scope is gpu
        assert isinstance(x.ptr, int)
        assert repr(x) == f"<DeviceArray shape=(2, 3) dtype=float32 at 0x{x.ptr:x}>"
        ro = x.as_readonly()
        assert (ro.readonly, ro.ptr, ro.shape, ro.dtype) == (True, x.ptr, x.shape, x.dtype)
        assert repr(ro) == f"<DeviceArray shape=(2, 3) dtype=float32 readonly at 0x{x.ptr:x}>"
        async with ro as same:
            assert same is ro
        assert ro.closed
        assert not x.closed
        assert repr(ro).endswith(f"readonly closed at 0x{x.ptr:x}>")
        np.testing.assert_array_equal(await gpu.to_host(x), np.zeros((2, 3), F4))
        x.close()
        x.close()  # idempotent
        assert x.closed
        with pytest.raises(TypeError, match="no public constructor"):
            trio_cuda.DeviceArray()
        y = gpu.zeros(1, F4)
    assert y.closed  # its scope exited


async def test_quarantined_array_property(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        sim.inject_fault("completion_unknown")
        with pytest.raises(trio_cuda.CompletionUnknownError):
            await gpu.run(add(x, 1.0))
        assert x.quarantined
        assert "quarantined" in repr(x)
        with pytest.raises(trio_cuda.CompletionUnknownError, match="quarantined"):
            await gpu.run(add(x, 1.0))
    assert len(sim.live_allocations) == 1  # never freed


async def test_kernel_facts():
    assert ADD.name == "add_f4"
    assert [type(p) for p in ADD.params] == [InOut, Scalar, Scalar]
    assert [type(p) for p in COPY.params] == [In, trio_cuda.Out, Scalar]
    assert [(s.offset, s.size) for s in ADD.plan.slots] == [(0, 8), (8, 4), (12, 4)]
    assert ADD.plan.size == 16
