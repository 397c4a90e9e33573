"""Burst size and retained memory on the launch rows, taken in turn (GPU host).

    python3 benchmarks/bursts.py [--rounds 9]

Host µs per launch, 1000 launches per measurement in bursts of 1000, 100 or
10 (each burst waited for before the next, outside the timed calls), one
measurement of each row per round, medians: a raw prepacked launch, CuPy's
RawKernel, a typed launch + ``submit``, a prebuilt launch's ``submit``, a
typed launch + ``unsafe.async_on`` and ``async_on`` of a prebuilt launch;
then the typed launch alone, and the prebuilt submit and the raw launch
each keeping 600 bytes per launch until the burst ends ("ballast"). A
library launch keeps objects until it retires; if that memory were what a
fresh launch costs beyond its parts, the typed rows would lose less in
short bursts than in long ones, and the ballast would cost what the typed
rows' excess does.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run as R  # (the benchmarks' shared helpers)

import trio_cuda

perf = time.perf_counter
Row = Callable[[], Awaitable[float]]


async def main(rounds: int) -> None:
    raw = R.Raw()
    cu = raw.cu
    L = cu.cuLaunchKernel
    fn, st, params = raw.fn, raw.stream, raw.params
    try:
        cupy_launch, cs = R._cupy_launch()
    except Exception as exc:
        print("no CuPy row:", repr(exc)[:200])
        cupy_launch, cs = None, None
    kept: list[bytes] = []

    def in_bursts(f: Callable[[], object], sync: Callable[[], None], n: int) -> Row:
        async def one() -> float:
            total = 0.0
            for _ in range(1000 // n):
                sync()
                gc.disable()
                t0 = perf()
                for _ in range(n):
                    f()
                total += perf() - t0
                gc.enable()
            sync()
            return total / 1000 * 1e6

        return one

    async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
        bufs, s, op = await R.empty_setup(gpu)
        handle = s.handle
        async_on = trio_cuda.unsafe.async_on

        b0, b1, b2, b3 = bufs

        def typed() -> Any:
            return R.EMPTY.launch(b0, b1, b2, b3, 256, grid=1, block=1)

        def ssync() -> None:
            cu.cuStreamSynchronize(handle.cu)

        def rsync() -> None:
            cu.cuStreamSynchronize(st)
            kept.clear()

        def submits(make: Callable[[], Any], n: int, ballast: int = 0) -> Row:
            async def one() -> float:
                total = 0.0
                for _ in range(1000 // n):
                    await gpu.run(trio_cuda.ops.value(None), stream=s)
                    keep = []
                    gc.disable()
                    t0 = perf()
                    if ballast:
                        for _ in range(n):
                            fut = gpu.submit(make(), stream=s)
                            keep.append(bytes(ballast))
                    else:
                        for _ in range(n):
                            fut = gpu.submit(make(), stream=s)
                    total += perf() - t0
                    gc.enable()
                    await fut.wait()
                return total / 1000 * 1e6

            return one

        rows: dict[str, Row] = {}
        for n in (1000, 100, 10):
            rows[f"raw b{n}"] = in_bursts(lambda: L(fn, 1, 1, 1, 1, 1, 1, 0, st, params, 0), rsync, n)
            if cupy_launch is not None and cs is not None:

                def cupy_row(n: int = n) -> Row:
                    inner = in_bursts(cupy_launch, cs.synchronize, n)

                    async def one() -> float:
                        with cs:
                            return await inner()

                    return one

                rows[f"cupy b{n}"] = cupy_row()
            rows[f"typed+submit b{n}"] = submits(typed, n)
            rows[f"prebuilt submit b{n}"] = submits(lambda: op, n)
            rows[f"typed+async_on b{n}"] = in_bursts(lambda: async_on(typed(), s), ssync, n)
            rows[f"async_on b{n}"] = in_bursts(lambda: async_on(op, s), ssync, n)
        rows["typed only b1000"] = in_bursts(typed, ssync, 1000)
        rows["prebuilt submit+600B b1000"] = submits(lambda: op, 1000, 600)
        rows["prebuilt submit+600B b100"] = submits(lambda: op, 100, 600)
        rows["raw+600B b1000"] = in_bursts(
            lambda: (L(fn, 1, 1, 1, 1, 1, 1, 0, st, params, 0), kept.append(bytes(600))), rsync, 1000
        )
        await R.in_turn(rows, rounds, "bursts:")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    trio.run(main, ap.parse_args().rounds)
