"""A trace's compiled records on the awaited path (``_claunch_trace.c``)
against the Python ones: ``Tracer.emit``'s ring, ``Completion.trace_await``,
``Completion.trace_retire`` and ``_trace.trace_submit``.

The compiled records are taken only where the class or module holds the
Python function; wrapping each (as a test or a subclass would) makes the
Python one run, so one program run twice, with and without wrappers, must
record the same events (times aside; who retired which work depends on
timing, so the retirers are compared as a set)."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import run_bounded
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import add_one
from trio_cuda._core import _compiled, _completion, _scope, _trace
from trio_cuda.testing import SimDevice

_launch = add_one


class _Python:
    """Wrappers around the three Python records (the compiled ones then decline)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        C = _completion.Completion
        a, r, s = C.trace_await, C.trace_retire, _scope.trace_submit

        def trace_await(c: Any, sub: Any, t0: float) -> None:
            self.calls.append("await")
            a(c, sub, t0)

        def trace_retire(c: Any, sub: Any) -> None:
            self.calls.append("retire")
            r(c, sub)

        def trace_submit(*args: Any) -> None:
            self.calls.append("submit")
            s(*args)

        monkeypatch.setattr(C, "trace_await", trace_await)
        monkeypatch.setattr(C, "trace_retire", trace_retire)
        monkeypatch.setattr(_scope, "trace_submit", trace_submit)
        monkeypatch.setattr(_scope, "trace_awaited", C.trace_await)


def _program(limit: int) -> tuple[list[Any], int]:
    """Awaited launches, a forgotten one, a cancelled wait, a kernel fault,
    the exit's retirements; the events (times and t0 aside) and ``dropped``."""
    trace = trio_cuda.trace.Trace(limit=limit)
    sim = SimDevice()

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim, trace=trace, streams=2) as gpu:
            x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
            for _ in range(3):
                await gpu.run(_launch(x), stream=gpu.streams[0])
            gpu.submit(_launch(y), stream=gpu.streams[1])  # (forgotten)
            await trio.testing.wait_all_tasks_blocked()
            sim.hold()
            with trio.move_on_after(0.01):
                await gpu.run(_launch(x), stream=gpu.streams[0])  # (left)
            sim.release()
            await trio.testing.wait_all_tasks_blocked()
            sim.inject_fault("kernel_fault")
            with pytest.raises(trio_cuda.TrioCudaError):  # (observed here: not raised at the exit)
                await gpu.run(_launch(y), stream=gpu.streams[1])
            sim.hold()
            gpu.submit(_launch(x), stream=gpu.streams[0])  # (retired at the exit)
            trio.lowlevel.current_trio_token().run_sync_soon(sim.release)

    run_bounded(main, limit=20.0)
    events = []
    for e in trace.events:
        args = dict(e.args) if isinstance(e.args, dict) else e.args
        if e.cat == "await":
            args.pop("t0")
        events.append((e.cat, e.name, e.scope, e.stream, e.submission, e.allocation, args))
    return events, trace.dropped


def _compare(compiled: list[Any], python: list[Any]) -> None:
    def key(e: Any) -> Any:  # (a retirement named by who saw it first)
        return (*e[:1], "?", *e[2:]) if e[0] == "retire" else e

    assert [key(e) for e in compiled] == [key(e) for e in python]
    assert {e[1] for e in compiled if e[0] == "retire"} <= {"waiter", "handoff", "exit"}


