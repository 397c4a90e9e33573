"""Stream-choosing policies: the default lets independent work overlap.

Asserted on the simulator through the streams work lands on and what is
queued on each, never on wall time (``benchmarks/policy.py`` measures that).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import held
from tests.helpers.kernels import COPY
from trio_cuda import ops
from trio_cuda._public import ORIGINS
from trio_cuda.testing import SimDevice, SimHost

F4 = np.float32
N = 64


def _read_ref(x: Any, n: Any) -> None:
    pass


_READ = trio_cuda.Kernel.from_source(
    'extern "C" __global__ void read_f4(const float* x, int n) { }',
    "read_f4",
    params=[trio_cuda.In("f4"), trio_cuda.Scalar("i4")],
    reference=_read_ref,
)


def read(x: trio_cuda.DeviceArray) -> trio_cuda.KernelLaunch:
    """A kernel that only reads ``x``."""
    return _READ.launch(x, np.int32(x.size), grid=1, block=32)


def copy(src: trio_cuda.DeviceArray, dst: trio_cuda.DeviceArray) -> trio_cuda.KernelLaunch:
    return COPY.launch(src, dst, np.int32(src.size), grid=1, block=N)


@contextlib.contextmanager
def finishing(*sims: SimDevice) -> Iterator[None]:
    """On exit, however the block ends, run the minute-long kernels now."""
    try:
        yield
    finally:
        for sim in sims:
            sim.hold()
            sim.run_until_idle()
            sim.release()


def loads(gpu: trio_cuda.ResourceScope) -> list[int]:
    return [s.statistics().in_flight for s in gpu.streams]


async def upload_then_kernel(gpu: trio_cuda.ResourceScope, n: int = 4) -> list[trio_cuda.DeviceFuture[Any]]:
    """The common loop: ``x = await gpu.to_device(a_i)``, then a kernel on x."""
    futs = []
    for i in range(n):
        x = await gpu.to_device(np.full(N, i, F4))
        futs.append(gpu.submit(read(x)))
    return futs


# --------------------------------------------------------------------------- the default


async def test_default_is_follow_writer(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        assert type(internals.policy_of(gpu)) is trio_cuda.FollowWriter
    async with trio_cuda.open_scope(device=sim) as other:
        assert internals.policy_of(other) is not internals.policy_of(gpu)  # a fresh one per scope


async def test_default_overlaps_upload_then_kernel():
    # Uploads execute at once; each kernel "runs" for a minute, so it stays
    # in flight while the loop goes on. Each kernel must get a stream of its
    # own with nothing queued ahead of it: all four can run at once.
    sim = SimDevice(kernel_time=60.0)
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        with finishing(sim):
            futs = await upload_then_kernel(gpu)
            assert [f.stream.index for f in futs] == [0, 1, 2, 3]
            assert loads(gpu) == [1, 1, 1, 1]  # only its kernel on each stream
            assert sim.statistics().launches == 0  # none has finished: all four run at once
        assert sim.statistics().launches == 4
        for f in futs:
            await f.wait()
    assert sim.violations == []


async def test_round_robin_queues_the_same_loop_behind_itself():
    # The failure the default exists to avoid, for contrast: the kernels land
    # on streams 1, 3, 1, 3, so the last two queue behind the first two.
    sim = SimDevice(kernel_time=60.0)
    async with trio_cuda.open_scope(device=sim, streams=4, policy=trio_cuda.RoundRobin()) as gpu:
        with finishing(sim):
            futs = await upload_then_kernel(gpu)
            assert [f.stream.index for f in futs] == [1, 3, 1, 3]
            assert loads(gpu) == [0, 2, 0, 2]
        for f in futs:
            await f.wait()


async def test_default_keeps_a_dependent_chain_on_one_stream(sim):
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        x = await gpu.to_device(np.arange(N, dtype=F4))
        y, z, w = (gpu.empty(N, F4) for _ in range(3))
        other = await gpu.to_device(np.ones(N, F4))
        await trio.testing.wait_all_tasks_blocked()
        assert loads(gpu) == [0, 0, 0, 0]
        with held(sim):
            f1 = gpu.submit(copy(x, y))
            f2 = gpu.submit(copy(y, z))  # reads y: follows its writer, the tail of stream 0
            f3 = gpu.submit(copy(z, w))
            f4 = gpu.submit(read(other))  # independent: the least-loaded stream
            assert [f.stream.index for f in (f1, f2, f3, f4)] == [0, 0, 0, 1]
            assert loads(gpu) == [3, 1, 0, 0]
        assert await f3.wait() is w
        np.testing.assert_array_equal(await gpu.to_host(w), np.arange(N, dtype=F4))


async def test_default_fans_out_readers_of_one_write(sim):
    # The first reader follows the write; the writer is then no longer the
    # last work of its stream, so the next readers go to the least-loaded one.
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        x = await gpu.to_device(np.arange(N, dtype=F4))
        y = gpu.empty(N, F4)
        await trio.testing.wait_all_tasks_blocked()
        with held(sim):
            f0 = gpu.submit(copy(x, y))
            readers = [gpu.submit(read(y)) for _ in range(3)]
            assert f0.stream.index == 0
            assert [f.stream.index for f in readers] == [0, 1, 2]


async def test_default_does_not_follow_a_writer_with_work_behind_it(sim):
    async with trio_cuda.open_scope(device=sim, streams=3) as gpu:
        x = await gpu.to_device(np.arange(N, dtype=F4))
        y, z = gpu.empty(N, F4), gpu.empty(N, F4)
        await trio.testing.wait_all_tasks_blocked()
        s0 = gpu.streams[0]
        with held(sim):
            gpu.submit(copy(x, y), stream=s0)
            gpu.submit(copy(x, z), stream=s0)  # unrelated work queued behind the write of y
            assert gpu.submit(read(y)).stream.index == 1  # least-loaded, with a device-side wait


async def test_default_is_least_loaded_once_the_writer_retired(sim):
    async with trio_cuda.open_scope(device=sim, streams=3) as gpu:
        x = await gpu.to_device(np.arange(N, dtype=F4))
        y = gpu.empty(N, F4)
        await gpu.run(copy(x, y), stream=gpu.streams[2])  # retired: nothing to follow
        with held(sim):
            gpu.submit(read(x), stream=gpu.streams[0])
            assert gpu.submit(read(y)).stream.index == 1


async def test_default_follows_only_a_writer_on_a_stream_of_its_own_scope():
    # y (scope a) was last written by a copy submitted on stream 2 of scope
    # b: neither that stream nor a's stream 2 is the writer's stream of a.
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        y = a.empty(N, F4)
        src = await b.to_device(np.arange(N, dtype=F4))
        await trio.testing.wait_all_tasks_blocked()
        with held(sim):
            b.submit(ops.copy(y, src), stream=b.streams[2])
            [writer] = internals.allocation_of(y).writers
            assert writer.stream is b.streams[2]
            fut = a.submit(read(y))
            assert fut.stream is a.streams[0]  # least-loaded, with a device-side wait
        await fut.wait()
    assert sim.violations == []


# --------------------------------------------------------------------------- LeastLoaded, RoundRobin


async def test_least_loaded_takes_the_lowest_index_on_ties(sim):
    policy = trio_cuda.LeastLoaded()
    async with trio_cuda.open_scope(device=sim, streams=4, policy=policy) as gpu:
        x = await gpu.to_device(np.ones(N, F4))
        await trio.testing.wait_all_tasks_blocked()
        s = gpu.streams
        launch = read(x)
        assert policy.choose(s, launch) is s[0]  # all idle
        with held(sim):
            for i in (0, 3):
                gpu.submit(launch, stream=s[i])
            assert loads(gpu) == [1, 0, 0, 1]
            assert policy.choose(s, launch) is s[1]
            for i in (1, 2, 2):
                gpu.submit(launch, stream=s[i])
            assert loads(gpu) == [1, 1, 2, 1]
            assert policy.choose(s, launch) is s[0]
            gpu.submit(launch, stream=s[0])
            assert loads(gpu) == [2, 1, 2, 1]
            assert policy.choose(s, launch) is s[1]
            assert gpu.submit(launch).stream is s[1]
            assert policy.choose(s, launch) is s[3]


async def test_least_loaded_ignores_dependencies(sim):
    async with trio_cuda.open_scope(device=sim, streams=3, policy=trio_cuda.LeastLoaded()) as gpu:
        x = await gpu.to_device(np.arange(N, dtype=F4))
        y, z = gpu.empty(N, F4), gpu.empty(N, F4)
        await trio.testing.wait_all_tasks_blocked()
        with held(sim):
            f1 = gpu.submit(copy(x, y))
            f2 = gpu.submit(copy(y, z))
            assert [f1.stream.index, f2.stream.index] == [0, 1]
        np.testing.assert_array_equal(await gpu.to_host(z), np.arange(N, dtype=F4))


async def test_round_robin_still_works_when_asked_for(sim):
    async with trio_cuda.open_scope(device=sim, streams=3, policy=trio_cuda.RoundRobin()) as gpu:
        x = await gpu.to_device(np.ones(N, F4))  # the allocation takes stream 0
        picks = [gpu.submit(read(x)).stream.index for _ in range(5)]
        assert picks == [1, 2, 0, 1, 2]
        await gpu.run(read(x), stream=gpu.streams[2])  # pinning does not advance the turn
        assert gpu.submit(read(x)).stream.index == 0


def test_policies_are_exported():
    for name in ("FollowWriter", "LeastLoaded", "RoundRobin", "SchedulingPolicy"):
        assert getattr(trio_cuda, name).__module__ == "trio_cuda"
        assert ORIGINS[f"trio_cuda.{name}"] == "trio_cuda._core._policy"


# --------------------------------------------------------------------------- how often it is asked


class Counting:
    """A policy that counts its calls and delegates to the default."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.inner = trio_cuda.FollowWriter()

    def choose(self, streams: Sequence[trio_cuda.Stream], op: Any) -> trio_cuda.Stream:
        self.calls.append(type(op).__name__)
        return self.inner.choose(streams, op)


