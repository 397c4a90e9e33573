"""examples/tile_simt_inplace.py and examples/tile_mlp.py: tile and SIMT kernels together.

On the simulator (kernels take simulated time, tile kernels run on NumPy
tiles): the tile kernel's leases come from its loads and stores, the SIMT
update on another stream waits for it on the device, the allocation is
updated in place and the values match NumPy; the MLP answers its requests,
the cancelled ones leave work in flight that the scope retires, the graph
replays, and nothing is left allocated. On a real GPU (marked ``gpu``,
skipped cleanly without one) the same checks, except those that need the
simulator's timing. Skipped without ``cuda.tile``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")

from trio_cuda._backends import probe_cuda
from trio_cuda.testing import SimDevice

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
_PROBE = probe_cuda()


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


inplace = _load("tile_simt_inplace")
mlp = _load("tile_mlp")


async def test_inplace_on_the_simulator() -> None:
    sim = SimDevice(kernel_time=inplace.KERNEL_TIME)
    facts = await inplace.run(sim, n=1000)  # not a whole number of tiles
    assert facts["backend"] == "sim"
    assert facts["tile_leases"] == "x read, y write"
    assert facts["update_leases"] == "y write, x read"
    assert facts["waits"] == 1  # the SIMT update waited on the device for the tile kernel
    for key in ("same_array", "same_pointer", "no_new_allocation", "values_ok", "memcheck"):
        assert facts[key] is True, (key, facts)
    assert facts["max_error"] == 0.0
    assert sim.violations == []
    assert sim.live_allocations == []


async def test_mlp_on_the_simulator() -> None:
    sim = SimDevice(kernel_time=mlp.KERNEL_TIME)
    facts = await mlp.serve(sim, requests=8, cancel_every=4)
    assert facts["backend"] == "sim"
    assert facts["verified"], facts
    assert (facts["answered"], facts["cancelled"]) == (6, 2), facts
    assert facts["cancelled_in_flight"] >= 1, facts
    assert facts["retired"], facts
    assert facts["replays"] == 3
    assert facts["memcheck"], facts


async def test_mlp_f32_weights() -> None:
    facts = await mlp.serve(SimDevice(), requests=2, dtype="f32", cancel_every=0)
    assert facts["verified"], facts
    assert (facts["answered"], facts["cancelled"]) == (2, 0)
    assert facts["max_error"] < 1e-5


def test_the_examples_as_programs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inplace.main(["--device", "sim", "--n", "4096"]) == 0
    out = capsys.readouterr().out
    assert "backend: sim" in out
    assert out.rstrip().endswith("tile + SIMT in-place update: OK")
    page = tmp_path / "mlp.html"
    assert mlp.main(["--device", "sim", "--requests", "8", "--trace", str(page)]) == 0
    out = capsys.readouterr().out
    assert "8 requests in" in out
    assert out.rstrip().endswith("tile MLP: OK")
    assert page.read_text(encoding="utf-8").lower().startswith("<!doctype html")
    for argv in (["--batch", "10"], ["--size", "48"], ["--trace", "x.txt"]):
        with pytest.raises(SystemExit) as exc:
            mlp.main(argv)
        assert exc.value.code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}")
async def test_inplace_on_a_gpu() -> None:
    # the simulator test's sizes: where the GPU host has no tile compiler, a run of this
    # module on the simulator with the same TRIO_CUDA_TILE_CACHE fills the cache for it
    facts = await inplace.run("cuda", n=1000)
    assert facts["backend"] == "cuda"
    for key in ("same_array", "same_pointer", "no_new_allocation", "values_ok"):
        assert facts[key] is True, (key, facts)


@pytest.mark.gpu
@pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}")
async def test_mlp_on_a_gpu() -> None:
    facts = await mlp.serve("cuda", requests=8, cancel_every=4)
    assert facts["backend"] == "cuda"
    assert facts["verified"], facts
    assert facts["retired"], facts
    assert facts["answered"] + facts["cancelled"] == 8
