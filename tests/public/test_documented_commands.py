"""The shell commands that README.md and docs/*.rst show, run as they are written.

Every line of a code block marked ``sh``, ``bash``, ``shell`` or ``console``
(there, the lines after a ``$`` prompt) is a command. Each one is either run or
excluded by one of the named rules of :data:`RULES`, so that none is left out
silently. A command that is run:

* runs in a fresh folder holding a copy of ``examples/`` and, where it names
  ``my_job.py``, a tiny program that opens a scope and accepts any arguments;
* its interpreter (``python``, ``python3``, ``.venv/bin/python``) is the one
  running the tests, its words exactly as written (comments dropped);
* must exit with status 0 within its timeout, write every file its options
  name (``-o``, ``--output``, ``--trace``) and nothing else in its folder;
  a page a lesson writes elsewhere (the ``timeline:`` line) must exist.

A backend is not forced: where no GPU answers, "auto" is the simulator.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from trio_cuda._backends import probe_cuda

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.rst"))]
SHELLS = ("sh", "bash", "shell", "console")

#: a program the commands may name: it opens a scope, uploads and downloads, and takes any arguments
MY_JOB = """\
import sys

import numpy as np
import trio

import trio_cuda


async def main():
    async with trio_cuda.open_scope() as gpu:
        x = await gpu.to_device(np.arange(16, dtype=np.float32))
        assert (await gpu.to_host(x)).sum() == 120
    print("my_job: ran with", sys.argv[1:])


trio.run(main)
"""


@dataclass(frozen=True)
class Command:
    where: str  #: page and line
    text: str  #: as written, continuation lines joined


def _blocks(path: Path) -> list[tuple[int, list[str], bool]]:
    """(first line number, lines, console) of each shell code block of a page."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if path.suffix == ".md":
            m = re.fullmatch(r"\s*```\s*(\w+)\s*", line)
            if m and m.group(1) in SHELLS:
                j = i + 1
                while j < len(lines) and not lines[j].strip().startswith("```"):
                    j += 1
                blocks.append((i + 2, lines[i + 1 : j], m.group(1) == "console"))
                i = j
        else:
            m = re.fullmatch(r"(\s*)\.\. code-block::\s*(\w+)\s*", line)
            if m and m.group(2) in SHELLS:
                indent = len(m.group(1))
                j = i + 1
                while j < len(lines) and re.match(r"\s+:\w[\w-]*:", lines[j]):  # the block's options
                    j += 1
                body_start = j
                while j < len(lines) and (
                    not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
                ):
                    j += 1
                body = lines[body_start:j]
                blocks.append((body_start + 1, body, m.group(2) == "console"))
                i = j - 1
        i += 1
    return blocks


def documented_commands() -> list[Command]:
    return [c for path in PAGES for c in commands_of(path)]


