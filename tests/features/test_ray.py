"""trio_cuda.ray: Trio jobs with a scope inside Ray tasks, against a real local Ray.

One local Ray instance (2 CPUs, no dashboard) serves the module. Jobs run on
the simulator (the tasks ask for no GPU), so that every case runs in CI:
results and statistics coming back, errors crossing the process boundary, the
deadline and ``ray.cancel`` cancelling work that is really in flight (the
simulated kernels take time) while the scope still drains and frees
everything, and a worker killed mid-job being retried by Ray. A ``gpu`` test
runs a job on the GPU Ray assigns, where there is one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'trio_cuda[ray]' (Python < 3.14)")

import trio_cuda  # noqa: E402
import trio_cuda.ray as tray  # noqa: E402
from tests.helpers import internals  # noqa: E402
from trio_cuda import KernelArgumentError, ops  # noqa: E402
from trio_cuda._backends import probe_cuda  # noqa: E402

TIMEOUT = 60  # seconds for any one ray.get


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # the workers cannot import this test module: send its jobs by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        namespace="trio_cuda_tests",
    )
    try:
        yield
    finally:
        ray.shutdown()


async def fill_and_read(ctx: tray.WorkerContext, n: int, steps: int, started: str = "") -> str:
    """Fill, read back and emit step by step; record what was in flight at the end
    (``started``: a file made once the first step is done)."""
    gpu = ctx.gpu
    x = await gpu.to_device(np.zeros(n, np.float32))
    try:
        for i in range(steps):
            gpu.submit(ops.fill(x, float(i)))  # in flight while the next one is queued
            ctx.emit(i, float((await gpu.to_host(x))[0]))
            if i == 0 and started:
                await trio.Path(started).touch()
    finally:
        ctx.emit("in_flight_at_end", gpu.statistics().in_flight)
    return f"{steps} steps on {gpu.device.backend}"


async def failing(ctx: tray.WorkerContext) -> None:
    x = ctx.gpu.empty(4, np.float32)
    await ctx.gpu.run(ops.fill(x, 1.0))
    ctx.emit("before", True)
    raise KernelArgumentError("x: expected 8 elements, got 4")


class Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("carries a lock")
        import threading

        self.lock = threading.Lock()

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle a lock")


async def failing_unpicklably(ctx: tray.WorkerContext) -> None:
    raise Unpicklable


async def dies_on_first_attempt(ctx: tray.WorkerContext, n: int) -> int:
    gpu = ctx.gpu
    x = await gpu.to_device(np.arange(n, dtype=np.float32))
    gpu.submit(ops.fill(x, 2.0))
    if ctx.attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies with work in flight
    return int((await gpu.to_host(x)).sum())


def _checked(report: tray.WorkerReport) -> tray.WorkerReport:
    assert isinstance(report, tray.WorkerReport)
    assert not report.leaked, report
    assert report.statistics.in_flight == 0
    assert report.statistics.leases_held == 0
    assert report.statistics.live_allocations == 0
    assert report.violations == 0
    assert report.sim_live_allocations == 0
    return report


def test_importing_trio_cuda_does_not_import_ray() -> None:
    code = "import sys, trio_cuda, trio_cuda.testing; assert 'ray' not in sys.modules, 'ray imported'"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr


def test_run_job_in_process() -> None:
    report = _checked(tray.run_job(fill_and_read, 64, 5, device="sim"))
    assert report.result() == "5 steps on sim"
    assert [report.emitted[i] for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert report.cancelled is None
    assert report.backend == "sim"
    assert report.attempt == 0
    assert report.gpu_ids == ()
    assert report.statistics.submitted >= 10


def test_bad_options_are_refused_before_anything_runs() -> None:
    with pytest.raises(TypeError, match="deadline"):
        tray.run_job(fill_and_read, 4, 1, deadline="soon")
    with pytest.raises(TypeError, match="deadline"):
        tray.run_job(fill_and_read, 4, 1, deadline=float("nan"))
    with pytest.raises(TypeError, match="fn"):
        tray.run_job(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device"):
        tray.run_job(fill_and_read, 4, 1, scope_options={"device": "sim"})
    with pytest.raises(TypeError, match="deadline"):
        tray.remote(fill_and_read, deadline=True)


def test_a_remote_job_returns_its_value_and_the_scope_statistics(cluster: None) -> None:
    job = tray.remote(fill_and_read, max_retries=0)
    assert "fill_and_read" in repr(job)
    refs = [job.remote(32, 4), job.remote(32, 6)]
    reports = [_checked(r) for r in ray.get(refs, timeout=TIMEOUT)]
    assert [r.result() for r in reports] == ["4 steps on sim", "6 steps on sim"]
    assert all(r.pid != os.getpid() for r in reports)  # they ran in workers
    assert all(r.node_id for r in reports)
    assert reports[1].emitted[5] == 5.0


def test_errors_come_back_with_the_statistics(cluster: None) -> None:
    report = ray.get(tray.remote(failing, max_retries=0).remote(), timeout=TIMEOUT)
    _checked(report)
    assert isinstance(report.error, KernelArgumentError)
    assert report.emitted == {"before": True}
    with pytest.raises(KernelArgumentError, match="expected 8 elements"):
        report.result()
    report = ray.get(tray.remote(failing_unpicklably, max_retries=0).remote(), timeout=TIMEOUT)
    assert isinstance(report.error, RuntimeError)
    assert "Unpicklable" in str(report.error)


class NeedsTwo(Exception):
    """Pickles (its args are one message) but cannot be rebuilt: its __init__ wants two."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed: {why}")


