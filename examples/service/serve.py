"""A Trio HTTP service that awaits GPU kernels: one scope, many requests.

The process holds ONE long-lived ``trio_cuda.open_scope`` and a small scoring
model, ``y = relu(W @ x + b)`` (D = 64; ``W`` is a fixed, seeded D x D matrix
uploaded once at startup). Each ``POST /score`` uploads its ``x``, runs a
matrix-vector kernel and an elementwise bias + ReLU kernel (chained with
``.then`` on one stream), downloads ``y`` and closes its arrays. With CuPy on
a real GPU, the matmul goes through cuBLAS inside ``ops.external`` instead.

A client that disconnects cancels its request: the handler watches for the
ASGI ``http.disconnect`` event and cancels the GPU work. Work not yet submitted
is really cancelled; work already on the device is retired by the scope when
it completes, and nothing it uses is freed early (that is trio_cuda's job).

    python examples/service/serve.py --host 127.0.0.1 --port 8000 [--device auto|sim|cuda:N]
                                     [--matmul auto|kernel|cublas]

    GET  /health  -> {"dim": 64}
    POST /score   {"x": [64 floats]} -> {"y": [64 floats]}
    GET  /stats   -> the scope's statistics (and memcheck violations on the simulator)

Ctrl-C (SIGINT) or SIGTERM shuts it down gracefully: the scope drains first.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from typing import Any

import attrs
import numpy as np
import trio

import trio_cuda
from trio_cuda import In, Kernel, Out, Scalar, ops, unsafe

D = 64
SEED = 20241201

SRC = r"""
extern "C" __global__ void matvec(const float* W, const float* x, float* h, int d) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) return;
    float acc = 0.0f;
    for (int j = 0; j < d; ++j) acc += W[i * d + j] * x[j];
    h[i] = acc;
}
extern "C" __global__ void bias_relu(const float* h, const float* b, float* y, int d) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < d) y[i] = fmaxf(h[i] + b[i], 0.0f);
}
"""


def matvec_on_cpu(w: np.ndarray, x: np.ndarray, h: np.ndarray, d: np.int32) -> None:
    n = int(d)
    h[:n] = w.reshape(n, n) @ x[:n]


def bias_relu_on_cpu(h: np.ndarray, b: np.ndarray, y: np.ndarray, d: np.int32) -> None:
    n = int(d)
    y[:n] = np.maximum(h[:n] + b[:n], np.float32(0.0))


matvec = Kernel.from_source(
    SRC, "matvec", params=[In("f4"), In("f4"), Out("f4"), Scalar("i4")], reference=matvec_on_cpu
)
bias_relu = Kernel.from_source(
    SRC, "bias_relu", params=[In("f4"), In("f4"), Out("f4"), Scalar("i4")], reference=bias_relu_on_cpu
)


def model(seed: int = SEED, dim: int = D) -> tuple[np.ndarray, np.ndarray]:
    """The model's weights ``(W, b)``, float32, deterministic for a seed."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((dim, dim)) / math.sqrt(dim)).astype(np.float32)
    b = (0.1 * rng.standard_normal(dim)).astype(np.float32)
    return w, b


def reference(x: np.ndarray, seed: int = SEED) -> np.ndarray:
    """What ``POST /score`` answers for ``x``, computed with NumPy."""
    w, b = model(seed, len(x))
    return np.maximum(w @ np.asarray(x, np.float32) + b, np.float32(0.0))


class Scorer:
    """The model on the device, and the per-request GPU work."""

    def __init__(
        self,
        gpu: trio_cuda.ResourceScope,
        w: trio_cuda.DeviceArray,
        b: trio_cuda.DeviceArray,
        matmul: str = "auto",
    ):
        self.gpu, self.w, self.b = gpu, w, b
        self.cupy: Any = None
        if matmul not in ("auto", "kernel", "cublas"):
            raise ValueError(f"matmul: expected 'auto', 'kernel' or 'cublas', got {matmul!r}")
        if matmul != "kernel" and gpu.device.backend == "cuda":
            try:
                import cupy  # optional: cuBLAS does the matmul
            except Exception:  # not installed, or not for this CUDA: the kernels do it
                if matmul == "cublas":
                    raise
            else:
                self.cupy = cupy
                self.w_cp = self._as_cupy(w, (D, D))
        elif matmul == "cublas":
            raise ValueError(f"matmul: 'cublas' needs a GPU, got the {gpu.device.backend!r} backend")

    def _cupy_stream(self, stream: trio_cuda.Stream) -> Any:
        # CuPy adopts the stream through the CUDA stream protocol (``__cuda_stream__``)
        from_external = getattr(self.cupy.cuda.Stream, "from_external", None)
        if from_external is not None:
            return from_external(stream)
        return self.cupy.cuda.ExternalStream(stream.__cuda_stream__()[1])  # CuPy before 14

    def _as_cupy(self, arr: trio_cuda.DeviceArray, shape: tuple[int, ...]) -> Any:
        # no lease of its own: ops.external's reads/writes cover the memory while cuBLAS runs
        return self.cupy.asarray(unsafe.cuda_view(arr)).reshape(shape)

    def _matmul(self, x: trio_cuda.DeviceArray, h: trio_cuda.DeviceArray) -> trio_cuda.DeviceOp[Any]:
        if self.cupy is None:
            return matvec.launch(self.w, x, h, np.int32(D), grid=1, block=D)
        gpu, x_cp, h_cp = self.gpu, self._as_cupy(x, (D,)), self._as_cupy(h, (D,))

        def cublas(stream: trio_cuda.Stream) -> trio_cuda.DeviceArray:
            cp = self.cupy
            with cp.cuda.Device(gpu.device.ordinal), self._cupy_stream(stream):
                cp.matmul(self.w_cp, x_cp, out=h_cp)  # only enqueues
            return h

        return ops.external(cublas, reads=[self.w, x], writes=[h])

    async def score(self, x_host: np.ndarray) -> np.ndarray:
        gpu = self.gpu
        x = await gpu.to_device(x_host)
        arrays = [x]
        try:
            h = gpu.empty(D, np.float32)
            arrays.append(h)
            y = gpu.empty(D, np.float32)
            arrays.append(y)
            op = self._matmul(x, h).then(
                lambda h_: bias_relu.launch(h_, self.b, y, np.int32(D), grid=1, block=D)
            )
            await gpu.run(op)
            return await gpu.to_host(y)
        finally:  # never frees early: a close waits for the arrays' last use
            for arr in arrays:
                arr.close()


