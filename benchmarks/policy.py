"""The ``policy`` section: how the stream-choosing policy lets work overlap.

    python3 benchmarks/policy.py          # on the GPU (cuda:0)
    python3 benchmarks/policy.py --sim    # on the simulator (50 ms kernels)

For each policy (:class:`~trio_cuda.RoundRobin`, :class:`~trio_cuda.LeastLoaded`
and the default, :class:`~trio_cuda.FollowWriter`), as medians over repeats:

* ``upload_kernel``: the common loop ``for i in range(4): x = await
  gpu.to_device(a_i); fut_i = gpu.submit(spin 50 ms on x)``, then await all.
  Independent kernels: ideal is one kernel's time (they overlap on 4 streams);
  the streams the kernels ran on are reported.
* ``chains``: 4 independent chains of 3 dependent kernels (``x_i -> y_i ->
  z_i -> w_i``, 50 ms each), submitted without awaiting, then await all.
  Ideal is three kernels' time; a policy that spreads one chain's links over
  several streams makes later chains queue behind earlier links.
* ``choose_ns``: host nanoseconds per ``policy.choose(streams, launch)`` on
  4 streams (the cost every unpinned submission pays).

``bench_policy(record, reps)`` is what ``benchmarks/run.py`` calls; on a
machine without a GPU it prints why and returns.
"""

from __future__ import annotations

import argparse
import itertools
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
from trio_cuda import In, Kernel, Out, Scalar
from trio_cuda._backends import probe_cuda

SPIN_SRC = r"""
__device__ void spin_for(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
extern "C" __global__ void spin_read(const float* x, unsigned long long ns) { spin_for(ns); }
extern "C" __global__ void spin_copy(const float* x, float* y, int n, unsigned long long ns) {
    spin_for(ns);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i];
}
"""


def _read_ref(x: Any, ns: Any) -> None:
    pass


def _copy_ref(x: Any, y: Any, n: Any, ns: Any) -> None:
    y[:n] = x[:n]


SPIN_READ = Kernel.from_source(SPIN_SRC, "spin_read", params=[In("f4"), Scalar("u8")], reference=_read_ref)
SPIN_COPY = Kernel.from_source(
    SPIN_SRC,
    "spin_copy",
    params=[In("f4"), Out("f4"), Scalar("i4"), Scalar("u8")],
    reference=_copy_ref,
)
KERNEL_NS = 50_000_000  # 50 ms
N = 1024
POLICIES: list[tuple[str, Callable[[], trio_cuda.SchedulingPolicy]]] = [
    ("round_robin", trio_cuda.RoundRobin),
    ("least_loaded", trio_cuda.LeastLoaded),
    ("follow_writer", trio_cuda.FollowWriter),  # the default
]
perf = time.perf_counter


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


async def _settle(gpu: trio_cuda.ResourceScope) -> None:
    """Until the scope retired everything (leases released)."""
    while gpu.statistics().in_flight:  # noqa: ASYNC110 - polling public statistics
        await trio.sleep(0.0005)


async def _upload_kernel(gpu: trio_cuda.ResourceScope, hosts: list[Any]) -> tuple[float, list[int]]:
    ns = np.uint64(KERNEL_NS)
    t0 = perf()
    futs = []
    for a in hosts:
        x = await gpu.to_device(a)
        futs.append(gpu.submit(SPIN_READ.launch(x, ns, grid=1, block=1)))
    for f in futs:
        await f.wait()
    dt = perf() - t0
    return dt, [f.stream.index for f in futs]


async def _chains(gpu: trio_cuda.ResourceScope, bufs: list[list[Any]]) -> tuple[float, list[list[int]]]:
    ns = np.uint64(KERNEL_NS)
    t0 = perf()
    futs = []
    for chain in bufs:
        futs.append(
            [
                gpu.submit(SPIN_COPY.launch(src, dst, np.int32(N), ns, grid=1, block=32))
                for src, dst in itertools.pairwise(chain)
            ]
        )
    for fs in futs:
        for f in fs:
            await f.wait()
    dt = perf() - t0
    return dt, [[f.stream.index for f in fs] for fs in futs]


class _MinKey:
    """The previous ``LeastLoaded.choose``: ``min`` with a key function (for
    the per-choice cost only)."""

    def choose(self, streams: Any, op: Any) -> Any:
        return min(streams, key=lambda s: (s._in_flight, s.index))


def _choose_ns(streams: Any, policy: Any, launch: Any) -> float:
    """Host ns per ``policy.choose(streams, launch)``: best of 20 loops."""
    choose = policy.choose
    n = 20_000
    best = float("inf")
    for _ in range(20):
        t0 = perf()
        for _ in range(n):
            choose(streams, launch)
        best = min(best, perf() - t0)
    return best / n * 1e9


