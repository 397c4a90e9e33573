"""Rule 2 under ``conflicts="error"``, for ops of several pieces.

A conflict in any piece of ``zip``, ``then``, ``map`` or ``shared`` refuses the
whole op with :class:`~trio_cuda.AccessConflictError` before any piece is
enqueued: nothing runs, nothing is retained, no lease is taken, and a caller
who retries runs the work once. Closures run once per submission, whether the
op is refused or not. Each case places the conflicting writer in flight with
``hold()``.
"""

from __future__ import annotations

import numpy as np
import pytest

import trio_cuda
from tests.helpers.kernels import add
from trio_cuda import AccessConflictError, ops
from trio_cuda.testing import SimDevice

F4 = np.float32


def _ops(a, b, calls):
    """(name, op) pairs whose first piece writes ``a`` and a later one ``b``."""

    def later(_):
        calls.append("then")
        return add(b, 1.0)

    def mapped(out):
        calls.append("map")
        return out

    shared = add(a, 1.0).shared()
    twice = ops.fill(a, 1.0).map(mapped).shared()  # used twice: its closure runs once
    return [
        ("zip", trio_cuda.zip(add(a, 1.0), add(b, 1.0))),
        ("then", add(a, 1.0).then(later)),
        ("map-then", ops.fill(a, 1.0).map(mapped).then(lambda x: ops.copy(b, x))),
        ("nested", trio_cuda.zip(ops.fill(a, 1.0), trio_cuda.zip(ops.value(3), add(b, 1.0)))),
        ("shared", trio_cuda.zip(shared, add(b, 1.0))),
        ("shared-twice", trio_cuda.zip(twice, twice.then(later), add(b, 1.0))),
        ("external", trio_cuda.zip(ops.external(lambda s: calls.append("fn"), writes=a), add(b, 1.0))),
        ("closure", ops.host_closure(lambda: calls.append("host")).then(lambda r: add(b, 1.0))),
    ]


NAMES = ["zip", "then", "map-then", "nested", "shared", "shared-twice", "external", "closure"]


@pytest.mark.parametrize("name", NAMES)
async def test_a_conflict_in_a_later_piece_refuses_the_whole_op(name):
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        s0, s1 = gpu.streams
        a = await gpu.to_device(np.zeros(8, F4), stream=s0)
        b = await gpu.to_device(np.zeros(8, F4), stream=s0)
        calls: list[str] = []
        op = dict(_ops(a, b, calls))[name]
        sim.hold()
        try:
            gpu.submit(ops.fill(b, 5.0), stream=s1)  # b's writer, in flight on another stream
            before = gpu.statistics()
            with pytest.raises(AccessConflictError, match="write-after-write"):
                gpu.submit(op, stream=s0)
            after = gpu.statistics()
            assert after.in_flight == before.in_flight
            assert after.leases_held == before.leases_held
            assert after.retained_bytes == before.retained_bytes
            assert "fn" not in calls, "an external's fn must not run for a refused op"
            assert "host" not in calls
            assert calls.count("then") <= 1
            assert calls.count("map") <= 1
        finally:
            sim.release()
        await gpu.run(ops.value(None), stream=s1)
        np.testing.assert_array_equal(await gpu.to_host(a), 0.0)  # no piece of it ever ran
        # retried once the writer completed: it runs once, the closures once more
        calls.clear()
        await gpu.run(op, stream=s0)
        assert calls.count("then") == (1 if name in ("then", "shared-twice") else 0)
        assert calls.count("map") == (1 if name in ("map-then", "shared-twice") else 0)
        got_a = await gpu.to_host(a)
        got_b = await gpu.to_host(b)
        assert np.all(got_b == (1.0 if name == "map-then" else 7.0 if name == "shared-twice" else 6.0)), got_b
        if name in ("zip", "then", "shared"):
            assert np.all(got_a == 1.0), got_a  # once, not twice
    assert sim.violations == []


@pytest.mark.parametrize("conflicts", ["order", "error"])
async def test_closures_run_once_per_submission_in_both_modes(conflicts):
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts=conflicts) as gpu:
        a = await gpu.to_device(np.zeros(8, F4))
        calls: list[str] = []

        def later(out):
            calls.append("then")
            return ops.fill(a, 2.0)

        op = ops.fill(a, 1.0).map(lambda x: calls.append("map") or x).then(later)
        assert await gpu.run(op) is a
        assert calls == ["map", "then"]
        np.testing.assert_array_equal(await gpu.to_host(a), 2.0)
    assert sim.violations == []


async def test_a_closure_that_raises_in_the_preflight_enqueues_nothing():
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, conflicts="error") as gpu:
        a = await gpu.to_device(np.zeros(8, F4))
        before = gpu.statistics()

        def boom(_):
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            gpu.submit(ops.fill(a, 1.0).then(boom))
        assert gpu.statistics().in_flight == before.in_flight
        np.testing.assert_array_equal(await gpu.to_host(a), 0.0)  # the fill never ran
    assert sim.violations == []
