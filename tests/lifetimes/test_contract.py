"""The lifetime contract (docs/lifetimes.rst, rules 1-7, 9, 10) on both backends.

Every test takes the ``backend`` fixture: it runs on the simulated device and,
where a CUDA device answers (``trio_cuda._backends.probe_cuda()``), on the real
GPU (those params are marked ``gpu``; elsewhere they skip cleanly).

Work is kept in flight the same way on both backends: a driver *gate*
(``create_gate``: a stream-side wait; on CUDA a ``cuStreamWaitValue32`` on a
pinned host flag) is enqueued on the streams before the work and opened later
with ``open_gate`` (see :class:`Hold`). Every gate must be open before its
scope exits, or the exit drain would wait forever: ``async with
backend.held(gpu)`` opens what is still closed on the way out, and a watchdog
in the fixture opens every gate (and fails the test) if one stays closed for
``WATCHDOG_S`` seconds. Simulator-only extras (memcheck records, fault
injection) are guarded by ``backend.sim``.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import ADD, COPY, SAXPY, add, copy, saxpy
from tests.helpers.sanitizer import SLOW
from trio_cuda import ops, unsafe
from trio_cuda._backends import probe_cuda
from trio_cuda.testing import SimDevice

N = 256
_PROBE = probe_cuda()
#: a test that leaves a gate closed this long fails instead of hanging
WATCHDOG_S = 10.0


def host(value: float | None = None) -> np.ndarray:
    if value is None:
        return np.arange(N, dtype=np.float32)
    return np.full(N, value, dtype=np.float32)


async def until(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    """Poll ``predicate`` (public statistics) without blocking the loop."""
    with trio.fail_after(timeout * SLOW):
        while not predicate():  # noqa: ASYNC110 - polling public statistics
            await trio.sleep(0.001)


async def settle(gpu: trio_cuda.ResourceScope) -> None:
    """Wait until every submission of the scope retired (leases released)."""
    await until(lambda: gpu.statistics().in_flight == 0)


async def preload(gpu: trio_cuda.ResourceScope) -> None:
    """Compile and load the kernels before anything is timed or held."""
    await gpu.load(ADD, COPY, SAXPY)


async def release_after(hold: Hold, delay: float) -> None:
    await trio.sleep(delay)
    hold.release()


# --------------------------------------------------------------------------- holding streams


class Hold:
    """Holds streams of a scope with driver gates until :meth:`release`.

    :meth:`start` first waits until the scope has nothing in flight (so every
    earlier submission is marked and retired), then enqueues one gate on each
    stream: work submitted afterwards to those streams stays in flight.
    """

    def __init__(self, gpu: trio_cuda.ResourceScope, streams: Sequence[Any] | None) -> None:
        self.gpu = gpu
        self.driver = internals.driver_of(gpu)
        self.streams = tuple(gpu.streams if streams is None else streams)
        self.gates: list[Any] = []

    async def start(self) -> Hold:
        await settle(self.gpu)
        for s in self.streams:
            self.gates.append(self.driver.create_gate(s.handle))
        return self

    @property
    def holding(self) -> bool:
        return any(not g.opened for g in self.gates)

    def release(self) -> None:
        """Open every gate still closed (idempotent)."""
        for g in self.gates:
            if not g.opened:
                self.driver.open_gate(g)

    async def __aenter__(self) -> Hold:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class Backend:
    """What a test needs to know about the backend it runs on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sim: SimDevice | None = SimDevice() if name == "sim" else None
        self.device: object = self.sim if self.sim is not None else "cuda"
        self.holds: list[Hold] = []
        self.watchdog_fired = False
        self._watchdog_cs = trio.CancelScope()

    def open_scope(self, **kwargs: Any) -> Any:
        return trio_cuda.open_scope(device=self.device, **kwargs)

    def held(self, gpu: trio_cuda.ResourceScope, streams: Sequence[Any] | None = None) -> Hold:
        hold = Hold(gpu, streams)
        self.holds.append(hold)
        return hold

    def release_all(self) -> None:
        for hold in self.holds:
            hold.release()

    def live_ptrs(self) -> set[int]:
        assert self.sim is not None
        return {a.ptr for a in self.sim.live_allocations}

    def check_freed(self, gpu: trio_cuda.ResourceScope) -> None:
        """After scope exit: nothing in flight, nothing left allocated."""
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held, st.live_allocations) == (0, 0, 0)
        if self.sim is not None:
            assert self.sim.live_allocations == []

    async def watchdog(self) -> None:
        with self._watchdog_cs:
            await trio.sleep(WATCHDOG_S)
            self.watchdog_fired = True
            self.release_all()


