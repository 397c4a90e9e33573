"""The simulator's time under Trio's clocks: timed work (``kernel_time``,
``copy_time``) is measured and waited on the Trio run's own clock.

Under ``trio.testing.MockClock(autojump_threshold=0)`` a kernel takes virtual
time and the clock jumps to it; under a ``MockClock`` without autojump, time
moves only when the test calls ``clock.jump`` and the work completes then;
under the default clock it takes real time. Every program runs under
``run_bounded`` (or a subprocess with a timeout): the simulated times are far
longer than the bound, so only virtual time can finish them in time, and a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import importlib.metadata
import time

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers.guard import SCALE, run_bounded
from tests.helpers.kernels import add, saxpy
from trio_cuda import ops
from trio_cuda.testing import SimDevice, SimHost

pytest_plugins = ["pytester"]

N = 64
#: simulated seconds per command: far past every bound, so that only a clock
#: that moves virtual time can complete the work in time
LONG = 60.0


def arange() -> np.ndarray:
    return np.arange(N, dtype=np.float32)


def autojump() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


# --------------------------------------------------------------------------- autojump


def test_autojump_kernel_takes_exactly_its_virtual_time() -> None:
    async def main() -> tuple[float, np.ndarray]:
        sim = SimDevice(kernel_time=LONG)
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(arange())
            y = await gpu.to_device(np.ones(N, np.float32))
            t0 = trio.current_time()
            await gpu.run(saxpy(2.0, x, y))
            elapsed = trio.current_time() - t0
            return elapsed, await gpu.to_host(y)

    elapsed, y = run_bounded(main, clock=autojump())
    assert elapsed == pytest.approx(LONG)
    np.testing.assert_array_equal(y, 2 * arange() + 1)


def test_autojump_serial_and_overlapping_work_in_virtual_time() -> None:
    async def main() -> tuple[float, float, list[float]]:
        sim = SimDevice(kernel_time=LONG)
        async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
            s0, s1 = gpu.streams
            x = await gpu.to_device(arange(), stream=s0)
            y = await gpu.to_device(arange(), stream=s1)
            await gpu.run(add(x, 0.0), stream=s0)  # the kernel is loaded: no host time below
            t0 = trio.current_time()
            futs = [gpu.submit(add(x, 1.0), stream=s0) for _ in range(3)]
            for f in futs:
                await f.wait()
            serial = trio.current_time() - t0
            t1 = trio.current_time()
            a = gpu.submit(add(x, 1.0), stream=s0)
            b = gpu.submit(add(y, 1.0), stream=s1)
            await a.wait()
            await b.wait()
            overlapped = trio.current_time() - t1
            durations = [e.t_end - e.t_start for e in sim.trace if e.kind == "launch"]
            return serial, overlapped, durations

    serial, overlapped, durations = run_bounded(main, clock=autojump())
    assert serial == pytest.approx(3 * LONG)  # back to back on one stream
    assert overlapped == pytest.approx(LONG)  # two streams run at once
    assert durations
    assert all(d == pytest.approx(LONG) for d in durations)


def test_autojump_copies_take_their_virtual_time() -> None:
    async def main() -> tuple[float, np.ndarray]:
        sim = SimDevice(copy_time=LONG)
        async with trio_cuda.open_scope(device=sim) as gpu:
            t0 = trio.current_time()
            x = await gpu.to_device(arange())
            got = await gpu.to_host(x)
            return trio.current_time() - t0, got

    elapsed, got = run_bounded(main, clock=autojump())
    assert elapsed == pytest.approx(2 * LONG)
    np.testing.assert_array_equal(got, arange())


def test_autojump_scope_exit_drains_timed_work() -> None:
    async def main() -> tuple[float, list[object]]:
        sim = SimDevice(kernel_time=LONG)
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(arange())
            await gpu.run(add(x, 0.0))
            t0 = trio.current_time()
            for _ in range(4):
                gpu.submit(add(x, 1.0))  # nobody awaits them: the exit does
        return trio.current_time() - t0, sim.live_allocations

    elapsed, live = run_bounded(main, clock=autojump())
    assert elapsed == pytest.approx(4 * LONG)
    assert live == []


def test_autojump_many_short_kernels_never_stall() -> None:
    """Deadlines converted between the device clock and Trio's are subject to
    float rounding: work due at a deadline still runs when it passes."""

    async def main() -> tuple[float, np.ndarray]:
        sim = SimDevice(kernel_time=0.1)
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(np.zeros(N, np.float32))
            t0 = trio.current_time()
            for _ in range(50):
                await gpu.run(add(x, 1.0))
            return trio.current_time() - t0, await gpu.to_host(x)

    elapsed, x = run_bounded(main, clock=autojump())
    assert elapsed == pytest.approx(50 * 0.1)
    np.testing.assert_array_equal(x, np.full(N, 50, np.float32))


def test_autojump_on_a_sim_host_peer_copy() -> None:
    async def main() -> tuple[float, np.ndarray]:
        host = SimHost(2, copy_time=LONG)
        async with trio_cuda.open_scope(device=host[0]) as a, trio_cuda.open_scope(device=host[1]) as b:
            x = await a.to_device(arange())
            y = b.empty(N, np.float32)
            t0 = trio.current_time()
            await b.run(ops.copy(y, x))
            elapsed = trio.current_time() - t0
            return elapsed, await b.to_host(y)

    elapsed, y = run_bounded(main, clock=autojump())
    assert elapsed == pytest.approx(LONG)
    np.testing.assert_array_equal(y, arange())


# --------------------------------------------------------------------------- no autojump


def test_without_autojump_work_completes_when_the_test_jumps() -> None:
    async def main(clock: trio.testing.MockClock) -> list[bool]:
        seen: list[bool] = []
        sim = SimDevice(kernel_time=LONG)
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(arange())
            y = await gpu.to_device(np.zeros(N, np.float32))
            fut = gpu.submit(saxpy(1.0, x, y))
            for step in (0.0, LONG / 2, LONG / 2):
                clock.jump(step)
                await trio.testing.wait_all_tasks_blocked()
                seen.append(fut.done())
            np.testing.assert_array_equal(await gpu.to_host(y), arange())
        return seen

    clock = trio.testing.MockClock()
    assert run_bounded(main, clock, clock=clock) == [False, False, True]


def test_without_autojump_scope_exit_waits_for_the_jump() -> None:
    async def main(clock: trio.testing.MockClock) -> tuple[bool, bool]:
        sim = SimDevice(kernel_time=LONG)
        exited = trio.Event()

        async def user() -> None:
            async with trio_cuda.open_scope(device=sim) as gpu:
                x = await gpu.to_device(arange())
                gpu.submit(add(x, 1.0))
            exited.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(user)
            await trio.testing.wait_all_tasks_blocked()
            before = exited.is_set()
            clock.jump(LONG)
            await exited.wait()
        return before, sim.live_allocations == []

    clock = trio.testing.MockClock()
    assert run_bounded(main, clock, clock=clock) == (False, True)


# --------------------------------------------------------------------------- the real clock


def test_real_clock_timed_work_takes_real_time() -> None:
    kernel_time = 0.05

    async def main() -> tuple[float, float]:
        sim = SimDevice(kernel_time=kernel_time)
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(arange())
            await gpu.run(add(x, 0.0))
            t0, w0 = trio.current_time(), time.perf_counter()
            await gpu.run(add(x, 1.0))
            return trio.current_time() - t0, time.perf_counter() - w0

    elapsed, wall = run_bounded(main)
    assert elapsed >= kernel_time * 0.99
    assert wall >= kernel_time * 0.99
    assert wall < 5 * SCALE


def test_one_device_across_runs_of_different_clocks() -> None:
    """A device used under the real clock, then under a MockClock, then
    outside any run: its time never goes back, and each run's work takes that
    run's time (not the distance between the clocks)."""
    sim = SimDevice(kernel_time=0.01)

    async def work() -> float:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(arange())
            await gpu.run(add(x, 0.0))
            t0 = trio.current_time()
            await gpu.run(add(x, 1.0))
            return trio.current_time() - t0

    assert run_bounded(work) >= 0.01 * 0.99
    sim.kernel_time = LONG
    assert run_bounded(work, clock=autojump()) == pytest.approx(LONG)
    sim.kernel_time = 0.01
    assert run_bounded(work) < 5 * SCALE  # not LONG: the device went on from where it was
    enqueued = [e.t_enqueue for e in sorted(sim.trace, key=lambda e: e.seq)]
    assert len(enqueued) > 6
    assert enqueued == sorted(enqueued)
    assert sim.violations == []
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- pytest fixtures