def _countdown(n: int) -> Iterator[int]:
    yield from range(n, 0, -1)


async def returns_what_does_not_travel(ctx: tray.WorkerContext, kind: str) -> Any:
    x = await ctx.gpu.to_device(np.arange(4, dtype=np.float32))
    ctx.emit("sum", float((await ctx.gpu.to_host(x)).sum()))
    values = {
        "generator": lambda: _countdown(3),
        "DeviceArray": lambda: x,
        "lock": threading.Lock,
        "NeedsTwo": lambda: NeedsTwo("the upload", "the link went down"),
    }
    return values[kind]()


async def raises_what_cannot_be_rebuilt(ctx: tray.WorkerContext) -> None:
    x = ctx.gpu.empty(4, np.float32)
    await ctx.gpu.run(ops.fill(x, 1.0))
    ctx.emit("before", True)
    raise NeedsTwo("the upload", "the link went down")


async def raises_a_group_with_one_that_cannot_be_rebuilt(ctx: tray.WorkerContext) -> None:
    ctx.emit("before", True)
    raise ExceptionGroup(
        "two failures", [KernelArgumentError("x: expected 8 elements, got 4"), NeedsTwo("a", "b")]
    )


async def emits_what_does_not_travel(ctx: tray.WorkerContext) -> str:
    ctx.emit("fine", 1.5)
    ctx.emit("array", np.arange(3))
    ctx.emit("lock", threading.Lock())
    ctx.emit("NeedsTwo", NeedsTwo("a", "b"))
    ctx.emit(threading.Lock(), "under a key that does not pickle")
    return "done"


def test_a_value_that_does_not_travel_is_replaced_by_an_error_naming_it(cluster: None) -> None:
    job = tray.remote(returns_what_does_not_travel, max_retries=0)
    kinds = {"generator": "did not pickle", "DeviceArray": "did not pickle", "lock": "did not pickle"}
    kinds["NeedsTwo"] = "could not be rebuilt"
    refs = {kind: job.remote(kind) for kind in kinds}
    for kind, ref in refs.items():
        report = _checked(ray.get(ref, timeout=TIMEOUT))  # the report came back, whole
        assert report.emitted == {"sum": 6.0}, kind
        assert report.value is None
        assert isinstance(report.error, RuntimeError), (kind, report.error)
        message = str(report.error)
        assert message.startswith("value: "), message
        assert kind in message, message
        assert kinds[kind] in message, message
        with pytest.raises(RuntimeError, match=kinds[kind]):
            report.result()


