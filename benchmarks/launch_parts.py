"""The parts of the typed launch row, taken in turn (GPU host).

    python3 benchmarks/launch_parts.py [--rounds 15]

Host µs per launch, bursts of 1000, one burst of each row per round, medians
(``run.py``'s ``in_turn``): a raw prepacked launch and CuPy's RawKernel; the
typed launch alone (made and freed, or made and kept); safe ``submit`` of a
prebuilt launch, of 1000 fresh launches made before the burst (with and
without their first check against the scope's device done before it), and
of a typed launch made in the loop (the collector off, and on);
``unsafe.async_on`` likewise. A fresh launch's cost beyond its parts is
"premade" minus "prebuilt".
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


async def main(rounds: int) -> None:
    raw = R.Raw()
    cu = raw.cu
    L = cu.cuLaunchKernel
    fn, st, params = raw.fn, raw.stream, raw.params
    rows: dict[str, Callable[[], Awaitable[float]]] = {
        "raw_launch": R.sync_burst(lambda: L(fn, 1, 1, 1, 1, 1, 1, 0, st, params, 0), raw.sync)
    }
    cupy = R._cupy_row()
    if cupy is not None:
        rows["cupy_rawkernel"] = cupy
    async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
        bufs, s, op = await R.empty_setup(gpu)
        handle = s.handle
        async_on = trio_cuda.unsafe.async_on

        def sync() -> None:
            cu.cuStreamSynchronize(handle.cu)

        b0, b1, b2, b3 = bufs

        def typed() -> Any:
            return R.EMPTY.launch(b0, b1, b2, b3, 256, grid=1, block=1)

        async def kept() -> float:
            gc.disable()
            keep = []
            t0 = perf()
            for _ in range(1000):
                keep.append(typed())
            t = (perf() - t0) / 1000 * 1e6
            gc.enable()
            return t

        def premade(submit: bool, checked: bool = False) -> Callable[[], Awaitable[float]]:
            async def one() -> float:
                await gpu.run(trio_cuda.ops.value(None), stream=s)
                ops = [typed() for _ in range(1000)]
                if checked:  # (their check against the device, before the burst)
                    for o in ops:
                        gpu._kernels.function_for(o.prepared)
                gc.disable()
                t0 = perf()
                if submit:
                    for o in ops:
                        fut = gpu.submit(o, stream=s)
                else:
                    for o in ops:
                        async_on(o, s)
                t = (perf() - t0) / 1000 * 1e6
                gc.enable()
                if submit:
                    await fut.wait()
                else:
                    sync()
                return t

            return one

        async def collector_on() -> float:
            await gpu.run(trio_cuda.ops.value(None), stream=s)
            t0 = perf()
            for _ in range(1000):
                fut = gpu.submit(typed(), stream=s)
            t = (perf() - t0) / 1000 * 1e6
            await fut.wait()
            return t

        rows.update(
            {
                "typed_only": R.sync_burst(typed, sync),
                "typed_kept": kept,
                "prebuilt+submit": lambda: R._submit_burst(gpu, op, s, 1),
                "premade+submit": premade(True),
                "premade_checked+submit": premade(True, True),
                "typed+submit": lambda: R._submit_burst_of(gpu, typed, s, 1),
                "typed+submit, collector on": collector_on,
                "async_on": R.sync_burst(lambda: async_on(op, s), sync),
                "premade+async_on": premade(False),
                "premade_checked+async_on": premade(False, True),
                "typed+async_on": R.sync_burst(lambda: async_on(typed(), s), sync),
            }
        )
        await R.in_turn(rows, rounds, "parts:")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    trio.run(main, ap.parse_args().rounds)
