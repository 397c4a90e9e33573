"""A shard of the Ray batch job (``demo --ray``): what its worker runs, and
how the driver checks and summarizes what the shards sent back.

Invariants:

* Nothing here imports Ray: the worker side runs under
  :func:`trio_cuda.ray.run_job` (in a Ray worker, or in-process), and the
  checks read :class:`trio_cuda.ray.WorkerReport` values.
* A shard runs ``batch``'s engine unchanged on its inputs, in the
  job's one scope. A completed result is emitted under its input index (it
  comes back even when the shard is cancelled); the shard's counters are
  emitted under :data:`SUMMARY`. The worker checks nothing: the driver
  regenerates each input from the seed and checks it against NumPy.
* The driver's checks count each input once: a second result for an input
  is dropped (and counted), a result outside the shard's inputs or a count
  that disagrees with what came back is a failed check, and so are a shard
  with no report and a shard whose scope left anything behind.
"""

from __future__ import annotations

import io
import os
import signal
import time
import types
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio

from .batch import (
    ATOL,
    RTOL,
    BatchConfig,
    BatchReport,
    _Item,
    _Job,
    _median_max,
    _process_one,
    _warm_up,
    expected,
    input_vectors,
    make_kernels,
)
from .output import Output

if TYPE_CHECKING:
    from ..ray import WorkerContext, WorkerReport

__all__ = [
    "SUMMARY",
    "RayReport",
    "ShardResult",
    "ShardSpec",
    "first_line",
    "shard_job",
    "split",
    "summarize",
    "verify",
    "warm_up_job",
]

#: the emitted key of a shard's own counters (a BatchReport); inputs are keyed by their index
SUMMARY = "summary"


def split(inputs: int, shards: int) -> list[range]:
    """``range(inputs)`` cut into ``shards`` contiguous parts, as even as can be."""
    base, extra = divmod(inputs, shards)
    parts, start = [], 0
    for i in range(shards):
        stop = start + base + (1 if i < extra else 0)
        parts.append(range(start, stop))
        start = stop
    return parts


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# --------------------------------------------------------------------------- the worker side


@attrs.frozen
class ShardSpec:
    """What a shard's worker is given: its inputs ``start`` to ``stop - 1``."""

    shard: int
    start: int
    stop: int
    config: BatchConfig
    #: testing aid: SIGKILL the worker after this many results on attempt 0 (0: never)
    kill_after: int = 0
    driver_pid: int = 0

    @property
    def inputs(self) -> range:
        return range(self.start, self.stop)


