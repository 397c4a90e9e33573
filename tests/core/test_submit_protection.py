"""``ResourceScope.submit`` without a frame of its own, and Ctrl-C.

Where the compiled paths are built, ``scope.submit(op)`` runs the compiled
submission with no Python frame (``_claunch_protect.c``). Trio defers a
Ctrl-C only in code marked KI-protected, found by walking the frames, so
every Python frame that such a submission starts must be protected, as it
was under the reference method's protected frame: the simulator's driver
(all Python), a policy's choice, the Python lease path, the trace, a failed
launch's bookkeeping, the general path of other ops. Each case below records
every Python frame started during one ``submit`` (``sys.setprofile``) and
asks Trio whether it is protected. The descriptor also behaves as the method
it stands for: its errors, its signature, the reference on the class.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import stub_source
from trio_cuda import In, InOut, Scalar, ops
from trio_cuda._core import _scope, _submit
from trio_cuda._core._scope import ResourceScope
from trio_cuda.testing import SimDevice


def _ref(x: Any, y: Any, v: Any) -> None:
    y[:] = x + v


K = trio_cuda.Kernel.from_source(
    stub_source("k"), "k", params=[In("f4"), InOut("f4"), Scalar("f4")], reference=_ref
)


def frames_during(call: Callable[[], object]) -> list[tuple[str, bool]]:
    """Each Python frame started while ``call()`` runs: its name, and whether
    Trio would defer a Ctrl-C there."""
    seen: list[tuple[str, bool]] = []

    def hook(frame: Any, event: str, arg: object) -> None:
        if event == "call":
            # (the hook's own frame is not marked: Trio walks on to the frame called)
            seen.append((frame.f_code.co_name, trio.lowlevel.currently_ki_protected()))

    kept = []
    sys.setprofile(hook)
    try:
        kept.append(call())  # (a future dropped later, outside: its finalizer is not the submission's)
    finally:
        sys.setprofile(None)
    assert seen[0][0] in ("<lambda>", call.__name__)
    return seen[1:]  # (the caller's own frame: not the runtime's)


class FirstStream:
    """A user's policy, in Python."""

    def choose(self, streams: Sequence[Any], op: object) -> Any:
        return streams[0]


def _unprotected(seen: list[tuple[str, bool]]) -> list[str]:
    return [name for name, protected in seen if not protected]


@compiled_only
@pytest.mark.parametrize("traced", [False, True])
async def test_every_python_frame_a_frameless_submit_starts_is_protected(
    traced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = SimDevice()
    trace = trio_cuda.trace.Trace() if traced else None
    async with trio_cuda.open_scope(device=sim, streams=2, policy=FirstStream(), trace=trace) as gpu:
        s0, s1 = gpu.streams
        x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
        await gpu.run(K.launch(x, y, np.float32(1), grid=1, block=4), stream=s0)
        seen: dict[str, list[tuple[str, bool]]] = {}
        launches = [K.launch(x, y, np.float32(v), grid=1, block=4) for v in range(6)]
        other_shape = K.launch(x, y, np.float32(3), grid=2, block=2)
        sim.hold()
        try:
            seen["pinned"] = frames_during(lambda: gpu.submit(launches[0], stream=s0))
            seen["policy"] = frames_during(lambda: gpu.submit(launches[1]))
            # a writer on another stream: ordered after s0's work (the driver's waits, in Python here)
            seen["conflict"] = frames_during(lambda: gpu.submit(launches[2], stream=s1))
            seen["another shape"] = frames_during(lambda: gpu.submit(other_shape, stream=s1))
            fill = ops.fill(x, 7.0)
            seen["fill"] = frames_during(lambda: gpu.submit(fill, stream=s0))
            with monkeypatch.context() as m:
                m.setattr(_submit, "take_whole", None)  # (the Python lease path)
                seen["python leases"] = frames_during(lambda: gpu.submit(launches[3], stream=s0))
            sim.inject_fault("launch_error")

            def failing() -> None:
                try:
                    gpu.submit(launches[4], stream=s1)
                except trio_cuda.LaunchError:
                    return
                raise AssertionError("the launch did not fail")

            seen["failed launch"] = frames_during(failing)
        finally:
            sim.release()
        await gpu.run(ops.value(None), stream=s0)
        await gpu.run(ops.value(None), stream=s1)
    for case, frames in seen.items():
        assert frames, case  # (Python ran: the simulator's driver at least)
        assert _unprotected(frames) == [], (case, _unprotected(frames))
    assert sim.violations == []


@compiled_only
async def test_the_reference_runs_where_the_compiled_steps_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
        monkeypatch.setattr(_scope, "submit_whole", None)
        seen = frames_during(lambda: gpu.submit(K.launch(x, y, np.float32(1), grid=1, block=4)))
        assert seen[0] == ("submit", True)  # (the reference's own frame)
        assert _unprotected(seen) == []
        monkeypatch.undo()
        seen = frames_during(lambda: gpu.submit(K.launch(x, y, np.float32(1), grid=1, block=4)))
        assert "submit" not in [name for name, _ in seen]
        assert _unprotected(seen) == []
        await gpu.run(ops.value(None))


@compiled_only
async def test_the_descriptor_is_the_method_it_stands_for() -> None:
    reference = ResourceScope.__dict__["submit"].__wrapped__
    assert ResourceScope.submit is reference  # (read on the class: documentation, signature)
    assert inspect.signature(ResourceScope.submit) == inspect.signature(reference)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(4, "f4"), gpu.zeros(4, "f4")
        s = gpu.streams[0]
        bound = gpu.submit
        assert bound.__self__ is gpu
        assert "stream" in inspect.signature(bound).parameters
        assert bound.__doc__ == reference.__doc__
        assert bound.__name__ == "submit"
        op = K.launch(x, y, np.float32(1), grid=1, block=4)
        bad: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
            ((op, s), {}),  # (stream is keyword-only)
            ((), {}),
            ((op,), {"colour": "red"}),
            ((op,), {"stream": s, "other": 1}),
            ((), {"op": op, "extra": 2}),
        ]
        for args, kwargs in bad:
            with pytest.raises(TypeError) as compiled_error:
                gpu.submit(*args, **kwargs)
            with pytest.raises(TypeError) as reference_error:
                reference(gpu, *args, **kwargs)
            assert str(compiled_error.value) == str(reference_error.value)
        with pytest.raises(TypeError, match="stream"):
            gpu.submit(op, stream=3)  # type: ignore[arg-type]
        fut = bound(op, stream=s)
        assert await fut.wait() is y
        fut = gpu.submit(op, **{"stream": s})
        assert await fut.wait() is y
        assert gpu.statistics().in_flight == 0
