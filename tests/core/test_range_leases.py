"""Rule 11: leases cover byte ranges.

Disjoint views of one allocation never conflict, on any stream, in either
conflict mode; views whose extents overlap conflict exactly as whole arrays
do. Every path that takes leases is checked: typed launches and ``Slice``
arguments, builders, copies, fills, downloads, graphs, exports, ``borrow()``
and cross-device copies. Freeing stays per allocation.
"""

import gc

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import held
from tests.helpers.kernels import ADD, COPY, add, copy
from trio_cuda import AccessConflictError, Slice, ops
from trio_cuda.testing import SimDevice, SimHost

F4 = np.float32
N = 8
H = N // 2


def _arange(n=N):
    return np.arange(n, dtype=F4)


def _kernels(sim):
    return [e for e in sim.trace if e.kind == "launch"]


def _overlap(a, b):
    return min(a.t_end, b.t_end) - max(a.t_start, b.t_start)


@pytest.mark.parametrize("conflicts", ["order", "error"])
async def test_disjoint_halves_are_in_flight_at_once_on_two_streams(sim, conflicts):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts=conflicts) as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(_arange())
        with held(sim):
            f0 = gpu.submit(add(x[:H], 1.0), stream=s0)
            f1 = gpu.submit(add(x[H:], 2.0), stream=s1)
            # both in flight, neither waits for the other (no device-side wait)
            assert gpu.statistics().in_flight == 2
            assert gpu.statistics().leases_held == 2
            kinds = [[c.kind for c in internals.queued_commands(s)] for s in gpu.streams]
            assert "wait_marker" not in kinds[0] + kinds[1], kinds
            assert internals.allocation_of(x).active == 2
        await f0.wait()
        await f1.wait()
        np.testing.assert_array_equal(await gpu.to_host(x), _arange() + np.r_[[1] * H, [2] * H])
        assert gpu.statistics().leases_held == 0


async def test_the_simulator_shows_disjoint_halves_overlapping_in_time():
    sim = SimDevice(kernel_time=0.02)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(_arange())
        sim.clear_trace()
        a = gpu.submit(add(x[:H], 1.0), stream=gpu.streams[0])
        b = gpu.submit(add(x[H:], 1.0), stream=gpu.streams[1])
        await a.wait()
        await b.wait()
        k0, k1 = _kernels(sim)
        assert k0.stream != k1.stream
        assert _overlap(k0, k1) > 0.015, (k0, k1)  # they ran together
        # overlapping halves on two streams are ordered: no overlap in time
        sim.clear_trace()
        a = gpu.submit(add(x[: H + 1], 1.0), stream=gpu.streams[0])
        b = gpu.submit(add(x[H:], 1.0), stream=gpu.streams[1])
        await a.wait()
        await b.wait()
        k0, k1 = _kernels(sim)
        assert k1.t_start >= k0.t_end, (k0, k1)
    assert sim.violations == []
    assert sim.live_allocations == []


@pytest.mark.parametrize(
    ("first", "second", "name"),
    [
        ("write", "write", "write-after-write"),
        ("write", "read", "read-after-write"),
        ("read", "write", "write-after-read"),
    ],
)
async def test_overlapping_extents_conflict_as_whole_arrays_do(sim, first, second, name):
    def op(view, mode):
        return ops.fill(view, 1.0) if mode == "write" else ops.copy(np.zeros(view.shape, F4), view)

    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        x = await gpu.to_device(_arange())
        with held(sim):
            f = gpu.submit(op(x[1:5], first), stream=gpu.streams[0])
            before = gpu.statistics()
            with pytest.raises(
                AccessConflictError, match=rf"{name} conflict.*bytes \[4, 20\).*bytes \[16, 24\)"
            ):
                gpu.submit(op(x[4:6], second), stream=gpu.streams[1])
            assert gpu.statistics() == before  # nothing enqueued, nothing retained
            # one byte apart is enough: [20, 32) touches none of [4, 20)
            g = gpu.submit(op(x[5:], second), stream=gpu.streams[1])
            # the same stream never conflicts
            h = gpu.submit(op(x[1:3], second), stream=gpu.streams[0])
        for fut in (f, g, h):
            await fut.wait()


