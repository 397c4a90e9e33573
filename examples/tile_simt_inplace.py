"""A tile kernel and a SIMT kernel update one allocation in place, on two streams.

A tile kernel (cuTile, ``import cuda.tile as ct``) writes a fresh allocation:
``y = x * x``. A SIMT kernel (CUDA C++, with a NumPy ``reference=`` for the
simulator) then updates the same allocation in place, ``y = y * s + t``,
submitted on another stream while the tile kernel may still run: nothing but
the leases orders them. The tile kernel's leases come from what it does (it
loads x: a read; it stores y: a write), the SIMT kernel's from its parameter
list (``InOut``), and the conflict on y becomes a device-side wait, not a
blocked host. Chained behind the SIMT kernel with ``then``, on its stream, a
second tile kernel adds ``alpha * x`` to y in place (x read, y read and
written). Both kinds go through one launch API: ``launch``, ``submit``,
``then``, futures.

The device pointer, the ``DeviceArray`` and the scope's allocation count stay
the same throughout (no copy, no new allocation), and the values match NumPy.

    python examples/tile_simt_inplace.py [--n 65536] [--device auto|sim|cuda:N] [--trace OUT.html]

It runs on the real GPU when a CUDA driver and a device answer, and on the
simulated device otherwise, and says which. On the simulator the tile kernels
run on NumPy tiles and every kernel takes ``KERNEL_TIME`` seconds, so the
SIMT kernel is always submitted while the tile kernel runs. Exit status: 0 if
every check passed, 1 if one failed.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import cuda.tile as ct
import numpy as np
import trio

import trio_cuda
from trio_cuda import InOut, Kernel, Scalar
from trio_cuda.testing import SimDevice

KERNEL_TIME = 0.02  # simulated seconds per kernel
TILE = 256
ConstInt = ct.Constant[int]


@ct.kernel
def square(x, y, TILE: ConstInt):
    """``y = x * x``, one tile per block."""
    i = ct.bid(0)
    t = ct.load(x, index=(i,), shape=(TILE,))
    ct.store(y, index=(i,), tile=t * t)


@ct.kernel
def axpy(alpha, x, y, TILE: ConstInt):
    """``y = alpha * x + y``, in place."""
    i = ct.bid(0)
    t = alpha * ct.load(x, index=(i,), shape=(TILE,)) + ct.load(y, index=(i,), shape=(TILE,))
    ct.store(y, index=(i,), tile=t)


SRC = r"""
extern "C" __global__ void affine(float* y, float s, float t, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] * s + t;
}
"""


def affine_on_cpu(y: np.ndarray, s: np.float32, t: np.float32, n: np.int32) -> None:
    y[:n] = y[:n] * s + t


SQUARE = Kernel.from_tile(square)  # leases from the kernel: x read, y written
AXPY = Kernel.from_tile(axpy)  # x read, y read and written
AFFINE = Kernel.from_source(
    SRC, "affine", params=[InOut("f4"), Scalar("f4"), Scalar("f4"), Scalar("i4")], reference=affine_on_cpu
)


async def pick_device(name: str) -> object:
    """The device to use: ``auto`` is the GPU if one answers, else the simulator,
    whose kernels take ``KERNEL_TIME``; a GPU asked for must answer."""
    if name == "sim":
        return SimDevice(kernel_time=KERNEL_TIME)
    try:
        async with trio_cuda.open_scope(device="cuda" if name == "auto" else name):
            return "cuda" if name == "auto" else name
    except trio_cuda.DeviceUnavailableError:
        if name != "auto":
            raise
        return SimDevice(kernel_time=KERNEL_TIME)


def leases(events: list[trio_cuda.trace.TraceEvent], names: dict[int, str]) -> str:
    """The leases the events record, as ``y write, x read``."""
    taken = [lease for e in events if e.args for lease in e.args.get("leases", ())]
    return ", ".join(f"{names.get(ptr, hex(ptr))} {mode}" for ptr, _, _, mode in taken)


async def run(device: object = "auto", n: int = 1 << 16) -> dict[str, Any]:
    """Produce y with a tile kernel, update it in place with a SIMT kernel on
    another stream, then with a tile kernel again, and check. Returns what
    was observed (the tests assert on it too)."""
    trace = trio_cuda.trace.Trace()
    tiles, block = -(-n // TILE), 256
    s, t, alpha = np.float32(2.0), np.float32(1.0), np.float32(0.5)
    x_host = (np.arange(n) % 64).astype(np.float32)
    async with trio_cuda.open_scope(device=device, trace=trace) as gpu:
        x = await gpu.to_device(x_host)
        y = gpu.empty(n, np.float32)
        ptr, allocations = y.ptr, gpu.statistics().live_allocations

        produce = SQUARE.launch(x, y, TILE, grid=tiles)
        affine = AFFINE.launch(y, s, t, n, grid=-(-n // block), block=block)
        add = AXPY.launch(alpha, x, y, TILE, grid=tiles)
        await gpu.load(produce, affine, add)  # compile ahead, in a worker thread

        # The tile kernel on stream 0; at once, without awaiting it, the in-place
        # updates on stream 1. Only the leases on y order them.
        first = gpu.submit(produce, stream=gpu.streams[0])
        second = gpu.submit(affine.then(lambda y: add), stream=gpu.streams[1])
        produced, updated = await first.wait(), await second.wait()
        got = await gpu.to_host(y)

        names = {x.ptr: "x", y.ptr: "y"}
        ev = trace.events
        expected = (x_host * x_host) * s + t + alpha * x_host
        facts = {
            "backend": gpu.backend,
            "device": gpu.device.name,
            "tile_leases": leases([e for e in ev if e.cat == "submit" and e.name == "square"], names),
            "update_leases": leases([e for e in ev if e.cat == "lease" and e.stream == 1], names),
            "waits": len([e for e in ev if e.cat == "wait" and e.stream == 1]),
            "same_array": produced is y and updated is y,
            "same_pointer": produced.ptr == ptr and updated.ptr == ptr and y.ptr == ptr,
            "no_new_allocation": gpu.statistics().live_allocations == allocations,
            "values_ok": bool(np.array_equal(got, expected)),
            "max_error": float(np.max(np.abs(got - expected))),
        }
    if isinstance(device, SimDevice):
        facts["memcheck"] = device.violations == [] and device.live_allocations == []
    facts["trace"] = trace
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1 << 16, help="number of float32 elements")
    ap.add_argument("--device", default="auto", help="auto, sim or cuda:N")
    ap.add_argument("--trace", metavar="OUT", help="write the timeline page (.html, or .json for Perfetto)")
    args = ap.parse_args(argv)
    if not 1 <= args.n < 2**31:
        ap.error("--n: expected 1 <= n < 2**31")
    if args.trace and not args.trace.lower().endswith((".html", ".htm", ".json")):
        ap.error(f"--trace: expected a file name ending in .html or .json, got {args.trace!r}")
    try:
        device = trio.run(pick_device, args.device)
    except trio_cuda.DeviceUnavailableError as exc:
        print(f"{ap.prog}: error: --device {args.device}: {exc}", file=sys.stderr)
        return 2
    f = trio.run(functools.partial(run, device, args.n))

    how = f"the simulated device; each kernel takes {KERNEL_TIME} s" if f["backend"] == "sim" else f["device"]
    print(f"backend: {f['backend']} ({how})")
    print(f"stream 0: square (tile kernel), leases {f['tile_leases']}")
    print(f"stream 1: affine (SIMT) then axpy (tile kernel), leases {f['update_leases']}")
    if f["waits"]:
        print(f"stream 1 waited on the device for the tile kernel's completion ({f['waits']} wait)")
    else:
        print("stream 1 did not wait: the tile kernel had finished before stream 1's work was submitted")
    for key in ("same_array", "same_pointer", "no_new_allocation", "values_ok", "max_error", "memcheck"):
        if key in f:
            print(f"{key:>18}: {f[key]}")
    if args.trace:
        f["trace"].write(args.trace)
        print(f"trace: {len(f['trace'].events)} events written to {args.trace}")
    ok = all(f[k] for k in ("same_array", "same_pointer", "no_new_allocation", "values_ok"))
    if f["backend"] == "sim":  # every kernel takes KERNEL_TIME: the tile kernel was still running
        ok = ok and f["memcheck"] and f["waits"] == 1
    print("tile + SIMT in-place update:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
