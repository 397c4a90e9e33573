"""What a fresh typed launch and its submission keep: the objects per launch.

A launch made by the compiled typed path keeps its accesses as its kernel's
shared modes (``ArrayModes``) and makes the (array, access) pairs only when
Python asks for them; its lease plan is its allocations' tuple and a flag;
the loaded function it is checked against is the kernel table's shared pair;
its backend scratch space is made on first use. A fresh launch submitted
once keeps five container objects until it is retired."""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import stub_source
from trio_cuda import In, InOut, Out, Scalar
from trio_cuda._core._completion import Submission
from trio_cuda._core._future import DeviceFuture
from trio_cuda._core._launch import ArrayModes, KernelLaunch, PreparedLaunch
from trio_cuda._core._ops import Access
from trio_cuda._core._submit import launch_lease_plan
from trio_cuda.testing import SimDevice


def _kernel() -> trio_cuda.Kernel:
    return trio_cuda.Kernel.from_source(
        stub_source("k"),
        "k",
        params=[In("f4"), Scalar("i4"), InOut("f4"), Out("f4")],
        reference=trio_cuda.NO_REFERENCE,
    )


def _pairs(launch: Any) -> list[tuple[int, Any]]:
    return [(id(a), m) for a, m in internals.accesses_of(launch)]


@compiled_only
async def test_a_typed_launch_keeps_its_kernel_s_modes_and_makes_its_accesses_when_asked() -> None:
    k = _kernel()
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y, z = (gpu.zeros(8, "f4") for _ in range(3))
        a = k.launch(x, 3, y, z, grid=1, block=8)
        b = k.launch(z, 4, x, y, grid=1, block=8)
        assert type(a._acc) is ArrayModes
        assert a._acc is b._acc
        assert list(a._acc) == [Access.READ, None, Access.WRITE, Access.WRITE]
        checked = internals.checked_launch_function(type(k))(k, (x, 3, y, z), a.prepared.config)
        assert _pairs(a) == _pairs(checked)
        assert type(a._acc) is tuple  # made once, then kept
        assert internals.accesses_of(a) is internals.accesses_of(a)
        # two arrays of one allocation: merged at once (an exact tuple, as before)
        shared = k.launch(x, 1, x, y, grid=1, block=8)
        assert type(shared._acc) is tuple
        assert _pairs(shared) == [(id(x), Access.WRITE), (id(y), Access.WRITE)]
        # its lease plan: the allocations, each once, and the flag
        allocs, simple = launch_lease_plan(b)
        assert allocs is b._lease_plan
        assert simple is True
        assert [id(m) for m in allocs] == [id(z._alloc), id(x._alloc), id(y._alloc)]
        assert internals.lease_plan_of(shared) is None  # (made by its first safe submission)
        got = launch_lease_plan(shared)
        assert [id(m) for m in got[0]] == [id(x._alloc), id(y._alloc)]
        assert got[1] is True
        # both run, and take their leases from the modes
        await gpu.run(b)
        await gpu.run(a)
        await gpu.run(shared)


@compiled_only
async def test_lazy_accesses_take_the_same_leases_as_the_pairs() -> None:
    """A submission of a launch whose accesses are modes leases what the
    same launch with its pairs made leases (the compiled lease path walks
    either form), and a cross-stream writer is ordered for both."""
    k = _kernel()
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x, y, z = (gpu.zeros(8, "f4") for _ in range(3))
        s0, s1 = gpu.streams
        await trio.testing.wait_all_tasks_blocked()  # (the fills retired)
        sim.hold()
        try:
            lazy = k.launch(x, 3, y, z, grid=1, block=8)
            eager = k.launch(x, 3, y, z, grid=1, block=8)
            internals.accesses_of(eager)  # (its pairs made now)
            assert type(lazy._acc) is ArrayModes
            assert type(eager._acc) is tuple
            f1 = gpu.submit(lazy, stream=s0)
            tables = [(len(m.readers), len(m.writers), m.active) for m in (x._alloc, y._alloc, z._alloc)]
            assert tables == [(1, 0, 1), (0, 1, 1), (0, 1, 1)]
            f2 = gpu.submit(eager, stream=s1)  # writes y and z after s0's writer: ordered device-side
            assert [m.active for m in (x._alloc, y._alloc, z._alloc)] == [2, 2, 2]
            assert type(lazy._acc) is ArrayModes  # (the compiled path never made its pairs)
        finally:
            sim.release()
        await f1.wait()
        await f2.wait()
        assert [c.stream for c in sim.trace if c.kind == "wait_marker"] == [1]
    assert sim.violations == []


@compiled_only
async def test_fresh_launches_share_their_kernel_s_ready_pair_and_make_no_scratch_space() -> None:
    k = _kernel()
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y, z = (gpu.zeros(8, "f4") for _ in range(3))
        launches = [k.launch(x, i, y, z, grid=1, block=8) for i in range(3)]
        assert [op.prepared.cache for op in launches] == [None] * 3  # (made on first use)
        for op in launches:
            await gpu.run(op)
        pairs = {id(op.prepared.ready) for op in launches}
        assert len(pairs) == 1
        assert launches[0].prepared.ready == (gpu._kernels.functions, gpu._kernels.functions[k])
        fresh = k.launch(x, 9, y, z, grid=1, block=8).prepared
        assert fresh.cache is None
        assert fresh.enqueued is False
        assert fresh.scratch() is fresh.cache is not None


@compiled_only
async def test_a_fresh_launch_submitted_once_keeps_five_objects_until_it_retires() -> None:
    """The launch (its PreparedLaunch and KernelLaunch), its arguments'
    tuple, its allocations' tuple and its submission: nothing else is made
    per launch that outlives the call (the future is dropped here)."""
    k = trio_cuda.Kernel.from_source(
        stub_source("k"),
        "k",
        params=[In("f4"), In("f4"), In("f4"), In("f4"), Scalar("i4")],
        reference=trio_cuda.NO_REFERENCE,
    )
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        bufs = [gpu.zeros(8, "f4") for _ in range(4)]
        s = gpu.streams[0]
        await gpu.run(k.launch(*bufs, 1, grid=1, block=8), stream=s)
        await gpu.submit(k.launch(*bufs, 2, grid=1, block=8), stream=s).wait()  # (the table's memo made)
        sim.hold()
        kinds = (tuple, dict, list, PreparedLaunch, KernelLaunch, Submission, DeviceFuture)

        def counts() -> Counter[str]:
            return Counter(type(o).__name__ for o in gc.get_objects() if type(o) in kinds)

        gc.collect()
        gc.disable()
        try:
            before = counts()
            for i in range(200):
                gpu.submit(k.launch(bufs[0], bufs[1], bufs[2], bufs[3], i, grid=1, block=8), stream=s)
            kept = {name: n / 200 for name, n in (counts() - before).items() if n >= 20}
        finally:
            gc.enable()
            sim.release()
        await gpu.run(trio_cuda.ops.value(None), stream=s)
    # (the simulator's own records of each command are not counted)
    assert kept == {"tuple": 2.0, "PreparedLaunch": 1.0, "KernelLaunch": 1.0, "Submission": 1.0}, kept
    assert sim.violations == []
