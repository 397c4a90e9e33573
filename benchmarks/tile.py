"""Tile kernel (cuTile) benchmarks: the ``tile`` section of ``benchmarks/run.py``.

* ``tile:typed_launch+submit`` against ``tile:simt_typed_launch+submit``: a
  fresh typed launch and ``gpu.submit`` per call, bursts of 1000, for a tile
  kernel and a SIMT kernel of the same arity (4 arrays and an int), in the same
  run (target: tile <= 1.2 x SIMT).
* ``tile:device_trio`` against ``tile:device_raw``: the device time of 50
  back-to-back launches of one f16 matmul cubin (4096^3), through trio_cuda
  (``gpu.submit`` on one stream) and through a raw ``cuLaunchKernel`` of the
  same cubin, each measured with CUDA events around the burst (target <= 1.02 x).
* ``tile:example_tflops`` against ``tile:cublas_tflops``: the tile GEMM
  example (``examples/tile_gemm.py``: f16 in, f32 accumulate, f16 out) at
  8192^3 through trio_cuda, and CuPy's ``matmul`` (cuBLAS) on the same inputs
  (target >= 0.8 x); then other tile shapes and hints of the same kernel
  (``GEMM_VARIANTS``), the A/B behind the example's choice.

The GPU host needs no tile compiler: ``python3 benchmarks/tile.py --fill DIR``
compiles every specialisation this section launches for ``sm_90`` into the
disk cache DIR on any machine with the toolchain (on the simulator: nothing
runs), and the GPU run reads them with ``TRIO_CUDA_TILE_CACHE=DIR``.
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

import cuda.tile as ct

import trio_cuda
from trio_cuda import In, Kernel, Scalar
from trio_cuda._tile.cache import pyfunc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from tile_gemm import gemm as example_gemm  # the tile GEMM example
from tile_gemm import launch_gemm

ConstInt = ct.Constant[int]
perf = time.perf_counter

EMPTY_SRC = r"""
extern "C" __global__ void empty(const float* a, const float* b, const float* c, const float* d, int n) { }
"""
EMPTY = Kernel.from_source(
    EMPTY_SRC,
    "empty",
    params=[In("f4"), In("f4"), In("f4"), In("f4"), Scalar("i4")],
    reference=trio_cuda.NO_REFERENCE,
)


@ct.kernel
def tile_empty(a, b, c, d, n):
    """Reads nothing it needs: the four arrays are passed (pointer, shape,
    stride each) and leased, as for the SIMT kernel of the same arity."""
    if n < 0:
        ct.store(a, index=(0,), tile=ct.load(b, index=(0,), shape=(16,)))


#: the example's kernel as a Python function, to compile with other hints
_grouped = pyfunc(example_gemm)
TILE_EMPTY = Kernel.from_tile(tile_empty)
GROUP = 8
#: the A/B behind the example's choice (256x128x64, clusters of 2): the same
#: kernel with other tile shapes and hints; tag -> (kernel, TM, TN, TK, GROUP)
GEMM_VARIANTS: dict[str, tuple[Kernel, int, int, int, int]] = {
    "grouped_128x128x64": (Kernel.from_tile(ct.kernel(_grouped)), 128, 128, 64, GROUP),
    "grouped_256x128x64": (Kernel.from_tile(ct.kernel(_grouped)), 256, 128, 64, GROUP),
    "grouped_128x128x64_occ2": (Kernel.from_tile(ct.kernel(occupancy=2)(_grouped)), 128, 128, 64, GROUP),
    "grouped16_128x128x64_occ2": (Kernel.from_tile(ct.kernel(occupancy=2)(_grouped)), 128, 128, 64, 16),
    "grouped_128x128x32_occ2": (Kernel.from_tile(ct.kernel(occupancy=2)(_grouped)), 128, 128, 32, GROUP),
}
DEVICE_N = 4096
GEMM_N = 8192


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _launches(gpu: Any) -> dict[str, Any]:
    """Every launch the section makes (one per specialisation)."""
    bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
    A = gpu.empty((DEVICE_N, DEVICE_N), np.float16)
    B = gpu.empty((DEVICE_N, DEVICE_N), np.float16)
    C = gpu.empty((DEVICE_N, DEVICE_N), np.float16)
    GA = gpu.empty((GEMM_N, GEMM_N), np.float16)
    GB = gpu.empty((GEMM_N, GEMM_N), np.float16)
    GC = gpu.empty((GEMM_N, GEMM_N), np.float16)
    return {
        "bufs": bufs,
        "empty": TILE_EMPTY.launch(*bufs, 256, grid=1),
        "device": launch_gemm(A, B, C),
        "device_arrays": (A, B, C),
        "example": launch_gemm(GA, GB, GC),
        **{
            tag: k.launch(GA, GB, GC, tm, tn, tk, group, grid=(GEMM_N // tm) * (GEMM_N // tn))
            for tag, (k, tm, tn, tk, group) in GEMM_VARIANTS.items()
        },
        "gemm_arrays": (GA, GB, GC),
    }


async def _fill(path: str) -> None:
    os.environ["TRIO_CUDA_TILE_CACHE"] = path
    async with trio_cuda.open_scope(device="sim") as gpu:
        ls = _launches(gpu)
        await gpu.load(ls["empty"], ls["device"], ls["example"], *(ls[t] for t in GEMM_VARIANTS))
    print(f"filled {path}: {trio_cuda._tile.compile.compile_statistics()}")


async def _bench(
    record: Callable[..., float], reps: Callable[[int], int], submit_burst_of: Callable[..., Any]
) -> None:
    from cuda.bindings import driver as cu

    async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
        s = gpu.streams[0]
        ls = _launches(gpu)
        bufs = ls["bufs"]
        await gpu.load(ls["empty"], ls["device"], ls["example"], *(ls[t] for t in GEMM_VARIANTS))
        await gpu.run(ls["empty"], stream=s)
        await gpu.run(EMPTY.launch(*bufs, 256, grid=1, block=1), stream=s)
        B = reps(15)
        b0, b1, b2, b3 = bufs
        print("tile kernels (host µs per launch, bursts of 1000)")
        simt, tile = [], []

        def simt_launch() -> Any:
            return EMPTY.launch(b0, b1, b2, b3, 256, grid=1, block=1)

        def tile_launch() -> Any:
            return TILE_EMPTY.launch(b0, b1, b2, b3, 256, grid=1)

        for _ in range(B):  # interleaved bursts: drift hits both alike
            simt.append(await submit_burst_of(gpu, simt_launch, s, 1))
            tile.append(await submit_burst_of(gpu, tile_launch, s, 1))
        record("tile:simt_typed_launch+submit", _med(simt), "us", "(4 arrays + int, interleaved)")
        record("tile:typed_launch+submit", _med(tile), "us", "(4 arrays + int)")

        # device time of one cubin, through trio_cuda and raw, with events
        A, Bm, _ = ls["device_arrays"]
        rng = np.random.default_rng(0)
        host = rng.standard_normal((DEVICE_N, DEVICE_N)).astype(np.float16)
        await gpu.run(trio_cuda.ops.copy(A, host))
        await gpu.run(trio_cuda.ops.copy(Bm, host))
        launch = ls["device"]
        spec = launch.kernel.tile
        image = spec.image(spec.arch_for("cuda", gpu.device.compute_capability))
        err, module = cu.cuModuleLoadData(image.cubin)
        assert not err, err
        err, fn = cu.cuModuleGetFunction(module, image.symbol.encode())
        assert not err, err
        err, raw_stream = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        arena = np.frombuffer(bytearray(launch.prepared.arena), dtype=np.uint8).copy()
        base = int(arena.ctypes.data)
        ptrs = np.array([base + slot.offset for slot in launch.prepared.plan.slots], dtype=np.uint64)
        grid = launch.config.grid
        e0 = cu.cuEventCreate(0)[1]
        e1 = cu.cuEventCreate(0)[1]
        K = 50

        def raw_burst() -> float:
            cu.cuEventRecord(e0, raw_stream)
            for _ in range(K):
                (err,) = cu.cuLaunchKernel(fn, *grid, 1, 1, 1, 0, raw_stream, int(ptrs.ctypes.data), 0)
                assert not err, err
            cu.cuEventRecord(e1, raw_stream)
            cu.cuEventSynchronize(e1)
            return float(cu.cuEventElapsedTime(e0, e1)[1]) / K

        async def trio_burst() -> float:
            await gpu.run(trio_cuda.ops.value(None), stream=s)
            cu.cuEventRecord(e0, s.handle.cu)
            for _ in range(K):
                fut = gpu.submit(launch, stream=s)
            cu.cuEventRecord(e1, s.handle.cu)
            await fut.wait()
            cu.cuEventSynchronize(e1)
            return float(cu.cuEventElapsedTime(e0, e1)[1]) / K

        raw_burst()
        await trio_burst()
        raws, trios = [], []
        for _ in range(reps(7)):
            raws.append(raw_burst())
            trios.append(await trio_burst())
        record("tile:device_raw", _med(raws), "ms", f"({DEVICE_N}^3 f16 matmul, same cubin)")
        record("tile:device_trio", _med(trios), "ms")
        cu.cuStreamSynchronize(raw_stream)
        cu.cuStreamDestroy(raw_stream)
        cu.cuModuleUnload(module)

        # the tile GEMM against cuBLAS (CuPy) at 8192^3
        GA, GB, GC = ls["gemm_arrays"]
        big = rng.standard_normal((GEMM_N, GEMM_N)).astype(np.float16)
        await gpu.run(trio_cuda.ops.copy(GA, big))
        await gpu.run(trio_cuda.ops.copy(GB, big))
        flops = 2.0 * GEMM_N**3
        G = 10

        async def gemm_burst(gemm_op: Any) -> float:
            await gpu.run(gemm_op, stream=s)
            t0 = perf()
            for _ in range(G):
                fut = gpu.submit(gemm_op, stream=s)
            await fut.wait()
            return flops * G / (perf() - t0) / 1e12

        for tag in ("example", *GEMM_VARIANTS):  # the example, then the A/B of tile shapes and hints
            await gemm_burst(ls[tag])
            rate = max([await gemm_burst(ls[tag]) for _ in range(reps(5))])
            record(f"tile:{tag}_tflops", rate, "TFLOP/s", "(8192^3 f16)")
        await gpu.run(ls["example"], stream=s)
        # a spot check of the example's result: 64 entries against float64 on the host
        out = await gpu.to_host(GC)
        idx = rng.integers(0, GEMM_N, (64, 2))
        want = np.array([np.dot(big[i].astype(np.float64), big[:, j].astype(np.float64)) for i, j in idx])
        got = out[idx[:, 0], idx[:, 1]].astype(np.float64)
        err_rel = float(np.max(np.abs(got - want) / (np.abs(want) + 1.0)))
        record("tile:gemm_max_rel_error", err_rel, "", "(64 sampled entries)")
        try:
            import cupy

            ca = cupy.asarray(big)
            cb = cupy.asarray(big)
            cupy.matmul(ca, cb)
            cupy.cuda.Device().synchronize()
            rates = []
            for _ in range(reps(5)):
                t0 = perf()
                for _ in range(G):
                    cupy.matmul(ca, cb)
                cupy.cuda.Device().synchronize()
                rates.append(flops * G / (perf() - t0) / 1e12)
            record("tile:cublas_tflops", max(rates), "TFLOP/s", "(CuPy matmul, same inputs)")
        except Exception as exc:  # CuPy missing or broken: the row says so
            print("  cupy:", repr(exc)[:200])


def bench_tile(
    record: Callable[..., float], reps: Callable[[int], int], submit_burst_of: Callable[..., Any]
) -> None:
    """The section, with ``benchmarks/run.py``'s recorder, repeat count and
    submit-burst timer (a fresh op per submission)."""
    trio.run(_bench, record, reps, submit_burst_of)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fill", metavar="DIR", required=True, help="compile the section's kernels into DIR")
    args = ap.parse_args()
    # the cache key names each kernel's module: fill it as benchmarks/run.py imports it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tile

    trio.run(tile._fill, os.path.abspath(args.fill))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
