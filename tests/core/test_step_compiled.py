"""``run``'s checkpoint and first look as one compiled awaitable
(``_claunch.step``) against ``await checkpoint(); look(c, sub)``.

The step yields Trio's own schedule-point message (taken from
``trio.lowlevel.cancel_shielded_checkpoint`` by ``checkpoint_message``),
makes Trio's cancel point after it, and gives ``LOOK_CHECK`` where a
cancellation (or a KeyboardInterrupt for the main task) is due, so that
Trio's own checkpoint raises it. Outcomes, cancel points and retention must
match the Python path's."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import outcome
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import run_bounded
from tests.helpers.kernels import add_one
from trio_cuda._core import _completion, _scope, _trio_internals
from trio_cuda.testing import SimDevice

step_only = pytest.mark.skipif(
    _completion.step is None,
    reason="the compiled paths are not in use (not built at install, or TRIO_CUDA_PURE set)",
)


_launch = add_one


def test_checkpoint_message_is_what_trio_s_checkpoint_yields() -> None:
    from trio._core._traps import CancelShieldedCheckpoint

    assert _trio_internals.checkpoint_message() is CancelShieldedCheckpoint


def _spy_step(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record what each compiled step gave: "check", "settled", "again" or the output's type."""
    saved = _scope.step
    assert saved is not None
    got: list[str] = []
    names = {id(_completion.LOOK_CHECK): "check", id(_completion.LOOK_SETTLED): "settled"}
    names[id(_completion.LOOK_AGAIN)] = "again"

    async def spy(c: Any, sub: Any) -> Any:
        r = await saved(c, sub)
        got.append(names.get(id(r), type(r).__name__))
        return r

    monkeypatch.setattr(_scope, "step", spy)
    return got


@step_only
async def test_the_step_by_hand() -> None:
    """Its first step yields Trio's message; resumed with a Value it gives
    look's answer; an Error outcome is raised; it runs once; a thrown
    exception finishes it and is raised; close() finishes it."""
    assert _completion.step is not None
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, c, sub = await internals.completed_unwatched(gpu, _launch)  # (completed, not retired)
        task = trio.lowlevel.current_task()
        points = task._cancel_points  # type: ignore[attr-defined]
        it = _completion.step(c, sub).__await__()
        assert it.send(None) is _trio_internals.checkpoint_message()
        with pytest.raises(StopIteration) as stop:
            it.send(outcome.Value(None))
        assert stop.value.value is x  # (a launch's output: its first InOut array)
        assert task._cancel_points == points + 1  # type: ignore[attr-defined]
        assert sub.state.name == "DONE"
        with pytest.raises(RuntimeError, match="already awaited"):
            it.send(None)

        it = _completion.step(c, sub).__await__()
        with pytest.raises(TypeError, match="other than None"):
            it.send(1)
        it.send(None)
        with pytest.raises(ValueError, match="sent"):
            it.send(outcome.Error(ValueError("sent")))
        for thrown in (ValueError("thrown"), ValueError):
            it = _completion.step(c, sub).__await__()
            it.send(None)
            with pytest.raises(ValueError):
                it.throw(thrown)
            with pytest.raises(RuntimeError, match="already awaited"):
                it.send(None)
        it = _completion.step(c, sub).__await__()
        it.send(None)
        it.close()
        with pytest.raises(RuntimeError, match="already awaited"):
            it.send(outcome.Value(None))
        with pytest.raises(TypeError):
            it.throw(1)
        # iterated (next), as a yield from would
        it = _completion.step(c, sub).__await__()
        assert next(it) is _trio_internals.checkpoint_message()
    assert sim.violations == []


@step_only
def test_a_step_in_a_cycle_is_collected() -> None:
    """A step whose references lead back to it is freed by the collector
    (its sentinel's weak reference dies): it is traversed and cleared."""
    assert _completion.step is not None

    class Sentinel:
        pass

    sentinel = Sentinel()
    alive = weakref.ref(sentinel)
    box: list[Any] = [sentinel]
    s = _completion.step(box, box)
    box.append(s)
    del s, box, sentinel
    gc.collect()
    assert alive() is None


