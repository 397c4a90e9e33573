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
