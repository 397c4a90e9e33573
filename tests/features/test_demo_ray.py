"""The batch job on Ray (``python -m trio_cuda demo --ray``), against a real local Ray.

One local Ray instance (2 CPUs, no dashboard) serves the module; the shards
run on the simulator, so every case runs in CI: the inputs sharded over both
workers and each verified once, the global deadline cancelling work really in
flight in the workers, a worker killed mid-shard and its shard retried, the
per-shard leak check, the driver's backstop, and the command line (joining a
cluster, starting its own when none answers, an address that does not answer,
Ctrl-C). Every wait is bounded: run_on_ray's by the deadline and its grace
periods, the subprocesses' by a timeout.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest

from tests.helpers.sigint import python

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'trio_cuda[ray]' (Python < 3.14)")

import trio_cuda.ray as tray  # noqa: E402
from trio_cuda._backends import probe_cuda  # noqa: E402
from trio_cuda._demo.batch import BatchConfig  # noqa: E402
from trio_cuda._demo.cli import main  # noqa: E402
from trio_cuda._demo.output import Output  # noqa: E402
from trio_cuda._demo.ray import run_on_ray  # noqa: E402
from trio_cuda._demo.shard import (  # noqa: E402
    SUMMARY,
    RayReport,
    ShardResult,
    ShardSpec,
    shard_job,
    split,
    summarize,
    verify,
)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 90  # seconds for a subprocess
GRACE = 5.0  # the backstop's grace periods in run_on_ray (bounds each run to deadline + 15 s)


def _config(**changes: object) -> BatchConfig:
    base: dict[str, object] = {
        "inputs": 16,
        "size": 256,
        "concurrency": 4,
        "kernel_ms": 2.0,
        "device": "sim",
        "deadline": 30.0,
        "progress": "none",
    }
    base.update(changes)
    return BatchConfig(**base)  # type: ignore[arg-type]


def _reference(index: int, config: BatchConfig) -> np.ndarray:
    """The result of input ``index``, by a plain NumPy formula (not the demo's references)."""
    rng = np.random.default_rng((config.seed, index))
    x = rng.standard_normal(config.size, dtype=np.float32)
    y = rng.standard_normal(config.size, dtype=np.float32)
    return (np.float32(2.0) * x + y) * np.float32(0.5) - np.float32(1.0)


def _check_every_result(report: RayReport) -> None:
    """Each completed input came back once, from the shard that owns it, and
    equals the formula; the driver verified exactly those."""
    seen: dict[int, int] = {}
    for sr in report.shards:
        assert sr.report is not None, sr.lost
        for key, got in sr.report.emitted.items():
            if key == SUMMARY:
                continue
            assert key in sr.inputs, (sr.shard, key)
            assert key not in seen, f"input {key} from shards {seen[key]} and {sr.shard}"
            seen[key] = sr.shard
            np.testing.assert_allclose(got, _reference(key, report.config), rtol=1e-5, atol=1e-5)
    assert seen == report.verified_by
    assert report.mismatched == []
    assert report.duplicates == 0


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray for the module; its GCS address."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        namespace="trio_cuda_demo_tests",
    )
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()


def _env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


QUICK = ("--device", "sim", "--inputs", "16", "--size", "256", "--kernel-ms", "1", "--progress", "lines")


def _demo(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_cuda", "demo", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=env,
        check=False,
    )


def _closed_port() -> int:
    """A local TCP port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shard_lines(text: str) -> dict[int, str]:
    """Each shard's summary block (its first line and the indented ones under it)."""
    blocks: dict[int, str] = {}
    current: int | None = None
    for line in text.splitlines():
        m = re.match(r"shard (\d+): inputs \d+ to \d+ on ", line)
        if m:
            current = int(m.group(1))
            blocks[current] = line
        elif current is not None and line.startswith("  "):
            blocks[current] += "\n" + line
        else:
            current = None
    return blocks


# --------------------------------------------------------------------------- without a cluster


