"""The compiled ``Completion.scan`` (``_claunch.scan``), an awaiting task's
first look (``_claunch.look``) and the common retirement (``retire_done``)
against the Python ones, untraced and traced.

A program mixes awaited and forgotten launches on three streams, host
closures (one raising), a kernel fault, an unknown completion, and a
driver whose ``poll_marker`` raises an ``Exception`` (an unknown
completion, on both paths) or a ``KeyboardInterrupt`` (raised, on both
paths); both scans must leave the same record after every step: outcomes,
statistics, values, and the exit's errors."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import run_bounded
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import ADD_ONE
from trio_cuda import ops
from trio_cuda._core import _completion, _scope
from trio_cuda.testing import SimDevice

ADD = ADD_ONE


def _program(compiled: bool, calls: list[int], traced: bool = False) -> list[Any]:
    record: list[Any] = []
    trace = trio_cuda.trace.Trace() if traced else None
    saved = _completion.scan_streams

    def counting(completion: Any) -> bool:
        assert saved is not None
        calls.append(1)
        return saved(completion)

    saved_look = _scope.look
    saved_retire = _completion.retire_done
    _completion.scan_streams = counting if compiled else None
    _scope.look = saved_look if compiled else None
    _completion.retire_done = saved_retire if compiled else None

    async def main() -> None:
        sim = SimDevice()
        ran: list[int] = []
        async with trio_cuda.open_scope(device=sim, streams=3, trace=trace) as gpu:
            s0, s1, s2 = gpu.streams
            xs = [gpu.zeros(4, "f4") for _ in range(3)]

            def add(i: int, v: float) -> Any:
                return ADD.launch(xs[i], np.float32(v), grid=1, block=4)

            async def step(label: str, fn: Any) -> None:
                try:
                    what: Any = await fn()
                except BaseException as exc:  # KeyboardInterrupt too
                    what = (type(exc).__name__, str(exc)[:120])
                await trio.testing.wait_all_tasks_blocked()
                # (who retired the work, a waiter or the handoff, depends on timing)
                st = attrs.evolve(gpu.statistics(), retired_by_waiters=0)
                record.append((label, repr(what)[:200], st, list(ran)))

            async def burst() -> None:
                sim.hold()
                for i in range(6):
                    gpu.submit(add(i % 3, 1.0), stream=(s0, s1, s2)[i % 3])
                gpu.submit(ops.host_closure(ran.append, 1), stream=s1)
                sim.release()

            await step("burst", burst)
            await step("run", lambda: gpu.run(add(0, 2.0), stream=s0))

            def boom() -> None:
                raise ValueError("closure")

            await step("closure raises", lambda: gpu.run(ops.host_closure(boom), stream=s2))

            async def fault() -> None:
                sim.inject_fault("kernel_fault")
                await gpu.run(add(1, 1.0), stream=s1)

            await step("kernel fault", fault)

            cls = type(internals.driver_of(gpu))
            real = cls.poll_marker

            async def polls_raise(exc: BaseException, i: int, s: Any) -> None:
                me = trio.lowlevel.current_task()

                def raising(self: Any, marker: Any) -> Any:
                    if trio.lowlevel.current_task() is not me:  # (the handoff)
                        return real(self, marker)
                    raise exc

                sim.hold()  # (the work is in flight when the waiter looks)
                gpu.submit(add(i, 1.0), stream=s)
                cls.poll_marker = raising
                try:
                    await gpu.run(add(i, 1.0), stream=s)
                finally:
                    cls.poll_marker = real
                    sim.release()

            await step("poll raises an Exception", lambda: polls_raise(RuntimeError("poll"), 2, s2))
            await step("poll raises KeyboardInterrupt", lambda: polls_raise(KeyboardInterrupt(), 0, s0))
            await step("after", lambda: gpu.run(add(0, 1.0), stream=s0))
            values = [(await gpu.to_host(x)).tolist() for x in xs[:1]]
            record.append(("values", values))
        record.append(("exit", sim.violations))

    try:
        try:
            run_bounded(main, limit=20.0)
        except BaseException as exc:  # the exit's errors: the fault, the quarantine
            record.append(("raised", type(exc).__name__, str(exc)[:300]))
        if trace is not None:  # (who retired, a waiter or the handoff, depends on timing)
            retired = sorted(e.submission for e in trace.events if e.cat == "retire")
            record.append(("trace", retired, sorted(e.cat for e in trace.events)))
    finally:
        _completion.scan_streams = saved
        _scope.look = saved_look
        _completion.retire_done = saved_retire
    return record


@compiled_only
@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_compiled_and_python_scans_agree(traced: bool) -> None:
    calls: list[int] = []
    compiled = _program(True, calls, traced)
    python = _program(False, [], traced)
    assert calls  # the compiled scan ran
    assert [r[0] for r in compiled] == [r[0] for r in python]
    for a, b in zip(compiled, python, strict=True):
        assert a == b
    by_label = {r[0]: r for r in compiled}
    assert "ValueError" in by_label["closure raises"][1]
    assert "KeyboardInterrupt" in by_label["poll raises KeyboardInterrupt"][1]
    assert "CompletionUnknownError" in by_label["poll raises an Exception"][1]
    assert by_label["burst"][3] == [1]
    assert by_label["after"][2].quarantined > 0
    if traced:
        assert len(by_label["trace"][1]) >= 15


@compiled_only
async def test_prepare_records_a_lone_waiter_s_marker_only() -> None:
    """``prepare`` (before an awaiting task's first checkpoint) records the
    marker of a lone waiter's stream, as ``observe`` begins; not with
    another task runnable, a host closure due, or the marker recorded."""
    assert _completion.prepare is not None
    sim = SimDevice(batch_markers=True)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, "f4")
        await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))  # (loaded)
        c = internals.completion_of(gpu)
        sim.hold()
        try:
            launch = ADD.launch(x, np.float32(1), grid=1, block=4)
            async with trio.open_nursery() as nursery:
                sub = internals.submit_unwatched(gpu, launch)  # (as run() submits: the handoff not woken)
                nursery.start_soon(trio.sleep, 0)  # (runnable until it runs)
                _completion.prepare(c, sub)
                assert sub.marker is None  # another task is runnable
            await trio.testing.wait_all_tasks_blocked()
            sub = internals.submit_unwatched(gpu, launch)
            assert sub.marker is None
            _completion.prepare(c, sub)
            assert sub.marker is not None  # alone: recorded now
            marker = sub.marker
            _completion.prepare(c, sub)
            assert sub.marker is marker  # (recorded once)
        finally:
            sim.release()
    assert sim.violations == []


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
async def test_cancelled_at_run_s_first_checkpoint(compiled: bool) -> None:
    """Cancelled at the checkpoint ``run`` makes before its first look (the
    work held in flight): ``Cancelled`` at once, the leases still held, and
    once the device goes on everything retires, nothing leaked."""
    if compiled and _scope.look is None:
        pytest.skip("the compiled paths are not in use")
    saved = _scope.look
    _scope.look = saved if compiled else None
    try:
        sim = SimDevice()
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = gpu.zeros(4, "f4")
            await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))
            sim.hold()
            with trio.move_on_after(0.01) as cs:
                await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))
            assert cs.cancelled_caught
            st = gpu.statistics()
            assert (st.in_flight, st.leases_held) == (1, 1)
            sim.release()
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(5):
                assert (await gpu.to_host(x)).tolist() == [2.0] * 4
            assert gpu.statistics().in_flight == 0
        assert sim.violations == []
        assert sim.live_allocations == []
    finally:
        _scope.look = saved


async def test_run_from_another_trio_run_in_a_worker_thread_is_refused() -> None:
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, "f4")
        op = ADD.launch(x, np.float32(1), grid=1, block=4)

        def elsewhere() -> object:
            async def main() -> object:
                return await gpu.run(op)

            try:
                return trio.run(main)
            except Exception as exc:
                return exc

        await trio.testing.wait_all_tasks_blocked()
        before = (gpu.statistics(), sim.statistics())
        got = await trio.to_thread.run_sync(elsewhere)
        assert isinstance(got, RuntimeError), got
        assert (gpu.statistics(), sim.statistics()) == before  # nothing enqueued or retained
        await gpu.run(op)
    assert sim.violations == []


class _FailingMarkers:
    """A driver whose ``record_marker`` raises; everything else is the real one's."""

    def __init__(self, driver: Any, exc: BaseException) -> None:
        self._driver, self._exc = driver, exc

    def record_marker(self, stream: Any) -> Any:
        raise self._exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)


