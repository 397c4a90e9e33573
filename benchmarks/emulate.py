"""The awaited path on an emulated device: library Python against Trio, no GPU.

    python3 benchmarks/emulate.py [--launch-us 1.8] [--device-us 3.0] [--profile ROW]

A null driver with GPU-like timings (a launch costs ``--launch-us`` of host
time, busy-waited; a kernel completes ``--device-us`` after its launch, in
stream order; a flag write costs a third of a launch) runs the library's
awaited path and the Trio floor (the same emulated launch and flag, the least
Trio scheduling per await) in one process. Use it to A/B the core's
bookkeeping on a development machine; the figures that count come from
``benchmarks/run.py`` on a real GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trio_cuda
from trio_cuda._core._driver import DONE, PENDING, Capabilities, DeviceInfo, Poll
from trio_cuda._core._manager import scope_manager

perf = time.perf_counter
LAUNCH = 1.8e-6
DEVICE = 3.0e-6


def busy(seconds: float) -> None:
    end = perf() + seconds
    while perf() < end:
        pass


class EmuStream:
    __slots__ = ("busy_until", "index")

    def __init__(self, index: int) -> None:
        self.index = index
        self.busy_until = 0.0


class EmuMarker:
    __slots__ = ("at", "stream")

    def __init__(self, stream: EmuStream, at: float) -> None:
        self.stream = stream
        self.at = at


class EmuContext:
    """The DeviceContext protocol with timings and nothing else."""

    info = DeviceInfo("emulated", "emulated GPU", 0, 1 << 34)
    capabilities = Capabilities(batch_markers=True, await_spin=20e-6)

    def __init__(self) -> None:
        self._next = 1 << 20

    def create_stream(self, index: int) -> EmuStream:
        return EmuStream(index)

    def destroy_stream(self, stream: Any) -> None:
        pass

    def alloc(self, nbytes: int, stream: Any) -> int:
        p = self._next
        self._next += (nbytes + 255) // 256 * 256
        return p

    def free(self, ptr: int, nbytes: int) -> None:
        pass

    def fill(self, stream: Any, dst: int, pattern: bytes, count: int) -> None:
        self._work(stream)

    def copy_h2d(self, stream: Any, dst: int, src: Any) -> None:
        self._work(stream)

    def copy_d2h(self, stream: Any, dst: Any, src: int, *, direct: bool = False) -> None:
        self._work(stream)

    def copy_d2d(self, stream: Any, dst: int, src: int, nbytes: int) -> None:
        self._work(stream)

    def load_kernel(self, kernel: Any) -> object:
        return object()

    def unload_kernel(self, function: object) -> None:
        pass

    def check_launch(self, function: object, launch: Any) -> None:
        pass

    def _work(self, stream: EmuStream) -> None:
        now = perf()
        stream.busy_until = max(now, stream.busy_until) + DEVICE

    def launch(self, stream: EmuStream, function: object, launch: Any) -> None:
        busy(LAUNCH)
        self._work(stream)

    def record_marker(self, stream: EmuStream) -> EmuMarker:
        busy(LAUNCH / 3)
        return EmuMarker(stream, stream.busy_until)

    def poll_marker(self, marker: EmuMarker) -> Poll:
        return DONE if perf() >= marker.at else PENDING

    def wait_marker(self, stream: EmuStream, marker: EmuMarker) -> None:
        stream.busy_until = max(stream.busy_until, marker.at)

    async def wait_for_progress(self, pending: Sequence[EmuMarker]) -> None:
        end = perf() + 200e-6
        while perf() < end:
            if any(perf() >= m.at for m in pending):
                return
            await trio.lowlevel.checkpoint()
        await trio.sleep(0.0005)

    def notify_submitted(self) -> None:
        pass

    def last_command(self) -> int | None:
        return None

    def command_times(self, ids: Sequence[int]) -> dict[int, tuple[float, float]]:
        return {}

    def close(self) -> None:
        pass


SRC = (
    'extern "C" __global__ void empty(const float* a, const float* b, const float* c, const float* d, int n)'
    " {}"
)


def _ref(a: Any, b: Any, c: Any, d: Any, n: Any) -> None:
    pass


EMPTY = trio_cuda.Kernel.from_source(
    SRC, "empty", params=[trio_cuda.In("f4")] * 4 + [trio_cuda.Scalar("i4")], reference=_ref
)

WRITE2_SRC = 'extern "C" __global__ void write2(float* a, float* b, int n) {}'


def _ref2(a: Any, b: Any, n: Any) -> None:
    pass


#: writes both its arrays: every launch conflicts with the last one on another stream
WRITE2 = trio_cuda.Kernel.from_source(
    WRITE2_SRC, "write2", params=[trio_cuda.InOut("f4")] * 2 + [trio_cuda.Scalar("i4")], reference=_ref2
)


# --------------------------------------------------------------------------- the Trio floor


class Flag:
    """A pinned flag written by the emulated ``cuStreamWriteValue32``."""

    __slots__ = ("at",)


def floor_launch(stream: EmuStream) -> Flag:
    busy(LAUNCH)
    stream.busy_until = max(perf(), stream.busy_until) + DEVICE
    busy(LAUNCH / 3)  # the flag write
    f = Flag()
    f.at = stream.busy_until
    return f


async def floor_await(stream: EmuStream) -> None:
    f = floor_launch(stream)
    while True:
        await trio.lowlevel.checkpoint()
        if perf() >= f.at:
            return


async def floor_tasks(ntasks: int, per_task: int, streams: list[EmuStream]) -> float:
    go = trio.Event()

    async def worker(i: int) -> None:
        await go.wait()
        s = streams[i % len(streams)]
        for _ in range(per_task):
            await floor_await(s)

    async with trio.open_nursery() as n:
        for i in range(ntasks):
            n.start_soon(worker, i)
        await _start_line()
        t0 = perf()
        go.set()
    return ntasks * per_task / (perf() - t0)


async def _start_line() -> None:
    for _ in range(100):
        await trio.lowlevel.checkpoint()
        if not trio.lowlevel.current_statistics().tasks_runnable:
            break


# --------------------------------------------------------------------------- the library


async def lib_tasks(gpu: Any, op: Any, ntasks: int, per_task: int) -> float:
    go = trio.Event()

    async def worker() -> None:
        await go.wait()
        for _ in range(per_task):
            await gpu.run(op)

    async with trio.open_nursery() as n:
        for _ in range(ntasks):
            n.start_soon(worker)
        await _start_line()
        t0 = perf()
        go.set()
    return ntasks * per_task / (perf() - t0)


async def lib_typed_tasks(gpu: Any, make: Any, ntasks: int, per_task: int, *, pin: bool) -> float:
    """Launches/s of ``ntasks`` tasks, each awaiting ``per_task`` launches
    built per await by ``make()``; with ``pin``, task i runs on stream i % 4
    (else the policy picks)."""
    go = trio.Event()
    streams = gpu.streams

    async def worker(i: int) -> None:
        s = streams[i % len(streams)] if pin else None
        await go.wait()
        for _ in range(per_task):
            await gpu.run(make(), stream=s)

    async with trio.open_nursery() as n:
        for i in range(ntasks):
            n.start_soon(worker, i)
        await _start_line()
        t0 = perf()
        go.set()
    return ntasks * per_task / (perf() - t0)


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


async def main(reps: int, only: str) -> dict[str, float]:
    out: dict[str, float] = {}
    streams = [EmuStream(i) for i in range(4)]
    # raw launch + sync: the round trip with no Trio
    per = []
    for _ in range(reps):
        t0 = perf()
        for _ in range(200):
            f = floor_launch(streams[0])
            while perf() < f.at:
                pass
        per.append((perf() - t0) / 200 * 1e6)
    out["launch+sync"] = med(per)
    per = []
    for _ in range(reps):
        t0 = perf()
        for _ in range(200):
            await floor_await(streams[0])
        per.append((perf() - t0) / 200 * 1e6)
    out["floor roundtrip"] = med(per)
    out["floor 100 tasks"] = med([await floor_tasks(100, 100, streams) for _ in range(reps)])
    out["floor 10k tasks"] = med([await floor_tasks(10_000, 3, streams) for _ in range(max(1, reps // 2))])

    async with scope_manager(EmuContext, streams=4) as gpu:
        op, s = await _launch_setup(gpu)
        out["lib roundtrip"] = await _roundtrip(gpu, op, s, reps)
        per = []
        for _ in range(reps):
            gc.disable()
            t0 = perf()
            for _ in range(1000):
                fut = gpu.submit(op, stream=s)
            per.append((perf() - t0) / 1000 * 1e6)
            gc.enable()
            await fut.wait()
        out["lib submit"] = med(per)
        out["lib 100 tasks"] = med([await lib_tasks(gpu, op, 100, 100) for _ in range(reps)])
        out["lib 10k tasks"] = med([await lib_tasks(gpu, op, 10_000, 3) for _ in range(max(1, reps // 2))])
        # typed launch per await: independent reads, then 4 streams that all
        # write the same two buffers (every launch a cross-stream conflict)
        bufs = [gpu.empty(256, np.float32) for _ in range(4)]

        def typed() -> Any:
            return EMPTY.launch(*bufs, 256, grid=1, block=1)

        a, b = bufs[:2]

        def writes() -> Any:
            return WRITE2.launch(a, b, 256, grid=1, block=1)

        await gpu.run(writes())
        out["lib 100 typed"] = med(
            [await lib_typed_tasks(gpu, typed, 100, 100, pin=False) for _ in range(reps)]
        )
        out["lib 100 conflict"] = med(
            [await lib_typed_tasks(gpu, writes, 100, 100, pin=True) for _ in range(reps)]
        )

    # the same round trip with a lifetime trace recording
    trace = trio_cuda.trace.Trace(limit=100_000)
    async with scope_manager(EmuContext, streams=4, trace=trace._tracer) as gpu:
        op, s = await _launch_setup(gpu)
        out["traced roundtrip"] = await _roundtrip(gpu, op, s, reps)
    return out


async def _launch_setup(gpu: Any) -> tuple[Any, Any]:
    """The benchmark's launch (4 arrays, loaded) and the stream it runs on."""
    bufs = [gpu.empty(256, np.float32) for _ in range(4)]
    op = EMPTY.launch(*bufs, 256, grid=1, block=1)
    s = gpu.streams[0]
    await gpu.run(op, stream=s)
    return op, s


