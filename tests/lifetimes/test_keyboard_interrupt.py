"""Ctrl-C landing inside the runtime's own bookkeeping never loses work.

Trio raises ``KeyboardInterrupt`` wherever the program happens to be when
SIGINT arrives, unless that code is KI-protected. The runtime protects the
code that moves a submission between its states (marking, retiring, freeing):
a Ctrl-C there is delivered at the next checkpoint instead, so the scope still
knows every submission, its exit drains and frees everything, and nothing
hangs. Each case runs in a subprocess, sends SIGINT from inside one driver
call at a time, and must end promptly with the interrupt reported, the
simulator's memcheck clean and every allocation freed.

A scope's exit waits for the device even after a Ctrl-C (Trio delivers one at
the main task's blocking waits even inside a shield): the first is re-raised
once everything drained, a second stops the waiting and quarantines what is
still in flight, with a ``ResourceWarning``. A Ctrl-C during a graph capture
never leaves the stream capturing. ``tests/helpers/interrupts.py`` places the
interrupts (at random, or at given driver calls) and checks each trial; the
slow variant runs many more trials::

    pytest -m slow tests/lifetimes/test_keyboard_interrupt.py -s          # 3,000 trials
    TRIO_CUDA_INTERRUPT_TRIALS=500 TRIO_CUDA_INTERRUPT_FIRST=10000 \\
        pytest tests/lifetimes/test_keyboard_interrupt.py -k many -s

The children get Ctrl-C whatever this process inherited: started with SIGINT
ignored (in the background by a non-interactive shell), a process passes that
on, and Python and Trio then leave SIGINT ignored; each child restores its
default first (``tests/helpers/sigint.py``; the harness does so itself).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.sigint import ignoring_sigint, python

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import json, signal, sys
    import numpy as np, trio, trio_cuda
    from trio_cuda import ops
    from trio_cuda._backends.sim.context import SimContext

    point, nth = sys.argv[1], int(sys.argv[2])
    original = getattr(SimContext, point)
    calls = 0

    def interrupting(self, *args, **kwargs):
        global calls
        calls += 1
        if calls == nth:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, right inside the runtime's bookkeeping
        return original(self, *args, **kwargs)

    setattr(SimContext, point, interrupting)
    sim = trio_cuda.testing.SimDevice(kernel_time=0.001)

    async def main():
        async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
            async def worker(i):
                x = await gpu.to_device(np.arange(256, dtype=np.float32))
                for k in range(40):
                    if k % 3:
                        gpu.submit(ops.fill(x, float(k)))
                    else:
                        await gpu.run(ops.fill(x, float(k)))
                x.close()
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(worker, i)

    interrupted = False
    try:
        trio.run(main)
    except KeyboardInterrupt:
        interrupted = True
    except BaseExceptionGroup as group:
        _, rest = group.split(KeyboardInterrupt)
        if rest is not None:
            raise
        interrupted = True
    print(json.dumps({
        "interrupted": interrupted,
        "calls": calls,
        "violations": len(sim.violations),
        "live": len(sim.live_allocations),
    }))
    """
)


