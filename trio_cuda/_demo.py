"""The batch job behind ``python -m trio_cuda demo`` and ``examples/batch_job.py``.

A cancellation-safe batch: many input vectors go through two kernels (``saxpy``
then ``scale_shift``), at most ``concurrency`` at a time. A deadline cancels the
batch part-way, while kernels are in flight. Every result that completed is
checked against the kernels' NumPy references, and at the end the job checks
that nothing leaked: the scope retired every submission, released every lease,
quarantined nothing, and (on the simulator) memcheck saw no violation and every
allocation was freed.

Both kernels take a ``spin_ns`` argument: on a real GPU, one thread waits that
long on the GPU's clock, so a launch takes about as long as a launch on the
simulator with ``SimDevice(kernel_time=...)``. The deadline then cancels real
in-flight work on both backends.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import attrs
import numpy as np
import trio

from . import trace
from ._core._array import DeviceArray
from ._core._kernel import Kernel
from ._core._params import In, InOut, Out, Scalar
from ._core._scope import ResourceScope, ScopeStatistics
from ._open import open_scope
from .testing import SimAllocation, SimDevice, Violation

__all__ = ["BatchConfig", "BatchReport", "build_parser", "main", "make_kernels", "run_batch"]

KERNEL_SOURCE = r"""
__device__ __forceinline__ unsigned long long trio_cuda_demo_now()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* One thread of the grid waits spin_ns nanoseconds, so that the launch takes
   a predictable time (the simulator's kernel_time plays this part there). */
__device__ __forceinline__ void trio_cuda_demo_spin(unsigned long long spin_ns)
{
    if (spin_ns == 0 || blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long start = trio_cuda_demo_now();
    while (trio_cuda_demo_now() - start < spin_ns) { }
}

extern "C" __global__ void saxpy(float a, const float* x, float* y, int n,
                                 unsigned long long spin_ns)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
    trio_cuda_demo_spin(spin_ns);
}

extern "C" __global__ void scale_shift(const float* y, float* out, float scale, float shift,
                                       int n, unsigned long long spin_ns)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = y[i] * scale + shift;
    trio_cuda_demo_spin(spin_ns);
}
"""

BLOCK = 256
RTOL = 1e-5
ATOL = 1e-5


def saxpy_reference(
    a: np.float32, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], n: np.int32, spin_ns: Any
) -> None:
    """CPU behaviour of ``saxpy``: ``y[:n] = a * x[:n] + y[:n]``."""
    y[:n] = a * x[:n] + y[:n]


def scale_shift_reference(
    y: np.ndarray[Any, Any],
    out: np.ndarray[Any, Any],
    scale: np.float32,
    shift: np.float32,
    n: np.int32,
    spin_ns: Any,
) -> None:
    """CPU behaviour of ``scale_shift``: ``out[:n] = y[:n] * scale + shift``."""
    out[:n] = y[:n] * scale + shift


@attrs.frozen
class Kernels:
    """The two kernels of the batch job."""

    saxpy: Kernel
    scale_shift: Kernel


def make_kernels() -> Kernels:
    """Build the batch job's kernels (CUDA C++ source plus NumPy references)."""
    saxpy = Kernel.from_source(
        KERNEL_SOURCE,
        "saxpy",
        params=[Scalar("f4"), In("f4"), InOut("f4"), Scalar("i4"), Scalar("u8")],
        reference=saxpy_reference,
    )
    scale_shift = Kernel.from_source(
        KERNEL_SOURCE,
        "scale_shift",
        params=[In("f4"), Out("f4"), Scalar("f4"), Scalar("f4"), Scalar("i4"), Scalar("u8")],
        reference=scale_shift_reference,
    )
    return Kernels(saxpy, scale_shift)


@attrs.frozen
class BatchConfig:
    """Settings of one batch run (see ``python -m trio_cuda demo --help``)."""

    inputs: int = 64
    size: int = 4096
    concurrency: int = 8
    deadline: float = 0.1  #: seconds; math.inf for none
    kernel_ms: float = 5.0  #: time each launch takes (simulated, or spun on the GPU)
    device: str = "auto"
    streams: int = 4
    seed: int = 0
    progress_every: int = 8  #: a progress line every this many completions (0: none)


