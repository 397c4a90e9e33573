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

Needs the ``service`` extra (``pip install 'trio_cuda[service]'``: hypercorn);
without it, or when it cannot listen on ``--host``/``--port`` (the port is
in use, say), it says so in one line and exits with status 2, before it
opens the device.

Invariants: every answer is JSON proper (no NaN, no infinities), also an
error. Input that float32 cannot hold (NaN, an infinity, a magnitude past
float32's largest, in any spelling) and any other bad input is refused with
a 400 before it reaches the GPU, a body over ``MAX_BODY`` bytes with a 413;
an error's body names the field, what was expected and what was given (a
missing ``"x"`` is said to be missing). A known path asked with another
method is a 405 with an ``Allow`` header, an unknown path a 404. A
result that is not finite (the computation overflowed float32) is a 422 of
the same form, and an unexpected failure a 500 with a JSON body.

Ctrl-C (SIGINT) or SIGTERM shuts it down gracefully: the scope drains first.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import signal
import sys
import traceback
from typing import Any

import attrs
import numpy as np
import trio

import trio_cuda
from trio_cuda import In, Kernel, Out, Scalar, ops

D = 64
SEED = 20241201
#: the largest magnitude a float32 holds; an input past it is refused
F32_MAX = float(np.finfo(np.float32).max)
#: the largest request body read (bytes)
MAX_BODY = 1 << 20

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


# the simulator's kernels; like a GPU, they overflow to inf without a warning
def matvec_on_cpu(w: np.ndarray, x: np.ndarray, h: np.ndarray, d: np.int32) -> None:
    n = int(d)
    with np.errstate(over="ignore", invalid="ignore"):
        h[:n] = w.reshape(n, n) @ x[:n]


def bias_relu_on_cpu(h: np.ndarray, b: np.ndarray, y: np.ndarray, d: np.int32) -> None:
    n = int(d)
    with np.errstate(over="ignore", invalid="ignore"):
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
    with np.errstate(over="ignore", invalid="ignore"):
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
        elif matmul == "cublas":
            raise ValueError(f"matmul: 'cublas' needs a GPU, got the {gpu.device.backend!r} backend")

    def _cupy_stream(self, stream: trio_cuda.Stream) -> Any:
        # CuPy adopts the stream through the CUDA stream protocol (``__cuda_stream__``)
        from_external = getattr(self.cupy.cuda.Stream, "from_external", None)
        if from_external is not None:
            return from_external(stream)
        return self.cupy.cuda.ExternalStream(stream.__cuda_stream__()[1])  # CuPy before 14

    def _as_cupy(self, arr: trio_cuda.DeviceArray, shape: tuple[int, ...]) -> Any:
        # only inside ops.external's fn: there the export is covered by its reads=/writes= leases
        # (no lease, wait or stream of its own) until cuBLAS's work completed; outside it, a CuPy
        # array kept would hold an export lease for as long as it lives
        return self.cupy.asarray(arr).reshape(shape)

    def _matmul(self, x: trio_cuda.DeviceArray, h: trio_cuda.DeviceArray) -> trio_cuda.DeviceOp[Any]:
        if self.cupy is None:
            return matvec.launch(self.w, x, h, np.int32(D), grid=1, block=D)
        gpu, w = self.gpu, self.w

        def cublas(stream: trio_cuda.Stream) -> trio_cuda.DeviceArray:
            cp = self.cupy
            with cp.cuda.Device(gpu.device.ordinal), self._cupy_stream(stream):
                w_cp, x_cp, h_cp = self._as_cupy(w, (D, D)), self._as_cupy(x, (D,)), self._as_cupy(h, (D,))
                cp.matmul(w_cp, x_cp, out=h_cp)  # only enqueues
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


