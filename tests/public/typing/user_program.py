"""A small typed program using trio_cuda as a user would, checked with mypy --strict.

tests/public/test_typing.py type-checks it against trio_cuda as installed (its py.typed marker
makes mypy read the library's annotations); ``assert_type`` pins the types users rely on.
It also runs, on the simulator.
"""

from __future__ import annotations

import contextlib
from typing import Any, assert_type

import numpy as np
import trio

import trio_cuda
from trio_cuda import DeviceArray, DeviceFuture, DeviceOp, KernelLaunch, ResourceScope, ScopeStatistics
from trio_cuda.testing import SimDevice, Violation

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def saxpy_on_cpu(a: np.float32, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], n: np.int32) -> None:
    y[:n] = a * x[:n] + y[:n]


saxpy = trio_cuda.Kernel.from_source(
    SAXPY,
    "saxpy",
    params=[trio_cuda.Scalar("f4"), trio_cuda.In("f4"), trio_cuda.InOut("f4"), trio_cuda.Scalar("i4")],
    reference=saxpy_on_cpu,
)
assert_type(saxpy, trio_cuda.Kernel)


def twice(n: int) -> DeviceOp[float]:
    return trio_cuda.ops.value(2.0 * n)


async def step(gpu: ResourceScope, n: int) -> np.ndarray[Any, Any]:
    x = await gpu.to_device(np.ones(n, np.float32))
    assert_type(x, DeviceArray)
    y = gpu.zeros(n, np.float32)
    launch = saxpy.launch(np.float32(2.0), x, y, n, grid=1, block=n)
    assert_type(launch, KernelLaunch)
    await gpu.run(launch)
    fut = gpu.submit(trio_cuda.ops.value(n))
    assert_type(fut, DeviceFuture[int])
    assert_type(await fut.wait(), int)
    assert_type(fut.done(), bool)
    host = await gpu.to_host(y)
    assert_type(host, np.ndarray[Any, Any])
    return host


async def main() -> None:
    sim = SimDevice(kernel_time=0.001)
    manager = trio_cuda.open_scope(sim, streams=2, conflicts="order")
    assert_type(manager, contextlib.AbstractAsyncContextManager[ResourceScope])
    async with manager as gpu:
        assert_type(gpu, ResourceScope)
        assert_type(trio_cuda.current_scope(), ResourceScope)
        y = await step(gpu, 8)
        assert y.tolist() == [2.0] * 8

        three = trio_cuda.ops.value(3)
        assert_type(three, DeviceOp[int])
        assert_type(await gpu.run(three), int)
        assert_type(await three, int)
        label = three.map(str)
        assert_type(label, DeviceOp[str])
        chained = three.then(twice)
        assert_type(chained, DeviceOp[float])
        assert_type(await gpu.run(chained, stream=gpu.streams[1]), float)
        both = trio_cuda.zip(label, chained.shared())
        assert_type(both, DeviceOp[tuple[str, float]])
        assert await gpu.run(both) == ("3", 6.0)

        arr = gpu.empty(4, np.float32)
        assert_type(trio_cuda.ops.fill(arr, 1.5), DeviceOp[DeviceArray])
        await gpu.run(trio_cuda.ops.fill(arr, 1.5).then(lambda a: trio_cuda.ops.copy(y[:4], a)))
        ran: list[str] = []
        await gpu.run(trio_cuda.ops.host_closure(ran.append, "ran"))
        assert ran == ["ran"]
        # a host closure's output is its value once awaited (a HostResult inside then/map)
        closure = trio_cuda.ops.host_closure(len, "four")
        assert_type(closure, DeviceOp[trio_cuda.ops.HostResult[int]])
        assert_type(await gpu.run(closure), int)
        assert_type(await closure, int)
        pending = gpu.submit(trio_cuda.ops.host_closure(len, "four"))
        assert_type(await pending.wait(), int)
        assert await pending.wait() == 4

        stats = gpu.statistics()
        assert_type(stats, ScopeStatistics)
        assert_type(stats.in_flight, int)
    violations = sim.violations
    assert_type(violations, list[Violation])
    assert violations == []
    assert sim.live_allocations == []


if __name__ == "__main__":
    trio.run(main)
