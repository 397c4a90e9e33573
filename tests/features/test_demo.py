"""The batch job (examples/batch_job.py, ``python -m trio_cuda demo``) on the simulator."""

from __future__ import annotations

import ast
import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trio_cuda
from tests.helpers.sigint import python
from trio_cuda import DeviceUnavailableError
from trio_cuda._demo import batch, cli, output
from trio_cuda._demo.batch import BatchConfig, make_kernels, run_batch
from trio_cuda._demo.cli import main
from trio_cuda._demo.output import Output

ROOT = Path(__file__).resolve().parents[2]

FAST = {"inputs": 24, "size": 512, "concurrency": 4, "kernel_ms": 2.0, "device": "sim", "progress_every": 4}


def _assert_clean(report: object, text: str) -> None:
    assert report.ok, f"{report.problems}\n{text}"  # type: ignore[attr-defined]
    stats = report.final_stats  # type: ignore[attr-defined]
    assert stats is not None
    assert (stats.in_flight, stats.leases_held, stats.quarantined, stats.live_allocations) == (0, 0, 0, 0)
    assert report.sim_violations == []  # type: ignore[attr-defined]
    assert report.sim_live_allocations == []  # type: ignore[attr-defined]
    assert report.mismatched == []
    assert report.failed == []
    assert "backend: sim" in text
    assert "nothing leaked" in text


async def test_batch_without_deadline_completes_and_verifies_everything() -> None:
    out = io.StringIO()
    report = await run_batch(BatchConfig(**FAST, deadline=math.inf), out=out)  # type: ignore[arg-type]
    text = out.getvalue()
    _assert_clean(report, text)
    assert report.completed == report.verified == FAST["inputs"]
    assert report.cancelled_total == 0
    assert not report.deadline_hit
    assert "progress:" in text


async def test_deadline_cancels_in_flight_work_and_nothing_leaks() -> None:
    out = io.StringIO()
    # 24 inputs x 2 launches x 2 ms on 4 streams need about 24 ms; cancel after 8 ms.
    report = await run_batch(BatchConfig(**FAST, deadline=0.008), out=out)  # type: ignore[arg-type]
    text = out.getvalue()
    _assert_clean(report, text)
    assert report.deadline_hit, text
    assert report.completed < FAST["inputs"], text
    assert report.cancelled_total == FAST["inputs"] - report.completed
    assert report.cancelled_in_flight > 0, text
    assert report.verified == report.completed
    assert "deadline:" in text


def test_main_exit_status_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        ["--device", "sim", "--inputs", "12", "--size", "256", "--kernel-ms", "1", "--deadline", "0.004"]
    )
    text = capsys.readouterr().out
    assert status == 0, text
    assert text.splitlines()[-1].startswith("OK:")


def test_references_match_a_plain_numpy_formula() -> None:
    kernels = make_kernels()
    assert kernels.saxpy.reference is not None
    assert kernels.scale_shift.reference is not None
    x = np.arange(6, dtype=np.float32)
    y = np.ones(6, dtype=np.float32)
    kernels.saxpy.reference(np.float32(2.0), x, y, np.int32(6), np.uint64(0))
    np.testing.assert_array_equal(y, 2 * np.arange(6) + 1)
    out = np.empty_like(y)
    kernels.scale_shift.reference(y, out, np.float32(0.5), np.float32(-1.0), np.int32(6), np.uint64(0))
    np.testing.assert_array_equal(out, (2 * np.arange(6) + 1) * 0.5 - 1)


@pytest.mark.parametrize(
    "command",
    [
        [str(ROOT / "examples" / "batch_job.py")],
        ["-m", "trio_cuda", "demo"],
    ],
    ids=["examples/batch_job.py", "python -m trio_cuda demo"],
)
def test_batch_job_runs_as_a_program(command: list[str]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, *command, "--device", "sim", "--inputs", "16", "--size", "256", "--kernel-ms", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "backend: sim" in proc.stdout
    assert "nothing leaked" in proc.stdout


# --------------------------------------------------------------------------- helpers for the command line


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    return env


def _demo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_cuda", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=_env(),
        check=False,
    )