@attrs.define
class BatchReport:
    """What a batch run did and which checks passed."""

    backend: str = ""
    backend_detail: str = ""
    completed: int = 0
    verified: int = 0
    mismatched: list[int] = attrs.field(factory=list)
    failed: list[tuple[int, str]] = attrs.field(factory=list)
    #: items cancelled by the deadline, by the phase they were in
    cancelled: dict[str, int] = attrs.field(factory=dict)
    deadline_hit: bool = False
    in_flight_at_deadline: int = 0
    leases_at_deadline: int = 0
    elapsed: float = 0.0
    final_stats: ScopeStatistics | None = None
    sim_violations: list[Violation] | None = None
    sim_live_allocations: list[SimAllocation] | None = None
    scope_errors: list[str] = attrs.field(factory=list)
    problems: list[str] = attrs.field(factory=list)

    @property
    def cancelled_total(self) -> int:
        return sum(self.cancelled.values())

    @property
    def cancelled_in_flight(self) -> int:
        """Items cancelled after some of their GPU work was submitted."""
        return sum(n for phase, n in self.cancelled.items() if phase != "waiting")

    @property
    def ok(self) -> bool:
        return not self.problems


# --------------------------------------------------------------------------- backend choice


def _resolve_device(device: str, kernel_ms: float) -> tuple[str | SimDevice, str]:
    """What to pass to ``open_scope(device=...)``, and why it was chosen.

    On the simulator, launches take ``kernel_ms`` of simulated time, so that the
    deadline cancels work that is really in flight.
    """
    from ._backends import _cuda_backend_available, probe_cuda

    kernel_time = max(0.0, kernel_ms) / 1e3
    if device == "sim":
        return SimDevice(kernel_time=kernel_time), "asked for with --device sim"
    if device == "auto":
        probe = probe_cuda()
        if probe.available and _cuda_backend_available():
            return "cuda", ""
        reason = probe.reason if not probe.available else "the cuda backend is not installed"
        return SimDevice(kernel_time=kernel_time), reason
    return device, ""


def _describe_cuda(gpu: ResourceScope) -> str:
    info = gpu.device
    major, minor = info.compute_capability
    return (
        f"{info.name}, device {info.ordinal}, compute capability {major}.{minor}, "
        f"{info.multiprocessor_count} SMs, {info.total_memory / 2**30:.0f} GiB"
    )


# --------------------------------------------------------------------------- the job


@attrs.define
class _Progress:
    total: int
    every: int
    say: Callable[[str], None]
    started_at: float
    done: int = 0
    phase: dict[int, str] = attrs.field(factory=dict)

    def completed(self) -> None:
        self.done += 1
        if self.every and (self.done % self.every == 0 or self.done == self.total):
            running = sum(1 for p in self.phase.values() if p != "waiting")
            self.say(
                f"progress: {self.done:3d}/{self.total} done, {running} in flight, "
                f"{time.perf_counter() - self.started_at:6.3f} s"
            )


async def _process_one(
    gpu: ResourceScope,
    kernels: Kernels,
    index: int,
    x_host: np.ndarray[Any, Any],
    y_host: np.ndarray[Any, Any],
    a: np.float32,
    scale: np.float32,
    shift: np.float32,
    spin_ns: int,
    limiter: trio.CapacityLimiter,
    progress: _Progress,
    results: dict[int, np.ndarray[Any, Any]],
    report: BatchReport,
) -> None:
    n = x_host.shape[0]
    grid = max(1, math.ceil(n / BLOCK))
    phase = progress.phase
    phase[index] = "waiting"
    finished = False
    arrays: list[DeviceArray] = []
    try:
        async with limiter:
            phase[index] = "uploading"
            x = await gpu.to_device(x_host)
            arrays.append(x)
            y = await gpu.to_device(y_host)
            arrays.append(y)
            out = gpu.empty(n, np.float32)
            arrays.append(out)

            # saxpy writes y; scale_shift reads it into out, on the same stream.
            op = kernels.saxpy.launch(a, x, y, n, spin_ns, grid=grid, block=BLOCK).then(
                lambda y_dev: kernels.scale_shift.launch(
                    y_dev, out, scale, shift, n, spin_ns, grid=grid, block=BLOCK
                )
            )
            phase[index] = "computing"
            await gpu.run(op)

            phase[index] = "downloading"
            results[index] = await gpu.to_host(out)
            finished = True
    except Exception as exc:
        # A trio_cuda or driver error: record it and let the batch go on.
        report.failed.append((index, f"{type(exc).__name__}: {exc}"))
        finished = True
    finally:
        # Closing a handle never frees memory the GPU may still use: the scope
        # frees it once the last submission that touched it has retired.
        for arr in arrays:
            arr.close()
        if not finished:  # cancelled by the deadline
            where = phase.get(index, "waiting")
            report.cancelled[where] = report.cancelled.get(where, 0) + 1
        phase.pop(index, None)
        if index in results:
            progress.completed()