class RequestError(ValueError):
    """A request the service refuses: which field, what was expected, what was given."""

    def __init__(
        self,
        field: str,
        expected: str,
        got: str,
        status: int = 400,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(f"{field}: expected {expected}, got {got}")
        self.field, self.expected, self.got, self.status = field, expected, got, status
        self.headers = headers  # added to the answer's (405: Allow)

    def doc(self) -> dict[str, str]:
        return {"error": str(self), "field": self.field, "expected": self.expected, "got": self.got}


class _Unrepresentable:
    """A number of the request that float32 cannot hold, kept as its text."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_float(text: str) -> float | _Unrepresentable:
    value = float(text)  # inf past float64's range
    return value if abs(value) <= F32_MAX else _Unrepresentable(text)


def _parse_int(text: str) -> int | _Unrepresentable:
    if len(text.lstrip("-")) > 39:  # past float32's range; int() refuses past 4300 digits
        return _Unrepresentable(text)
    value = int(text)
    return value if abs(value) <= F32_MAX else _Unrepresentable(text)


NUMBER = f"a finite number of magnitude at most {F32_MAX:.8g} (float32)"
DOCUMENT = f'a JSON object {{"x": [{D} numbers]}}'


def _describe(value: object) -> str:
    """What a client sent, in JSON's words."""
    if isinstance(value, _Unrepresentable):
        text = value.text
        digits = len(text.lstrip("-"))
        if text.lstrip("-").isdigit() and digits > 40:
            return f"an integer of {digits} digits ({text[:12]}...)"
        return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        shown = repr(value) if len(value) <= 40 else repr(value[:40])[:-1] + "...'"
        return f"a string {shown}"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return f"an array of length {len(value)}"
    return "an object"


def _fields(doc: dict[str, Any]) -> str:
    """The fields an object has, in a few words."""
    if not doc:
        return "the object is empty"
    names = [json.dumps(k if len(k) <= 20 else k[:20] + "...") for k in list(doc)[:5]]
    more = f" and {len(doc) - 5} more" if len(doc) > 5 else ""
    return f"the object has {', '.join(names)}{more}"


def parse_x(body: bytes) -> np.ndarray:
    """The request's ``x`` as float32; RequestError naming what is wrong."""
    try:
        doc = json.loads(
            body, parse_float=_parse_float, parse_int=_parse_int, parse_constant=_Unrepresentable
        )
    except RecursionError:
        raise RequestError("body", DOCUMENT, "JSON nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise RequestError("body", "JSON", f"invalid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise RequestError("body", DOCUMENT, _describe(doc))
    if "x" not in doc:
        raise RequestError('"x"', f"a list of {D} numbers", f"nothing: the field is missing ({_fields(doc)})")
    x = doc["x"]
    if not isinstance(x, list):
        raise RequestError('"x"', f"a list of {D} numbers", _describe(x))
    if len(x) != D:
        raise RequestError('"x"', f"a list of {D} numbers", f"a list of length {len(x)}")
    for i, v in enumerate(x):
        # what is left of int and float lies within float32's range (the parser's hooks)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RequestError(f'"x"[{i}]', NUMBER, _describe(v))
    return np.asarray(x, np.float32)


def check_y(y: np.ndarray) -> np.ndarray:
    """``y`` if every element is finite; else a RequestError (422): the input
    was valid, but the computation overflowed float32."""
    bad = np.flatnonzero(~np.isfinite(y))
    if bad.size:
        where = ", ".join(str(int(i)) for i in bad[:8]) + (", ..." if bad.size > 8 else "")
        raise RequestError(
            '"y"',
            'finite numbers (float32); scale "x" down',
            f"{bad.size} of {y.size} elements not finite (at {where}): the computation overflowed",
            status=422,
        )
    return y


def _describe_failure(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # the nursery's group around the one failure
    return f"{type(exc).__name__}: {exc}"


#: each path the service answers, and its method
ROUTES = {"/health": "GET", "/stats": "GET", "/score": "POST"}


def make_app(scorer: Scorer, sim: Any) -> Any:
    """A small ASGI app over ``scorer``."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        started = False

        async def reply(status: int, doc: object, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
            nonlocal started
            body = json.dumps(doc, allow_nan=False).encode()  # JSON proper, or a ValueError
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            headers += extra
            started = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        try:
            await route(scope, receive, reply)
        except RequestError as exc:
            if started:
                raise
            await reply(exc.status, exc.doc(), exc.headers)
        except Exception as exc:
            traceback.print_exc()  # the operator's copy; the client gets one line
            if started:
                raise
            await reply(500, {"error": f"internal error: {_describe_failure(exc)}"})

    async def route(scope: dict[str, Any], receive: Any, reply: Any) -> None:
        method, path = scope["method"], scope["path"]
        allowed = ROUTES.get(path)
        if allowed is not None and method != allowed:
            allow = ((b"allow", allowed.encode()),)
            raise RequestError("method", f"{allowed} for {path}", method, status=405, headers=allow)
        where = (method, path)
        if where == ("GET", "/health"):
            await reply(200, {"dim": D})
        elif where == ("GET", "/stats"):
            await reply(200, stats(scorer.gpu, sim))
        elif where == ("POST", "/score"):
            body = b""
            while True:
                event = await receive()
                if event["type"] == "http.disconnect":
                    return
                body += event.get("body", b"")
                if len(body) > MAX_BODY:
                    raise RequestError("body", f"at most {MAX_BODY} bytes", f"over {MAX_BODY}", status=413)
                if not event.get("more_body", False):
                    break
            x = parse_x(body)
            y: np.ndarray | None = None
            async with trio.open_nursery() as nursery:

                async def cancel_on_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    nursery.cancel_scope.cancel()  # the client is gone: cancel its GPU work

                nursery.start_soon(cancel_on_disconnect)
                y = await scorer.score(x)
                nursery.cancel_scope.cancel()
            if y is not None:  # else the client went away
                await reply(200, {"y": check_y(y).tolist()})
        else:
            await reply(404, {"error": f"no route {method} {path}: the paths are {', '.join(ROUTES)}"})

    return app


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class CannotStart(Exception):
    """The service cannot start (an extra is missing, or it cannot listen): one line says why."""


def _config(host: str, port: int) -> tuple[Any, int]:
    """hypercorn's configuration, listening on a socket bound here (so that a
    port in use is told before anything starts), and the port it got."""
    try:
        from hypercorn.config import Config
    except ModuleNotFoundError as exc:
        raise CannotStart(f"serve.py needs hypercorn ({exc}): pip install 'trio_cuda[service]'") from None
    config = Config()
    config.bind = [_netloc(host, port)]
    try:
        sockets = config.create_sockets().insecure_sockets
    except OSError as exc:
        why = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise CannotStart(f"serve.py: cannot listen on {_netloc(host, port)}: {why}") from None
    bound = sockets[0].getsockname()[1]
    config.bind = [f"fd://{sock.detach()}" for sock in sockets]  # hypercorn owns the sockets now
    config.graceful_timeout = 5.0
    config.backlog = 1024  # many clients connect at once
    config.errorlog = None  # type: ignore[assignment]
    return config, bound


async def serve(host: str, port: int, device: str, matmul: str = "auto") -> None:
    """Serve until SIGINT or SIGTERM; CannotStart, before the device is opened,
    where hypercorn is missing or ``host:port`` cannot be listened on."""
    config, port = _config(host, port)
    from hypercorn.trio import serve as hypercorn_serve

    sim: Any = None
    if device == "sim" or (device == "auto" and not trio_cuda._backends.probe_cuda().available):
        sim = trio_cuda.testing.SimDevice(kernel_time=0.002)
    async with trio_cuda.open_scope(device=sim if sim is not None else device) as gpu:
        w_host, b_host = model()
        w, b = await gpu.to_device(w_host), await gpu.to_device(b_host)
        scorer = Scorer(gpu, w, b, matmul)

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
            print(
                f"serving on http://{_netloc(host, port)} (backend: {gpu.device.backend}, {how})", flush=True
            )
    print("stopped: the scope drained", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=_port, default=8000, help="0: any free port")
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
    except CannotStart as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
    return port


if __name__ == "__main__":
    sys.exit(main())