QUICK = ("--device", "sim", "--inputs", "16", "--size", "256", "--kernel-ms", "1")


# --------------------------------------------------------------------------- -v and -vv


async def test_verbose_adds_per_input_lines_and_device_details() -> None:
    config = {**FAST, "deadline": math.inf}
    plain_out, plain_err = io.StringIO(), io.StringIO()
    plain = await run_batch(BatchConfig(**config), out=plain_out, err=plain_err)  # type: ignore[arg-type]
    out, err = io.StringIO(), io.StringIO()
    report = await run_batch(BatchConfig(**config, verbose=1), out=out, err=err)  # type: ignore[arg-type]
    text, plain_text = out.getvalue(), plain_out.getvalue()
    _assert_clean(plain, plain_text)
    _assert_clean(report, text)

    # One line per input: its stream, the time of each step, the scope's counters.
    per_input = re.findall(
        r"^input +(\d+): stream (\d+), upload [\d.]+ ms, compute [\d.]+ ms, download [\d.]+ ms, "
        r"matches the reference; scope: \d+ submission\(s\) in flight, \d+ lease\(s\), [\d.]+ MiB retained$",
        text,
        re.MULTILINE,
    )
    assert sorted(int(i) for i, _ in per_input) == list(range(FAST["inputs"])), text
    assert all(0 <= int(stream) < 4 for _, stream in per_input)
    assert sum(report.streams_used.values()) == FAST["inputs"]
    # The device, the scope, the timings and the streams.
    for needle in (
        "device: sim0 (sim, ordinal 0), 8.0 GiB, compute capability 9.0",
        "scope: 4 streams, up to 4 inputs at a time, launches of 2 block(s) of 256 threads; "
        "each launch takes 2 ms of simulated time",
        f"timings (ms, median/max over {FAST['inputs']} inputs): upload ",
        "streams: 0: ",
    ):
        assert needle in text, text
    # None of that without -v; the summary lines are the same.
    assert not re.search(r"^input +\d+:", plain_text, re.MULTILINE), plain_text
    for needle in ("device: ", "timings", "streams: "):
        assert needle not in plain_text
    for summary in ("verify: 24/24", "after scope exit: ", "OK: 24 verified"):
        assert summary in plain_text
        assert summary in text
    assert plain_err.getvalue() == ""
    assert len(text.splitlines()) > len(plain_text.splitlines()) + FAST["inputs"]


async def test_verbose_reports_each_cancellation_and_logs_at_info() -> None:
    # Launches of 400 ms and a deadline of 150 ms: the deadline finds every
    # started input with work in flight (its kernels, or an upload queued
    # behind another input's kernel).
    config = BatchConfig(
        inputs=8, size=64, concurrency=4, kernel_ms=400, deadline=0.15, device="sim", verbose=1
    )
    out, err = io.StringIO(), io.StringIO()
    report = await run_batch(config, out=out, err=err)
    text, log_text = out.getvalue(), err.getvalue()
    _assert_clean(report, text)
    assert report.cancelled_in_flight == 4, text
    assert report.cancelled["waiting"] == 4, text
    assert report.cancelled.get("computing", 0) >= 1, text
    cancels = re.findall(
        r"^input +(\d+): cancelled while (?:computing on stream \d+|uploading), [\d.]+ ms after it started; "
        r"the scope keeps its work in flight until the device finished it$",
        text,
        re.MULTILINE,
    )
    assert sorted(int(i) for i in cancels) == [0, 1, 2, 3], text
    assert "inputs 4 to 7: never started" in text
    assert "deadline: 0.150 s passed: 0 done, 4 cancelled in flight (" in text
    # The trio_cuda logger at INFO: each task cancelled with its work in flight.
    assert report.in_flight_at_deadline >= 4, text
    assert log_text.count("[trio_cuda INFO] a task awaiting submission") == 4, log_text
    assert "DEBUG" not in log_text
    # The logger is as it was before the run.
    logger = logging.getLogger("trio_cuda")
    assert logger.level == logging.NOTSET
    assert not [h for h in logger.handlers if type(h).__name__ == "_Handler"]


