"""Threads and several Trio runs at once, on the simulated device.

* ``gpu.statistics()`` (and a pool's) from a worker thread is refused with a
  message naming the call, the thread and the way to make it
  (``trio.from_thread.run_sync(gpu.statistics)``), however busy the loop is;
  that way works; a closed scope's final statistics may be read anywhere.
* So are a future's and a graph's ``statistics()`` (``fut.statistics``,
  ``graph.statistics`` in the hint), from a worker thread however busy the
  loop and from another Trio run; a closed scope's may be read anywhere. A
  future used from a worker thread (``wait_nowait``, a scope call) names both
  threads and the way to call it on the loop.
* One lifetime trace shared by scopes in several threads, each running its own
  ``trio.run`` (a ``Trace`` passed to each scope, or the process trace of
  ``trio_cuda.trace.enable()``), while other threads export it: no scope exit
  fails, no export fails, every scope gets its own id, no event is lost, and
  every export is a consistent snapshot.

The interpreter switches threads far more often than usual during these tests
(``sys.setswitchinterval``), so that races show up within a short run. Every
thread is bounded in time: a hang fails the test, never the suite.
"""

from __future__ import annotations

import gc
import json
import re
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import SCALE, held, run_bounded
from tests.helpers.kernels import add
from trio_cuda.testing import SimDevice, SimHost

F4 = np.float32
LIMIT = 30.0


@pytest.fixture
def switchy() -> Iterator[None]:
    """Switch threads every 20 µs instead of every 5 ms."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run_threads(targets: dict[str, Callable[[], object]], limit: float = LIMIT) -> dict[str, BaseException]:
    """Run each target in its own daemon thread at once; the exceptions they
    raised, by name. A thread still running after ``limit`` seconds fails the
    test with its stack."""
    errors: dict[str, BaseException] = {}

    def wrap(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def target() -> None:
            try:
                fn()
            except BaseException as exc:
                errors[name] = exc

        return target

    threads = [threading.Thread(target=wrap(n, fn), name=n, daemon=True) for n, fn in targets.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + limit * SCALE
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        frames = sys._current_frames()
        stacks = "\n".join(
            f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
            for t in stuck
            if t.ident in frames
        )
        pytest.fail(f"threads still running after {limit * SCALE:g} s: {stacks}")
    return errors


def formatted(errors: dict[str, BaseException]) -> str:
    return "\n".join(f"{n}: {''.join(traceback.format_exception(e))}" for n, e in errors.items())


# --------------------------------------------------------------------------- statistics() from threads

#: what the refusal must say: the call, the thread, the way to make it
REFUSAL = r"statistics.*thread.*trio\.from_thread\.run_sync\(gpu\.statistics\)"


async def _busy(gpu: trio_cuda.ResourceScope, x: trio_cuda.DeviceArray, stop: trio.Event) -> None:
    """Submit, retire and allocate until ``stop``: the scope's tables change all the time."""
    while not stop.is_set():
        futs = [gpu.submit(add(x, 1.0), stream=s) for s in gpu.streams]
        tmp = gpu.zeros(64, F4)
        await futs[-1].wait()
        tmp.close()
        await trio.lowlevel.checkpoint()


def test_statistics_from_a_worker_thread_is_refused_clearly_however_busy_the_loop(switchy: None) -> None:
    sim = SimDevice()
    calls = 300
    record: dict[str, Any] = {}

    def from_worker(gpu: trio_cuda.ResourceScope) -> None:
        refused: list[str] = []
        other: list[BaseException] = []
        accepted = 0
        for _ in range(calls):
            try:
                gpu.statistics()
            except RuntimeError as exc:
                refused.append(str(exc))
            except BaseException as exc:
                other.append(exc)
            else:
                accepted += 1
        # the way the refusal names: on the loop, a consistent snapshot each time
        seen = [trio.from_thread.run_sync(gpu.statistics) for _ in range(20)]
        record.update(refused=refused, other=other, accepted=accepted, seen=seen)
        record["thread"] = threading.current_thread().name

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim, streams=3) as gpu:
            x = await gpu.to_device(np.zeros(64, F4))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_busy, gpu, x, stop)
                await trio.to_thread.run_sync(from_worker, gpu)
                stop.set()
            record["final"] = gpu.statistics()

    run_bounded(main, limit=LIMIT)
    assert record["other"] == [], record["other"]
    assert record["accepted"] == 0
    assert len(record["refused"]) == calls
    message = record["refused"][0]
    assert re.search(REFUSAL, message), message
    assert repr(record["thread"]) in message  # the calling thread, by name
    completed = [st.completed for st in record["seen"]]
    assert completed == sorted(completed)
    assert all(st.submitted == st.completed + st.in_flight for st in record["seen"])
    assert record["final"].in_flight == 0
    assert sim.violations == []