def test_an_error_that_cannot_be_rebuilt_is_replaced_by_one_naming_it(cluster: None) -> None:
    job = tray.remote(raises_what_cannot_be_rebuilt, max_retries=0)
    report = _checked(ray.get(job.remote(), timeout=TIMEOUT))
    assert report.emitted == {"before": True}
    assert report.statistics.submitted >= 1
    assert isinstance(report.error, RuntimeError)
    message = str(report.error)
    assert "NeedsTwo: the upload failed: the link went down" in message, message
    assert "could not be rebuilt" in message, message
    assert "why" in message, message  # the reason: __init__ lacks its second argument
    assert any("raises_what_cannot_be_rebuilt" in note for note in report.error.__notes__)  # the traceback

    # in a group, only the member that cannot be rebuilt is replaced
    job = tray.remote(raises_a_group_with_one_that_cannot_be_rebuilt, max_retries=0)
    report = _checked(ray.get(job.remote(), timeout=TIMEOUT))
    assert report.emitted == {"before": True}
    assert isinstance(report.error, ExceptionGroup), report.error
    first, second = report.error.exceptions
    assert isinstance(first, KernelArgumentError)
    assert isinstance(second, RuntimeError)
    assert "NeedsTwo: a failed: b" in str(second)


def test_emitted_results_that_do_not_travel_are_replaced_by_errors_naming_them(cluster: None) -> None:
    report = _checked(
        ray.get(tray.remote(emits_what_does_not_travel, max_retries=0).remote(), timeout=TIMEOUT)
    )
    assert report.result() == "done"
    emitted = dict(report.emitted)
    assert emitted.pop("fine") == 1.5
    np.testing.assert_array_equal(emitted.pop("array"), np.arange(3))
    lock, needs_two = emitted.pop("lock"), emitted.pop("NeedsTwo")
    assert isinstance(lock, RuntimeError)
    assert "emitted['lock']" in str(lock)
    assert "lock" in str(lock).removeprefix("emitted['lock']")
    assert "did not pickle" in str(lock)
    assert isinstance(needs_two, RuntimeError)
    assert "emitted['NeedsTwo']" in str(needs_two)
    assert "could not be rebuilt" in str(needs_two)
    # the key that does not pickle: its value kept under the key's repr
    [(key, value)] = emitted.items()
    assert isinstance(key, str)
    assert "lock" in key
    assert value == "under a key that does not pickle"


def test_a_value_that_does_not_travel_is_noted_on_the_error_there_already_is() -> None:
    from tests.helpers.kernels import add
    from trio_cuda.testing import SimDevice

    sim = SimDevice()

    async def job(ctx: tray.WorkerContext) -> Any:
        x = await ctx.gpu.to_device(np.zeros(4, np.float32))
        sim.inject_fault("kernel_fault")
        ctx.gpu.submit(add(x, 1.0))  # nobody awaits it: its error is raised by the scope's exit
        return threading.Lock()

    report = tray.run_job(job, device=sim)
    assert report.value is None
    assert isinstance(report.error, ExceptionGroup), report.error
    assert "kernel_fault" in str(report.error.exceptions[0])
    [note] = report.error.__notes__
    assert "value: the job's return value of type _thread.lock did not pickle" in note, note


def test_the_deadline_cancels_work_in_flight_and_the_scope_still_drains(cluster: None) -> None:
    job = tray.remote(fill_and_read, sim={"copy_time": 0.02}, max_retries=0)
    t0 = time.time()
    report = ray.get(job.options(deadline=t0 + 1.0).remote(64, 10_000), timeout=TIMEOUT)
    assert time.time() - t0 < 10
    _checked(report)
    assert report.cancelled == "deadline"
    assert report.value is None
    assert 0 < len(report.emitted) - 1 < 10_000  # some steps done, then cancelled
    assert report.emitted["in_flight_at_end"] >= 1  # work was on the device when it hit
    with pytest.raises(tray.JobCancelledError, match="deadline"):
        report.result()


def test_ray_cancel_becomes_trio_cancellation(cluster: None, tmp_path: Path) -> None:
    job = tray.remote(fill_and_read, sim={"copy_time": 0.02}, max_retries=0)
    started = tmp_path / "started"
    ref = job.remote(64, 10_000, str(started))
    deadline = time.monotonic() + TIMEOUT
    while not started.exists():  # the worker is running it (a loaded host starts it late)
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    time.sleep(0.2)
    ray.cancel(ref)
    report = _checked(ray.get(ref, timeout=TIMEOUT))
    assert report.cancelled == "ray.cancel"
    assert report.emitted["in_flight_at_end"] >= 1
    assert len(report.emitted) > 1


