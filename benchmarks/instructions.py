"""Instructions per launch of the launch rows, counted by callgrind.

    bash benchmarks/nulldriver/build.sh
    LD_LIBRARY_PATH=benchmarks/nulldriver/build python3 benchmarks/instructions.py [--rows typed,submit]
        [--n 10000] [--functions]

Each row runs in a child process under ``valgrind --tool=callgrind`` twice,
with 1,000 and with 1,000 + ``--n`` iterations, and the difference of the
two totals divided by ``--n`` is the count per iteration: start-up, imports
and warm-up cancel out. Counts are repeatable for one build and environment
(``PYTHONHASHSEED`` is fixed; address-dependent hashing leaves about ±100
instructions), so they decide small changes that timings on a noisy host
cannot. With the null driver (``benchmarks/nulldriver``) the driver's own
work is nothing, so the count is the library's and Python's alone; on a GPU
machine the same script counts the real driver's host work too.
``--functions`` prints, per row, the functions with the most instructions
of their own per iteration.

Rows (bursts of 1,000 on one stream, retired between bursts):
``typed`` ``gpu.submit(k.launch(...), stream=s)``; ``submit`` a prebuilt
launch's ``gpu.submit``; ``make`` the typed launch alone; ``async_on``
``unsafe.async_on`` of a prebuilt launch; ``typed_async_on`` of a typed
launch made in the loop; ``raw`` the raw prepacked
``cuLaunchKernel`` of ``run.py`` (cuda.bindings' Python wrapper), the
reference the launch rows' targets are ratios of. ``roundtrip``
``await gpu.run(op)`` of a prebuilt launch (per iteration: one round trip),
and ``traced_roundtrip`` the same in a scope that records a lifetime trace
(into a ring of 3,000 events: the steady state, each event overwriting the
oldest, and a teardown that does not grow with ``--n``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROWS = ("typed", "submit", "make", "async_on", "typed_async_on", "raw", "roundtrip", "traced_roundtrip")
HERE = os.path.dirname(os.path.abspath(__file__))


def child(row: str, n: int) -> None:
    import gc

    import numpy as np
    import trio

    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    import run as R  # (the benchmarks' shared kernel)

    import trio_cuda

    if row == "raw":
        raw = R.Raw()
        L = raw.cu.cuLaunchKernel
        fn, st, params = raw.fn, raw.stream, raw.params
        gc.disable()
        for _ in range(n // 1000):
            for _ in range(1000):
                L(fn, 1, 1, 1, 1, 1, 1, 0, st, params, 0)
            raw.cu.cuStreamSynchronize(st)
        gc.enable()
        return

    async def main() -> None:
        trace = trio_cuda.trace.Trace(limit=3000) if row == "traced_roundtrip" else None
        async with trio_cuda.open_scope(device="cuda", streams=4, trace=trace) as gpu:
            bufs = [gpu.zeros(256, np.float32) for _ in range(4)]
            b0, b1, b2, b3 = bufs
            s = gpu.streams[0]
            k = R.EMPTY
            op = k.launch(b0, b1, b2, b3, 256, grid=1, block=1)
            await gpu.run(op, stream=s)
            gc.disable()
            for _ in range(n // 1000):
                fut = None
                if row == "typed":
                    for _ in range(1000):
                        fut = gpu.submit(k.launch(b0, b1, b2, b3, 256, grid=1, block=1), stream=s)
                elif row == "submit":
                    for _ in range(1000):
                        fut = gpu.submit(op, stream=s)
                elif row == "make":
                    for _ in range(1000):
                        k.launch(b0, b1, b2, b3, 256, grid=1, block=1)
                elif row == "typed_async_on":
                    for _ in range(1000):
                        trio_cuda.unsafe.async_on(k.launch(b0, b1, b2, b3, 256, grid=1, block=1), s)
                elif row in ("roundtrip", "traced_roundtrip"):
                    for _ in range(1000):
                        await gpu.run(op, stream=s)
                    continue
                else:
                    for _ in range(1000):
                        trio_cuda.unsafe.async_on(op, s)
                if fut is not None:
                    await fut.wait()
                else:
                    await gpu.run(trio_cuda.ops.value(None), stream=s)
            gc.enable()

    trio.run(main)


def count(row: str, n: int, out: str) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    tool = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    subprocess.run(
        [*tool, sys.executable, __file__, "--child", row, str(n)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return total(out)


def total(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    raise RuntimeError(f"{path}: no totals")


def own_costs(path: str) -> collections.Counter[str]:
    text = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--threshold=100", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    costs: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*:\S.*)$", line)
        if m:
            name = re.sub(r" \[.*\]$", "", m.group(2)).rsplit(":", 1)[-1]
            costs[name] += int(m.group(1).replace(",", ""))
    return costs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--functions", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]))
        return 0
    if shutil.which("valgrind") is None:
        print("instructions.py needs valgrind (callgrind)", file=sys.stderr)
        return 2
    n = max(1000, a.n // 1000 * 1000)
    with tempfile.TemporaryDirectory() as tmp:
        for row in a.rows.split(","):
            if row not in ROWS:
                print(f"--rows: expected some of {', '.join(ROWS)}, got {row!r}", file=sys.stderr)
                return 2
            short, long = os.path.join(tmp, f"{row}.1"), os.path.join(tmp, f"{row}.2")
            base, more = count(row, 1000, short), count(row, 1000 + n, long)
            print(f"{row:10s} {(more - base) / n:10.0f} instructions per iteration")
            if a.functions:
                diff = own_costs(long)
                diff.subtract(own_costs(short))
                for name, c in diff.most_common(15):
                    print(f"    {c / n:8.0f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
