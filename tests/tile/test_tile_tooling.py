"""Tile kernels around the runtime: ``python -m trio_cuda info``'s tile line,
and the tile GEMM example on the simulator."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import trio

pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")

from tests.helpers import internals
from trio_cuda.__main__ import tile_line
from trio_cuda._tile import compile as tc

ROOT = Path(__file__).resolve().parents[2]


def test_info_says_the_toolchain_compiles_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRIO_CUDA_TILE_CACHE", str(tmp_path))
    line = tile_line()
    assert line.startswith("tile kernels: cuda-tile 1.7"), line
    assert "compiles for sm_90" in line
    assert str(tmp_path) in line


def test_info_without_cuda_tile_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> str:
        raise tc.TileToolchainError("cuda.tile is not importable: No module named 'cuda.tile'")

    monkeypatch.setattr(tc, "_cutile_version", missing)
    assert (
        tile_line()
        == "tile kernels: not available (cuda.tile is not installed: pip install 'trio_cuda[tile]')"
    )


def test_info_without_a_compiler_runs_cached_cubins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler(arch: str) -> None:
        raise tc.TileToolchainError("the tileiras compiler is not installed")

    monkeypatch.setattr(tc, "_preflight", no_compiler)
    monkeypatch.setenv("TRIO_CUDA_TILE_CACHE", "")
    line = tile_line()
    assert "without a working compiler (the tileiras compiler is not installed)" in line, line
    assert "runs cubins found in the cache only (no disk cache)" in line
    assert line.endswith("pip install 'trio_cuda[tile]' compiles")


def _load_example(name: str) -> object:
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


async def test_tile_gemm_example_on_the_simulator(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRIO_CUDA_TILE_CACHE", str(tmp_path))
    example = _load_example("tile_gemm")
    assert await example.main(256, "sim") == 0  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert "tile GEMM 256 x 256 x 256" in out
    assert "(sim)" in out
    assert "OK" in out
    assert any(p.suffix == ".cubin" for p in await trio.Path(tmp_path).iterdir()), "nothing was cached"


async def test_a_cancelled_run_leaves_while_the_compile_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` compiles in a worker thread; a cancelled caller leaves at once,
    with nothing submitted, and the compile ends in its thread."""
    import threading
    import time

    import cuda.tile as ct
    import numpy as np

    import trio_cuda
    from trio_cuda._tile.kernel import TileSpecialisation

    @ct.kernel
    def copy16(a, b):
        ct.store(b, index=(ct.bid(0),), tile=ct.load(a, index=(ct.bid(0),), shape=(16,)))

    started, done = threading.Event(), threading.Event()
    real = TileSpecialisation.prepare

    def slow(self: TileSpecialisation, backend: str, cc: tuple[int, int]) -> None:
        started.set()
        time.sleep(0.5)
        real(self, backend, cc)
        done.set()

    monkeypatch.setattr(TileSpecialisation, "prepare", slow)
    k = trio_cuda.Kernel.from_tile(copy16)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(64, np.float32)
        y = gpu.zeros(64, np.float32)
        launch = k.launch(x, y, grid=4)  # the access analysis runs here, once per signature
        before = gpu.statistics().submitted
        t0 = time.perf_counter()
        with trio.move_on_after(0.05) as cs:
            await gpu.run(launch)
        assert cs.cancelled_caught
        assert time.perf_counter() - t0 < 0.4
        assert started.is_set()
        assert gpu.statistics().submitted == before
        await trio.to_thread.run_sync(done.wait, 5.0)
        assert done.is_set()
        assert await gpu.run(k.launch(x, y, grid=4)) is y  # prepared by the abandoned thread


async def test_a_kernel_without_source_file_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """cuTile reads a kernel's source: one made under exec has none. The
    compile error says so, and the fallback leases (every array written) are
    logged."""
    import numpy as np

    import trio_cuda

    code = (
        "import cuda.tile as ct\n"
        "@ct.kernel\n"
        "def sourceless(a, b):\n"
        "    ct.store(b, index=(0,), tile=ct.load(a, index=(0,), shape=(16,)))\n"
    )
    namespace: dict[str, object] = {}
    exec(compile(code, "<no file>", "exec"), namespace)
    k = trio_cuda.Kernel.from_tile(namespace["sourceless"], cache=tmp_path)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(16, np.float32)
        y = gpu.zeros(16, np.float32)
        with caplog.at_level("WARNING", logger="trio_cuda"):
            launch = k.launch(x, y, grid=1)
        assert (
            internals.accesses_of(launch)[0][1] is internals.accesses_of(launch)[1][1]
        )  # both written: the fallback
        assert "sourceless': the access analysis could not answer" in caplog.text
        assert "leased as written" in caplog.text
        with pytest.raises(trio_cuda.TileCompileError, match="define @ct.kernel functions in a file"):
            await gpu.run(launch)


async def test_a_device_pool_runs_tile_launches_and_compiles_off_the_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``pool.run`` is its scope's ``run``: the specialisation compiles in a
    worker thread (no calling-thread warning), on the scope owning the arrays."""
    import cuda.tile as ct
    import numpy as np

    import trio_cuda

    @ct.kernel
    def double(a, out):
        i = ct.bid(0)
        ct.store(out, index=(i,), tile=ct.load(a, index=(i,), shape=(16,)) * 2)

    k = trio_cuda.Kernel.from_tile(double, cache=tmp_path)
    async with trio_cuda.open_device_pool(trio_cuda.testing.SimHost(2)) as pool:
        x = await pool.to_device(np.arange(64, dtype=np.float32))
        y = x.scope.empty(64, np.float32)
        with caplog.at_level("WARNING", logger="trio_cuda"):
            assert await pool.run(k.launch(x, y, grid=4)) is y
        assert "calling thread" not in caplog.text
        np.testing.assert_array_equal(await x.scope.to_host(y), 2 * np.arange(64, dtype=np.float32))
