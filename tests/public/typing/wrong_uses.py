"""Wrong uses of trio_cuda that mypy --strict must report.

tests/public/test_typing.py type-checks this file against trio_cuda as installed: every line
marked ``# E: CODE[, CODE]`` must be reported with exactly those error codes, and no
unmarked line may be reported. It is never run.

Where the result of ``gpu.run(op)`` goes to a variable annotated with another type,
mypy infers ``run``'s type from that annotation and reports ``op`` (``arg-type``);
where the result is assigned later, it reports the assignment. Either way it is an
error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import trio_cuda
from trio_cuda import DeviceArray, ResourceScope, Stream, ops, unsafe

K = trio_cuda.Kernel.from_source("", "k", params=[trio_cuda.InOut("f4")], reference=trio_cuda.NO_REFERENCE)


def index_of(stream: Stream) -> int:
    return stream.index


async def results(gpu: ResourceScope) -> None:
    x = await gpu.to_device(np.ones(4))
    n: int = await gpu.to_host(x)  # E: assignment
    a: int = await gpu.run(ops.value("a"))  # E: arg-type
    op = ops.value("a")
    a2: int = await gpu.run(op)  # E: arg-type
    b: str = await ops.value(1)  # E: arg-type
    one = ops.value(1)
    b2: str = await one  # E: assignment
    c: str = await gpu.run(one.shared())  # E: arg-type
    d = await gpu.run(one.map(str))
    d2: int = d  # E: assignment
    pair = trio_cuda.zip(ops.value(1), ops.value("s"))
    e: tuple[int, int] = await gpu.run(pair)  # E: arg-type
    e2: tuple[int, int] = await gpu.run(trio_cuda.zip(ops.value(1), ops.value("s")))  # E: arg-type
    six = trio_cuda.zip(one, one, one, one, one, ops.value("s"))
    e3: tuple[int, int, int, int, int, int] = await gpu.run(six)  # E: arg-type
    closure = ops.host_closure(str, 1)
    f: int = await gpu.run(closure)  # E: arg-type
    ext = ops.external(index_of, writes=x)
    g: str = await gpu.run(ext)  # E: arg-type
    after = ops.after(gpu.streams[0])
    h: int = await gpu.run(after)  # E: arg-type
    to_device = ops.copy(x, np.ones(4))
    i: str = await gpu.run(to_device)  # E: arg-type
    to_host = ops.copy(np.ones(4), x)
    j: DeviceArray = await gpu.run(to_host)  # E: arg-type
    anything = ops.value(object())
    narrower: trio_cuda.DeviceOp[int] = anything  # E: assignment
    print(n, a, a2, b, b2, c, d2, e, e2, e3, f, g, h, i, j, narrower)


async def launches(gpu: ResourceScope, y: DeviceArray) -> None:
    # a launch outputs DeviceArray | tuple[DeviceArray, ...] | None: narrow it first
    launch = K.launch(y, grid=1, block=32)
    out: DeviceArray = await gpu.run(launch)  # E: arg-type
    await gpu.to_host(await gpu.run(launch))  # E: arg-type
    first: DeviceArray = unsafe.async_on(launch, gpu.streams[0])  # E: assignment
    graph = await gpu.capture(launch)
    kept: DeviceArray = graph.output  # E: assignment
    print(out, first, kept)


async def combinators(gpu: ResourceScope, x: DeviceArray) -> None:
    await gpu.run(42)  # E: call-overload
    gpu.submit("op")  # E: arg-type
    gpu.upload(x)  # E: attr-defined
    trio_cuda.zip(ops.value(1), 2)  # E: call-overload
    ops.value(1).then(str)  # E: arg-type
    ops.value(1).map(len)  # E: arg-type
    ops.value("s").then(lambda s: ops.value(s + 1))  # E: operator
    ops.fill(np.ones(4), 1.0)  # E: arg-type
    ops.host_closure(42)  # E: arg-type
    ops.external(42)  # E: arg-type


async def futures_and_graphs(gpu: ResourceScope) -> None:
    fut = gpu.submit(trio_cuda.ops.value(1.5))
    s: str = await fut.wait()  # E: assignment
    t: str = fut.wait_nowait()  # E: assignment
    graph = await gpu.capture(ops.value(1))
    u: str = graph.output  # E: assignment
    replay = graph.launch()
    v: str = await gpu.run(replay)  # E: arg-type
    await graph.update(ops.value("other"))  # E: arg-type
    w = unsafe.async_on(ops.value(1), gpu.streams[0])
    w2: str = w  # E: assignment
    print(s, t, u, v, w2)


def elsewhere(x: DeviceArray, scope: Any) -> None:
    x.no_such_attribute = 1  # E: attr-defined
    trio_cuda.open_scope(conflicts="ignore")  # E: arg-type
    scope.anything_goes()  # (an Any is not checked)