def _env() -> dict[str, str]:
    """The environment of a subprocess that imports this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


CASES = [(point, nth) for point in ("record_marker", "poll_marker") for nth in (1, 7, 40)]
CASES += [("free", 1), ("free", 3)]  # four arrays are freed


def _command(command: list[str], ignored: bool) -> list[str]:
    return ignoring_sigint(command) if ignored else command


def _run_inside_case(point: str, nth: int, ignored: bool = False) -> None:
    env = _env()
    try:
        out = subprocess.run(
            _command(python("-c", PROGRAM, point, str(nth)), ignored),
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"Ctrl-C inside {point} (call {nth}) left the program hanging")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["calls"] >= nth, report  # the interrupt was really sent
    assert report["interrupted"], report  # and delivered, at a checkpoint
    assert report["violations"] == 0, report
    assert report["live"] == 0, report  # the scope drained and freed everything


@pytest.mark.parametrize(("point", "nth"), CASES)
def test_ctrl_c_inside_the_runtime_is_delivered_later_and_loses_nothing(point: str, nth: int) -> None:
    _run_inside_case(point, nth)


# --------------------------------------------------------------------------- exit and capture

HARNESS = ROOT / "tests" / "helpers" / "interrupts.py"


def _trials(*args: str, timeout: float = 120, ignored: bool = False) -> list[dict[str, object]]:
    """Run ``tests/helpers/interrupts.py`` with ``args`` (with SIGINT ignored where
    ``ignored``: the harness restores it); its trial reports."""
    env = _env()
    try:
        out = subprocess.run(
            _command([sys.executable, str(HARNESS), *args], ignored),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        started = [ln for ln in (exc.stdout or b"").decode().splitlines() if '"start"' in ln]
        pytest.fail(f"interrupt trials hung; the last one started: {started[-1:]}")
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    reports = [r for r in lines if "start" not in r]
    if out.returncode != 0:  # faulthandler ended a stuck trial
        started = [r["start"] for r in lines if "start" in r]
        pytest.fail(f"trial {started[-1:]} hung or crashed:\n{out.stderr[-4000:]}")
    return reports


def _check(reports: list[dict[str, object]]) -> None:
    bad = [r for r in reports if r["problems"]]
    assert not bad, "\n".join(f"seed {r['seed']} ({r['scenario']}): {r['problems']}" for r in bad[:5])


EXIT_PROGRAM = textwrap.dedent(
    """
    import json, logging, signal, sys, warnings
    import numpy as np, trio, trio_cuda
    from trio_cuda import ops

    case = sys.argv[1]
    sim = trio_cuda.testing.SimDevice()
    scopes = []
    exiting = trio.Event()

    @trio.lowlevel.enable_ki_protection
    def ctrl_c():
        signal.raise_signal(signal.SIGINT)  # delivered to the main task, where it waits

    delivered = []

    class Seen(logging.Handler):  # the exit logs each Ctrl-C it keeps waiting through
        def emit(self, record):
            if "Ctrl-C while" in record.getMessage():
                delivered.append(record)

    logging.getLogger("trio_cuda").addHandler(Seen())

    async def operator():
        await exiting.wait()
        await trio.sleep(0.05)  # the exit waits for the held device by now
        ctrl_c()
        while not delivered:  # two signals before one delivery would be one interrupt
            await trio.sleep(0.01)
        await trio.sleep(0.05)  # the exit keeps waiting
        if case == "twice":
            ctrl_c()
        else:
            sim.release()  # the device finishes the work

    async def body(gpu, x):
        sim.hold()  # the work below is really in flight when the exit starts
        y = gpu.zeros(64, np.float32)
        gpu.submit(ops.copy(y, x))  # nested: a copy of the outer scope's memory
        gpu.submit(ops.fill(y, 1.0))
        exiting.set()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(operator)
            async with trio_cuda.open_scope(device=sim, streams=2) as outer:
                scopes.append(outer)
                x = await outer.to_device(np.arange(64, dtype=np.float32))
                if case == "nested":  # the inner scope's copy of the outer scope's memory
                    async with trio_cuda.open_scope(device=sim) as inner:
                        scopes.append(inner)
                        await body(inner, x)
                else:
                    await body(outer, x)

    interrupted = False
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            trio.run(main)
        except KeyboardInterrupt:
            interrupted = True
        except BaseExceptionGroup as group:
            _, rest = group.split(KeyboardInterrupt)
            if rest is not None:
                raise
            interrupted = True
    stats = [gpu.statistics() for gpu in scopes]
    print(json.dumps({
        "interrupted": interrupted,
        "closed": all(gpu.closed for gpu in scopes),
        "in_flight": sum(st.in_flight for st in stats),
        "quarantined": sum(st.quarantined for st in stats),
        "warnings": [str(w.message) for w in warned if issubclass(w.category, ResourceWarning)],
        "violations": len(sim.violations),
        "live": len(sim.live_allocations),
    }))
    """
)


def _run_exit_case(case: str, ignored: bool = False) -> dict[str, object]:
    env = _env()
    try:
        out = subprocess.run(
            _command(python("-c", EXIT_PROGRAM, case), ignored),
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"Ctrl-C at scope exit ({case}) left the program hanging")
    assert out.returncode == 0, out.stderr[-3000:]
    report: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["interrupted"], report
    assert report["closed"], report
    assert report["in_flight"] == 0, report
    assert report["violations"] == 0, report
    return report


@pytest.mark.parametrize("case", ["once", "nested"])
def test_ctrl_c_while_the_exit_drains_waits_then_propagates(case: str) -> None:
    """One Ctrl-C while the exit waits for the held device: the exit keeps
    waiting (without blocking the loop), drains and frees everything, and
    then the interrupt comes out. Before, the exit gave up at once: the work
    still ran, nothing was quarantined, no warning, its memory never freed;
    nested, the inner scope's copy of the outer scope's memory was never
    retired and the outer exit waited for its lease for ever."""
    report = _run_exit_case(case)
    assert report["quarantined"] == 0, report
    assert report["warnings"] == [], report
    assert report["live"] == 0, report  # drained: everything freed


def test_a_second_ctrl_c_quarantines_what_is_in_flight_with_a_warning() -> None:
    """Two Ctrl-C while the device never finishes: the second stops the
    waiting; the work still in flight is quarantined, with a ResourceWarning,
    and its memory is never freed."""
    report = _run_exit_case("twice")
    assert report["quarantined"] >= 1, report
    assert any("second Ctrl-C" in w for w in report["warnings"]), report  # type: ignore[union-attr]
    assert report["live"] >= 1, report  # leaked on purpose, never freed


@pytest.mark.parametrize("point", ["wait_for_progress", "poll_marker", "free", "destroy_stream"])
def test_ctrl_c_at_driver_calls_of_the_exit(point: str) -> None:
    """A Ctrl-C from inside one of the exit's driver calls (the device runs
    freely): the trial ends drained, the interrupt reported."""
    (report,) = _trials("3", "1", "--scenario", "exit", "--at", "1", "--only", point)
    _check([report])
    assert report["sent"] == 1
    assert report["delivered"] == 1
    assert report["outcome"] == "drained"


@pytest.mark.parametrize("point", ["begin_capture", "fill", "end_capture"])
def test_ctrl_c_inside_a_capture_leaves_the_stream_usable(point: str) -> None:
    """A Ctrl-C right after the driver began a capture (or during or at its
    end) is delivered after the capture ended: the stream is not left
    capturing, later work is not quarantined and later captures work."""
    reports = _trials("3", "1", "--scenario", "capture", "--at", "1", "--only", point)
    _check(reports)
    assert reports[0]["delivered"] == 1, reports


def test_random_interrupts_at_exit_and_capture() -> None:
    """SIGINT at random driver calls of scope exits (one scope, nested scopes)
    and of captures: every trial ends drained, or quarantined with a
    warning after a second Ctrl-C, and never hangs."""
    reports = _trials("0", "120")
    _check(reports)
    seen = Counter((r["scenario"], r["outcome"]) for r in reports if r["sent"])
    for scenario in ("exit", "nested", "capture"):
        assert seen[(scenario, "drained")], seen


def test_ctrl_c_reaches_the_children_of_a_process_that_ignores_it() -> None:
    """Started with SIGINT ignored, as a non-interactive shell starts a
    background job (and passes on to its children), each kind of child still
    gets its Ctrl-C: inside the runtime, at a scope's exit (once, then twice)
    and in the harness's trials."""
    _run_inside_case("record_marker", 7, ignored=True)
    assert _run_exit_case("once", ignored=True)["quarantined"] == 0
    assert _run_exit_case("twice", ignored=True)["quarantined"] >= 1
    (report,) = _trials("3", "1", "--scenario", "exit", "--at", "1", "--only", "free", ignored=True)
    _check([report])
    assert report["delivered"] == 1, report


