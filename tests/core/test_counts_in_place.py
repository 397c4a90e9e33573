"""The compiled paths' counters past the small ints: changed in place only
where nothing else refers to them.

A stream's, a completion's and an allocation's counts (in flight,
completed, active leases) are ints in slots. Past CPython's small ints an
int that only its slot refers to is changed in place rather than replaced;
an int someone else holds (a user's variable, a statistics value) is
replaced as before, so what they hold never changes. These tests hold such
references while the counts pass 256 both ways and check them, and the
counts, against what the submissions imply."""

from __future__ import annotations

import trio.testing

import trio_cuda
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import stub_kernel
from trio_cuda import In, InOut, Scalar
from trio_cuda.testing import SimDevice


def _kernel() -> trio_cuda.Kernel:
    return stub_kernel(In("f4"), Scalar("i4"), InOut("f4"))


@compiled_only
async def test_counts_past_the_small_ints_keep_what_others_hold() -> None:
    k = _kernel()
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        s = gpu.streams[0]
        await trio.testing.wait_all_tasks_blocked()
        base = s.statistics()
        sim.hold()
        held: dict[int, tuple[object, object, object]] = {}
        futures = []
        try:
            for i in range(1, 701):
                futures.append(gpu.submit(k.launch(x, i, y, grid=1, block=8), stream=s))
                if i % 100 == 0:
                    # references to the current ints: these must never change
                    held[i] = (s._in_flight, x._alloc.active, y._alloc.active)
            assert s._in_flight == 700
            assert (x._alloc.active, y._alloc.active) == (700, 700)
            assert len(x._alloc.readers) == 700
            assert len(y._alloc.writers) == 1
            for i, values in held.items():
                assert values == (i, i, i)
            assert s.statistics().in_flight == 700
        finally:
            sim.release()
        for f in futures:
            await f.wait()
        after = s.statistics()
        assert after.in_flight == 0
        assert after.completed - base.completed == 700
        assert (x._alloc.active, y._alloc.active) == (0, 0)
        for i, values in held.items():
            assert values == (i, i, i)
    assert sim.violations == []


@compiled_only
async def test_a_count_someone_holds_is_replaced_not_changed() -> None:
    """The same counts, each read into a variable before every submission
    and every retirement: none of those values changes afterwards."""
    k = _kernel()
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        s = gpu.streams[0]
        await trio.testing.wait_all_tasks_blocked()
        seen: list[tuple[int, object]] = []
        sim.hold()
        try:
            futures = []
            for i in range(300):
                v = x._alloc.active
                seen.append((int(str(v)), v))  # (its value, by another route, and the object)
                futures.append(gpu.submit(k.launch(x, i, y, grid=1, block=8), stream=s))
        finally:
            sim.release()
        for f in futures:
            await f.wait()
        assert all(v == value for value, v in seen)
        assert [value for value, _ in seen] == list(range(300))
    assert sim.violations == []
