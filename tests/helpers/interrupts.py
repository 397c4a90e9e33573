"""Ctrl-C at random points of a scope's exit and of a graph capture.

Run as a program (``python tests/helpers/interrupts.py FIRST COUNT``): it runs
``COUNT`` trials from seed ``FIRST`` on, one ``trio.run`` each in the main
thread (where Trio handles SIGINT; the program first restores SIGINT's
default, should it have been started with SIGINT ignored), and prints one
JSON line per trial. A
trial is fixed by its seed: a scenario, a simulated device with real
durations, some unawaited work, and the driver calls (counted from the start
of the scope's exit, or of the capture) at which SIGINT is raised from inside
the call, once or twice.

What each trial must end in, whatever the interrupts hit:

* the program ends (``faulthandler`` ends the process with the stuck stack
  if one trial runs past its limit), with the interrupt reported;
* every scope is closed with nothing in flight, and the memcheck is clean;
* either everything was drained and freed, or (only after a second Ctrl-C
  or a drain timeout) the work still in flight was quarantined with a
  ``ResourceWarning``;
* after an interrupted capture, the stream is usable: the same scope runs,
  captures and replays again and gets the right data.

``tests/lifetimes/test_keyboard_interrupt.py`` runs a batch; the slow variant runs more.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import random
import signal
import time
import traceback
import warnings
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import ops
from trio_cuda._backends.sim.context import SimContext

F4 = np.float32
LIMIT_S = 30.0  # one trial; a hang ends the process with its stack

#: driver calls that may carry a Ctrl-C (sync ones; wait_for_progress is async)
POINTS = (
    "poll_marker",
    "record_marker",
    "free",
    "destroy_stream",
    "unload_kernel",
    "close",
    "open_gate",
    "begin_capture",
    "end_capture",
    "fill",
    "copy_d2d",
    "copy_h2d",
    "launch",
)


class Plan:
    """When to interrupt: the driver calls (1-based, counted while ``phase``
    is armed) at which SIGINT is raised from inside the call."""

    def __init__(self, at: list[int], only: str | None = None) -> None:
        self.at = at
        self.only = only  # count calls of this driver method alone
        self.phase = False
        self.calls = 0
        self.sent = 0

    def tick(self, name: str) -> None:
        if not self.phase or (self.only is not None and name != self.only):
            return
        self.calls += 1
        if self.calls in self.at:
            self.sent += 1
            signal.raise_signal(signal.SIGINT)  # handled by Trio's handler at once


PLAN = Plan([])


def _patch() -> None:
    for name in POINTS:
        original = getattr(SimContext, name)

        def call(self: Any, *args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            result = __original(self, *args, **kwargs)
            PLAN.tick(__name)  # after the call: its effect on the device is done
            return result

        setattr(SimContext, name, call)
    waiting = SimContext.wait_for_progress

    async def wait_for_progress(self: Any, pending: Any) -> None:
        PLAN.tick("wait_for_progress")
        await waiting(self, pending)

    SimContext.wait_for_progress = wait_for_progress  # type: ignore[method-assign]


ADD = trio_cuda.Kernel.from_source(
    'extern "C" __global__ void add_f4(float* x, float v, int n) {}',
    "add_f4",
    params=[trio_cuda.InOut("f4"), trio_cuda.Scalar("f4"), trio_cuda.Scalar("i4")],
    reference=lambda x, v, n: x.__setitem__(slice(0, n), x[:n] + v),
)


def add(x: trio_cuda.DeviceArray, v: float) -> Any:
    return ADD.launch(x, F4(v), x.size, grid=1, block=x.size)


def _busy(gpu: trio_cuda.ResourceScope, rng: random.Random, arrays: list[trio_cuda.DeviceArray]) -> None:
    """Unawaited work of every kind, in flight when the exit starts."""
    for _ in range(rng.randint(1, 6)):
        x = rng.choice(arrays)
        kind = rng.choice(("fill", "add", "copy", "closure"))
        if kind == "fill":
            gpu.submit(ops.fill(x, float(rng.randint(0, 9))))
        elif kind == "add":
            gpu.submit(add(x, 1.0))
        elif kind == "copy":
            y = rng.choice(arrays)
            if y is not x:
                gpu.submit(ops.copy(y, x))
        else:
            gpu.submit(ops.fill(x, 2.0).then(lambda _: ops.host_closure(lambda: None)))


async def _exit_trial(rng: random.Random, sim: trio_cuda.testing.SimDevice, out: dict[str, Any]) -> None:
    timeout = rng.choice((None, None, None, 0.5))
    async with trio_cuda.open_scope(device=sim, streams=rng.randint(1, 3), drain_timeout=timeout) as gpu:
        out["scopes"].append(gpu)
        arrays = [await gpu.to_device(np.arange(64, dtype=F4)) for _ in range(3)]
        if rng.random() < 0.3:
            g = await gpu.capture(trio_cuda.zip(ops.fill(arrays[0], 5.0), add(arrays[1], 1.0)))
            gpu.submit(g.launch())
        _busy(gpu, rng, arrays)
        PLAN.phase = True  # the exit starts here


async def _nested_trial(rng: random.Random, sim: trio_cuda.testing.SimDevice, out: dict[str, Any]) -> None:
    async with trio_cuda.open_scope(device=sim, streams=2) as outer:
        out["scopes"].append(outer)
        x = await outer.to_device(np.arange(64, dtype=F4))
        _busy(outer, rng, [x, outer.zeros(64, F4)])
        async with trio_cuda.open_scope(device=sim, streams=rng.randint(1, 2)) as inner:
            out["scopes"].append(inner)
            y = inner.empty(64, F4)
            inner.submit(ops.copy(y, x))  # a cross-scope copy of the outer scope's memory
            inner.submit(add(y, 1.0))
            if rng.random() < 0.5:
                inner.submit(ops.copy(x, y))
            PLAN.phase = True  # the inner exit, then the outer one


async def _capture_trial(rng: random.Random, sim: trio_cuda.testing.SimDevice, out: dict[str, Any]) -> None:
    async with trio_cuda.open_scope(device=sim, streams=rng.randint(1, 2)) as gpu:
        out["scopes"].append(gpu)
        x = await gpu.to_device(np.zeros(64, dtype=F4))
        y = await gpu.to_device(np.zeros(64, dtype=F4))
        pieces = [ops.fill(x, 3.0), ops.copy(y, x), add(y, 1.0)]
        op = (
            trio_cuda.zip(*pieces[: rng.randint(1, 3)])
            if rng.random() < 0.7
            else pieces[0].then(lambda _: add(x, 2.0))
        )
        PLAN.phase = True
        try:
            graph = await gpu.capture(op)
            await trio.sleep(0.01)  # a deferred interrupt arrives here at the latest
            graph.close()
        except KeyboardInterrupt:
            out["caught"] += 1
        PLAN.phase = False
        # The stream must not be left capturing: run, capture and replay again.
        await gpu.run(ops.fill(x, 1.0))
        graph = await gpu.capture(trio_cuda.zip(ops.fill(y, 4.0), add(x, 1.0)))
        await gpu.run(graph.launch())
        graph.close()
        got = (await gpu.to_host(x), await gpu.to_host(y))
        if not (np.all(got[0] == 2.0) and np.all(got[1] == 4.0)):
            out["problems"].append(f"wrong data after an interrupted capture: {got[0][:4]}, {got[1][:4]}")


SCENARIOS = {"exit": _exit_trial, "nested": _nested_trial, "capture": _capture_trial}


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def trial(
    seed: int, scenario: str | None = None, at: list[int] | None = None, only: str | None = None
) -> dict[str, Any]:
    """One trial; ``scenario``, ``at`` and ``only`` fix what the seed would pick."""
    rng = random.Random(seed)
    picked = rng.choice(tuple(SCENARIOS))
    scenario = scenario or picked
    t = rng.choice((0.001, 0.003, 0.01))
    sim = trio_cuda.testing.SimDevice(kernel_time=t, copy_time=t)
    first = rng.randint(1, 4 if scenario == "capture" else 12)
    if at is None:
        at = [first] + ([first + rng.randint(1, 10)] if rng.random() < 0.4 else [])
    PLAN.__init__(at, only)
    out: dict[str, Any] = {"scopes": [], "caught": 0, "problems": []}
    interrupted = 0
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            trio.run(SCENARIOS[scenario], rng, sim, out)
        except BaseException as exc:
            for leaf in _leaves(exc):
                if isinstance(leaf, KeyboardInterrupt):
                    interrupted += 1
                else:
                    out["problems"].append("".join(traceback.format_exception(leaf, limit=-6)))
    PLAN.phase = False
    problems: list[str] = out["problems"]
    resource = [str(w.message) for w in warned if issubclass(w.category, ResourceWarning)]
    other = [str(w.message) for w in warned if not issubclass(w.category, ResourceWarning)]
    problems += [f"unexpected warning: {w}" for w in other]
    quarantined = 0
    for gpu in out["scopes"]:
        st = gpu.statistics()
        quarantined += st.quarantined + st.quarantined_leases
        if not gpu.closed:
            problems.append(f"{gpu!r} is not closed")
        if st.in_flight:
            problems.append(f"{gpu!r} exited with {st.in_flight} in flight")
    delivered = interrupted + out["caught"]
    if PLAN.sent and not delivered:
        problems.append(f"{PLAN.sent} SIGINT(s) sent, none reported")
    if delivered and not PLAN.sent:
        problems.append("an interrupt nobody sent")
    if sim.violations:
        problems.append(f"memcheck: {sim.violations[:3]}")
    if quarantined:
        if not resource:
            problems.append(f"{quarantined} quarantined without a ResourceWarning")
        if PLAN.sent < 2 and not any("drain_timeout" in w for w in resource):
            problems.append(f"{quarantined} quarantined after {PLAN.sent} Ctrl-C and no drain timeout")
    elif sim.live_allocations:
        problems.append(f"nothing quarantined, yet {len(sim.live_allocations)} allocation(s) never freed")
    return {
        "seed": seed,
        "scenario": scenario,
        "sent": PLAN.sent,
        "delivered": delivered,
        "calls": PLAN.calls,
        "outcome": "quarantined" if quarantined else "drained",
        "seconds": round(time.perf_counter() - t0, 3),
        "problems": problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("first", type=int, help="the first seed")
    parser.add_argument("count", type=int, help="how many trials")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help="instead of the seed's pick")
    parser.add_argument("--at", type=int, nargs="+", help="the calls that carry a SIGINT")
    parser.add_argument("--only", choices=(*POINTS, "wait_for_progress"), help="count these calls alone")
    args = parser.parse_args()
    # Ctrl-C must raise KeyboardInterrupt here (so that Trio handles it), also in a process
    # started with SIGINT ignored, as a non-interactive shell starts a background job.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _patch()
    for seed in range(args.first, args.first + args.count):
        print(json.dumps({"start": seed}), flush=True)
        faulthandler.dump_traceback_later(LIMIT_S, exit=True)
        result = trial(seed, args.scenario, args.at, args.only)
        faulthandler.cancel_dump_traceback_later()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