class _AtNextStep(trio.abc.Instrument):
    """Runs ``action`` right before ``task``'s next step: once armed before
    ``await gpu.run(...)``, that is the resumption after run's first
    checkpoint (``begin`` yields nowhere before it)."""

    def __init__(self, task: Any, action: Any) -> None:
        self.task, self.action, self.ran = task, action, False

    def before_task_step(self, task: Any) -> None:
        if task is self.task and not self.ran:
            self.ran = True
            self.action()

    def __enter__(self) -> _AtNextStep:
        trio.lowlevel.add_instrument(self)
        return self

    def __exit__(self, *exc: object) -> None:
        trio.lowlevel.remove_instrument(self)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
async def test_cancelled_while_run_s_step_yields(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while run's first checkpoint yields (the work held in
    flight): ``Cancelled`` at once (the compiled step gives CHECK and Trio's
    checkpoint raises it), the leases still held, and once the device goes
    on everything retires, nothing leaked. The same on both paths, with the
    same count of cancel points."""
    if compiled and _scope.step is None:
        pytest.skip("the compiled paths are not in use")
    got = _spy_step(monkeypatch) if compiled else []
    if not compiled:
        monkeypatch.setattr(_scope, "step", None)
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, "f4")
        await gpu.run(_launch(x))
        got.clear()
        task = trio.lowlevel.current_task()
        cs = trio.CancelScope()
        at_step = _AtNextStep(task, cs.cancel)
        sim.hold()
        try:
            points = task._cancel_points  # type: ignore[attr-defined]
            with at_step, cs:
                await gpu.run(_launch(x))
            moved = task._cancel_points - points  # type: ignore[attr-defined]
            st = gpu.statistics()
        finally:
            sim.release()
        assert at_step.ran
        assert cs.cancelled_caught
        assert moved == 3  # (checkpoint_if_cancelled's; the checkpoint's, and its wait's that raised)
        assert (st.in_flight, st.leases_held) == (1, 1)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(5):
            assert (await gpu.to_host(x)).tolist() == [2.0] * 4
        assert gpu.statistics().in_flight == 0
    assert got == (["check"] if compiled else [])
    assert sim.violations == []
    assert sim.live_allocations == []


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_keyboard_interrupt_due_while_run_s_step_yields(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt pending for the main task when run's first
    checkpoint resumes is raised there, by Trio's checkpoint, on both
    paths; the submission stays retained and retires (the exit does not hang)."""
    if compiled and _scope.step is None:
        pytest.skip("the compiled paths are not in use")
    got = _spy_step(monkeypatch) if compiled else []
    if not compiled:
        monkeypatch.setattr(_scope, "step", None)
    sim = SimDevice()
    seen: list[Any] = []

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = gpu.zeros(4, "f4")
            await gpu.run(_launch(x))
            got.clear()
            task = trio.lowlevel.current_task()

            def interrupt() -> None:
                task._runner.ki_pending = True  # type: ignore[attr-defined]  # (as Trio's handler sets it)

            at_step = _AtNextStep(task, interrupt)
            sim.hold()
            try:
                with at_step:
                    try:
                        await gpu.run(_launch(x))
                    except KeyboardInterrupt:
                        seen.append("KeyboardInterrupt")
                seen.append((gpu.statistics().in_flight, gpu.statistics().leases_held))
            finally:
                sim.release()
            seen.append((await gpu.to_host(x)).tolist())

    run_bounded(main, limit=20.0)
    assert seen == ["KeyboardInterrupt", (1, 1), [2.0] * 4]
    assert got == (["check"] if compiled else [])
    assert sim.violations == []
    assert sim.live_allocations == []


@step_only
async def test_run_steps_once_per_round_trip_and_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each awaited lone launch makes one compiled step, which gives the
    output; ``run`` is a checkpoint (schedule and cancel point)."""
    got = _spy_step(monkeypatch)
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, "f4")
        await gpu.run(_launch(x))
        got.clear()
        for _ in range(3):
            with trio.testing.assert_checkpoints():
                assert await gpu.run(_launch(x)) is x
        assert (await gpu.to_host(x)).tolist() == [4.0] * 4
    assert got == ["DeviceArray"] * 3
    assert sim.violations == []
