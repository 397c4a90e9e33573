"""``python -m trio_cuda trace``'s options, run as a subprocess.

Every option is checked before the program runs: a bad one is one argparse
error line (naming the option, what was expected and what was given) with exit
status 2, no traceback, and the program never started. Where the trace cannot
be written after all (its folder went away while the program ran), that is one
error line too, and the program's own status or 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# writes what it was given to RAN (so a test can tell it ran), opens a scope, and exits 0
PROGRAM = """\
import json, os, sys
import numpy as np, trio, trio_cuda

with open(os.environ["RAN"], "w") as f:
    json.dump(sys.argv[1:], f)

async def main():
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = await gpu.to_device(np.arange(8, dtype=np.float32))
        await gpu.to_host(x)

trio.run(main)
"""


def _trace(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["RAN"] = str(tmp_path / "ran.json")
    return subprocess.run(
        [sys.executable, "-m", "trio_cuda", "trace", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=False,
    )


@pytest.fixture
def program(tmp_path: Path) -> str:
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    return str(path)


def _refused(proc: subprocess.CompletedProcess[str], tmp_path: Path, *named: str) -> str:
    """The one error line of a refused command line, after checking how it was refused."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "ran.json").exists(), "the program ran before its options were checked"
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    [line] = errors
    assert line.startswith("trio-cuda trace: error: argument "), line
    for text in named:
        assert text in line, (text, line)
    return line


@pytest.mark.parametrize(
    ("make", "option", "expected"),
    [
        (lambda d: d / "no" / "such" / "folder" / "run.json", "-o", "a file in an existing folder"),
        (lambda d: d / "prog.py" / "run.json", "-o", "a file in an existing folder"),  # a file as folder
        (lambda d: d / "run.txt", "-o", "ending in .html or .json"),
        (lambda d: d / "a_folder.json", "-o", "a file name, not a folder"),
    ],
    ids=["missing-folder", "file-as-folder", "suffix", "folder-as-output"],
)
def test_a_bad_output_is_refused_before_the_program_runs(
    tmp_path: Path, program: str, make: object, option: str, expected: str
) -> None:
    (tmp_path / "a_folder.json").mkdir()
    out = make(tmp_path)  # type: ignore[operator]
    line = _refused(_trace(tmp_path, "-o", str(out), program), tmp_path, option, expected, repr(str(out)))
    assert "--output" in line  # argparse names the option by both its spellings


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_in_a_folder_that_cannot_be_written_is_refused(tmp_path: Path, program: str) -> None:
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        proc = _trace(tmp_path, "-o", str(folder / "run.json"), program)
    finally:
        folder.chmod(0o700)
    _refused(proc, tmp_path, "-o", "a folder it can write to")


@pytest.mark.parametrize("limit", ["0", "-3", "many", "1.5", ""])
def test_a_bad_limit_is_refused_before_the_program_runs(tmp_path: Path, program: str, limit: str) -> None:
    proc = _trace(tmp_path, "--limit", limit, "-o", str(tmp_path / "run.json"), program)
    _refused(proc, tmp_path, "--limit", "expected an integer >= 1", f"got {limit!r}")
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("script", ["missing.py", "."], ids=["missing", "folder"])
def test_a_bad_script_is_refused(tmp_path: Path, script: str) -> None:
    proc = _trace(tmp_path, "-o", str(tmp_path / "run.json"), script)
    _refused(proc, tmp_path, "SCRIPT", "expected a Python file", repr(script))


def test_the_options_go_before_the_script_and_its_arguments_after_it(tmp_path: Path, program: str) -> None:
    out = tmp_path / "run.json"
    proc = _trace(tmp_path, "--limit", "3", "-o", str(out), program, "--its-arg", "-o", "theirs.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "ran.json").read_text()) == ["--its-arg", "-o", "theirs.json"]
    doc = json.loads(out.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    assert 0 < len(events) <= 3  # --limit kept the last 3
    assert f"written to {out}" in proc.stderr
    assert "0 dropped" not in proc.stderr, proc.stderr
    assert not (tmp_path / "theirs.json").exists()


def test_an_output_that_cannot_be_written_after_the_run_is_one_error_line(tmp_path: Path) -> None:
    # the folder was there when the options were checked; the program removes it
    folder = tmp_path / "out"
    folder.mkdir()
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM + f"import shutil\nshutil.rmtree({str(folder)!r})\n")
    out = folder / "run.json"
    proc = _trace(tmp_path, "-o", str(out), str(prog))
    assert (tmp_path / "ran.json").exists()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert line.startswith(f"trio-cuda trace: error: -o: could not write {str(out)!r}: "), line