async def _choose_costs(device: object, record: Callable[..., float]) -> None:
    """Per-choice host cost on 4 streams, in three states: all idle; loaded
    [2, 2, 1, 1] in flight (the loop scans to stream 2); and a launch whose
    input was last written by the last work of stream 3 (FollowWriter's
    affinity case). Nothing awaits while a loop runs, so the counts hold."""
    ns = np.uint64(KERNEL_NS)
    policies: list[tuple[str, Any]] = [(name, make()) for name, make in POLICIES]
    policies.append(("least_loaded_min_key", _MinKey()))
    async with trio_cuda.open_scope(device=device, streams=4) as gpu:
        s = gpu.streams
        x = await gpu.to_device(np.ones(N, np.float32))
        y = gpu.zeros(N, np.float32)
        z = gpu.empty(N, np.float32)
        await gpu.run(SPIN_COPY.launch(x, y, np.int32(N), np.uint64(0), grid=1, block=32))
        await _settle(gpu)
        plain = SPIN_READ.launch(x, ns, grid=1, block=1)
        dependent = SPIN_COPY.launch(y, z, np.int32(N), ns, grid=1, block=32)
        for name, pol in policies:
            record(f"policy_{name}:choose_idle", _choose_ns(s, pol, plain), "ns", "4 idle streams")
        for i in (0, 0, 1, 1, 2):
            gpu.submit(plain, stream=s[i])
        gpu.submit(SPIN_COPY.launch(x, y, np.int32(N), ns, grid=1, block=32), stream=s[3])
        for name, pol in policies:
            record(f"policy_{name}:choose_loaded", _choose_ns(s, pol, plain), "ns", "in flight [2, 2, 1, 1]")
        for name, pol in policies:
            got = pol.choose(s, dependent).index
            record(
                f"policy_{name}:choose_dependent",
                _choose_ns(s, pol, dependent),
                "ns",
                f"input written last on stream 3; chose {got}",
            )
        await _settle(gpu)


async def _policy(device: object, record: Callable[..., float], reps: Callable[[int], int]) -> None:
    R = reps(5)
    rng = np.random.default_rng(0)
    hosts = [rng.random(N, dtype=np.float32) for _ in range(4)]
    for name, make in POLICIES:
        async with trio_cuda.open_scope(device=device, streams=4, policy=make()) as gpu:
            # warm up: load the kernels, fill the memory pool
            x = await gpu.to_device(hosts[0])
            y = gpu.empty(N, np.float32)
            await gpu.run(SPIN_READ.launch(x, np.uint64(0), grid=1, block=1))
            await gpu.run(SPIN_COPY.launch(x, y, np.int32(N), np.uint64(0), grid=1, block=32))
            await _settle(gpu)

            times: list[float] = []
            used: list[int] = []
            for _ in range(R):
                dt, used = await _upload_kernel(gpu, hosts)
                times.append(dt)
                await _settle(gpu)
            record(f"policy_{name}:upload_kernel", _med(times), "s", f"streams {used}")

            bufs = [
                [await gpu.to_device(hosts[i])] + [gpu.empty(N, np.float32) for _ in range(3)]
                for i in range(4)
            ]
            await _settle(gpu)
            times = []
            chains: list[list[int]] = []
            for _ in range(R):
                dt, chains = await _chains(gpu, bufs)
                times.append(dt)
                await _settle(gpu)
            record(f"policy_{name}:chains", _med(times), "s", f"streams {chains}")

    await _choose_costs(device, record)


async def _submit_costs(device: object, record: Callable[..., float], reps: Callable[[int], int]) -> None:
    """Host µs per ``gpu.submit`` of a prebuilt launch (an empty kernel that
    reads one array), in bursts of 400: pinned to one stream, and unpinned
    under each policy (the streams fill up as the burst goes on)."""
    R = reps(15)
    burst = 400
    for name, make in [("pinned", trio_cuda.LeastLoaded), *POLICIES]:
        async with trio_cuda.open_scope(device=device, streams=4, policy=make()) as gpu:
            x = await gpu.to_device(np.ones(N, np.float32))
            launch = SPIN_READ.launch(x, np.uint64(0), grid=1, block=1)
            stream = gpu.streams[0] if name == "pinned" else None
            await gpu.run(launch)
            await _settle(gpu)
            per: list[float] = []
            for _ in range(R):
                t0 = perf()
                for _ in range(burst):
                    gpu.submit(launch, stream=stream)
                per.append((perf() - t0) / burst * 1e6)
                await _settle(gpu)
            record(f"policy_{name}:submit_us", _med(per), "us", f"bursts of {burst}, 4 streams")


def bench_policy(record: Callable[..., float], reps: Callable[[int], int]) -> None:
    """Run the section on cuda:0 (prints why and returns without a GPU)."""
    probe = probe_cuda()
    if not probe.available:
        print(f"policy: skipped, no CUDA device: {probe.reason}")
        return
    print("stream policies (4 streams, 50 ms kernels; wall s, streams used)")
    trio.run(_policy, "cuda", record, reps)
    trio.run(_submit_costs, "cuda", record, reps)


def bench_policy_sim(record: Callable[..., float], reps: Callable[[int], int]) -> None:
    """The same on the simulator: ``SimDevice(kernel_time=0.05)``."""
    from trio_cuda.testing import SimDevice

    print("stream policies on the simulator (4 streams, kernel_time=0.05; wall s, streams used)")
    trio.run(_policy, SimDevice(kernel_time=KERNEL_NS / 1e9), record, reps)
    trio.run(_submit_costs, SimDevice(), record, reps)  # instant kernels: host cost only


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true", help="run on the simulator instead of a GPU")
    ap.add_argument("--reps", type=int, default=5, help="repeats of the 50 ms scenarios (median)")
    args = ap.parse_args()
    scale: int = args.reps

    def record(key: str, value: float, unit: str, note: str = "") -> float:
        print(f"  {key:<40} {value:12.3f} {unit} {note}", flush=True)
        return value

    def reps(n: int) -> int:
        return max(1, n * scale // 5)

    run = bench_policy_sim if args.sim else bench_policy
    run(record, reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