async def test_very_verbose_adds_every_step_and_debug_logging() -> None:
    out, err = io.StringIO(), io.StringIO()
    report = await run_batch(BatchConfig(**FAST, deadline=math.inf, verbose=2), out=out, err=err)  # type: ignore[arg-type]
    text = out.getvalue()
    _assert_clean(report, text)
    n = FAST["inputs"]
    for step in (
        r"started, \d+ of 4 places taken",
        r"x and y uploaded in",
        r"saxpy, scale_shift submitted on stream \d",
        "kernels done in",
    ):
        assert len(re.findall(rf"^input +\d+: {step}", text, re.MULTILINE)) == n, (step, text)
    assert "ScopeStatistics(" in text
    assert "[trio_cuda DEBUG] opened <ResourceScope sim:0" in err.getvalue()


def test_cli_v_and_vv_print_more_than_the_default() -> None:
    runs = {flags: _demo(*QUICK, "--deadline", "none", *flags) for flags in ((), ("-v",), ("-vv",))}
    for flags, proc in runs.items():
        assert proc.returncode == 0, (flags, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
    plain, v, vv = (runs[f].stdout.splitlines() for f in ((), ("-v",), ("-vv",)))
    assert len(plain) < len(v) < len(vv)
    assert not any(line.startswith("input ") for line in plain)
    assert sum(bool(re.match(r"input +\d+: stream \d", line)) for line in v) == 16
    assert "[trio_cuda DEBUG]" in runs[("-vv",)].stderr
    assert runs[()].stderr == ""


# --------------------------------------------------------------------------- --device cuda without a GPU


def _missing_devices() -> list[str]:
    from trio_cuda._backends import probe_cuda

    probe = probe_cuda()
    if probe.available:  # a GPU machine: an ordinal past the last device is missing
        return [f"cuda:{probe.device_count}", f"cuda:{probe.device_count + 6}"]
    return ["cuda", "cuda:0", "cuda:7"]


@pytest.mark.parametrize("device", _missing_devices())
@pytest.mark.parametrize("program", ["module", "example"])
def test_a_missing_cuda_device_fails_early_with_one_line(device: str, program: str, tmp_path: Path) -> None:
    from trio_cuda._backends import probe_cuda

    args = ["--device", device, "--trace", str(tmp_path / "t.html")]
    if program == "module":
        proc = _demo(*args)
        prog = "trio-cuda demo"
    else:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "batch_job.py"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=_env(),
            check=False,
        )
        prog = "batch_job"
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: --device {device}: ")
    probe = probe_cuda()
    assert (probe.reason if not probe.available else "the CUDA driver reports") in lines[0]
    assert not (tmp_path / "t.html").exists()  # nothing ran, nothing was traced


async def test_run_batch_refuses_a_missing_device_before_printing() -> None:
    out = io.StringIO()
    with pytest.raises(DeviceUnavailableError):
        await run_batch(BatchConfig(device=_missing_devices()[-1]), out=out)
    assert out.getvalue() == ""


# --------------------------------------------------------------------------- progress: bar or lines


def test_progress_is_plain_lines_when_not_a_terminal() -> None:
    proc = _demo(*QUICK, "--deadline", "none")
    assert proc.returncode == 0, proc.stderr
    progress = [line for line in proc.stdout.splitlines() if line.startswith("progress: ")]
    assert len(progress) == 8, proc.stdout  # every eighth of the inputs
    assert progress[-1].startswith("progress:  16/16 done")
    assert "\r" not in proc.stdout + proc.stderr
    assert "%|" not in proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("OK: 16 verified")