def test_python_restores_sigint_that_ignoring_sigint_ignores(tmp_path: Path) -> None:
    """``python()`` restores SIGINT's default in its child, for ``-c`` and
    ``-m`` alike, under a parent that ignores SIGINT; without it, such a
    parent's child ignores SIGINT (so the test above can fail)."""
    probe = "import signal, sys\n"
    probe += "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, sys.argv[1:])"
    (tmp_path / "sigint_probe.py").write_text(probe)

    def run(command: list[str]) -> str:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path)
        return out.stdout.strip()

    default = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    assert run([sys.executable, "-c", probe, "a"]) == f"{default} ['a']"
    assert run(ignoring_sigint([sys.executable, "-c", probe, "a"])) == "False ['a']"
    assert run(ignoring_sigint(python("-c", probe, "a", "b"))) == "True ['a', 'b']"
    assert run(ignoring_sigint([sys.executable, "-m", "sigint_probe", "a"])) == "False ['a']"
    assert run(ignoring_sigint(python("-m", "sigint_probe", "a"))) == "True ['a']"
    interrupted = subprocess.run(
        ignoring_sigint(
            python("-c", "import signal, time\nsignal.raise_signal(signal.SIGINT)\ntime.sleep(30)")
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "KeyboardInterrupt" in interrupted.stderr, interrupted
    with pytest.raises(ValueError, match="^args: expected"):
        python("script.py")


def _slow_selected(config: pytest.Config) -> bool:
    if os.environ.get("TRIO_CUDA_INTERRUPT_TRIALS"):
        return True
    markexpr = config.getoption("markexpr") or ""
    return "slow" in markexpr and "not slow" not in markexpr


@pytest.mark.slow
def test_many_random_interrupts(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    """``TRIO_CUDA_INTERRUPT_TRIALS`` trials (3,000 by default) from seed
    ``TRIO_CUDA_INTERRUPT_FIRST`` on (100,000 by default)."""
    if not _slow_selected(request.config):
        pytest.skip("slow: select it with -m slow or TRIO_CUDA_INTERRUPT_TRIALS=N")
    count = int(os.environ.get("TRIO_CUDA_INTERRUPT_TRIALS", "3000"))
    first = int(os.environ.get("TRIO_CUDA_INTERRUPT_FIRST", "100000"))
    reports: list[dict[str, object]] = []
    for start in range(first, first + count, 500):
        reports += _trials(str(start), str(min(500, first + count - start)), timeout=1200)
    _check(reports)
    seen = Counter((r["scenario"], r["sent"], r["outcome"]) for r in reports)
    with capsys.disabled():
        print(
            f"\n{len(reports)} interrupt trials, (scenario, SIGINTs, outcome): {dict(sorted(seen.items()))}"
        )
