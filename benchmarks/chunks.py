"""The ``chunks`` section: disjoint chunks of one buffer overlap (rule 11).

    python3 benchmarks/chunks.py          # on the GPU (cuda:0)
    python3 benchmarks/chunks.py --sim    # on the simulator (timed kernels)

One device buffer in 4 chunks; a kernel of ``KERNEL_NS`` (20 ms, one block,
so four fit on the GPU at once) reads and rewrites each chunk. Medians over
repeats of the wall time, from the first submission to the last completion:

* ``one``: one chunk's kernel, awaited (the baseline).
* ``disjoint``: the 4 chunks' kernels submitted without a stream (the default
  policy), then awaited. Their leases are disjoint, so they should run
  together: the target is at most 1.3 x ``one``.
* ``overlapping``: the same 4 kernels on views that overlap their neighbour
  by one element: each conflicts with the next and is ordered after it
  (about 4 x ``one``). The control that shows the leases are doing the work.

Every run's output is checked against NumPy. ``bench_chunks(record, reps)``
is what ``benchmarks/run.py`` calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trio_cuda
from trio_cuda import InOut, Kernel, Scalar, ops
from trio_cuda._backends import probe_cuda

SRC = r"""
extern "C" __global__ void spin_scale(float* x, int n, unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = 2.0f * x[i] + 1.0f;
}
"""


def _ref(x: Any, n: Any, ns: Any) -> None:
    x[:n] = 2 * x[:n] + 1


SPIN_SCALE = Kernel.from_source(
    SRC, "spin_scale", params=[InOut("f4"), Scalar("i4"), Scalar("u8")], reference=_ref
)
KERNEL_NS = 20_000_000  # 20 ms
CHUNKS = 4
CHUNK = 1 << 16  # elements per chunk
perf = time.perf_counter


def _launch(view: trio_cuda.DeviceArray, ns: int) -> trio_cuda.KernelLaunch:
    return SPIN_SCALE.launch(view, np.int32(view.size), np.uint64(ns), grid=1, block=256)


async def _timed(
    gpu: trio_cuda.ResourceScope, views: list[trio_cuda.DeviceArray], ns: int
) -> tuple[float, list[int]]:
    t0 = perf()
    futs = [gpu.submit(_launch(v, ns)) for v in views]
    for f in futs:
        await f.wait()
    return perf() - t0, [f.stream.index for f in futs]


async def _chunks(device: object, record: Callable[..., float], reps: Callable[[int], int]) -> None:
    R = reps(5)
    n = CHUNKS * CHUNK
    host = np.arange(n, dtype=np.float32) % 1000
    async with trio_cuda.open_scope(device=device, streams=CHUNKS) as gpu:
        x = await gpu.to_device(host)
        disjoint = [x[i * CHUNK : (i + 1) * CHUNK] for i in range(CHUNKS)]
        # each overlaps the next by one element (the last is one shorter)
        overlapping = [x[i * CHUNK : min(n, (i + 1) * CHUNK + 1)] for i in range(CHUNKS)]
        await gpu.run(_launch(x, 0))  # warm up: load the kernel
        await gpu.run(ops.copy(x, host))
        expect = host.copy()  # (float32 both sides: 2x is exact, one rounding)
        results: dict[str, list[float]] = {"one": [], "disjoint": [], "overlapping": []}
        used: dict[str, list[int]] = {}
        for _ in range(R):
            for name, views in (("one", disjoint[:1]), ("disjoint", disjoint), ("overlapping", overlapping)):
                dt, used[name] = await _timed(gpu, views, KERNEL_NS)
                results[name].append(dt)
                for v in views:  # f applied once per kernel that touches an element
                    lo = v._offset // 4
                    expect[lo : lo + v.size] = 2 * expect[lo : lo + v.size] + 1
            if not np.array_equal(await gpu.to_host(x), expect):
                raise AssertionError("chunks: the results do not match NumPy")
            await gpu.run(ops.copy(x, host))  # start the next repeat from the input again
            expect = host.copy()
        one = statistics.median(results["one"])
        record("chunks:one_kernel", one, "s", f"one chunk, {KERNEL_NS / 1e6:.0f} ms kernel")
        for name in ("disjoint", "overlapping"):
            t = statistics.median(results[name])
            record(f"chunks:{name}", t, "s", f"{t / one:.2f} x one kernel; streams {used[name]}")


def bench_chunks(record: Callable[..., float], reps: Callable[[int], int], device: object = "cuda:0") -> None:
    if device == "cuda:0" and not probe_cuda().available:
        print("chunks: no CUDA device")
        return
    trio.run(_chunks, device, record, reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true", help="on the simulator (20 ms simulated kernels)")
    args = ap.parse_args()

    def record(key: str, value: float, unit: str, note: str = "") -> float:
        print(f"{key:<28} {value:10.4f} {unit:<3} {note}")
        return value

    device: object = "cuda:0"
    if args.sim:
        device = trio_cuda.testing.SimDevice(kernel_time=KERNEL_NS / 1e9)
    bench_chunks(record, lambda n: n, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
