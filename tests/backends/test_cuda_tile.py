"""Tile kernels (cuTile) through trio_cuda on a real GPU: results, leases
against SIMT kernels on other streams, graphs, list arguments, cancellation.

Marked ``gpu``: skipped without a CUDA device or without ``cuda.tile``. A GPU
host needs no tile compiler: the cubins come from the disk cache
(``TRIO_CUDA_TILE_CACHE``), filled on any machine with the toolchain by
running this module on the simulator with ``TRIO_CUDA_TILE_FILL=1``, which
compiles every specialisation the tests launch for ``sm_90``. A cache miss on
the GPU host then fails with the toolchain's one-line message.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers.kernels import copy
from tests.helpers.sanitizer import SLOW
from trio_cuda import Kernel, Scalar, ops, unsafe
from trio_cuda._backends import probe_cuda

ct = pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")

FILL = os.environ.get("TRIO_CUDA_TILE_FILL", "") not in ("", "0")
DEVICE = "sim" if FILL else "cuda"
_PROBE = probe_cuda()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not FILL and not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}"),
]

ConstInt = ct.Constant[int]
F4 = np.float32

# --------------------------------------------------------------------------- kernels


@ct.kernel
def vadd(a, b, out, TILE: ConstInt):
    i = ct.bid(0)
    ct.store(
        out, index=(i,), tile=ct.load(a, index=(i,), shape=(TILE,)) + ct.load(b, index=(i,), shape=(TILE,))
    )


@ct.kernel
def matmul(A, B, C, TM: ConstInt, TN: ConstInt, TK: ConstInt):
    bm = ct.bid(0)
    bn = ct.bid(1)
    acc = ct.full((TM, TN), 0, dtype=ct.float32)
    zero = ct.PaddingMode.ZERO
    for k in range(ct.num_tiles(A, axis=1, shape=(TM, TK))):
        a = ct.load(A, index=(bm, k), shape=(TM, TK), padding_mode=zero)
        b = ct.load(B, index=(k, bn), shape=(TK, TN), padding_mode=zero)
        acc = ct.mma(a, b, acc)
    ct.store(C, index=(bm, bn), tile=ct.astype(acc, C.dtype))


@ct.kernel
def count_positive(x, counter, TILE: ConstInt):
    t = ct.load(x, index=(ct.bid(0),), shape=(TILE,), padding_mode=ct.PaddingMode.ZERO)
    n = ct.sum(ct.where(t > 0, 1, 0))
    ct.atomic_add(counter, 0, n)


@ct.kernel
def row_sums(x, sums, N: ConstInt):
    r = ct.bid(0)
    t = ct.load(x, index=(r, 0), shape=(1, N))
    ct.store(sums, index=(r,), tile=ct.sum(t, axis=1))


@ct.kernel
def list_sum(arrays, out, TILE: ConstInt):
    i = ct.bid(0)
    acc = ct.zeros((TILE,), dtype=ct.float32)
    for k in range(len(arrays)):
        acc = acc + ct.load(arrays[k], index=(i,), shape=(TILE,))
    ct.store(out, index=(i,), tile=acc)


@ct.kernel
def axpy_pair(pair, out, alpha, TILE: ConstInt):
    i = ct.bid(0)
    x, y = pair
    t = ct.load(x, index=(i,), shape=(TILE,)) * alpha + ct.load(y, index=(i,), shape=(TILE,))
    ct.store(out, index=(i,), tile=t)


VADD = Kernel.from_tile(vadd)
MATMUL = Kernel.from_tile(matmul)
COUNT = Kernel.from_tile(count_positive)
ROWS = Kernel.from_tile(row_sums)
LIST_SUM = Kernel.from_tile(list_sum)
AXPY_PAIR = Kernel.from_tile(axpy_pair)

SPIN_SRC = r"""
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
SPIN = Kernel.from_source(SPIN_SRC, "spin_ns", params=[Scalar("u8")], reference=trio_cuda.NO_REFERENCE)

SCALE_SRC = r"""
extern "C" __global__ void scale_f4(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
"""


def _scale_ref(x: Any, s: Any, n: Any) -> None:
    x[:n] *= s


SCALE = Kernel.from_source(
    SCALE_SRC,
    "scale_f4",
    params=[trio_cuda.InOut("f4"), Scalar("f4"), Scalar("i4")],
    reference=_scale_ref,
)


