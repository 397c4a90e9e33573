"""Lifetime traces: what is recorded, the Chrome trace-event JSON, the command
line, logging, and that a trace never changes what the scope does."""

import json
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import add
from trio_cuda import ops
from trio_cuda._backends import probe_cuda
from trio_cuda.testing import SimDevice

F4 = np.float32
ROOT = Path(__file__).resolve().parents[2]
_PROBE = probe_cuda()
# a marker, not pytest.skip() in the test: the async tests' runner drops a skip's reason
needs_cuda = pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}")


def cats(trace):
    return Counter(e.cat for e in trace.events)


async def _scenario(sim, trace):
    """Every kind of lifetime event, on purpose: an allocation, awaited work,
    a cross-stream wait, a dropped future, a cancelled waiter, a failed
    kernel, a quarantine, a host closure and the exit's frees."""

    def boom(x, v, n):
        raise ValueError("reference failed on purpose")

    bad = trio_cuda.Kernel.from_source(
        'extern "C" __global__ void bad(float* x, float v, int n) {}',
        "bad",
        params=[trio_cuda.InOut("f4"), trio_cuda.Scalar("f4"), trio_cuda.Scalar("i4")],
        reference=boom,
    )
    async with trio_cuda.open_scope(device=sim, streams=2, trace=trace) as gpu:
        x = await gpu.to_device(np.arange(8, dtype=F4))
        await gpu.run(add(x[:4], 1.0), stream=gpu.streams[0])
        sim.hold()
        gpu.submit(add(x, 1.0), stream=gpu.streams[0])  # dropped at once
        with trio.move_on_after(0.01):
            await gpu.run(ops.copy(np.zeros(8, F4), x), stream=gpu.streams[1])  # waits on stream 0
        sim.release()
        with pytest.raises(trio_cuda.LaunchError, match="on purpose"):
            await gpu.run(bad.launch(x, F4(1), np.int32(8), grid=1, block=8))
        await gpu.run(ops.host_closure(lambda: None))
        y = await gpu.to_device(np.zeros(4, F4))
        sim.inject_fault("completion_unknown")
        with pytest.raises(trio_cuda.CompletionUnknownError):
            await gpu.run(add(y, 1.0))
        out = await gpu.to_host(x)
    np.testing.assert_array_equal(out, np.arange(8, dtype=F4) + np.array([2, 2, 2, 2, 1, 1, 1, 1], F4))


async def test_a_trace_records_every_kind_of_lifetime_event(caplog):
    sim = SimDevice()
    trace = trio_cuda.trace.Trace()
    with caplog.at_level(logging.INFO, logger="trio_cuda"):
        await _scenario(sim, trace)
    got = cats(trace)
    for cat in ("scope", "alloc", "free", "submit", "lease", "wait", "enqueue", "retire", "cancel", "drop"):
        # (a single launch's submit stands for its enqueue: copies record both)
        assert got[cat] > 0, (cat, got)
    assert got["quarantine"] == 1
    assert got["await"] > 0
    # who observed each completion: the awaiting task or the handoff
    by = Counter(e.name for e in trace.events if e.cat == "retire")
    assert by["waiter"] > 0
    assert by["handoff"] > 0
    # the failed kernel's error is on its retirement
    assert any(e.cat == "retire" and e.args and "on purpose" in e.args["error"] for e in trace.events)
    # the wait names what it waits on, on the other stream
    [wait] = [e for e in trace.events if e.cat == "wait"]
    assert (wait.stream, wait.args["on_stream"]) == (1, 0)
    # leases carry allocation, byte range and mode
    leases = [lease for e in trace.events if e.args for lease in e.args.get("leases", ())]
    assert any(mode == "write" and (lo, hi) == (0, 16) for _, lo, hi, mode in leases)
    # the scope opened and closed, and every allocation was freed or quarantined
    assert [e.name for e in trace.events if e.cat == "scope"] == ["open", "close"]
    # logging: the cancelled waiter with work in flight, and the quarantine
    messages = [r.getMessage() for r in caplog.records if r.name == "trio_cuda"]
    assert any("was cancelled with the work in flight" in m for m in messages)
    assert any("quarantined" in m for m in messages)
    assert sim.violations == []