def commands_of(path: Path) -> list[Command]:
    """The commands of a page's shell blocks, where each starts."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for first, body, console in _blocks(path):
        pending, start = "", 0
        for n, raw in enumerate(body, first):
            line = raw.strip()
            if not pending:
                if console:
                    if not line.startswith("$ "):
                        continue  # the command's output
                    line = line[2:]
                if not line or line.startswith("#"):
                    continue
                start = n
            pending = f"{pending} {line}" if pending else line
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip()
                continue
            found.append(Command(f"{name}:{start}", pending))
            pending = ""
    return found


def _words(text: str) -> list[str]:
    return shlex.split(text, comments=True)


def _is_python(word: str) -> bool:
    return re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", word) is not None


def _runs_trio_cuda(words: list[str]) -> bool:
    """``python -m trio_cuda ...`` or ``python examples/...``."""
    if not words or not _is_python(words[0]):
        return False
    return words[1:3] == ["-m", "trio_cuda"] or (len(words) > 1 and words[1].startswith("examples/"))


_GPU = probe_cuda()


def _ray_missing() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return True
    return False


@dataclass(frozen=True)
class Rule:
    """A named rule for the commands it ``applies`` to: ``exclude`` (never run
    here), ``skip`` (not run on this machine: no GPU, no Ray) or ``slow`` (run,
    marked slow). The first rule that applies decides; none: the command runs."""

    name: str
    applies: Callable[[Command], bool]
    reason: str
    action: str


RULES = [
    Rule(
        "installs",
        lambda c: re.search(r"\bpip\b.*\binstall\b|-m venv\b", c.text) is not None,
        "installs packages or makes a virtual environment: this test runs in the environment it has",
        "exclude",
    ),
    Rule(
        "another program",
        lambda c: not _runs_trio_cuda(_words(c.text)),
        "runs neither python -m trio_cuda nor an examples/ script (e.g. ray start)",
        "exclude",
    ),
    Rule(
        "needs a GPU",
        lambda c: re.search(r"--device[ =]cuda", c.text) is not None and not _GPU.available,
        f"asks for a CUDA device, and none answers here ({_GPU.reason or 'ok'})",
        "skip",
    ),
    Rule(
        "needs Ray",
        lambda c: "--ray" in _words(c.text) and _ray_missing(),
        "starts a Ray cluster, and Ray is not installed here",
        "skip",
    ),
    Rule(
        "starts Ray",
        lambda c: "--ray" in _words(c.text),
        "starts a local Ray cluster and workers: about 20 s",
        "slow",
    ),
]


def rule_for(command: Command) -> Rule | None:
    return next((r for r in RULES if r.applies(command)), None)


def _params() -> list[object]:
    params = []
    for c in documented_commands():
        rule = rule_for(c)
        marks = [pytest.mark.slow] if rule is not None and rule.action == "slow" else []
        params.append(pytest.param(c, id=f"{c.where}: {c.text}", marks=marks))
    return params


#: the options whose value is a file the command writes
OUTPUT_OPTIONS = ("-o", "--output", "--trace")


def outputs(words: list[str]) -> list[str]:
    """The files a command's options name (``-o X``, ``--output=X``, ``--trace X``)."""
    found = []
    for i, word in enumerate(words):
        if word in OUTPUT_OPTIONS and i + 1 < len(words):
            found.append(words[i + 1])
        elif word.startswith(("--output=", "--trace=")):
            found.append(word.split("=", 1)[1])
    return found


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", _params())
def test_documented_command(command: Command, tmp_path: Path) -> None:
    rule = rule_for(command)
    if rule is not None and rule.action in ("exclude", "skip"):
        pytest.skip(f"{rule.name}: {rule.reason}")
    words = _words(command.text)
    operators = {"&&", "||", "|", ";", ">", ">>", "<", "&"}
    assert not operators & set(words), f"{command.where}: a shell pipeline: give it a rule to run it"
    here, temp = tmp_path / "here", tmp_path / "temp"
    here.mkdir()
    temp.mkdir()
    shutil.copytree(ROOT / "examples", here / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    if "my_job.py" in words:
        (here / "my_job.py").write_text(MY_JOB)
    before = _files(here)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if rule is None:  # Ray keeps its sockets under the temporary folder: a short path
        env["TMPDIR"] = str(temp)
    timeout = 180 if rule is not None and rule.action == "slow" else 60
    proc = subprocess.run(
        [sys.executable, *words[1:]],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    said = f"{command.where}: {command.text}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, said
    assert "Traceback" not in proc.stderr, said
    named = outputs(words)
    for name in named:
        path = here / name
        assert path.is_file(), f"{name} was not written\n{said}"
        assert path.stat().st_size > 0, f"{name} is empty\n{said}"
    new = _files(here) - before
    assert new == set(named), f"files written besides the named ones: {sorted(new - set(named))}\n{said}"
    for line in proc.stdout.splitlines():
        if line.startswith("timeline: "):  # a lesson's page, written outside the folder
            page = Path(line.removeprefix("timeline: ").rsplit(" (", 1)[0])
            page = page if page.is_absolute() else here / page
            assert page.is_file(), said


def test_the_commands_are_found_and_each_is_run_or_excluded_by_a_rule() -> None:
    commands = documented_commands()
    texts = [c.text for c in commands]
    # the forms the pages show, found where they are
    assert any(re.fullmatch(r"python -m trio_cuda trace my_job\.py -o run\.html\s*#.*", t) for t in texts), (
        texts
    )
    assert "python -m trio_cuda trace my_job.py --its-args -o run.html" in texts
    assert "python -m trio_cuda demo --trace demo.json" in texts
    assert any(t.startswith("python examples/lifetimes/") for t in texts), texts
    assert len(set(texts)) >= 8
    run = [c for c in commands if rule_for(c) is None or rule_for(c).action == "slow"]  # type: ignore[union-attr]
    assert len(run) >= 5, run
    for c in commands:
        rule = rule_for(c)
        if rule is not None and rule.name == "installs":
            assert re.search(r"pip|venv", c.text), c
    # the rules are checked by name: a command that installs is never run, nor another program
    assert rule_for(Command("x", "pip install 'trio_cuda[ray]'")).name == "installs"  # type: ignore[union-attr]
    assert rule_for(Command("x", "python3 -m venv .venv && .venv/bin/python examples/batch_job.py")).name == (  # type: ignore[union-attr]
        "installs"
    )
    assert rule_for(Command("x", "ray start --head --port=6379")).name == "another program"  # type: ignore[union-attr]
    assert rule_for(Command("x", ".venv/bin/python -m trio_cuda info")) is None


def test_the_block_reader_reads_both_markups(tmp_path: Path) -> None:
    md = tmp_path / "page.md"
    md.write_text(
        "text\n```sh\npython -m trio_cuda info   # a comment\n\npython a \\\n  b\n```\n"
        "```python\nx = 1\n```\n"
    )
    assert [(line, body) for line, body, _ in _blocks(md)] == [
        (3, ["python -m trio_cuda info   # a comment", "", "python a \\", "  b"])
    ]
    rst = tmp_path / "page.rst"
    rst.write_text(
        "Title\n\n.. code-block:: console\n   :class: x\n\n   $ python -m trio_cuda demo\n   output\n"
        "   $ python examples/x.py\n\nafter\n\n.. code-block:: python\n\n   $ not a shell\n"
    )
    [(_, body, console)] = _blocks(rst)
    assert console
    assert [b.strip() for b in body if b.strip()] == [
        "$ python -m trio_cuda demo",
        "output",
        "$ python examples/x.py",
    ]
    assert commands_of(rst) == [
        Command("page.rst:6", "python -m trio_cuda demo"),
        Command("page.rst:8", "python examples/x.py"),
    ]
    assert commands_of(md) == [
        Command("page.md:3", "python -m trio_cuda info   # a comment"),
        Command("page.md:5", "python a b"),
    ]
    assert outputs(_words("python -m trio_cuda trace s.py -o a.html --trace=b.json")) == ["a.html", "b.json"]