@pytest.fixture(
    params=[
        "sim",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}"),
            ],
        ),
    ]
)
async def backend(
    request: pytest.FixtureRequest,
    nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    if request.param == "cuda":
        # one compilation cache for this test session, never the user's
        monkeypatch.setenv("TRIO_CUDA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "nvrtc-cache"))
    b = Backend(request.param)
    nursery.start_soon(b.watchdog)
    yield b
    b._watchdog_cs.cancel()
    b.release_all()
    assert not b.watchdog_fired, f"a gate stayed closed for {WATCHDOG_S} s; the watchdog opened it"
    if b.sim is not None:
        assert b.sim.violations == [], b.sim.violations


# --------------------------------------------------------------------------- rule 1: retention


async def test_submission_retains_what_it_uses_after_handles_are_dropped(backend: Backend) -> None:
    xh, yh, wh = host(), host(1.0), host() * 3
    async with backend.open_scope() as gpu:
        await preload(gpu)
        x = await gpu.to_device(xh)
        y = await gpu.to_device(yh)
        w = await gpu.to_device(wh)
        z = gpu.zeros(N, np.float32)
        ptrs = {x.ptr, w.ptr}
        async with backend.held(gpu) as h:
            assert gpu.statistics().live_allocations == 4
            op = saxpy(2.0, x, y)
            f1 = gpu.submit(op)
            f2 = gpu.submit(copy(w, z))
            x.close()  # an explicit close ...
            del op, w  # ... and a handle lost to garbage collection
            gc.collect()
            await trio.sleep(0.02)
            st = gpu.statistics()
            assert (st.in_flight, st.leases_held) == (2, 4)
            assert st.retained_bytes == 4 * N * 4
            assert st.live_allocations == 4  # nothing freed under the GPU's feet
            assert not f1.done()
            assert not f2.done()
            if backend.sim is not None:
                assert ptrs <= backend.live_ptrs()
            h.release()
            assert await f1.wait() is y
            assert await f2.wait() is z
        await settle(gpu)
        assert gpu.statistics().leases_held == 0
        # x and w freed once retired: the futures kept do not pin the ops' arrays
        await until(lambda: gc.collect() >= 0 and gpu.statistics().live_allocations == 2)
        assert f2.done()
        if backend.sim is not None:
            assert not (ptrs & backend.live_ptrs())
        np.testing.assert_array_equal(await gpu.to_host(y), 2 * xh + yh)
        np.testing.assert_array_equal(await gpu.to_host(z), wh)
    backend.check_freed(gpu)
    if backend.sim is not None:
        st = backend.sim.statistics()
        assert st.kernel_unloads == st.kernel_loads == 3


# --------------------------------------------------------------------------- rule 3: cancellation


async def test_deadline_cancels_promptly_and_the_scope_keeps_the_work(backend: Backend) -> None:
    xh, yh = host(), host(1.0)
    async with backend.open_scope() as gpu:
        await preload(gpu)
        x = await gpu.to_device(xh)
        y = await gpu.to_device(yh)
        async with backend.held(gpu) as h:
            t0 = time.perf_counter()
            with trio.move_on_after(0.05) as cs:
                await gpu.run(saxpy(3.0, x, y))
            assert cs.cancelled_caught
            assert time.perf_counter() - t0 < 1.0  # promptly, without waiting for the GPU
            st = gpu.statistics()
            assert (st.in_flight, st.leases_held, st.retained_bytes) == (1, 2, 2 * N * 4)
            await trio.sleep(0.02)
            # the task returned long ago; the leases stay until the GPU completes
            assert gpu.statistics().leases_held == 2
            x.close()
            assert gpu.statistics().live_allocations == 2
            h.release()
        await settle(gpu)
        st = gpu.statistics()
        assert (st.leases_held, st.live_allocations, st.completed, st.failed) == (0, 1, st.submitted, 0)
        np.testing.assert_array_equal(await gpu.to_host(y), 3 * xh + yh)  # the cancelled launch ran
    backend.check_freed(gpu)


async def test_pre_cancelled_run_submits_nothing(backend: Backend) -> None:
    async with backend.open_scope() as gpu:
        await preload(gpu)
        x = await gpu.to_device(host())
        await settle(gpu)
        before = gpu.statistics()
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.run(add(x, 1.0))
        assert cs.cancelled_caught
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.to_device(host())
        assert cs.cancelled_caught
        assert gpu.statistics() == before
        np.testing.assert_array_equal(await gpu.to_host(x), host())
    backend.check_freed(gpu)


async def test_shielded_wait_completes_after_release_from_another_task(backend: Backend) -> None:
    async with backend.open_scope() as gpu, trio.open_nursery() as nursery:
        await preload(gpu)
        x = await gpu.to_device(host())
        async with backend.held(gpu) as h:
            nursery.start_soon(release_after, h, 0.05)
            t0 = time.perf_counter()
            with trio.CancelScope() as outer:
                outer.cancel()
                with trio.CancelScope(shield=True):
                    out = await gpu.run(add(x, 1.0))
            assert out is x
            assert time.perf_counter() - t0 >= 0.04  # it really waited for the release
            assert not h.holding
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)
    backend.check_freed(gpu)


# --------------------------------------------------------------------------- rule 4: dropped futures


async def test_dropped_future_keeps_its_submission(backend: Backend) -> None:
    xh, yh = host(), host(0.5)
    async with backend.open_scope() as gpu:
        await preload(gpu)
        x = await gpu.to_device(xh)
        y = await gpu.to_device(yh)
        async with backend.held(gpu) as h:
            fut = gpu.submit(saxpy(1.0, x, y))
            del fut
            x.close()
            gc.collect()
            await trio.sleep(0.02)
            st = gpu.statistics()
            assert (st.in_flight, st.leases_held, st.live_allocations) == (1, 2, 2)
            h.release()
        await until(lambda: gc.collect() >= 0 and gpu.statistics().live_allocations == 1)
        assert gpu.statistics().in_flight == 0
        np.testing.assert_array_equal(await gpu.to_host(y), xh + yh)
    backend.check_freed(gpu)


async def test_forgotten_future_error_surfaces_at_exit(backend: Backend) -> None:
    """A host closure that raises fails its submission; nobody awaits it, so
    the error comes out of the scope's exit. The work after it still ran."""
    out = np.zeros(N, np.float32)

    def bad() -> None:
        raise RuntimeError("nobody awaited me")

    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="nobody awaited me")):
        async with backend.open_scope(streams=1) as gpu:
            await preload(gpu)
            x = await gpu.to_device(host())
            async with backend.held(gpu):
                gpu.submit(ops.host_closure(bad))  # the future is dropped at once
                gpu.submit(add(x, 1.0).then(lambda a: ops.copy(out, a)))
                gc.collect()
                st = gpu.statistics()
                assert (st.in_flight, st.host_closures_pending) == (2, 1)
    np.testing.assert_array_equal(out, host() + 1)
    backend.check_freed(gpu)


