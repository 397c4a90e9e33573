"""The ``multigpu`` section of ``benchmarks/run.py`` (``--only multigpu``).

Needs two CUDA devices (prints why and returns otherwise). Measures, as
medians over repeats:

* peer-copy bandwidth, device 0 -> device 1, as ``ops.copy`` submitted on the
  receiving scope (pull) and on the sending scope (push), against the
  device-to-device copy rate on one device (``ops.copy`` within cuda:0);
* overlap of compute on two devices: two long kernels on two devices at once
  (through a ``DevicePool``) against the same two one after the other.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import Kernel, Scalar, ops
from trio_cuda._backends import probe_cuda

SPIN_SRC = r"""
extern "C" __global__ void spin_mg(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
SPIN = Kernel.from_source(SPIN_SRC, "spin_mg", params=[Scalar("u8")])
perf = time.perf_counter


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


async def _bandwidth(scope: trio_cuda.ResourceScope, dst: Any, src: Any, copies: int, repeats: int) -> float:
    """Median GB/s of ``copies`` back-to-back copies submitted on ``scope``."""
    op = ops.copy(dst, src)
    await scope.run(op)  # warm up (peer access, pools)
    rates = []
    for _ in range(repeats):
        t0 = perf()
        fut = None
        for _ in range(copies):
            fut = scope.submit(op)
        assert fut is not None
        await fut.wait()
        rates.append(copies * dst.nbytes / (perf() - t0) / 1e9)
    return _med(rates)


async def _multigpu(record: Callable[..., float], reps: Callable[[int], int]) -> None:
    nbytes = 256 << 20
    n = nbytes // 4
    async with trio_cuda.open_device_pool(["cuda:0", "cuda:1"]) as pool:
        a, b = pool
        try:
            from trio_cuda._backends.cuda.peer import peer_access

            direct = peer_access(a._driver, b._driver)  # type: ignore[arg-type]
        except Exception:  # pragma: no cover - informational only
            direct = False
        print(f"multigpu ({a.device.name} x2, peer access: {'yes' if direct else 'no (staged)'})")
        xa = a.zeros(n, np.float32)
        ya = a.empty(n, np.float32)
        yb = b.empty(n, np.float32)
        R = reps(7)
        d2d = record("d2d_copy_one_device", await _bandwidth(a, ya, xa, 8, R), "GB/s", "256 MiB, cuda:0")
        pull = record("peer_copy_pull", await _bandwidth(b, yb, xa, 8, R), "GB/s", "256 MiB 0->1, on cuda:1")
        push = record("peer_copy_push", await _bandwidth(a, yb, xa, 8, R), "GB/s", "256 MiB 0->1, on cuda:0")
        record("peer_pull_vs_d2d", pull / d2d, "x", "ratio")
        record("peer_push_vs_d2d", push / d2d, "x", "ratio")

        spin = SPIN.launch(np.uint64(50_000_000), grid=1, block=1)  # 50 ms
        await a.run(spin)
        await b.run(spin)
        seq, par = [], []
        for _ in range(max(3, R // 2)):
            t0 = perf()
            await a.run(spin)
            await b.run(spin)
            seq.append(perf() - t0)
            t0 = perf()
            fa = a.submit(spin)
            fb = b.submit(spin)
            await fa.wait()
            await fb.wait()
            par.append(perf() - t0)
        s_ms = record("two_kernels_one_after_other", _med(seq) * 1e3, "ms", "2 x 50 ms on cuda:0, cuda:1")
        p_ms = record("two_kernels_at_once", _med(par) * 1e3, "ms", "2 x 50 ms on cuda:0, cuda:1")
        record("two_device_overlap", s_ms / p_ms, "x", "sequential / concurrent (ideal 2.0)")


def bench_multigpu(record: Callable[..., float], reps: Callable[[int], int]) -> None:
    probe = probe_cuda()
    if probe.device_count < 2:
        print(f"multigpu: skipped, needs 2 CUDA devices, found {probe.device_count}")
        return
    trio.run(_multigpu, record, reps)
