"""The up-front launch checks run once per launch shape, not once per launch.

A SIMT launch is checked against the device (its limits, then what only the
loaded kernel knows) before anything is enqueued. A fresh launch of a shape
the scope already checked (the same kernel, configuration and parameter plan)
skips both; a new shape, another scope, or a tile launch is checked again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import SAXPY


class CountingChecks:
    """The scope's driver, counting ``check_launch`` calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.checks = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def check_launch(self, function: object, launch: object) -> None:
        self.checks += 1
        self.inner.check_launch(function, launch)


async def test_a_fresh_launch_of_a_checked_shape_is_not_checked_again() -> None:
    async with trio_cuda.open_scope(device="sim") as gpu:
        spy = CountingChecks(internals.driver_of(gpu))
        internals.set_driver(gpu, spy)
        x = await gpu.to_device(np.ones(256, np.float32))
        y = gpu.zeros(256, np.float32)
        for i in range(5):  # five launch objects of one shape
            await gpu.run(SAXPY.launch(np.float32(i), x, y, np.int32(256), grid=1, block=256))
        assert spy.checks == 1
        await gpu.run(SAXPY.launch(np.float32(1), x, y, np.int32(256), grid=2, block=128))
        assert spy.checks == 2  # another configuration
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(256, 11, np.float32))
    async with trio_cuda.open_scope(device="sim") as other:
        spy2 = CountingChecks(internals.driver_of(other))
        internals.set_driver(other, spy2)
        x = await other.to_device(np.ones(256, np.float32))
        y = other.zeros(256, np.float32)
        await other.run(SAXPY.launch(np.float32(1), x, y, np.int32(256), grid=1, block=256))
        assert spy2.checks == 1  # each scope checks for its own device


async def test_a_shape_that_failed_its_check_is_checked_again() -> None:
    from trio_cuda.testing import SimDevice

    # a device without thread-block clusters: the scope's device check refuses one
    async with trio_cuda.open_scope(device=SimDevice(compute_capability=(8, 0))) as gpu:
        x = await gpu.to_device(np.ones(256, np.float32))
        y = gpu.zeros(256, np.float32)
        before = gpu.statistics().submitted
        for _ in range(2):  # refused both times, by the scope: nothing remembered the shape
            b = SAXPY.builder().grid(2).block(128).cluster(2)
            op = b.arg(np.float32(1)).arg(x).arg(y).arg(np.int32(256)).finalize_unchecked()
            with pytest.raises(trio_cuda.KernelArgumentError, match="cluster"):
                gpu.submit(op)
        assert gpu.statistics().submitted == before  # nothing was submitted


async def test_launches_alternating_between_two_scopes_use_each_scopes_function() -> None:
    """A launch keeps the loaded function of the scope that checked it
    (``ready``): launches alternating between two live scopes are each
    checked once, in their own scope, and run there; a launch of one scope's
    arrays is refused by the other with nothing enqueued; and once its scope
    exited, a launch is refused there while the other scope's still runs."""
    from trio_cuda.testing import SimDevice

    sims = [SimDevice(), SimDevice()]
    async with trio_cuda.open_scope(device=sims[1]) as b:
        async with trio_cuda.open_scope(device=sims[0]) as a:
            spies = [CountingChecks(internals.driver_of(g)) for g in (a, b)]
            for g, spy in zip((a, b), spies, strict=True):
                internals.set_driver(g, spy)
            x = [await g.to_device(np.ones(256, np.float32)) for g in (a, b)]
            y = [g.zeros(256, np.float32) for g in (a, b)]
            ops = [SAXPY.launch(np.float32(1), x[i], y[i], np.int32(256), grid=1, block=256) for i in (0, 1)]
            for _ in range(3):
                await a.run(ops[0])
                await b.run(ops[1])
            assert [s.checks for s in spies] == [1, 1]
            for i, g in enumerate((a, b)):
                np.testing.assert_array_equal(await g.to_host(y[i]), np.full(256, 3, np.float32))
            before = b.statistics().submitted
            with pytest.raises(ValueError, match="scope"):
                await b.run(ops[0])
            assert b.statistics().submitted == before
        with pytest.raises(trio_cuda.ScopeClosedError):
            await a.run(ops[0])
        await b.run(ops[1])
        np.testing.assert_array_equal(await b.to_host(y[1]), np.full(256, 4, np.float32))
        assert spies[1].checks == 1
    assert sims[0].violations == []
    assert sims[1].violations == []