async def test_forgotten_kernel_fault_surfaces_at_exit(backend: Backend) -> None:
    if backend.sim is None:
        pytest.skip("an asynchronous kernel fault is sticky on a real GPU; injected on the simulator only")
    sim = backend.sim
    with pytest.RaisesGroup(pytest.RaisesExc(trio_cuda.LaunchError, match="CUDA_ERROR_LAUNCH_FAILED")):
        async with backend.open_scope() as gpu:
            x = await gpu.to_device(host())
            async with backend.held(gpu):
                sim.inject_fault("kernel_fault")
                gpu.submit(add(x, 1.0))
                assert gpu.statistics().pending_errors == 0  # not failed yet: held
    backend.check_freed(gpu)


# --------------------------------------------------------------------------- rule 5: scope exit


async def test_scope_exit_waits_for_in_flight_work(backend: Backend) -> None:
    out = np.zeros(N, np.float32)
    async with trio.open_nursery() as nursery:
        async with backend.open_scope() as gpu:
            await preload(gpu)
            x = await gpu.to_device(host())
            h = await backend.held(gpu).start()
            gpu.submit(add(x, 1.0).then(lambda a: ops.copy(out, a)))  # future dropped
            nursery.start_soon(release_after, h, 0.05)
            t0 = time.perf_counter()
        elapsed = time.perf_counter() - t0
    assert elapsed >= 0.04
    assert x.closed
    np.testing.assert_array_equal(out, host() + 1)  # retired (finishers ran) before exit returned
    backend.check_freed(gpu)


