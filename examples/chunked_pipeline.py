"""A chunked pipeline: the chunks of one device buffer, each on its own stream.

One device buffer ``y`` of ``n`` float32 is split into ``--chunks`` views
``y[i*c:(i+1)*c]``. Each chunk runs one op chain on its own stream: upload its
slice of the host input, run a kernel on the view in place, download it. Leases
cover byte ranges (rule 11 of docs/lifetimes.rst), so the chunks never conflict, and their
work overlaps although it shares one allocation.

The kernel takes every element (a seed) through ``--iters`` steps of a linear
congruential generator and writes a float in [0, 1). NumPy checks every element
exactly, by jumping ahead ``iters`` steps at once. Each launch gets its share
of the GPU's multiprocessors (a grid-stride loop covers the chunk): kernels
that each fill the GPU queue one after another whatever the streams.

The overlap is measured two ways: by wall time, against the same chunks all
on one stream; and on the simulator, by its trace, where every kernel takes
``KERNEL_TIME`` and every copy ``COPY_TIME`` of simulated time (whatever
``--iters``), and the kernel's NumPy ``reference=`` computes the values.

    python examples/chunked_pipeline.py [--chunks 4] [--n 1048576] [--iters 1000000]
                                        [--device auto|sim|cuda:N]

It runs on the real GPU when a CUDA driver and a device answer, and on the
simulated device otherwise, and says which. It exits with 1 if any result is wrong.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import Kernel, Scalar, Slice, ops
from trio_cuda.testing import SimCommandRecord, SimDevice

SRC = r"""
extern "C" __global__ void lcg(float* x, unsigned long long n, unsigned int iters) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long first = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (unsigned long long i = first; i < n; i += stride) {  // a grid-stride loop over the chunk
        unsigned int s = (unsigned int)x[i];
        for (unsigned int k = 0; k < iters; ++k) s = s * 1664525u + 1013904223u;  // the work
        x[i] = (float)(s >> 8) * (1.0f / 16777216.0f);
    }
}
"""
A, C, M = 1664525, 1013904223, 1 << 32
BLOCK = 256
KERNEL_TIME, COPY_TIME = 0.020, 0.002  # simulated seconds per launch / per copy


def lcg_expected(seeds: np.ndarray, iters: int) -> np.ndarray:
    """``iters`` LCG steps at once: s -> a*s + c, composed k times, is
    s -> a**k * s + c * (a**k - 1) / (a - 1) (mod 2**32)."""
    a_k = pow(A, iters, M)
    c_k = C * ((pow(A, iters, (A - 1) * M) - 1) // (A - 1)) % M
    s = (seeds.astype(np.uint64) * np.uint64(a_k) + np.uint64(c_k)) % np.uint64(M)
    return (s >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)


def lcg_on_cpu(x: np.ndarray, n: np.uint64, iters: np.uint32) -> None:
    x[:n] = lcg_expected(x[:n], int(iters))


lcg = Kernel.from_source(
    SRC, "lcg", params=[Slice("f4", access="readwrite"), Scalar("u4")], reference=lcg_on_cpu
)


def chunk_op(
    view: trio_cuda.DeviceArray, src: np.ndarray, dst: np.ndarray, iters: int, blocks: int
) -> trio_cuda.DeviceOp[np.ndarray]:
    """Upload, compute in place, download: one op chain, on one stream."""
    return (
        ops.copy(view, src)
        .then(lambda v: lcg.launch(v, np.uint32(iters), grid=blocks, block=BLOCK))
        .then(lambda v: ops.copy(dst, v))
    )


def kernel_overlap(events: Sequence[SimCommandRecord]) -> tuple[int, int, int, float, float]:
    """(kernels, streams, peak, busy, serial) of the trace's launches: how many
    ran on how many streams, at most how many at once, the seconds when at
    least one ran, and the sum of their durations."""
    launches = [e for e in events if e.kind == "launch"]
    edges = sorted([(e.t_start, 1) for e in launches] + [(e.t_end, -1) for e in launches])
    running, peak, busy = 0, 0, 0.0
    for (t, step), (t_next, _) in itertools.pairwise(edges):
        running += step  # an end sorts before a start at the same time: touching is not overlapping
        peak = max(peak, running)
        if running:
            busy += t_next - t
    serial = sum(e.t_end - e.t_start for e in launches)
    return len(launches), len({e.stream for e in launches}), peak, busy, serial


async def run(
    device: object = "auto", chunks: int = 4, n: int = 1 << 20, iters: int = 1_000_000
) -> dict[str, Any]:
    """Run the pipeline on ``chunks`` streams (checked; the warm-up), then on
    one stream and on ``chunks`` streams again (checked and timed). ``n`` is
    rounded down to a multiple of ``chunks``. Returns what was observed."""
    c = n // chunks
    host_in = np.arange(chunks * c, dtype=np.float32)  # seeds: exact below 2**24
    expected = lcg_expected(host_in, iters)
    sim = device if isinstance(device, SimDevice) else None
    async with trio_cuda.open_scope(device=device, streams=chunks) as gpu:
        y = gpu.empty(chunks * c, "f4")
        views = [y[i * c : (i + 1) * c] for i in range(chunks)]
        blocks = max(1, gpu.device.multiprocessor_count // chunks)  # each chunk's share of the SMs

        async def pipeline(streams: Sequence[trio_cuda.Stream]) -> tuple[bool, float, float]:
            out = np.full_like(host_in, np.nan)
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i, (view, stream) in enumerate(zip(views, streams)):
                    op = chunk_op(view, host_in[i * c : (i + 1) * c], out[i * c : (i + 1) * c], iters, blocks)
                    nursery.start_soon(functools.partial(gpu.run, op, stream=stream))
            return bool(np.array_equal(out, expected)), start, time.perf_counter()

        ok_first, t0, t1 = await pipeline(gpu.streams)
        ok_one, s0, s1 = await pipeline([gpu.streams[0]] * chunks)
        ok_many, m0, m1 = await pipeline(gpu.streams)
        facts: dict[str, Any] = {
            "backend": gpu.device.backend,
            "device": gpu.device.name,
            "elements": chunks * c,
            "chunks": chunks,
            "bytes": y.nbytes,
            "verified": ok_first and ok_one and ok_many,
            "t_one_stream": s1 - s0,
            "t_streams": m1 - m0,
        }
    if sim is not None:  # the first run's launches (trace times are perf_counter values)
        events = [e for e in sim.trace if t0 <= e.t_start and e.t_end <= t1]
        facts["device"] += f", simulated kernels take {sim.kernel_time:g} s, copies {sim.copy_time:g} s"
        keys = ("kernels", "kernel_streams", "peak", "busy", "serial")
        facts.update(zip(keys, kernel_overlap(events)))
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto, sim or cuda:N")
    ap.add_argument("--chunks", type=int, default=4, help="chunks, one stream each")
    ap.add_argument("--n", type=int, default=1 << 20, help="float32 elements (at most 2**24; whole chunks)")
    ap.add_argument("--iters", type=int, default=1_000_000, help="LCG steps per element (kernel work)")
    args = ap.parse_args(argv)
    if not (1 <= args.chunks <= args.n <= 1 << 24) or not 0 <= args.iters < 1 << 32:
        ap.error("expected 1 <= chunks <= n <= 2**24 and 0 <= iters < 2**32")
    device: object = args.device
    if device == "auto":  # what open_scope("auto") checks; the simulator here gets timings
        from trio_cuda._backends import probe_cuda

        device = "cuda" if probe_cuda().available else "sim"
    if device == "sim":
        device = SimDevice(kernel_time=KERNEL_TIME, copy_time=COPY_TIME)
    f = trio.run(run, device, args.chunks, args.n, args.iters)

    mib, verdict = f["bytes"] / 2**20, "verified against NumPy" if f["verified"] else "WRONG"
    print(f"backend: {f['backend']} ({f['device']})")
    print(f"{f['chunks']} chunks of one {mib:.3g} MiB buffer, {args.iters:,} LCG steps per element")
    print(f"results: {f['elements']:,} elements x 3 runs {verdict}")
    if "busy" in f:
        print(
            f"trace: {f['kernels']} kernels on {f['kernel_streams']} streams ran {f['peak']} at a time: "
            f"busy {f['busy']:.3f} s of {f['serial']:.3f} s serial, {f['serial'] / f['busy']:.2f}x overlap"
        )
    t1, tn = f["t_one_stream"], f["t_streams"]
    print(f"wall time: {tn:.3f} s on {f['chunks']} streams, {t1:.3f} s on one stream: {t1 / tn:.2f}x")
    print("chunked pipeline:", "OK" if f["verified"] else "FAILED")
    return 0 if f["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
