"""Profile the launch path's rows on a device: where the host time goes.

    python3 benchmarks/profile_launch.py [--device cuda]
        [--rows roundtrip,typed,submit,builder,tasks,conflict,traced]
        [--top 25] [--n 20000]

Each row runs ``--n`` times under cProfile (after a warm-up) and prints the
functions with the most time of their own. cProfile's own cost per call
inflates small functions, so read the order and the call counts, and take
the figures that count from ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
from typing import Any

import numpy as np
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trio_cuda
from trio_cuda import unsafe

SRC = r"""
extern "C" __global__ void empty(const float* a, const float* b, const float* c, const float* d, int n) { }
"""
K = trio_cuda.Kernel.from_source(
    SRC, "empty", params=[trio_cuda.In("f4")] * 4 + [trio_cuda.Scalar("i4")], reference=lambda *a: None
)
W2 = trio_cuda.Kernel.from_source(
    'extern "C" __global__ void write2(float* a, float* b, int n) {}',
    "write2",
    params=[trio_cuda.InOut("f4")] * 2 + [trio_cuda.Scalar("i4")],
    reference=lambda *a: None,
)


async def main(device: str, rows: list[str], top: int, n: int) -> None:
    async with trio_cuda.open_scope(device=device, streams=4) as gpu:
        bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
        op = K.launch(*bufs, 256, grid=1, block=1)
        s = gpu.streams[0]
        await gpu.run(op, stream=s)

        async def roundtrip() -> None:
            for _ in range(n):
                await gpu.run(op, stream=s)

        async def typed() -> None:
            for i in range(n):
                gpu.submit(K.launch(*bufs, 256, grid=1, block=1), stream=s)
                if i % 1000 == 999:
                    await gpu.run(trio_cuda.ops.value(None), stream=s)

        async def submit() -> None:
            for i in range(n):
                gpu.submit(op, stream=s)
                if i % 1000 == 999:
                    await gpu.run(trio_cuda.ops.value(None), stream=s)

        async def builder() -> None:
            for i in range(n):
                b = K.builder().grid(1).block(1)
                for x in bufs:
                    b.arg(x)
                b.arg(np.int32(256))
                unsafe.async_on(b.finalize_unchecked(), s)
                if i % 1000 == 999:
                    await gpu.run(trio_cuda.ops.value(None), stream=s)

        async def tasks(conflict: bool = False) -> None:
            """100 tasks, each awaiting a typed launch per await (``conflict``:
            task i on stream i % 4, all writing the same two buffers)."""
            a, b = bufs[:2]

            async def worker(i: int) -> None:
                st = gpu.streams[i % 4] if conflict else None
                for _ in range(n // 100):
                    if conflict:
                        await gpu.run(W2.launch(a, b, 256, grid=1, block=1), stream=st)
                    else:
                        await gpu.run(K.launch(*bufs, 256, grid=1, block=1))

            async with trio.open_nursery() as nursery:
                for i in range(100):
                    nursery.start_soon(worker, i)

        async def conflict() -> None:
            await tasks(conflict=True)

        async def traced() -> None:
            trace = trio_cuda.trace.Trace(limit=4 * n + 100)
            async with trio_cuda.open_scope(device=device, streams=4, trace=trace) as tgpu:
                tb = [tgpu.zeros(256, np.float32) for _ in range(4)]
                top = K.launch(*tb, 256, grid=1, block=1)
                for _ in range(n):
                    await tgpu.run(top, stream=tgpu.streams[0])

        fns: dict[str, Any] = {
            "roundtrip": roundtrip,
            "typed": typed,
            "submit": submit,
            "builder": builder,
            "tasks": tasks,
            "conflict": conflict,
            "traced": traced,
        }
        for row in rows:
            await fns[row]()  # warm-up
            prof = cProfile.Profile()
            prof.enable()
            await fns[row]()
            prof.disable()
            print(f"\n=== {row}: {n} operations")
            pstats.Stats(prof).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="roundtrip,typed,submit,builder,tasks,conflict,traced")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--n", type=int, default=20000)
    a = ap.parse_args()
    trio.run(main, a.device, a.rows.split(","), a.top, a.n)
