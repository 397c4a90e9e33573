"""examples/chunked_pipeline.py: the chunks of one buffer overlap across streams.

On the simulator (kernels and copies take simulated time), the trace shows the
chunks' kernels running at once on distinct streams, every result is checked,
and memcheck stays clean; views whose byte ranges overlap are serialised
instead (rule 11). On a real GPU (marked ``gpu``, skipped cleanly without one),
the chunks on their own streams finish well before the same work on one stream.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trio_cuda
from trio_cuda._backends import probe_cuda
from trio_cuda.testing import SimDevice


def _load_example() -> Any:
    path = Path(__file__).resolve().parents[2] / "examples" / "chunked_pipeline.py"
    spec = importlib.util.spec_from_file_location("chunked_pipeline", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chunked_pipeline", module)
    spec.loader.exec_module(module)
    return module


cp = _load_example()
_PROBE = probe_cuda()


async def test_chunks_overlap_on_the_simulator() -> None:
    sim = SimDevice(kernel_time=cp.KERNEL_TIME, copy_time=cp.COPY_TIME)
    facts = await cp.run(sim, chunks=4, n=1 << 16, iters=1000)
    assert facts["backend"] == "sim"
    assert facts["verified"], facts
    # the first run's four kernels: one per stream, all four running at once
    assert (facts["kernels"], facts["kernel_streams"], facts["peak"]) == (4, 4, 4), facts
    assert facts["serial"] == pytest.approx(4 * cp.KERNEL_TIME)
    # (ordered, the ratio would be about 1; 4 at best, and host load takes some of it: 2.97 seen)
    assert facts["serial"] / facts["busy"] > 2.5, facts
    assert facts["t_one_stream"] > 2 * facts["t_streams"], facts
    assert sim.violations == []
    assert sim.live_allocations == []


async def test_overlapping_views_are_serialised() -> None:
    sim = SimDevice(kernel_time=cp.KERNEL_TIME)
    c = 4096
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        y = gpu.zeros(4 * c, "f4")

        async def kernels_on_two_streams(a: trio_cuda.DeviceArray, b: trio_cuda.DeviceArray) -> tuple:
            sim.clear_trace()
            futures = [
                gpu.submit(cp.lcg.launch(v, np.uint32(10), grid=2, block=cp.BLOCK), stream=s)
                for v, s in zip((a, b), gpu.streams)
            ]
            for f in futures:
                await f.wait()
            return cp.kernel_overlap(sim.trace)

        # disjoint chunks run at once; chunks that share half their bytes take turns
        kernels, streams, peak, busy, serial = await kernels_on_two_streams(y[0:c], y[c : 2 * c])
        assert (kernels, streams, peak) == (2, 2, 2)
        assert busy == pytest.approx(cp.KERNEL_TIME, rel=0.5)
        kernels, streams, peak, busy, serial = await kernels_on_two_streams(y[0 : 2 * c], y[c : 3 * c])
        assert (kernels, streams, peak) == (2, 2, 1)
        assert busy == pytest.approx(serial)
        # no kernel touched the bytes outside its view
        assert np.array_equal(await gpu.to_host(y[3 * c :]), np.zeros(c, np.float32))
    assert sim.violations == []
    assert sim.live_allocations == []


async def test_overlapping_views_conflict_under_conflicts_error() -> None:
    sim = SimDevice()
    c = 4096
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        y = gpu.zeros(4 * c, "f4")
        sim.hold()  # the first kernel stays in flight
        first = gpu.submit(
            cp.lcg.launch(y[0 : 2 * c], np.uint32(1), grid=1, block=cp.BLOCK), stream=gpu.streams[0]
        )
        with pytest.raises(trio_cuda.AccessConflictError):  # shares y[c:2c] with the kernel in flight
            gpu.submit(
                cp.lcg.launch(y[c : 3 * c], np.uint32(1), grid=1, block=cp.BLOCK), stream=gpu.streams[1]
            )
        disjoint = gpu.submit(
            cp.lcg.launch(y[2 * c :], np.uint32(1), grid=1, block=cp.BLOCK), stream=gpu.streams[1]
        )
        assert not first.done()
        sim.release()
        await first.wait()
        await disjoint.wait()
    assert sim.violations == []


def test_main_on_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    assert cp.main(["--device", "sim", "--n", "65536", "--iters", "100"]) == 0
    out = capsys.readouterr().out
    assert "backend: sim" in out
    assert "results: 65,536 elements x 3 runs verified against NumPy" in out
    assert "trace: 4 kernels on 4 streams ran 4 at a time" in out
    assert out.rstrip().endswith("chunked pipeline: OK")


def test_main_fails_on_a_wrong_result(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_run = cp.run

    async def wrong(*args: Any) -> dict[str, Any]:
        return {**await real_run(*args), "verified": False}

    monkeypatch.setattr(cp, "run", wrong)
    assert cp.main(["--device", "sim", "--n", "4096", "--iters", "10"]) == 1
    assert "chunked pipeline: FAILED" in capsys.readouterr().out


def test_lcg_jump_ahead_matches_stepping() -> None:
    seeds = np.array([0, 1, 12345, 2**24 - 1], np.float32)
    for iters in (0, 1, 7, 1000):
        s = seeds.astype(np.uint64)
        for _ in range(iters):
            s = (s * np.uint64(cp.A) + np.uint64(cp.C)) % np.uint64(2**32)
        expected = (s >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)
        assert np.array_equal(cp.lcg_expected(seeds, iters), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}")
async def test_chunks_overlap_on_the_gpu() -> None:
    facts = await cp.run("cuda")
    assert facts["backend"] == "cuda"
    assert facts["verified"], facts
    # four chunks on four streams take well under the time of the same work on one stream
    assert facts["t_one_stream"] > 2 * facts["t_streams"], facts