async def _warm_up(gpu: ResourceScope, kernels: Kernels) -> None:
    """Compile and load both kernels (NVRTC on a real GPU) in a worker thread,
    before the batch's deadline starts."""
    await gpu.load(kernels.saxpy, kernels.scale_shift)


def _expected(
    x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], a: np.float32, scale: np.float32, shift: np.float32
) -> np.ndarray[Any, Any]:
    """The reference result, computed on the CPU by the kernels' references."""
    n = np.int32(x.shape[0])
    y_ref = y.copy()
    saxpy_reference(a, x, y_ref, n, np.uint64(0))
    out = np.empty_like(y_ref)
    scale_shift_reference(y_ref, out, scale, shift, n, np.uint64(0))
    return out


async def run_batch(config: BatchConfig, *, out: TextIO | None = None) -> BatchReport:
    """Run the batch job; print progress and a summary to ``out`` (stdout by default)."""
    stream = sys.stdout if out is None else out

    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    report = BatchReport()
    kernels = make_kernels()
    rng = np.random.default_rng(config.seed)
    xs = rng.standard_normal((config.inputs, config.size), dtype=np.float32)
    ys = rng.standard_normal((config.inputs, config.size), dtype=np.float32)
    a, scale, shift = np.float32(2.0), np.float32(0.5), np.float32(-1.0)
    results: dict[int, np.ndarray[Any, Any]] = {}

    device, why = _resolve_device(config.device, config.kernel_ms)
    sim = device if isinstance(device, SimDevice) else None
    deadline = "none" if math.isinf(config.deadline) else f"{config.deadline:.3f} s"
    say(
        f"trio_cuda batch job: {config.inputs} inputs of {config.size} float32, "
        f"{config.concurrency} at a time on {config.streams} streams, deadline {deadline}, "
        f"{config.kernel_ms:g} ms per launch"
    )

    started = time.perf_counter()
    progress = _Progress(config.inputs, config.progress_every, say, started)
    gpu: ResourceScope | None = None
    try:
        async with open_scope(device=device, streams=config.streams) as gpu:
            report.backend = gpu.backend
            report.backend_detail = _describe_cuda(gpu) if gpu.backend == "cuda" else (why or gpu.device.name)
            say(f"backend: {report.backend} ({report.backend_detail})")
            spin_ns = int(config.kernel_ms * 1e6) if gpu.backend == "cuda" else 0
            t0 = time.perf_counter()
            await _warm_up(gpu, kernels)
            say(f"warm-up: kernels loaded in {time.perf_counter() - t0:.3f} s (before the deadline starts)")
            progress.started_at = time.perf_counter()
            limiter = trio.CapacityLimiter(config.concurrency)
            with trio.move_on_after(config.deadline) as deadline_scope:
                async with trio.open_nursery() as nursery:
                    for i in range(config.inputs):
                        nursery.start_soon(
                            _process_one,
                            gpu,
                            kernels,
                            i,
                            xs[i],
                            ys[i],
                            a,
                            scale,
                            shift,
                            spin_ns,
                            limiter,
                            progress,
                            results,
                            report,
                        )
            report.deadline_hit = deadline_scope.cancelled_caught
            if report.deadline_hit:
                stats = gpu.statistics()
                report.in_flight_at_deadline = stats.in_flight
                report.leases_at_deadline = stats.leases_held
                c = report.cancelled
                say(
                    f"deadline: {config.deadline:.3f} s passed: {len(results)} done, "
                    f"{report.cancelled_in_flight} cancelled in flight "
                    f"({c.get('uploading', 0)} uploading, {c.get('computing', 0)} computing, "
                    f"{c.get('downloading', 0)} downloading), {c.get('waiting', 0)} never started"
                )
                say(
                    f"  the scope still retains {stats.in_flight} submission(s) holding "
                    f"{stats.leases_held} lease(s); it retires them as the GPU completes them"
                )
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, an outer Cancelled: not ours to swallow
        errors = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        report.scope_errors.extend(f"{type(e).__name__}: {e}" for e in errors)
    report.elapsed = time.perf_counter() - started

    # ----------------------------------------------------------------- checks
    report.completed = len(results)
    if gpu is None:
        sim = None  # nothing ran
    for i, got in sorted(results.items()):
        want = _expected(xs[i], ys[i], a, scale, shift)
        if np.allclose(got, want, rtol=RTOL, atol=ATOL):
            report.verified += 1
        else:
            report.mismatched.append(i)
    say(f"verify: {report.verified}/{report.completed} completed results match the NumPy reference")

    problems = report.problems
    if report.mismatched:
        problems.append(f"results differ from the reference for inputs {report.mismatched}")
    for i, why_failed in report.failed:
        problems.append(f"input {i} failed: {why_failed}")
    for err in report.scope_errors:
        problems.append(f"the scope raised {err}" if gpu is not None else f"could not open a scope: {err}")
    if gpu is not None:
        stats = gpu.statistics()
        report.final_stats = stats
        say(
            f"after scope exit: in_flight={stats.in_flight} leases_held={stats.leases_held} "
            f"quarantined={stats.quarantined} live_allocations={stats.live_allocations} "
            f"submitted={stats.submitted} completed={stats.completed} failed={stats.failed}"
        )
        for name in ("in_flight", "leases_held", "quarantined", "live_allocations", "pending_errors"):
            if getattr(stats, name):
                problems.append(
                    f"after scope exit, statistics().{name} is {getattr(stats, name)}, expected 0"
                )
    if sim is not None:
        report.sim_violations = sim.violations
        report.sim_live_allocations = sim.live_allocations
        say(f"sim: violations={report.sim_violations} live_allocations={report.sim_live_allocations}")
        if report.sim_violations:
            problems.append(f"memcheck violations: {report.sim_violations}")
        if report.sim_live_allocations:
            problems.append(f"allocations never freed: {report.sim_live_allocations}")

    if report.ok:
        say(
            f"OK: {report.verified} verified, {report.cancelled_total} cancelled "
            f"({report.cancelled_in_flight} in flight), nothing leaked, {report.elapsed:.2f} s"
        )
    else:
        for p in problems:
            say(f"FAILED: {p}")
    return report


