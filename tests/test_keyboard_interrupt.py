"""Ctrl-C landing inside the runtime's own bookkeeping never loses work.

Trio raises ``KeyboardInterrupt`` wherever the program happens to be when
SIGINT arrives, unless that code is KI-protected. The runtime protects the
code that moves a submission between its states (marking, retiring, freeing):
a Ctrl-C there is delivered at the next checkpoint instead, so the scope still
knows every submission, its exit drains and frees everything, and nothing
hangs. Each case runs in a subprocess, sends SIGINT from inside one driver
call at a time, and must end promptly with the interrupt reported, the
simulator's memcheck clean and every allocation freed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = textwrap.dedent(
    """
    import json, signal, sys
    import numpy as np, trio, trio_cuda
    from trio_cuda import ops
    from trio_cuda._backends.sim.context import SimContext

    point, nth = sys.argv[1], int(sys.argv[2])
    original = getattr(SimContext, point)
    calls = 0

    def interrupting(self, *args, **kwargs):
        global calls
        calls += 1
        if calls == nth:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, right inside the runtime's bookkeeping
        return original(self, *args, **kwargs)

    setattr(SimContext, point, interrupting)
    sim = trio_cuda.testing.SimDevice(kernel_time=0.001)

    async def main():
        async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
            async def worker(i):
                x = await gpu.to_device(np.arange(256, dtype=np.float32))
                for k in range(40):
                    if k % 3:
                        gpu.submit(ops.fill(x, float(k)))
                    else:
                        await gpu.run(ops.fill(x, float(k)))
                x.close()
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(worker, i)

    interrupted = False
    try:
        trio.run(main)
    except KeyboardInterrupt:
        interrupted = True
    except BaseExceptionGroup as group:
        _, rest = group.split(KeyboardInterrupt)
        if rest is not None:
            raise
        interrupted = True
    print(json.dumps({
        "interrupted": interrupted,
        "calls": calls,
        "violations": len(sim.violations),
        "live": len(sim.live_allocations),
    }))
    """
)


CASES = [(point, nth) for point in ("record_marker", "poll_marker") for nth in (1, 7, 40)]
CASES += [("free", 1), ("free", 3)]  # four arrays are freed


@pytest.mark.parametrize(("point", "nth"), CASES)
def test_ctrl_c_inside_the_runtime_is_delivered_later_and_loses_nothing(point: str, nth: int) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROGRAM, point, str(nth)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"Ctrl-C inside {point} (call {nth}) left the program hanging")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["calls"] >= nth, report  # the interrupt was really sent
    assert report["interrupted"], report  # and delivered, at a checkpoint
    assert report["violations"] == 0, report
    assert report["live"] == 0, report  # the scope drained and freed everything