def test_split_covers_the_inputs_in_contiguous_even_shards() -> None:
    assert split(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert split(2, 2) == [range(0, 1), range(1, 2)]
    for inputs, shards in [(1, 1), (7, 7), (64, 5), (1000, 8)]:
        parts = split(inputs, shards)
        assert len(parts) == shards
        assert [i for p in parts for i in p] == list(range(inputs))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_importing_trio_cuda_and_the_demo_does_not_import_ray() -> None:
    code = (
        "import sys\n"
        "import trio_cuda\n"
        "assert 'ray' not in sys.modules, 'import trio_cuda imported ray'\n"
        "import trio_cuda._demo.ray, trio_cuda._demo.cli, trio_cuda.__main__ as m\n"
        "m.build_parser().parse_args(['demo', '--ray', '--ray-kill-worker', '1'])\n"
        "bad = sorted(n for n in sys.modules if n == 'ray' or n.startswith('ray.'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=_env()
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ray-shards", "2"], "--ray-shards: only with --ray"),
        (["--ray-kill-worker", "0"], "--ray-kill-worker: only with --ray"),
        (["--ray", "--device", "cuda:1"], "--device cuda:1: Ray assigns each shard its GPU"),
        (["--ray", "--trace", "out.json"], "--trace: not available with --ray"),
    ],
)
def test_options_that_cannot_run_are_one_error_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert message in lines[0]


@pytest.mark.parametrize("value", ["nowhere", "host:port", "host:0", ":80", "ray://"])
def test_a_malformed_address_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--ray", value])
    assert exc.value.code == 2
    assert "expected 'auto', 'local', HOST:PORT" in capsys.readouterr().err


def test_an_address_that_does_not_answer_is_one_error_line_and_exit_2() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    t0 = time.perf_counter()
    proc = _demo("--ray", address, *QUICK, env=_env(RAY_ADDRESS=None))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"--ray {address}: no Ray cluster answers at {address}" in lines[0]
    assert time.perf_counter() - t0 < 30


