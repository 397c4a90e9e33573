"""examples/service/serve.py: a real HTTP service awaiting kernels, under load.

The server runs in a subprocess (hypercorn on Trio, one long-lived scope on the
simulator); a real HTTP client drives it from hundreds of concurrent clients,
a share of which give up mid-request, so the server sees disconnects and
cancels their GPU work. Every answer is checked against NumPy, the scope must
settle (nothing in flight, no leases, only the model's allocations left,
memcheck clean), bad input gets a 400, and SIGINT stops it cleanly. A ``gpu``
variant does the same on a real GPU (skipped cleanly without one).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from trio_cuda._backends import probe_cuda

pytest.importorskip("hypercorn")
httpx = pytest.importorskip("httpx")

# httpx's request body is an async generator; a request cancelled while sending it leaves the
# generator to Trio's finalizer, which warns. That is the client's business, not the server's.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:Async generator 'httpx._content.ByteStream.__aiter__' was garbage collected:ResourceWarning"
    ),
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <async_generator object ByteStream.__aiter__"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
]

ROOT = Path(__file__).resolve().parent.parent
SERVE = ROOT / "examples" / "service" / "serve.py"
CLIENTS = 240
CANCEL_SHARE = 0.2


def _load_serve() -> Any:
    spec = importlib.util.spec_from_file_location("service_serve", SERVE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("service_serve", module)
    spec.loader.exec_module(module)
    return module


serve = _load_serve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, device: str, log: Path, matmul: str = "auto") -> None:
        self.device = device
        self.matmul = matmul
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(SERVE),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--device",
                    device,
                    "--matmul",
                    matmul,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited early:\n{self.output()}"
            try:
                r = httpx.get(f"{self.url}/health", timeout=1.0)
                if r.status_code == 200:
                    assert r.json() == {"dim": serve.D}
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        pytest.fail(f"the server did not answer /health within {timeout} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(
    scope="module",
    # on a GPU: cuBLAS through CuPy inside ops.external where CuPy is installed, and the kernels
    params=[
        "sim",
        pytest.param("cuda", marks=pytest.mark.gpu),
        pytest.param("cuda-kernel", marks=pytest.mark.gpu),
    ],
)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    device, _, matmul = str(request.param).partition("-")
    if device == "cuda":
        probe = probe_cuda()
        if not probe.available:
            pytest.skip(f"no CUDA GPU: {probe.reason}")
    srv = Server(device, tmp_path_factory.mktemp("service") / "server.log", matmul or "auto")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _tolerance(srv: Server) -> dict[str, float]:
    return {"rtol": 1e-6, "atol": 1e-6} if srv.device == "sim" else {"rtol": 1e-4, "atol": 1e-4}


async def test_score_and_bad_input(server: Server) -> None:
    x = np.linspace(-1.0, 1.0, serve.D, dtype=np.float32)
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        r = await client.post("/score", json={"x": x.tolist()})
        assert r.status_code == 200, r.text
        y = np.asarray(r.json()["y"], np.float32)
        np.testing.assert_allclose(y, serve.reference(x), **_tolerance(server))
        again = await client.post("/score", json={"x": x.tolist()})
        assert again.json() == r.json()  # deterministic

        bad: list[Any] = [
            {"x": [1.0, 2.0]},
            {"x": ["a"] * serve.D},
            {"x": [True] * serve.D},
            {"y": x.tolist()},
            [1, 2, 3],
        ]
        for doc in bad:
            r = await client.post("/score", json=doc)
            assert r.status_code == 400, (doc, r.text)
            assert "error" in r.json()
        for raw in (b"not json", b'{"x": [1,', b"\xff\xfe"):
            r = await client.post("/score", content=raw)
            assert r.status_code == 400, (raw, r.text)
            assert "JSON" in r.json()["error"]
        r = await client.get("/nowhere")
        assert r.status_code == 404


async def test_many_clients_some_cancel(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(7)
    inputs = rng.standard_normal((CLIENTS, serve.D)).astype(np.float32)
    cancelling = set(rng.choice(CLIENTS, int(CLIENTS * CANCEL_SHARE), replace=False).tolist())
    latencies: list[float] = []
    results: dict[int, np.ndarray] = {}
    gave_up = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=CLIENTS)

    async with httpx.AsyncClient(base_url=server.url, timeout=20.0, limits=limits) as client:
        # how many submissions one request makes, to tell afterwards that disconnects cancelled work
        before = (await client.get("/stats")).json()["submitted"]
        await client.post("/score", json={"x": inputs[0].tolist()})
        per_request = (await client.get("/stats")).json()["submitted"] - before
        before += per_request

        async def one(i: int) -> None:
            nonlocal gave_up
            start = time.perf_counter()
            # the impatient give up while the server has their request queued for the GPU
            with trio.move_on_after(0.05 + 0.2 * rng.random() if i in cancelling else 20.0):
                r = await client.post("/score", json={"x": inputs[i].tolist()})
                assert r.status_code == 200, r.text
                results[i] = np.asarray(r.json()["y"], np.float32)
                latencies.append(time.perf_counter() - start)
                return
            gave_up += 1

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(CLIENTS):
                nursery.start_soon(one, i)
        elapsed = time.perf_counter() - t0

        assert gave_up + len(results) == CLIENTS
        assert len(results) >= CLIENTS - len(cancelling), "only the impatient clients may give up"
        if server.device == "sim":  # simulated kernels take 2 ms each: the impatient do give up
            assert gave_up > 0, "no client cancelled mid-request; the test exercised nothing"
        for i, y in results.items():
            np.testing.assert_allclose(y, serve.reference(inputs[i]), **_tolerance(server))

        # the scope settles: nothing in flight, no leases, only the model's two arrays left
        with trio.fail_after(10):
            while True:
                stats = (await client.get("/stats")).json()
                if stats["in_flight"] == 0 and stats["leases_held"] == 0 and stats["live_allocations"] == 2:
                    break
                await trio.sleep(0.05)
        # the server cancelled the work of clients that went away: fewer submissions than asked for
        if gave_up:
            assert stats["submitted"] - before < per_request * CLIENTS, (stats, per_request)
        assert stats["quarantined"] == 0, stats
        assert stats["pending_errors"] == 0, stats
        if server.device == "sim":
            assert stats["violations"] == 0, stats
        # the server still answers correctly after the disconnects
        r = await client.post("/score", json={"x": inputs[0].tolist()})
        np.testing.assert_allclose(r.json()["y"], serve.reference(inputs[0]), **_tolerance(server))

    lat = np.asarray(latencies) * 1e3
    with capsys.disabled():
        print(
            f"\n[service/{server.device}/{server.matmul}] {CLIENTS} concurrent clients, "
            f"{gave_up} gave up mid-request: "
            f"{len(results)} completed in {elapsed:.2f} s = {len(results) / elapsed:.0f} req/s, "
            f"latency p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms"
        )


def test_load_script_verifies_and_settles(server: Server) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(SERVE.parent / "load.py"),
            "--url",
            server.url,
            "--clients",
            "16",
            "--requests",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 wrong" in out.stdout, out.stdout
    assert "in_flight=0, leases_held=0" in out.stdout, out.stdout


def test_sigint_stops_cleanly(server: Server) -> None:
    server.proc.send_signal(signal.SIGINT)
    try:
        status = server.proc.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within 20 s of SIGINT:\n{server.output()}")
    out = server.output()
    assert status in (0, 130), out
    assert "Traceback" not in out, out
    assert f"serving on {server.url} (backend: {server.device}" in out, out