def _run_on_a_terminal(
    args: list[str], *, stdout_too: bool, command: list[str] | None = None
) -> tuple[int, str, str]:
    """Run the demo (``python -m trio_cuda`` or ``python *command``) with stderr
    (and stdout, if ``stdout_too``) on a pseudo-terminal."""
    pty = pytest.importorskip("pty", reason="pseudo-terminals need the pty module (POSIX)")
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, *(command or ["-m", "trio_cuda"]), "demo", *args],
            stdin=subprocess.DEVNULL,
            stdout=slave if stdout_too else subprocess.PIPE,
            stderr=slave,
            cwd=ROOT,
            env=_env(),
        )
    finally:
        os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every copy of the terminal's other end is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    piped = proc.stdout.read().decode() if proc.stdout is not None else ""
    if proc.stdout is not None:
        proc.stdout.close()
    status = proc.wait(timeout=120)
    return status, b"".join(chunks).decode(errors="replace"), piped


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
@pytest.mark.parametrize("stdout_too", [True, False], ids=["both on the terminal", "stdout piped"])
def test_progress_bar_on_a_terminal_and_the_summary_still_prints(stdout_too: bool) -> None:
    status, terminal, piped = _run_on_a_terminal([*QUICK, "--deadline", "none"], stdout_too=stdout_too)
    assert status == 0, terminal + piped
    assert "Traceback" not in terminal
    assert re.search(r"batch: +100%\|[^|]*\| 16/16 \[", terminal), terminal  # tqdm's bar, complete
    assert "progress: " not in terminal + piped  # the bar replaces the plain lines
    summary = terminal if stdout_too else piped
    lines = [line.rsplit("\r", 1)[-1] for line in summary.replace("\r\n", "\n").split("\n")]
    assert "verify: 16/16 completed results match the NumPy reference" in lines, summary
    assert any(line.startswith("OK: 16 verified") and "nothing leaked" in line for line in lines), summary
    if not stdout_too:  # the bar stays on stderr: the summary on stdout is clean
        assert "\r" not in piped
        assert "%|" not in piped
        assert piped.splitlines()[-1].startswith("OK: 16 verified")


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_quiet_shows_no_bar_on_a_terminal() -> None:
    status, terminal, _ = _run_on_a_terminal([*QUICK, "--quiet"], stdout_too=True)
    assert status == 0, terminal
    assert "%|" not in terminal
    assert "progress: " not in terminal
    assert "nothing leaked" in terminal


async def test_bar_mode_writes_the_bar_to_err_and_lines_to_out() -> None:
    out, err = io.StringIO(), io.StringIO()
    report = await run_batch(
        BatchConfig(**FAST, deadline=math.inf, progress="bar", verbose=1), out=out, err=err
    )  # type: ignore[arg-type]
    _assert_clean(report, out.getvalue())
    assert "%|" in err.getvalue()
    assert "%|" not in out.getvalue()
    assert "progress: " not in out.getvalue()
    assert len(re.findall(r"^input +\d+: stream", out.getvalue(), re.MULTILINE)) == FAST["inputs"]


# --------------------------------------------------------------------------- the bar without tqdm

#: runs ``python -m trio_cuda`` with the tqdm import blocked, as where tqdm is not installed
NO_TQDM = "import sys; sys.modules['tqdm'] = None; from trio_cuda.__main__ import main; sys.exit(main())"


async def test_bar_mode_without_tqdm_draws_the_built_in_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    with pytest.raises(ImportError):
        import tqdm  # noqa: F401
    out, err = io.StringIO(), io.StringIO()
    report = await run_batch(
        BatchConfig(**FAST, deadline=math.inf, progress="bar", verbose=1), out=out, err=err
    )  # type: ignore[arg-type]
    _assert_clean(report, out.getvalue())
    bar = err.getvalue()
    assert "%|" not in bar  # not tqdm's
    last = bar.rstrip("\n").rsplit("\r", 1)[-1]
    assert re.fullmatch(r"batch: 100% \[#{24}\] 24/24 inputs, \d+\.\d s, 0 in flight *", last), repr(last)
    assert bar.endswith("\n")  # the bar's line is ended when it closes
    assert "\r" not in out.getvalue()
    assert "progress: " not in out.getvalue()
    assert len(re.findall(r"^input +\d+: stream", out.getvalue(), re.MULTILINE)) == FAST["inputs"]