async def _roundtrip(gpu: Any, op: Any, s: Any, reps: int) -> float:
    """Median µs of one ``await gpu.run(op)``, 200 in a row per repeat."""
    per = []
    for _ in range(reps):
        t0 = perf()
        for _ in range(200):
            await gpu.run(op, stream=s)
        per.append((perf() - t0) / 200 * 1e6)
    return med(per)


def report(out: dict[str, float]) -> None:
    for k, val in out.items():
        print(f"{k:<18} {val:12.2f}")
    print(f"roundtrip / launch+sync   {out['lib roundtrip'] / out['launch+sync']:.3f}")
    print(f"floor rt / launch+sync    {out['floor roundtrip'] / out['launch+sync']:.3f}")
    print(f"traced / untraced rt      {out['traced roundtrip'] / out['lib roundtrip']:.3f}")
    print(f"submit / launch           {out['lib submit'] / (LAUNCH * 1e6):.3f}")
    print(f"100 tasks / floor         {out['lib 100 tasks'] / out['floor 100 tasks']:.3f}")
    print(f"10k / 100 tasks (lib)     {out['lib 10k tasks'] / out['lib 100 tasks']:.3f}")
    print(f"conflict / 100 tasks      {out['lib 100 conflict'] / out['lib 100 tasks']:.3f}")
    print(f"conflict / 100 typed      {out['lib 100 conflict'] / out['lib 100 typed']:.3f}")
    print(f"10k / 100 tasks (floor)   {out['floor 10k tasks'] / out['floor 100 tasks']:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch-us", type=float, default=LAUNCH * 1e6)
    ap.add_argument("--device-us", type=float, default=DEVICE * 1e6)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="cProfile the library rows")
    args = ap.parse_args()
    LAUNCH, DEVICE = args.launch_us * 1e-6, args.device_us * 1e-6
    if args.profile:
        import cProfile
        import pstats

        cProfile.run("trio.run(main, 3, '')", "/tmp/emu.prof")
        pstats.Stats("/tmp/emu.prof").sort_stats("tottime").print_stats(25)
    else:
        report(trio.run(main, args.reps, ""))