async def test_chrome_json_is_well_formed():
    sim = SimDevice(kernel_time=0.002)
    trace = trio_cuda.trace.Trace()
    await _scenario(sim, trace)
    doc = json.loads(json.dumps(trace.to_chrome()))  # plain JSON all the way down
    evs = doc["traceEvents"]
    assert doc["otherData"]["dropped"] == 0
    assert doc["otherData"]["device_time"] == "simulated"
    # the lifetime events of the design contract, named in the export
    categories = doc["otherData"]["categories"]
    assert categories == [
        *("scope", "alloc", "free", "submit", "lease", "wait", "enqueue"),
        *("complete", "retire", "cancel", "drop", "quarantine", "error"),
    ], categories
    names = {}
    for e in evs:
        assert e["ph"] in {"M", "X", "i", "s", "f"}, e
        assert isinstance(e["pid"], int)
        if e["ph"] == "M":
            if e["name"] == "thread_name":
                names[(e["pid"], e["tid"])] = e["args"]["name"]
            continue
        assert e["ts"] >= 0, e
        assert e["cat"] in categories, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    # every event sits on a named track
    for e in evs:
        if e["ph"] != "M":
            assert (e["pid"], e["tid"]) in names, e
    tracks = set(names.values())
    assert {"stream 0", "stream 1", "scope"} <= tracks
    assert any(t.startswith("alloc 0x") and t.endswith(" B)") for t in tracks)
    assert any(t.startswith("task ") for t in tracks)
    present = {e["cat"] for e in evs if e["ph"] != "M"}
    assert set(categories) - present == set(), present
    # flows: each start has its end, and it ends no earlier
    starts = {e["id"]: e["ts"] for e in evs if e["ph"] == "s"}
    ends = {e["id"]: e["ts"] for e in evs if e["ph"] == "f"}
    assert starts
    assert starts.keys() == ends.keys()
    assert all(ends[i] >= starts[i] for i in starts)
    # device lanes show the simulated kernels' durations (2 ms each)
    kernels = [e for e in evs if e["ph"] == "X" and e["cat"] == "enqueue" and e["name"] == "add_f4"]
    assert kernels
    assert all(e["args"]["device_time"] == "simulated" for e in kernels)
    assert max(e["dur"] for e in kernels) >= 1900
    # an allocation's life: alive from alloc to free, leases nested in time
    alive = [e for e in evs if e["ph"] == "X" and e["cat"] == "alloc"]
    leases = [e for e in evs if e["ph"] == "X" and e["cat"] == "lease"]
    assert alive
    assert leases
    assert {e["name"] for e in leases} == {"read", "write"}
    # slices on one track never overlap without nesting (Perfetto needs it)
    by_track = {}
    for e in evs:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        stack = []
        for lo, hi in spans:
            while stack and stack[-1] <= lo + 1e-3:
                stack.pop()
            assert not stack or hi <= stack[-1] + 1e-3, spans
            stack.append(hi)


async def test_the_ring_is_bounded_and_says_what_it_dropped():
    sim = SimDevice()
    trace = trio_cuda.trace.Trace(limit=10)
    async with trio_cuda.open_scope(device=sim, trace=trace) as gpu:
        x = await gpu.to_device(np.zeros(4, F4))
        for _ in range(20):
            await gpu.run(add(x, 1.0))
    assert len(trace.events) == 10
    assert trace.dropped > 40
    assert trace.to_chrome()["otherData"]["dropped"] == trace.dropped
    assert trace.events[-1].cat == "scope"  # the newest are kept
    with pytest.raises(ValueError, match="limit: expected an int >= 1, got 0"):
        trio_cuda.trace.Trace(limit=0)


