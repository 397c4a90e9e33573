"""The batch job (examples/batch_job.py, ``python -m trio_cuda demo``) on the simulator."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trio_cuda._demo import BatchConfig, main, make_kernels, run_batch

ROOT = Path(__file__).resolve().parent.parent

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


def test_bad_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--inputs", "0"])
    assert exc.value.code == 2
    assert "--inputs" in capsys.readouterr().err
