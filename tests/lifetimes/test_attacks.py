"""Regression tests for defects found by attacking the runtime, on the simulated device.

Each section attacks one defect and checks the behaviour the fix promises:

1. a host closure (or a simulated kernel's reference) raising a BaseException
   that is not an Exception must not kill the scope's completion handoff: the
   error reaches the awaiting task (or the exit group) and the scope goes on;
2. a scope used from another Trio run is refused before anything is enqueued;
3. the synchronous API called from a worker thread is refused, and
   ``arr.close()`` from a worker thread never frees on that thread;
4. one ``open_scope()`` / ``open_device_pool()`` manager cannot be entered
   twice, nested or one after the other;
5. a graph replay whose completion is unknown keeps the graph's kernel module
   loaded at scope exit;
6. work conflicting with in-flight work whose marker already reports
   "unknown" (not yet quarantined by the handoff) fails with
   ``CompletionUnknownError`` and enqueues nothing;
7. ``drain_timeout=0`` does not quarantine work the device already finished;
8. ``drain_timeout`` and ``streams`` are validated (NaN, bools, ...);
9. a scheduling policy that returns something other than one of the scope's
   streams is refused naming the policy, with nothing enqueued or leaked;
10. ``submit(launch, stream=<not a Stream>)`` is a ``TypeError``;
11. a device pool routes ``graph.launch()`` to the scope that captured it.

Programs that may hang at scope exit (a shielded wait) run under
``run_bounded`` (see ``helpers.guard``), which fails the test instead of the suite.
"""

from __future__ import annotations

import math
import re
import threading
import warnings

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import Hang, run_bounded
from tests.helpers.kernels import ADD, COPY, add, copy, stub_source
from trio_cuda import InOut, Scalar, ops
from trio_cuda._backends.sim.engine import SimEngine
from trio_cuda.testing import SimDevice, SimHost

F4 = np.float32
N = 64
LIMIT = 5.0
#: what a refusal of use from another thread or Trio run should mention
LOOSE = r"(?i)trio run|thread"


def host(value: float | None = None, n: int = N) -> np.ndarray:
    if value is None:
        return np.arange(n, dtype=F4)
    return np.full(n, value, dtype=F4)


def addrs(sim: SimDevice) -> set[int]:
    return {a.ptr for a in sim.live_allocations}


def contains(exc: BaseException | None, cls: type[BaseException]) -> bool:
    """``exc`` is a ``cls``, or a group containing one (at any depth)."""
    if isinstance(exc, cls):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(contains(e, cls) for e in exc.exceptions)
    return False