@compiled_only
@pytest.mark.parametrize("limit", [100_000, 7], ids=["kept", "wrapped"])
def test_compiled_and_python_records_agree(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled, c_dropped = _program(limit)
    with monkeypatch.context() as m:
        wrapped = _Python(m)
        python, p_dropped = _program(limit)
    assert {"await", "retire", "submit"} <= set(wrapped.calls)
    assert c_dropped == p_dropped
    _compare(compiled, python)
    if limit > 100:
        cats = [e[0] for e in compiled]
        assert sum(e[0] == "submit" and e[1] == "add" for e in compiled) == 7
        assert cats.count("await") == 5
        outcomes = sorted(e[6]["outcome"] for e in compiled if e[0] == "await")
        assert outcomes == ["error", "left", "ok", "ok", "ok"]
        assert "waiter" in {e[1] for e in compiled if e[0] == "retire"}
        submit = next(e for e in compiled if e[0] == "submit" and e[1] == "add")
        assert submit[6]["enqueue"] == "add"
        assert submit[6]["leases"]


@compiled_only
async def test_the_record_is_emit_s() -> None:
    """``trace_await`` on a tracer (its ring filling, then wrapping) leaves
    what ``emit`` leaves for the same event, times aside."""
    assert _compiled.ext is not None
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        _x, c, sub = await internals.completed_unwatched(gpu, _launch)
        rings = []
        for compiled in (True, False):
            tr = _trace.Tracer(limit=3)
            c.tracer, c.trace_id = tr, 9
            try:
                for i in range(5):
                    if compiled:
                        _compiled.ext.trace_await(c, sub, float(i))
                    else:
                        _completion.Completion.trace_await(c, sub, float(i))
            finally:
                c.tracer = None
            assert tr.recorded == 5
            assert len(tr.ring) == 3
            rings.append([e[1:] for e in tr.ring])
            if compiled:  # (nothing in it for the garbage collector to visit)
                assert not any(gc.is_tracked(e) for e in tr.ring)
            assert all(isinstance(e[0], float) for e in tr.ring)
        assert rings[0] == rings[1]
        assert [e[-1]["t0"] for e in rings[0]] == [3.0, 4.0, 2.0]  # (slot 5 % 3 and 4 % 3 overwritten)
        assert rings[0][0][:5] == ("await", "await", 9, sub.stream.index, sub.id)


@compiled_only
async def test_records_alternating_between_tracers_use_each_one_s_lock() -> None:
    """The record keeps the last lock's bound methods: records alternating
    between two tracers (and one whose lock was replaced) each land in their
    own ring, under their own lock, and leave every lock free."""
    assert _compiled.ext is not None  # (for the type checker: the marker skips otherwise)
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        _x, c, sub = await internals.completed_unwatched(gpu, _launch)
        a, b = _trace.Tracer(limit=100), _trace.Tracer(limit=100)
        held = []

        class Spy:
            """A lock that notes its use (the replacement of ``a``'s)."""

            def __init__(self) -> None:
                self.inner = a.lock

            def acquire(self) -> bool:
                held.append("acquire")
                return self.inner.acquire()

            def release(self) -> None:
                held.append("release")
                self.inner.release()

        try:
            for i in range(6):
                if i == 4:
                    a.lock = Spy()  # type: ignore[assignment]
                c.tracer = (a, b)[i % 2]
                _compiled.ext.trace_await(c, sub, float(i))
        finally:
            c.tracer = None
        assert [e[-1]["t0"] for e in a.ring] == [0.0, 2.0, 4.0]
        assert [e[-1]["t0"] for e in b.ring] == [1.0, 3.0, 5.0]
        assert held == ["acquire", "release"]
        for lock in (a.lock.inner, b.lock):  # type: ignore[attr-defined]
            assert lock.acquire(blocking=False)
            lock.release()
    assert sim.violations == []


class _Nvtx:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_range(self, message: str, domain: str) -> int:
        self.calls.append(f"start {message}")
        return len(self.calls)

    def end_range(self, rid: int) -> None:
        self.calls.append(f"end {rid}")


@compiled_only
async def test_a_tracer_with_nvtx_records_through_emit() -> None:
    """With NVTX ranges on, the compiled records decline: ``emit`` records
    and opens and closes each submission's range."""
    trace = trio_cuda.trace.Trace()
    nvtx = trace._tracer.nvtx = _Nvtx()
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, trace=trace) as gpu:
        x = gpu.zeros(4, "f4")
        for _ in range(3):
            await gpu.run(_launch(x))
    cats = [e.cat for e in trace.events if e.cat != "submit" or e.name == "add"]
    assert cats.count("submit") == 3
    assert cats.count("await") == 3
    assert cats.count("retire") >= 3
    assert sum(c.startswith("start add") for c in nvtx.calls) == 3
    assert sum(c.startswith("end") for c in nvtx.calls) >= 4  # (and the scope's)
    assert sim.violations == []