@attrs.define(eq=False)
class _ShardJob(_Job):
    """The batch engine's job, where a completed result is emitted (the
    driver checks it) instead of checked here."""

    ctx: Any = None
    kill_after: int = 0
    driver_pid: int = 0

    def finished(self, item: _Item, got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
        r = self.report
        r.completed += 1
        self.ctx.emit(item.index, got)
        for step, took in item.steps.items():
            r.timings.setdefault(step, []).append(took)
        if item.stream is not None:
            r.streams_used[item.stream] = r.streams_used.get(item.stream, 0) + 1
        if (
            self.kill_after
            and r.completed >= self.kill_after
            and self.ctx.attempt == 0
            and os.getpid() != self.driver_pid  # never the driver, where a job runs in-process
        ):
            os.kill(os.getpid(), signal.SIGKILL)


def _quiet() -> Output:
    return Output(io.StringIO(), io.StringIO(), progress="none")


async def warm_up_job(ctx: WorkerContext) -> str:
    """Start a worker: load the kernels (their compile is cached by the process)."""
    await _warm_up(ctx.gpu, make_kernels())
    return ctx.gpu.device.name


async def shard_job(ctx: WorkerContext, spec: ShardSpec) -> BatchReport:
    """Run the batch engine on the shard's inputs in the job's scope. Its
    counters are emitted under :data:`SUMMARY` (they come back when the
    shard is cancelled), each completed result under its input index."""
    gpu, config = ctx.gpu, spec.config
    report = BatchReport(backend=gpu.backend, backend_detail=gpu.device.name)
    ctx.emit(SUMMARY, report)
    t0 = time.perf_counter()
    ended = False
    try:
        kernels = make_kernels()
        await _warm_up(gpu, kernels)  # cached: the warm-up round loaded them in this process
        spin_ns = int(config.kernel_ms * 1e6) if gpu.backend == "cuda" else 0
        job = _ShardJob(
            config, gpu, kernels, spin_ns, report, _quiet(), trio.Semaphore(config.concurrency),
            ctx=ctx, kill_after=spec.kill_after, driver_pid=spec.driver_pid,
        )  # fmt: skip
        async with trio.open_nursery() as nursery:
            for i in spec.inputs:
                await job.places.acquire()
                report.started += 1
                nursery.start_soon(_process_one, job, i)
        ended = True
    finally:
        report.elapsed = time.perf_counter() - t0
        never = len(spec.inputs) - report.started
        if never:
            report.cancelled["waiting"] = never
        if not ended:  # cancelled (or failed): what the scope still has in flight now
            stats = gpu.statistics()
            report.in_flight_at_deadline = stats.in_flight
            report.leases_at_deadline = stats.leases_held
            report.deadline_hit = ctx.remaining <= 0
    return report


# --------------------------------------------------------------------------- the driver's report


@attrs.define
class ShardResult:
    """One shard as the driver saw it."""

    shard: int
    inputs: range
    #: its worker's report (the last attempt's), or None when none came back
    report: WorkerReport | None = None
    #: why no report came back
    lost: str = ""
    #: cancelled (Ctrl-C, the backstop) before its worker started it: no
    #: scope was opened, and its inputs never started
    never_ran: bool = False
    #: what the driver's checks found wrong with this shard
    problems: list[str] = attrs.field(factory=list)
    #: input indices whose result this shard sent back, verified or not
    results: int = 0

    @property
    def summary(self) -> BatchReport | None:
        """The shard's own counters, as its worker emitted them."""
        if self.report is None:
            return None
        s = self.report.emitted.get(SUMMARY)
        return s if isinstance(s, BatchReport) else None

    @property
    def leaks(self) -> list[str]:
        """What outlived the shard's scope, as ``name=count`` (empty: nothing)."""
        if self.report is None:
            return []
        s = self.report.statistics
        found = [
            f"{name}={getattr(s, name)}"
            for name in ("in_flight", "leases_held", "quarantined", "live_allocations", "pending_errors")
            if getattr(s, name)
        ]
        if self.report.violations:
            found.append(f"memcheck violations={self.report.violations}")
        if self.report.sim_live_allocations:
            found.append(f"allocations never freed={self.report.sim_live_allocations}")
        return found


@attrs.define
class RayReport:
    """What a run on Ray did, and which checks passed."""

    config: BatchConfig
    shards: list[ShardResult] = attrs.field(factory=list)
    #: how the driver reached the cluster, and what the cluster has
    cluster: str = ""
    use_gpus: bool = False
    #: input index -> the shard whose result was verified (each input at most once)
    verified_by: dict[int, int] = attrs.field(factory=dict)
    mismatched: list[int] = attrs.field(factory=list)
    #: results dropped because the same input had already come back
    duplicates: int = 0
    #: shards cancelled by the driver's backstop, and by force
    backstop: list[int] = attrs.field(factory=list)
    forced: list[int] = attrs.field(factory=list)
    interrupted: bool = False
    warm_up: float = 0.0
    elapsed: float = 0.0
    problems: list[str] = attrs.field(factory=list)

    @property
    def verified(self) -> int:
        return len(self.verified_by)

    @property
    def completed(self) -> int:
        return self.verified + len(self.mismatched)

    @property
    def ok(self) -> bool:
        return not self.problems


# --------------------------------------------------------------------------- checks and summary


def verify(report: RayReport, output: Output) -> None:
    """Check each completed result against NumPy, once per input; record
    what is wrong in ``report.problems`` (it starts afresh)."""
    config = report.config
    report.verified_by.clear()
    report.mismatched.clear()
    report.duplicates = 0
    report.problems.clear()
    for sr in report.shards:
        sr.problems.clear()
        sr.results = 0
        rep = sr.report
        if rep is None and sr.never_ran:
            continue
        if rep is None:
            which = f"inputs {sr.inputs.start} to {sr.inputs.stop - 1}"
            sr.problems.append(f"shard {sr.shard} ({which}) sent no report: {sr.lost}")
            continue
        if rep.error is not None:
            sr.problems.append(f"shard {sr.shard} failed: {first_line(rep.error)}")
        s = sr.summary
        for index, got in rep.emitted.items():
            if index == SUMMARY:
                continue
            sr.results += 1
            if not isinstance(index, int) or index not in sr.inputs:
                sr.problems.append(f"shard {sr.shard} sent a result for {index!r}, not one of its inputs")
                continue
            if index in report.verified_by or index in report.mismatched:
                report.duplicates += 1
                output.detail(f"input {index}: a second result (shard {sr.shard}) dropped")
                continue
            x, y = input_vectors(config.seed, index, config.size)
            want = expected(x, y)
            good = (
                isinstance(got, np.ndarray)
                and got.shape == want.shape
                and got.dtype == want.dtype
                and bool(np.allclose(got, want, rtol=RTOL, atol=ATOL))
            )
            if good:
                report.verified_by[index] = sr.shard
            else:
                report.mismatched.append(index)
        if s is not None:
            if s.completed != sr.results:
                sr.problems.append(
                    f"shard {sr.shard} counted {s.completed} completed input(s) but sent {sr.results}"
                )
            for i, why in s.failed:
                sr.problems.append(f"input {i} failed in shard {sr.shard}: {why}")
        leaks = sr.leaks
        if leaks:
            sr.problems.append(f"shard {sr.shard} leaked: {', '.join(leaks)}")
    if report.mismatched:
        report.problems.append(f"results differ from the reference for inputs {sorted(report.mismatched)}")
    for sr in report.shards:
        report.problems.extend(sr.problems)


def _stats_line(s: Any) -> str:
    return (
        f"in_flight={s.in_flight} leases_held={s.leases_held} quarantined={s.quarantined} "
        f"live_allocations={s.live_allocations} submitted={s.submitted} completed={s.completed} "
        f"failed={s.failed}"
    )


def _cancelled_text(s: BatchReport) -> str:
    c = s.cancelled
    return (
        f"{s.cancelled_total} cancelled ({s.cancelled_in_flight} in flight: {c.get('uploading', 0)} "
        f"uploading, {c.get('computing', 0)} computing, {c.get('downloading', 0)} downloading; "
        f"{c.get('waiting', 0)} never started)"
    )


def summarize(report: RayReport, output: Output) -> None:
    """The per-shard lines, the total and the verdict (``report.problems``
    must already hold the checks' findings)."""
    say = output.say
    config = report.config
    summaries = [s for sr in report.shards if (s := sr.summary) is not None]
    by_deadline = [sr for sr in report.shards if sr.report is not None and sr.report.cancelled == "deadline"]
    if by_deadline:
        total = BatchReport()
        for sr in by_deadline:
            s = sr.summary
            if s is not None:
                total.completed += s.completed
                for phase, n in s.cancelled.items():
                    total.cancelled[phase] = total.cancelled.get(phase, 0) + n
        say(
            f"deadline: {config.deadline:.3f} s passed in {len(by_deadline)} shard(s): "
            f"{total.completed} done, {_cancelled_text(total)}"
        )
    say(
        f"verify: {report.verified}/{report.completed} completed results match the NumPy reference "
        f"(each input checked once; {report.duplicates} duplicate(s) dropped)"
    )
    if output.verbose >= 1 and any(s.timings.get("computing") for s in summaries):
        t: dict[str, list[float]] = {}
        for s in summaries:
            for step, values in s.timings.items():
                t.setdefault(step, []).extend(values)
        say(
            f"timings (ms, median/max over {len(t['computing'])} inputs): "
            f"upload {_median_max(t['uploading'])}, compute {_median_max(t['computing'])}, "
            f"download {_median_max(t.get('downloading', [0.0]))}"
        )
    for sr in report.shards:
        for line in _shard_lines(sr):
            say(line)
    reports = [sr.report for sr in report.shards if sr.report is not None]
    names = (
        "in_flight",
        "leases_held",
        "quarantined",
        "live_allocations",
        "submitted",
        "completed",
        "failed",
    )
    sums = {name: sum(getattr(r.statistics, name) for r in reports) for name in names}
    processes = {(r.hostname, r.pid) for r in reports}
    hosts = {r.hostname for r in reports}
    cancelled = sum(s.cancelled_total for s in summaries)
    cancelled += sum(len(sr.inputs) for sr in report.shards if sr.never_ran)
    in_flight = sum(s.cancelled_in_flight for s in summaries)
    leaky = [sr.shard for sr in report.shards if sr.leaks]
    say(
        f"total: {len(reports)}/{len(report.shards)} shard(s) reported from {len(processes)} worker "
        f"process(es) on {len(hosts)} host(s); {report.completed} done, {cancelled} cancelled; "
        f"after scope exit: {_stats_line(types.SimpleNamespace(**sums))}; "
        + (f"shard(s) {leaky} leaked" if leaky else "nothing leaked in any shard")
    )
    if report.ok:
        say(
            f"OK: {report.verified} verified, {cancelled} cancelled ({in_flight} in flight), "
            f"nothing leaked, {len(report.shards)} shard(s), {report.elapsed:.2f} s"
        )
    else:
        for p in report.problems:
            say(f"FAILED: {p}")


def _shard_lines(sr: ShardResult) -> list[str]:
    head = f"shard {sr.shard}: inputs {sr.inputs.start} to {sr.inputs.stop - 1}"
    rep = sr.report
    if rep is None and sr.never_ran:
        return [f"{head}: cancelled before it started; its inputs never started"]
    if rep is None:
        return [f"{head}: NO REPORT ({sr.lost}); its inputs are not counted"]
    s = sr.summary
    retried = f" (retried {rep.attempt} time(s))" if rep.attempt else ""
    gpus = f", GPU {','.join(rep.gpu_ids)}" if rep.gpu_ids else ""
    where = f"{rep.hostname} pid {rep.pid}, attempt {rep.attempt}{retried}"
    lines = [f"{head} on {where}, {rep.backend} ({rep.device}{gpus})"]
    if s is not None and (rep.cancelled or s.cancelled_total):
        why = {"deadline": " by the deadline", "ray.cancel": " by ray.cancel"}.get(rep.cancelled or "", "")
        lines.append(
            f"  {s.completed} done, {_cancelled_text(s)}{why}; {s.in_flight_at_deadline} submission(s) "
            f"and {s.leases_at_deadline} lease(s) in flight when cancelled; {rep.elapsed:.3f} s"
        )
    elif s is not None:
        lines.append(f"  {s.completed} done, nothing cancelled; {rep.elapsed:.3f} s")
    if rep.error is not None:
        lines.append(f"  error: {first_line(rep.error)}")
    sim = "" if rep.violations is None else (
        f"; sim: violations={rep.violations} never freed={rep.sim_live_allocations}"
    )  # fmt: skip
    leaks = sr.leaks
    verdict = "nothing leaked" if not leaks else "LEAKED: " + ", ".join(leaks)
    lines.append(f"  after scope exit: {_stats_line(rep.statistics)}{sim}; {verdict}")
    return lines