def test_statistics_from_another_trio_run_is_refused(sim: SimDevice) -> None:
    record: dict[str, Any] = {}

    async def other(gpu: trio_cuda.ResourceScope) -> None:
        try:
            gpu.statistics()
        except RuntimeError as exc:
            record["error"] = str(exc)

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            await trio.to_thread.run_sync(trio.run, other, gpu)

    run_bounded(main, limit=LIMIT)
    assert re.search(r"statistics.*another Trio run", record["error"]), record


def test_pool_statistics_from_a_worker_thread_is_refused() -> None:
    record: dict[str, Any] = {}

    async def main() -> None:
        async with trio_cuda.open_device_pool(SimHost(2)) as pool:
            with pytest.raises(RuntimeError, match=REFUSAL):
                await trio.to_thread.run_sync(pool.statistics)
            st = await trio.to_thread.run_sync(trio.from_thread.run_sync, pool.statistics)
            record["devices"] = len(st.devices)

    run_bounded(main, limit=LIMIT)
    assert record["devices"] == 2


def test_a_closed_scopes_final_statistics_may_be_read_from_any_thread(sim: SimDevice) -> None:
    async def main() -> tuple[trio_cuda.ResourceScope, Any]:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(np.zeros(8, F4))
            await gpu.run(add(x, 1.0))
        return gpu, gpu.statistics()

    gpu, final = run_bounded(main, limit=LIMIT)  # trio.run in another thread
    assert gpu.closed
    assert gpu.statistics() == final
    assert final.completed >= 2
    assert final.live_allocations == 0


# --------------------------------------------------------------------------- futures' and graphs' statistics

#: what the refusal must say for each: the call, the thread, the way to make it
FUT_REFUSAL = (
    r"^statistics: expected a call from the Trio run that opened <ResourceScope .*\(on thread .*\), got "
    r"one from thread .*, which runs no Trio loop; call it on that loop: "
    r"trio\.from_thread\.run_sync\(fut\.statistics\)"
)
GRAPH_REFUSAL = FUT_REFUSAL.replace("fut", "graph")


async def _busy_replays(
    gpu: trio_cuda.ResourceScope, graph: trio_cuda.CudaGraph, x: trio_cuda.DeviceArray, stop: trio.Event
) -> None:
    """Replay ``graph``, submit and retire until ``stop``: the tables a
    future's and a graph's statistics read change all the time."""
    while not stop.is_set():
        futs = [gpu.submit(graph.launch()), gpu.submit(add(x, 1.0))]
        await futs[0].wait()
        await futs[1].wait()
        await trio.lowlevel.checkpoint()