def leaves(exc: BaseException) -> list[BaseException]:
    """The non-group exceptions inside ``exc``."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def outcome(main, *args, limit: float = LIMIT) -> tuple[object, BaseException | None]:
    """``trio.run(main, *args)`` under a hard limit: ``(value, None)`` or
    ``(None, exception)``. A hang, an assertion or a ``pytest.fail`` inside
    fails the test; any other exception (KeyboardInterrupt and SystemExit
    included) is returned, never re-raised into pytest."""
    try:
        return run_bounded(main, *args, limit=limit, fail=False), None
    except Hang:
        raise
    except (AssertionError, pytest.fail.Exception):
        raise
    except BaseException as exc:
        return None, exc


async def settle(*scopes: trio_cuda.ResourceScope) -> None:
    """Wait until the handoff tasks retired everything in flight."""
    with trio.fail_after(LIMIT):
        while any(s.statistics().in_flight for s in scopes):  # noqa: ASYNC110 - polling public statistics
            await trio.sleep(0.001)


# --------------------------------------------------------------------------- 1: BaseException in host code


class Boom(BaseException):
    """A BaseException that is not an Exception."""


BASE_EXCEPTIONS = pytest.mark.parametrize(
    "cls", [KeyboardInterrupt, SystemExit, Boom], ids=["KeyboardInterrupt", "SystemExit", "Boom"]
)


def raiser(cls: type[BaseException]):
    def fn() -> None:
        raise cls("raised by a host closure")

    return fn


@BASE_EXCEPTIONS
def test_host_closure_base_exception_is_raised_by_run(sim, cls):
    seen: list[object] = []

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            try:
                await gpu.run(ops.host_closure(raiser(cls)))
            except BaseException as exc:
                seen.append(exc)
                raise
            seen.append("returned")

    _, exc = outcome(main)
    assert len(seen) == 1, seen
    assert isinstance(seen[0], cls), f"run() raised {seen[0]!r}, expected a {cls.__name__}"
    assert contains(exc, cls), f"the scope let {exc!r} out, expected a {cls.__name__} (or a group of it)"
    assert all(isinstance(e, cls) for e in leaves(exc)), exc
    assert sim.live_allocations == []


@BASE_EXCEPTIONS
def test_host_closure_base_exception_nobody_awaited_comes_out_of_the_exit(sim, cls):
    record: dict[str, object] = {}

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
            s0 = gpu.streams[0]
            x = await gpu.to_device(host(), stream=s0)
            gpu.submit(ops.host_closure(raiser(cls)), stream=s0)
            # after the closure on its stream: the stream is released, the work runs
            await gpu.submit(add(x, 1.0), stream=s0).wait()
            record["x"] = await gpu.to_host(x, stream=s0)

    _, exc = outcome(main)
    assert isinstance(exc, BaseExceptionGroup), f"expected a BaseExceptionGroup at exit, got {exc!r}"
    assert contains(exc, cls), exc
    assert all(isinstance(e, cls) for e in leaves(exc)), exc
    np.testing.assert_array_equal(record["x"], host() + 1)
    assert sim.live_allocations == []


@BASE_EXCEPTIONS
def test_handoff_survives_a_host_closure_base_exception(sim, cls):
    results: dict[str, object] = {}

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            y = gpu.zeros(N, F4)
            try:
                await gpu.run(ops.host_closure(raiser(cls)))
            except cls:
                results["raised"] = True
            # later work on the same scope: the handoff must be alive
            await gpu.run(add(x, 1.0))
            fut = gpu.submit(ops.copy(y, x))
            assert await fut.wait() is y
            results["closure"] = await gpu.run(ops.host_closure(lambda: 42))
            results["y"] = await gpu.to_host(y)

    _, exc = outcome(main)
    assert results.get("raised") is True, (results, exc)
    assert results.get("closure") == 42, (results, exc)
    np.testing.assert_array_equal(results["y"], host() + 1)
    # the error was observed: the exit raises nothing else (at most the same error again)
    assert exc is None or all(isinstance(e, cls) for e in leaves(exc)), exc
    assert sim.live_allocations == []


def _interrupt_ref(x, n):
    raise KeyboardInterrupt("raised by a kernel's reference")


INTERRUPT = trio_cuda.Kernel.from_source(
    stub_source("interrupting"),  # a kernel whose simulated reference raises KeyboardInterrupt
    "interrupting",
    params=[InOut("f4"), Scalar("i4")],
    reference=_interrupt_ref,
)


@pytest.mark.parametrize("how", ["run", "submit"])
def test_kernel_reference_raising_keyboard_interrupt_does_not_kill_the_handoff(how):
    sim = SimDevice(kernel_time=0.001)  # the reference runs inside the handoff's wait

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            launch = INTERRUPT.launch(x, N, grid=1, block=N)
            if how == "run":
                await gpu.run(launch)
            else:
                fut = gpu.submit(launch)
                await fut.wait()

    _, exc = outcome(main)
    assert contains(exc, KeyboardInterrupt), f"expected a KeyboardInterrupt (or a group of it), got {exc!r}"
    assert sim.violations == []
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- 2: another Trio run


OTHER_RUN_CALLS = ["submit_launch", "submit_fill", "empty", "run"]


@pytest.mark.parametrize("call", OTHER_RUN_CALLS)
def test_scope_used_from_another_trio_run_is_refused(sim, call):
    record: dict[str, object] = {}

    async def other(gpu: trio_cuda.ResourceScope, x) -> None:
        try:
            if call == "submit_launch":
                gpu.submit(add(x, 1.0))
            elif call == "submit_fill":
                gpu.submit(ops.fill(x, 5.0))
            elif call == "empty":
                gpu.empty(N, F4)
            else:
                await gpu.run(add(x, 1.0))
        except RuntimeError as exc:
            record["error"] = exc
        except Exception as exc:
            record["other"] = exc
        else:
            record["accepted"] = True

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            await gpu.load(ADD, COPY)  # loading modules is not enqueueing: keep it out of the comparison
            await settle(gpu)
            before = (gpu.statistics().submitted, sim.statistics(), addrs(sim))
            await trio.to_thread.run_sync(trio.run, other, gpu, x)
            record["before"] = before
            record["after"] = (gpu.statistics().submitted, sim.statistics(), addrs(sim))
            record["x"] = await gpu.to_host(x)
        record["exited"] = True

    _, exc = outcome(main)
    assert exc is None, f"the owner's run failed: {exc!r}"
    assert "accepted" not in record, record
    assert "other" not in record, record
    err = record.get("error")
    assert isinstance(err, RuntimeError), record
    assert re.search(LOOSE, str(err)), err
    assert record["after"] == record["before"], "something was enqueued or allocated"
    np.testing.assert_array_equal(record["x"], host())
    assert record.get("exited") is True
    assert sim.violations == []
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- 3: worker threads


THREAD_CALLS = {
    "submit_launch": lambda gpu, x: gpu.submit(add(x, 1.0)),
    "submit_fill": lambda gpu, x: gpu.submit(ops.fill(x, 5.0)),
    "empty": lambda gpu, x: gpu.empty(N, F4),
    "zeros": lambda gpu, x: gpu.zeros(N, F4),
    "full": lambda gpu, x: gpu.full(N, 3.0, F4),
    "empty_like": lambda gpu, x: gpu.empty_like(x),
}


@pytest.mark.parametrize("call", list(THREAD_CALLS))
def test_sync_api_from_a_worker_thread_is_refused(sim, call):
    record: dict[str, object] = {}

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            await gpu.load(ADD, COPY)  # loading modules is not enqueueing: keep it out of the comparison
            await settle(gpu)
            before = (gpu.statistics().submitted, sim.statistics(), addrs(sim))
            try:
                await trio.to_thread.run_sync(THREAD_CALLS[call], gpu, x)
            except RuntimeError as exc:
                record["error"] = exc
            except Exception as exc:
                record["other"] = exc
            else:
                record["accepted"] = True
            record["before"] = before
            record["after"] = (gpu.statistics().submitted, sim.statistics(), addrs(sim))
            # the scope is intact: work from the loop thread still runs
            await gpu.run(add(x, 1.0))
            record["x"] = await gpu.to_host(x)
        record["exited"] = True

    _, exc = outcome(main)
    assert exc is None, f"the scope's run failed: {exc!r}"
    assert "accepted" not in record, record
    assert "other" not in record, record
    err = record.get("error")
    assert isinstance(err, RuntimeError), record
    assert re.search(LOOSE, str(err)), err
    assert record["after"] == record["before"], "something was enqueued or allocated"
    np.testing.assert_array_equal(record["x"], host() + 1)
    assert record.get("exited") is True
    assert sim.violations == []
    assert sim.live_allocations == []


def test_array_close_from_a_worker_thread_frees_on_the_loop_thread(monkeypatch: pytest.MonkeyPatch):
    # SimDevice is final: record the thread of every free by patching its engine's class for this test
    frees: list[tuple[int, int]] = []
    real_free = SimEngine.free

    def recording_free(self: SimEngine, ptr: int, nbytes: int) -> None:
        frees.append((ptr, threading.get_ident()))
        real_free(self, ptr, nbytes)

    monkeypatch.setattr(SimEngine, "free", recording_free)
    sim = SimDevice()
    record: dict[str, object] = {}

    async def main() -> None:
        record["loop"] = threading.get_ident()
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            y = await gpu.to_device(host())
            record["ptrs"] = {x.ptr, y.ptr}
            await settle(gpu)
            await trio.to_thread.run_sync(x.close)  # must not raise
            sim.hold()
            fut = gpu.submit(add(y, 1.0))  # y in flight: its close must defer the free
            await trio.to_thread.run_sync(y.close)
            record["y_live_while_in_flight"] = y.ptr in addrs(sim)
            sim.release()
            await fut.wait()
            await gpu.run(ops.value(None))

    _, exc = outcome(main)
    assert exc is None, repr(exc)
    assert {p for p, _ in frees} == record["ptrs"]
    wrong = [hex(p) for p, t in frees if t != record["loop"]]
    assert wrong == [], f"freed on a worker thread: {wrong}"
    assert record["y_live_while_in_flight"] is True
    assert sim.violations == []
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- 4: entering a manager twice


def test_open_scope_manager_entered_twice_nested_is_refused(sim):
    record: dict[str, object] = {}

    async def main() -> None:
        cm = trio_cuda.open_scope(device=sim)
        async with cm as a:
            x = await a.to_device(host())
            try:
                async with cm as b:
                    record["inner"] = b
            except RuntimeError as exc:
                record["error"] = exc
            sim.hold()
            a.submit(add(x, 1.0))  # in flight at exit: the outer exit must drain it
            trio.lowlevel.current_task().parent_nursery.start_soon(_release_later, sim)
        record["a_closed"] = a.closed
        record["stats"] = a.statistics()

    _, exc = outcome(main)
    assert exc is None, f"the run failed (TrioInternalError?): {exc!r}"
    assert "inner" not in record, "the second entry of the same manager was accepted"
    assert isinstance(record.get("error"), RuntimeError), record
    assert record["a_closed"] is True
    st = record["stats"]
    assert (st.in_flight, st.quarantined, st.live_allocations) == (0, 0, 0)
    assert sim.violations == []
    assert sim.live_allocations == []
    assert sim.statistics().kernel_unloads == sim.statistics().kernel_loads


async def _release_later(sim: SimDevice) -> None:
    await trio.sleep(0.02)
    sim.release()


def test_open_scope_manager_entered_again_after_exit_is_refused(sim):
    record: dict[str, object] = {}

    async def main() -> None:
        cm = trio_cuda.open_scope(device=sim)
        async with cm as a:
            x = await a.to_device(host())
            await a.run(add(x, 1.0))
        try:
            async with cm as b:
                record["second"] = b
                b.zeros(N, F4)
        except RuntimeError as exc:
            record["error"] = exc

    _, exc = outcome(main)
    assert exc is None, repr(exc)
    assert "second" not in record, "the manager was entered a second time"
    assert isinstance(record.get("error"), RuntimeError), record
    assert sim.live_allocations == []


@pytest.mark.parametrize("order", ["nested", "sequential"])
def test_open_device_pool_manager_entered_twice_is_refused(order):
    sims = SimHost(2)
    record: dict[str, object] = {}

    async def main() -> None:
        cm = trio_cuda.open_device_pool(sims)
        async with cm as pool:
            x = await pool[1].to_device(host())
            if order == "nested":
                try:
                    async with cm as inner:
                        record["inner"] = inner
                except RuntimeError as exc:
                    record["error"] = exc
            await pool.run(add(x, 1.0))
            record["x"] = await pool[1].to_host(x)
        record["closed"] = [s.closed for s in pool]
        if order == "sequential":
            try:
                async with cm as again:
                    record["inner"] = again
            except RuntimeError as exc:
                record["error"] = exc

    _, exc = outcome(main)
    assert exc is None, f"the run failed (TrioInternalError?): {exc!r}"
    assert "inner" not in record, "the pool manager was entered a second time"
    assert isinstance(record.get("error"), RuntimeError), record
    np.testing.assert_array_equal(record["x"], host() + 1)
    assert record["closed"] == [True, True]
    assert sims.violations == []
    assert [d.live_allocations for d in sims] == [[], []]


# --------------------------------------------------------------------------- 5: quarantined graph replays


@pytest.mark.parametrize("observed", [True, False], ids=["awaited", "unobserved"])
def test_unknown_replay_keeps_the_graph_kernel_module_loaded(sim, observed):
    record: dict[str, object] = {}

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            record["gpu"] = gpu
            x = gpu.zeros(N, F4)
            graph = await gpu.capture(add(x, 1.0))
            sim.inject_fault("completion_unknown")
            fut = gpu.submit(graph.launch())
            if observed:
                try:
                    await fut.wait()
                except trio_cuda.CompletionUnknownError as exc:
                    record["error"] = exc

    _, exc = outcome(main)
    if observed:
        assert isinstance(record.get("error"), trio_cuda.CompletionUnknownError), record
        assert exc is None or all(isinstance(e, trio_cuda.CompletionUnknownError) for e in leaves(exc)), exc
    else:
        assert isinstance(exc, BaseExceptionGroup), repr(exc)
        assert contains(exc, trio_cuda.CompletionUnknownError), exc
    assert record["gpu"].statistics().quarantined == 1
    st = sim.statistics()
    assert st.kernel_loads == 1
    assert st.kernel_unloads < st.kernel_loads, "the module of a quarantined replay was unloaded"
    assert sim.violations == []


# --------------------------------------------------------------------------- 6: unknown, not yet quarantined


CONFLICTING = {
    "launch_write": lambda y, z: add(y, 2.0),
    "launch_read": lambda y, z: copy(y, z),
    "fill_write": lambda y, z: ops.fill(y, 5.0),
    "copy_read": lambda y, z: ops.copy(z, y),
}


@pytest.mark.parametrize("conflicts", ["order", "error"])
@pytest.mark.parametrize("kind", list(CONFLICTING))
async def test_conflict_with_unknown_completion_not_yet_quarantined_is_refused(sim, conflicts, kind):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts=conflicts) as gpu:
        s0, s1 = gpu.streams
        y = await gpu.to_device(host(), stream=s0)
        z = await gpu.to_device(host(0.0), stream=s1)
        await gpu.load(ADD, COPY)  # loading modules is not enqueueing: keep it out of the comparison
        await settle(gpu)
        sim.hold()
        sim.inject_fault("completion_unknown")
        fut = gpu.submit(add(y, 1.0), stream=s0)  # writes y
        assert sim.run_until_idle() == 1  # it "ran"; its marker now polls UNKNOWN
        assert sim.pending == 0
        # no checkpoint since: the handoff has not retired (quarantined) it yet
        assert not fut.done()
        assert fut.statistics().state == "in_flight"
        before = (gpu.statistics().submitted, gpu.statistics().leases_held, sim.statistics())
        try:
            with pytest.raises(trio_cuda.CompletionUnknownError):
                gpu.submit(CONFLICTING[kind](y, z), stream=s1)
            after = (gpu.statistics().submitted, gpu.statistics().leases_held, sim.statistics())
            assert after == before, "the conflicting work was enqueued"
        finally:
            sim.release()
        with pytest.raises(trio_cuda.CompletionUnknownError):
            await fut.wait()
        assert y.quarantined
        assert not z.quarantined
        np.testing.assert_array_equal(await gpu.to_host(z, stream=s1), host(0.0))
    assert sim.violations == []


# --------------------------------------------------------------------------- 7: drain_timeout=0


@pytest.mark.parametrize("mode", ["free_running", "held"])
async def test_drain_timeout_zero_does_not_quarantine_finished_work(mode):
    problems = []
    for i in range(20):
        sim = SimDevice()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with trio_cuda.open_scope(device=sim, drain_timeout=0) as gpu:
                x = gpu.zeros(N, F4)
                y = gpu.empty(N, F4)
                if mode == "held":
                    sim.hold()
                gpu.submit(add(x, 1.0))
                gpu.submit(copy(x, y))
                if mode == "held":
                    sim.run_until_idle()  # done on the device; no checkpoint: not retired yet
                    sim.release()
        st = gpu.statistics()
        rw = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        if rw or st.quarantined or sim.live_allocations or sim.violations:
            problems.append((i, rw, st.quarantined, len(sim.live_allocations), sim.violations))
    assert problems == [], problems


# --------------------------------------------------------------------------- 8: argument validation


async def test_drain_timeout_and_streams_are_validated(sim):
    with pytest.raises(ValueError, match="drain_timeout"):
        trio_cuda.open_scope(device=sim, drain_timeout=float("nan"))
    with pytest.raises(ValueError, match="drain_timeout"):
        trio_cuda.open_device_pool(SimHost(2), drain_timeout=float("nan"))
    for bad in (-1, -0.5, -math.inf, "1", True, False):
        with pytest.raises((ValueError, TypeError), match="drain_timeout"):
            trio_cuda.open_scope(device=sim, drain_timeout=bad)
    for bad in (float("nan"), 2.0, 1.5, True, False, 0, -1):
        with pytest.raises((ValueError, TypeError), match="streams"):
            trio_cuda.open_scope(device=sim, streams=bad)
    # infinity is accepted and behaves like None: the exit drains fully
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with trio_cuda.open_scope(device=sim, drain_timeout=math.inf) as gpu:
            x = await gpu.to_device(host())
            sim.hold()
            gpu.submit(add(x, 1.0))
            trio.lowlevel.current_task().parent_nursery.start_soon(_release_later, sim)
    assert [w.message for w in caught if issubclass(w.category, ResourceWarning)] == []
    st = gpu.statistics()
    assert (st.in_flight, st.quarantined, st.completed) == (0, 0, st.submitted)
    assert sim.live_allocations == []
    assert sim.statistics().launches == 1


# --------------------------------------------------------------------------- 9: bad scheduling policies


class PolicyBroke(Exception):
    pass


#: ``Policy.answer`` for a well-behaved policy
GOOD = object()


class Policy:
    """A SchedulingPolicy whose answer the test sets."""

    def __init__(self) -> None:
        self.answer: object = GOOD
        self.fail = False

    def choose(self, streams, op):
        if self.fail:
            raise PolicyBroke("choose() failed")
        if self.answer is GOOD:
            return streams[0]
        return self.answer


POLICY_CALLS = {
    "launch": lambda gpu, x: gpu.submit(add(x, 1.0)),
    "empty": lambda gpu, x: gpu.empty(N, F4),
    "fill": lambda gpu, x: gpu.submit(ops.fill(x, 1.0)),
}
BAD_ANSWERS = ["None", "zero", "string", "foreign_stream"]


@pytest.mark.parametrize("answer", BAD_ANSWERS)
@pytest.mark.parametrize("call", list(POLICY_CALLS))
def test_policy_returning_a_non_stream_is_refused(sim, call, answer):
    policy = Policy()
    record: dict[str, object] = {}

    async def main() -> None:
        async with (
            trio_cuda.open_scope(device=sim, streams=2, policy=policy) as gpu,
            trio_cuda.open_scope(device=sim) as other,
        ):
            s0 = gpu.streams[0]
            x = await gpu.to_device(host(), stream=s0)
            await gpu.load(ADD, COPY)  # loading modules is not enqueueing: keep it out of the comparison
            await settle(gpu, other)
            bad = {"None": None, "zero": 0, "string": "s1", "foreign_stream": other.streams[0]}[answer]
            policy.answer = bad
            before = (gpu.statistics(), other.statistics(), sim.statistics())
            try:
                POLICY_CALLS[call](gpu, x)
            except (TypeError, ValueError) as exc:
                record["error"] = exc
            except Exception as exc:
                record["other"] = exc
            else:
                record["accepted"] = True
            record["before"] = before
            record["after"] = (gpu.statistics(), other.statistics(), sim.statistics())
            # a policy whose choose() raises: the error propagates, nothing is taken
            policy.fail = True
            try:
                POLICY_CALLS[call](gpu, x)
            except PolicyBroke:
                record["broke"] = True
            record["after_broke"] = (gpu.statistics(), other.statistics(), sim.statistics())
            policy.fail = False
            policy.answer = GOOD  # a good policy again: the scope still works
            await gpu.run(add(x, 1.0), stream=s0)
            record["x"] = await gpu.to_host(x, stream=s0)
        record["stats"] = gpu.statistics()

    _, exc = outcome(main)
    assert exc is None, repr(exc)
    assert "accepted" not in record, record
    assert "other" not in record, record
    err = record.get("error")
    assert isinstance(err, TypeError | ValueError), record
    assert re.search(r"(?i)policy", str(err)), err
    assert record["after"] == record["before"], "something was enqueued, leased or allocated"
    assert record.get("broke") is True
    assert record["after_broke"] == record["before"]
    np.testing.assert_array_equal(record["x"], host() + 1)
    st = record["stats"]
    assert (st.quarantined, st.leases_held, st.live_allocations) == (0, 0, 0)
    assert sim.violations == []
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- 10: stream= not a Stream


@pytest.mark.parametrize("bad", [0, "s", object()], ids=["int", "str", "object"])
async def test_submit_launch_with_a_non_stream_is_a_type_error(sim, bad):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        await gpu.load(ADD, COPY)  # loading modules is not enqueueing: keep it out of the comparison
        await settle(gpu)
        before = (gpu.statistics(), sim.statistics())
        with pytest.raises(TypeError, match="stream: expected a Stream"):
            gpu.submit(add(x, 1.0), stream=bad)
        with pytest.raises(TypeError, match="stream: expected a Stream"):
            await gpu.run(add(x, 1.0), stream=bad)
        with pytest.raises(TypeError, match="stream: expected a Stream"):
            gpu.submit(ops.fill(x, 1.0), stream=bad)
        assert (gpu.statistics(), sim.statistics()) == before
        np.testing.assert_array_equal(await gpu.to_host(x), host())
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- 11: device pools and graphs


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
async def test_pool_routes_graph_launches_to_the_capturing_scope(policy):
    sims = SimHost(2)
    device_policy = trio_cuda.RoundRobinDevices() if policy == "round_robin" else None
    async with trio_cuda.open_device_pool(sims, policy=device_policy) as pool:
        for i in (1, 0):
            scope = pool[i]
            x = scope.zeros(N, F4)
            graph = await scope.capture(add(x, 1.0))
            await settle(*pool)
            assert await pool.run(graph.launch()) is x
            await settle(*pool)
            fut = pool.submit(graph.launch())
            assert fut.stream.scope is scope
            assert await fut.wait() is x
            np.testing.assert_array_equal(await scope.to_host(x), host(2.0))
            graph.close()
    assert sims.violations == []
    assert [d.live_allocations for d in sims] == [[], []]


def test_graph_close_from_a_worker_thread_is_handed_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing a graph from a worker thread never touches the driver there: the
    close runs on the loop, and the graph is destroyed once its replays retired."""
    from trio_cuda._backends.sim import SimContext

    destroyed_on: list[int] = []
    inner = SimContext.destroy_graph

    def spy(self: SimContext, graph_exec: object) -> None:
        destroyed_on.append(threading.get_ident())
        inner(self, graph_exec)

    monkeypatch.setattr(SimContext, "destroy_graph", spy)
    sim = SimDevice()
    loop_thread: list[int] = []

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(np.zeros(N, np.float32))
            idle = await gpu.capture(add(x, 1.0))
            busy = await gpu.capture(add(x, 2.0))
            sim.hold()
            gpu.submit(busy.launch())
            await trio.to_thread.run_sync(idle.close)
            await trio.to_thread.run_sync(busy.close)
            await trio.testing.wait_all_tasks_blocked()
            assert idle.closed
            assert busy.closed
            assert sim.live_graphs == 1  # the busy one's replay is still in flight
            sim.release()
            np.testing.assert_array_equal(await gpu.to_host(x), np.full(N, 2.0, np.float32))
            assert sim.live_graphs == 0

    run_bounded(main, limit=5)
    assert destroyed_on == loop_thread * 2
    assert sim.violations == []