def test_an_address_that_takes_the_connection_but_never_answers_is_bounded() -> None:
    """Something listens, and is not Ray: ray.init would wait for minutes;
    the driver gives up after CONNECT_TIMEOUT (2 s here) with one line, exit 2."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        code = (
            "import sys, trio_cuda._demo.ray as r\n"
            "r.CONNECT_TIMEOUT = 2.0\n"
            "from trio_cuda._demo.cli import main\n"
            f"sys.exit(main(['--ray', {address!r}, '--device', 'sim']))\n"
        )
        t0 = time.perf_counter()
        command = [sys.executable, "-c", code]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=_env())
        took = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"the Ray cluster at {address} did not accept the driver within 2 s" in proc.stderr
    assert proc.stdout == ""
    assert took < 30


def test_a_worker_job_never_kills_the_driver_it_runs_in() -> None:
    """The kill is a testing aid for Ray workers: run in-process (attempt 0,
    the driver's pid), the shard completes."""
    config = _config(inputs=4)
    spec = ShardSpec(0, 0, 4, config, kill_after=1, driver_pid=os.getpid())
    report = tray.run_job(shard_job, spec, device="sim")
    assert report.error is None
    assert report.emitted[SUMMARY].completed == 4
    assert sorted(k for k in report.emitted if k != SUMMARY) == [0, 1, 2, 3]


def test_the_summary_checks_each_shard_for_leaks() -> None:
    """A shard whose scope left something behind is named, with what it
    leaked, beside a clean one; the run fails."""
    config = _config(inputs=8)
    parts = split(8, 2)
    run = RayReport(config, shards=[ShardResult(i, p) for i, p in enumerate(parts)])
    for sr in run.shards:
        spec = ShardSpec(sr.shard, sr.inputs.start, sr.inputs.stop, config)
        sr.report = tray.run_job(shard_job, spec, device="sim")
        assert not sr.report.leaked
    rep = run.shards[1].report
    assert rep is not None
    run.shards[1].report = attrs.evolve(
        rep,
        statistics=attrs.evolve(rep.statistics, in_flight=1, live_allocations=2),
        violations=1,
    )
    out = io.StringIO()
    output = Output(out, io.StringIO(), progress="none")
    verify(run, output)
    summarize(run, output)
    text = out.getvalue()
    blocks = _shard_lines(text)
    assert blocks[0].endswith("; nothing leaked"), text
    assert "LEAKED: in_flight=1, live_allocations=2, memcheck violations=1" in blocks[1], text
    assert "shard(s) [1] leaked" in text
    assert not run.ok
    assert "FAILED: shard 1 leaked: in_flight=1, live_allocations=2, memcheck violations=1" in text
    assert run.verified == 8  # the results themselves were fine


def test_each_input_is_verified_once_when_a_shard_reports_twice() -> None:
    """A second report of the same shard (a shard sent again after its first
    report was thought lost) adds nothing: its results are dropped, counted."""
    config = _config(inputs=6)
    spec = ShardSpec(0, 0, 6, config)
    first = tray.run_job(shard_job, spec, device="sim")
    again = tray.run_job(shard_job, spec, device="sim")
    run = RayReport(config, shards=[ShardResult(0, range(6), first), ShardResult(0, range(6), again)])
    out = io.StringIO()
    output = Output(out, io.StringIO(), verbose=1, progress="none")
    verify(run, output)
    verify(run, output)  # checking again counts nothing twice
    assert run.ok, run.problems
    assert run.verified_by == dict.fromkeys(range(6), 0)
    assert run.duplicates == 6
    assert run.completed == 6
    assert "input 5: a second result (shard 0) dropped" in out.getvalue()


def test_a_wrong_or_stray_result_fails_the_check() -> None:
    config = _config(inputs=4)
    rep = tray.run_job(shard_job, ShardSpec(0, 0, 4, config), device="sim")
    emitted = dict(rep.emitted)
    emitted[1] = emitted[1] + np.float32(1e-2)  # a wrong value
    emitted[7] = emitted[0]  # an input that is not the shard's
    run = RayReport(config, shards=[ShardResult(0, range(4), attrs.evolve(rep, emitted=emitted))])
    verify(run, Output(io.StringIO(), io.StringIO(), progress="none"))
    assert run.mismatched == [1]
    assert sorted(run.verified_by) == [0, 2, 3]
    assert "results differ from the reference for inputs [1]" in run.problems
    assert "shard 0 sent a result for 7, not one of its inputs" in run.problems
    assert "shard 0 counted 4 completed input(s) but sent 5" in run.problems


# --------------------------------------------------------------------------- on the module's cluster


def test_shards_cover_every_input_and_each_is_verified_once(cluster: str) -> None:
    config = _config(inputs=24, kernel_ms=20.0, verbose=1)
    out = io.StringIO()
    report = run_on_ray(config, out=out, grace=GRACE)
    text = out.getvalue()
    assert report.ok, text
    assert len(report.shards) == 2  # one per CPU of the cluster
    assert [sr.inputs for sr in report.shards] == [range(0, 12), range(12, 24)]
    assert sorted(report.verified_by) == list(range(24))
    _check_every_result(report)
    pids = {sr.report.pid for sr in report.shards if sr.report is not None}
    assert len(pids) == 2, text  # two workers at once
    assert os.getpid() not in pids
    for sr in report.shards:
        assert sr.report is not None
        assert sr.report.cancelled is None
        assert sr.report.attempt == 0
        assert not sr.report.leaked
        assert sr.results == 12
    blocks = _shard_lines(text)
    assert sorted(blocks) == [0, 1]
    assert all(b.endswith("; nothing leaked") for b in blocks.values()), text
    assert "verify: 24/24 completed results match" in text
    assert "shard 0: inputs 0 to 11 submitted" in text  # -v: per-shard progress
    assert re.search(r"shard 1: finished on \S+ pid \d+, attempt 0: 12 done", text), text
    assert "progress:   2/2 shard(s) reported" in text
    assert text.splitlines()[-1].startswith("OK: 24 verified, 0 cancelled")


def test_the_global_deadline_cancels_work_in_flight_in_the_workers(cluster: str) -> None:
    # Each input takes two 200 ms launches, 4 at a time per shard: at the
    # deadline (0.5 s) the second wave of each shard is in its kernels.
    config = _config(inputs=16, kernel_ms=200.0, deadline=0.5)
    out = io.StringIO()
    t0 = time.perf_counter()
    report = run_on_ray(config, out=out, grace=GRACE)
    text = out.getvalue()
    assert report.ok, text
    by_deadline = [sr for sr in report.shards if sr.report is not None and sr.report.cancelled == "deadline"]
    assert by_deadline, text
    summaries = [sr.summary for sr in by_deadline]
    assert all(s is not None for s in summaries)
    assert sum(s.in_flight_at_deadline for s in summaries if s is not None) > 0, text
    assert sum(s.cancelled_in_flight for s in summaries if s is not None) > 0, text
    assert report.completed < config.inputs, text
    _check_every_result(report)
    for sr in report.shards:
        assert sr.report is not None
        assert not sr.report.leaked, sr.report.statistics  # the scope drained before it reported
        assert sr.report.statistics.in_flight == 0
    assert re.search(r"deadline: 0\.500 s passed in [12] shard\(s\)", text), text
    assert "by the deadline" in text
    assert not report.backstop
    assert time.perf_counter() - t0 < 0.5 + GRACE, "the deadline did not bound the run"


def test_a_killed_worker_is_retried_and_every_input_is_verified_once(cluster: str) -> None:
    config = _config(inputs=16, kernel_ms=5.0, verbose=1)
    out = io.StringIO()
    report = run_on_ray(config, kill_shard=1, out=out, grace=GRACE)
    text = out.getvalue()
    assert report.ok, text
    killed, other = report.shards[1], report.shards[0]
    assert killed.report is not None, killed.lost
    assert other.report is not None, other.lost
    assert killed.report.attempt == 1, text  # Ray retried it once
    assert other.report.attempt == 0
    assert killed.report.cancelled is None
    assert killed.results == 8  # the first attempt's results died with its worker
    assert sorted(report.verified_by) == list(range(16))
    _check_every_result(report)
    assert sum(sr.results for sr in report.shards) == 16
    assert "its worker kills itself half-way through its first attempt" in text
    assert "attempt 1 (retried 1 time(s))" in _shard_lines(text)[1]
    assert all(b.endswith("; nothing leaked") for b in _shard_lines(text).values()), text


def test_cli_auto_joins_the_cluster_that_ray_address_names(cluster: str) -> None:
    proc = _demo("--ray", "auto", *QUICK, "--deadline", "30", "-v", env=_env(RAY_ADDRESS=cluster))
    text = proc.stdout
    assert proc.returncode == 0, text + proc.stderr
    assert text.startswith(f"ray: joined the Ray cluster at {cluster}\n"), text
    assert "in 2 shard(s) (one per CPU worker, on the simulator)" in text
    assert "shard 1: inputs 8 to 15 submitted" in text
    blocks = _shard_lines(text)
    assert sorted(blocks) == [0, 1], text
    assert all(b.endswith("; nothing leaked") for b in blocks.values()), text
    assert "verify: 16/16 completed results match" in text
    assert "nothing leaked in any shard" in text
    assert text.splitlines()[-1].startswith("OK: 16 verified")


def test_cli_ctrl_c_cancels_the_shards_and_still_collects_their_reports(cluster: str) -> None:
    proc = subprocess.Popen(
        python("-m", "trio_cuda", "demo", "--ray", cluster, "--device", "sim",
         "--inputs", "64", "--size", "256", "--kernel-ms", "200", "--concurrency", "2",
         "--deadline", "none", "-v"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(RAY_ADDRESS=f"127.0.0.1:{_closed_port()}"),  # the address given wins
    )  # fmt: skip
    assert proc.stdout is not None
    head = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            head.append(line)
            if line.startswith("shard 1: inputs 32 to 63 submitted"):
                break
        assert head, "no output"
        assert head[-1].startswith("shard 1:"), "".join(head)
        time.sleep(0.5)  # both shards are in their kernels: 32 inputs need 6.4 s each
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = "".join(head) + rest
    assert proc.returncode == 130, text + err
    assert "Ctrl-C: cancelling the shards (ray.cancel)" in text
    blocks = _shard_lines(text)
    assert sorted(blocks) == [0, 1], text
    for block in blocks.values():
        assert "by ray.cancel" in block, text
        assert block.endswith("; nothing leaked"), text
    assert "NO REPORT" not in text
    done = int(re.search(r"verify: (\d+)/\1 completed", text).group(1))  # type: ignore[union-attr]
    assert 0 < done < 64, text


def test_cli_auto_starts_a_local_cluster_when_none_answers() -> None:
    """RAY_ADDRESS names a cluster that does not answer: ``--ray auto`` starts
    its own (whether or not another cluster runs on this host)."""
    dead = f"127.0.0.1:{_closed_port()}"
    proc = _demo("--ray", "auto", *QUICK, "--deadline", "30", env=_env(RAY_ADDRESS=dead))
    text = proc.stdout
    assert proc.returncode == 0, text + proc.stderr
    assert text.startswith(f"ray: started a local Ray cluster (the Ray cluster at {dead} does not answer"), (
        text
    )
    blocks = _shard_lines(text)
    assert blocks, text
    assert all(b.endswith("; nothing leaked") for b in blocks.values()), text
    assert text.splitlines()[-1].startswith("OK: 16 verified")


@pytest.mark.gpu
def test_shards_run_on_the_gpus_ray_assigns_and_the_deadline_cancels_them(cluster: str) -> None:
    probe = probe_cuda()
    if not probe.available:
        pytest.skip(f"no CUDA device: {probe.reason}")
    gpus = int(ray.cluster_resources().get("GPU", 0))
    assert gpus >= 1  # Ray found the GPUs itself
    # 16 inputs per shard, 4 at a time, two launches of 100 ms spun on the GPU
    # each: at the deadline (0.5 s) the third wave is in its kernels.
    config = _config(device="cuda", inputs=16 * gpus, size=1 << 16, kernel_ms=100.0, deadline=0.5)
    out = io.StringIO()
    report = run_on_ray(config, out=out, grace=GRACE)
    text = out.getvalue()
    assert report.ok, text
    assert report.use_gpus
    assert len(report.shards) == gpus
    assert 0 < report.completed < config.inputs, text
    _check_every_result(report)
    for sr in report.shards:
        assert sr.report is not None, sr.lost
        assert sr.report.backend == "cuda", text
        assert sr.report.gpu_ids, text
        assert not sr.report.leaked, text
        assert sr.report.violations is None
    summaries = [s for sr in report.shards if (s := sr.summary) is not None]
    assert sum(s.in_flight_at_deadline for s in summaries) > 0, text
    assert "(one per GPU)" in text
    assert all(b.endswith("; nothing leaked") for b in _shard_lines(text).values()), text


def test_the_backstop_stops_shards_that_outlive_the_deadline(cluster: str) -> None:
    """Runs last (it kills the module's workers). Four shards on two CPUs:
    launches of 2 s keep shards 0 and 1 draining well past the deadline, and
    2 and 3 wait for a CPU. With a grace of 0.5 s the backstop cancels all
    four (2 and 3 before they started: no failure), then kills 0 and 1: their
    inputs are reported lost, and the run fails."""
    config = _config(inputs=8, kernel_ms=2000.0, concurrency=2, deadline=0.3)
    out = io.StringIO()
    t0 = time.perf_counter()
    report = run_on_ray(config, shards=4, out=out, grace=0.5)
    elapsed = time.perf_counter() - t0
    text = out.getvalue()
    assert report.backstop == [0, 1, 2, 3], text
    assert report.forced == [0, 1], text
    assert not report.ok
    for sr in report.shards:
        assert sr.report is None, text
        assert sr.never_ran == (sr.shard >= 2), text
    assert "backstop: 4 shard(s) [0, 1, 2, 3] still running 0.5 s after the deadline" in text
    assert "shard 0: inputs 0 to 1: NO REPORT (TaskCancelledError" in text
    assert "shard 3: inputs 6 to 7: cancelled before it started; its inputs never started" in text
    problems = [p for p in report.problems if "sent no report" in p]
    assert problems == [
        f"shard {i} (inputs {2 * i} to {2 * i + 1}) sent no report: {report.shards[i].lost}" for i in (0, 1)
    ]
    assert report.verified == 0
    assert elapsed < 10, text