async def test_policy_is_asked_once_per_unpinned_submission(sim):
    policy = Counting()
    async with trio_cuda.open_scope(device=sim, streams=3, policy=policy) as gpu:
        s1 = gpu.streams[1]
        x = await gpu.to_device(np.ones(N, F4))  # one choice: allocation and copy together
        assert len(policy.calls) == 1
        y = gpu.empty(N, F4, stream=s1)  # pinned: not asked
        assert len(policy.calls) == 1

        before = len(policy.calls)
        gpu.submit(copy(x, y))  # a single launch (the hot path)
        gpu.submit(trio_cuda.zip(read(x), read(y)))  # a composite op: asked once for all of it
        gpu.submit(copy(x, y).then(lambda out: read(out)))
        await gpu.run(read(x))
        await read(y)  # ``await op`` in a scope
        assert len(policy.calls) - before == 5
        assert policy.calls[before] == "KernelLaunch"

        before = len(policy.calls)
        gpu.submit(read(x), stream=s1)
        await gpu.run(read(x), stream=s1)
        await gpu.to_device(np.ones(N, F4), stream=s1)
        assert len(policy.calls) == before  # pinned work never asks
        await gpu.to_host(y)  # unpinned: asked once
        assert len(policy.calls) == before + 1


# --------------------------------------------------------------------------- device pools


