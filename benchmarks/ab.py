"""A/B two trees of trio_cuda in one process, alternating round by round.

    python3 benchmarks/ab.py OLD_TREE [NEW_TREE] [--rounds 12] [--device cuda]
    python3 benchmarks/ab.py --paths [--rounds 12]

With ``--paths``, one tree (this one) is imported twice and measured twice per
round: "old" with every compiled part off, as with ``TRIO_CUDA_PURE=1`` (the
CUDA backend's launch path through cuda.bindings' wrappers, the pure-Python
builder and typed-launch fast path), "new" with the compiled parts on (the
direct driver calls, the compiled builder and typed-launch fast path).

Each tree (a directory that holds a ``trio_cuda`` package, e.g. one made with
``git archive REV trio_cuda | tar -x -C DIR``) is imported under its own name,
so both run in the same process, on the same device, against the same driver
state. Every round measures both trees in turn (ABBA order), so slow phases
of a noisy host hit both alike; the result is the median of each figure and
the median of the per-round ratios new/old, and the ratio of the best
figures (a hiccup of the host only ever makes a figure worse):

* ``roundtrip``: ``await gpu.run(launch)`` of an empty kernel with 4 array
  arguments, pinned to one stream (µs per op, the best of three blocks of 100);
* ``roundtrip_traced``: the same in a scope that records a lifetime trace;
* ``submit``: safe ``gpu.submit`` of the same prebuilt launch, bursts of 500
  (µs per submission);
* ``async_on``: ``unsafe.async_on`` of the same launch, bursts of 500 (µs per
  launch);
* ``typed``: ``gpu.submit(k.launch(...))``, a fresh typed launch each call,
  bursts of 500 (µs per launch);
* ``builder``: ``unsafe.async_on`` of ``k.builder()...finalize_unchecked()``,
  built each call, bursts of 500 (µs per launch);
* ``tasks_100``: 100 tasks, each awaiting 50 of its own launches (launches/s);
* ``tasks_100_typed``: the same, each launch a typed launch made per await
  (launches/s);
* ``conflict_100``: 100 tasks, task i on stream i % 4, each awaiting 50 typed
  launches that write the same two buffers (every launch a cross-stream
  conflict, ordered device-side; launches/s).

On the simulator (``--device sim``) it measures the library's Python against
the simulated driver.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from types import ModuleType
from typing import Any

import numpy as np
import trio

perf = time.perf_counter
SRC = r"""
extern "C" __global__ void empty(const float* a, const float* b, const float* c, const float* d, int n) { }
extern "C" __global__ void write2(float* a, float* b, int n) { }
"""


def load_tree(tree: str, alias: str, *, pure: bool = False) -> ModuleType:
    """Import ``tree/trio_cuda`` as the package ``alias`` (its imports are
    relative, so its modules stay apart from any other copy); ``pure``: with
    ``TRIO_CUDA_PURE=1`` while it imports (its compiled parts are chosen then)."""
    saved = os.environ.get("TRIO_CUDA_PURE")
    if pure:
        os.environ["TRIO_CUDA_PURE"] = "1"
    try:
        return _load_tree(tree, alias)
    finally:
        if saved is None:
            os.environ.pop("TRIO_CUDA_PURE", None)
        else:
            os.environ["TRIO_CUDA_PURE"] = saved


def _load_tree(tree: str, alias: str) -> ModuleType:
    init = os.path.join(os.path.abspath(tree), "trio_cuda", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        alias, init, submodule_search_locations=[os.path.dirname(init)]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"OLD_TREE/NEW_TREE: expected a directory holding trio_cuda/, got {tree!r}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod


async def _roundtrip(gpu: Any, op: Any, s: Any) -> float:
    """µs per ``await gpu.run(op)`` after 50 warm-up ones: the best of three
    blocks of 100 (a block with a hiccup of the host is dropped)."""
    for _ in range(50):
        await gpu.run(op, stream=s)
    per = []
    for _ in range(3):
        t0 = perf()
        for _ in range(100):
            await gpu.run(op, stream=s)
        per.append((perf() - t0) / 100 * 1e6)
    return min(per)


async def measure(tc: Any, device: str, pure: bool | None = None) -> dict[str, float]:
    if pure is not None:
        importlib.import_module(f"{tc.__name__}._backends.cuda.direct").reset(pure=pure)
    kernel = tc.Kernel.from_source(
        SRC, "empty", params=[tc.In("f4")] * 4 + [tc.Scalar("i4")], reference=lambda *a: None
    )
    write2 = tc.Kernel.from_source(
        SRC, "write2", params=[tc.InOut("f4")] * 2 + [tc.Scalar("i4")], reference=lambda *a: None
    )
    out: dict[str, float] = {}
    async with tc.open_scope(device=device, streams=4) as gpu:
        bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
        a, b, c, d = bufs
        op = kernel.launch(a, b, c, d, 256, grid=1, block=1)
        s = gpu.streams[0]
        out["roundtrip"] = await _roundtrip(gpu, op, s)
        trace = tc.trace.Trace(limit=1_000_000)
        async with tc.open_scope(device=device, streams=4, trace=trace) as traced:
            tbufs = [traced.zeros(256, np.float32) for _ in range(4)]
            top = kernel.launch(*tbufs, 256, grid=1, block=1)
            out["roundtrip_traced"] = await _roundtrip(traced, top, traced.streams[0])
        per = []
        for _ in range(3):
            t0 = perf()
            futs = [gpu.submit(op, stream=s) for _ in range(500)]
            per.append((perf() - t0) / 500 * 1e6)
            await futs[-1].wait()
            del futs
        out["submit"] = min(per)
        per = []
        for _ in range(3):  # unsafe.async_on: bursts of 500, then one sync
            t0 = perf()
            for _ in range(500):
                tc.unsafe.async_on(op, s)
            per.append((perf() - t0) / 500 * 1e6)
            await gpu.run(tc.ops.value(None), stream=s)
        out["async_on"] = min(per)
        per = []
        for _ in range(3):
            t0 = perf()
            futs = [gpu.submit(kernel.launch(a, b, c, d, 256, grid=1, block=1), stream=s) for _ in range(500)]
            per.append((perf() - t0) / 500 * 1e6)
            await futs[-1].wait()
            del futs
        out["typed"] = min(per)
        n = np.int32(256)
        per = []
        for _ in range(3):  # the builder, built each call, then unsafe.async_on
            t0 = perf()
            for _ in range(500):
                tc.unsafe.async_on(
                    kernel.builder().grid(1).block(1).arg(a).arg(b).arg(c).arg(d).arg(n).finalize_unchecked(),
                    s,
                )
            per.append((perf() - t0) / 500 * 1e6)
            await gpu.run(tc.ops.value(None), stream=s)
        out["builder"] = min(per)

        async def task() -> None:
            for _ in range(50):
                await gpu.run(op)

        t0 = perf()
        async with trio.open_nursery() as nursery:
            for _ in range(100):
                nursery.start_soon(task)
        out["tasks_100"] = 100 * 50 / (perf() - t0)

        async def typed_task() -> None:
            for _ in range(50):
                await gpu.run(kernel.launch(a, b, c, d, 256, grid=1, block=1))

        t0 = perf()
        async with trio.open_nursery() as nursery:
            for _ in range(100):
                nursery.start_soon(typed_task)
        out["tasks_100_typed"] = 100 * 50 / (perf() - t0)

        async def conflict_task(i: int) -> None:
            st = gpu.streams[i % 4]
            for _ in range(50):
                await gpu.run(write2.launch(a, b, 256, grid=1, block=1), stream=st)

        await gpu.run(write2.launch(a, b, 256, grid=1, block=1))
        t0 = perf()
        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(conflict_task, i)
        out["conflict_100"] = 100 * 50 / (perf() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("old", nargs="?")
    ap.add_argument("new", nargs="?", default=here)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--paths", action="store_true", help="A/B the launch paths of this tree")
    args = ap.parse_args()
    pure: dict[str, bool | None] = {"old": None, "new": None}
    if args.paths:
        trees = {
            "old": load_tree(args.new, "trio_cuda_pure", pure=True),
            "new": load_tree(args.new, "trio_cuda_new"),
        }
        pure = {"old": True, "new": False}
        compiled = importlib.import_module("trio_cuda_new._core._compiled").ext is not None
        print(
            f"old: every compiled part off; new: the compiled parts on (launch making compiled: {compiled})"
        )
    elif args.old is None:
        ap.error("give OLD_TREE, or --paths")
    else:
        trees = {"old": load_tree(args.old, "trio_cuda_old"), "new": load_tree(args.new, "trio_cuda_new")}
    rows: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    ratios: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        got = {name: trio.run(measure, trees[name], args.device, pure[name]) for name in order}
        for name in order:
            for k, v in got[name].items():
                rows[name].setdefault(k, []).append(v)
        for k in got["old"]:
            ratios.setdefault(k, []).append(got["new"][k] / got["old"][k])
    print(
        f"{'figure':<12} {'old':>12} {'new':>12} {'new/old (median of rounds)':>28} {'best new/best old':>18}"
    )
    for k in rows["old"]:
        old, new = statistics.median(rows["old"][k]), statistics.median(rows["new"][k])
        q = sorted(ratios[k])
        lo, hi = q[len(q) // 4], q[(3 * len(q)) // 4]
        best = max if k.startswith(("tasks_100", "conflict_100")) else min  # a rate, or a time
        ratio = best(rows["new"][k]) / best(rows["old"][k])
        print(
            f"{k:<12} {old:12.2f} {new:12.2f} {statistics.median(q):12.3f}  (quartiles {lo:.3f}-{hi:.3f})"
            f" {ratio:10.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
