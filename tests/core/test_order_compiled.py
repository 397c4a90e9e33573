"""Cross-stream conflicts ordered by the compiled lease path.

``take_whole`` orders leases of other streams in a launch's way itself (the
device-side waits, ``_claunch_order.c``) where the Python fast path would.
Each scenario here runs twice, through the compiled path and through the
Python one, and both must give the same device commands, errors, counters
and results; each also checks what it must show on its own, so that two
equally wrong paths fail too. The random programs of
``test_lease_paths.py`` compare it with the general path as well."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import run_bounded
from tests.helpers.kernels import stub_source
from trio_cuda import InOut, Scalar
from trio_cuda._core import _compiled, _submit
from trio_cuda.testing import SimDevice

pytestmark = pytest.mark.skipif(
    _compiled.ext is None,
    reason="the compiled paths are not in use (not built at install, or TRIO_CUDA_PURE set)",
)

N = 16


def _bump_ref(x: Any, v: Any) -> None:
    x += v


def _copy_ref(dst: Any, src: Any) -> None:
    dst[...] = src


BUMP = trio_cuda.Kernel.from_source(
    stub_source("bump"), "bump", params=[InOut("f4"), Scalar("f4")], reference=_bump_ref
)
COPY = trio_cuda.Kernel.from_source(
    stub_source("copy"), "copy", params=[trio_cuda.Out("f4"), trio_cuda.In("f4")], reference=_copy_ref
)


class Boom(BaseException):
    """Not an Exception: nothing on the way may swallow it."""


Scenario = Callable[[Any, SimDevice, dict[str, Any]], Any]


def _run(scenario: Scenario, compiled: bool, conflicts: str = "order") -> dict[str, Any]:
    """Run ``scenario(gpu, sim, out)`` with the compiled ordering (counting
    what ``take_whole`` took, and with waits) or with the Python path only;
    ``out`` collects what the two runs must agree on."""
    saved = _submit.take_whole
    out: dict[str, Any] = {"took": 0, "took with waits": 0}

    def whole(*args: Any) -> bool:
        assert saved is not None
        took: bool = saved(*args)
        out["took"] += took
        out["took with waits"] += took and args[2].dirty
        return took

    async def main() -> None:
        sim = SimDevice()
        try:
            async with trio_cuda.open_scope(device=sim, streams=2, conflicts=conflicts) as gpu:
                try:
                    await scenario(gpu, sim, out)
                finally:
                    sim.release()
        except BaseException as exc:  # (what the exit raised: compared below)
            out["exit"] = repr(exc)
        out["commands"] = [(c.stream, c.kind, c.label) for c in sim.trace]
        out["violations"] = list(sim.violations)

    _submit.take_whole = whole if compiled else None
    try:
        run_bounded(main, limit=20.0)
    finally:
        _submit.take_whole = saved
    return out


def _agree(scenario: Scenario, conflicts: str = "order") -> dict[str, Any]:
    compiled = _run(scenario, True, conflicts)
    python = _run(scenario, False, conflicts)
    took, waits = compiled.pop("took"), compiled.pop("took with waits")
    assert python.pop("took") == python.pop("took with waits") == 0
    assert compiled == python
    compiled["took"], compiled["took with waits"] = took, waits
    return compiled


async def _held_writer(gpu: Any, sim: SimDevice) -> tuple[Any, Any]:
    """The scope's second stream and an array whose writer is in flight on
    the first, the device held."""
    s0, s1 = gpu.streams
    x = gpu.zeros(N, np.float32)
    await trio.testing.wait_all_tasks_blocked()
    sim.hold()
    gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s0)
    return s1, x


@contextlib.contextmanager
def _failing(gpu: Any, method: str, error: BaseException) -> Iterator[None]:
    """The scope's driver's ``method`` raises ``error`` (patched on its
    class: the driver is slotted), restored after."""
    cls = type(internals.driver_of(gpu))
    real = getattr(cls, method)

    def boom(*args: Any) -> None:
        raise error

    setattr(cls, method, boom)
    try:
        yield
    finally:
        setattr(cls, method, real)


def _waits(out: dict[str, Any]) -> list[int]:
    return [stream for stream, kind, _ in out["commands"] if kind == "wait_marker"]


async def _chain(gpu: Any, sim: SimDevice, out: dict[str, Any]) -> None:
    """Writers of one buffer on alternating streams (each a WAW on the
    other), a reader on the last writer's stream and a writer after it on
    the other (WAR)."""
    s0, s1 = gpu.streams
    x, y = gpu.zeros(N, np.float32), gpu.zeros(N, np.float32)
    await trio.testing.wait_all_tasks_blocked()
    sim.hold()
    for i in range(8):
        gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=(s0, s1)[i % 2])
    gpu.submit(COPY.launch(y, x, grid=1, block=N), stream=s1)
    gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s0)
    out["stats"] = gpu.statistics()
    sim.release()
    out["x"] = (await gpu.to_host(x)).tolist()
    out["y"] = (await gpu.to_host(y)).tolist()


def test_a_chain_of_conflicts_is_ordered_alike():
    out = _agree(_chain)
    assert out["x"] == [9.0] * N
    assert out["y"] == [8.0] * N
    assert out["violations"] == []
    assert "exit" not in out
    # the 7 writers after the first wait (WAW), the reader does not (its
    # writer is on its own stream), the last writer waits for it (WAR)
    assert out["took with waits"] == 8, out
    assert len(_waits(out)) == 9  # and the read of y back on stream 0 (a copy: the general path)


def test_no_leak_through_the_compiled_ordering():
    async def main() -> None:
        async with trio_cuda.open_scope(device="sim", streams=2) as gpu:
            s0, s1 = gpu.streams
            x = gpu.zeros(N, np.float32)
            op0, op1 = (BUMP.launch(x, 1.0, grid=1, block=N) for _ in range(2))
            await gpu.run(op0, stream=s0)
            await gpu.run(op1, stream=s1)

            def counts() -> list[int]:
                gc.collect()
                held = (x, x._alloc, x._extent, op0, op1, op0._accesses, s0, s1, s0.handle, s1.handle)
                return [sys.getrefcount(o) for o in held]

            before = counts()
            for _ in range(3):
                futures = [gpu.submit((op0, op1)[i % 2], stream=(s0, s1)[i % 2]) for i in range(100)]
                for f in futures:
                    await f.wait()
                del futures, f
            assert counts() == before

    run_bounded(main, limit=20.0)


@pytest.mark.parametrize(
    "error", [Boom("refused"), RuntimeError("refused")], ids=["BaseException", "Exception"]
)
@pytest.mark.parametrize("method", ["wait_marker", "poll_marker"])
def test_a_poll_or_wait_that_fails_raises_alike(method: str, error: BaseException):
    """The driver's poll of the writer in the way, or the wait on it, raises:
    the error propagates as it is, nothing of the launch is enqueued, and the
    next launch is ordered as usual."""

    async def scenario(gpu: Any, sim: SimDevice, out: dict[str, Any]) -> None:
        s1, x = await _held_writer(gpu, sim)
        with _failing(gpu, method, error):
            try:
                gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s1)
            except (Boom, RuntimeError) as exc:
                out["raised"] = repr(exc)
        out["stats"] = gpu.statistics()
        gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s1)  # ordered now
        sim.release()
        out["x"] = (await gpu.to_host(x)).tolist()

    out = _agree(scenario)
    assert out["raised"] == repr(error)
    assert out["stats"].in_flight == 1  # (the first writer only)
    assert out["x"] == [2.0] * N
    assert out["violations"] == []
    assert len(_waits(out)) == 1


@pytest.mark.parametrize("error", [Boom, RuntimeError])
def test_a_marker_that_cannot_be_recorded_raises_alike(error: type[BaseException]):
    """The writers in the way have no marker yet, and recording it raises:
    those writers are quarantined; a BaseException propagates, and an
    Exception is reported as their unknown completion (nothing enqueued)."""

    async def scenario(gpu: Any, sim: SimDevice, out: dict[str, Any]) -> None:
        s0, s1 = gpu.streams
        x = gpu.zeros(N, np.float32)
        await trio.testing.wait_all_tasks_blocked()
        sim.hold()
        internals.completion_of(gpu).batch = True  # (the writer's marker is recorded when needed)
        gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s0)
        assert (
            internals.submission_of(gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s0)).marker
            is None
        )
        with _failing(gpu, "record_marker", error("no marker")):
            try:
                gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s1)
            except (Boom, trio_cuda.CompletionUnknownError) as exc:
                out["raised"] = repr(exc)
        out["stats"] = gpu.statistics()
        try:
            gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s1)
        except trio_cuda.CompletionUnknownError as exc:
            out["then"] = str(exc)

    out = _agree(scenario)
    if error is Boom:
        assert out["raised"] == "Boom('no marker')"
    else:
        assert "CompletionUnknownError('bump: completion of submission #4" in out["raised"], out
    assert out["stats"].quarantined == 2
    assert out["stats"].in_flight == 0
    assert "is unknown; its memory is quarantined" in out["then"]
    assert "CompletionUnknownError" in out["exit"]
    assert out["took"] == 2
    assert _waits(out) == []


def test_unknown_completion_in_the_way_raises_alike():
    """The writer in the way is marked, and its marker's completion cannot
    be established: the conflicting launch is refused with nothing enqueued."""

    async def scenario(gpu: Any, sim: SimDevice, out: dict[str, Any]) -> None:
        s0, s1 = gpu.streams
        x = gpu.zeros(N, np.float32)
        await trio.testing.wait_all_tasks_blocked()
        sim.hold()
        sim.inject_fault("completion_unknown")
        gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s0)
        internals.completion_of(gpu).flush_all()
        sim.complete_next()
        try:
            gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s1)
        except trio_cuda.CompletionUnknownError as exc:
            out["raised"] = str(exc)
        out["stats"] = gpu.statistics()

    out = _agree(scenario)
    assert "could not be established; work that touches its memory is refused" in out["raised"], out
    assert out["stats"].submitted == 3  # the fill, the first launch, its marker's... not the second
    assert "CompletionUnknownError" in out["exit"]
    assert out["took with waits"] == 0
    assert _waits(out) == []


def test_conflicts_error_is_left_to_python():
    out = _agree(_chain, conflicts="error")
    assert "AccessConflictError" in out["exit"]
    assert out["took with waits"] == 0
    assert _waits(out) == []


def test_a_completed_writer_in_the_way_is_not_waited_for():
    async def scenario(gpu: Any, sim: SimDevice, out: dict[str, Any]) -> None:
        s1, x = await _held_writer(gpu, sim)
        internals.completion_of(gpu).flush_all()
        sim.run_until_idle()  # done on the device, not yet retired
        gpu.submit(BUMP.launch(x, 1.0, grid=1, block=N), stream=s1)
        out["stats"] = gpu.statistics()
        sim.release()
        out["x"] = (await gpu.to_host(x)).tolist()

    out = _agree(scenario)
    assert out["x"] == [2.0] * N
    assert out["took"] >= 2
    assert _waits(out) == []
