"""The compiled submission of a lone kernel launch (``_claunch.submit_launch``).

It makes the steps of ``ResourceScope._submit_launch``. Random programs
compare it with the Python path in ``test_lease_paths.py``; here: each way a
submission can go wrong gives the same error, leaves the same state and
records the same trace on both paths, the driver runs under KI protection
on both, and nothing leaks."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import run_bounded
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import stub_source
from trio_cuda import In, InOut, Scalar
from trio_cuda._core import _compiled, _scope
from trio_cuda.testing import SimDevice


def _ref(x: Any, y: Any, v: Any) -> None:
    y[:] = x + v


K = trio_cuda.Kernel.from_source(
    stub_source("k"), "k", params=[In("f4"), InOut("f4"), Scalar("f4")], reference=_ref
)


class Garbage:
    """A policy that returns what it is told to."""

    def __init__(self, give: Callable[[Any], Any]) -> None:
        self.give = give

    def choose(self, streams: Any, op: Any) -> Any:
        return self.give(streams)

    def __repr__(self) -> str:
        return "Garbage()"


def _record(gpu: Any, sim: SimDevice, what: Any) -> tuple[Any, ...]:
    return (
        what,
        gpu.statistics(),
        internals.submissions_numbered(gpu),
        [s.statistics() for s in gpu.streams],
        sim.statistics(),
    )


def _interrupt(streams: Any) -> Any:
    raise KeyboardInterrupt


def _scenario(compiled: bool, traced: bool, whole: bool | None = None) -> list[tuple[Any, ...]]:
    """Each way a lone launch's submission can go: its record on one path
    (traced: with the trace's events, their times left out). ``whole``:
    ``submit``'s compiled steps (``submit_whole``) on or off; by default as
    ``compiled`` (the submission of the launch itself)."""
    records: list[tuple[Any, ...]] = []
    trace = trio_cuda.trace.Trace() if traced else None
    saved, saved_whole = _scope.submit_launch, _scope.submit_whole
    _scope.submit_launch = saved if compiled else None
    _scope.submit_whole = saved_whole if (compiled if whole is None else whole) else None

    async def main() -> None:
        sim = SimDevice()
        give: list[Callable[[Any], Any]] = [lambda streams: streams[1]]
        policy = Garbage(lambda streams: give[0](streams))
        async with (
            trio_cuda.open_scope(device=sim, streams=2, policy=policy, trace=trace) as gpu,
            trio_cuda.open_scope(device=SimDevice()) as other,
        ):
            x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
            op = K.launch(x, y, np.float32(1), grid=1, block=4)
            await gpu.load(K)
            await trio.testing.wait_all_tasks_blocked()

            def attempt(label: str, fn: Callable[[], Any]) -> None:
                try:
                    fn()
                    what: Any = "ok"
                except BaseException as exc:  # KeyboardInterrupt too: both paths raise it alike
                    what = (type(exc).__name__, str(exc), type(exc.__context__).__name__)
                records.append(_record(gpu, sim, (label, what)))

            attempt("policy", lambda: gpu.submit(op))
            attempt("pinned", lambda: gpu.submit(op, stream=gpu.streams[0]))
            attempt("fresh", lambda: gpu.submit(K.launch(y, x, np.float32(2), grid=1, block=4)))
            big = K.launch(y, x, np.float32(2), grid=1 << 30, block=1024, cooperative=True)
            attempt("over the device's limits", lambda: gpu.submit(big))
            attempt("fresh again", lambda: gpu.submit(K.launch(y, x, np.float32(2), grid=1, block=4)))
            for label, bad in [
                ("policy gives an int", lambda streams: 3),
                ("policy gives another scope's stream", lambda streams: other.streams[0]),
                ("policy raises", lambda streams: 1 / 0),
                ("policy raises KeyboardInterrupt", _interrupt),
            ]:
                give[0] = bad
                attempt(label, lambda: gpu.submit(op))
            give[0] = lambda streams: streams[0]
            attempt("stream of another scope", lambda: gpu.submit(op, stream=other.streams[0]))
            attempt("stream not a stream", lambda: gpu.submit(op, stream="s"))  # type: ignore[arg-type]
            attempt("another op", lambda: gpu.submit(trio_cuda.ops.value(1), stream=gpu.streams[0]))
            attempt("not an op", lambda: gpu.submit(3))  # type: ignore[arg-type]
            attempt("a builder", lambda: gpu.submit(K.builder()))  # type: ignore[arg-type]
            elsewhere: list[BaseException] = []

            def in_thread() -> None:
                try:
                    gpu.submit(op)
                except BaseException as exc:  # (recorded on the loop's thread)
                    elsewhere.append(exc)

            await trio.to_thread.run_sync(in_thread)

            def again() -> None:
                raise elsewhere[0]

            attempt("from a worker thread", again if elsewhere else lambda: None)
            attempt(
                "inside a then closure",
                lambda: gpu.submit(trio_cuda.ops.value(1).then(lambda v: gpu.submit(op))),
            )
            sim.inject_fault("launch_error")
            attempt("launch error", lambda: gpu.submit(op))
            cls = type(internals.driver_of(gpu))
            real = cls.launch

            def interrupted(*args: Any) -> None:
                raise KeyboardInterrupt

            cls.launch = interrupted
            try:
                attempt("interrupted launch", lambda: gpu.submit(op))
            finally:
                cls.launch = real
            await trio.testing.wait_all_tasks_blocked()
            records.append(_record(gpu, sim, "settled"))
            await gpu.run(op)
            records.append(("values", (await gpu.to_host(x)).tolist(), (await gpu.to_host(y)).tolist()))
        records.append(("exit", sim.violations, sim.live_allocations))
        if trace is not None:
            # (an await's args hold its time; who retired, a waiter or the
            # handoff, depends on timing)
            events = [
                (
                    e.cat,
                    "" if e.cat == "retire" else e.name,
                    e.stream,
                    e.submission,
                    None if e.cat == "await" else e.args,
                )
                for e in trace.events
            ]
            records.append(("trace", events))

    try:
        try:
            run_bounded(main, limit=20.0)
        except BaseException as exc:  # the exit reports the launch errors nobody awaited
            records.append(("raised", type(exc).__name__, repr(exc)[:300]))
    finally:
        _scope.submit_launch, _scope.submit_whole = saved, saved_whole
    return records


@compiled_only
@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_compiled_and_python_submissions_agree_on_every_outcome(traced: bool) -> None:
    compiled = _scenario(True, traced)
    python = _scenario(False, traced)
    assert [r[0] for r in compiled] == [r[0] for r in python]
    for a, b in zip(compiled, python, strict=True):
        assert a == b
    # ``submit``'s compiled steps around the Python submission of the launch
    assert _scenario(False, traced, whole=True) == python
    outcomes = dict(r[0] for r in compiled if isinstance(r[0], tuple))
    assert outcomes["policy"] == outcomes["pinned"] == outcomes["fresh"] == outcomes["fresh again"] == "ok"
    assert outcomes["over the device's limits"][0] == "KernelArgumentError"
    assert outcomes["policy gives an int"][0] == "TypeError"
    assert outcomes["policy gives another scope's stream"][0] == "ValueError"
    assert outcomes["policy raises"][0] == "ZeroDivisionError"
    assert outcomes["policy raises KeyboardInterrupt"][0] == "KeyboardInterrupt"
    assert outcomes["stream of another scope"][0] == "ValueError"
    assert outcomes["stream not a stream"][0] == "TypeError"
    assert outcomes["launch error"][0] == "LaunchError"
    assert outcomes["interrupted launch"][0] == "KeyboardInterrupt"
    assert outcomes["another op"] == "ok"
    assert outcomes["not an op"][0] == outcomes["a builder"][0] == "TypeError"
    assert outcomes["from a worker thread"][0] == "RuntimeError"
    assert outcomes["inside a then closure"][0] == "RuntimeError"
    records = dict((r[0], r) for r in compiled if isinstance(r[0], str))
    assert records["values"] == ("values", [3.0] * 4, [4.0] * 4)
    assert records["exit"] == ("exit", [], [])
    if traced:
        cats = [e[0] for e in records["trace"][1]]
        assert cats.count("submit") >= 4
        assert "error" in cats


@compiled_only
async def test_the_driver_runs_under_ki_protection_traced_or_not() -> None:
    seen: list[bool] = []
    made: list[object] = []
    real = _scope.submit_launch
    assert real is not None

    def counting(*args: Any) -> Any:
        assert real is not None
        sub = real(*args)
        made.append(sub)
        return sub

    trace = trio_cuda.trace.Trace()
    _scope.submit_launch = counting
    try:
        for traced in (False, True):
            sim = SimDevice()
            async with trio_cuda.open_scope(device=sim, trace=trace if traced else None) as gpu:
                x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
                cls = type(internals.driver_of(gpu))
                launch = cls.launch

                def watched(*args: Any, launch: Any = launch) -> Any:
                    seen.append(trio.lowlevel.currently_ki_protected())
                    return launch(*args)

                cls.launch = watched
                try:
                    await gpu.run(K.launch(x, y, np.float32(1), grid=1, block=4))
                    await gpu.submit(K.launch(x, y, np.float32(1), grid=1, block=4)).wait()
                finally:
                    cls.launch = launch
            assert sim.violations == []
    finally:
        _scope.submit_launch = real
    assert seen == [True, True, True, True]  # (run and submit, untraced and traced)
    assert len(made) == 4
    assert {type(sub).__name__ for sub in made} == {"Submission"}
    assert any(e.cat == "submit" for e in trace.events)


@compiled_only
async def test_a_submission_s_future() -> None:
    """``future_of`` makes the future ``DeviceFuture._create`` makes."""
    assert _compiled.ext is not None
    assert _scope.future_of is _compiled.ext.future_of
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
        fut = gpu.submit(K.launch(x, y, np.float32(2), grid=1, block=4))
        assert type(fut) is trio_cuda.DeviceFuture
        sub = fut._sub
        again = _compiled.ext.future_of(sub)
        assert type(again) is trio_cuda.DeviceFuture
        assert again._sub is sub
        import weakref

        assert weakref.ref(again)() is again
        assert await again.wait() is y
        assert await fut.wait() is y
        assert list(await gpu.to_host(y)) == [2.0] * 4
        with pytest.raises(TypeError, match="expected a Submission"):
            _compiled.ext.future_of(object())


@compiled_only
async def test_compiled_submission_leaks_nothing() -> None:
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
        op = K.launch(x, y, np.float32(1), grid=1, block=4)
        await gpu.run(op)
        s = gpu.streams[1]
        driver = internals.driver_of(gpu)
        function = internals.loaded_function(gpu, K)

        def counts() -> list[int]:
            gc.collect()
            # (not the scope and its components: the handoff task's frames and
            # the current-scope context variable refer to them, more or less
            # depending on where the handoff waits, on either path)
            held = (s, op, op.prepared, function, driver, x, y, x._alloc, y._alloc)
            return [sys.getrefcount(o) for o in held]

        before = counts()
        for _ in range(100):
            await gpu.run(op)
            await gpu.run(op, stream=s)
        futures = [gpu.submit(op) for _ in range(20)]
        for f in futures:
            await f.wait()
        del futures, f
        for _ in range(3):
            sim.inject_fault("launch_error")
            with pytest.raises(trio_cuda.LaunchError):
                await gpu.run(op, stream=s)
        with pytest.raises(TypeError):
            gpu.submit(op, stream=3)  # type: ignore[arg-type]
        await trio.testing.wait_all_tasks_blocked()
        assert counts() == before
        assert gpu.statistics().in_flight == 0
    assert sim.violations == []


@compiled_only
async def test_fresh_launch_of_last_checked_shape_skips_function_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KernelTable.function_for`` runs for a shape not checked last (and
    for a launch the scope has not loaded); a fresh launch of the last
    checked shape finds its function without it, and keeps it as the
    Python path keeps it."""
    from trio_cuda._core._kernels import KernelTable

    calls: list[object] = []
    real = KernelTable.function_for

    def counting(self: Any, prepared: Any) -> Any:
        calls.append(prepared.config)
        return real(self, prepared)

    monkeypatch.setattr(KernelTable, "function_for", counting)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
        first = K.launch(x, y, np.float32(1), grid=1, block=4)
        await gpu.run(first)
        assert len(calls) == 1
        again = K.launch(x, y, np.float32(1), grid=1, block=4)
        await gpu.run(again)
        assert len(calls) == 1
        assert again.prepared.ready == first.prepared.ready
        other = K.launch(x, y, np.float32(1), grid=2, block=2)
        await gpu.run(other)
        await gpu.run(K.launch(x, y, np.float32(1), grid=1, block=4))  # (no longer the last checked)
        assert len(calls) == 3


@compiled_only
async def test_the_kernel_table_s_memo_follows_its_tables() -> None:
    """The compiled path remembers its last lookups (``KernelTable.hot``):
    set by a fresh launch of the last checked shape, reset by every change
    to the tables, and never answering for another shape or kernel."""
    W = trio_cuda.Kernel.from_source(
        stub_source("w"),
        "w",
        params=[trio_cuda.InOut("f4"), trio_cuda.Scalar("i4")],
        reference=trio_cuda.NO_REFERENCE,
    )
    async with trio_cuda.open_scope(device="sim") as gpu:
        table = gpu._kernels
        x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
        await gpu.run(K.launch(x, y, np.float32(1), grid=1, block=4))
        assert table.hot is None  # (checked by the Python method: nothing remembered yet)
        fresh = K.launch(x, y, np.float32(1), grid=1, block=4)
        await gpu.submit(fresh).wait()
        assert table.hot is not None
        assert table.hot[:3] == (K, fresh.prepared.config, K.plan)
        assert table.hot[3] is fresh.prepared.ready is table.ready[K]
        again = K.launch(x, y, np.float32(1), grid=1, block=4)
        await gpu.submit(again).wait()
        assert again.prepared.ready is fresh.prepared.ready
        other = K.launch(x, y, np.float32(1), grid=2, block=2)  # another shape: checked, and the memo reset
        await gpu.submit(other).wait()
        assert table.hot is None
        assert table.last_checked[K][0] is other.prepared.config
        await gpu.submit(K.launch(x, y, np.float32(1), grid=2, block=2)).wait()
        assert table.hot is not None
        assert table.hot[1] is other.prepared.config
        await gpu.run(W.launch(x, 4, grid=1, block=4))  # another kernel loaded and checked
        assert table.hot is None
        assert table.function(W) is table.functions[W]  # (already loaded: no change, the memo stays)
        await gpu.submit(W.launch(x, 4, grid=1, block=4)).wait()
        assert table.hot is not None
        assert table.hot[0] is W
        await gpu.submit(K.launch(x, y, np.float32(1), grid=2, block=2)).wait()
        assert table.hot is not None
        assert table.hot[0] is K
        fn = table.functions[K]
    assert table.hot is None  # (the exit unloaded every function)
    assert fn not in table.functions.values()


@compiled_only
async def test_a_global_patched_between_submissions_is_read_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled submission reads its module globals (``take_whole``,
    ``take_launch_leases``, ``submit_launch``) as they are at each call,
    though it remembers them between calls."""
    from trio_cuda._core import _submit

    calls: list[int] = []
    real = _submit.take_whole
    assert real is not None

    def spy(*args: Any) -> bool:
        calls.append(1)
        return real(*args)

    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
        for _ in range(2):  # (remembered)
            await gpu.submit(K.launch(x, y, np.float32(1), grid=1, block=4)).wait()
        monkeypatch.setattr(_submit, "take_whole", spy)
        await gpu.submit(K.launch(x, y, np.float32(1), grid=1, block=4)).wait()
        assert calls == [1]
        monkeypatch.setattr(_submit, "take_whole", None)  # (the Python path's leases)
        await gpu.submit(K.launch(x, y, np.float32(1), grid=1, block=4)).wait()
        monkeypatch.undo()
        await gpu.submit(K.launch(x, y, np.float32(1), grid=1, block=4)).wait()
        assert calls == [1]
        seen: list[int] = []
        real_launch = _scope.submit_launch
        monkeypatch.setattr(_scope, "submit_launch", lambda *a: seen.append(1) or real_launch(*a))
        await gpu.submit(K.launch(x, y, np.float32(1), grid=1, block=4)).wait()
        assert seen == [1]
        assert gpu.statistics().leases_held == 0


def _unsafe_program(compiled: bool) -> list[Any]:
    """``unsafe.async_on`` each way it can go, on one path: the outcomes and
    the device's record."""
    record: list[Any] = []
    saved = _scope.enqueue_unsafe
    _scope.enqueue_unsafe = saved if compiled else _scope.enqueue_unsafe_py

    async def main() -> None:
        sim = SimDevice()
        async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
            x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
            s = gpu.streams[1]
            await gpu.run(K.launch(x, y, np.float32(0), grid=1, block=4))  # (loaded, settled)

            def attempt(label: str, fn: Callable[[], Any]) -> None:
                try:
                    what: Any = repr(fn())
                except BaseException as exc:
                    what = (type(exc).__name__, str(exc))
                record.append((label, what, sim.statistics()))

            attempt(
                "launch", lambda: trio_cuda.unsafe.async_on(K.launch(x, y, np.float32(1), grid=1, block=4), s)
            )
            attempt(
                "fresh shape",
                lambda: trio_cuda.unsafe.async_on(K.launch(x, y, np.float32(1), grid=2, block=2), s),
            )
            attempt("a fill", lambda: trio_cuda.unsafe.async_on(trio_cuda.ops.fill(x, 2.0), s))
            attempt("a builder", lambda: trio_cuda.unsafe.async_on(K.builder(), s))  # type: ignore[arg-type]
            attempt("not an op", lambda: trio_cuda.unsafe.async_on(3, s))  # type: ignore[arg-type]
            sim.inject_fault("launch_error")
            attempt(
                "launch error",
                lambda: trio_cuda.unsafe.async_on(K.launch(x, y, np.float32(1), grid=1, block=4), s),
            )
            op = K.launch(x, y, np.float32(1), grid=1, block=4)
            thread = await trio.to_thread.run_sync(_outcome_of, lambda: trio_cuda.unsafe.async_on(op, s))
            record.append(("from a thread", thread))
            await trio.testing.wait_all_tasks_blocked()
        attempt("after the exit", lambda: trio_cuda.unsafe.async_on(op, s))
        record.append(("exit", sim.violations, sim.live_allocations))

    try:
        run_bounded(main, limit=20.0)
    finally:
        _scope.enqueue_unsafe = saved
    return record


def _outcome_of(fn: Callable[[], Any]) -> Any:
    try:
        return repr(fn())
    except BaseException as exc:
        return (type(exc).__name__, str(exc))


@compiled_only
def test_compiled_and_python_async_on_agree() -> None:
    assert _scope.enqueue_unsafe is not _scope.enqueue_unsafe_py
    compiled, python = _unsafe_program(True), _unsafe_program(False)
    assert compiled == python
    outcomes = {r[0]: r[1] for r in compiled}
    assert outcomes["launch"].startswith("<DeviceArray")
    assert outcomes["a builder"][0] == outcomes["not an op"][0] == "TypeError"
    assert outcomes["launch error"][0] == "LaunchError"
    assert outcomes["from a thread"][0] == "RuntimeError"
    assert outcomes["after the exit"][0] == "ScopeClosedError"
