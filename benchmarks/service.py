"""The service example's GPU path without HTTP: host time per ``Scorer.score``.

Separates what trio_cuda costs per request (upload, two kernels or cuBLAS plus a
kernel, download, three closes) from the HTTP stack's share in the figures of
``examples/service/load.py``. Sequential (one task) and concurrent (N tasks at
once), medians of several rounds.

    python benchmarks/service.py [--device auto|sim|cuda:N] [--matmul auto|kernel|cublas]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import trio

import trio_cuda

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "service"))
import serve  # the example's model and Scorer


async def measure(device: str, matmul: str, n: int, rounds: int) -> None:
    where: object = trio_cuda.testing.SimDevice() if device == "sim" else device
    async with trio_cuda.open_scope(device=where) as gpu:  # type: ignore[arg-type]
        w, b = serve.model()
        scorer = serve.Scorer(gpu, await gpu.to_device(w), await gpu.to_device(b), matmul)
        rng = np.random.default_rng(1)
        x = rng.standard_normal(serve.D).astype(np.float32)
        y = await scorer.score(x)
        np.testing.assert_allclose(y, serve.reference(x), rtol=1e-4, atol=1e-4)
        for _ in range(50):  # warm
            await scorer.score(x)
        seq, conc = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                await scorer.score(x)
            seq.append((time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(scorer.score, x)
            conc.append((time.perf_counter() - t0) / n)
        how = "cuBLAS via CuPy" if scorer.cupy is not None else "kernels"
        print(
            f"service scorer on {gpu.device.backend} ({gpu.device.name}, {how}): "
            f"sequential {statistics.median(seq) * 1e6:.0f} us/request, "
            f"{n} concurrent {statistics.median(conc) * 1e6:.0f} us/request "
            f"(medians of {rounds} rounds; {1 / statistics.median(conc):.0f} requests/s without HTTP)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--matmul", default="auto", choices=["auto", "kernel", "cublas"])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    trio.run(measure, args.device, args.matmul, args.requests, args.rounds)


if __name__ == "__main__":
    main()