def test_the_built_in_bar_writes_lines_above_itself_and_closes_once() -> None:
    err, out = io.StringIO(), io.StringIO()
    bar = output.PlainBar(4, err, mininterval=3600.0)
    bar.update()  # not redrawn: too soon
    assert err.getvalue().count("\r") == 1
    bar.write("a line", file=out)
    assert out.getvalue() == "a line\n"
    # the bar was blanked out before the line and drawn again after it, at 1/4
    assert re.search(r"\r {20,}\r+batch:  25% \[#{6}\.{18}\] 1/4 inputs, \d+\.\d s$", err.getvalue())
    bar.set_postfix_str("2 in flight")
    bar.update(3)  # the last one is drawn whatever the interval
    assert re.search(r"\] 4/4 inputs, \d+\.\d s, 2 in flight$", err.getvalue())
    bar.close()
    bar.close()
    assert err.getvalue().count("\n") == 1
    bar.write("after", file=out)  # a closed bar writes plain lines
    assert out.getvalue() == "a line\nafter\n"

    gone = io.StringIO()
    bar = output.PlainBar(2, gone)
    gone.close()  # the terminal went away: the bar stops drawing, the job goes on
    bar.update(2)
    bar.set_postfix_str("x")
    bar.write("still printed", file=out)
    bar.close()
    assert out.getvalue().endswith("after\nstill printed\n")


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_without_tqdm_the_terminal_gets_the_built_in_bar() -> None:
    status, terminal, piped = _run_on_a_terminal(
        [*QUICK, "--deadline", "none"], stdout_too=False, command=["-c", NO_TQDM]
    )
    assert status == 0, terminal + piped
    assert "Traceback" not in terminal
    assert "%|" not in terminal
    assert re.search(r"batch: 100% \[#{24}\] 16/16 inputs", terminal), terminal
    assert "progress: " not in terminal + piped
    assert "\r" not in piped
    assert piped.splitlines()[-1].startswith("OK: 16 verified")


# --------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--inputs", "0"], "--inputs"),
        (["--inputs", "-3"], "--inputs"),
        (["--inputs", "abc"], "--inputs"),
        (["--size", "0"], "--size"),
        (["--size", "-1"], "--size"),
        (["--size", str(2**31)], "--size"),
        (["--concurrency", "0"], "--concurrency"),
        (["--streams", "0"], "--streams"),
        (["--streams", "100000"], "--streams"),
        (["--deadline", "nan"], "--deadline"),
        (["--deadline", "-0.5"], "--deadline"),
        (["--deadline", "-inf"], "--deadline"),
        (["--deadline", "soon"], "--deadline"),
        (["--kernel-ms", "nan"], "--kernel-ms"),
        (["--kernel-ms", "inf"], "--kernel-ms"),
        (["--kernel-ms", "-1"], "--kernel-ms"),
        (["--seed", "-1"], "--seed"),
        (["--seed", "1.5"], "--seed"),
        (["--device", "gpu"], "--device"),
        (["--device", "cuda:-1"], "--device"),
        (["--device", ""], "--device"),
        (["--progress", "fancy"], "--progress"),
        (["--trace", "out.txt"], "--trace"),
        (["--trace", "no/such/folder/out.html"], "--trace"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_options_are_usage_errors(
    args: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: " in captured.err
    assert option in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("inputs", 0),
        ("size", 2**31),
        ("deadline", math.nan),
        ("kernel_ms", math.inf),
        ("device", "gpu"),
        ("streams", True),
        ("seed", -1),
        ("progress", "fancy"),
    ],
)
def test_batch_config_refuses_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        BatchConfig(**{field: value})  # type: ignore[arg-type]