@compiled_only
@pytest.mark.parametrize("how", ["prepare", "Completion.flush"])
async def test_a_marker_that_cannot_be_recorded_quarantines_as_flush_does(how: str) -> None:
    """``prepare``'s compiled flush and ``Completion.flush``: a driver whose
    ``record_marker`` raises leaves the lone waiter's submission
    quarantined (its completion cannot be established), the same way; a
    KeyboardInterrupt is raised on after that, not swallowed (and the exit
    does not wait for work nothing would retire)."""
    sim = SimDevice(batch_markers=True)
    results = []
    # (the unknown completion surfaces at the exit)
    with trio.fail_after(20), pytest.raises(BaseExceptionGroup) as group:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = gpu.zeros(4, "f4")
            await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))  # (loaded)
            c = internals.completion_of(gpu)
            real = c.driver
            for exc in (RuntimeError("no marker"), KeyboardInterrupt()):
                y = gpu.zeros(4, "f4")
                await trio.testing.wait_all_tasks_blocked()  # (a lone waiter: prepare records)
                sub = internals.submit_unwatched(gpu, ADD.launch(y, np.float32(1), grid=1, block=4))
                c.driver = _FailingMarkers(real, exc)
                try:
                    if isinstance(exc, KeyboardInterrupt):
                        with pytest.raises(KeyboardInterrupt):
                            _completion.prepare(c, sub) if how == "prepare" else c.flush(sub.stream)
                    else:
                        _completion.prepare(c, sub) if how == "prepare" else c.flush(sub.stream)
                finally:
                    c.driver = real
                results.append((sub.state.name, type(sub.error).__name__, sub.marker))
            results.append(gpu.statistics().quarantined)
    assert results[0] == results[1] == ("QUARANTINED", "CompletionUnknownError", None)
    assert results[2] == 2
    assert [type(e).__name__ for e in group.value.exceptions] == ["CompletionUnknownError"] * 2
    assert sim.violations == []