def test_future_and_graph_statistics_from_a_worker_thread_are_refused_however_busy_the_loop(
    switchy: None,
) -> None:
    sim = SimDevice()
    calls = 200
    record: dict[str, Any] = {}

    def from_worker(fut: trio_cuda.DeviceFuture[Any], graph: trio_cuda.CudaGraph) -> None:
        outcomes: dict[str, list[object]] = {"fut": [], "graph": []}
        for _ in range(calls):
            for name, read in (("fut", fut.statistics), ("graph", graph.statistics)):
                try:
                    outcomes[name].append(read())
                except RuntimeError as exc:
                    outcomes[name].append(str(exc))
                except BaseException as exc:
                    outcomes[name].append(exc)
        # the way the refusal names: on the loop, a consistent snapshot each time
        record["seen"] = [trio.from_thread.run_sync(graph.statistics) for _ in range(20)]
        record["fut"] = trio.from_thread.run_sync(fut.statistics)
        record.update(outcomes=outcomes, thread=threading.current_thread().name)

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
            x = await gpu.to_device(np.zeros(64, F4))
            y = await gpu.to_device(np.zeros(64, F4))
            graph = await gpu.capture(add(y, 1.0))
            fut = gpu.submit(add(x, 1.0))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_busy_replays, gpu, graph, x, stop)
                await trio.to_thread.run_sync(from_worker, fut, graph)
                stop.set()
            record["final"] = graph.statistics()
            graph.close()

    run_bounded(main, limit=LIMIT)
    for name, pattern in (("fut", FUT_REFUSAL), ("graph", GRAPH_REFUSAL)):
        got = record["outcomes"][name]
        assert len(got) == calls
        assert all(isinstance(o, str) and re.search(pattern, o) for o in got), got[:3]
        assert repr(record["thread"]) in got[0]  # the calling thread, by name
    replays = [st.replays for st in record["seen"]]
    assert replays == sorted(replays)
    assert all(st.retained_allocations == 1 for st in record["seen"])
    assert record["fut"].state == "done"
    assert record["final"].in_flight == 0
    assert sim.violations == []


def test_future_and_graph_statistics_from_another_trio_run_are_refused(sim: SimDevice) -> None:
    record: dict[str, str] = {}

    async def other(fut: trio_cuda.DeviceFuture[Any], graph: trio_cuda.CudaGraph) -> None:
        for name, read in (("fut", fut.statistics), ("graph", graph.statistics)):
            try:
                read()
            except RuntimeError as exc:
                record[name] = str(exc)

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(np.zeros(8, F4))
            async with await gpu.capture(add(x, 1.0)) as graph:
                fut = gpu.submit(graph.launch())
                await trio.to_thread.run_sync(trio.run, other, fut, graph)
                await fut.wait()

    run_bounded(main, limit=LIMIT)
    for name in ("fut", "graph"):
        assert re.search(
            r"^statistics: expected a call from the Trio run that opened <ResourceScope .*\(on thread .*\), "
            r"got one from another Trio run, on thread '.*'; a scope belongs to the run \(and thread\) that "
            r"opened it$",
            record.get(name, ""),
        ), record


def test_a_closed_scopes_future_and_graph_statistics_may_be_read_from_any_thread(sim: SimDevice) -> None:
    async def main() -> tuple[Any, ...]:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(np.zeros(8, F4))
            graph = await gpu.capture(add(x, 1.0))
            fut = gpu.submit(graph.launch())
            await fut.wait()
            before = (fut.statistics(), graph.statistics())
        return fut, graph, before, (fut.statistics(), graph.statistics())

    fut, graph, before, final = run_bounded(main, limit=LIMIT)  # trio.run in another thread
    assert (fut.statistics(), graph.statistics()) == final
    assert final[0] == before[0]
    assert final[0].state == "done"
    assert final[1].closed  # the scope's exit closed it
    assert final[1].replays == before[1].replays == 1


