"""Several devices on the simulator: per-device scopes, cross-device copies with
leases on both sides, cross-device ordering, scope exit with foreign leases,
faults on one device, and device pools."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import trio
from trio.testing import assert_checkpoints, wait_all_tasks_blocked

import trio_cuda
from tests.helpers.kernels import add
from trio_cuda import ops
from trio_cuda._backends import probe_cuda
from trio_cuda.testing import SimDevice, SimHost

N = 64


@pytest.fixture
def host():
    """Two simulated devices of one host; every test must leave them clean."""
    h = SimHost(2)
    yield h
    assert h.violations == [], h.violations


def arange(n: int = N, start: float = 0.0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.float32)


# --------------------------------------------------------------------------- the simulated host


def test_sim_host_devices_are_separate_with_disjoint_address_spaces(host: SimHost) -> None:
    a, b = host
    assert (a.name, b.name) == ("sim0", "sim1")
    assert (a.info.ordinal, b.info.ordinal) == (0, 1)
    ca, cb = a.open_context(), b.open_context()
    sa, sb = ca.create_stream(0), cb.create_stream(0)
    pa, pb = ca.alloc(1024, sa), cb.alloc(1024, sb)
    assert abs(pa - pb) >= 1 << 40
    assert [x.ptr for x in a.live_allocations] == [pa]
    assert [x.ptr for x in b.live_allocations] == [pb]
    # device b cannot reach device a's memory through an ordinary copy: memcheck
    cb.copy_d2d(sb, pb, pa, 16)
    assert [(v.kind, v.address) for v in b.violations] == [("unallocated", pa)]
    b.clear_violations()
    # a peer copy may
    cb.copy_peer(sb, pb, cb, pa, ca, 16)
    assert host.statistics().peer_copies == 1
    ca.free(pa, 1024)
    cb.free(pb, 1024)
    # a peer copy of freed memory is a violation of the device whose memory it touched
    pc = cb.alloc(64, sb)
    cb.copy_peer(sb, pc, cb, pa, ca, 16)
    assert [(v.kind, v.address) for v in a.violations] == [("use_after_free", pa)]
    a.clear_violations()
    cb.free(pc, 64)


def test_sim_host_rejects_bad_devices() -> None:
    with pytest.raises(ValueError, match=r"^devices: expected an int from 1 to 64 or SimDevices, got 0$"):
        SimHost(0)
    used = SimDevice()
    ctx = used.open_context()
    ctx.alloc(8, ctx.create_stream(0))
    with pytest.raises(ValueError, match=r"^devices\[0\]: expected a fresh SimDevice"):
        SimHost([used])
    d = SimDevice()
    with pytest.raises(ValueError, match=r"^devices: expected distinct SimDevices, got one twice$"):
        SimHost([d, d])
    SimHost([d])
    with pytest.raises(ValueError, match=r"^devices\[0\]: 'sim0' already belongs to a SimHost$"):
        SimHost([d])
    with pytest.raises(TypeError, match=r"^devices\[1\]: expected a SimDevice, got str$"):
        SimHost([SimDevice(), "sim"])  # type: ignore[list-item]
    with pytest.raises(
        ValueError, match=r"^a: expected a SimDevice of this host or an ordinal below 2, got 5$"
    ):
        SimHost(2).can_access_peer(5, 0)


def test_devices_outside_one_host_cannot_copy() -> None:
    async def main() -> None:
        async with (
            trio_cuda.open_scope(device=SimDevice(name="x")) as a,
            trio_cuda.open_scope(device=SimDevice(name="y")) as b,
        ):
            x = await a.to_device(arange())
            y = b.empty(N, np.float32)
            before = b.statistics().submitted
            with pytest.raises(
                trio_cuda.KernelArgumentError,
                match=r"^copy: expected simulated devices of one SimHost, got x, y",
            ):
                b.submit(ops.copy(y, x))
            st = a.statistics()
            assert (st.foreign_leases, st.leases_held) == (0, 0)
            assert b.statistics().submitted == before  # nothing enqueued or retained

    trio.run(main)


# --------------------------------------------------------------------------- scopes on two devices


def test_two_scopes_on_two_devices_work_independently(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[0]) as a, trio_cuda.open_scope(device=host[1]) as b:
            assert (a.device.ordinal, b.device.ordinal) == (0, 1)
            x = await a.to_device(arange())
            y = await b.to_device(arange(start=100))
            host.hold()
            fa = a.submit(add(x, 1))
            fb = b.submit(add(y, 2))
            host[1].run_until_idle()  # only device 1 runs
            await fb.wait()
            assert not fa.done()
            host.release()
            await fa.wait()
            np.testing.assert_array_equal(await a.to_host(x), arange() + 1)
            np.testing.assert_array_equal(await b.to_host(y), arange(start=100) + 2)

    trio.run(main)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_peer_copy_moves_the_bytes(host: SimHost, direction: str) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[0]) as a, trio_cuda.open_scope(device=host[1]) as b:
            x = await a.to_device(arange())
            y = b.empty(N, np.float32)
            if direction == "pull":  # submitted where it lands
                out = await b.run(ops.copy(y, x))
            else:  # submitted where it comes from
                out = await a.run(ops.copy(y, x))
            assert out is y
            np.testing.assert_array_equal(await b.to_host(y), arange())
            st = host.statistics()
            assert (st.peer_copies, st.staged_copies, st.peer_bytes) == (1, 0, N * 4)

    trio.run(main)


def test_peer_copy_is_staged_without_peer_access() -> None:
    host = SimHost(2, peer_access=False)
    assert not host.can_access_peer(0, 1)

    async def main() -> None:
        async with trio_cuda.open_device_pool(host) as pool:
            a, b = pool
            x = await a.to_device(arange())
            y = b.empty(N, np.float32)
            await pool.run(ops.copy(y, x))
            np.testing.assert_array_equal(await b.to_host(y), arange())
            host.enable_peer_access(0, 1)
            await pool.run(ops.copy(y, x))

    trio.run(main)
    st = host.statistics()
    assert (st.peer_copies, st.staged_copies) == (2, 1)
    assert host.violations == []


def test_peer_copy_orders_after_the_other_devices_writer(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[0]) as a, trio_cuda.open_scope(device=host[1]) as b:
            x = await a.to_device(arange())
            y = await b.to_device(np.zeros(N, np.float32))
            host.hold()
            fw = a.submit(add(x, 5))  # in flight on device 0
            fc = b.submit(ops.copy(y, x))  # must wait for it, device-side
            assert host[1].run_until_idle() == 0  # the copy waits on device 0's marker
            assert not fc.done()
            assert host[0].run_until_idle() == 1  # the writer runs; the wait is released
            assert host.statistics().cross_device_waits == 1
            assert host[1].run_until_idle() == 1  # now the copy runs
            host.release()
            await fw.wait()
            await fc.wait()
            np.testing.assert_array_equal(await b.to_host(y), arange() + 5)

    trio.run(main)


def test_other_devices_writer_orders_after_an_in_flight_peer_read(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[0]) as a, trio_cuda.open_scope(device=host[1]) as b:
            x = await a.to_device(arange())
            y = b.empty(N, np.float32)
            host.hold()
            fc = b.submit(ops.copy(y, x))  # reads x on device 1
            fw = a.submit(add(x, 5))  # write-after-read: device 0 waits for it
            assert host[0].run_until_idle() == 0
            assert host[1].run_until_idle() == 1
            assert host[0].run_until_idle() == 1
            host.release()
            await fc.wait()
            await fw.wait()
            np.testing.assert_array_equal(await b.to_host(y), arange())  # the old values
            np.testing.assert_array_equal(await a.to_host(x), arange() + 5)

    trio.run(main)


def test_conflicts_error_refuses_a_cross_device_conflict(host: SimHost) -> None:
    async def main() -> None:
        async with (
            trio_cuda.open_scope(device=host[0]) as a,
            trio_cuda.open_scope(device=host[1], conflicts="error") as b,
        ):
            x = await a.to_device(arange())
            y = b.empty(N, np.float32)
            host.hold()
            fw = a.submit(add(x, 1))
            with pytest.raises(trio_cuda.AccessConflictError, match=r"^copy: read-after-write conflict on"):
                b.submit(ops.copy(y, x))
            assert a.statistics().foreign_leases == 0  # nothing was leased
            host.release()
            await fw.wait()
            await b.run(ops.copy(y, x))  # no conflict once the writer retired
            np.testing.assert_array_equal(await b.to_host(y), arange() + 1)

    trio.run(main)


def test_copy_must_involve_the_submitting_scope(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_device_pool(host) as pool:
            a, b = pool
            async with trio_cuda.open_scope(device=host[1]) as c:
                x = await a.to_device(arange())
                y = b.empty(N, np.float32)
                with pytest.raises(
                    trio_cuda.KernelArgumentError,
                    match=r"^copy: expected dst or src owned by the scope the copy is submitted to \(sim:1 "
                    r"\(sim1\)\), got dst of sim:1 \(sim1\) and src of sim:0 \(sim0\)$",
                ):
                    c.submit(ops.copy(y, x))
                with pytest.raises(trio_cuda.KernelArgumentError, match="of another scope"):
                    b.submit(add(x, 1))  # kernels only touch their own scope's memory
                assert a.statistics().foreign_leases == 0

    trio.run(main)


# --------------------------------------------------------------------------- lifetimes


@pytest.mark.parametrize("drop", ["close", "gc"])
def test_owner_never_frees_a_source_a_peer_copy_still_reads(host: SimHost, drop: str) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[0]) as a, trio_cuda.open_scope(device=host[1]) as b:
            x = await a.to_device(arange())
            ptr = x.ptr
            y = b.empty(N, np.float32)
            host.hold()
            fut = b.submit(ops.copy(y, x))
            if drop == "close":
                x.close()
            else:
                del x
                gc.collect()
            await wait_all_tasks_blocked()
            assert ptr in [m.ptr for m in host[0].live_allocations]  # still there
            st = a.statistics()
            assert (st.foreign_leases, st.leases_held) == (1, 1)
            host.release()
            await fut.wait()
            await wait_all_tasks_blocked()
            assert ptr not in [m.ptr for m in host[0].live_allocations]  # freed after retirement
            assert a.statistics().foreign_leases == 0
            np.testing.assert_array_equal(await b.to_host(y), arange())

    trio.run(main)


def test_scope_exit_waits_for_foreign_leases_and_refuses_new_ones(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[1]) as b:
            y = b.empty(N, np.float32)
            y2 = b.empty(N, np.float32)
            exited = trio.Event()

            async def owner(task_status: trio.TaskStatus[tuple[object, object]]) -> None:
                async with trio_cuda.open_scope(device=host[0]) as a:
                    x = await a.to_device(arange())
                    host.hold()
                    fut = b.submit(ops.copy(y, x))
                    task_status.started((fut, x))
                exited.set()

            async with trio.open_nursery() as nursery:
                fut, x = await nursery.start(owner)
                try:  # a failed check must not leave the device held (the exits would wait forever)
                    await wait_all_tasks_blocked()
                    assert not exited.is_set()  # a's exit waits for b's copy of its memory
                    with pytest.raises(
                        trio_cuda.ScopeClosedError,
                        match=r"^copy: src: expected an array of an open scope, got one of sim:0 \(sim0\), "
                        r"which is exiting$",
                    ):
                        b.submit(ops.copy(y2, x))
                    assert x.ptr in [m.ptr for m in host[0].live_allocations]
                finally:
                    host.release()
            assert exited.is_set()
            await fut.wait()
            np.testing.assert_array_equal(await b.to_host(y), arange())
        assert host.live_allocations == []

    trio.run(main)


def test_scope_exit_after_drain_timeout_quarantines_foreign_leased_memory(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[1]) as b:
            y = b.empty(N, np.float32)
            with pytest.warns(ResourceWarning, match="lease\\(s\\) of other scopes' in-flight work"):
                async with trio_cuda.open_scope(device=host[0], drain_timeout=0.01) as a:
                    x = await a.to_device(arange())
                    ptr = x.ptr
                    host.hold()
                    fut = b.submit(ops.copy(y, x))
            assert a.closed
            assert ptr in [m.ptr for m in host[0].live_allocations]  # leaked, not freed
            host.release()
            await fut.wait()  # the copy read valid memory
            np.testing.assert_array_equal(await b.to_host(y), arange())
        assert [m.ptr for m in host[0].live_allocations] == [ptr]  # quarantined for good
        assert host.live_allocations[0].ptr == ptr

    trio.run(main)


def test_cancelled_peer_copy_keeps_leases_on_both_devices(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[0]) as a, trio_cuda.open_scope(device=host[1]) as b:
            x = await a.to_device(arange())
            y = b.empty(N, np.float32)
            host.hold()
            with trio.move_on_after(0.05) as cs:
                await b.run(ops.copy(y, x))
            assert cs.cancelled_caught  # Cancelled was raised promptly, the GPU still holds it
            sa, sb = a.statistics(), b.statistics()
            assert (sa.foreign_leases, sa.leases_held) == (1, 1)  # read lease on device 0's memory
            assert (sb.in_flight, sb.leases_held) == (1, 1)  # write lease on device 1's memory
            x.close()
            y.close()
            assert len(host.live_allocations) == 2
            host.release()
            await wait_all_tasks_blocked()
            sa, sb = a.statistics(), b.statistics()
            assert (sa.foreign_leases, sa.leases_held, sa.live_allocations) == (0, 0, 0)
            assert (sb.in_flight, sb.leases_held, sb.live_allocations) == (0, 0, 0)
            assert host.live_allocations == []

    trio.run(main)


def test_quarantined_peer_copy_leaks_memory_on_both_devices(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[1]) as b:
            z = await b.to_device(arange())
            y = b.empty(N, np.float32)
            async with trio_cuda.open_scope(device=host[0]) as a:
                x = await a.to_device(arange())
                host[1].inject_fault("completion_unknown")
                fut = b.submit(trio_cuda.zip(ops.copy(y, x), add(z, 1)))
                with pytest.raises(trio_cuda.CompletionUnknownError):
                    await fut.wait()
                sa = a.statistics()
                assert (sa.foreign_leases, sa.quarantined_leases, sa.quarantined_bytes) == (0, 1, N * 4)
                assert x.quarantined
                assert y.quarantined
                assert b.statistics().quarantined == 1
                with pytest.raises(trio_cuda.CompletionUnknownError):
                    a.submit(add(x, 1))
            # a's exit did not wait for the leaked lease, and did not free x
            assert len(host[0].live_allocations) == 1

    trio.run(main)


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("fault", ["kernel_fault", "completion_unknown"])
def test_one_device_faults_while_the_other_keeps_working(host: SimHost, fault: str) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[1]) as b:
            y = await b.to_device(arange())
            errors: list[BaseException] = []
            try:
                async with trio_cuda.open_scope(device=host[0]) as a:
                    x = await a.to_device(arange())
                    host[0].inject_fault(fault)  # type: ignore[arg-type]
                    bad = a.submit(add(x, 1))
                    for _ in range(5):
                        await b.run(add(y, 1))  # device 1 is unaffected meanwhile
                    expected = (
                        trio_cuda.LaunchError if fault == "kernel_fault" else trio_cuda.CompletionUnknownError
                    )
                    with pytest.raises(expected):
                        await bad.wait()
                    sa = a.statistics()
                    assert (sa.failed, sa.quarantined) == (1, 1 if fault == "completion_unknown" else 0)
                    assert x.quarantined is (fault == "completion_unknown")
            except BaseExceptionGroup as eg:  # pragma: no cover - the error was observed above
                errors.extend(eg.exceptions)
            assert errors == []
            sb = b.statistics()
            assert (sb.failed, sb.quarantined, sb.completed, sb.in_flight) == (0, 0, sb.submitted, 0)
            np.testing.assert_array_equal(await b.to_host(y), arange() + 5)

    trio.run(main)


@pytest.mark.parametrize("fault", ["kernel_fault", "completion_unknown"])
def test_peer_copy_of_data_from_failed_work_fails(host: SimHost, fault: str) -> None:
    async def main() -> None:
        async with trio_cuda.open_scope(device=host[1]) as b:
            y = b.empty(N, np.float32)
            async with trio_cuda.open_scope(device=host[0]) as a:
                x = await a.to_device(arange())
                host.hold()
                host[0].inject_fault(fault)  # type: ignore[arg-type]
                bad = a.submit(add(x, 1))
                copy = b.submit(ops.copy(y, x))  # ordered after the bad writer
                host.release()
                with pytest.raises(trio_cuda.TrioCudaError):
                    await bad.wait()
                expected = (
                    trio_cuda.CompletionUnknownError
                    if fault == "completion_unknown"
                    else trio_cuda.TrioCudaError
                )
                with pytest.raises(expected, match=r"^copy: src: .*cannot be trusted$"):
                    await copy.wait()
            assert b.statistics().quarantined == 0  # b's own memory is fine

    trio.run(main)


# --------------------------------------------------------------------------- device pools


def test_device_pool_routes_by_arrays_then_by_load(host: SimHost) -> None:
    async def main() -> None:
        with assert_checkpoints():
            async with trio_cuda.open_device_pool(host, streams=2) as pool:
                assert len(pool) == 2
                assert pool[0].device.ordinal == 0
                assert list(pool) == list(pool.scopes)
                assert isinstance(pool.policy, trio_cuda.LeastLoadedDevice)
                a, b = pool
                x = await a.to_device(arange())
                y = await b.to_device(arange())
                host.hold()
                fut = pool.submit(add(x, 1))  # x lives on device 0: runs there
                assert fut.stream.scope is a
                assert pool.choose() is b  # device 1 is less loaded now
                assert pool.choose(ops.copy(y, x)) is b  # a copy runs where it lands
                assert pool.choose(ops.value(3)) is b
                st = pool.statistics()
                assert (st.in_flight, len(st.devices)) == (1, 2)
                host.release()
                with assert_checkpoints():
                    assert await pool.run(ops.value(7)) == 7
                with assert_checkpoints():
                    w = await pool.to_device(arange())
                assert w.scope in (a, b)
                await fut.wait()
                np.testing.assert_array_equal(await a.to_host(x), arange() + 1)

    trio.run(main)


def test_round_robin_devices_and_pinned_streams(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_device_pool(host, policy=trio_cuda.RoundRobinDevices()) as pool:
            assert [pool.choose() for _ in range(3)] == [pool[0], pool[1], pool[0]]
            s = pool[1].streams[2]
            fut = pool.submit(ops.value(1), stream=s)
            assert fut.stream is s
            assert await fut.wait() == 1
            async with trio_cuda.open_scope(device="sim") as other:
                with pytest.raises(
                    ValueError, match=r"^stream: expected a stream of one of the pool's scopes"
                ):
                    pool.submit(ops.value(1), stream=other.streams[0])
            with pytest.raises(TypeError, match=r"^op: expected a DeviceOp, got int$"):
                pool.submit(3)  # type: ignore[arg-type]

    trio.run(main)


def test_open_device_pool_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"^devices: expected at least one device, got none$"):
        trio_cuda.open_device_pool([])
    with pytest.raises(
        TypeError, match=r"^devices: expected 'auto', 'cuda', a SimHost or a sequence of devices, got int$"
    ):
        trio_cuda.open_device_pool(3)
    with pytest.raises(
        ValueError,
        match=r"^devices: expected 'auto' \(every CUDA device when one answers, else one simulated "
        r"device\), 'cuda' \(every CUDA device\), a SimHost or a sequence of devices, got 'gpu'$",
    ):
        trio_cuda.open_device_pool("gpu")
    with pytest.raises(
        TypeError, match=r"^policy: expected a DevicePolicy \(with a choose\(\) method\), got 1$"
    ):
        trio_cuda.open_device_pool(["sim"], policy=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^streams: expected an int >= 1, got 0$"):
        trio_cuda.open_device_pool(["sim"], streams=0)
    if not probe_cuda().available:
        with pytest.raises(trio_cuda.DeviceUnavailableError, match=r"^devices: 'cuda' was asked for, but "):
            trio_cuda.open_device_pool("cuda")


def test_the_default_pool_opens_wherever_open_scope_does() -> None:
    """devices="auto": every GPU where one answers, else one simulated device."""

    async def main() -> None:
        async with trio_cuda.open_device_pool() as pool, trio_cuda.open_scope() as gpu:
            assert {s.backend for s in pool.scopes} == {gpu.backend}
            probe = probe_cuda()
            assert len(pool.scopes) == (probe.device_count if gpu.backend == "cuda" else 1)
            x = await pool.to_device(arange())
            np.testing.assert_array_equal(await x.scope.to_host(x), arange())

    trio.run(main)


def test_device_pool_opens_nothing_when_one_device_fails() -> None:
    host = SimHost(2)

    async def main() -> None:
        with pytest.raises(TypeError, match=r"^device: expected"):
            async with trio_cuda.open_device_pool([host[0], 42]):
                pytest.fail("the pool must not open")  # pragma: no cover

    trio.run(main)
    assert host.live_allocations == []
    assert host.violations == []


def test_sim_host_controls_act_on_every_device(host: SimHost) -> None:
    async def main() -> None:
        async with trio_cuda.open_device_pool(host) as pool:
            a, b = pool
            x = await a.to_device(arange())
            y = await b.to_device(arange())
            host.hold()
            assert host[0].held
            assert host[1].held
            fa = a.submit(add(x, 1))
            fb = b.submit(add(y, 1))
            assert host.pending >= 2
            assert host.complete_next()  # the oldest first: device 0's
            await fa.wait()
            assert not fb.done()
            assert host.run_until_idle() == 1
            await fb.wait()
            host.release()

    trio.run(main)
