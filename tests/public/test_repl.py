"""A scope in Trio's REPL, and a scope entered and exited by different tasks.

``python -m trio`` runs each input through ``trio.from_thread.run``: every
input is a fresh contextvars context of the REPL's task, so a scope entered
with an ``AsyncExitStack`` on one input is used and exited on later ones, and
the REPL may be left with the scope still open. The first tests drive the
real REPL in a subprocess, fed on stdin; each printed result is a line
``RESULT <name> <value>``. The rest check the same rules in-process: entry and
exit in different tasks (the entering task ended, or still running), in
different contexts of one task (``trio.from_thread.run`` as the REPL calls
it), the current scope in each context, refused exits, and a scope still open
when its Trio run ends (drained and closed then, with a warning).
"""

import contextlib
import contextvars
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import add
from trio_cuda import ops
from trio_cuda.testing import SimDevice

ROOT = Path(__file__).resolve().parents[2]
N = 64

# --------------------------------------------------------------------------- the REPL


def _repl(*lines: str) -> subprocess.CompletedProcess[str]:
    """Feed ``lines`` (one input each; a block ends with an empty line) to
    ``python -m trio`` and end its input (Ctrl-D)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        return subprocess.run(
            [sys.executable, "-m", "trio"],
            input="\n".join(lines) + "\n",
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:  # pragma: no cover - a hang is the failure
        pytest.fail(f"python -m trio hung: {exc.stderr!r}")


def _results(out: subprocess.CompletedProcess[str]) -> dict[str, str]:
    found = dict(re.findall(r"RESULT (\S+) (.*)$", out.stdout, flags=re.MULTILINE))
    assert found, f"nothing printed:\nstdout: {out.stdout}\nstderr: {out.stderr}"
    return found


def _assert_clean(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, out.stderr
    for word in ("Traceback", "TrioInternalError", "Exception", "Error"):
        assert word not in out.stderr, out.stderr


PRELUDE = (
    "import atexit, contextlib, numpy as np, trio_cuda",
    "from trio_cuda import ops",
    'SRC = \'extern "C" __global__ void add1(float* x, int n) '
    "{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }'",
    'k = trio_cuda.Kernel.from_source(SRC, "add1", params=[trio_cuda.InOut("f4"), trio_cuda.Scalar("i4")], '
    "reference=lambda x, n: np.add(x, 1, out=x))",
)


def test_repl_exit_stack_across_inputs():
    out = _repl(
        *PRELUDE,
        "stack = contextlib.AsyncExitStack()",
        'gpu = await stack.enter_async_context(trio_cuda.open_scope(device="sim"))',
        "x = await gpu.to_device(np.arange(4, dtype=np.float32))",
        "fut = gpu.submit(k.launch(x, np.int32(4), grid=1, block=4))",
        'print("RESULT waited", (await fut.wait()) is x)',
        # `await op` on a later input: the scope entered on an earlier one is current
        'print("RESULT current", trio_cuda.current_scope() is gpu)',
        'print("RESULT await_op", (await k.launch(x, np.int32(4), grid=1, block=4)) is x)',
        'print("RESULT value", await ops.value(41).map(lambda v: v + 1))',
        # and in a task started on a later input
        "async def child(found):",
        "    found.append(trio_cuda.current_scope() is gpu)",
        "    found.append(await ops.value(7))",
        "",
        "found = []",
        "async with trio.open_nursery() as nursery:",
        "    nursery.start_soon(child, found)",
        "",
        'print("RESULT child", found)',
        # a second scope entered later is the innermost until it exits
        "inner_stack = contextlib.AsyncExitStack()",
        'inner = await inner_stack.enter_async_context(trio_cuda.open_scope(device="sim"))',
        'print("RESULT innermost", trio_cuda.current_scope() is inner)',
        "await inner_stack.aclose()",
        'print("RESULT after_inner", trio_cuda.current_scope() is gpu, inner.closed)',
        'print("RESULT host", (await gpu.to_host(x)).tolist())',
        "await stack.aclose()",
        "s = gpu.statistics()",
        'print("RESULT closed", gpu.closed, s.in_flight, s.leases_held, s.live_allocations)',
        "try:",
        "    trio_cuda.current_scope()",
        "except RuntimeError as exc:",
        '    print("RESULT none", "no trio_cuda scope is open" in str(exc))',
        "",
        # the `async with` block written on one input works as it always did
        'async with trio_cuda.open_scope(device="sim") as g:',
        '    print("RESULT one_input", await g.run(ops.value(5)))',
        "",
    )
    _assert_clean(out)
    assert _results(out) == {
        "waited": "True",
        "current": "True",
        "await_op": "True",
        "value": "42",
        "child": "[True, 7]",
        "innermost": "True",
        "after_inner": "True True",
        "host": "[2.0, 3.0, 4.0, 5.0]",
        "closed": "True 0 0 0",
        "none": "True",
        "one_input": "5",
    }


@pytest.mark.parametrize("leave", ["eof", "exit()"])
def test_leaving_the_repl_with_a_scope_open_drains_and_closes_it(leave):
    out = _repl(
        *PRELUDE,
        "sim = trio_cuda.testing.SimDevice(kernel_time=0.3)",
        "t0 = __import__('time').perf_counter()",
        'atexit.register(lambda: print("RESULT at_exit", sim.live_allocations, sim.violations, '
        "sim.statistics().launches, __import__('time').perf_counter() - t0 >= 0.3))",
        "stack = contextlib.AsyncExitStack()",
        "gpu = await stack.enter_async_context(trio_cuda.open_scope(device=sim))",
        "x = gpu.zeros(4, np.float32)",
        "fut = gpu.submit(k.launch(x, np.int32(4), grid=1, block=4))",
        "bad = gpu.submit(ops.host_closure(lambda: 1 / 0))",
        'print("RESULT in_flight", gpu.statistics().in_flight > 0)',
        *(("exit()",) if leave == "exit()" else ()),
    )
    assert out.returncode == 0, out.stderr
    assert "TrioInternalError" not in out.stderr
    assert "was still open when its Trio run ended" in out.stderr, out.stderr
    # the failure nobody awaited is reported, not lost
    assert "nobody observed" in out.stderr
    assert "ZeroDivisionError: division by zero" in out.stderr
    # drained first (the kernel ran, 0.3 s), then every allocation freed
    assert _results(out) == {"in_flight": "True", "at_exit": "[] [] 1 True"}


def test_repl_errors_at_close_reach_the_input_that_closes():
    out = _repl(
        *PRELUDE,
        "stack = contextlib.AsyncExitStack()",
        'gpu = await stack.enter_async_context(trio_cuda.open_scope(device="sim"))',
        "bad = gpu.submit(ops.host_closure(lambda: 1 / 0))",
        "await stack.aclose()",
        'print("RESULT after", gpu.closed)',
    )
    assert out.returncode == 0, out.stderr
    assert "errors from trio_cuda scope" in out.stderr
    assert "ZeroDivisionError" in out.stderr
    assert "TrioInternalError" not in out.stderr
    assert "was still open" not in out.stderr
    assert _results(out) == {"after": "True"}


# --------------------------------------------------------------------------- in-process


def _host_values(value=0.0):
    return np.full(N, value, np.float32)


async def test_enter_in_one_task_exit_in_another_after_it_ended(sim):
    stack = contextlib.AsyncExitStack()
    box = {}

    async def enter():
        gpu = box["gpu"] = await stack.enter_async_context(trio_cuda.open_scope(device=sim))
        box["x"] = await gpu.to_device(_host_values())
        sim.hold()
        box["fut"] = gpu.submit(add(box["x"], 1.0))  # in flight when the task ends

    async with trio.open_nursery() as nursery:
        nursery.start_soon(enter)
    gpu = box["gpu"]
    assert gpu.statistics().in_flight == 1
    assert not gpu.closed
    # the scope is usable from here, though its entering task is gone
    with pytest.raises(RuntimeError, match="no trio_cuda scope is open in this task"):
        trio_cuda.current_scope()  # this task's context never named it

    async def release_later():
        await trio.sleep(0.05)
        sim.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_later)
        assert await box["fut"].wait() is box["x"]
    np.testing.assert_array_equal(await gpu.to_host(box["x"]), _host_values(1.0))
    sim.hold()
    gpu.submit(add(box["x"], 1.0))
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_later)
        await stack.aclose()  # drains: waits for the held work
    assert time.perf_counter() - t0 >= 0.04
    assert gpu.closed
    assert gpu.statistics().in_flight == 0
    assert sim.live_allocations == []
    assert sim.statistics().launches == 2


async def test_exit_in_another_task_while_the_entering_task_runs(sim):
    stack = contextlib.AsyncExitStack()
    entered = trio.Event()
    closed = trio.Event()
    seen = []

    async def body():
        gpu = await stack.enter_async_context(trio_cuda.open_scope(device=sim))
        seen.append(await ops.value(1))  # `await op` in the entering context
        entered.set()
        await closed.wait()
        seen.append(trio_cuda.current_scope() is gpu)  # its context still names it: closed now
        with pytest.raises(trio_cuda.ScopeClosedError, match="the scope is closed"):
            await ops.value(2)
        with pytest.raises(trio_cuda.ScopeClosedError):
            gpu.submit(ops.value(3))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(body)
        await entered.wait()
        await stack.aclose()
        closed.set()
    assert seen == [1, True]
    assert sim.live_allocations == []


async def test_exit_cancelled_in_another_task_still_drains(sim):
    stack = contextlib.AsyncExitStack()

    async def enter():
        gpu = await stack.enter_async_context(trio_cuda.open_scope(device=sim))
        x = await gpu.to_device(_host_values())
        sim.hold()
        gpu.submit(add(x, 1.0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(enter)
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:

        async def release_later():
            await trio.sleep(0.05)
            sim.release()

        nursery.start_soon(release_later)
        with trio.move_on_after(0.01) as cs:
            await stack.aclose()
    assert cs.cancelled_caught  # the exit was cancelled, and still waited, shielded
    assert time.perf_counter() - t0 >= 0.04
    assert sim.live_allocations == []
    assert sim.statistics().launches == 1


async def test_from_thread_calls_as_the_repl_makes_them(sim):
    """Each call is run by the calling task in a fresh copy of the thread's
    context, as every input of ``python -m trio`` is."""
    stack = contextlib.AsyncExitStack()

    async def current_is(gpu):
        return trio_cuda.current_scope() is gpu

    async def in_a_child(gpu):
        found = []

        async def child():
            found.append(trio_cuda.current_scope() is gpu)
            found.append(await ops.value(9))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
        return found

    async def await_op():
        return await ops.value(41).map(lambda v: v + 1)

    def thread():
        gpu = trio.from_thread.run(stack.enter_async_context, trio_cuda.open_scope(device=sim))
        x = trio.from_thread.run(gpu.to_device, _host_values())
        fut = trio.from_thread.run_sync(gpu.submit, add(x, 1.0))
        got = {
            "current": trio.from_thread.run(current_is, gpu),
            "await_op": trio.from_thread.run(await_op),
            "waited": trio.from_thread.run(fut.wait) is x,
            "child": trio.from_thread.run(in_a_child, gpu),
            "host": trio.from_thread.run(gpu.to_host, x).tolist()[:2],
        }
        trio.from_thread.run(stack.aclose)
        got["closed"] = gpu.closed
        return got

    with pytest.raises(RuntimeError, match="no trio_cuda scope is open"):
        await trio.to_thread.run_sync(lambda: trio.from_thread.run_sync(trio_cuda.current_scope))
    try:
        got = await trio.to_thread.run_sync(thread)
    finally:
        await stack.aclose()  # (a no-op once the thread closed it)
    assert got == {
        "current": True,
        "await_op": 42,
        "waited": True,
        "child": [True, 9],
        "host": [1.0, 1.0],
        "closed": True,
    }
    assert sim.live_allocations == []


async def test_current_scope_after_from_thread_exit_raises(sim):
    def thread():
        stack = contextlib.AsyncExitStack()
        trio.from_thread.run(stack.enter_async_context, trio_cuda.open_scope(device=sim))
        trio.from_thread.run(stack.aclose)
        try:
            trio.from_thread.run_sync(trio_cuda.current_scope)
        except RuntimeError as exc:
            return str(exc)
        return "no error"  # pragma: no cover - the failure

    assert (await trio.to_thread.run_sync(thread)).startswith("no trio_cuda scope is open in this task")


async def test_from_thread_calls_in_system_tasks(sim):
    """With ``abandon_on_cancel=True`` (or a ``trio_token=``), every call is
    its own system task: the entering one ends at once, the scope lives on.
    ``await op`` needs a scope its own task (or an ancestor) entered."""
    stack = contextlib.AsyncExitStack()

    async def await_op():
        return await ops.value(1)

    def thread():
        gpu = trio.from_thread.run(stack.enter_async_context, trio_cuda.open_scope(device=sim))
        x = trio.from_thread.run(gpu.to_device, _host_values(2.0))
        out = trio.from_thread.run(gpu.run, add(x, 1.0))
        host = trio.from_thread.run(gpu.to_host, out)
        try:
            trio.from_thread.run(await_op)
            message = "no error"
        except RuntimeError as exc:
            message = str(exc)
        trio.from_thread.run(stack.aclose)
        return gpu, host, message

    gpu, host, message = await trio.to_thread.run_sync(thread, abandon_on_cancel=True)
    np.testing.assert_array_equal(host, _host_values(3.0))
    assert message.startswith("no trio_cuda scope is open in this task")
    assert gpu.closed
    assert sim.live_allocations == []


async def test_device_pool_across_from_thread_calls():
    stack = contextlib.AsyncExitStack()

    def thread():
        pool = trio.from_thread.run(stack.enter_async_context, trio_cuda.open_device_pool(["sim", "sim"]))
        scopes = list(pool.scopes)
        values = [trio.from_thread.run(s.run, ops.value(i)) for i, s in enumerate(scopes)]
        trio.from_thread.run(stack.aclose)
        return values, [s.closed for s in scopes]

    assert await trio.to_thread.run_sync(thread) == ([0, 1], [True, True])


async def test_exit_in_a_context_that_names_the_scope_restores_the_outer(sim):
    async with trio_cuda.open_scope(device=sim) as outer:
        stack = contextlib.AsyncExitStack()
        inner = await stack.enter_async_context(trio_cuda.open_scope(device=sim))
        assert trio_cuda.current_scope() is inner
        seen = []

        async def exit_it():  # its context is a copy of one that names the inner scope
            assert trio_cuda.current_scope() is inner
            await stack.aclose()
            seen.append(trio_cuda.current_scope() is outer)
            seen.append(await ops.value(4))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(exit_it)
        assert seen == [True, 4]
        # this context (not the exiting one) still names the inner scope, now closed
        assert trio_cuda.current_scope() is inner
        with pytest.raises(trio_cuda.ScopeClosedError):
            await ops.value(5)
        assert await outer.run(ops.value(6)) == 6
    with pytest.raises(RuntimeError, match="no trio_cuda scope is open"):
        trio_cuda.current_scope()


async def test_handoff_sees_the_entering_context(sim):
    var = contextvars.ContextVar("var")
    for value in ("first", "second"):  # the run's first scope starts its host, the second finds it
        var.set(value)
        async with trio_cuda.open_scope(device=sim) as gpu:
            var.set("changed later")
            assert await gpu.run(ops.host_closure(var.get)) == value


async def test_a_second_exit_is_refused(sim):
    manager = trio_cuda.open_scope(device=sim)
    gpu = await manager.__aenter__()
    assert await gpu.run(ops.value(1)) == 1
    assert await manager.__aexit__(None, None, None) is False
    with pytest.raises(
        RuntimeError, match=r"^open_scope\(\): <ResourceScope .*> was already exited; a scope exits once$"
    ):
        await manager.__aexit__(None, None, None)


async def test_an_exit_during_another_exit_is_refused(sim):
    manager = trio_cuda.open_scope(device=sim)
    gpu = await manager.__aenter__()
    x = await gpu.to_device(_host_values())
    sim.hold()
    gpu.submit(add(x, 1.0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(manager.__aexit__, None, None, None)
        await trio.testing.wait_all_tasks_blocked()
        assert not gpu.closed  # the first exit waits for the held work
        with pytest.raises(RuntimeError, match=r"is exiting; a scope exits once$"):
            await manager.__aexit__(None, None, None)
        sim.release()
    assert gpu.closed
    assert sim.live_allocations == []


async def test_an_exit_from_another_trio_run_is_refused(sim):
    manager = trio_cuda.open_scope(device=sim)
    gpu = await manager.__aenter__()
    errors = []

    def other_run():
        try:
            trio.run(manager.__aexit__, None, None, None)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=other_run)
    thread.start()
    await trio.to_thread.run_sync(thread.join)
    assert len(errors) == 1
    assert re.match(
        r"open_scope\(\): expected the exit of <ResourceScope .*> in the Trio run that entered it, "
        r"got one from another thread or Trio run",
        errors[0],
    ), errors
    assert not gpu.closed  # refused before anything changed
    assert await gpu.run(ops.value(2)) == 2
    await manager.__aexit__(None, None, None)
    assert gpu.closed


def test_a_scope_open_when_the_run_ends_is_drained_and_closed(caplog):
    sim = SimDevice(kernel_time=0.1)
    box = {}

    async def main():
        outer = await trio_cuda.open_scope(device=sim).__aenter__()
        inner_manager = trio_cuda.open_scope(device=sim)
        inner = await inner_manager.__aenter__()
        x = await outer.to_device(_host_values())
        outer.submit(add(x, 1.0))  # in flight as the run ends: 0.1 s
        inner.submit(ops.host_closure(lambda: 1 / 0))  # fails, and nobody awaits it
        box.update(outer=outer, inner=inner, inner_manager=inner_manager)

    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, "trio_cuda"), pytest.warns(ResourceWarning) as warned:
        trio.run(main)
    assert time.perf_counter() - t0 >= 0.1  # the drain waited for the kernel
    outer, inner = box["outer"], box["inner"]
    assert outer.closed
    assert inner.closed
    assert sim.live_allocations == []
    assert sim.violations == []
    assert sim.statistics().launches == 1
    closing = [r.args[0] for r in caplog.records if "was still open when its Trio run ended" in r.msg]
    assert closing == [inner, outer]  # innermost first
    errors = [r for r in caplog.records if "nobody observed" in r.getMessage()]
    assert len(errors) == 1
    assert isinstance(errors[0].exc_info[1], ZeroDivisionError)
    assert sum("was still open when its Trio run ended" in str(w.message) for w in warned) == 2
    with pytest.raises(RuntimeError, match=r"was closed when its Trio run ended; a scope exits once$"):
        trio.run(box["inner_manager"].__aexit__, None, None, None)


def test_a_scope_open_when_the_run_ends_keeps_its_drain_timeout(caplog):
    sim = SimDevice()

    async def main():
        gpu = await trio_cuda.open_scope(device=sim, drain_timeout=0).__aenter__()
        x = gpu.zeros(N, np.float32)
        await gpu.run(ops.value(None))
        sim.hold()  # never released: the work stays in flight
        gpu.submit(add(x, 1.0))

    with caplog.at_level(logging.WARNING, "trio_cuda"), pytest.warns(ResourceWarning) as warned:
        trio.run(main)
    messages = " ".join(str(w.message) for w in warned)
    assert "was still open when its Trio run ended" in messages
    assert "still in flight after drain_timeout=0" in messages
    assert len(sim.live_allocations) == 1  # quarantined: leaked, never freed
    assert sim.violations == []


def test_a_scope_entry_while_the_run_ends_is_refused(monkeypatch):
    sim = SimDevice()
    from trio_cuda._core import _manager

    async def main():
        async with trio_cuda.open_scope(device=sim):
            pass
        _manager._HOST.get().ending = True
        with pytest.raises(
            RuntimeError, match=r"^open_scope\(\): the Trio run is ending, so no scope can open in it$"
        ):
            await trio_cuda.open_scope(device=sim).__aenter__()
        _manager._HOST.get().ending = False

    trio.run(main)

    def closed_system_nursery(*args, **kwargs):
        raise RuntimeError("Nursery is closed to new arrivals")

    async def first_scope_of_a_run():
        monkeypatch.setattr(trio.lowlevel, "spawn_system_task", closed_system_nursery)
        with pytest.raises(RuntimeError, match=r"^open_scope\(\): the Trio run is ending"):
            await trio_cuda.open_scope(device=sim).__aenter__()

    trio.run(first_scope_of_a_run)
    assert sim.live_allocations == []
    assert sim.violations == []


async def test_a_ctrl_c_while_the_exit_waits_for_the_handoff_is_kept(sim):
    """Trio delivers Ctrl-C at the exit's waits even inside its shield; one
    delivered while the exit waits for the handoff task to end is re-raised
    once the scope is closed, as one delivered in the drain is."""
    manager = trio_cuda.open_scope(device=sim)
    gpu = await manager.__aenter__()
    await gpu.to_device(_host_values())  # freed at the exit
    real = internals.handoff_ended(manager)

    class InterruptedOnce:
        waits = 0

        def is_set(self):
            return real.is_set()

        def set(self):
            real.set()

        async def wait(self):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt
            await real.wait()

    ended = InterruptedOnce()
    internals.set_handoff_ended(manager, ended)
    with pytest.raises(KeyboardInterrupt):
        await manager.__aexit__(None, None, None)
    assert ended.waits == 2  # it went on waiting after the interrupt
    assert real.is_set()
    assert gpu.closed
    assert sim.live_allocations == []