def test_edge_values_run_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--device", "sim", "--inputs", "3", "--size", "1", "--deadline", "0", "--kernel-ms", "0"]) == 0
    )
    text = capsys.readouterr().out
    assert "0 done" in text
    assert "3 never started" in text
    assert text.splitlines()[-1].startswith("OK: 0 verified")
    assert (
        main(["--device", "sim", "--inputs", "2", "--size", "1", "--deadline", "1e400", "--kernel-ms", "0"])
        == 0
    )
    assert "deadline none" in capsys.readouterr().out


def test_failed_inputs_are_reported_together_and_the_exit_status_is_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = batch.input_vectors

    def flaky(seed: int, index: int, size: int) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[type-arg]
        if index in (2, 5):
            raise MemoryError("no room for the inputs")
        return real(seed, index, size)

    monkeypatch.setattr(batch, "input_vectors", flaky)
    status = main(
        ["--device", "sim", "--inputs", "8", "--size", "64", "--kernel-ms", "0", "--deadline", "none"]
    )
    text = capsys.readouterr().out
    assert status == 1, text
    assert "FAILED: 2 inputs [2, 5] failed: MemoryError: no room for the inputs" in text
    assert "verify: 6/6 completed results match" in text
    assert "nothing leaked" not in text


def test_a_trace_that_cannot_be_written_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(self: object, path: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trio_cuda.trace.Trace, "write", disk_full)
    target = tmp_path / "t.html"
    status = main(
        ["--device", "sim", "--inputs", "2", "--size", "64", "--kernel-ms", "0", "--trace", str(target)]
    )
    captured = capsys.readouterr()
    assert status == 1
    assert captured.err.count("\n") == 1
    assert f"--trace: could not write {str(target)!r}: [Errno 28] No space left on device" in captured.err
    assert "nothing leaked" in captured.out