def test_a_killed_worker_is_retried_and_its_gpu_work_is_redone(cluster: None) -> None:
    job = tray.remote(dies_on_first_attempt, max_retries=2)
    report = _checked(ray.get(job.remote(100), timeout=TIMEOUT))
    assert report.attempt == 1
    assert report.result() == 200


@pytest.mark.gpu
def test_a_job_runs_on_the_gpu_ray_assigns(cluster: None) -> None:
    probe = probe_cuda()
    if not probe.available:
        pytest.skip(f"no CUDA device: {probe.reason}")
    assert ray.cluster_resources().get("GPU", 0) >= 1  # Ray found the GPU itself
    report = ray.get(tray.remote(fill_and_read, num_gpus=1, max_retries=0).remote(1 << 20, 20), timeout=120)
    assert report.backend == "cuda", report
    assert report.gpu_ids, report
    assert not report.leaked, report
    assert report.result() == "20 steps on cuda"
    assert report.violations is None
    # the deadline cancels real GPU work in flight too
    report = ray.get(
        tray.remote(fill_and_read, num_gpus=1, max_retries=0, deadline=time.time() + 2.0).remote(
            1 << 28, 10**6
        ),
        timeout=120,
    )
    assert report.cancelled == "deadline", report
    assert not report.leaked, report


def test_trio_cuda_statistics_survive_the_round_trip() -> None:
    # a WorkerReport pickles (Ray sends it back by pickling)
    import pickle

    report = tray.run_job(fill_and_read, 8, 2, device="sim")
    again = pickle.loads(pickle.dumps(report))
    assert again == report
    assert isinstance(again.statistics, trio_cuda.ScopeStatistics)


def test_gpu_jobs_get_a_fresh_worker_per_task_and_contexts_are_made_by_the_runtime() -> None:
    # a worker's CUDA driver reads CUDA_VISIBLE_DEVICES once: Ray must not reuse it for a task
    # that it gives another GPU (Ray's default for GPU tasks, which .options() would skip)
    job = tray.remote(fill_and_read, num_gpus=1)
    assert internals.default_options_of(internals.remote_function_of(job)).get("max_calls") == 1
    assert (
        internals.default_options_of(internals.remote_function_of(job.options(max_retries=1))).get(
            "max_calls"
        )
        == 1
    )
    with pytest.raises(TypeError, match="no public constructor"):
        tray.WorkerContext()


def test_a_reused_worker_refuses_a_gpu_its_driver_never_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tray, "_visible_at_first_gpu_job", [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    internals.check_same_gpus(tray, "cuda:0")  # the first GPU job of the process: remembered
    internals.check_same_gpus(tray, "cuda:0")  # Ray gave the same GPU again: fine
    internals.check_same_gpus(tray, "sim")  # the simulator needs no GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(RuntimeError, match="cannot switch GPUs"):
        internals.check_same_gpus(tray, "cuda:0")


def _not_async(ctx: tray.WorkerContext) -> int:
    return 1


def test_a_job_that_is_not_async_is_reported_clearly() -> None:
    report = tray.run_job(_not_async, device="sim")
    assert isinstance(report.error, TypeError)
    assert "expected an async function" in str(report.error)
    assert not report.leaked


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()])
def test_a_base_exception_in_a_job_propagates_after_the_scope_drained(exc: BaseException) -> None:
    from trio_cuda.testing import SimDevice

    sim = SimDevice(copy_time=0.01)

    async def job(ctx: tray.WorkerContext) -> None:
        x = await ctx.gpu.to_device(np.zeros(8, np.float32))
        ctx.gpu.submit(ops.fill(x, 1.0))  # in flight when the job raises
        raise exc

    with pytest.raises(BaseException) as info:  # a group holding exc
        tray.run_job(job, device=sim)
    got = info.value
    if isinstance(got, BaseExceptionGroup):
        matched, rest = got.split(type(exc))
        assert matched is not None
        assert rest is None
    else:
        assert isinstance(got, type(exc))
    assert sim.live_allocations == []  # the scope waited for the fill, then freed x
    assert sim.violations == []