# --------------------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text}")
    return value


def _deadline(text: str) -> float:
    if text.lower() in ("none", "inf"):
        return math.inf
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 or 'none', got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the batch job's options to ``parser`` (or a new one)."""
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="batch_job",
            description="Run a cancellation-safe GPU batch job and check that nothing leaked.",
        )
    d = BatchConfig()
    parser.add_argument(
        "--inputs", type=_positive_int, default=d.inputs, help=f"input vectors (default {d.inputs})"
    )
    parser.add_argument(
        "--size", type=_positive_int, default=d.size, help=f"elements per vector (default {d.size})"
    )
    parser.add_argument(
        "--concurrency",
        type=_positive_int,
        default=d.concurrency,
        help=f"inputs in flight at once (default {d.concurrency})",
    )
    parser.add_argument(
        "--deadline",
        type=_deadline,
        default=d.deadline,
        help=f"seconds before the rest of the batch is cancelled, or 'none' (default {d.deadline})",
    )
    parser.add_argument(
        "--kernel-ms",
        type=_non_negative,
        default=d.kernel_ms,
        help=f"time each kernel launch takes, simulated or spun on the GPU (default {d.kernel_ms})",
    )
    parser.add_argument("--device", default=d.device, help="'auto' (default), 'sim', 'cuda' or 'cuda:N'")
    parser.add_argument(
        "--streams", type=_positive_int, default=d.streams, help=f"streams (default {d.streams})"
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="random seed of the inputs")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what trio_cuda does (INFO)")
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="record the run's lifetime trace and write it to FILE (.html: a timeline page; "
        ".json: Chrome trace-event JSON for ui.perfetto.dev)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> BatchConfig:
    return BatchConfig(
        inputs=args.inputs,
        size=args.size,
        concurrency=args.concurrency,
        deadline=args.deadline,
        kernel_ms=args.kernel_ms,
        device=args.device,
        streams=args.streams,
        seed=args.seed,
        progress_every=0 if args.quiet else BatchConfig().progress_every,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run the job for parsed arguments; the exit status (0: every check passed)."""
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    path = getattr(args, "trace", None)
    if path is not None and not str(path).endswith((".json", ".html", ".htm")):
        print(f"--trace: expected a file name ending in .html or .json, got {path!r}", file=sys.stderr)
        return 2
    recording = trace.enable() if path is not None else None
    try:
        report = trio.run(run_batch, config_from_args(args))
    finally:
        if recording is not None and path is not None:
            trace.disable()
            recording.write(path)
            print(f"trace: {len(recording.events)} events ({recording.dropped} dropped) written to {path}")
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``batch_job [options]``: run the job, return the exit status."""
    return run_from_args(build_parser().parse_args(argv))