async def test_scope_exit_on_error_drains_and_reraises_unwrapped(backend: Backend) -> None:
    out = np.zeros(N, np.float32)
    async with trio.open_nursery() as nursery:
        with pytest.raises(KeyError, match="boom"):
            async with backend.open_scope() as gpu:
                await preload(gpu)
                x = await gpu.to_device(host())
                h = await backend.held(gpu).start()
                gpu.submit(add(x, 1.0).then(lambda a: ops.copy(out, a)))
                nursery.start_soon(release_after, h, 0.03)
                t0 = time.perf_counter()
                raise KeyError("boom")
        assert time.perf_counter() - t0 >= 0.025
    np.testing.assert_array_equal(out, host() + 1)
    backend.check_freed(gpu)


async def test_scope_exit_on_cancellation_drains_shielded(backend: Backend) -> None:
    out = np.zeros(N, np.float32)
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as cs:
            async with backend.open_scope() as gpu:
                await preload(gpu)
                x = await gpu.to_device(host())
                h = await backend.held(gpu).start()
                gpu.submit(add(x, 1.0).then(lambda a: ops.copy(out, a)))
                nursery.start_soon(release_after, h, 0.03)
                t0 = time.perf_counter()
                cs.cancel()
                await trio.sleep_forever()
        assert cs.cancelled_caught
        assert time.perf_counter() - t0 >= 0.025
    np.testing.assert_array_equal(out, host() + 1)
    backend.check_freed(gpu)


async def test_drain_timeout_quarantines_with_a_resource_warning(backend: Backend) -> None:
    with pytest.warns(ResourceWarning, match=r"drain_timeout=0\.05"):
        async with backend.open_scope(streams=1, drain_timeout=0.05) as gpu:
            await preload(gpu)
            x = await gpu.to_device(host())
            ptr = x.ptr
            h = await backend.held(gpu).start()
            fut = gpu.submit(add(x, 1.0))
            t0 = time.perf_counter()
    assert time.perf_counter() - t0 >= 0.04
    assert h.holding  # the GPU has still not run it
    st = gpu.statistics()
    assert (st.in_flight, st.quarantined, st.quarantined_leases) == (0, 1, 1)
    assert (st.live_allocations, st.quarantined_bytes) == (1, N * 4)  # never freed
    with pytest.raises(trio_cuda.CompletionUnknownError, match="drain_timeout"):
        fut.wait_nowait()
    # The GPU finishes later, on memory that is still allocated. The core did
    # not close the driver context on timeout, so opening the gate is safe.
    h.release()
    if backend.sim is not None:
        assert ptr in backend.live_ptrs()
        assert backend.sim.violations == []
    else:
        await trio.sleep(0.01)  # let the (tiny) kernel finish before the next test


# --------------------------------------------------------------------------- rule 6: partial errors