def test_drain_timeout_zero_finishes_a_released_export() -> None:
    """An export its consumer released just before the exit is finished, not
    quarantined, when ``drain_timeout=0`` leaves no time to wait."""
    import gc

    sim = SimDevice()
    stats: list[trio_cuda.ScopeStatistics] = []

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim, drain_timeout=0) as gpu:
            x = gpu.zeros(4, np.float32)
            await trio.testing.wait_all_tasks_blocked()
            capsule = x.__dlpack__(max_version=(1, 0), dl_device=x.__dlpack_device__())
            del capsule
            gc.collect()
        stats.append(gpu.statistics())

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no quarantine warning
        run_bounded(main, limit=5)
    assert stats[0].quarantined_leases == 0
    assert sim.live_allocations == []
    assert sim.violations == []


# --------------------------------------------------------------------------- waiter-side completion


def test_failing_free_inside_a_retirement_neither_hangs_nor_half_retires(sim, monkeypatch):
    # Retirement (by an awaiting task or the handoff) frees memory whose last
    # lease it releases; a free that fails there (its ResourceWarning raised
    # as an error by a warnings filter) must not leave the submission
    # half-retired, which would hang the scope's exit.
    async def body() -> None:
        with pytest.RaisesGroup(ResourceWarning):
            async with trio_cuda.open_scope(device=sim) as gpu:
                a = gpu.zeros(16, np.float32)

                def failing_free(self: object, ptr: int, nbytes: int) -> None:
                    raise RuntimeError("free refused")

                monkeypatch.setattr(type(internals.driver_of(gpu)), "free", failing_free)
                with warnings.catch_warnings():
                    warnings.simplefilter("error", ResourceWarning)
                    a.close()  # freed when the zero fill's lease retires
                    assert await gpu.run(ops.value(1)) == 1
                    await trio.testing.wait_all_tasks_blocked()
                    st = gpu.statistics()
                    assert (st.in_flight, st.leases_held) == (0, 0)

    run_bounded(body, limit=10)


def test_wait_nowait_from_a_worker_thread_is_refused(sim):
    async def body() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            sim.hold()
            try:
                fut = gpu.submit(trio_cuda.ops.fill(gpu.empty(8, np.float32), 1.0))
                with pytest.raises(RuntimeError, match="wait_nowait: expected a call from the Trio run"):
                    await trio.to_thread.run_sync(fut.wait_nowait)
                assert not fut.done()
            finally:
                sim.release()

    run_bounded(body, limit=10)
