"""examples/lifetimes: every lesson runs, its rule holds, and it writes its timeline page.

Each lesson is run in-process through its ``main(argv)`` (a fresh SimDevice
each), on the simulator; the test checks the exit status, the lines of output
that show the rule held, and the page. One lesson also runs as a program,
leaving nothing in the folder it ran in (its page goes to a new temporary
folder); a GPU that is not there is one error line and exit status 2. On a
real GPU (marked ``gpu``, skipped cleanly without one) the lessons that support
it run with ``--device cuda``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trio_cuda._backends import probe_cuda

LESSONS_DIR = Path(__file__).resolve().parents[2] / "examples" / "lifetimes"
sys.path.insert(0, str(LESSONS_DIR))  # the lessons import their shared _lesson module

# each lesson, and words of its output that show its rule held
EXPECTED: dict[str, list[str]] = {
    "01_retention": [
        "ok: the submission took its two leases (x read, y write) before returning",
        "ok: x's memory stays: the submission owns it",
        "ok: x was freed only after the kernel had run",
    ],
    "02_leases": [
        "ok: B got one device-side wait, on A's completion marker",
        "ok: B ran after A, not beside it",
        "ok: reads never conflict with reads: no wait",
        'conflicts="error": AccessConflictError: axpy: read-after-write conflict',
        "ok: B raised AccessConflictError: nothing submitted",
    ],
    "03_cancel_while_running": [
        "ok: Cancelled came promptly",
        "leases still held: 2",
        "ok: closing them freed nothing",
        "after the device finished: leases 0, memory freed (0 live)",
        "ok: the handoff task retired it",
    ],
    "04_drop_a_future": [
        "ok: the submission and its lease on y stay",
        "ok: the dropped work really ran",
        "the scope's exit raised ExceptionGroup(",
        "ok: the forgotten error surfaced at scope exit, in an ExceptionGroup",
    ],
    "05_scope_exit_under_cancellation": [
        "ok: the exit waited, shielded, for both kernels",
        "ok: every free came after the last retirement",
        "ResourceWarning: trio_cuda scope exited with 1 submission(s) still in flight",
        "ok: the unfinished submission was quarantined",
        "ok: z is still leaked after its kernel ended: never freed",
    ],
    "06_partial_error": [
        "submit raised at once",
        "ok: the enqueued part keeps its leases on x and y",
        "ok: x's memory stays while the axpy may read it",
        "ok: the axpy ran: y = 2 * x",
    ],
    "07_unknown_completion": [
        "run(axpy(x, y)) raised CompletionUnknownError",
        "ok: the submission and its leases were quarantined",
        "ok: work on y fails before anything is enqueued",
        "ok: x and y are leaked for good; z was freed",
    ],
    "08_graphs": [
        "ok: capturing ran nothing",
        "ok: x's memory stays: the graph will replay on it",
        "ok: the graph is closed but kept while replays run",
        "ok: the graph was destroyed after its last replay",
        "ok: each replay ran both kernels: y = 2x + 2",
    ],
    "09_close_an_array_in_use": [
        "x.closed = True",
        "y.closed = True",
        "ok: no memory was freed: every kernel still uses its array",
        "ok: each array was freed only after its kernel had run",
    ],
    "10_host_closures": [
        "awaited a short fill: retired by the waiter",
        "retired by the handoff after",
        "ok: the second kernel ran only after the closure",
        "ok: the closure ran on the Trio loop's thread",
    ],
    "11_disjoint_chunks": [
        "ok: disjoint chunks never conflict: no cross-stream wait",
        "ok: they ran at once",
        "ok: the overlapping view waited, device-side, for the other",
        "y[1024:] was refused",
    ],
    "12_tile_kernels": [
        "B's leases, from the tile kernel's loads and stores: x read, y write",
        "ok: B waits on the device for A (x), C for B (y)",
        "ok: closing x and y freed nothing: B and C still use them",
        "ok: x and y were freed only after A, B and C had run",
        "ok: C read what B wrote from what A wrote",
        "KernelArgumentError: double: argument 0 (x) and argument 1 (y) overlap in memory",
    ],
}
#: lessons that need an optional package, and which
NEEDS = {"12_tile_kernels": "cuda.tile"}
SIM_ONLY = {"07_unknown_completion"}


def load(name: str) -> Any:
    path = LESSONS_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"lesson_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{name} needs {NEEDS[name]}: pip install 'trio_cuda[tile]'")
    rc = load(name).main(argv)
    return rc, capsys.readouterr().out


def test_every_lesson_is_listed() -> None:
    found = sorted(p.stem for p in LESSONS_DIR.glob("[0-9][0-9]_*.py"))
    assert found == sorted(EXPECTED)
    readme = (LESSONS_DIR / "README.md").read_text()
    assert all(f"{name}.py" in readme for name in found)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_lesson_on_the_simulator(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(name, ["--out", str(tmp_path)], capsys)
    assert rc == 0, out
    assert "backend: sim" in out
    assert "   FAILED: " not in out
    assert "ok: the simulator's memcheck saw no use of freed memory" in out
    assert out.rstrip().endswith("the rule held: every check passed"), out
    for line in EXPECTED[name]:
        assert line in out, f"{line!r} missing from:\n{out}"
    page = tmp_path / f"{name}.html"
    assert f"timeline: {page}" in out
    assert page.read_text(encoding="utf-8").lower().startswith("<!doctype html")


def test_trace_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run("06_partial_error", ["--trace", str(tmp_path / "sub" / "t.json")], capsys)
    assert rc == 0
    assert (tmp_path / "sub" / "t.json").read_text().startswith("{")
    rc, out = run("06_partial_error", ["--no-trace", "--out", str(tmp_path / "none")], capsys)
    assert rc == 0
    assert "timeline:" not in out
    assert not (tmp_path / "none").exists()
    for argv in (
        ["--device", "gpu0"],
        ["--device", "cuda:abc"],
        ["--device", "cuda:-1"],
        ["--trace", "x.txt"],
    ):
        with pytest.raises(SystemExit) as exc:
            run("06_partial_error", argv, capsys)
        assert exc.value.code == 2


def test_a_broken_rule_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import _lesson

    async def lesson(L: Any) -> None:
        L.check(True, "this held")
        L.check(False, "this did not")

    rc = _lesson.run_lesson(lesson, ["--no-trace"], file="99_broken.py", doc="Broken.", kernel_time=0.0)
    out = capsys.readouterr().out
    assert rc == 1
    assert "   FAILED: this did not" in out
    assert "the rule did NOT hold: 1 check(s) failed" in out


def test_sim_only_lesson_falls_back_from_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run("07_unknown_completion", ["--device", "cuda", "--no-trace"], capsys)
    assert rc == 0, out
    assert "needs the simulator" in out
    assert "backend: sim" in out


def test_a_lesson_runs_as_a_program_and_leaves_the_current_folder_alone(tmp_path: Path) -> None:
    script = LESSONS_DIR / "03_cancel_while_running.py"
    here, temp = tmp_path / "here", tmp_path / "temp"
    here.mkdir()
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}  # where tempfile makes the page's folder
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=here,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the rule held" in done.stdout
    assert list(here.iterdir()) == []  # nothing written where it ran
    [line] = [line for line in done.stdout.splitlines() if line.startswith("timeline: ")]
    page = Path(line.removeprefix("timeline: ").rsplit(" (", 1)[0])
    assert page.parent.parent == temp, page
    assert page.name == "03_cancel_while_running.html"
    assert page.read_text(encoding="utf-8").lower().startswith("<!doctype html")


def test_without_options_each_run_gets_its_own_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    pages = []
    for _ in range(2):
        rc, out = run("06_partial_error", [], capsys)
        assert rc == 0, out
        [line] = [line for line in out.splitlines() if line.startswith("timeline: ")]
        pages.append(Path(line.removeprefix("timeline: ").rsplit(" (", 1)[0]))
    assert pages[0] != pages[1]
    assert all(p.exists() and p.parent.parent == tmp_path for p in pages)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.parent.name for p in pages)


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import trio_cuda._backends as backends

    reason = "no CUDA driver: libcuda.so.1 not found"
    monkeypatch.setattr(backends, "probe_cuda", lambda: backends.CudaProbe(False, reason=reason))


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_gpu_that_is_not_there_is_one_line_and_exit_status_2(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_gpu(monkeypatch)
    rc = load("03_cancel_while_running").main(["--device", device, "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.out == ""  # nothing ran
    assert captured.err.splitlines() == [
        f"03_cancel_while_running.py: error: --device {device}: no CUDA driver: libcuda.so.1 not found; "
        "--device sim runs the lesson on the simulator"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_gpu_that_is_not_there_as_a_program(tmp_path: Path) -> None:
    if probe_cuda().available:
        pytest.skip("a CUDA device answers here")
    done = subprocess.run(
        [sys.executable, str(LESSONS_DIR / "01_retention.py"), "--device", "cuda:0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"01_retention.py: error: --device cuda:0: {probe_cuda().reason}; "), line
    assert list(tmp_path.iterdir()) == []


def test_a_folder_as_the_page_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "page.html"
    folder.mkdir()
    with pytest.raises(SystemExit) as exc:
        run("06_partial_error", ["--trace", str(folder)], capsys)
    assert exc.value.code == 2
    assert f"--trace: expected a file name, not a folder, got {str(folder)!r}" in capsys.readouterr().err
    rc, _ = run("06_partial_error", ["--trace", str(tmp_path / "PAGE.HTML")], capsys)
    assert rc == 0
    assert (tmp_path / "PAGE.HTML").read_text(encoding="utf-8").lower().startswith("<!doctype html")


_PROBE = probe_cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}")
@pytest.mark.parametrize("name", sorted(set(EXPECTED) - SIM_ONLY))
def test_lesson_on_a_gpu(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(name, ["--device", "cuda", "--out", str(tmp_path)], capsys)
    assert rc == 0, out
    assert "backend: cuda" in out
    assert "   FAILED: " not in out
    assert (tmp_path / f"{name}.html").read_text(encoding="utf-8").lower().startswith("<!doctype html")