@pytest.mark.parametrize("how", ["closure_raises", "second_piece_rejected"])
async def test_partial_error_keeps_the_enqueued_part_retained(backend: Backend, how: str) -> None:
    async with backend.open_scope() as gpu:
        await preload(gpu)
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        if how == "closure_raises":

            def second(out: object) -> Any:
                raise ValueError("closure failed")

            error, match = ValueError, "closure failed"
        else:

            def second(out: object) -> Any:
                # valid to build, rejected at enqueue: more shared memory than any device has
                return ADD.launch(y, np.float32(1), N, grid=2, block=128, shared_mem=1 << 30)

            error, match = trio_cuda.KernelArgumentError, "shared_mem"
        async with backend.held(gpu) as h:
            with pytest.raises(error, match=match):
                await gpu.run(add(x, 1.0).then(second))
            await trio.sleep(0.02)
            st = gpu.statistics()
            assert (st.in_flight, st.leases_held, st.retained_bytes) == (1, 1, N * 4)
            assert st.pending_errors == 0  # the caller saw the error
            h.release()
        await settle(gpu)
        assert gpu.statistics().leases_held == 0
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)  # the first part ran
        np.testing.assert_array_equal(await gpu.to_host(y), host())  # the second never enqueued
        assert gpu.statistics().pending_errors == 0
    backend.check_freed(gpu)


# --------------------------------------------------------------------------- rule 7: unknown completion


async def test_unknown_completion_quarantines_and_poisons(backend: Backend) -> None:
    if backend.sim is None:
        pytest.skip("a sticky error breaks a real context; test_cuda_backend covers it in a subprocess")
    sim = backend.sim
    async with backend.open_scope() as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        async with backend.held(gpu) as h:
            sim.inject_fault("completion_unknown")
            fut = gpu.submit(saxpy(2.0, x, y))
            h.release()
            with pytest.raises(trio_cuda.CompletionUnknownError, match="could not be established"):
                await fut.wait()
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
        z = await gpu.to_device(host())  # other work still runs
        await gpu.run(add(z, 1.0))
        np.testing.assert_array_equal(await gpu.to_host(z), host() + 1)
    assert backend.live_ptrs() == ptrs  # quarantined memory is never freed
    assert gpu.statistics().quarantined_bytes == 2 * N * 4


# --------------------------------------------------------------------------- rule 2: leases and conflicts


def wait_labels(sim: SimDevice, stream: int) -> list[str]:
    return [e.label for e in sim.trace if e.kind == "wait_marker" and e.stream == stream]


async def test_cross_stream_raw_waits_device_side_for_the_held_writer(backend: Backend) -> None:
    async with backend.open_scope(streams=2) as gpu:
        await preload(gpu)
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        z = await gpu.to_device(host(-1.0), stream=s1)
        async with backend.held(gpu, [s0]) as h:  # only the writer's stream
            fw = gpu.submit(add(x, 100.0), stream=s0)
            fr = gpu.submit(copy(x, z), stream=s1)  # nothing blocks the host
            assert gpu.statistics().leases_held == 3
            await trio.sleep(0.05)
            assert not fr.done()  # its free stream waits for the held writer
            assert not fw.done()
            h.release()
            assert await fr.wait() is z
            assert await fw.wait() is x
        np.testing.assert_array_equal(await gpu.to_host(z), host() + 100)  # saw the writer's values
        if backend.sim is not None:
            assert wait_labels(backend.sim, 1)
    backend.check_freed(gpu)


@pytest.mark.parametrize("kind", ["war", "waw"])
async def test_cross_stream_write_conflicts_wait_for_held_work(backend: Backend, kind: str) -> None:
    async with backend.open_scope(streams=2) as gpu:
        await preload(gpu)
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        y = await gpu.to_device(host(0.0), stream=s0)
        async with backend.held(gpu, [s0]) as h:
            if kind == "war":
                first = gpu.submit(copy(x, y), stream=s0)  # reads x, held
            else:
                first = gpu.submit(ops.fill(x, 1.0), stream=s0)  # writes x, held
            second = gpu.submit(ops.fill(x, 5.0), stream=s1)  # writes x on a free stream
            await trio.sleep(0.05)
            assert not second.done()
            h.release()
            await second.wait()
            await first.wait()
        if kind == "war":
            np.testing.assert_array_equal(await gpu.to_host(y), host())  # read before the overwrite
        np.testing.assert_array_equal(await gpu.to_host(x), host(5.0))  # the later write landed last
    backend.check_freed(gpu)