def test_a_future_used_from_a_worker_thread_names_the_threads_and_the_way_to_call_it(sim: SimDevice) -> None:
    record: dict[str, str] = {}

    def from_worker(gpu: trio_cuda.ResourceScope, fut: trio_cuda.DeviceFuture[Any]) -> None:
        record["thread"] = threading.current_thread().name
        for name, call in (("wait_nowait", fut.wait_nowait), ("empty", lambda: gpu.empty(8, F4))):
            try:
                call()
            except RuntimeError as exc:
                record[name] = str(exc)
        try:
            trio.run(fut.wait)  # a Trio run of its own in the worker thread
        except RuntimeError as exc:
            record["wait"] = str(exc)

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(np.zeros(8, F4))
            with held(sim):
                fut = gpu.submit(add(x, 1.0))  # in flight: wait_nowait must look at the loop's tables
                await trio.to_thread.run_sync(from_worker, gpu, fut)
            await fut.wait()
            record["loop"] = threading.current_thread().name

    run_bounded(main, limit=LIMIT)
    head = r"expected a call from the Trio run that opened <ResourceScope sim:0 open, \d+ in flight> "
    head += rf"\(on thread {re.escape(repr(record['loop']))}\), got one from "
    mine = re.escape(repr(record["thread"]))
    assert re.search(
        rf"^wait_nowait: {head}thread {mine}, which runs no Trio loop; call it on that loop: "
        r"trio\.from_thread\.run_sync\(fut\.wait_nowait\) from a thread Trio started "
        r"\(trio\.to_thread\.run_sync\), with trio_token= from any other thread$",
        record["wait_nowait"],
    ), record
    assert re.search(
        rf"^empty: {head}thread {mine}, which runs no Trio loop; call it on that loop: "
        r"trio\.from_thread\.run_sync\(\) \(trio\.from_thread\.run\(\) for an async call\)",
        record["empty"],
    ), record
    assert re.search(
        rf"^wait: {head}another Trio run, on thread {mine}; a scope belongs to the run", record["wait"]
    ), record


def test_a_finished_future_is_read_from_a_worker_thread_only_once_its_scope_closed(sim: SimDevice) -> None:
    """Reading a finished future's outcome marks its error observed in the scope's tables:
    from a worker thread it is refused while the scope is open, and allowed once it closed."""
    record: dict[str, object] = {}

    def from_worker(fut: trio_cuda.DeviceFuture[Any], key: str) -> None:
        try:
            record[key] = fut.wait_nowait()
        except RuntimeError as exc:
            record[key] = exc

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(np.zeros(8, F4))
            fut = gpu.submit(add(x, 1.0))
            await fut.wait()
            assert fut.done()
            await trio.to_thread.run_sync(from_worker, fut, "open")
        await trio.to_thread.run_sync(from_worker, fut, "closed")

    run_bounded(main, limit=LIMIT)
    assert isinstance(record["open"], RuntimeError), record
    assert str(record["open"]).startswith("wait_nowait: expected a call from the Trio run"), record
    assert not isinstance(record["closed"], BaseException), record


# --------------------------------------------------------------------------- one trace, many threads


def _traced_program(trace: trio_cuda.trace.Trace | None, scopes: int, launches: int) -> Callable[[], None]:
    """A thread's program: ``scopes`` scopes one after the other, each with
    ``launches`` launches and an allocation per launch, on its own SimDevice."""

    async def main() -> None:
        sim = SimDevice()
        for _ in range(scopes):
            async with trio_cuda.open_scope(device=sim, streams=2, trace=trace) as gpu:
                x = await gpu.to_device(np.zeros(16, F4))
                for i in range(launches):
                    y = gpu.zeros(16, F4)
                    gpu.submit(add(x, 1.0), stream=gpu.streams[i % 2])
                    gpu.submit(add(y, 1.0), stream=gpu.streams[(i + 1) % 2])
                    y.close()
                out = await gpu.to_host(x)
            assert (out == launches).all(), out
        assert sim.violations == []
        assert sim.live_allocations == []

    return lambda: trio.run(main)