@compiled_only
async def test_a_failing_record_releases_the_lock_and_changes_nothing() -> None:
    assert _compiled.ext is not None
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        _x, c, sub = await internals.completed_unwatched(gpu, _launch)
        tr = _trace.Tracer(limit=3)
        tr.ring = ()  # type: ignore[assignment]  # (not a list)
        c.tracer = tr
        try:
            with pytest.raises(TypeError, match="ring"):
                _compiled.ext.trace_await(c, sub, 0.0)
        finally:
            c.tracer = None
        assert tr.recorded == 0

        def other_thread_takes_the_lock() -> bool:
            got = tr.lock.acquire(timeout=5)
            if got:
                tr.lock.release()
            return got

        assert await trio.to_thread.run_sync(other_thread_takes_the_lock)
    assert sim.violations == []


@compiled_only
async def test_the_records_defer_to_overridden_methods_and_name_the_retirer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``trace_await`` calls the class's method where it is not the original;
    the retirement's record names the retirer as ``Completion.retirer``
    does: the exit while the scope exits, else the awaiting task."""
    assert _compiled.ext is not None
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, "f4")
        await gpu.run(_launch(x))
        c = internals.completion_of(gpu)
        await trio.testing.wait_all_tasks_blocked()
        tr = _trace.Tracer(limit=100)
        c.tracer = tr
        try:
            calls: list[Any] = []
            with monkeypatch.context() as m:
                m.setattr(_completion.Completion, "trace_await", lambda self, sub, t0: calls.append(t0))
                sub = internals.submit_unwatched(gpu, _launch(x))
                _compiled.ext.trace_await(c, sub, 5.0)
            assert calls == [5.0]
            assert tr.recorded == 0
            names = []
            for exiting in (True, False):  # (the awaiting task retires its own work)
                c.exiting = exiting
                try:
                    await gpu.run(_launch(x))
                finally:
                    c.exiting = False
                names.append([e[2] for e in tr.ring if e[1] == "retire"][-1])
            assert names == ["exit", "waiter"]
        finally:
            c.tracer = None
    assert sim.violations == []


@pytest.mark.parametrize("exc", [RuntimeError("cmd"), KeyboardInterrupt()], ids=["Exception", "KI"])
@pytest.mark.parametrize("records", ["compiled", "python"])
def test_a_submission_record_that_raises(
    records: str, exc: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's ``last_command`` raising inside the submission's record
    (after the launch was enqueued): the error reaches the awaiting task,
    the launch stays retained and retires, nothing leaks, the exit does not
    hang; the same with either record."""
    if records == "python":
        _Python(monkeypatch)
    sim = SimDevice()
    out: list[Any] = []

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim, trace=trio_cuda.trace.Trace()) as gpu:
            x = gpu.zeros(4, "f4")
            await gpu.run(_launch(x))

            def boom(self: Any) -> Any:
                raise exc

            with monkeypatch.context() as m:
                m.setattr(type(internals.driver_of(gpu)), "last_command", boom)
                with pytest.raises(type(exc)):
                    await gpu.run(_launch(x))
            out.append(gpu.statistics().in_flight)
            out.append((await gpu.to_host(x)).tolist())

    run_bounded(main, limit=20.0)
    assert out == [1, [2.0] * 4]
    assert sim.violations == []
    assert sim.live_allocations == []


@compiled_only
async def test_a_record_waits_for_the_lock_held_by_another_thread() -> None:
    """The record takes the tracer's lock in C: while another thread holds
    it (mid-update), the record waits, with the GIL released, and lands
    after that thread's event."""
    assert _compiled.ext is not None
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        _x, c, sub = await internals.completed_unwatched(gpu, _launch)
        tr = _trace.Tracer(limit=10)
        held, go = threading.Event(), threading.Event()

        def holder() -> None:
            with tr.lock:
                held.set()
                go.wait(10)
                tr.emit("scope", "held", 1)

        th = threading.Thread(target=holder)
        th.start()
        assert held.wait(5)
        threading.Timer(0.1, go.set).start()
        c.tracer = tr
        try:
            _compiled.ext.trace_await(c, sub, 1.0)
        finally:
            c.tracer = None
        th.join(5)
        assert [e[2] for e in tr.ring] == ["held", "await"]
        assert tr.recorded == 2
        assert tr.lock.acquire(blocking=False)
        tr.lock.release()
    assert sim.violations == []