async def test_device_pool_uses_the_default_per_device():
    host = SimHost(2)
    async with trio_cuda.open_device_pool(host) as pool:
        policies = [internals.policy_of(scope) for scope in pool]
        assert [type(p) for p in policies] == [trio_cuda.FollowWriter] * 2
        assert policies[0] is not policies[1]
    async with trio_cuda.open_device_pool(host, stream_policy=trio_cuda.RoundRobin) as pool:
        assert [type(internals.policy_of(scope)) for scope in pool] == [trio_cuda.RoundRobin] * 2


async def test_device_pool_default_overlaps_upload_then_kernel():
    host = SimHost(2, kernel_time=60.0)
    async with trio_cuda.open_device_pool(host, streams=4) as pool:
        gpu = next(iter(pool))
        with finishing(*host.devices):
            futs = await upload_then_kernel(gpu)
            assert [f.stream.index for f in futs] == [0, 1, 2, 3]
        for f in futs:
            await f.wait()


@pytest.mark.parametrize("policy", [trio_cuda.FollowWriter, trio_cuda.LeastLoaded, trio_cuda.RoundRobin])
async def test_every_policy_answers_a_stream_of_the_scope_for_every_op(sim, policy):
    async with trio_cuda.open_scope(device=sim, streams=2, policy=policy()) as gpu:
        x = await gpu.to_device(np.arange(N, dtype=F4))
        y = gpu.zeros(N, F4)
        await gpu.run(trio_cuda.zip(copy(x, y), ops.value(1), ops.fill(gpu.empty(N, F4), 2.0)))
        np.testing.assert_array_equal(await gpu.to_host(y), np.arange(N, dtype=F4))
