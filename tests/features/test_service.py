"""examples/service/serve.py: a real HTTP service awaiting kernels, under load.

The server runs in a subprocess (hypercorn on Trio, one long-lived scope on the
simulator); a real HTTP client drives it from hundreds of concurrent clients,
a share of which give up mid-request, so the server sees disconnects and
cancels their GPU work. Every answer is checked against NumPy, the scope must
settle (nothing in flight, no leases, only the model's allocations left,
memcheck clean), bad input gets a 400 naming the field (numbers float32
cannot hold in every spelling, JSON nested too deeply included), a result that
overflows a 422, a known path asked with another method a 405 with ``Allow``,
every answer is strict JSON, a port in use is one line and status 2, and
SIGINT stops it cleanly. A
``gpu`` variant does the same on a real GPU (skipped cleanly without one).
"""

from __future__ import annotations

import importlib.util
import json
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

pytest.importorskip("hypercorn", reason="hypercorn is not installed: pip install 'trio_cuda[service]'")
httpx = pytest.importorskip("httpx", reason="httpx is not installed: pip install 'trio_cuda[service]'")

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

ROOT = Path(__file__).resolve().parents[2]
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
    def __init__(self, device: str, log: Path, matmul: str = "auto", port: int | None = None) -> None:
        self.device = device
        self.matmul = matmul
        self.port = _free_port() if port is None else port
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


