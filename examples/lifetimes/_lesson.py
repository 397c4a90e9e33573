"""What the lifetime lessons share: options, the device, two kernels, narration and checks.

Every lesson's ``main(argv) -> int`` calls :func:`run_lesson`, which parses the
options below, runs the lesson's ``lesson(L)`` coroutine with a :class:`Lesson`
``L``, writes the trace page and returns 0 if every check held, 1 if not, and 2
if it could not run (a bad option, or a GPU asked for that is not there: one
error line, before anything runs).

    --device sim | cuda | cuda:N   where to run (default: the simulator)
    --trace FILE                   where to write the timeline page (.html; .json for Perfetto)
    --out DIR                      or the folder for <lesson>.html (default: a new
                                   folder in the system's temporary folder)
    --no-trace                     write no page

The page's path is printed (``timeline: PATH``); without ``--trace`` or
``--out`` nothing is written to the current folder.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import trio

import trio_cuda
from trio_cuda import In, InOut, Kernel, Scalar
from trio_cuda.testing import SimDevice
from trio_cuda.trace import Trace, TraceEvent

# One thread of each kernel waits ``ns`` nanoseconds on the GPU's clock, so that a
# launch on a real GPU takes about as long as SimDevice(kernel_time=...) makes it
# take on the simulator (where the NumPy reference runs and ``ns`` is ignored).
SRC = r"""
__device__ void spin(unsigned long long ns) {
    if (ns == 0 || blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
extern "C" __global__ void add(float* x, float v, int n, unsigned long long ns) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
    spin(ns);
}
extern "C" __global__ void axpy(float a, const float* x, float* y, int n, unsigned long long ns) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
    spin(ns);
}
"""


def _add_ref(x: np.ndarray, v: np.float32, n: np.int32, ns: np.uint64) -> None:
    x[:n] += v


def _axpy_ref(a: np.float32, x: np.ndarray, y: np.ndarray, n: np.int32, ns: np.uint64) -> None:
    y[:n] = a * x[:n] + y[:n]


ADD = Kernel.from_source(
    SRC, "add", params=[InOut("f4"), Scalar("f4"), Scalar("i4"), Scalar("u8")], reference=_add_ref
)
AXPY = Kernel.from_source(
    SRC, "axpy", params=[Scalar("f4"), In("f4"), InOut("f4"), Scalar("i4"), Scalar("u8")], reference=_axpy_ref
)
KERNELS = (ADD, AXPY)


class Lesson:
    """The device to use, the trace being recorded, kernels that take ``kernel_time``,
    and ``say``/``check`` for the narration."""

    def __init__(self, device: str, kernel_time: float, sim_only: str | None, sim_options: dict) -> None:
        self.kernel_time = kernel_time
        self.trace = Trace()
        self.failures: list[str] = []
        self.sim: SimDevice | None = None
        self.device: object = device
        if device.startswith("cuda") and sim_only:
            print(f"note: {device} asked for, but this lesson needs the simulator ({sim_only}): using it")
        if device.startswith("cuda") and not sim_only:
            print(f"backend: {device} (each kernel spins {kernel_time:.3f} s on the GPU clock)")
        else:
            self.sim = self.device = SimDevice(kernel_time=kernel_time, **sim_options)
            print(f"backend: sim (the simulated device; each kernel takes {kernel_time:.3f} s)")
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since the lesson started."""
        return time.perf_counter() - self.t0

    def say(self, text: str) -> None:
        print(f"{self.now():7.3f} s  {text}")

    def check(self, ok: bool, text: str) -> bool:
        print(f"{'ok' if ok else 'FAILED':>9}: {text}")
        if not ok:
            self.failures.append(text)
        return ok

    def _spin(self) -> np.uint64:
        return np.uint64(0 if self.sim is not None else round(self.kernel_time * 1e9))

    def add(self, x: trio_cuda.DeviceArray, v: float) -> trio_cuda.KernelLaunch:
        """``x += v``: writes x (an exclusive lease)."""
        return ADD.launch(x, np.float32(v), np.int32(x.size), self._spin(), grid=-(-x.size // 256), block=256)

    def axpy(self, a: float, x: trio_cuda.DeviceArray, y: trio_cuda.DeviceArray) -> trio_cuda.KernelLaunch:
        """``y = a * x + y``: reads x (a shared lease), writes y (an exclusive one)."""
        return AXPY.launch(
            np.float32(a), x, y, np.int32(x.size), self._spin(), grid=-(-x.size // 256), block=256
        )

    async def until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        """Sleep until ``done()`` -- without awaiting any of the work it watches."""
        with trio.fail_after(timeout):
            while not done():  # noqa: ASYNC110 - polling the scope's counters is the point
                await trio.sleep(0.001)

    def names(self, **arrays: trio_cuda.DeviceArray) -> str:
        """``x: alloc 0x7f...`` for each array: how the timeline page names its allocation."""
        return ", ".join(f"{k}: alloc {a.ptr:#x}" for k, a in arrays.items())

    def retired_by(self, op: str) -> list[str]:
        """Who retired each submission named ``op`` (a kernel's name, ``copy``, ...):
        ``waiter``, ``handoff`` or ``exit``, from the trace."""
        subs = {
            (e.scope, e.submission)
            for e in self.trace.events
            if e.cat in ("submit", "enqueue") and e.name == op
        }
        return [e.name for e in self.trace.events if e.cat == "retire" and (e.scope, e.submission) in subs]

    def events(self, cat: str) -> list[TraceEvent]:
        """The trace events recorded so far of one category (``wait``, ``retire``, ...)."""
        return [e for e in self.trace.events if e.cat == cat]


async def _unavailable(device: str) -> str:
    """Why ``device`` cannot be used ("" if it can): open a scope on it and close it."""
    try:
        async with trio_cuda.open_scope(device=device):
            pass
    except trio_cuda.DeviceUnavailableError as exc:
        return f"{exc.reason}; --device sim runs the lesson on the simulator"
    return ""


def run_lesson(
    lesson: Callable[[Lesson], Awaitable[None]],
    argv: list[str] | None,
    *,
    file: str,
    doc: str | None,
    kernel_time: float,
    sim_only: str | None = None,
    sim_options: dict | None = None,
    look_for: str = "",
) -> int:
    """Run one lesson: parse ``argv``, run it, write its page, say whether the rule held."""
    name = Path(file).stem
    ap = argparse.ArgumentParser(
        prog=Path(file).name, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="sim", help="sim (default), cuda or cuda:N")
    ap.add_argument(
        "--trace", metavar="FILE", help="write the timeline page here (default: DIR/<lesson>.html)"
    )
    ap.add_argument(
        "--out",
        metavar="DIR",
        help="folder for the timeline page (default: a new folder in the system's temporary folder)",
    )
    ap.add_argument("--no-trace", action="store_true", help="do not write the timeline page")
    args = ap.parse_args(argv)
    if args.device != "sim" and re.fullmatch(r"cuda(:\d+)?", args.device) is None:
        ap.error(f"--device: expected sim, cuda or cuda:N, got {args.device!r}")
    if args.trace and os.path.isdir(args.trace):
        ap.error(f"--trace: expected a file name, not a folder, got {args.trace!r}")
    if args.trace and not args.trace.lower().endswith((".html", ".htm", ".json")):
        ap.error(f"--trace: expected a file name ending in .html (or .json), got {args.trace!r}")
    if args.device != "sim" and not sim_only:
        problem = trio.run(_unavailable, args.device)
        if problem:  # like the demo: one line, nothing run
            print(f"{ap.prog}: error: --device {args.device}: {problem}", file=sys.stderr)
            return 2
    print(f"{name}: {(doc or '').strip().splitlines()[0]}")
    L = Lesson(args.device, kernel_time, sim_only, sim_options or {})
    trio.run(lesson, L)
    if L.sim is not None:
        L.check(L.sim.violations == [], "the simulator's memcheck saw no use of freed memory")
    if not args.no_trace:
        if args.trace:
            path = Path(args.trace)
        elif args.out:
            path = Path(args.out) / f"{name}.html"
        else:
            path = Path(tempfile.mkdtemp(prefix=f"{name}-")) / f"{name}.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        L.trace.write(path)
        print(f"timeline: {path} ({len(L.trace.events)} events)")
        if look_for:
            print(f"  look for: {look_for}")
    if L.failures:
        print(f"the rule did NOT hold: {len(L.failures)} check(s) failed")
        return 1
    print("the rule held: every check passed")
    return 0
