"""The launch builder's host cost, A/B between two trees of trio_cuda.

    python3 benchmarks/builder.py OLD_TREE [NEW_TREE] [--rounds 8] [--device sim]

Each tree (a directory holding a ``trio_cuda`` package, e.g. one made with
``git archive REV trio_cuda | tar -x -C DIR``) is imported under its own
name (``ab.load_tree``), and the rounds alternate the trees (ABBA), so a
slow phase of a noisy host hits both alike. Every figure is µs per call,
the median of bursts of 1000 calls with the garbage collector off:

* ``build``: ``k.builder().grid(1).block(1)``, four ``arg(array)``, one
  ``arg(np.int32(...))``, ``finalize_unchecked()``: the builder alone, no
  enqueue (the part the builder controls);
* ``build_boxed``: the same with the scalar passed by ``arg_boxed``;
* ``typed``: ``k.launch(*arrays, 256, grid=1, block=1)`` (no enqueue), for
  scale;
* ``build+async_on``: the build above, then ``unsafe.async_on`` (the
  design's row, built each call);
* ``typed+async_on``: the typed launch, then ``unsafe.async_on`` (a fresh
  launch each call is checked against the device at its first enqueue, for
  either path: the difference between these two rows and ``async_on`` is
  that check and the making of the launch);
* ``async_on``: ``unsafe.async_on`` of one prebuilt launch;
* ``raw``: the driver's own ``launch`` of one prebuilt, prepacked launch on
  the same stream (the device's raw launch: on the simulator, the
  simulator's cost of enqueueing a kernel; the ratios are to it).

The result is the median of each figure over the rounds, the median of the
per-round ratios new/old, and each tree's ratios to ``raw``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ab import SRC, load_tree

perf = time.perf_counter
N = 1000


def _burst(fn: Callable[[], object], repeats: int) -> float:
    """Median µs per call of ``fn`` over ``repeats`` bursts of ``N`` calls
    (GC off in a burst)."""
    per = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t0 = perf()
            for _ in range(N):
                fn()
            per.append((perf() - t0) / N * 1e6)
        finally:
            gc.enable()
    return statistics.median(per)


async def measure(tc: Any, device: str, repeats: int) -> dict[str, float]:
    kernel = tc.Kernel.from_source(
        SRC, "empty", params=[tc.In("f4")] * 4 + [tc.Scalar("i4")], reference=lambda *a: None
    )
    out: dict[str, float] = {}
    async with tc.open_scope(device=device, streams=1) as gpu:
        bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
        a, b, c, d = bufs
        s = gpu.streams[0]
        n = np.int32(256)
        n_raw = n.tobytes()
        async_on = tc.unsafe.async_on

        def build() -> Any:
            return kernel.builder().grid(1).block(1).arg(a).arg(b).arg(c).arg(d).arg(n).finalize_unchecked()

        def build_boxed() -> Any:
            return (
                kernel.builder()
                .grid(1)
                .block(1)
                .arg(a)
                .arg(b)
                .arg(c)
                .arg(d)
                .arg_boxed(n_raw, align=4)
                .finalize_unchecked()
            )

        def typed() -> Any:
            return kernel.launch(a, b, c, d, 256, grid=1, block=1)

        op = build()
        await gpu.run(op, stream=s)
        driver, handle = gpu._driver, s.handle
        fn = gpu._functions[kernel]
        prepared = op.prepared
        launch = driver.launch

        async def drain() -> None:
            await gpu.run(tc.ops.value(None), stream=s)

        for name, make in (("build", build), ("build_boxed", build_boxed), ("typed", typed)):
            out[name] = _burst(make, repeats)
        for name, call in (
            ("build+async_on", lambda: async_on(build(), s)),
            ("typed+async_on", lambda: async_on(typed(), s)),
            ("async_on", lambda: async_on(op, s)),
            ("raw", lambda: launch(handle, fn, prepared)),
        ):
            per = []
            for _ in range(repeats):
                await drain()
                per.append(_burst(call, 1))
            await drain()
            out[name] = statistics.median(per)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7, help="bursts per figure and round")
    ap.add_argument("--device", default="sim")
    args = ap.parse_args()
    trees = {"old": load_tree(args.old, "trio_cuda_old"), "new": load_tree(args.new, "trio_cuda_new")}
    rows: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    ratios: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        got = {name: trio.run(measure, trees[name], args.device, args.repeats) for name in order}
        for name in order:
            for k, v in got[name].items():
                rows[name].setdefault(k, []).append(v)
        for k in got["old"]:
            ratios.setdefault(k, []).append(got["new"][k] / got["old"][k])
    print(f"{'figure (µs)':<16} {'old':>9} {'new':>9} {'new/old':>9} {'old/raw':>9} {'new/raw':>9}")
    raw = {t: statistics.median(rows[t]["raw"]) for t in ("old", "new")}
    for k in rows["old"]:
        old, new = statistics.median(rows["old"][k]), statistics.median(rows["new"][k])
        print(
            f"{k:<16} {old:9.2f} {new:9.2f} {statistics.median(ratios[k]):9.3f}"
            f" {old / raw['old']:9.2f} {new / raw['new']:9.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