async def test_reads_of_overlapping_views_never_conflict(sim):
    async with trio_cuda.open_scope(device=sim, streams=3, conflicts="error") as gpu:
        x = await gpu.to_device(_arange())
        with held(sim):
            futs = [
                gpu.submit(ops.copy(np.zeros(6, F4), x[i : i + 6]), stream=gpu.streams[i]) for i in range(3)
            ]
            assert gpu.statistics().in_flight == 3
        for f in futs:
            await f.wait()


async def test_overlapping_write_is_ordered_under_order_mode(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(_arange())
        with held(sim):
            f0 = gpu.submit(add(x[:5], 1.0), stream=gpu.streams[0])
            f1 = gpu.submit(add(x[4:], 10.0), stream=gpu.streams[1])  # overlaps at x[4]: waits
            assert internals.queued_commands(gpu.streams[1])[0].kind == "wait_marker"
        await f1.wait()
        assert f0.done()
        np.testing.assert_array_equal(
            await gpu.to_host(x), _arange() + np.array([1, 1, 1, 1, 11, 10, 10, 10], F4)
        )


async def test_launch_reading_one_half_and_writing_the_other(sim):
    # one submission, two extents of one allocation: a read and a write
    async with trio_cuda.open_scope(device=sim, streams=3, conflicts="error") as gpu:
        x = await gpu.to_device(_arange())
        with held(sim):
            f = gpu.submit(copy(x[:H], x[H:]), stream=gpu.streams[0])
            assert internals.allocation_of(x).active == 1  # one lease count per allocation and submission
            # reading the read half elsewhere is fine; writing it is write-after-read
            g = gpu.submit(ops.copy(np.zeros(H, F4), x[:H]), stream=gpu.streams[1])
            with pytest.raises(AccessConflictError, match="write-after-read"):
                gpu.submit(ops.fill(x[:H], 0.0), stream=gpu.streams[2])
            # the written half: read-after-write
            with pytest.raises(AccessConflictError, match="read-after-write"):
                gpu.submit(ops.copy(np.zeros(H, F4), x[H:]), stream=gpu.streams[2])
        await f.wait()
        await g.wait()
        np.testing.assert_array_equal(await gpu.to_host(x), np.r_[_arange()[:H], _arange()[:H]])


async def test_slice_arguments_and_builders_lease_their_views(sim):
    scale = trio_cuda.Kernel.from_source(
        'extern "C" __global__ void twice(float* x, unsigned long long n) {}',
        "twice",
        params=[Slice("f4", access="write")],
        reference=lambda x, n: x.__imul__(2),
    )
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        x = await gpu.to_device(_arange())
        with held(sim):
            a = gpu.submit(scale.launch(x[:H], grid=1, block=1), stream=gpu.streams[0])
            built = ADD.builder().grid(1).block(1).arg(x[H:]).arg(F4(5)).arg(np.int32(H)).finalize_unchecked()
            b = gpu.submit(built, stream=gpu.streams[1])
            with pytest.raises(AccessConflictError):
                gpu.submit(scale.launch(x[H - 1 : H + 1], grid=1, block=1), stream=gpu.streams[1])
        await a.wait()
        await b.wait()
        np.testing.assert_array_equal(await gpu.to_host(x), np.r_[_arange()[:H] * 2, _arange()[H:] + 5])


async def test_a_whole_array_write_supersedes_the_chunks_it_covers(sim):
    async with trio_cuda.open_scope(device=sim, streams=3) as gpu:
        x = await gpu.to_device(_arange())
        with held(sim):
            gpu.submit(ops.fill(x[:H], 1.0), stream=gpu.streams[0])
            gpu.submit(ops.fill(x[H:], 2.0), stream=gpu.streams[1])
            assert len(internals.allocation_of(x).writers) == 2
            whole = gpu.submit(ops.fill(x, 3.0), stream=gpu.streams[2])  # waits for both
            assert [c.kind for c in internals.queued_commands(gpu.streams[2])][:2] == [
                "wait_marker",
                "wait_marker",
            ]
            assert list(internals.allocation_of(x).writers) == [
                internals.submission_of(whole)
            ]  # the chunks' entries are covered
            # a later reader of one chunk waits only for the whole write
            r = gpu.submit(ops.copy(np.zeros(H, F4), x[:H]), stream=gpu.streams[0])
        await r.wait()
        np.testing.assert_array_equal(await gpu.to_host(x), np.full(N, 3, F4))


async def test_zero_size_views_never_conflict(sim):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        x = await gpu.to_device(_arange())
        with held(sim):
            f = gpu.submit(ops.fill(x, 1.0), stream=gpu.streams[0])
            g = gpu.submit(ops.fill(x[3:3], 2.0), stream=gpu.streams[1])
            assert internals.allocation_of(x).active == 2  # it still retains the allocation
        await f.wait()
        await g.wait()


async def test_default_policy_follows_the_writer_of_the_same_chunk(sim):
    # "upload chunk i, then a kernel on chunk i": each kernel follows its own
    # chunk's upload, and the chunks spread over the streams
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        y = gpu.empty(4 * H, F4)
        with held(sim):
            uploads = [gpu.submit(ops.copy(y[i * H : (i + 1) * H], _arange(H) + i)) for i in range(4)]
            kernels = [gpu.submit(add(y[i * H : (i + 1) * H], 1.0)) for i in range(4)]
            assert sorted(f.stream.index for f in uploads) == [0, 1, 2, 3]
            assert [f.stream for f in kernels] == [f.stream for f in uploads]
            assert not any(c.kind == "wait_marker" for s in gpu.streams for c in internals.queued_commands(s))
        out = await gpu.to_host(y)
        np.testing.assert_array_equal(out, np.concatenate([_arange(H) + i + 1 for i in range(4)]))


async def test_graph_replays_lease_only_the_captured_views(sim):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        x = await gpu.to_device(_arange())
        graph = await gpu.capture(add(x[:H], 1.0).then(lambda _: add(x[:2], 1.0)), stream=gpu.streams[0])
        assert graph.statistics().retained_allocations == 1
        with held(sim):
            r = gpu.submit(graph.launch(), stream=gpu.streams[0])
            other = gpu.submit(add(x[H:], 5.0), stream=gpu.streams[1])  # disjoint: runs beside it
            with pytest.raises(AccessConflictError, match="read-after-write"):
                gpu.submit(ops.copy(np.zeros(1, F4), x[1:2]), stream=gpu.streams[1])
        await r.wait()
        await other.wait()
        expect = _arange() + np.array([2, 2, 1, 1, 5, 5, 5, 5], F4)
        np.testing.assert_array_equal(await gpu.to_host(x), expect)
        graph.close()


async def test_an_export_of_a_view_leases_that_view(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = await a.to_device(_arange())
        y = trio_cuda.borrow(x[:H], "write", scope=b)  # a DLPack export of the head
        await b.run(ops.fill(y, 7.0))
        # the tail is not exported: a's work on it goes on
        await a.run(ops.fill(x[H:], 1.0))
        # the head is, and a's work on it cannot order after the consumer's
        with pytest.raises(AccessConflictError, match="DLPack export"):
            a.submit(ops.fill(x[H - 1 :], 0.0))
        y.close()
        np.testing.assert_array_equal(await a.to_host(x), [7, 7, 7, 7, 1, 1, 1, 1])
        assert a.statistics().leases_held == 0


async def test_borrowed_memory_leases_by_range_too(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim, streams=2) as b:
        x = await a.to_device(_arange())
        y = trio_cuda.borrow(x, "write", scope=b)
        with held(sim):
            f = b.submit(add(y[:H], 1.0), stream=b.streams[0])
            g = b.submit(add(y[H:], 1.0), stream=b.streams[1])
            assert not any(c.kind == "wait_marker" for s in b.streams for c in internals.queued_commands(s))
        for fut in (f, g):
            (await fut.wait()).close()  # the written views (the futures' outputs) are handles too
        y.close()
        np.testing.assert_array_equal(await a.to_host(x), _arange() + 1)


def test_cross_device_copies_lease_their_ranges() -> None:
    host = SimHost(2)

    async def main() -> None:
        async with (
            trio_cuda.open_scope(device=host[0], streams=2, conflicts="error") as a,
            trio_cuda.open_scope(device=host[1]) as b,
        ):
            x = await a.to_device(_arange())
            src = await b.to_device(_arange() + 100)
            with held(host):
                # b copies into x's head; a writes x's tail meanwhile: no conflict
                c = b.submit(ops.copy(x[:H], src[:H]))
                t = a.submit(ops.fill(x[H:], 1.0), stream=a.streams[1])
                with pytest.raises(AccessConflictError):
                    a.submit(ops.fill(x[H - 1 : H + 1], 0.0), stream=a.streams[1])
            await c.wait()
            await t.wait()
            np.testing.assert_array_equal(await a.to_host(x), [100, 101, 102, 103, 1, 1, 1, 1])

    trio.run(main)
    assert host.violations == []


async def test_freeing_waits_for_a_lease_on_any_range(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(_arange())
        with held(sim):
            f = gpu.submit(ops.fill(x[H:], 1.0), stream=gpu.streams[1])
            x.close()  # the only handle; a view of it has a lease in flight
            gc.collect()
            await trio.testing.wait_all_tasks_blocked()
            assert len(sim.live_allocations) == 1
            assert internals.allocation_of(x).active == 1
        tail = await f.wait()  # fill's output: the view, a handle of its own
        await trio.testing.wait_all_tasks_blocked()
        assert len(sim.live_allocations) == 1  # the view's handle is open, no lease
        assert internals.allocation_of(x).active == 0
        tail.close()
        assert sim.live_allocations == []


async def test_read_only_views_share_reads_and_refuse_writes_by_range(sim):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        x = await gpu.to_device(_arange())
        ro = x.as_readonly()
        with held(sim):
            r = gpu.submit(ops.copy(np.zeros(N, F4), ro), stream=gpu.streams[0])
            with pytest.raises(AccessConflictError, match="write-after-read"):
                gpu.submit(ops.fill(x[:1], 0.0), stream=gpu.streams[1])
        await r.wait()


async def test_typed_launch_fast_path_and_disjoint_writers(sim):
    # the whole-array fast path gives way to the general path for a disjoint
    # writer on another stream, and both views run without a wait
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        src = await gpu.to_device(_arange())
        dst = gpu.empty(N, F4)
        with held(sim):
            a = gpu.submit(COPY.launch(src[:H], dst[:H], H, grid=1, block=H), stream=gpu.streams[0])
            b = gpu.submit(COPY.launch(src[H:], dst[H:], H, grid=1, block=H), stream=gpu.streams[1])
        await a.wait()
        await b.wait()
        np.testing.assert_array_equal(await gpu.to_host(dst), _arange())


async def test_many_chunks_in_flight_are_indexed_and_exact(sim):
    # 200 one-element chunks in flight on 4 streams: the lease table grows
    # past INDEX_AT and gets an index; conflicts stay exact; retirement takes
    # every entry out
    n = 200
    async with trio_cuda.open_scope(device=sim, streams=4, conflicts="error") as gpu:
        x = gpu.zeros(n, F4)
        await gpu.run(ops.value(None))
        with held(sim):
            futs = [gpu.submit(ops.fill(x[i : i + 1], float(i)), stream=gpu.streams[i % 4]) for i in range(n)]
            alloc = internals.allocation_of(x)
            assert alloc.index is not None
            assert len(alloc.writers) == n
            # chunk i was written on stream i % 4: a read of chunks 50..52 on
            # stream 2 conflicts with chunk 51 (stream 3) first, not with 50
            with pytest.raises(AccessConflictError, match=r"bytes \[204, 208\)"):
                gpu.submit(ops.copy(np.zeros(3, F4), x[50:53]), stream=gpu.streams[2])
            ok = gpu.submit(ops.copy(np.zeros(1, F4), x[52:53]), stream=gpu.streams[0])
            # a write over every chunk conflicts on every stream (each holds chunks)
            for s in gpu.streams:
                with pytest.raises(AccessConflictError):
                    gpu.submit(ops.fill(x, 0.0), stream=s)
        await ok.wait()
        for f in futs:
            await f.wait()
        assert alloc.writers == {}
        assert alloc.readers == {}
        # the index drops retired entries lazily: the next lease finds the
        # tables empty and drops the index with them
        assert alloc.index is not None
        await gpu.run(ops.fill(x[:1], 0.0))
        assert alloc.index is None
        np.testing.assert_array_equal(await gpu.to_host(x), np.arange(n, dtype=F4))


async def test_whole_allocation_leases_build_no_index_and_keep_the_fast_path(sim, monkeypatch):
    # 40 whole reads of x in flight on 4 streams (past INDEX_AT), then a
    # write of x: no range index is built, every launch takes the launch fast
    # path, and the write waits device-side for the readers of the 3 other
    # streams
    from trio_cuda._core import _leases, _submit

    general = []
    real = _submit.take_leases
    monkeypatch.setattr(_submit, "take_leases", lambda *a, **k: (general.append(a[4]), real(*a, **k)))
    n = 40
    assert n > _leases.INDEX_AT
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        x = await gpu.to_device(_arange())
        ys = [gpu.zeros(N, F4) for _ in range(n)]
        await gpu.run(ops.value(None))
        alloc = internals.allocation_of(x)
        general.clear()  # the uploads and fills: not single launches
        with held(sim):
            for i, y in enumerate(ys):
                gpu.submit(copy(x, y), stream=gpu.streams[i % 4])
            assert len(alloc.readers) == n
            assert alloc.index is None
            before = [c.seq for c in internals.queued_commands(gpu.streams[0])]
            gpu.submit(add(x, 1.0), stream=gpu.streams[0])
            new = [c for c in internals.queued_commands(gpu.streams[0]) if c.seq not in before]
            # one wait per reader of another stream, as the general path makes them
            kinds = [c.kind for c in new if c.kind != "marker"]
            assert kinds == ["wait_marker"] * (n - n // 4) + ["launch"]
            assert alloc.index is None
            assert len(alloc.writers) == 1
            assert not alloc.readers
            assert general == []  # every launch took the fast path
        for y in ys:
            np.testing.assert_array_equal(await gpu.to_host(y), _arange())
        np.testing.assert_array_equal(await gpu.to_host(x), _arange() + 1)
        # partial reads past INDEX_AT still get an index (and the general path)
        general.clear()
        with held(sim):
            for i, y in enumerate(ys):
                gpu.submit(copy(x[:H], y[:H]), stream=gpu.streams[i % 4])
            assert alloc.index is not None
            assert general == ["copy_f4"] * (n - 1 - _leases.INDEX_AT)


async def test_quarantine_of_one_chunk_quarantines_the_allocation(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(_arange())
        other = await gpu.to_device(_arange())
        tail = x[H:]
        sim.inject_fault("completion_unknown")
        with pytest.raises(trio_cuda.CompletionUnknownError, match="could not be established"):
            await gpu.run(add(x[:H], 1.0), stream=gpu.streams[0])
        # the tail never had a lease, but its memory is the same allocation
        assert tail.quarantined
        with pytest.raises(trio_cuda.CompletionUnknownError, match="quarantined"):
            gpu.submit(add(tail, 1.0), stream=gpu.streams[1])
        with pytest.raises(trio_cuda.CompletionUnknownError, match="quarantined"):
            x[H:]  # no new view of quarantined memory either
        # other allocations are untouched
        await gpu.run(add(other, 1.0), stream=gpu.streams[1])
        np.testing.assert_array_equal(await gpu.to_host(other), _arange() + 1)
    assert len(sim.live_allocations) == 1  # x's memory: leaked on purpose, never freed
