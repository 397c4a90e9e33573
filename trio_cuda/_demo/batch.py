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

Invariants: an input's task is started only when one of the ``concurrency``
places is free, and its vectors are made then and checked as soon as its result
arrives, so host memory stays bounded however many inputs a run has. A CUDA
device that is asked for and not there is refused before anything is printed
or run. Cancelling the batch (the deadline, or the first Ctrl-C on the command
line) never skips the checks: the scope still retires what is in flight. What
the job prints, and where, is ``output``'s business.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import attrs
import numpy as np
import trio

from .._core._array import DeviceArray
from .._core._errors import DeviceUnavailableError
from .._core._kernel import Kernel
from .._core._params import In, InOut, Out, Scalar
from .._core._scope import ResourceScope
from .._core._statistics import ScopeStatistics
from .._open import open_scope
from ..testing import SimAllocation, SimDevice, Violation
from .output import Output

__all__ = [
    "BatchConfig",
    "BatchReport",
    "DeviceUnavailableError",
    "check_device",
    "make_kernels",
    "run_batch",
]

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


A = np.float32(2.0)
SCALE = np.float32(0.5)
SHIFT = np.float32(-1.0)


def input_vectors(seed: int, index: int, size: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Input ``index``'s x and y: made when the input starts (the job's host
    memory stays bounded by ``concurrency``), the same in every run of a seed."""
    rng = np.random.default_rng((seed, index))
    return rng.standard_normal(size, dtype=np.float32), rng.standard_normal(size, dtype=np.float32)


def expected(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The reference result, computed on the CPU by the kernels' references."""
    n = np.int32(x.shape[0])
    y_ref = y.copy()
    saxpy_reference(A, x, y_ref, n, np.uint64(0))
    out = np.empty_like(y_ref)
    scale_shift_reference(y_ref, out, SCALE, SHIFT, n, np.uint64(0))
    return out


# --------------------------------------------------------------------------- settings and report

MAX_SIZE = 2**31 - 1  #: the kernels' ``n`` is an int32
MAX_STREAMS = 1024
MAX_KERNEL_MS = 60_000.0
PROGRESS_MODES = ("bar", "lines", "none")
_DEVICE = re.compile(r"auto|sim|cuda(?::(\d+))?")