def stats(gpu: trio_cuda.ResourceScope, sim: Any) -> dict[str, Any]:
    s = gpu.statistics()
    out: dict[str, Any] = attrs.asdict(s)
    if sim is not None:
        out["violations"] = len(sim.violations)
    return out


def parse_x(body: bytes) -> np.ndarray:
    """The request's ``x``; ValueError with a message for bad input."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"body: expected JSON, got invalid JSON ({exc})") from None
    x = doc.get("x") if isinstance(doc, dict) else None
    if not isinstance(x, list) or len(x) != D:
        got = f"a list of length {len(x)}" if isinstance(x, list) else type(x).__name__
        raise ValueError(f'"x": expected a list of {D} numbers, got {got}')
    for i, v in enumerate(x):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f'"x"[{i}]: expected a finite number, got {v!r}')
    return np.asarray(x, np.float32)


def make_app(scorer: Scorer, sim: Any) -> Any:
    """A small ASGI app over ``scorer``."""

    async def reply(send: Any, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (event := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        route = (scope["method"], scope["path"])
        if route == ("GET", "/health"):
            await reply(send, 200, {"dim": D})
        elif route == ("GET", "/stats"):
            await reply(send, 200, stats(scorer.gpu, sim))
        elif route == ("POST", "/score"):
            body = b""
            while True:
                event = await receive()
                if event["type"] == "http.disconnect":
                    return
                body += event.get("body", b"")
                if not event.get("more_body", False):
                    break
            try:
                x = parse_x(body)
            except ValueError as exc:
                await reply(send, 400, {"error": str(exc)})
                return
            async with trio.open_nursery() as nursery:

                async def cancel_on_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    nursery.cancel_scope.cancel()  # the client is gone: cancel its GPU work

                nursery.start_soon(cancel_on_disconnect)
                y = await scorer.score(x)
                await reply(send, 200, {"y": y.tolist()})
                nursery.cancel_scope.cancel()
        else:
            await reply(send, 404, {"error": f"no route {scope['method']} {scope['path']}"})

    return app


async def serve(host: str, port: int, device: str, matmul: str = "auto") -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    sim: Any = None
    if device == "sim" or (device == "auto" and not trio_cuda._backends.probe_cuda().available):
        sim = trio_cuda.testing.SimDevice(kernel_time=0.002)
    async with trio_cuda.open_scope(device=sim if sim is not None else device) as gpu:
        w_host, b_host = model()
        w, b = await gpu.to_device(w_host), await gpu.to_device(b_host)
        scorer = Scorer(gpu, w, b, matmul)
        config = Config()
        config.bind = [f"{host}:{port}"]
        config.graceful_timeout = 5.0
        config.backlog = 1024  # many clients connect at once
        config.errorlog = None  # type: ignore[assignment]

        async def shutdown_trigger() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    return

        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: hypercorn_serve(
                    make_app(scorer, sim), config, shutdown_trigger=shutdown_trigger, task_status=task_status
                )
            )
            how = f"{gpu.device.name}, {'cuBLAS via CuPy' if scorer.cupy is not None else 'kernels'}"
            print(f"serving on http://{host}:{port} (backend: {gpu.device.backend}, {how})", flush=True)
    print("stopped: the scope drained", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="auto", help="auto, sim or cuda:N")
    ap.add_argument(
        "--matmul",
        default="auto",
        choices=["auto", "kernel", "cublas"],
        help="the matmul: cuBLAS via CuPy where installed (auto), or always the kernel",
    )
    args = ap.parse_args(argv)
    try:
        trio.run(serve, args.host, args.port, args.device, args.matmul)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