async def test_tracing_off_records_nothing_and_process_tracing_covers_new_scopes():
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        assert internals.tracer_of(gpu) is None
    assert trio_cuda.trace.current() is None
    trace = trio_cuda.trace.enable(limit=1000)
    try:
        assert trio_cuda.trace.current() is trace
        async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim, trace=False) as b:
            await a.run(ops.fill(a.zeros(4, F4), 1.0))
            await b.run(ops.fill(b.zeros(4, F4), 1.0))
            assert internals.tracer_of(b) is None
    finally:
        assert trio_cuda.trace.disable() is trace
    assert trio_cuda.trace.current() is None
    assert {e.scope for e in trace.events} == {1}
    with pytest.raises(TypeError, match="trace: expected None, False or a trio_cuda.trace.Trace, got True"):
        trio_cuda.open_scope(device=sim, trace=True)


async def test_a_trace_does_not_change_what_the_scope_does():
    # the same program with and without a trace: same results, same statistics
    async def program(trace):
        sim = SimDevice()
        async with trio_cuda.open_scope(device=sim, streams=3, trace=trace) as gpu:
            x = await gpu.to_device(np.arange(64, dtype=F4))
            futs = [gpu.submit(add(x[i * 16 : (i + 1) * 16], float(i))) for i in range(4)]
            for f in futs:
                await f.wait()
            out = await gpu.to_host(x)
            stats = gpu.statistics()
        return out, stats, sim.statistics()

    plain = await program(None)
    traced = await program(trio_cuda.trace.Trace())
    np.testing.assert_array_equal(plain[0], traced[0])
    # (who retired what depends on Trio's scheduling order, traced or not)
    assert attrs.evolve(plain[1], retired_by_waiters=0) == attrs.evolve(traced[1], retired_by_waiters=0)
    assert plain[2] == traced[2]