def _check_export(doc: dict[str, Any], limit: int) -> None:
    """What every export must satisfy, however it was interleaved with recording."""
    other = doc["otherData"]
    assert other["dropped"] >= 0, other
    assert other["events"] <= limit, other
    procs = Counter(e["pid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name")
    assert all(n == 1 for n in procs.values()), procs  # one process per scope id
    pids = {e["pid"] for e in doc["traceEvents"]}
    assert pids <= set(procs), (pids, procs)  # every event's scope is registered


def _exporter(
    trace: trio_cuda.trace.Trace, done: threading.Event, tmp: Path, limit: int
) -> Callable[[], None]:
    def export() -> None:
        tmp.mkdir(exist_ok=True)
        n = 0
        while not done.is_set() or n < 3:
            _check_export(trace.to_chrome(), limit)
            events = trace.events
            assert len(events) <= limit
            repr(trace)
            assert trace.dropped >= 0
            if n % 10 == 0:
                trace.write(tmp / "t.json")
                _check_export(json.loads((tmp / "t.json").read_text()), limit)
            if n == 1:
                trace.write(tmp / "t.html")
            n += 1

    return export


def _check_final(trace: trio_cuda.trace.Trace, scopes: int) -> None:
    events = trace.events
    assert trace.dropped == 0
    opened = Counter(e.scope for e in events if e.cat == "scope" and e.name == "open")
    closed = Counter(e.scope for e in events if e.cat == "scope" and e.name == "close")
    assert len(opened) == scopes, opened  # each scope its own id
    assert set(opened.values()) == {1}, opened
    assert closed == opened
    assert [e.t for e in events] == sorted(e.t for e in events)  # the ring is in time order
    _check_export(trace.to_chrome(), 10**9)


@pytest.mark.parametrize("how", ["passed", "process"])
def test_one_trace_recorded_by_several_trio_runs_while_other_threads_export_it(
    switchy: None, tmp_path: Path, how: str
) -> None:
    threads, scopes, launches = 3, 4, 25
    limit = 1_000_000
    trace = trio_cuda.trace.Trace(limit=limit) if how == "passed" else trio_cuda.trace.enable(limit=limit)
    done = threading.Event()
    programs = {
        f"run {i}": _traced_program(trace if how == "passed" else None, scopes, launches)
        for i in range(threads)
    }
    try:

        def runs() -> None:
            try:
                errors = run_threads(programs)
                assert errors == {}, formatted(errors)
            finally:
                done.set()

        errors = run_threads(
            {
                "runs": runs,
                "export 1": _exporter(trace, done, tmp_path / "1", limit),
                "export 2": _exporter(trace, done, tmp_path / "2", limit),
            }
        )
    finally:
        if how == "process":
            assert trio_cuda.trace.disable() is trace
    assert errors == {}, formatted(errors)
    _check_final(trace, threads * scopes)


def test_a_bounded_trace_stays_consistent_when_several_runs_overflow_it(
    switchy: None, tmp_path: Path
) -> None:
    limit = 500
    trace = trio_cuda.trace.Trace(limit=limit)
    done = threading.Event()
    programs = {f"run {i}": _traced_program(trace, 6, 20) for i in range(3)}

    def runs() -> None:
        try:
            errors = run_threads(programs)
            assert errors == {}, formatted(errors)
        finally:
            done.set()

    errors = run_threads({"runs": runs, "export": _exporter(trace, done, tmp_path, limit)})
    assert errors == {}, formatted(errors)
    assert len(trace.events) == limit
    doc = trace.to_chrome()
    _check_export(doc, limit)
    assert doc["otherData"]["dropped"] == trace.dropped > 0


def test_a_finalizer_recording_inside_the_recorder_neither_deadlocks_nor_breaks_it(tmp_path: Path) -> None:
    """A garbage-collection finalizer (a dropped future's) may record an event on
    a thread that is inside the recorder: copying the ring for an export, or
    searching it at a scope's exit. Here every collection on the worker records one."""
    limit = 300
    trace = trio_cuda.trace.Trace(limit=limit)
    tracer = internals.tracer_of(trace)
    worker: list[int] = []
    recorded = Counter[str]()

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and worker and threading.get_ident() == worker[0]:
            tracer.emit("drop", "dropped future", tracer.next_sid)
            recorded["drop"] += 1

    def program() -> None:
        worker.append(threading.get_ident())
        _traced_program(trace, 8, 10)()  # exits search the ring; the registries get pruned
        for _ in range(5):
            _check_export(trace.to_chrome(), limit)
            assert len(trace.events) == limit
            repr(trace)
        trace.write(tmp_path / "t.html")

    threshold = gc.get_threshold()
    gc.callbacks.append(on_collection)
    gc.set_threshold(1)  # a collection at almost every allocation
    try:
        errors = run_threads({"program": program})
    finally:
        gc.callbacks.remove(on_collection)
        gc.set_threshold(*threshold)
    assert errors == {}, formatted(errors)
    assert recorded["drop"] > 100
    assert trace.dropped == tracer.recorded - limit > 0