@attrs.frozen
class _Check:
    """One setting's rule: an attrs validator of :class:`BatchConfig`, and the
    argparse ``type`` of its option, with the same message."""

    expected: str
    ok: Callable[[Any], bool]
    convert: Callable[[str], Any] = str

    def __call__(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not self.ok(value):
            raise ValueError(f"{attribute.name}: expected {self.expected}, got {value!r}")

    def parse(self, text: str) -> Any:
        try:
            value = self.convert(text)
        except ValueError:
            value = None
        if value is None or not self.ok(value):
            raise argparse.ArgumentTypeError(f"expected {self.expected}, got {text!r}")
        return value


def _integer(low: int, high: int | None = None) -> _Check:
    def ok(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)

    return _Check(f"an int >= {low}" if high is None else f"an int from {low} to {high}", ok, int)


def _real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _seconds(text: str) -> float:
    return math.inf if text.strip().lower() in ("none", "inf", "infinity") else float(text)


_DEADLINE = _Check("seconds >= 0, or 'none' (math.inf)", lambda v: _real(v) and v >= 0, _seconds)
_KERNEL_MS = _Check(
    f"milliseconds from 0 to {MAX_KERNEL_MS:g}", lambda v: _real(v) and 0 <= v <= MAX_KERNEL_MS, float
)
_DEVICE_NAME = _Check(
    "'auto', 'sim', 'cuda' or 'cuda:N'", lambda v: isinstance(v, str) and _DEVICE.fullmatch(v) is not None
)
_PROGRESS = _Check("'bar', 'lines' or 'none'", lambda v: v in PROGRESS_MODES)


@attrs.frozen
class BatchConfig:
    """Settings of one batch run (see ``python -m trio_cuda demo --help``)."""

    inputs: int = attrs.field(default=64, validator=_integer(1))
    size: int = attrs.field(default=4096, validator=_integer(1, MAX_SIZE))
    concurrency: int = attrs.field(default=8, validator=_integer(1))
    deadline: float = attrs.field(default=0.1, validator=_DEADLINE)  #: seconds; math.inf for none
    #: time each launch takes (simulated, or spun on the GPU)
    kernel_ms: float = attrs.field(default=5.0, validator=_KERNEL_MS)
    device: str = attrs.field(default="auto", validator=_DEVICE_NAME)
    streams: int = attrs.field(default=4, validator=_integer(1, MAX_STREAMS))
    seed: int = attrs.field(default=0, validator=_integer(0))
    #: "lines": a plain line every ``progress_every`` completions (and at
    #: least every few seconds); "bar": a bar on the error stream (tqdm's, else a built-in one); "none"
    progress: str = attrs.field(default="lines", validator=_PROGRESS)
    progress_every: int = attrs.field(default=0, validator=_integer(0))  #: 0: every eighth of the inputs
    #: 1: a line per input, the trio_cuda logger at INFO; 2: a line per step, DEBUG
    verbose: int = attrs.field(default=0, validator=_integer(0))


@attrs.define
class BatchReport:
    """What a batch run did and which checks passed."""

    backend: str = ""
    backend_detail: str = ""
    started: int = 0  #: inputs that got a place before the deadline
    completed: int = 0
    verified: int = 0
    mismatched: list[int] = attrs.field(factory=list)
    failed: list[tuple[int, str]] = attrs.field(factory=list)
    #: inputs cancelled by the deadline, by the step they were in ("waiting": never started)
    cancelled: dict[str, int] = attrs.field(factory=dict)
    deadline_hit: bool = False
    interrupted: bool = False  #: ``stop`` was set (Ctrl-C on the command line)
    in_flight_at_deadline: int = 0
    leases_at_deadline: int = 0
    elapsed: float = 0.0
    #: seconds each completed input spent uploading, computing and downloading
    timings: dict[str, list[float]] = attrs.field(factory=dict)
    #: stream index -> completed inputs whose kernels ran on it
    streams_used: dict[int, int] = attrs.field(factory=dict)
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
        """Inputs cancelled after they started (some of their GPU work may be in flight)."""
        return sum(n for phase, n in self.cancelled.items() if phase != "waiting")

    @property
    def ok(self) -> bool:
        return not self.problems


# --------------------------------------------------------------------------- backend choice


def check_device(device: str) -> str:
    """Why ``device`` was chosen, or :class:`DeviceUnavailableError` saying
    why it cannot be used. Asks the CUDA driver (never raises anything else)."""
    from .._backends import _cuda_backend_available, probe_cuda

    m = _DEVICE.fullmatch(device)
    if m is None:
        raise ValueError(f"device: expected 'auto', 'sim', 'cuda' or 'cuda:N', got {device!r}")
    if device == "sim":
        return "asked for with --device sim"
    probe = probe_cuda()
    usable = probe.available and _cuda_backend_available()
    if device == "auto":
        if usable:
            return "a CUDA driver and device answer"
        return probe.reason if not probe.available else "the cuda backend is not installed"
    instead = "--device auto uses the simulator when no GPU answers, --device sim always"
    if not probe.available:
        raise DeviceUnavailableError(f"no CUDA device answered ({probe.reason}); {instead}")
    if not usable:
        raise DeviceUnavailableError(
            f"a CUDA device answers, but the cuda backend is not installed; {instead}"
        )
    ordinal = int(m.group(1) or 0)
    if ordinal >= probe.device_count:
        n = probe.device_count
        raise DeviceUnavailableError(
            f"the CUDA driver reports {n} device(s), " + ("cuda:0" if n == 1 else f"cuda:0 to cuda:{n - 1}")
        )
    return f"asked for with --device {device}"


def _resolve_device(device: str, kernel_ms: float) -> tuple[str | SimDevice, str]:
    """What to pass to ``open_scope(device=...)``, and why it was chosen.

    On the simulator, launches take ``kernel_ms`` of simulated time, so that the
    deadline cancels work that is really in flight.
    """
    why = check_device(device)
    if device == "sim" or (device == "auto" and why != "a CUDA driver and device answer"):
        return SimDevice(kernel_time=kernel_ms / 1e3), why
    return ("cuda" if device == "auto" else device), why


def _describe(gpu: ResourceScope, config: BatchConfig, spin_ns: int) -> list[str]:
    """The ``-v`` lines about the device, the scope and the launches."""
    info = gpu.device
    major, minor = info.compute_capability
    line = (
        f"device: {info.name} ({info.backend}, ordinal {info.ordinal}), "
        f"{info.total_memory / 2**30:.1f} GiB, compute capability {major}.{minor}, "
        f"{info.multiprocessor_count} SMs, up to {info.max_threads_per_block} threads per block"
    )
    if info.backend == "cuda":
        from .._backends import probe_cuda

        version = probe_cuda().driver_version
        if version > 0:
            line += f", driver {version // 1000}.{version % 1000 // 10}"
        timing = f"each launch spins {spin_ns / 1e6:g} ms on the GPU's clock"
    else:
        timing = f"each launch takes {config.kernel_ms:g} ms of simulated time"
    blocks = max(1, math.ceil(config.size / BLOCK))
    return [
        line,
        f"scope: {len(gpu.streams)} streams, up to {config.concurrency} inputs at a time, "
        f"launches of {blocks} block(s) of {BLOCK} threads; {timing}",
    ]


# --------------------------------------------------------------------------- the job


@attrs.define
class _Item:
    """One input on its way: the step it is in and how long each step took."""

    index: int
    phase: str = "uploading"
    stream: int | None = None
    started: float = attrs.field(factory=time.perf_counter)
    mark: float = 0.0
    steps: dict[str, float] = attrs.field(factory=dict)

    def step(self, phase: str) -> float:
        """Go on to ``phase``; the seconds the step before took."""
        now = time.perf_counter()
        took = self.steps[self.phase] = now - (self.mark or self.started)
        self.mark, self.phase = now, phase
        return took


@attrs.define(eq=False)
class _Job:
    """What the inputs' tasks share."""

    config: BatchConfig
    gpu: ResourceScope
    kernels: Kernels
    spin_ns: int
    report: BatchReport
    output: Output
    places: trio.Semaphore
    active: dict[int, _Item] = attrs.field(factory=dict)

    def scope_line(self) -> str:
        s = self.gpu.statistics()
        return (
            f"scope: {s.in_flight} submission(s) in flight, {s.leases_held} lease(s), "
            f"{s.retained_bytes / 2**20:.2f} MiB retained"
        )

    def finished(self, item: _Item, got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
        r = self.report
        r.completed += 1
        match = bool(np.allclose(got, want, rtol=RTOL, atol=ATOL))
        if match:
            r.verified += 1
        else:
            r.mismatched.append(item.index)
        for step, took in item.steps.items():
            r.timings.setdefault(step, []).append(took)
        if item.stream is not None:
            r.streams_used[item.stream] = r.streams_used.get(item.stream, 0) + 1
        out = self.output
        if out.verbose >= 1:
            ms = {step: took * 1e3 for step, took in item.steps.items()}
            out.detail(
                f"input {item.index:3d}: stream {item.stream}, upload {ms['uploading']:.2f} ms, "
                f"compute {ms['computing']:.2f} ms, download {ms['downloading']:.2f} ms, "
                f"{'matches' if match else 'DIFFERS from'} the reference; {self.scope_line()}"
            )
        out.completed(r.completed, len(self.active))

    def failed(self, item: _Item, exc: Exception) -> None:
        self.report.failed.append((item.index, f"{type(exc).__name__}: {exc}"))
        self.output.detail(f"input {item.index:3d}: failed while {item.phase}: {type(exc).__name__}: {exc}")

    def cancelled(self, item: _Item) -> None:
        c = self.report.cancelled
        c[item.phase] = c.get(item.phase, 0) + 1
        where = "" if item.stream is None else f" on stream {item.stream}"
        self.output.detail(
            f"input {item.index:3d}: cancelled while {item.phase}{where}, "
            f"{(time.perf_counter() - item.started) * 1e3:.2f} ms after it started; "
            f"the scope keeps its work in flight until the device finished it"
        )


async def _process_one(job: _Job, index: int) -> None:
    """Input ``index``: upload x and y, saxpy then scale_shift, download, verify."""
    gpu, kernels, out = job.gpu, job.kernels, job.output
    item = job.active[index] = _Item(index)
    arrays: list[DeviceArray] = []
    try:
        out.debug(f"input {index:3d}: started, {len(job.active)} of {job.config.concurrency} places taken")
        x_host, y_host = input_vectors(job.config.seed, index, job.config.size)
        n = x_host.shape[0]
        grid = max(1, math.ceil(n / BLOCK))
        x = await gpu.to_device(x_host)
        arrays.append(x)
        y = await gpu.to_device(y_host)
        arrays.append(y)
        res = gpu.empty(n, np.float32)
        arrays.append(res)
        out.debug(f"input {index:3d}: x and y uploaded in {item.step('computing') * 1e3:.2f} ms")

        # saxpy writes y; scale_shift reads it into res, on the same stream.
        op = kernels.saxpy.launch(A, x, y, n, job.spin_ns, grid=grid, block=BLOCK).then(
            lambda y_dev: kernels.scale_shift.launch(
                y_dev, res, SCALE, SHIFT, n, job.spin_ns, grid=grid, block=BLOCK
            )
        )
        fut = gpu.submit(op)
        item.stream = fut.stream.index
        out.debug(
            f"input {index:3d}: saxpy, scale_shift submitted on stream {item.stream}; {job.scope_line()}"
        )
        await fut.wait()
        out.debug(f"input {index:3d}: kernels done in {item.step('downloading') * 1e3:.2f} ms")

        got = await gpu.to_host(res)
        item.step("done")
        del job.active[index]
        job.finished(item, got, expected(x_host, y_host))
    except Exception as exc:
        # A trio_cuda or driver error (or no host memory): record it, go on.
        job.failed(item, exc)
        item.phase = "failed"
    finally:
        # Closing a handle never frees memory the GPU may still use: the scope
        # frees it once the last submission that touched it has retired.
        for arr in arrays:
            arr.close()
        job.active.pop(index, None)
        job.places.release()
        if item.phase not in ("done", "failed"):  # cancelled by the deadline
            job.cancelled(item)


async def _warm_up(gpu: ResourceScope, kernels: Kernels) -> None:
    """Compile and load both kernels (NVRTC on a real GPU) in a worker thread,
    before the batch's deadline starts."""
    await gpu.load(kernels.saxpy, kernels.scale_shift)


async def run_batch(
    config: BatchConfig,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    stop: trio.Event | None = None,
) -> BatchReport:
    """Run the batch job; print what it does and a summary to ``out`` (stdout
    by default), the progress bar and log records to ``err`` (stderr).
    Setting ``stop`` cancels the rest of the batch as the deadline does (the
    command line sets it on Ctrl-C).

    Raises :class:`DeviceUnavailableError`, before printing anything, if
    ``config.device`` names a CUDA device that is not there."""
    stream = sys.stdout if out is None else out
    err_stream = (sys.stderr or stream) if err is None else err
    output = Output(
        stream,
        err_stream,
        verbose=config.verbose,
        progress=config.progress,
        progress_every=config.progress_every,
    )
    with output:
        return await _run(config, output, stop)


async def _stop_on(stop: trio.Event, batch: trio.CancelScope, report: BatchReport, output: Output) -> None:
    await stop.wait()
    report.interrupted = True
    output.say("Ctrl-C: cancelling the rest of the batch; the scope retires the work in flight")
    batch.cancel()


async def _run(config: BatchConfig, output: Output, stop: trio.Event | None) -> BatchReport:
    say = output.say
    report = BatchReport()
    device, why = _resolve_device(config.device, config.kernel_ms)
    sim = device if isinstance(device, SimDevice) else None
    kernels = make_kernels()
    deadline = "none" if math.isinf(config.deadline) else f"{config.deadline:.3f} s"
    say(
        f"trio_cuda batch job: {config.inputs} inputs of {config.size} float32, "
        f"{config.concurrency} at a time on {config.streams} streams, deadline {deadline}, "
        f"{config.kernel_ms:g} ms per launch"
    )

    started = time.perf_counter()
    gpu: ResourceScope | None = None
    try:
        async with open_scope(device=device, streams=config.streams) as gpu:
            report.backend = gpu.backend
            if gpu.backend == "cuda":
                info = gpu.device
                report.backend_detail = f"{info.name}, device {info.ordinal}"
            else:
                report.backend_detail = why or gpu.device.name
            say(f"backend: {report.backend} ({report.backend_detail})")
            spin_ns = int(config.kernel_ms * 1e6) if gpu.backend == "cuda" else 0
            for line in _describe(gpu, config, spin_ns):
                output.detail(line)
            t0 = time.perf_counter()
            await _warm_up(gpu, kernels)
            say(f"warm-up: kernels loaded in {time.perf_counter() - t0:.3f} s (before the deadline starts)")
            job = _Job(config, gpu, kernels, spin_ns, report, output, trio.Semaphore(config.concurrency))
            output.start_progress(config.inputs)
            try:
                with trio.move_on_after(config.deadline) as batch:
                    async with trio.open_nursery() as watcher:
                        if stop is not None:
                            watcher.start_soon(_stop_on, stop, batch, report, output)
                        async with trio.open_nursery() as nursery:
                            for i in range(config.inputs):
                                await job.places.acquire()  # at most `concurrency` inputs at a time
                                report.started += 1
                                nursery.start_soon(_process_one, job, i)
                        watcher.cancel_scope.cancel()
            finally:
                output.stop_progress()
            never = config.inputs - report.started
            if never:
                report.cancelled["waiting"] = never
            report.deadline_hit = batch.cancelled_caught and not report.interrupted
            if batch.cancelled_caught:
                _report_deadline(output, gpu, config, report)
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, an outer Cancelled: not ours to swallow
        if gpu is None and isinstance(exc, DeviceUnavailableError):
            raise  # the device went away since it was checked: the command line says so
        errors = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        report.scope_errors.extend(f"{type(e).__name__}: {e}" for e in errors)
    report.elapsed = time.perf_counter() - started
    if gpu is None:
        # The scope never opened: nothing ran, and there is nothing to check.
        for e in report.scope_errors:
            report.problems.append(f"could not open a scope on {config.device}: {e}")
            say(f"FAILED: {report.problems[-1]}")
        return report
    _check(output, gpu, sim, report)
    return report


def _report_deadline(output: Output, gpu: ResourceScope, config: BatchConfig, report: BatchReport) -> None:
    stats = gpu.statistics()
    report.in_flight_at_deadline = stats.in_flight
    report.leases_at_deadline = stats.leases_held
    c = report.cancelled
    never = c.get("waiting", 0)
    if never == 1:
        output.detail(f"input {report.started}: never started")
    elif never:
        output.detail(f"inputs {report.started} to {config.inputs - 1}: never started")
    why = "interrupted" if report.interrupted else f"deadline: {config.deadline:.3f} s passed"
    output.say(
        f"{why}: {report.completed} done, "
        f"{report.cancelled_in_flight} cancelled in flight "
        f"({c.get('uploading', 0)} uploading, {c.get('computing', 0)} computing, "
        f"{c.get('downloading', 0)} downloading), {never} never started"
    )
    output.say(
        f"  the scope still retains {stats.in_flight} submission(s) holding "
        f"{stats.leases_held} lease(s); it retires them as the GPU completes them"
    )


def _median_max(values: list[float]) -> str:
    ms = sorted(v * 1e3 for v in values)
    return f"{ms[len(ms) // 2]:.2f}/{ms[-1]:.2f}"


def _check(output: Output, gpu: ResourceScope, sim: SimDevice | None, report: BatchReport) -> None:
    """After scope exit: the results, the scope's counters and memcheck."""
    say = output.say
    say(f"verify: {report.verified}/{report.completed} completed results match the NumPy reference")
    problems = report.problems
    if report.mismatched:
        problems.append(f"results differ from the reference for inputs {sorted(report.mismatched)}")
    by_error: dict[str, list[int]] = {}
    for i, why_failed in report.failed:
        by_error.setdefault(why_failed, []).append(i)
    for why_failed, indices in by_error.items():
        which = f"input {indices[0]}" if len(indices) == 1 else f"{len(indices)} inputs {sorted(indices)}"
        problems.append(f"{which} failed: {why_failed}")
    problems.extend(f"the scope raised {err}" for err in report.scope_errors)

    if output.verbose >= 1:
        if report.timings.get("computing"):
            t = report.timings
            say(
                f"timings (ms, median/max over {len(t['computing'])} inputs): "
                f"upload {_median_max(t['uploading'])}, compute {_median_max(t['computing'])}, "
                f"download {_median_max(t.get('downloading', [0.0]))}"
            )
        say(
            "streams: "
            + "; ".join(
                f"{s.index}: {report.streams_used.get(s.index, 0)} input(s), "
                f"{s.statistics().submitted} submission(s)"
                for s in gpu.streams
            )
        )
    stats = gpu.statistics()
    report.final_stats = stats
    say(
        f"after scope exit: in_flight={stats.in_flight} leases_held={stats.leases_held} "
        f"quarantined={stats.quarantined} live_allocations={stats.live_allocations} "
        f"submitted={stats.submitted} completed={stats.completed} failed={stats.failed}"
    )
    output.debug(f"  {stats}")
    for name in ("in_flight", "leases_held", "quarantined", "live_allocations", "pending_errors"):
        if getattr(stats, name):
            problems.append(f"after scope exit, statistics().{name} is {getattr(stats, name)}, expected 0")
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