async def test_reads_never_wait_for_reads_on_other_streams(backend: Backend) -> None:
    async with backend.open_scope(streams=3, conflicts="error") as gpu:
        await preload(gpu)
        s0, s1, s2 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        o1 = gpu.empty(N, np.float32, stream=s1)
        o2 = gpu.empty(N, np.float32, stream=s2)
        async with backend.held(gpu, [s1]) as h:
            f1 = gpu.submit(copy(x, o1), stream=s1)  # a held reader of x
            f2 = gpu.submit(copy(x, o2), stream=s2)  # no AccessConflictError
            assert gpu.statistics().leases_held == 4  # x twice (shared) + o1 + o2
            with trio.fail_after(2):
                assert await f2.wait() is o2  # no wait on the held reader
            assert not f1.done()
            h.release()
            assert await f1.wait() is o1
        for o in (o1, o2):
            np.testing.assert_array_equal(await gpu.to_host(o), host())
    backend.check_freed(gpu)


async def test_conflicts_error_raises_and_enqueues_nothing(backend: Backend) -> None:
    async with backend.open_scope(streams=2, conflicts="error") as gpu:
        await preload(gpu)
        s0, s1 = gpu.streams
        x = await gpu.to_device(host(), stream=s0)
        y = await gpu.to_device(host(-1.0), stream=s1)
        async with backend.held(gpu, [s0]) as h:
            fut = gpu.submit(add(x, 1.0), stream=s0)
            before = gpu.statistics()
            pending = backend.sim.pending if backend.sim is not None else None
            with pytest.raises(trio_cuda.AccessConflictError, match=r"read-after-write .* stream 0"):
                gpu.submit(copy(x, y), stream=s1)
            with pytest.raises(trio_cuda.AccessConflictError, match="write-after-write"):
                await gpu.run(ops.fill(x, 0.0), stream=s1)
            assert gpu.statistics() == before  # nothing retained, no lease taken
            if backend.sim is not None:
                assert backend.sim.pending == pending  # nothing enqueued
            h.release()
            await fut.wait()
        await gpu.run(copy(x, y), stream=s1)  # fine once the writer retired
        np.testing.assert_array_equal(await gpu.to_host(y), host() + 1)
        # and write-after-read the other way round
        async with backend.held(gpu, [s0]) as h:
            fut = gpu.submit(copy(x, y), stream=s0)
            before = gpu.statistics()
            with pytest.raises(trio_cuda.AccessConflictError, match="write-after-read"):
                gpu.submit(ops.fill(x, 0.0), stream=s1)
            assert gpu.statistics() == before
            h.release()
            await fut.wait()
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)
    backend.check_freed(gpu)


# --------------------------------------------------------------------------- rule 9: freeing


async def test_close_while_in_flight_defers_the_free(backend: Backend) -> None:
    async with backend.open_scope() as gpu:
        await preload(gpu)
        x = await gpu.to_device(host())
        ptr = x.ptr
        async with backend.held(gpu) as h:
            fut = gpu.submit(add(x, 1.0))
            x.close()
            assert x.closed
            await trio.sleep(0.02)
            assert gpu.statistics().live_allocations == 1
            if backend.sim is not None:
                assert ptr in backend.live_ptrs()
            h.release()
            assert await fut.wait() is x
        await settle(gpu)
        assert gpu.statistics().live_allocations == 0
    backend.check_freed(gpu)


async def test_async_with_array_and_gc_defer_the_free(backend: Backend) -> None:
    async with backend.open_scope() as gpu:
        await preload(gpu)
        a = gpu.empty(N, np.float32)
        b = gpu.empty(N, np.float32)
        async with backend.held(gpu) as h:
            async with a:
                gpu.submit(ops.fill(a, 1.0))
            assert a.closed
            gpu.submit(ops.fill(b, 2.0))
            del b
            gc.collect()
            await trio.sleep(0.02)
            st = gpu.statistics()
            assert (st.in_flight, st.live_allocations) == (2, 2)
            h.release()
        await until(lambda: gc.collect() >= 0 and gpu.statistics().live_allocations == 0)
    backend.check_freed(gpu)