@pytest.mark.parametrize("name", ["t.html", "t.json", "plain"])
def test_a_folder_as_the_trace_is_refused_before_the_job_runs(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / name
    folder.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["--device", "sim", "--inputs", "2", "--trace", str(folder)])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    [line] = [line for line in captured.err.splitlines() if "error:" in line]
    assert line == (
        f"batch_job: error: argument --trace: expected a file name, not a folder, got {str(folder)!r}"
    )
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize(("name", "start"), [("T.HTML", "<!doctype html"), ("t.Json", "{"), ("t.HtM", "<!")])
def test_the_trace_suffix_is_read_in_any_case(
    tmp_path: Path, name: str, start: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / name
    status = main(
        ["--device", "sim", "--inputs", "2", "--size", "64", "--kernel-ms", "0", "--trace", str(target)]
    )
    assert status == 0, capsys.readouterr()
    assert target.read_text(encoding="utf-8").lower().startswith(start)
    assert f"written to {target}" in capsys.readouterr().out


def test_the_demo_trace_keeps_the_documented_number_of_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "t.json"
    status = main(
        ["--device", "sim", "--inputs", "2", "--size", "64", "--kernel-ms", "0", "--trace", str(target)]
    )
    assert status == 0
    doc = json.loads(target.read_text())
    assert doc["otherData"]["limit"] == cli.TRACE_LIMIT == 100_000
    assert doc["otherData"]["dropped"] == 0
    assert "the last 100,000 events are kept" in " ".join(cli.build_parser().format_help().split())


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child is POSIX")
def test_ctrl_c_cancels_the_batch_drains_it_and_exits_130() -> None:
    proc = subprocess.Popen(
        python(  # SIGINT raises KeyboardInterrupt in the child even where this process ignores it
            "-m",
            "trio_cuda",
            "demo",
            "--device",
            "sim",
            "--inputs",
            "1000000",
            "--size",
            "256",
            "--kernel-ms",
            "1",
            "--deadline",
            "none",
            "--progress",
            "lines",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # wait until the batch is under way
        seen.append(line)
        if line.startswith("progress: "):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    text = "".join(seen) + out
    assert proc.returncode == 130, (text, err)
    assert "Traceback" not in err
    assert "Ctrl-C: cancelling the rest of the batch" in text
    assert re.search(r"^interrupted: \d+ done", text, re.MULTILINE), text
    assert "nothing leaked" in text


def test_a_reader_that_goes_away_is_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_cuda", "demo", *QUICK, "-v", "--trace", str(tmp_path / "t.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(b"trio_cuda batch job: ")
    proc.stdout.close()  # as `demo | head -1` does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert b"Traceback" not in err
    assert b"BrokenPipeError" not in err
    assert (tmp_path / "t.json").stat().st_size > 0  # the job went on to its end


# --------------------------------------------------------------------------- the printer


def test_plain_progress_lines_every_eighth_and_when_completions_are_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    printer = Output(out, io.StringIO(), progress="lines")
    printer.start_progress(100)
    for done in range(1, 101):
        printer.completed(done, 3)
    lines = out.getvalue().splitlines()
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [13, 26, 39, 52, 65, 78, 91, 100]
    assert all(line.startswith("progress: ") and ", 3 in flight, " in line for line in lines)

    monkeypatch.setattr(output, "LINE_INTERVAL", 0.0)  # every completion is "slow"
    out = io.StringIO()
    printer = Output(out, io.StringIO(), progress="lines")
    printer.start_progress(100)
    for done in range(1, 6):
        printer.completed(done, 1)
    assert len(out.getvalue().splitlines()) == 5

    out = io.StringIO()
    printer = Output(out, io.StringIO(), progress="none")
    printer.start_progress(10)
    for done in range(1, 11):
        printer.completed(done, 0)
    assert out.getvalue() == ""


def test_the_printer_restores_the_logger_on_an_error() -> None:
    logger = logging.getLogger("trio_cuda")
    handlers = list(logger.handlers)
    err = io.StringIO()
    with pytest.raises(RuntimeError, match="boom"), Output(io.StringIO(), err, verbose=2):
        assert logger.level == logging.DEBUG
        logger.debug("seen at -vv")
        raise RuntimeError("boom")
    assert logger.level == logging.NOTSET
    assert logger.handlers == handlers
    assert err.getvalue() == "[trio_cuda DEBUG] seen at -vv\n"
    with Output(io.StringIO(), err, verbose=1):
        logger.debug("not at -v")
    assert "not at -v" not in err.getvalue()
    with pytest.raises(ValueError, match="^progress: expected 'bar', 'lines' or 'none', got 'fancy'$"):
        Output(io.StringIO(), io.StringIO(), progress="fancy")


# --------------------------------------------------------------------------- the package


#: trio_cuda/_demo's modules, each importing only modules after it (its docstring's order)
DEMO_ORDER = ("cli", "ray", "shard", "batch", "output")


def _relative_imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of each relative import in ``path``; ``from . import x`` is (1, "x")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            names = [node.module] if node.module else [a.name for a in node.names]
            found += [(node.level, name) for name in names]
    return found


def test_the_demo_package_imports_one_way() -> None:
    package = ROOT / "trio_cuda" / "_demo"
    assert sorted(p.stem for p in package.glob("*.py")) == sorted(("__init__", *DEMO_ORDER))
    assert _relative_imports(package / "__init__.py") == []
    for rank, name in enumerate(DEMO_ORDER):
        inside = [m for level, m in _relative_imports(package / f"{name}.py") if level == 1]
        assert inside or name == DEMO_ORDER[-1], name  # the scan sees each module's imports
        below = set(DEMO_ORDER[rank + 1 :])
        assert set(inside) <= below, f"{name} imports {sorted(set(inside) - below)}, not below it"


def test_the_library_does_not_import_the_demo() -> None:
    """Only ``__main__`` imports the demo (when it builds its parser or runs it), and
    ``import trio_cuda, trio_cuda.__main__`` loads none of it."""
    importers = []
    for path in sorted((ROOT / "trio_cuda").rglob("*.py")):
        if path.parent.name != "_demo" and any("_demo" in m for _, m in _relative_imports(path)):
            importers.append(path.name)
    assert importers == ["__main__.py"]
    code = (
        "import sys, trio_cuda, trio_cuda.__main__\n"
        "print(sorted(n for n in sys.modules if n.startswith('trio_cuda._demo')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
