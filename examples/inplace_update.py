"""In-place inter-kernel update through the normal launch API.

One kernel (``produce``) fills a fresh allocation; a second launch (``update``)
rewrites the same allocation in place, chained with ``.then`` so that it runs
after the first on the same stream; a third, separate submission updates it
once more. The buffer is passed as a ``Slice`` (a pointer followed by its
length, as the kernels declare). The device pointer, the ``DeviceArray`` object
and the scope's allocation count stay the same throughout: no copy, no new
allocation, and the values match the kernels' NumPy references.

    python examples/inplace_update.py [--n 65536] [--device auto|sim|cuda:N]

It runs on the real GPU when a CUDA driver and a device answer, and on the
simulated device otherwise, and says which.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import trio

import trio_cuda
from trio_cuda import Kernel, Scalar, Slice

SRC = r"""
extern "C" __global__ void produce(float* out, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = (float)(i % 1000);
}
extern "C" __global__ void update(float* x, unsigned long long n, float scale, float shift) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * scale + shift;
}
"""


def produce_on_cpu(out: np.ndarray, n: np.uint64) -> None:
    out[:n] = (np.arange(int(n)) % 1000).astype(np.float32)


def update_on_cpu(x: np.ndarray, n: np.uint64, scale: np.float32, shift: np.float32) -> None:
    x[:n] = x[:n] * scale + shift


produce = Kernel.from_source(SRC, "produce", params=[Slice("f4", access="write")], reference=produce_on_cpu)
update = Kernel.from_source(
    SRC,
    "update",
    params=[Slice("f4", access="readwrite"), Scalar("f4"), Scalar("f4")],
    reference=update_on_cpu,
)


async def run(device: object = "auto", n: int = 1 << 16) -> dict[str, Any]:
    """Produce, update in place twice, and check. Returns what was observed
    (the test suite asserts on it too)."""
    block = 256
    grid = (n + block - 1) // block
    async with trio_cuda.open_scope(device=device) as gpu:
        buf = gpu.empty(n, np.float32)
        ptr = buf.ptr
        allocations = gpu.statistics().live_allocations

        # kernel 1 produces the allocation's contents; kernel 2 updates them in place
        op = produce.launch(buf, grid=grid, block=block).then(
            lambda arr: update.launch(arr, np.float32(2.0), np.float32(1.0), grid=grid, block=block)
        )
        first = await gpu.run(op)
        # a later, separate submission updates the same allocation again
        second = await gpu.run(update.launch(buf, np.float32(0.5), np.float32(-3.0), grid=grid, block=block))
        got = await gpu.to_host(buf)

        expected = (np.arange(n) % 1000).astype(np.float32)
        expected = expected * np.float32(2.0) + np.float32(1.0)
        expected = expected * np.float32(0.5) + np.float32(-3.0)
        facts = {
            "backend": gpu.device.backend,
            "same_array": first is buf and second is buf,
            "same_pointer": first.ptr == ptr and second.ptr == ptr and buf.ptr == ptr,
            "no_new_allocation": gpu.statistics().live_allocations == allocations,
            "values_ok": bool(np.array_equal(got, expected)),
            "max_error": float(np.max(np.abs(got - expected))),
        }
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1 << 16, help="number of float32 elements")
    ap.add_argument("--device", default="auto", help="auto, sim or cuda:N")
    args = ap.parse_args(argv)
    facts = trio.run(run, args.device, args.n)
    for key, value in facts.items():
        print(f"{key:>18}: {value}")
    ok = all(facts[k] for k in ("same_array", "same_pointer", "no_new_allocation", "values_ok"))
    print("in-place update:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