async def test_async_on_retains_nothing(backend: Backend) -> None:
    async with backend.open_scope() as gpu:
        await preload(gpu)
        s0 = gpu.streams[0]
        x = await gpu.to_device(host())
        op = add(x, 1.0)
        async with backend.held(gpu) as h:
            before = gpu.statistics()
            assert unsafe.async_on(op, s0) is x
            assert gpu.statistics() == before  # no submission, lease, owner or marker
            if backend.sim is not None:
                # the caller's duty: closing now frees at once, under the held kernel
                x.close()
                assert gpu.statistics().live_allocations == before.live_allocations - 1
                assert backend.live_ptrs() == set()
                h.release()
                assert [v.kind for v in backend.sim.violations] == ["use_after_free"]
                backend.sim.clear_violations()
            else:
                # on a real GPU the caller keeps x alive and orders the read
                h.release()
        if backend.sim is None:
            np.testing.assert_array_equal(await gpu.to_host(x, stream=s0), host() + 1)
    backend.check_freed(gpu)


# --------------------------------------------------------------------------- rule 10: handoff, host closures


async def test_host_closures_run_in_stream_order_on_the_loop_thread(backend: Backend) -> None:
    events: list[tuple[str, int]] = []

    def probe(tag: str) -> str:
        events.append((tag, threading.get_ident()))
        return tag

    async with backend.open_scope(streams=1) as gpu:
        await preload(gpu)
        x = await gpu.to_device(host())
        async with backend.held(gpu) as h:
            op = (
                add(x, 1.0)
                .then(lambda _: ops.host_closure(probe, "a"))
                .then(lambda _: add(x, 1.0))
                .then(lambda _: ops.host_closure(probe, "b"))
            )
            f1 = gpu.submit(op)
            f2 = gpu.submit(ops.host_closure(probe, "c"))
            await trio.sleep(0.05)
            assert events == []  # none ran ahead of the work before it
            assert gpu.statistics().host_closures_pending == 3
            h.release()
            assert await f2.wait() == "c"
            assert await f1.wait() == "b"
        assert [tag for tag, _ in events] == ["a", "b", "c"]
        assert {tid for _, tid in events} == {threading.get_ident()}
        assert gpu.statistics().host_closures_pending == 0
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 2)
    backend.check_freed(gpu)


async def test_host_closure_error_reaches_the_awaiting_task_and_the_stream_goes_on(
    backend: Backend,
) -> None:
    def bad() -> None:
        raise RuntimeError("closure exploded")

    async with backend.open_scope(streams=1) as gpu, trio.open_nursery() as nursery:
        await preload(gpu)
        x = await gpu.to_device(host())
        async with backend.held(gpu) as h:
            nursery.start_soon(release_after, h, 0.03)
            with pytest.raises(RuntimeError, match="closure exploded"):
                await gpu.run(ops.host_closure(bad).then(lambda _: add(x, 1.0)))
        await gpu.run(add(x, 1.0))  # later work on the stream runs too
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 2)
        await settle(gpu)
        st = gpu.statistics()
        assert (st.host_closures_pending, st.pending_errors) == (0, 0)
    backend.check_freed(gpu)


async def test_waiting_on_held_work_never_blocks_the_loop(backend: Backend) -> None:
    ticks = 0
    max_gap = 0.0

    async def ticker() -> None:
        nonlocal ticks, max_gap
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            max_gap = max(max_gap, now - last)
            last = now
            ticks += 1

    async with backend.open_scope() as gpu:
        await preload(gpu)
        x = await gpu.to_device(host())
        async with backend.held(gpu) as h, trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            nursery.start_soon(release_after, h, 0.1)
            t0 = time.perf_counter()
            assert await gpu.run(add(x, 1.0)) is x
            assert time.perf_counter() - t0 >= 0.09
            nursery.cancel_scope.cancel()
        assert ticks >= 20
        assert max_gap < 0.05
        np.testing.assert_array_equal(await gpu.to_host(x), host() + 1)
    backend.check_freed(gpu)