CLOCK_TESTS = """
import numpy as np
import pytest
import trio
import trio.testing
import trio_cuda

SRC = r'''
extern "C" __global__ void inc(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
'''

def inc_on_cpu(x, n):
    x[:n] += 1

inc = trio_cuda.Kernel.from_source(
    SRC, "inc", params=[trio_cuda.InOut("f4"), trio_cuda.Scalar("i4")], reference=inc_on_cpu
)

@pytest.mark.trio_cuda_sim(kernel_time=LONG)
async def test_autojump(autojump_clock, trio_cuda_scope):
    x = await trio_cuda_scope.to_device(np.zeros(8, np.float32))
    t0 = trio.current_time()
    await trio_cuda_scope.run(inc.launch(x, 8, grid=1, block=8))
    assert trio.current_time() - t0 == pytest.approx(LONG)
    np.testing.assert_array_equal(await trio_cuda_scope.to_host(x), np.ones(8, np.float32))

@pytest.mark.trio_cuda_sim(kernel_time=LONG)
async def test_jump(mock_clock, trio_cuda_scope):
    x = await trio_cuda_scope.to_device(np.zeros(8, np.float32))
    fut = trio_cuda_scope.submit(inc.launch(x, 8, grid=1, block=8))
    await trio.testing.wait_all_tasks_blocked()
    assert not fut.done()
    mock_clock.jump(LONG)
    await fut.wait()
    np.testing.assert_array_equal(await trio_cuda_scope.to_host(x), np.ones(8, np.float32))

@pytest.mark.trio_cuda_sim(kernel_time=LONG)
async def test_exit_drains(autojump_clock, trio_cuda_scope):
    x = await trio_cuda_scope.to_device(np.zeros(8, np.float32))
    for _ in range(3):
        trio_cuda_scope.submit(inc.launch(x, 8, grid=1, block=8))  # the fixture's exit drains them
"""


def _plugin_args() -> list[str]:
    """Load the plugin once: by its entry-point name where trio_cuda is
    installed with it, else by module."""
    plugin = "trio_cuda.testing.pytest_plugin"
    installed = any(ep.value == plugin for ep in importlib.metadata.entry_points(group="pytest11"))
    return ["-p", "trio_cuda" if installed else plugin]


def test_plugin_fixtures_under_the_mock_clock_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntrio_mode = true\nfilterwarnings = error\n")
    pytester.makepyfile(test_user=CLOCK_TESTS.replace("LONG", repr(LONG)))
    result = pytester.runpytest_subprocess(*_plugin_args(), "-p", "no:cacheprovider", timeout=60 * SCALE)
    result.assert_outcomes(passed=3)