async def test_a_known_path_with_another_method_is_a_405_with_allow(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        for method, path, allowed in [
            ("GET", "/score", "POST"),
            ("PUT", "/score", "POST"),
            ("POST", "/health", "GET"),
            ("DELETE", "/stats", "GET"),
        ]:
            r = await client.request(method, path, json={"x": [0.5] * serve.D})
            assert r.status_code == 405, (method, path, r.status_code, r.text)
            assert r.headers["allow"] == allowed, (method, path, r.headers)
            doc = _strict_json(r.text)
            assert doc["field"] == "method", doc
            assert doc["got"] == method, doc
            assert doc["error"] == f"method: expected {allowed} for {path}, got {method}", doc
        for path in ("/nowhere", "/score/", "/SCORE"):  # an unknown path is a 404, for any method
            for method in ("GET", "POST"):
                r = await client.request(method, path)
                assert r.status_code == 404, (method, path, r.status_code)
                assert "allow" not in r.headers
                assert "/score" in _strict_json(r.text)["error"]
        r = await client.post("/score", json={"x": [0.5] * serve.D})  # the right method still works
        assert r.status_code == 200, r.text


def test_a_port_in_use_is_one_line_and_status_2() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, str(SERVE), "--port", str(port), "--device", "sim"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=env,
            check=False,
        )
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == "", out.stdout  # nothing served, the device never opened
    assert out.stderr.splitlines() == [f"serve.py: cannot listen on 127.0.0.1:{port}: the port is in use"]
    # a port number that is none is refused by the command line
    out = subprocess.run(
        [sys.executable, str(SERVE), "--port", "65536"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 2, out
    assert "--port: expected a port number from 0 to 65535, got '65536'" in out.stderr
    assert "Traceback" not in out.stderr


def test_port_0_serves_on_a_free_port_and_says_which(tmp_path: Path) -> None:
    srv = Server("sim", tmp_path / "server.log", port=0)
    try:
        deadline = time.monotonic() + 30
        while "serving on" not in srv.output():
            assert srv.proc.poll() is None, srv.output()
            assert time.monotonic() < deadline, srv.output()
            time.sleep(0.05)
        line = next(ln for ln in srv.output().splitlines() if ln.startswith("serving on "))
        url = line.split()[2]
        port = int(url.rsplit(":", 1)[1])
        assert port > 0, line
        assert httpx.get(f"{url}/health", timeout=10.0).json() == {"dim": serve.D}
    finally:
        srv.stop()


def _strict_json(text: str) -> Any:
    """``text`` parsed as JSON proper: NaN and the infinities are not JSON."""

    def refuse(name: str) -> None:
        raise AssertionError(f"not JSON: {name} in {text[:200]!r}")

    return json.loads(text, parse_constant=refuse)


def _with(i: int, literal: str) -> bytes:
    """A request body whose ``x[i]`` is written as ``literal``, the rest 0.5."""
    items = ["0.5"] * serve.D
    items[i] = literal
    return ('{"x": [' + ", ".join(items) + "]}").encode()


F32_MAX = float(np.finfo(np.float32).max)
DEEP = 100_000


async def test_bad_numbers_and_documents_get_a_400_naming_them(server: Server) -> None:
    # (body, the field named, what the answer says was given)
    cases: list[tuple[bytes, str, str]] = [
        (_with(0, "1e39"), '"x"[0]', "1e39"),  # finite, but overflows float32
        (_with(1, "-3.5e38"), '"x"[1]', "-3.5e38"),
        (_with(2, "1e999"), '"x"[2]', "1e999"),  # overflows float64 too
        (_with(3, str(10**400)), '"x"[3]', "401 digits"),
        (_with(4, "-1" + "0" * 5000), '"x"[4]', "5001 digits"),  # past int()'s digit limit
        (_with(5, str(2**128)), '"x"[5]', str(2**128)),  # a float32 holds at most ~2**128
        (_with(6, "NaN"), '"x"[6]', "NaN"),
        (_with(7, "-Infinity"), '"x"[7]', "-Infinity"),
        (_with(8, '"1.0"'), '"x"[8]', "a string"),
        (_with(9, "null"), '"x"[9]', "null"),
        (_with(10, "[1.0]"), '"x"[10]', "an array"),
        (b"[" * DEEP + b"]" * DEEP, "body", "nested too deeply"),
        (b'{"x": ' + b"[" * DEEP + b"]" * DEEP + b"}", "body", "nested too deeply"),
        (b"[1, 2, 3]", "body", "an array"),
        (b"1e999", "body", "1e999"),
        (b"0.5", "body", "0.5"),
        (b'{"y": [1.0]}', '"x"', 'nothing: the field is missing (the object has "y")'),
        (b'{"y": 1}', '"x"', 'nothing: the field is missing (the object has "y")'),
        (b"{}", '"x"', "nothing: the field is missing (the object is empty)"),
        (b'{"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}', '"x"', '"a", "b", "c", "d", "e" and 1 more'),
        # a field that is there, of the wrong type, is told by its type
        (b'{"x": null}', '"x"', "null"),
        (b'{"x": 5}', '"x"', "5"),
        (b'{"x": "abc"}', '"x"', "a string 'abc'"),
        (b'{"x": true}', '"x"', "true"),
        (b'{"x": {"0": 1.0}}', '"x"', "an object"),
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=20.0) as client:
        for body, field, given in cases:
            r = await client.post("/score", content=body)
            assert r.status_code == 400, (body[:80], r.status_code, r.text[:300])
            doc = _strict_json(r.text)
            assert doc["field"] == field, (body[:80], doc)
            assert given in doc["got"], (body[:80], doc)
            assert doc["expected"], doc
            assert doc["error"] == f"{field}: expected {doc['expected']}, got {doc['got']}", doc
        # the largest float32 is accepted, and a huge number where nothing reads it is ignored
        x = np.zeros(serve.D, np.float32)
        x[0] = F32_MAX
        text = json.dumps({"x": x.tolist()})
        r = await client.post("/score", content=text[:-1] + ', "note": 1' + "0" * 5000 + "}")
        assert r.status_code == 200, r.text[:300]
        y = np.asarray(_strict_json(r.text)["y"], np.float32)
        np.testing.assert_allclose(y, serve.reference(x), **_tolerance(server))
        # a body past the limit is refused before it is parsed
        r = await client.post("/score", content=b" " * (serve.MAX_BODY + 1))
        assert r.status_code == 413, r.text[:300]
        assert _strict_json(r.text)["field"] == "body"


async def test_a_result_that_is_not_finite_is_an_error_response_not_invalid_json(server: Server) -> None:
    x = np.full(serve.D, 3.0e38, np.float32)  # within float32, but W @ x overflows it
    expected = serve.reference(x)
    assert not np.isfinite(expected).all(), "the input does not overflow: the test checks nothing"
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        r = await client.post("/score", json={"x": x.tolist()})
        assert r.status_code == 422, r.text[:300]
        doc = _strict_json(r.text)
        assert doc["field"] == '"y"', doc
        assert "finite" in doc["expected"], doc
        assert f"of {serve.D} elements not finite" in doc["got"], doc
        if server.device == "sim":  # the same arithmetic as NumPy's: the same elements overflow
            assert doc["got"].startswith(f"{int((~np.isfinite(expected)).sum())} of"), doc
        # and the server still answers
        r = await client.post("/score", json={"x": [0.5] * serve.D})
        assert r.status_code == 200, r.text[:300]


async def test_an_internal_error_is_a_json_500() -> None:
    # in process: an ASGI call of the app over a scorer whose GPU work fails
    class Failing:
        gpu = None

        async def score(self, x: np.ndarray) -> np.ndarray:
            raise RuntimeError("the device went away")

    sent: list[dict[str, Any]] = []
    events = [{"type": "http.request", "body": json.dumps({"x": [0.5] * serve.D}).encode()}]

    async def receive() -> dict[str, Any]:
        if events:
            return events.pop()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    app = serve.make_app(Failing(), None)
    await app({"type": "http", "method": "POST", "path": "/score"}, receive, send)
    assert sent[0]["status"] == 500
    doc = _strict_json(sent[1]["body"].decode())
    assert "RuntimeError: the device went away" in doc["error"], doc


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
