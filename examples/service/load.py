"""Load for examples/service/serve.py: many concurrent clients, some impatient.

Each of ``--clients`` concurrent clients (httpx on Trio, one connection pool)
sends ``--requests`` scoring requests one after another. A share of the
requests (``--cancel-share``) give up after a random short wait, so the server
sees disconnects and cancels their GPU work. Every completed answer is checked
against NumPy; afterwards the server's ``/stats`` must settle to nothing in
flight and no leases. Prints throughput and p50/p99 latency.

    python examples/service/load.py --url http://127.0.0.1:8000 [--clients 240] [--requests 10]

Exit status 0 when every completed answer was right and the scope settled;
2, with one line saying why, without the ``service`` extra (``pip install
'trio_cuda[service]'``: httpx) or when the server does not answer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import trio

try:
    import httpx
except ModuleNotFoundError as exc:  # told by main(), which needs it
    httpx = None
    _MISSING = f"load.py needs httpx ({exc}): pip install 'trio_cuda[service]'"

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # the model's reference lives beside this file


async def drive(url: str, clients: int, requests: int, cancel_share: float, seed: int, tol: float) -> int:
    latencies: list[float] = []
    wrong: list[str] = []
    gave_up = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        try:
            health = (await client.get("/health", timeout=10.0)).json()
        except (httpx.TransportError, ValueError) as exc:
            print(f"error: no service answers at {url}/health: {exc}", file=sys.stderr)
            return 2
        if health != {"dim": serve.D}:
            print(f"error: /health answered {health}, expected {{'dim': {serve.D}}}", file=sys.stderr)
            return 2

        async def one_client(c: int) -> None:
            nonlocal gave_up
            local = np.random.default_rng(seed * 1_000_003 + c)
            for _ in range(requests):
                x = local.standard_normal(serve.D).astype(np.float32)
                impatient = local.random() < cancel_share
                start = time.perf_counter()
                with trio.move_on_after(local.uniform(0.0005, 0.005) if impatient else 60.0):
                    r = await client.post("/score", json={"x": x.tolist()})
                    if r.status_code != 200:
                        wrong.append(f"status {r.status_code}: {r.text[:200]}")
                        continue
                    latencies.append(time.perf_counter() - start)
                    y = np.asarray(r.json()["y"], np.float32)
                    if not np.allclose(y, serve.reference(x), rtol=tol, atol=tol):
                        wrong.append(f"wrong answer for client {c}")
                    continue
                gave_up += 1

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for c in range(clients):
                nursery.start_soon(one_client, c)
        elapsed = time.perf_counter() - t0

        with trio.move_on_after(30):
            while True:
                stats = (await client.get("/stats")).json()
                if stats["in_flight"] == 0 and stats["leases_held"] == 0:
                    break
                await trio.sleep(0.05)
    done = len(latencies)
    lat = np.asarray(latencies or [float("nan")]) * 1e3
    print(
        f"{clients} clients x {requests} requests: {done} completed, {gave_up} gave up, {len(wrong)} wrong; "
        f"{done / elapsed:.0f} req/s over {elapsed:.2f} s; latency p50 {np.percentile(lat, 50):.2f} ms, "
        f"p99 {np.percentile(lat, 99):.2f} ms"
    )
    print(
        "server after the load: "
        + ", ".join(
            f"{k}={stats.get(k)}"
            for k in (
                "in_flight",
                "leases_held",
                "live_allocations",
                "quarantined",
                "pending_errors",
                "submitted",
                "violations",
            )
            if k in stats
        )
    )
    for line in wrong[:5]:
        print(f"  {line}", file=sys.stderr)
    settled = stats["in_flight"] == 0 and stats["leases_held"] == 0 and stats["quarantined"] == 0
    return 0 if not wrong and settled and not stats.get("violations") else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=240)
    ap.add_argument("--requests", type=int, default=10, help="requests per client, one after another")
    ap.add_argument("--cancel-share", type=float, default=0.2, help="share of requests that give up early")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tolerance", type=float, default=1e-4, help="rtol and atol against NumPy")
    args = ap.parse_args(argv)
    if httpx is None:
        print(_MISSING, file=sys.stderr)
        return 2
    if args.clients < 1 or args.requests < 1:
        ap.error("--clients and --requests: expected at least 1")
    if not 0.0 <= args.cancel_share <= 1.0:
        ap.error(f"--cancel-share: expected a number in [0, 1], got {args.cancel_share}")
    return trio.run(
        drive, args.url, args.clients, args.requests, args.cancel_share, args.seed, args.tolerance
    )


if __name__ == "__main__":
    sys.exit(main())
