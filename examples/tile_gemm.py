"""A tile GEMM: C = A @ B in f16 with f32 accumulation, written with cuTile and
launched through trio_cuda.

    python examples/tile_gemm.py [--size N] [--device auto|sim|cuda:0]

On a GPU it multiplies two N x N matrices (N = 8192 by default), checks 64
entries against float64 on the host and prints the rate in TFLOP/s; on the
simulator (N = 512 by default) it runs the kernel on NumPy tiles and checks
every entry. ``benchmarks/run.py`` times this kernel against cuBLAS.

The kernel walks 256 x 128 output tiles in groups of 8 tile rows, so that
blocks running together share tiles of A and B in L2, and asks for clusters
of 2 blocks (``num_ctas=2``). Each specialisation is compiled once (in a
worker thread) and cached on disk, so the second run starts at once.
"""

from __future__ import annotations

import argparse
import sys
import time

import cuda.tile as ct
import numpy as np
import trio

import trio_cuda

ConstInt = ct.Constant[int]

TM, TN, TK, GROUP = 256, 128, 64, 8


@ct.kernel(num_ctas=2)
def gemm(A, B, C, TM: ConstInt, TN: ConstInt, TK: ConstInt, GROUP: ConstInt):
    pid = ct.bid(0)
    num_m = ct.cdiv(A.shape[0], TM)
    num_n = ct.cdiv(B.shape[1], TN)
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    size_m = min(num_m - first_m, GROUP)
    bm = first_m + (pid % per_group) % size_m
    bn = (pid % per_group) // size_m
    acc = ct.full((TM, TN), 0, dtype=ct.float32)
    zero = ct.PaddingMode.ZERO
    for k in range(ct.num_tiles(A, axis=1, shape=(TM, TK))):
        a = ct.load(A, index=(bm, k), shape=(TM, TK), padding_mode=zero)
        b = ct.load(B, index=(k, bn), shape=(TK, TN), padding_mode=zero)
        acc = ct.mma(a, b, acc)
    ct.store(C, index=(bm, bn), tile=ct.astype(acc, C.dtype))


GEMM = trio_cuda.Kernel.from_tile(gemm)


def launch_gemm(
    A: trio_cuda.DeviceArray, B: trio_cuda.DeviceArray, C: trio_cuda.DeviceArray
) -> trio_cuda.KernelLaunch:
    """C = A @ B: the launch (A is M x K, B is K x N, C is M x N)."""
    m, n = C.shape
    grid = -(-m // TM) * -(-n // TN)
    return GEMM.launch(A, B, C, TM, TN, TK, GROUP, grid=grid)


async def main(size: int | None, device: str) -> int:
    async with trio_cuda.open_scope(device=device) as gpu:
        on_gpu = gpu.backend == "cuda"
        n = size or (8192 if on_gpu else 512)
        print(f"tile GEMM {n} x {n} x {n} (f16, f32 accumulation) on {gpu.device.name} ({gpu.backend})")
        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n)).astype(np.float16)
        b = rng.standard_normal((n, n)).astype(np.float16)
        A, B = await gpu.to_device(a), await gpu.to_device(b)
        C = gpu.empty((n, n), np.float16)
        op = launch_gemm(A, B, C)
        t0 = time.perf_counter()
        await gpu.load(op)  # compile (or read the cache) off the event loop
        print(f"  compiled or loaded in {time.perf_counter() - t0:.2f} s")
        assert await gpu.run(op) is C
        if on_gpu:
            repeats = 10
            t0 = time.perf_counter()
            for _ in range(repeats):
                fut = gpu.submit(op)
            await fut.wait()
            rate = 2.0 * n**3 * repeats / (time.perf_counter() - t0) / 1e12
            print(f"  {rate:.1f} TFLOP/s")
        c = await gpu.to_host(C)
        if on_gpu:
            idx = rng.integers(0, n, (64, 2))
            want = np.array([np.dot(a[i].astype(np.float64), b[:, j].astype(np.float64)) for i, j in idx])
            got = c[idx[:, 0], idx[:, 1]].astype(np.float64)
        else:
            want = a.astype(np.float32) @ b.astype(np.float32)
            got = c.astype(np.float32)
        err = float(np.max(np.abs(got - want) / (np.abs(want) + 1.0)))
        ok = err < 2e-2
        print(f"  max relative error {err:.2e}: {'OK' if ok else 'MISMATCH'}")
        return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=None, help="N (default: 8192 on a GPU, 512 on the simulator)")
    ap.add_argument("--device", default="auto", help="auto, sim or cuda:N (default: auto)")
    args = ap.parse_args()
    sys.exit(trio.run(main, args.size, args.device))
