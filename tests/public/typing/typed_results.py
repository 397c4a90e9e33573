"""The output types of device operations, as mypy --strict sees them, and at run time.

tests/public/test_typing.py type-checks this file against trio_cuda as installed; each
``assert_type`` pins the type a strict user gets from an op, a combinator, a
submission, a future, a graph or ``unsafe.async_on``. It also runs, on the simulator,
and checks that each value is what its type says.
"""

from __future__ import annotations

from typing import Any, assert_type

import numpy as np
import trio

import trio_cuda
from trio_cuda import (
    CudaGraph,
    DeviceArray,
    DeviceFuture,
    DeviceOp,
    KernelLaunch,
    ResourceScope,
    Stream,
    ops,
    unsafe,
)
from trio_cuda.testing import SimDevice

SCALE = r"""
extern "C" __global__ void scale(float* y, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= a;
}
extern "C" __global__ void split(const float* x, float* lo, float* hi, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { lo[i] = x[i] < 0 ? x[i] : 0; hi[i] = x[i] < 0 ? 0 : x[i]; }
}
extern "C" __global__ void total(const float* x, int n) {}
"""


def scale_on_cpu(y: np.ndarray[Any, Any], a: np.float32, n: np.int32) -> None:
    y[:n] *= a


def split_on_cpu(
    x: np.ndarray[Any, Any], lo: np.ndarray[Any, Any], hi: np.ndarray[Any, Any], n: np.int32
) -> None:
    lo[:n] = np.minimum(x[:n], 0)
    hi[:n] = np.maximum(x[:n], 0)


F4 = trio_cuda.Scalar("f4")
I4 = trio_cuda.Scalar("i4")
scale = trio_cuda.Kernel.from_source(
    SCALE, "scale", params=[trio_cuda.InOut("f4"), F4, I4], reference=scale_on_cpu
)
split = trio_cuda.Kernel.from_source(
    SCALE,
    "split",
    params=[trio_cuda.In("f4"), trio_cuda.Out("f4"), trio_cuda.Out("f4"), I4],
    reference=split_on_cpu,
)
total = trio_cuda.Kernel.from_source(
    SCALE, "total", params=[trio_cuda.In("f4"), I4], reference=trio_cuda.NO_REFERENCE
)

#: what every kernel launch outputs, to a type checker
LaunchOutput = DeviceArray | tuple[DeviceArray, ...] | None


def on_stream(stream: Stream) -> int:
    """``ops.external``'s function: would enqueue foreign work on ``stream``."""
    return stream.index


async def launches(gpu: ResourceScope) -> None:
    x = await gpu.to_device(np.arange(-4, 4, dtype=np.float32))
    y = await gpu.to_device(np.ones(8, np.float32))
    lo, hi = gpu.zeros(8, np.float32), gpu.zeros(8, np.float32)

    # a launch is a DeviceOp of the arrays it writes: one, several, or none
    one = scale.launch(y, 2.0, 8, grid=1, block=32)
    assert_type(one, KernelLaunch)
    op: DeviceOp[LaunchOutput] = one  # a KernelLaunch is that DeviceOp
    ops_of_anything: list[DeviceOp[object]] = [one, ops.value(1)]  # (DeviceOp is covariant)
    assert await gpu.run(trio_cuda.zip(*ops_of_anything)) == (y, 1)  # y: 2
    assert_type(await gpu.run(one), DeviceArray | tuple[DeviceArray, ...] | None)  # y: 4
    assert await gpu.run(op) is y  # y: 8
    assert await gpu.run(split.launch(x, lo, hi, 8, grid=1, block=32)) == (lo, hi)
    assert await gpu.run(total.launch(x, 8, grid=1, block=32)) is None
    built = scale.builder().grid(1).block(32).arg(y).arg(np.float32(2)).arg(np.int32(8)).finalize_unchecked()
    assert_type(built, KernelLaunch)
    # the arrays written are the caller's own: map gives an op typed by one of them
    typed = scale.launch(y, 0.25, 8, grid=1, block=32).map(lambda _: y)
    assert_type(typed, DeviceOp[DeviceArray])
    out = await gpu.run(typed)
    assert_type(out, DeviceArray)
    assert (await gpu.to_host(out)).tolist() == [2.0] * 8
    assert_type(await one, DeviceArray | tuple[DeviceArray, ...] | None)  # y: 4
    s0 = gpu.streams[0]
    assert_type(unsafe.async_on(one, s0), DeviceArray | tuple[DeviceArray, ...] | None)  # y: 8
    assert_type(unsafe.async_on(ops.value(1.5), s0), float)
    assert unsafe.async_on(ops.value(1.5), s0) == 1.5
    chained = one.then(lambda _: scale.launch(y, 8.0, 8, grid=1, block=32))
    assert_type(chained, DeviceOp[DeviceArray | tuple[DeviceArray, ...] | None])
    assert await gpu.run(chained, stream=s0) is y  # y: 128
    assert (await gpu.to_host(y)).tolist() == [128.0] * 8