def spin(ms: float) -> Any:
    return SPIN.launch(np.uint64(int(ms * 1e6)), grid=1, block=1)


def scale(x: Any, s: float) -> Any:
    return SCALE.launch(x, np.float32(s), x.size, grid=(x.size + 127) // 128, block=128)


N = 4096
TILE = 256


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


# --------------------------------------------------------------------------- results


async def test_vadd_exact(rng: np.random.Generator) -> None:
    a, b = rng.standard_normal(N).astype(F4), rng.standard_normal(N).astype(F4)
    async with trio_cuda.open_scope(device=DEVICE) as gpu:
        x, y = await gpu.to_device(a), await gpu.to_device(b)
        z = gpu.empty(N, F4)
        assert await gpu.run(VADD.launch(x, y, z, TILE, grid=N // TILE)) is z
        assert np.array_equal(await gpu.to_host(z), a + b)
        # submit, then the same specialisation again through async_on
        w = gpu.empty(N, F4)
        fut = gpu.submit(VADD.launch(z, y, w, TILE, grid=N // TILE))
        assert await fut.wait() is w
        assert np.array_equal(await gpu.to_host(w), a + b + b)
        await gpu.run(ops.value(None), stream=gpu.streams[0])
        unsafe.async_on(VADD.launch(x, x, z, TILE, grid=N // TILE), gpu.streams[0])
        await gpu.run(ops.value(None), stream=gpu.streams[0])
        assert np.array_equal(await gpu.to_host(z), a + a)
        assert gpu.statistics().leases_held == 0


async def test_matmul_f16(rng: np.random.Generator) -> None:
    m = n = k = 256
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((k, n)).astype(np.float16)
    async with trio_cuda.open_scope(device=DEVICE) as gpu:
        A, B = await gpu.to_device(a), await gpu.to_device(b)
        C = gpu.empty((m, n), F4)
        await gpu.run(MATMUL.launch(A, B, C, 64, 64, 32, grid=(m // 64, n // 64)))
        want = a.astype(F4) @ b.astype(F4)
        np.testing.assert_allclose(await gpu.to_host(C), want, rtol=1e-3, atol=1e-2)


async def test_reductions(rng: np.random.Generator) -> None:
    a = rng.standard_normal(N).astype(F4)
    rows = rng.integers(-8, 8, (64, 128)).astype(F4)
    async with trio_cuda.open_scope(device=DEVICE) as gpu:
        x = await gpu.to_device(a)
        counter = gpu.zeros(1, np.int32)
        launch = COUNT.launch(x, counter, TILE, grid=N // TILE)
        assert await gpu.run(launch) is counter  # the atomic makes it the written output

        assert int((await gpu.to_host(counter))[0]) == int((a > 0).sum())
        r = await gpu.to_device(rows)
        sums = gpu.empty(64, F4)
        await gpu.run(ROWS.launch(r, sums, 128, grid=64))
        assert np.array_equal(await gpu.to_host(sums), rows.sum(axis=1))


async def test_list_and_tuple_arguments(rng: np.random.Generator) -> None:
    parts = [rng.standard_normal(N).astype(F4) for _ in range(3)]
    async with trio_cuda.open_scope(device=DEVICE) as gpu:
        xs = [await gpu.to_device(p) for p in parts]
        out = gpu.empty(N, F4)
        launch = LIST_SUM.launch(xs, out, TILE, grid=N // TILE)
        await gpu.run(launch)
        np.testing.assert_allclose(await gpu.to_host(out), parts[0] + parts[1] + parts[2], rtol=1e-6)
        # the same launch again, and a list of other arrays (a second descriptor buffer)
        await gpu.run(launch)
        await gpu.run(LIST_SUM.launch(xs[:2], out, TILE, grid=N // TILE))
        np.testing.assert_allclose(await gpu.to_host(out), parts[0] + parts[1], rtol=1e-6)
        pair_out = gpu.empty(N, F4)
        await gpu.run(AXPY_PAIR.launch((xs[0], xs[1]), pair_out, 2.0, TILE, grid=N // TILE))
        np.testing.assert_allclose(await gpu.to_host(pair_out), 2 * parts[0] + parts[1], rtol=1e-6)


# --------------------------------------------------------------------------- the two models


async def test_tile_writer_ordered_against_simt_reader_on_another_stream(rng: np.random.Generator) -> None:
    """A tile kernel writes z on stream 0 behind a spin; a SIMT copy of z on
    stream 1 must wait for it (the lease makes a device-side wait), and a
    SIMT kernel then updates z in place, which the next tile kernel reads."""
    a, b = rng.standard_normal(N).astype(F4), rng.standard_normal(N).astype(F4)
    async with trio_cuda.open_scope(device=DEVICE) as gpu:
        s0, s1 = gpu.streams[0], gpu.streams[1]
        x, y = await gpu.to_device(a), await gpu.to_device(b)
        z, w = gpu.empty(N, F4), gpu.empty(N, F4)
        await gpu.load(VADD.launch(x, y, z, TILE, grid=N // TILE), copy(z, w), spin(0))
        ptr = z.ptr
        gpu.submit(spin(50), stream=s0)
        writer = gpu.submit(VADD.launch(x, y, z, TILE, grid=N // TILE), stream=s0)
        t0 = time.perf_counter()
        reader = gpu.submit(copy(z, w), stream=s1)  # RAW across streams
        assert time.perf_counter() - t0 < 0.02  # the host never waited
        await reader.wait()
        assert np.array_equal(await gpu.to_host(w), a + b)
        assert await writer.wait() is z
        # SIMT updates the tile kernel's allocation in place, on stream 1
        assert await gpu.run(scale(z, 3.0), stream=s1) is z
        assert z.ptr == ptr
        await gpu.run(VADD.launch(z, x, w, TILE, grid=N // TILE), stream=s0)  # reads the update
        np.testing.assert_allclose(await gpu.to_host(w), 3 * (a + b) + a, rtol=1e-6)


async def test_graph_capture_and_replay(rng: np.random.Generator) -> None:
    a, b = rng.standard_normal(N).astype(F4), rng.standard_normal(N).astype(F4)
    async with trio_cuda.open_scope(device=DEVICE) as gpu:
        x, y = await gpu.to_device(a), await gpu.to_device(b)
        z = gpu.empty(N, F4)
        xs = [x, y]
        out = gpu.empty(N, F4)
        op = trio_cuda.zip(
            VADD.launch(x, y, z, TILE, grid=N // TILE).then(lambda z: scale(z, 2.0)),
            LIST_SUM.launch(xs, out, TILE, grid=N // TILE),
        )
        graph = await gpu.capture(op)
        try:
            for _ in range(3):
                await gpu.run(graph.launch())
            assert np.array_equal(await gpu.to_host(z), 2 * (a + b))
            np.testing.assert_allclose(await gpu.to_host(out), a + b, rtol=1e-6)
        finally:
            graph.close()


# --------------------------------------------------------------------------- cancellation


@pytest.mark.skipif(FILL, reason="timing on a real GPU")
async def test_cancelled_waiter_keeps_the_tile_launch_retained(rng: np.random.Generator) -> None:
    a = rng.standard_normal(N).astype(F4)
    async with trio_cuda.open_scope(device=DEVICE) as gpu:
        s0 = gpu.streams[0]
        x = await gpu.to_device(a)
        z = gpu.empty(N, F4)
        launch = VADD.launch(x, x, z, TILE, grid=N // TILE)
        await gpu.load(launch)
        gpu.submit(spin(300), stream=s0)
        t0 = time.perf_counter()
        with trio.move_on_after(0.02) as cs:
            await gpu.run(launch, stream=s0)
        took = time.perf_counter() - t0
        assert cs.cancelled_caught
        assert took < 0.15 * SLOW, took  # promptly, not after the 300 ms spin
        assert gpu.statistics().leases_held >= 2  # x and z, still leased
        z.close()  # dropping the handle frees nothing while the launch is in flight
        x.close()
        while gpu.statistics().in_flight:  # noqa: ASYNC110
            await trio.sleep(0.01)
        st = gpu.statistics()
        assert st.leases_held == 0
        assert st.quarantined == 0


# --------------------------------------------------------------------------- cache


@pytest.mark.skipif(
    FILL or not os.environ.get("TRIO_CUDA_TILE_CACHE"), reason="a GPU run from a filled cache"
)
def test_cubins_came_from_the_disk_cache() -> None:
    """Run last: every specialisation above was loaded from the cache, none compiled here."""
    stats = trio_cuda._tile.compile.compile_statistics()
    assert stats["compiled"] == 0, stats
    assert stats["disk_hits"] >= 6, stats