def test_write_picks_the_format_from_the_name(tmp_path):
    trace = trio_cuda.trace.Trace()
    trio.run(_scenario, SimDevice(), trace)
    trace.write(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    trace.write(tmp_path / "t.html")
    assert (tmp_path / "t.html").read_text().lstrip().lower().startswith("<!doctype html")
    with pytest.raises(ValueError, match=r"path: expected a name ending in .json or .html, got '.*t.txt'"):
        trace.write(tmp_path / "t.txt")


def test_the_trace_command_runs_a_program_and_writes_its_trace(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_cuda",
            "trace",
            "-o",
            str(out),
            str(ROOT / "examples" / "inplace_update.py"),
            "--device",
            "sim",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "in-place update: OK" in proc.stdout
    assert f"written to {out}" in proc.stderr
    doc = json.loads(out.read_text())
    present = {e["cat"] for e in doc["traceEvents"] if e["ph"] != "M"}
    assert {"scope", "alloc", "free", "submit", "enqueue", "retire", "lease"} <= present
    bad = subprocess.run(
        [sys.executable, "-m", "trio_cuda", "trace", "-o", str(tmp_path / "x.txt"), "prog.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "expected a file name ending in .html or .json" in bad.stderr
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_cuda",
            "trace",
            "-o",
            str(tmp_path / "x.json"),
            str(tmp_path / "nope.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2
    assert "SCRIPT: expected a Python file" in missing.stderr
    assert not (tmp_path / "x.json").exists()
    # a program that fails still leaves its trace behind, and its exit status
    failing = tmp_path / "failing.py"
    failing.write_text(
        "import trio, trio_cuda\n"
        "async def main():\n"
        "    async with trio_cuda.open_scope(device='sim') as gpu:\n"
        "        gpu.zeros(4, 'f4')\n"
        "    raise SystemExit(3)\n"
        "trio.run(main)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "trio_cuda", "trace", "-o", str(tmp_path / "f.json"), str(failing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert json.loads((tmp_path / "f.json").read_text())["otherData"]["events"] > 0


MY_JOB = """\
import sys

import numpy as np
import trio

import trio_cuda


async def main():
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = await gpu.to_device(np.arange(1024, dtype=np.float32))
        print(sys.argv[1:], await gpu.to_host(x[:4]))


trio.run(main)
"""


def _docs_commands(page: Path) -> list[tuple[str, list[str]]]:
    """Each ``$ python -m trio_cuda ...`` command of the page's console blocks,
    and the lines of output shown after it."""
    out: list[tuple[str, list[str]]] = []
    for line in page.read_text().splitlines():
        text = line.strip()
        if text.startswith("$ python -m trio_cuda "):
            out.append((text[2:], []))
        elif text.startswith("$ "):
            raise AssertionError(f"a command this test does not know how to run: {text}")
        elif out and text.startswith("trace: "):
            out[-1][1].append(text)
    return out


def test_a_traced_program_imports_its_neighbours_as_python_would(tmp_path):
    """``trace SCRIPT`` runs it as ``python SCRIPT`` does: the script's folder
    first on ``sys.path`` (a lesson imports its ``_lesson`` helper), and
    nothing of it left there afterwards."""
    lesson = ROOT / "examples" / "lifetimes" / "03_cancel_while_running.py"
    out = tmp_path / "lesson.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_cuda",
            "trace",
            "-o",
            str(out),
            str(lesson),
            "--device",
            "sim",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "the rule held" in proc.stdout
    assert f"written to {out}" in proc.stderr


def test_the_commands_of_the_traces_page_work_as_written(tmp_path):
    """docs/traces.rst's commands, run as written (with ``my_job.py`` a small
    traced program), in both -o orders: each writes its trace where it says,
    prints what the page shows, and the program gets its own arguments."""
    (tmp_path / "my_job.py").write_text(MY_JOB)
    commands = _docs_commands(ROOT / "docs" / "traces.rst")
    assert any(c.startswith("python -m trio_cuda trace my_job.py") and " -o " in c for c, _ in commands)
    assert any(c.startswith("python -m trio_cuda trace -o ") for c, _ in commands)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    for command, shown in commands:
        argv = command.split()
        out_name = argv[argv.index("-o" if "-o" in argv else "--trace") + 1]
        proc = subprocess.run(
            [sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
        )
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        out = tmp_path / out_name
        if out_name.endswith(".json"):
            assert json.loads(out.read_text())["otherData"]["events"] > 0, command
        else:
            assert "<!DOCTYPE html>" in out.read_text()[:100], command
        for line in shown:  # the lines the page shows, as printed (the counts are the program's)
            pattern = re.sub(r"\d+", r"\\d+", re.escape(line))
            assert re.search(f"^{pattern}$", proc.stdout + proc.stderr, re.M), (command, line, proc.stderr)
        if "my_job.py" in argv:
            after = argv[argv.index("my_job.py") + 1 :]
            own = [a for i, a in enumerate(after) if a != "-o" and (i == 0 or after[i - 1] != "-o")]
            assert f"{own} [0. 1. 2. 3.]" in proc.stdout, (command, proc.stdout)
    # the program whose own arguments end in -o: with trace's -o first, they are the program's
    proc = subprocess.run(
        [sys.executable, "-m", "trio_cuda", "trace", "-o", "run.html", "my_job.py", "-o", "its.json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "['-o', 'its.json'] [0. 1. 2. 3.]" in proc.stdout
    assert not (tmp_path / "its.json").exists()


def test_the_demo_writes_its_trace(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_cuda",
            "demo",
            "--device",
            "sim",
            "--quiet",
            "--inputs",
            "8",
            "--trace",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"written to {out}" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["otherData"]["backend"] == "sim"


async def test_drain_timeout_that_runs_out_is_logged(caplog):
    sim = SimDevice()
    with caplog.at_level(logging.WARNING, logger="trio_cuda"), pytest.warns(ResourceWarning):
        async with trio_cuda.open_scope(device=sim, drain_timeout=0) as gpu:
            x = await gpu.to_device(np.zeros(4, F4))
            sim.hold()
            gpu.submit(add(x, 1.0))
    sim.release()
    assert any("drain_timeout=0" in r.getMessage() and "ran out" in r.getMessage() for r in caplog.records)


def test_the_timeline_page_counts_the_events_recorded():
    """The page's header counts the lifetime events (``trace.events``), not
    the JSON's records, which are more: a retirement alone is a complete and a
    retire marker, lease slices and take/release markers and a flow's end."""
    from tests.features.test_trace_html import facts

    trace = trio_cuda.trace.Trace()
    trio.run(_scenario, SimDevice(kernel_time=0.002), trace)
    records, n = len(trace.to_chrome()["traceEvents"]), len(trace.events)
    assert records > 2 * n > 0, (records, n)  # the two counts differ: the test can tell them apart
    shown = facts(trace.to_html())
    assert shown["events"] == f"{n} recorded", shown
    assert str(records) not in shown["events"], shown


def test_the_timeline_page_of_a_real_trace_in_chromium(tmp_path):
    from tests.features.test_trace_html import body, console_lines, dump_dom, facts, find_chromium

    if find_chromium() is None:
        pytest.skip("no chromium binary on PATH")
    trace = trio_cuda.trace.Trace()
    trio.run(_scenario, SimDevice(kernel_time=0.002), trace)
    page = trace.to_html(title="scenario")
    dom, stderr = dump_dom(page, tmp_path)
    assert body(dom).get("data-ready") == "1"
    assert console_lines(stderr) == []
    bars, marks, arrows = (int(part.split()[0]) for part in facts(page)["drawn"].split(", "))
    assert int(body(dom)["data-events"]) == bars + marks == len(dom.by_class("ev"))
    assert arrows == len(dom.by_class("flow")) > 0
    lanes = {lane["data-track"]: lane["data-kind"] for lane in dom.by_class("lane")}
    assert lanes["stream 0"] == lanes["stream 1"] == "stream"
    assert any(name.startswith("alloc 0x") and kind == "alloc" for name, kind in lanes.items())
    assert any(kind == "task" for kind in lanes.values())
    drawn = Counter(e["data-cat"] for e in dom.by_class("ev"))
    for cat in ("enqueue", "alloc", "lease", "free", "cancel", "drop", "quarantine", "wait", "retire"):
        assert drawn[cat] > 0, (cat, drawn)
    # the cancellation, the dropped future and the quarantine are marked across the scope
    assert {"cancel", "drop", "quarantine"} <= {a["data-cat"] for a in dom.by_class("alert")}


class _FakeNvtx:
    """Stands in for the ``nvtx`` package: records the ranges."""

    def __init__(self):
        self.open = {}
        self.closed = []
        self.next = 0

    def start_range(self, message, domain):
        self.next += 1
        self.open[self.next] = (message, domain)
        return self.next

    def end_range(self, rid):
        self.closed.append(self.open.pop(rid))


async def test_nvtx_ranges_for_scopes_and_submissions_where_nvtx_is_installed(monkeypatch):
    fake = _FakeNvtx()
    monkeypatch.setattr(trio_cuda._core._trace, "_load_nvtx", lambda: fake)
    trace = trio_cuda.trace.Trace()
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, trace=trace) as gpu:
        x = await gpu.to_device(np.zeros(4, F4))
        await gpu.run(add(x, 1.0))
        assert ("scope #1", "trio_cuda") in fake.open.values()
    assert fake.open == {}  # every range ended: the scope's and each submission's
    messages = [m for m, _ in fake.closed]
    assert "add_f4 #3" in messages
    assert messages[-1] == "scope #1"
    assert {d for _, d in fake.closed} == {"trio_cuda"}


async def test_a_broken_nvtx_turns_itself_off(monkeypatch, caplog):
    class Broken:
        def start_range(self, message, domain):
            raise RuntimeError("no profiler")

    monkeypatch.setattr(trio_cuda._core._trace, "_load_nvtx", Broken)
    trace = trio_cuda.trace.Trace()
    async with trio_cuda.open_scope(device=SimDevice(), trace=trace) as gpu:
        await gpu.run(ops.fill(gpu.zeros(4, F4), 1.0))
    assert cats(trace)["retire"] > 0  # the trace itself goes on
    assert any("NVTX ranges turned off" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
@needs_cuda
async def test_a_trace_on_the_gpu_shows_host_observed_times(tmp_path):
    trace = trio_cuda.trace.Trace()
    async with trio_cuda.open_scope(device="cuda", streams=2, trace=trace) as gpu:
        x = await gpu.to_device(np.arange(1024, dtype=F4))
        await gpu.run(add(x[:512], 1.0))
        fut = gpu.submit(add(x[512:], 2.0))
        await fut.wait()
        out = await gpu.to_host(x)
    np.testing.assert_array_equal(out, np.arange(1024, dtype=F4) + np.repeat(np.array([1, 2], F4), 512))
    got = cats(trace)
    for cat in ("scope", "alloc", "free", "submit", "enqueue", "retire", "await"):
        assert got[cat] > 0, (cat, got)
    doc = trace.to_chrome()
    assert doc["otherData"]["backend"] == "cuda"
    assert doc["otherData"]["device_time"] == "host-observed"
    kernels = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "add_f4"]
    assert len(kernels) == 2
    assert all(e["args"]["device_time"] == "host-observed" and e["dur"] > 0 for e in kernels)
    trace.write(tmp_path / "gpu.html")


@pytest.mark.gpu
@needs_cuda
async def test_timing_on_the_gpu_takes_device_times_from_cuda_events():
    spin = trio_cuda.Kernel.from_source(
        r"""extern "C" __global__ void spin(float* x, unsigned long long ns) {
            unsigned long long t0, t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
            x[0] += 1.0f;
        }""",
        "spin",
        params=[trio_cuda.InOut("f4"), trio_cuda.Scalar("u8")],
    )
    trace = trio_cuda.trace.Trace(timing=True)
    async with trio_cuda.open_scope(device="cuda", trace=trace) as gpu:
        x = await gpu.to_device(np.zeros(4, F4))
        await gpu.run(spin.launch(x, np.uint64(2_000_000), grid=1, block=1))  # 2 ms on the device
        await trio.sleep(0.01)  # host idle: a host-observed span would include nothing of this
        await gpu.run(ops.fill(x, 0.0))
    doc = trace.to_chrome()
    assert doc["otherData"]["device_time"] == "cuda-events"
    [k] = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "spin"]
    assert k["args"]["device_time"] == "cuda-events"
    assert 1900 <= k["dur"] <= 3000, k  # the kernel's own 2 ms, in microseconds
    fills = [
        e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "enqueue" and e["name"] == "fill"
    ]
    assert fills
    assert all(e["args"]["device_time"] == "cuda-events" for e in fills)
    assert fills[-1]["ts"] >= k["ts"] + k["dur"]  # stream order on the device clock


async def test_graph_replays_and_zeros_have_device_slices_and_frees_follow_retirement():
    trace = trio_cuda.trace.Trace()
    sim = SimDevice(copy_time=0.002)
    async with trio_cuda.open_scope(device=sim, trace=trace) as gpu:
        x = gpu.zeros(16, F4)
        g = await gpu.capture(ops.fill(x, 1.0))
        await gpu.run(g.launch())
        g.close()
        y = await gpu.to_device(np.ones(4, F4))
        gpu.submit(ops.fill(y, 1.0))
        y.close()  # freed when that fill retires
    names = [e["name"] for e in trace.to_chrome()["traceEvents"] if e["ph"] == "X" and e["cat"] == "enqueue"]
    assert names.count("fill") >= 2  # zeros() and the fill of y
    assert any(n.startswith("graph ") for n in names)
    # every free comes after the retirement that released the allocation's last lease
    events = trace.events
    for i, e in enumerate(events):
        if e.cat == "free":
            assert any(p.cat == "retire" for p in events[:i])
            assert events[i - 1].cat in ("retire", "free", "scope", "await"), events[i - 1]


@pytest.mark.parametrize("limit", [float("nan"), float("inf"), 1.5, True, -1, "10"])
def test_a_trace_limit_must_be_a_positive_int(limit):
    with pytest.raises(ValueError, match="limit: expected an int >= 1"):
        trio_cuda.trace.Trace(limit=limit)
    with pytest.raises(TypeError, match="timing: expected a bool"):
        trio_cuda.trace.Trace(timing=1)


async def test_a_traced_scope_cancelled_with_work_in_flight_exits_and_records_it():
    sim = SimDevice(kernel_time=0.05)
    trace = trio_cuda.trace.Trace()
    with trio.fail_after(5):  # a hung exit fails here
        with trio.move_on_after(0.01) as cs:
            async with trio_cuda.open_scope(device=sim, trace=trace) as gpu:
                x = await gpu.to_device(np.zeros(4, F4))
                await gpu.run(add(x, 1.0))
        assert cs.cancelled_caught
    got = cats(trace)
    assert got["cancel"] == 1
    assert [e.name for e in trace.events if e.cat == "scope"] == ["open", "close"]
    # the cancelled work was retired (by the handoff or at the exit), then its memory freed
    retire = max(e.t for e in trace.events if e.cat == "retire")
    free = max(e.t for e in trace.events if e.cat == "free")
    assert free >= retire
    assert sim.violations == []
    assert sim.live_allocations == []


async def test_a_host_closure_raising_a_base_exception_is_traced_and_reported():
    trace = trio_cuda.trace.Trace()

    def boom():
        raise SystemExit(7)

    with pytest.raises(BaseExceptionGroup) as info:
        async with trio_cuda.open_scope(device=SimDevice(), trace=trace) as gpu:
            gpu.submit(ops.host_closure(boom))
    assert info.group_contains(SystemExit)
    assert any(e.cat == "retire" and e.args and "SystemExit" in e.args["error"] for e in trace.events)
    assert trace.events[-1].cat == "scope"


class _BytesPath:
    """A path object whose ``__fspath__`` gives bytes (``open()`` takes it)."""

    def __init__(self, path: bytes) -> None:
        self.path = path

    def __fspath__(self) -> bytes:
        return self.path


class _BadPath:
    def __fspath__(self) -> object:
        return 5


def test_write_takes_every_file_name_open_takes(tmp_path):
    trace = trio_cuda.trace.Trace()
    trio.run(_scenario, SimDevice(), trace)
    names = {
        "str": (str(tmp_path / "a.json"), tmp_path / "a.json"),
        "bytes": (os.fsencode(tmp_path / "b.json"), tmp_path / "b.json"),
        "Path": (tmp_path / "c.json", tmp_path / "c.json"),
        "bytes path object": (_BytesPath(os.fsencode(tmp_path / "d.html")), tmp_path / "d.html"),
        "upper case": (tmp_path / "E.JSON", tmp_path / "E.JSON"),
        ".htm": (os.fsencode(tmp_path / "f.htm"), tmp_path / "f.htm"),
    }
    for how, (given, written) in names.items():
        trace.write(given)
        text = written.read_text()
        if written.suffix.lower() == ".json":
            assert json.loads(text)["traceEvents"], how
        else:
            assert text.lstrip().lower().startswith("<!doctype html"), how
            assert f"<title>{written.name}</title>" in text, how


#: (call, error, message): each bad argument is named, with what was expected and given
BAD_ARGUMENTS = {
    "write int": (
        lambda t: t.write(5),
        TypeError,
        r"^path: expected a str, bytes or os.PathLike file name, got int 5$",
    ),
    "write None": (lambda t: t.write(None), TypeError, r"^path: expected a str, bytes .* got NoneType None$"),
    "write bad fspath": (
        lambda t: t.write(_BadPath()),
        TypeError,
        r"^path: expected .* got _BadPath .*__fspath__",
    ),
    "write bytes .txt": (
        lambda t: t.write(b"run.txt"),
        ValueError,
        r"^path: expected a name ending in .json or .html, got 'run.txt'$",
    ),
    "write empty": (
        lambda t: t.write(""),
        ValueError,
        r"^path: expected a name ending in .json or .html, got ''$",
    ),
    "to_html int title": (lambda t: t.to_html(title=5), TypeError, r"^title: expected a str, got int 5$"),
    "to_html bytes title": (
        lambda t: t.to_html(title=b"t"),
        TypeError,
        r"^title: expected a str, got bytes b't'$",
    ),
    "huge limit": (
        lambda t: trio_cuda.trace.Trace(limit=2**64),
        ValueError,
        r"^limit: expected an int >= 1 and at most sys.maxsize, got 18446744073709551616$",
    ),
    "enable limit 0": (
        lambda t: trio_cuda.trace.enable(limit=0),
        ValueError,
        r"^limit: expected an int >= 1, got 0$",
    ),
    "enable limit nan": (
        lambda t: trio_cuda.trace.enable(limit=float("nan")),
        ValueError,
        r"^limit: expected an int >= 1, got nan$",
    ),
    "enable timing str": (
        lambda t: trio_cuda.trace.enable(timing="yes"),
        TypeError,
        r"^timing: expected a bool, got 'yes'$",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_to_the_trace_api_are_named(tmp_path, monkeypatch, case):
    call, error, message = BAD_ARGUMENTS[case]
    monkeypatch.chdir(tmp_path)  # nothing may be written, but not here if it were
    trace = trio_cuda.trace.Trace()
    with pytest.raises(error, match=message):
        call(trace)
    assert list(tmp_path.iterdir()) == []
    assert trio_cuda.trace.current() is None  # a refused enable() turned nothing on


def test_the_timeline_renderer_names_a_bad_title():
    from trio_cuda._trace_html import render_html

    with pytest.raises(TypeError, match=r"^title: expected a str, got NoneType None$"):
        render_html({}, title=None)


async def test_the_recorder_stays_bounded_over_many_scopes():
    # the scope registry and the device times follow the ring: what no event
    # in it refers to any more is forgotten; what it refers to is kept
    limit = 60
    trace = trio_cuda.trace.Trace(limit=limit)
    sim = SimDevice()
    tracer = internals.tracer_of(trace)
    sizes = []
    for i in range(150):
        launches = 40 if i % 50 == 7 else 1 + i % 4  # some scopes outlast the ring
        async with trio_cuda.open_scope(device=sim, trace=trace) as gpu:
            x = await gpu.to_device(np.zeros(4, F4))
            for _ in range(launches):
                await gpu.run(add(x, 1.0))
        sizes.append(len(tracer.scopes) + len(tracer.device) + len(tracer.marks))
        doc = trace.to_chrome()
        named = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
        assert {e.scope for e in trace.events} <= named
        # this scope's kernels still in the ring have their device times,
        # wherever its events sit in the ring
        sid = max(named)
        kernels = [
            e
            for e in doc["traceEvents"]
            if e["ph"] == "X" and e["cat"] == "enqueue" and e["name"] == "add_f4" and e["pid"] == sid
        ]
        assert kernels, i
        assert {e["args"]["device_time"] for e in kernels} == {"simulated"}, i
    assert max(sizes) <= 5 * limit + 10, sizes