async def combinators(gpu: ResourceScope) -> None:
    i, s, f = ops.value(1), ops.value("s"), ops.value(2.5)
    assert_type(i, DeviceOp[int])
    assert_type(i.map(str), DeviceOp[str])
    assert_type(i.then(lambda n: ops.value([n])), DeviceOp[list[int]])
    assert_type(i.shared(), DeviceOp[int])
    assert_type(await i.shared(), int)
    # zip: typed element by element for one to six ops
    assert_type(trio_cuda.zip(i), DeviceOp[tuple[int]])
    assert_type(trio_cuda.zip(i, s), DeviceOp[tuple[int, str]])
    assert_type(trio_cuda.zip(i, s, f), DeviceOp[tuple[int, str, float]])
    assert_type(trio_cuda.zip(i, s, f, i), DeviceOp[tuple[int, str, float, int]])
    assert_type(trio_cuda.zip(i, s, f, i, s), DeviceOp[tuple[int, str, float, int, str]])
    six = trio_cuda.zip(i, s, f, i, s, f)
    assert_type(six, DeviceOp[tuple[int, str, float, int, str, float]])
    assert await gpu.run(six) == (1, "s", 2.5, 1, "s", 2.5)
    # more, or a starred sequence: the variadic fallback
    assert_type(trio_cuda.zip(i, s, f, i, s, f, i), DeviceOp[tuple[Any, ...]])
    many: list[DeviceOp[int]] = [i, i.map(lambda n: n + 1)]
    assert_type(trio_cuda.zip(*many), DeviceOp[tuple[Any, ...]])
    assert await gpu.run(trio_cuda.zip(*many)) == (1, 2)
    fixed = (i, s)
    assert_type(trio_cuda.zip(*fixed), DeviceOp[tuple[int, str]])
    assert_type(trio_cuda.zip(), DeviceOp[tuple[()]])
    assert await gpu.run(trio_cuda.zip()) == ()
    pair = trio_cuda.zip(i, s).map(lambda t: t[1] * t[0])
    assert_type(pair, DeviceOp[str])
    assert_type(await gpu.run(pair), str)
    nested = trio_cuda.zip(trio_cuda.zip(i, f), s.shared())
    assert_type(await gpu.run(nested), tuple[tuple[int, float], str])
    assert await gpu.run(nested) == ((1, 2.5), "s")


async def helpers(gpu: ResourceScope) -> None:
    x = gpu.zeros(4, np.float32)
    host: np.ndarray[Any, np.dtype[np.float32]] = np.zeros(4, np.float32)
    assert_type(ops.fill(x, 3.0), DeviceOp[DeviceArray])
    assert_type(ops.copy(x, host), DeviceOp[DeviceArray])
    to_host = ops.copy(host, x)
    assert_type(to_host, DeviceOp[np.ndarray[Any, np.dtype[np.float32]]])
    await gpu.run(ops.fill(x, 3.0))
    assert_type(await gpu.run(to_host), np.ndarray[Any, np.dtype[np.float32]])
    assert host.tolist() == [3.0] * 4
    closure = ops.host_closure(len, "four")
    assert_type(closure, DeviceOp[ops.HostResult[int]])
    assert_type(await gpu.run(closure), int)
    assert_type(closure.map(lambda r: r.value), DeviceOp[int])
    ext = ops.external(on_stream, writes=x)
    assert_type(ext, DeviceOp[int])
    assert_type(await gpu.run(ext, stream=gpu.streams[1]), int)
    assert await gpu.run(ext, stream=gpu.streams[1]) == 1
    after = ops.after(gpu.streams[0])
    assert_type(after, DeviceOp[None])
    assert_type(await gpu.run(after, stream=gpu.streams[1]), None)


async def futures_and_graphs(gpu: ResourceScope) -> None:
    fut = gpu.submit(ops.value(b"raw"))
    assert_type(fut, DeviceFuture[bytes])
    assert_type(await fut.wait(), bytes)
    assert_type(fut.wait_nowait(), bytes)
    assert fut.wait_nowait() == b"raw"
    pending: list[DeviceFuture[object]] = [fut, gpu.submit(ops.value(2))]  # (covariant too)
    assert [await f.wait() for f in pending] == [b"raw", 2]
    closure = gpu.submit(ops.host_closure(float, "1.5"))
    assert_type(await closure.wait(), float)
    assert_type(closure.wait_nowait(), float)

    y = gpu.zeros(8, np.float32)
    graph = await gpu.capture(scale.launch(y, 2.0, 8, grid=1, block=32))
    assert_type(graph, CudaGraph[DeviceArray | tuple[DeviceArray, ...] | None])
    assert graph.output is y
    labelled = await gpu.capture(ops.fill(y, 1.0).map(lambda a: (a, "filled")))
    assert_type(labelled, CudaGraph[tuple[DeviceArray, str]])
    async with labelled as g:
        assert_type(g, CudaGraph[tuple[DeviceArray, str]])
        assert_type(g.output, tuple[DeviceArray, str])
        assert_type(g.launch(), DeviceOp[tuple[DeviceArray, str]])
        assert_type(await gpu.run(g.launch()), tuple[DeviceArray, str])
        assert await gpu.run(g.launch()) == (y, "filled")
        await g.update(ops.fill(y, 2.0).map(lambda a: (a, "refilled")))
        assert await gpu.run(g.launch()) == (y, "refilled")
    graph.close()


async def main() -> None:
    async with trio_cuda.open_scope(SimDevice(), streams=2) as gpu:
        await launches(gpu)
        await combinators(gpu)
        await helpers(gpu)
        await futures_and_graphs(gpu)


if __name__ == "__main__":
    trio.run(main)
