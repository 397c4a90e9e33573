"""An async MLP service on tile kernels: many concurrent requests, some cancelled.

A small multilayer perceptron answers requests, each a Trio task. A layer is a
tile kernel (cuTile, ``import cuda.tile as ct``) that multiplies the
activations by the layer's weights with ``ct.mma`` over K tiles (f16 or f32
weights, the activations cast to their dtype, f32 accumulation), followed on
the same stream by a SIMT kernel (CUDA C++, with a NumPy ``reference=`` for
the simulator) that adds the bias and applies GELU in place. Both kinds go
through the same launch API, leases and streams.

Each request uploads its input, allocates its activations and submits its
layers one after another. Every ``--cancel-every``-th request has a deadline,
from its upload on, of half a forward pass (``trio.move_on_after``): it is
cancelled, leaves at once and closes its buffers; work it left in flight stays
with the scope, with its memory, until the device has finished it, and the
scope retires it. (On the simulator the deadline always lands while a layer
runs or waits its turn; on a GPU, where a small layer takes microseconds, it
may land between layers: the output counts both.)
One whole forward pass is captured as a graph (``gpu.capture``) and replayed
on new inputs. The answers are checked against NumPy (all of them, or 32 of a
large run).

    python examples/tile_mlp.py [--requests 32] [--batch 16] [--size 64] [--dtype f16|f32]
                                [--cancel-every 4] [--device auto|sim|cuda:N] [--trace OUT.html]

It runs on the real GPU when a CUDA driver and a device answer (try ``--size
1024 --batch 256 --requests 256``), and on the simulated device otherwise,
and says which. On the simulator the tile kernels run on NumPy tiles, and
every kernel takes ``KERNEL_TIME`` seconds, so that a deadline lands in the
middle of the work. ``--trace OUT.html`` writes the scope's timeline page
(``.json`` for ui.perfetto.dev). Exit status: 0 if every check passed, 1 if
one failed.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from typing import Any

import cuda.tile as ct
import numpy as np
import trio

import trio_cuda
from trio_cuda import In, InOut, Kernel, Scalar, ops
from trio_cuda.testing import SimDevice

KERNEL_TIME = 0.004  # simulated seconds per kernel
#: largest error allowed, relative to the largest value of the answer
TOLERANCE = {"f16": 2e-2, "f32": 5e-3}
ConstInt = ct.Constant[int]


@ct.kernel
def matmul(x, w, out, TM: ConstInt, TN: ConstInt, TK: ConstInt):
    """``out = x @ w``: one (TM, TN) tile of ``out`` per block, over K tiles."""
    bm, bn = ct.bid(0), ct.bid(1)
    acc = ct.full((TM, TN), 0, dtype=ct.float32)
    for k in range(ct.num_tiles(x, axis=1, shape=(TM, TK))):
        a = ct.load(x, index=(bm, k), shape=(TM, TK), padding_mode=ct.PaddingMode.ZERO)
        b = ct.load(w, index=(k, bn), shape=(TK, TN), padding_mode=ct.PaddingMode.ZERO)
        acc = ct.mma(a.astype(w.dtype), b, acc)  # f32 accumulation
    ct.store(out, index=(bm, bn), tile=acc.astype(out.dtype))


SRC = r"""
extern "C" __global__ void bias_gelu(float* h, const float* bias, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        float v = h[i] + bias[i % cols];
        h[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
    }
}
"""


def gelu(v: np.ndarray) -> np.ndarray:
    """GELU, tanh form, in float32 (as the kernel computes it)."""
    c, k = np.float32(0.7978845608), np.float32(0.044715)
    return np.float32(0.5) * v * (np.float32(1.0) + np.tanh(c * (v + k * v * v * v)))


def bias_gelu_on_cpu(h: np.ndarray, bias: np.ndarray, rows: np.int32, cols: np.int32) -> None:
    h[:rows] = gelu(h[:rows] + bias)


MATMUL = Kernel.from_tile(matmul)  # leases from the kernel: x and w read, out written
BIAS_GELU = Kernel.from_source(
    SRC, "bias_gelu", params=[InOut("f4"), In("f4"), Scalar("i4"), Scalar("i4")], reference=bias_gelu_on_cpu
)


class Model:
    """The weights (host and device), the layer widths and the tile shape."""

    def __init__(self, size: int, batch: int, dtype: str, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.dims = [size, 2 * size, 2 * size, size]
        self.batch = batch
        self.dtype = np.dtype(np.float16 if dtype == "f16" else np.float32)
        pairs = list(zip(self.dims, self.dims[1:]))
        self.w_host = [(rng.standard_normal((k, n)) / math.sqrt(k)).astype(self.dtype) for k, n in pairs]
        self.b_host = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in self.dims[1:]]
        self.w: list[trio_cuda.DeviceArray] = []
        self.b: list[trio_cuda.DeviceArray] = []
        big = size >= 256 and size % 64 == 0
        self.tiles = (64 if batch % 64 == 0 else 16, 64 if big else 32, 64 if big else 32)

    async def upload(self, gpu: trio_cuda.ResourceScope) -> None:
        self.w = [await gpu.to_device(w) for w in self.w_host]
        self.b = [await gpu.to_device(b) for b in self.b_host]

    @property
    def layers(self) -> int:
        return len(self.w_host)

    def matmul(self, i: int, x: trio_cuda.DeviceArray, h: trio_cuda.DeviceArray) -> trio_cuda.KernelLaunch:
        """``h = x @ w[i]``: a tile kernel launch."""
        tm, tn, tk = self.tiles
        return MATMUL.launch(x, self.w[i], h, tm, tn, tk, grid=(h.shape[0] // tm, h.shape[1] // tn))

    def layer(self, i: int, x: trio_cuda.DeviceArray, h: trio_cuda.DeviceArray) -> trio_cuda.DeviceOp[Any]:
        """``h = gelu(x @ w[i] + b[i])`` (the last layer: ``h = x @ w[i]``), on one stream."""
        op: trio_cuda.DeviceOp[Any] = self.matmul(i, x, h)
        if i < self.layers - 1:
            rows, cols = h.shape
            blocks = -(-rows * cols // 256)
            op = op.then(lambda h: BIAS_GELU.launch(h, self.b[i], rows, cols, grid=blocks, block=256))
        return op

    def forward(self, x: trio_cuda.DeviceArray, hs: list[trio_cuda.DeviceArray]) -> trio_cuda.DeviceOp[Any]:
        """The whole forward pass as one op: its layers chained with ``then``."""
        op = self.layer(0, x, hs[0])
        for i in range(1, self.layers):
            op = op.then(lambda h, i=i: self.layer(i, h, hs[i]))
        return op

    def activations(self, gpu: trio_cuda.ResourceScope) -> list[trio_cuda.DeviceArray]:
        return [gpu.empty((self.batch, n), np.float32) for n in self.dims[1:]]

    def on_cpu(self, x: np.ndarray) -> np.ndarray:
        """What the kernels compute, in NumPy."""
        for i in range(self.layers):
            x = x.astype(self.dtype).astype(np.float32) @ self.w_host[i].astype(np.float32)
            if i < self.layers - 1:
                x = gelu(x + self.b_host[i])
        return x


def error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(got - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


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


async def serve(
    device: object = "sim",
    *,
    requests: int = 32,
    batch: int = 16,
    size: int = 64,
    dtype: str = "f16",
    cancel_every: int = 4,
    trace: trio_cuda.trace.Trace | None = None,
) -> dict[str, Any]:
    """Run the service once; return what was observed (the tests assert on it too)."""
    model = Model(size, batch, dtype)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((batch, size)).astype(np.float32) for _ in range(requests + 6)]
    facts: dict[str, Any] = {"requests": requests, "dims": model.dims, "tiles": model.tiles}
    # The trace says, among the rest, which awaits were cancelled with their work in flight.
    recorder = trace if trace is not None else trio_cuda.trace.Trace()
    async with trio_cuda.open_scope(device=device, trace=recorder) as gpu:
        facts["backend"], facts["device"] = gpu.backend, gpu.device.name
        await model.upload(gpu)

        # The first launch of a signature specialises the kernel (and finds what it
        # does to each array); loading compiles it ahead, in a worker thread, or
        # reads it from the disk cache. Every layer here has one signature.
        start = time.perf_counter()
        x, hs = gpu.empty((batch, size), np.float32), model.activations(gpu)
        first = model.matmul(0, x, hs[0])
        facts["t_specialise"] = time.perf_counter() - start
        start = time.perf_counter()
        await gpu.load(first, BIAS_GELU)
        facts["t_load"] = time.perf_counter() - start

        # Three forward passes: the first pays one-time costs; the fastest tells how
        # long a forward pass takes here (the short deadlines are half of it).
        errors, times = [], []
        for inp in inputs[-3:]:
            await gpu.run(ops.copy(x, inp))
            start = time.perf_counter()
            out = await gpu.run(model.forward(x, hs))
            times.append(time.perf_counter() - start)
            errors.append(error(await gpu.to_host(out), model.on_cpu(inp)))
        facts["t_forward"] = min(times)
        for a in (x, *hs):
            a.close()
        baseline = gpu.statistics().live_allocations  # the weights
        deadline = 0.5 * facts["t_forward"]

        answers: dict[int, np.ndarray] = {}
        cancelled: list[int] = []
        abandoned: list[trio_cuda.DeviceFuture[Any]] = []  # the cancelled requests' last layers

        async def request(i: int) -> None:
            impatient = cancel_every > 0 and i % cancel_every == cancel_every - 1
            buffers: list[trio_cuda.DeviceArray] = []
            fut: trio_cuda.DeviceFuture[Any] | None = None
            try:
                h = await gpu.to_device(inputs[i])
                buffers.append(h)
                with trio.move_on_after(deadline if impatient else math.inf) as cs:  # from here on
                    for layer in range(model.layers):
                        buffers.append(gpu.empty((batch, model.dims[layer + 1]), np.float32))
                        fut = gpu.submit(model.layer(layer, h, buffers[-1]))
                        h = await fut.wait()
                    answers[i] = await gpu.to_host(h)
                if cs.cancelled_caught:
                    cancelled.append(i)
                    if fut is not None:
                        abandoned.append(fut)
            finally:
                for buf in buffers:  # safe with work in flight: freed once it has retired
                    buf.close()

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(request, i)
        facts["t_requests"] = time.perf_counter() - start
        facts["answered"] = len(answers)
        facts["cancelled"] = len(cancelled)
        facts["cancelled_in_flight"] = len([e for e in recorder.events if e.cat == "cancel"])
        facts["deadline"] = deadline

        # Nobody awaits the cancelled requests' layers any more: the scope retires them.
        with trio.fail_after(30):
            while gpu.statistics().in_flight or gpu.statistics().live_allocations > baseline:  # noqa: ASYNC110
                await trio.sleep(0.001)
        facts["retired"] = all(fut.done() for fut in abandoned)
        # NumPy's answers, in a worker thread (every answer; at most 32 of a large run)
        checked = sorted(answers)[:: max(1, -(-len(answers) // 32))]
        expected = await trio.to_thread.run_sync(lambda: [model.on_cpu(inputs[i]) for i in checked])
        errors += [error(answers[i], e) for i, e in zip(checked, expected)]
        facts["checked"] = len(checked)

        # One whole forward pass as a graph, replayed on new inputs.
        x, hs = gpu.empty((batch, size), np.float32), model.activations(gpu)
        graph = await gpu.capture(model.forward(x, hs))
        replays = 0
        for inp in inputs[requests : requests + 3]:
            await gpu.run(ops.copy(x, inp))
            await gpu.run(graph.launch())
            errors.append(error(await gpu.to_host(hs[-1]), model.on_cpu(inp)))
            replays += 1
        graph.close()
        facts["replays"] = replays
        facts["max_error"] = max(errors)
        facts["verified"] = (
            len(errors) == 3 + len(checked) + replays and facts["max_error"] < TOLERANCE[dtype]
        )
        facts["retired_by_waiters"] = gpu.statistics().retired_by_waiters
        facts["completed"] = gpu.statistics().completed
    if isinstance(device, SimDevice):
        facts["memcheck"] = device.violations == [] and device.live_allocations == []
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto, sim or cuda:N")
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests")
    ap.add_argument("--batch", type=int, default=16, help="rows per request (a multiple of 16)")
    ap.add_argument("--size", type=int, default=64, help="model width (a multiple of 32)")
    ap.add_argument("--dtype", choices=("f16", "f32"), default="f16", help="the weights' dtype")
    ap.add_argument(
        "--cancel-every", type=int, default=4, help="every Nth request has a short deadline (0: none)"
    )
    ap.add_argument("--trace", metavar="OUT", help="write the timeline page (.html, or .json for Perfetto)")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.batch < 16 or args.batch % 16 or args.size < 32 or args.size % 32:
        ap.error("expected --requests >= 1, --batch a multiple of 16 and --size a multiple of 32")
    if args.trace and not args.trace.lower().endswith((".html", ".htm", ".json")):
        ap.error(f"--trace: expected a file name ending in .html or .json, got {args.trace!r}")

    try:
        device = trio.run(pick_device, args.device)
    except trio_cuda.DeviceUnavailableError as exc:
        print(f"{ap.prog}: error: --device {args.device}: {exc}", file=sys.stderr)
        return 2
    trace = trio_cuda.trace.Trace() if args.trace else None
    f = trio.run(
        functools.partial(
            serve,
            device,
            requests=args.requests,
            batch=args.batch,
            size=args.size,
            dtype=args.dtype,
            cancel_every=args.cancel_every,
            trace=trace,
        )
    )

    if f["backend"] == "sim":
        how = f"the simulated device: tile kernels run on NumPy tiles; each kernel takes {KERNEL_TIME} s"
    else:
        how = f["device"]
    print(f"backend: {f['backend']} ({how})")
    dims = " -> ".join(map(str, f["dims"]))
    print(
        f"model: {dims}, {args.dtype} weights, f32 accumulation, tiles {f['tiles']}, "
        f"{args.batch} rows a request"
    )
    print(f"first launch of a signature: {f['t_specialise']:.2f} s (accesses analysed, or read from cache)")
    print(f"compiled ahead in a worker thread (await gpu.load): {f['t_load']:.2f} s")
    print(f"one forward pass: {f['t_forward'] * 1e3:.1f} ms; short deadlines: {f['deadline'] * 1e3:.1f} ms")
    print(
        f"{f['requests']} requests in {f['t_requests']:.2f} s: {f['answered']} answered, "
        f"{f['cancelled']} cancelled by their deadline "
        f"({f['cancelled_in_flight']} while a layer was in flight)"
    )
    print(f"the scope retired the work the cancelled requests left in flight: {f['retired']}")
    print(f"graph: one forward pass captured, replayed {f['replays']} times")
    print(
        f"max error against NumPy ({f['checked']} of {f['answered']} answers, the warm-up passes and the "
        f"replays): {f['max_error']:.2e} (tolerance {TOLERANCE[args.dtype]:g})"
    )
    if "memcheck" in f:
        print(f"simulator memcheck clean, nothing left allocated: {f['memcheck']}")
    if trace is not None:
        trace.write(args.trace)
        print(f"trace: {len(trace.events)} events written to {args.trace}")
    ok = f["verified"] and f["retired"] and f.get("memcheck", True)
    if f["backend"] == "sim" and args.cancel_every and args.requests >= args.cancel_every:
        ok = ok and f["cancelled_in_flight"] > 0  # the timed simulator always cancels mid-flight
    print("tile MLP:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