@compiled_only
async def test_prepare_calls_an_overridden_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled flush makes ``Completion.flush``'s steps only while the
    class holds that function."""
    calls: list[Any] = []
    original = _completion.Completion.flush

    def flush(self: Any, s: Any) -> None:
        calls.append(s)
        original(self, s)

    monkeypatch.setattr(_completion.Completion, "flush", flush)
    sim = SimDevice(batch_markers=True)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, "f4")
        await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))
        c = internals.completion_of(gpu)
        await trio.testing.wait_all_tasks_blocked()
        calls.clear()
        sub = internals.submit_unwatched(gpu, ADD.launch(x, np.float32(1), grid=1, block=4))
        _completion.prepare(c, sub)
        assert calls == [sub.stream]
        assert sub.marker is not None
    assert sim.violations == []


def _spy_begin(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record what ``run``'s compiled start returned: "Submission" or "NoneType"."""
    saved = _scope.begin
    assert saved is not None
    got: list[str] = []

    def spy(*args: Any) -> Any:
        r = saved(*args)
        got.append(type(r).__name__)
        return r

    monkeypatch.setattr(_scope, "begin", spy)
    return got


@compiled_only
async def test_run_begins_compiled_only_where_its_checks_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """``begin`` submits a lone launch of a loaded kernel, not cancelled,
    traced or not; everything else is left to run's Python code (nothing
    submitted, no cancel point counted twice), and the outcome is the same."""
    got = _spy_begin(monkeypatch)
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, "f4")
        await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))  # (its first use: loads it)
        assert await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4)) is x
        await gpu.run(ops.fill(x, 5.0))  # not a launch
        submitted = gpu.statistics().submitted
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))  # pre-cancelled
        assert cs.cancelled_caught
        assert gpu.statistics().submitted == submitted  # (really not submitted)
        task = trio.lowlevel.current_task()
        points = task._cancel_points  # type: ignore[attr-defined]
        with trio.testing.assert_checkpoints():
            await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))
        assert task._cancel_points == points + 2  # type: ignore[attr-defined]  # (as Python: if_cancelled + checkpoint)
        assert (await gpu.to_host(x)).tolist() == [6.0] * 4
    assert got[1:] == ["Submission", "NoneType", "NoneType", "Submission"]
    trace = trio_cuda.trace.Trace()
    async with trio_cuda.open_scope(device=sim, trace=trace) as traced:
        y = traced.zeros(4, "f4")
        await traced.run(ADD.launch(y, np.float32(1), grid=1, block=4))
        await traced.run(ADD.launch(y, np.float32(1), grid=1, block=4))
    assert got[-2:] == ["Submission", "Submission"]  # (traced too: run records the wait)
    waits = [e for e in trace.events if e.cat == "await"]
    assert [e.args["outcome"] for e in waits] == ["ok", "ok"]
    assert sim.violations == []


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
async def test_a_keyboard_interrupt_recording_run_s_marker(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt out of the lone waiter's marker (``prepare``, in
    ``begin`` or in run's Python code): raised from ``run``, the submission
    quarantined (its completion unknown), and the exit does not hang."""
    if compiled and _scope.begin is None:
        pytest.skip("the compiled paths are not in use")
    if not compiled:
        monkeypatch.setattr(_scope, "begin", None)
    sim = SimDevice(batch_markers=True)
    with trio.fail_after(20), pytest.raises(BaseExceptionGroup) as group:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = gpu.zeros(4, "f4")
            await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))
            c = internals.completion_of(gpu)
            real = c.driver
            await trio.testing.wait_all_tasks_blocked()
            c.driver = _FailingMarkers(real, KeyboardInterrupt())
            try:
                with pytest.raises(KeyboardInterrupt):
                    await gpu.run(ADD.launch(x, np.float32(1), grid=1, block=4))
            finally:
                c.driver = real
            assert gpu.statistics().quarantined == 1
    assert [type(e).__name__ for e in group.value.exceptions] == ["CompletionUnknownError"]
    assert sim.violations == []


@compiled_only
async def test_run_s_compiled_start_and_look_leak_nothing() -> None:
    """Many awaited launches through ``begin``, ``prepare``'s flush and
    ``look``: the objects they read keep their reference counts, and memory
    does not grow."""
    import gc
    import sys
    import tracemalloc

    sim = SimDevice(batch_markers=True, trace_limit=0)  # (no record of each command)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, "f4")
        op = ADD.launch(x, np.float32(1), grid=1, block=4)
        for _ in range(50):
            await gpu.run(op)
        c = internals.completion_of(gpu)
        task = trio.lowlevel.current_task()
        held = (c, gpu, op, x, c.driver, gpu.streams[0], task, task._runner)  # type: ignore[attr-defined]
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        counts = [sys.getrefcount(o) for o in held]
        tracemalloc.start()
        try:
            for _ in range(50):
                await gpu.run(op)
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(2000):
                await gpu.run(op)
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert [sys.getrefcount(o) for o in held] == counts
        assert grown < 16_000, grown  # (a leaked int per run would be 2000 x 28 bytes and more)
    assert sim.violations == []
