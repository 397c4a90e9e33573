"""The compiled stream choice of the default policies (``submit_launch``'s
least-loaded choice, taken where ``FollowWriter`` would find no writer in
flight, and for ``LeastLoaded``) against the policies' own ``choose``.

Random programs hold the simulator, submit launches that read or write
three buffers, pinned and unpinned, and before each unpinned submission ask
the policy's Python method which stream it would choose: the submission
must land there. A policy class whose ``choose`` was replaced is always
asked."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers.kernels import stub_source
from trio_cuda import In, InOut, Scalar
from trio_cuda._core import _compiled, _policy
from trio_cuda.testing import SimDevice


def _noop(*args: Any) -> None:
    return None


READ = trio_cuda.Kernel.from_source(
    stub_source("rd"), "rd", params=[In("f4"), In("f4"), Scalar("f4")], reference=_noop
)
WRITE = trio_cuda.Kernel.from_source(
    stub_source("wr"), "wr", params=[In("f4"), InOut("f4"), Scalar("f4")], reference=_noop
)


async def _program(seed: int, policy: Any) -> tuple[int, int]:
    """(unpinned submissions checked, of them on a stream other than the first)."""
    rng = random.Random(seed)
    sim = SimDevice()
    checked = spread = 0
    async with trio_cuda.open_scope(device=sim, streams=4, policy=policy) as gpu:
        bufs = [gpu.zeros(8, "f4") for _ in range(3)]
        await gpu.run(READ.launch(bufs[0], bufs[1], np.float32(0), grid=1, block=1))
        await gpu.run(WRITE.launch(bufs[0], bufs[1], np.float32(0), grid=1, block=1))
        for _ in range(4):
            sim.hold()
            try:
                for _ in range(rng.randrange(1, 12)):
                    a, b = rng.sample(bufs, 2)
                    op = (READ if rng.random() < 0.6 else WRITE).launch(a, b, np.float32(1), grid=1, block=1)
                    if rng.random() < 0.3:
                        gpu.submit(op, stream=rng.choice(gpu.streams))
                        continue
                    expected = type(policy).choose(policy, gpu.streams, op)
                    fut = gpu.submit(op)
                    assert fut.stream is expected
                    checked += 1
                    spread += expected is not gpu.streams[0]
            finally:
                sim.release()
            await trio.testing.wait_all_tasks_blocked()
    assert sim.violations == []
    return checked, spread


@pytest.mark.parametrize("kind", ["FollowWriter", "LeastLoaded"])
async def test_the_compiled_choice_is_the_policy_s(kind: str) -> None:
    totals = [0, 0]
    for seed in range(12):
        policy = trio_cuda.FollowWriter() if kind == "FollowWriter" else trio_cuda.LeastLoaded()
        checked, spread = await _program(seed, policy)
        totals[0] += checked
        totals[1] += spread
    assert totals[0] > 100
    assert totals[1] > 10  # (the choices were not all the first stream)


@pytest.mark.skipif(_compiled.ext is None, reason="the compiled paths are not in use")
async def test_a_replaced_choose_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []
    original = _policy.FollowWriter.choose

    def choose(self: Any, streams: Any, op: Any) -> Any:
        asked.append(op)
        return streams[-1]

    monkeypatch.setattr(_policy.FollowWriter, "choose", choose)
    sim = SimDevice()
    async with trio_cuda.open_scope(device=sim, streams=4) as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        op = READ.launch(x, y, np.float32(1), grid=1, block=1)
        assert await gpu.run(op) is None
        assert gpu.submit(op).stream is gpu.streams[-1]
        assert asked[-2:] == [op, op]  # (after the two allocations')
    monkeypatch.setattr(_policy.FollowWriter, "choose", original)
    assert sim.violations == []
