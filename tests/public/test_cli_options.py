"""``python -m trio_cuda trace``'s options, run as a subprocess.

Every option is checked before the program runs: a bad one is one argparse
error line (naming the option, what was expected and what was given) with exit
status 2, no traceback, and the program never started. Where the trace cannot
be written after all (its folder went away while the program ran), that is one
error line too, and the program's own status or 1.

``-o`` goes before the script or ends the command line (the form the README
shows); when trace's ``-o`` comes before the script, or ``--`` ends trace's
options, a trailing ``-o`` is the program's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

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


# --------------------------------------------------------------------------- where -o goes


def _ran(tmp_path: Path) -> list[str]:
    args: list[str] = json.loads((tmp_path / "ran.json").read_text())
    return args


def _written(proc: subprocess.CompletedProcess[str], out: Path) -> None:
    assert proc.returncode == 0, proc.stderr
    assert f"written to {out.name}" in proc.stderr or f"written to {out}" in proc.stderr, proc.stderr
    text = out.read_text(encoding="utf-8")
    if out.suffix.lower() == ".json":
        assert json.loads(text)["traceEvents"]
    else:
        assert text.lower().startswith("<!doctype html")


@pytest.mark.parametrize(
    ("args", "theirs", "out"),
    [
        (["PROG", "-o", "run.html"], [], "run.html"),  # the README's form
        (["PROG", "--its-args", "-o", "run.html"], ["--its-args"], "run.html"),  # docs/traces.rst's
        (["-o", "run.html", "PROG", "--its-args"], ["--its-args"], "run.html"),
        (["PROG", "a", "--output", "run.json"], ["a"], "run.json"),
        (["PROG", "a", "--output=run.json"], ["a"], "run.json"),
        (["--limit", "50", "PROG", "x", "-o", "run.json"], ["x"], "run.json"),
        (["-o", "run.json", "--", "PROG", "--", "-o", "x"], ["--", "-o", "x"], "run.json"),
        (["--output=run.json", "PROG", "-o", "its.json"], ["-o", "its.json"], "run.json"),
        (["--out", "run.json", "PROG"], [], "run.json"),  # argparse's prefix of --output
        (["PROG", "-o", "RUN.HTML"], [], "RUN.HTML"),  # any case, as Trace.write takes
        (["PROG", "-o", "run.Json"], [], "run.Json"),
        (["PROG", "-o", "run.htm"], [], "run.htm"),
    ],
)
def test_o_goes_before_the_script_or_ends_the_command_line(
    tmp_path: Path, program: str, args: list[str], theirs: list[str], out: str
) -> None:
    proc = _trace(tmp_path, *[program if a == "PROG" else a for a in args])
    _written(proc, tmp_path / out)
    assert _ran(tmp_path) == theirs
    others = {p.name for p in tmp_path.iterdir()} - {"prog.py", "ran.json", out}
    assert others == set(), others  # the program's own -o was not written by trace


def test_a_trailing_o_is_the_programs_when_trace_has_its_own(tmp_path: Path, program: str) -> None:
    proc = _trace(tmp_path, "-o", "run.json", program, "-o", "its.html")
    _written(proc, tmp_path / "run.json")
    assert _ran(tmp_path) == ["-o", "its.html"]
    assert not (tmp_path / "its.html").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["PROG"], "before SCRIPT or as the last two arguments ('-o OUT'), got none"),
        (["PROG", "-o"], "before SCRIPT or as the last two arguments ('-o OUT'), got none"),
        (["PROG", "-o", "run.html", "--more"], "before SCRIPT or as the last two arguments"),
        (["--", "PROG", "-o", "run.html"], "before '--' (what follows '--' is SCRIPT and its arguments)"),
    ],
)
def test_without_a_trace_o_the_command_is_refused(
    tmp_path: Path, program: str, args: list[str], expected: str
) -> None:
    proc = _trace(tmp_path, *[program if a == "PROG" else a for a in args])
    line = _refused(proc, tmp_path, "argument -o/--output: expected OUT.html or OUT.json", expected)
    assert not (tmp_path / "run.html").exists(), line


def test_a_trailing_o_with_a_bad_name_is_checked_as_the_traces_own(tmp_path: Path, program: str) -> None:
    proc = _trace(tmp_path, program, "-o", "run.txt")
    _refused(proc, tmp_path, "-o/--output", "ending in .html or .json", "'run.txt'")
    (tmp_path / "out.json").mkdir()
    proc = _trace(tmp_path, program, "--output", "out.json")
    _refused(proc, tmp_path, "-o/--output", "a file name, not a folder", "'out.json'")


def test_the_rule_is_in_the_help(tmp_path: Path) -> None:
    proc = _trace(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: trio-cuda trace [-h] [-o OUT] [--limit N] [--] SCRIPT [ARGS ...] [-o OUT]" in proc.stdout
    help_text = " ".join(proc.stdout.split())
    assert "a final '-o OUT' (or '--output OUT', '--output=OUT') that ends the command line is trace's" in (
        help_text
    )
    assert "trio-cuda trace -o run.html my_job.py -o its.json # my_job.py gets '-o its.json'" in help_text


@pytest.mark.parametrize(
    ("argv", "parser_argv", "theirs"),
    [
        (["info"], ["info"], None),
        (["--version"], ["--version"], None),
        (["trace"], ["trace"], []),
        (["trace", "-o", "a.json"], ["trace", "-o", "a.json"], []),
        (["trace", "s.py", "-o", "a.json"], ["trace", "-o", "a.json", "--", "s.py"], []),
        (
            ["trace", "-oa.json", "s.py", "-o", "b.json"],
            ["trace", "-oa.json", "--", "s.py"],
            ["-o", "b.json"],
        ),
        (["trace", "--limit", "-3", "s.py"], ["trace", "--limit", "-3", "--", "s.py"], []),
        (["trace", "--limit=3", "s.py", "-v"], ["trace", "--limit=3", "--", "s.py"], ["-v"]),
        (["trace", "-h", "s.py"], ["trace", "-h", "--", "s.py"], []),
        (["trace", "s.py", "-h"], ["trace", "--", "s.py"], ["-h"]),
        (["trace", "--", "-s.py", "-o", "a.json"], ["trace", "--", "-s.py"], ["-o", "a.json"]),
        (
            ["trace", "s.py", "-o", "a.json", "-o", "b.json"],
            ["trace", "-o", "b.json", "--", "s.py"],
            ["-o", "a.json"],
        ),
    ],
)
def test_how_the_command_line_is_split(
    argv: list[str], parser_argv: list[str], theirs: list[str] | None
) -> None:
    from trio_cuda.__main__ import split_trace_argv

    got_argv, got_theirs, _ = split_trace_argv(argv)
    assert (got_argv, got_theirs) == (parser_argv, theirs)