@compiled_only
async def test_a_record_s_time_is_perf_counter_s() -> None:
    """The record reads the clock itself (where it is perf_counter's): its
    time lies between perf_counter() read before and after."""
    assert _compiled.ext is not None
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        _x, c, sub = await internals.completed_unwatched(gpu, _launch)
        tr = _trace.Tracer(limit=100)
        c.tracer = tr
        try:
            for _ in range(50):
                before = time.perf_counter()
                _compiled.ext.trace_await(c, sub, 0.0)
                after = time.perf_counter()
                assert before <= tr.ring[-1][0] <= after
        finally:
            c.tracer = None
    assert sim.violations == []


@compiled_only
def test_records_name_each_thread_s_own_task() -> None:
    """Trio runs in two threads, and one after another in the same thread:
    every await event names the task that awaited (the record keeps the last
    thread's run context, and must not hand it to another thread or run)."""
    trace = trio_cuda.trace.Trace(limit=10_000)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def program(tag: str) -> None:
        async def main() -> None:
            async with trio_cuda.open_scope(device=SimDevice(), trace=trace) as gpu:
                x = gpu.zeros(4, "f4")
                for i in range(40):
                    async with trio.open_nursery() as n:
                        n.start_soon(gpu.run, _launch(x), name=f"{tag}-{i}")
                    if i % 10 == 0:
                        await trio.to_thread.run_sync(barrier.wait, 5)

        try:
            run_bounded(main, limit=30.0)
            run_bounded(main, limit=30.0)  # (a second run in the same thread)
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=program, args=(tag,)) for tag in ("a", "b")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert errors == []
    awaits = [e for e in trace.events if e.cat == "await"]
    assert len(awaits) == 160
    by_scope: dict[int, set[str]] = {}
    for e in awaits:
        assert e.args is not None
        by_scope.setdefault(e.scope, set()).add(e.args["task"].split("-")[0])
    assert sorted(by_scope.values(), key=sorted) == [{"a"}, {"a"}, {"b"}, {"b"}]
    assert all(e.args is not None and e.args["outcome"] == "ok" for e in awaits)


@compiled_only
async def test_submissions_of_one_launch_share_their_record_and_exports_copy_it() -> None:
    """Without command ids (a GPU's host-observed times), one launch's
    submissions share their args in the ring; ``Trace.events`` and
    ``to_chrome`` hand out copies, so changing one changes nothing else."""
    trace = trio_cuda.trace.Trace()
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, trace=trace) as gpu:
        x = gpu.zeros(4, "f4")
        op = _launch(x)
        await gpu.run(op)  # (the Python record caches the plan's leases)
        gpu._trace_cmds = False  # (as a GPU scope records: no command ids)
        for _ in range(3):
            await gpu.run(op)
        kept = [e for e in trace._tracer.ring if e[1] == "submit" and e[2] == "add"]
        assert len(kept) == 4
        assert kept[1][7] is kept[2][7] is kept[3][7]
        assert kept[1][7] == {"leases": kept[0][7]["leases"], "enqueue": "add", "cmd": None, "marks": None}
        events = [e for e in trace.events if e.cat == "submit" and e.name == "add"]
        assert events[1].args == events[2].args
        assert events[1].args is not events[2].args
        assert events[1].args is not None
        events[1].args["cmd"] = "changed"
        assert kept[2][7]["cmd"] is None
        chrome = trace.to_chrome()
        for ev in chrome["traceEvents"]:
            if isinstance(ev.get("args"), dict):
                ev["args"]["mutated"] = True
        assert all("mutated" not in (e[7] or {}) for e in trace._tracer.ring)
        op2 = _launch(x)  # (a fresh launch: its own cache)
        for _ in range(3):
            await gpu.run(op2)
        kept = [e for e in trace._tracer.ring if e[1] == "submit" and e[2] == "add"]
        assert kept[-1][7] is kept[-2][7] is not kept[1][7]
    assert sim.violations == []
