"""Tile kernels (``Kernel.from_tile``) through the runtime, on the simulator.

A ``@ct.kernel`` function is a kernel like any other: its launches are
checked before anything is enqueued, take leases from what the kernel does to
each array, compose with ``then``/``map``/``zip``/``shared``/graphs/
``unsafe.async_on`` and with SIMT kernels, obey the cancellation and lifetime
rules, and compile once per signature in a worker thread. The simulator runs
them on NumPy tiles under its memcheck (and compiles each specialisation as a
check, where the toolchain is installed).

The kernels below are module-level and use ``cache=None`` (no disk cache):
each specialisation compiles once per process. Tests of compiling and caching
make their own kernels with a per-test cache directory.
"""

from __future__ import annotations

import gc
import logging
import pickle
import threading
import time
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ct = pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")

import trio_cuda  # noqa: E402
from tests.helpers import internals  # noqa: E402
from tests.helpers.guard import held  # noqa: E402
from tests.helpers.kernels import ADD, add  # noqa: E402
from trio_cuda import KernelArgumentError, TileCompileError, TileToolchainError, ops, unsafe  # noqa: E402
from trio_cuda._core._ops import Access  # noqa: E402
from trio_cuda._tile import compile as tc  # noqa: E402
from trio_cuda._tile import kernel as tk  # noqa: E402
from trio_cuda.testing import SimDevice  # noqa: E402

F4 = np.float32
I4 = np.int32
N = 256
T = 16  # the tile of the 1-D kernels
ConstInt = ct.Constant[int]
#: an int32-annotated scalar parameter (cuda.tile spells only ScalarInt64)
ScalarInt32 = typing.Annotated[int, type(ct.ScalarInt64.__metadata__[0])(dtype=ct.int32)]
rng = np.random.default_rng(20240607)


# --------------------------------------------------------------------------- kernels


@ct.kernel
def vadd(a, b, out):  # type: ignore[no-untyped-def]
    i = ct.bid(0)
    ct.store(out, index=(i,), tile=ct.load(a, index=(i,), shape=(16,)) + ct.load(b, index=(i,), shape=(16,)))


@ct.kernel
def accumulate(x, y):  # type: ignore[no-untyped-def]
    """y += x: y is loaded and stored (read_write)."""
    i = ct.bid(0)
    ct.store(y, index=(i,), tile=ct.load(y, index=(i,), shape=(16,)) + ct.load(x, index=(i,), shape=(16,)))


@ct.kernel
def block_sums(x, partial, total):  # type: ignore[no-untyped-def]
    """partial[i] = sum of block i; total[0] += every block's sum (atomics)."""
    i = ct.bid(0)
    s = ct.sum(ct.load(x, index=(i,), shape=(16,)))
    ct.store(partial, index=(i,), tile=s)
    ct.atomic_add(total, 0, s)


@ct.kernel
def matmul(A, B, C, TM: ConstInt, TN: ConstInt, TK: ConstInt):  # type: ignore[no-untyped-def]
    bm = ct.bid(0)
    bn = ct.bid(1)
    acc = ct.full((TM, TN), 0, dtype=ct.float32)
    for k in range(ct.num_tiles(A, axis=1, shape=(TM, TK))):
        a = ct.load(A, index=(bm, k), shape=(TM, TK))
        b = ct.load(B, index=(k, bn), shape=(TK, TN))
        acc = ct.mma(a, b, acc)
    ct.store(C, index=(bm, bn), tile=acc)


@ct.kernel
def pair_add(pair, out):  # type: ignore[no-untyped-def]
    i = ct.bid(0)
    ct.store(
        out,
        index=(i,),
        tile=ct.load(pair[0], index=(i,), shape=(16,)) + ct.load(pair[1], index=(i,), shape=(16,)),
    )


@ct.kernel
def list_sum(arrays, out):  # type: ignore[no-untyped-def]
    i = ct.bid(0)
    acc = ct.zeros((16,), dtype=ct.float32)
    for k in range(len(arrays)):
        acc = acc + ct.load(arrays[k], index=(i,), shape=(16,))
    ct.store(out, index=(i,), tile=acc)


@ct.kernel
def affine(x, out, alpha, shift: ct.ScalarInt64):  # type: ignore[no-untyped-def]
    """out's tile i = alpha * x's tile (i + shift)."""
    i = ct.bid(0)
    ct.store(out, index=(i,), tile=ct.load(x, index=(i + shift,), shape=(16,)) * alpha)


@ct.kernel
def fill_base(out, base: ScalarInt32):  # type: ignore[no-untyped-def]
    ct.store(out, index=(ct.bid(0),), tile=ct.full((16,), 0, dtype=ct.int32) + base)


@ct.function
def _twice(t):  # type: ignore[no-untyped-def]
    return t + t


def _put(arr, i, t):  # type: ignore[no-untyped-def]
    ct.store(arr, index=(i,), tile=t)


@ct.kernel
def via_helpers(x, out):  # type: ignore[no-untyped-def]
    """out = 2x, stored by a plain helper (the write happens in _put)."""
    i = ct.bid(0)
    _put(out, i, _twice(ct.load(x, index=(i,), shape=(16,))))


@ct.kernel
def scale(x, out, c: ct.Constant):  # type: ignore[no-untyped-def]
    i = ct.bid(0)
    ct.store(out, index=(i,), tile=ct.load(x, index=(i,), shape=(16,)) * c)


@ct.kernel
def bad_shapes(a, b, out):  # type: ignore[no-untyped-def]
    i = ct.bid(0)
    t = ct.load(a, index=(i,), shape=(16,)) + ct.load(b, index=(i,), shape=(32,))  # BAD
    ct.store(out, index=(i,), tile=t)


BAD_LINE = next(
    n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith("# BAD")
)


@ct.kernel
def unchecked_load(x, y):  # type: ignore[no-untyped-def]
    ct.store(y, index=(0,), tile=ct.load(x, index=(ct.bid(0),), shape=(16,), check_bounds=False))


VADD = trio_cuda.Kernel.from_tile(vadd, cache=None)
ACC = trio_cuda.Kernel.from_tile(accumulate, cache=None)
SUMS = trio_cuda.Kernel.from_tile(block_sums, cache=None)
MATMUL = trio_cuda.Kernel.from_tile(matmul, cache=None)
PAIR = trio_cuda.Kernel.from_tile(pair_add, cache=None)
LIST = trio_cuda.Kernel.from_tile(list_sum, cache=None)
AFFINE = trio_cuda.Kernel.from_tile(affine, cache=None)
FILL = trio_cuda.Kernel.from_tile(fill_base, cache=None)
HELPERS = trio_cuda.Kernel.from_tile(via_helpers, cache=None)
SCALE = trio_cuda.Kernel.from_tile(scale, cache=None)
BAD = trio_cuda.Kernel.from_tile(bad_shapes, cache=None)
UNCHECKED = trio_cuda.Kernel.from_tile(unchecked_load, cache=None)


def v(op: trio_cuda.KernelLaunch) -> list[tuple[int, Access]]:
    """A launch's leases: (address, access) per array, in argument order."""
    return [(arr.ptr, access) for arr, access in internals.accesses_of(op)]


def host(n: int = N, dtype: Any = F4) -> np.ndarray:
    return np.arange(n, dtype=dtype)


async def vadd_setup(gpu: trio_cuda.ResourceScope, n: int = N) -> tuple[Any, Any, Any]:
    x = await gpu.to_device(host(n))
    y = await gpu.to_device(host(n) * 2 + 1)
    z = gpu.zeros(n, F4)
    return x, y, z


def vadd_of(x: Any, y: Any, z: Any) -> trio_cuda.KernelLaunch:
    return VADD.launch(x, y, z, grid=z.size // T)


def expected_vadd(n: int = N) -> np.ndarray:
    return host(n) + (host(n) * 2 + 1)


async def settle(gpu: trio_cuda.ResourceScope) -> None:
    """Let every completed submission retire (the handoff runs)."""
    await gpu.run(ops.value(None))
    await trio.testing.wait_all_tasks_blocked()


def cubins(path: Path) -> int:
    """Entries in a tile cache directory."""
    return len(list(path.glob("*.cubin")))


def wait_labels(sim: SimDevice, stream: int) -> list[str]:
    return [e.label for e in sim.trace if e.kind == "wait_marker" and e.stream == stream]


# --------------------------------------------------------------------------- 1. from_tile


def test_from_tile_refuses_anything_but_a_tile_kernel() -> None:
    def plain(a):  # type: ignore[no-untyped-def]
        ct.store(a, index=(0,), tile=ct.load(a, index=(0,), shape=(16,)))

    for fn in (plain, vadd._annotated_function.pyfunc, 42, None, ADD):
        with pytest.raises(TypeError, match=r"^fn: expected a @cuda\.tile\.kernel function, got "):
            trio_cuda.Kernel.from_tile(fn)


def test_from_tile_checks_access_cache_and_arch() -> None:
    with pytest.raises(
        ValueError, match=r"access: 'nope' is not a parameter of the kernel \(its parameters: a, b, out\)"
    ):
        trio_cuda.Kernel.from_tile(vadd, access={"nope": "read"}, cache=None)
    with pytest.raises(
        ValueError, match=r"access\['out'\]: expected 'read', 'write', 'read_write' or 'none', got 'rw'"
    ):
        trio_cuda.Kernel.from_tile(vadd, access={"out": "rw"}, cache=None)
    with pytest.raises(ValueError, match=r"access\['TM'\]: TM is a ct\.Constant parameter"):
        trio_cuda.Kernel.from_tile(matmul, access={"TM": "read"}, cache=None)
    with pytest.raises(ValueError, match=r"access\['c'\]: c is a ct\.Constant parameter"):
        trio_cuda.Kernel.from_tile(scale, access={"c": "none"}, cache=None)
    with pytest.raises(TypeError, match=r"^access: expected a mapping"):
        trio_cuda.Kernel.from_tile(vadd, access="read", cache=None)
    with pytest.raises(TypeError, match=r"^cache: expected"):
        trio_cuda.Kernel.from_tile(vadd, cache=42)
    with pytest.raises(ValueError, match=r"arch: expected a GPU architecture such as 'sm_90', got 'gfx90a'"):
        trio_cuda.Kernel.from_tile(vadd, arch="gfx90a", cache=None)


def test_repr_names_the_kernel_and_builder_is_refused() -> None:
    assert repr(VADD).startswith("<Kernel vadd tile=<tile kernel ")
    assert f"{__name__}.vadd" in repr(VADD)
    assert "reference=None" in repr(VADD)
    assert VADD.name == "vadd"
    with pytest.raises(TypeError, match=r"vadd: builder\(\): .* use launch\(\*args, grid=\.\.\.\)"):
        VADD.builder()


async def test_loading_the_tile_kernel_itself_is_refused_with_guidance(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        with pytest.raises(
            TypeError, match=r"kernels\[1\]: tile kernel vadd is compiled per argument signature.*k\.launch"
        ):
            await gpu.load(ADD, VADD)
        assert sim.statistics().kernel_loads == 0  # checked before anything was loaded


# --------------------------------------------------------------------------- 2. launch checks


async def test_launch_checks_arity_options_grid_and_types(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        ints = gpu.zeros(N, I4)
        before = gpu.statistics()
        with pytest.raises(KernelArgumentError, match=r"^vadd: expected 3 arguments \(a, b, out\), got 2$"):
            VADD.launch(x, y, grid=16)
        with pytest.raises(KernelArgumentError, match=r"got 4$"):
            VADD.launch(x, y, z, z, grid=16)
        for option, value in [
            ("block", 128),
            ("shared_mem", 0),
            ("cluster", (1, 1, 1)),
            ("cooperative", False),
        ]:
            with pytest.raises(
                KernelArgumentError, match=rf"^vadd: {option}: a tile kernel takes only grid= and pdl="
            ):
                VADD.launch(x, y, z, grid=16, **{option: value})
        with pytest.raises(KernelArgumentError, match=r"grid: every dimension must be >= 1, got 0"):
            VADD.launch(x, y, z, grid=0)
        with pytest.raises(TypeError, match="grid"):
            VADD.launch(x, y, z)  # type: ignore[call-arg]
        with pytest.raises(
            KernelArgumentError, match=r"^vadd: argument 0 \(a\): expected a device array.*got ndarray"
        ):
            VADD.launch(host(), y, z, grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"^vadd: argument 2 \(out\): expected a device array.*got str"
        ):
            VADD.launch(x, y, "z", grid=16)
        with pytest.raises(KernelArgumentError, match=r"argument 0 \(arrays\): expected a non-empty list"):
            LIST.launch([], z, grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"argument 0 \(arrays\)\[1\]: expected a DeviceArray, got ndarray"
        ):
            LIST.launch([x, host()], z, grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"arrays\)\[1\]: the elements of a list share one dtype"
        ):
            LIST.launch([x, ints], z, grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"argument 3 \(TM\): a ct\.Constant parameter takes a bool"
        ):
            MATMUL.launch(x, y, z, x, 16, 16, grid=1)
        ok = vadd_of(x, y, z)
        assert isinstance(ok, trio_cuda.KernelLaunch)
        assert ok.config.block == (1, 1, 1)
        assert ok.config.grid == (16, 1, 1)
        assert VADD.launch(x, y, z, grid=16, pdl=True).config.pdl
        # nothing above reached the scope or the device
        assert gpu.statistics() == before
        assert sim.statistics().launches == 0


async def test_scalar_ranges_follow_the_annotation(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(2 * N, F4)
        out = gpu.zeros(N, F4)
        ints = gpu.zeros(N, I4)
        before = gpu.statistics()
        # ct.ScalarInt64
        AFFINE.launch(x, out, 1.0, 2**63 - 1, grid=16)
        AFFINE.launch(x, out, 1.0, -(2**63), grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"argument 3 \(shift\): 9223372036854775808 does not fit int64"
        ):
            AFFINE.launch(x, out, 1.0, 2**63, grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"argument 3 \(shift\): expected an integer \(int64\), got 1\.5"
        ):
            AFFINE.launch(x, out, 1.0, 1.5, grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"argument 3 \(shift\): expected an integer \(int64\), got True"
        ):
            AFFINE.launch(x, out, 1.0, True, grid=16)
        with pytest.raises(
            KernelArgumentError,
            match=r"argument 3 \(shift\): expected a int64 scalar \(as annotated\), got int32",
        ):
            AFFINE.launch(x, out, 1.0, np.int32(2), grid=16)
        # an int32 annotation
        FILL.launch(ints, 2**31 - 1, grid=16)
        with pytest.raises(KernelArgumentError, match=r"argument 1 \(base\): 2147483648 does not fit int32"):
            FILL.launch(ints, 2**31, grid=16)
        with pytest.raises(KernelArgumentError, match=r"argument 1 \(base\): -2147483649 does not fit int32"):
            FILL.launch(ints, -(2**31) - 1, grid=16)
        # unannotated: a Python float is float32, a Python int int32 or int64
        with pytest.raises(KernelArgumentError, match=r"argument 2 \(alpha\): 1e\+300 overflows float32"):
            AFFINE.launch(x, out, 1e300, 0, grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"argument 2 \(alpha\): expected a device array, .*got complex"
        ):
            AFFINE.launch(x, out, 1j, 0, grid=16)
        s32 = AFFINE.launch(x, out, 1.0, 0, grid=16)
        sf = AFFINE.launch(x, out, np.float32(1.0), 0, grid=16)
        assert s32.kernel is sf.kernel  # a Python float is a float32 scalar
        assert gpu.statistics() == before


async def test_constants_select_the_specialisation(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host(dtype=I4))
        out = gpu.zeros(N, I4)
        two = SCALE.launch(x, out, 2, grid=16)
        three = SCALE.launch(x, out, 3, grid=16)
        assert two.kernel is not three.kernel
        assert SCALE.launch(x, out, 2, grid=16).kernel is two.kernel  # made once per signature
        assert two.kernel is not SCALE
        assert two.kernel.name == "scale"
        assert await gpu.run(two) is out
        np.testing.assert_array_equal(await gpu.to_host(out), host(dtype=I4) * 2)
        assert await gpu.run(three) is out
        np.testing.assert_array_equal(await gpu.to_host(out), host(dtype=I4) * 3)


async def test_constants_equal_in_python_are_different_specialisations(sim: SimDevice) -> None:
    """1, True and 1.0 (and 0.0 and -0.0) are different constants: cuTile
    types them differently, so each needs its own specialisation (a float
    constant makes ``x * c`` a float tile, which an int32 array cannot take)."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host(dtype=I4))
        out = gpu.zeros(N, I4)
        as_int = SCALE.launch(x, out, 2, grid=16)
        as_float = SCALE.launch(x, out, 2.0, grid=16)
        assert as_float.kernel is not as_int.kernel
        assert SCALE.launch(x, out, True, grid=16).kernel is not SCALE.launch(x, out, 1, grid=16).kernel
        assert SCALE.launch(x, out, 1, grid=16).kernel is not SCALE.launch(x, out, 1.0, grid=16).kernel
        assert SCALE.launch(x, out, 2.0, grid=16).kernel is as_float.kernel
        (c,) = [p for p in as_float.kernel.tile.params if isinstance(p, tc.ConstantSpec)]
        assert type(c.value) is float
        await gpu.run(as_int)
        before = gpu.statistics()
        with pytest.raises(TileCompileError, match=r"scale.*cannot implicitly cast float32 to int32"):
            await gpu.run(as_float)
        assert gpu.statistics() == before
        np.testing.assert_array_equal(await gpu.to_host(out), host(dtype=I4) * 2)


def test_signed_zero_constants_are_different_specialisations() -> None:
    # a plain test running trio.run (the fast path is what it checks)
    sim = SimDevice()

    async def main() -> tuple[Any, Any]:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(host())
            out = gpu.zeros(N, F4)
            # the checked path (the first launch of each) tells them apart
            fresh = trio_cuda.Kernel.from_tile(scale, cache=None)
            assert fresh.launch(x, out, -0.0, grid=16).kernel is not SCALE.launch(x, out, 0.0, grid=16).kernel
            # ... and so must a launch whose recipe has a fast path already
            return SCALE.launch(x, out, 0.0, grid=16), SCALE.launch(x, out, -0.0, grid=16)

    positive, negative = trio.run(main)
    assert sim.violations == []
    (c,) = [p for p in negative.kernel.tile.params if isinstance(p, tc.ConstantSpec)]
    assert np.signbit(c.value), "a -0.0 launch runs the specialisation compiled for +0.0"
    assert negative.kernel is not positive.kernel


async def test_closed_and_read_only_arrays(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        before = gpu.statistics()
        # read-only where the kernel writes: refused
        with pytest.raises(
            KernelArgumentError, match=r"^vadd: argument 2 \(out\): the kernel writes it .*read-only"
        ):
            VADD.launch(x, y, z.as_readonly(), grid=16)
        with pytest.raises(KernelArgumentError, match=r"^accumulate: argument 1 \(y\): the kernel writes it"):
            ACC.launch(x, y.as_readonly(), grid=16)
        with pytest.raises(KernelArgumentError, match=r"argument 0 \(pair\)\[1\]: the kernel writes it"):
            trio_cuda.Kernel.from_tile(pair_add, access={"pair": "read_write"}, cache=None).launch(
                (x, y.as_readonly()), z, grid=16
            )
        assert gpu.statistics() == before
        # read-only where it only reads: fine, and exact
        op = VADD.launch(x.as_readonly(), y.as_readonly(), z, grid=16)
        assert await gpu.run(op) is z
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())
        # closed arrays: refused like a SIMT launch refuses them
        w = gpu.zeros(N, F4)
        w.close()
        with pytest.raises(KernelArgumentError, match=r"^vadd: argument 2 \(out\): the array is closed"):
            VADD.launch(x, y, w, grid=16)
        with pytest.raises(KernelArgumentError, match=r"the array is closed"):
            ADD.launch(w, np.float32(1), N, grid=1, block=N)  # the SIMT launch, for comparison
        with pytest.raises(KernelArgumentError, match=r"argument 0 \(arrays\)\[1\]: the array is closed"):
            LIST.launch([x, w], z, grid=16)
    with pytest.raises(KernelArgumentError, match=r"^vadd: argument 0 \(a\): the array is closed"):
        vadd_of(x, y, z)  # the scope has exited


# --------------------------------------------------------------------------- 3. results


async def test_vector_add(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        assert await gpu.run(vadd_of(x, y, z)) is z
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())
        # a partial last tile: loads are padded, stores stop at the extent
        x2, y2, z2 = await vadd_setup(gpu, 100)
        await gpu.run(VADD.launch(x2, y2, z2, grid=7))
        np.testing.assert_array_equal(await gpu.to_host(z2), expected_vadd(100))


async def test_matmul_with_mma(sim: SimDevice) -> None:
    m, n, k = 64, 48, 32
    a = rng.integers(-3, 4, (m, k)).astype(np.float16)
    b = rng.integers(-3, 4, (k, n)).astype(np.float16)
    async with trio_cuda.open_scope(device=sim) as gpu:
        da, db = await gpu.to_device(a), await gpu.to_device(b)
        dc = gpu.zeros((m, n), F4)
        op = MATMUL.launch(da, db, dc, 16, 16, 16, grid=(m // 16, n // 16))
        assert v(op) == [(da.ptr, Access.READ), (db.ptr, Access.READ), (dc.ptr, Access.WRITE)]
        assert await gpu.run(op) is dc
        np.testing.assert_array_equal(await gpu.to_host(dc), a.astype(F4) @ b.astype(F4))


async def test_reduction_with_atomics_returns_both_outputs(sim: SimDevice) -> None:
    data = rng.integers(-1000, 1000, N).astype(I4)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(data)
        partial = gpu.zeros(N // T, I4)
        total = await gpu.to_device(np.array([7], I4))
        op = SUMS.launch(x, partial, total, grid=N // T)
        assert v(op) == [(x.ptr, Access.READ), (partial.ptr, Access.WRITE), (total.ptr, Access.WRITE)]
        assert await gpu.run(op) == (partial, total)
        np.testing.assert_array_equal(await gpu.to_host(partial), data.reshape(-1, T).sum(axis=1))
        np.testing.assert_array_equal(await gpu.to_host(total), [7 + data.sum()])
        await gpu.run(op)  # the atomic adds onto what is there
        np.testing.assert_array_equal(await gpu.to_host(total), [7 + 2 * data.sum()])


async def test_tuple_and_list_arguments(sim: SimDevice) -> None:
    arrays = [rng.integers(-50, 50, N).astype(F4) for _ in range(3)]
    async with trio_cuda.open_scope(device=sim) as gpu:
        d = [await gpu.to_device(a) for a in arrays]
        out = gpu.zeros(N, F4)
        op = PAIR.launch((d[0], d[1]), out, grid=16)
        assert v(op) == [(d[0].ptr, Access.READ), (d[1].ptr, Access.READ), (out.ptr, Access.WRITE)]
        assert await gpu.run(op) is out
        np.testing.assert_array_equal(await gpu.to_host(out), arrays[0] + arrays[1])
        op = LIST.launch(d, out, grid=16)
        assert v(op) == [*((a.ptr, Access.READ) for a in d), (out.ptr, Access.WRITE)]
        assert await gpu.run(op) is out
        np.testing.assert_array_equal(await gpu.to_host(out), arrays[0] + arrays[1] + arrays[2])
        # a list of another length: the same specialisation
        two = LIST.launch(d[:2], out, grid=16)
        assert two.kernel is op.kernel
        await gpu.run(two)
        np.testing.assert_array_equal(await gpu.to_host(out), arrays[0] + arrays[1])


async def test_scalar_arguments(sim: SimDevice) -> None:
    data = rng.integers(-100, 100, 2 * N).astype(F4)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(data)
        out = gpu.zeros(N, F4)
        op = AFFINE.launch(x, out, 0.5, 3, grid=16)
        assert v(op) == [(x.ptr, Access.READ), (out.ptr, Access.WRITE)]
        assert await gpu.run(op) is out
        np.testing.assert_array_equal(await gpu.to_host(out), data[3 * T : 3 * T + N] * F4(0.5))
        await gpu.run(AFFINE.launch(x, out, np.float32(-2.0), np.int64(16), grid=16))
        np.testing.assert_array_equal(await gpu.to_host(out), data[N:] * F4(-2))
        ints = gpu.zeros(N, I4)
        await gpu.run(FILL.launch(ints, -(2**31), grid=16))
        np.testing.assert_array_equal(await gpu.to_host(ints), np.full(N, -(2**31), I4))


async def test_helper_functions(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        out = gpu.zeros(N, F4)
        op = HELPERS.launch(x, out, grid=16)
        # the write happens in a plain helper: still an exclusive lease, and the output
        assert v(op) == [(x.ptr, Access.READ), (out.ptr, Access.WRITE)]
        assert await gpu.run(op) is out
        np.testing.assert_array_equal(await gpu.to_host(out), 2 * host())


# --------------------------------------------------------------------------- 4. leases


async def test_leases_follow_what_the_kernel_does(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        op = vadd_of(x, y, z)
        assert v(op) == [(x.ptr, Access.READ), (y.ptr, Access.READ), (z.ptr, Access.WRITE)]
        acc = ACC.launch(x, y, grid=16)
        assert v(acc) == [(x.ptr, Access.READ), (y.ptr, Access.WRITE)]  # loaded and stored: exclusive
        await gpu.load(op)
        await settle(gpu)
        with held(sim):
            fut = gpu.submit(op)
            st = gpu.statistics()
            assert (st.in_flight, st.leases_held) == (1, 3)
        assert await fut.wait() is z
        assert await gpu.run(acc) is y
        np.testing.assert_array_equal(await gpu.to_host(y), host() * 3 + 1)


async def test_access_override_changes_leases_and_output(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        wider = trio_cuda.Kernel.from_tile(vadd, access={"a": "write"}, cache=None)
        op = wider.launch(x, y, z, grid=16)
        assert v(op) == [(x.ptr, Access.WRITE), (y.ptr, Access.READ), (z.ptr, Access.WRITE)]
        with pytest.raises(KernelArgumentError, match=r"argument 0 \(a\): the kernel writes it"):
            wider.launch(x.as_readonly(), y, z, grid=16)
        assert await gpu.run(op) == (x, z)
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())
        rw = trio_cuda.Kernel.from_tile(vadd, access={"b": "read_write"}, cache=None)
        assert v(rw.launch(x, y, z, grid=16))[1] == (y.ptr, Access.WRITE)
        # declared read / none: shared leases; nothing written, so no output
        quiet = trio_cuda.Kernel.from_tile(vadd, access={"out": "read", "b": "none"}, cache=None)
        op = quiet.launch(x, y, z, grid=16)
        assert v(op) == [(x.ptr, Access.READ), (y.ptr, Access.READ), (z.ptr, Access.READ)]
        quiet.launch(x, y, z.as_readonly(), grid=16)  # "read": a read-only array is accepted
        assert internals.output_of(op) is None


async def test_leases_order_and_refuse_like_simt_leases(sim: SimDevice) -> None:
    """conflicts="error" shows the leases: a tile launch in flight conflicts
    with a write (or read) of what it writes, never with reads of what it reads."""
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        s0, s1 = gpu.streams
        x, y, z = await vadd_setup(gpu)
        w = gpu.zeros(N, F4)
        await gpu.load(vadd_of(x, y, z))
        await settle(gpu)
        with held(sim):
            fut = gpu.submit(vadd_of(x, y, z), stream=s0)
            before = (gpu.statistics(), sim.pending)
            with pytest.raises(trio_cuda.AccessConflictError, match="write-after-write"):
                gpu.submit(add(z, 1.0), stream=s1)
            with pytest.raises(trio_cuda.AccessConflictError, match="read-after-write"):
                gpu.submit(vadd_of(z, y, w), stream=s1)
            with pytest.raises(trio_cuda.AccessConflictError, match="write-after-read"):
                gpu.submit(add(x, 1.0), stream=s1)
            assert (gpu.statistics(), sim.pending) == before
            other = gpu.submit(vadd_of(x, y, w), stream=s1)  # reads x, y too: no conflict
        assert await fut.wait() is z
        assert await other.wait() is w
        for arr in (z, w):
            np.testing.assert_array_equal(await gpu.to_host(arr), expected_vadd())


# --------------------------------------------------------------------------- 5. aliasing


async def test_aliasing_arguments(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        buf = await gpu.to_device(host(2 * N))
        before = gpu.statistics()
        with pytest.raises(
            KernelArgumentError,
            match=r"^vadd: argument 0 \(a\) and argument 2 \(out\) overlap in memory and the kernel writes "
            r"argument 2 \(out\)",
        ):
            VADD.launch(x, y, x, grid=16)
        with pytest.raises(KernelArgumentError, match=r"argument 1 \(b\) and argument 2 \(out\) overlap"):
            VADD.launch(x, y, y, grid=16)
        with pytest.raises(KernelArgumentError, match=r"argument 0 \(x\) and argument 1 \(y\) overlap"):
            ACC.launch(y, y, grid=16)
        with pytest.raises(KernelArgumentError, match=r"argument 0 \(a\) and argument 2 \(out\) overlap"):
            VADD.launch(buf[:N], y, buf[N // 2 : N // 2 + N], grid=16)  # partly
        with pytest.raises(
            KernelArgumentError, match=r"argument 0 \(pair\)\[1\] and argument 1 \(out\) overlap"
        ):
            PAIR.launch((x, z), z, grid=16)
        with pytest.raises(
            KernelArgumentError, match=r"argument 0 \(arrays\)\[2\] and argument 1 \(out\) overlap"
        ):
            LIST.launch([x, y, z[: N // 2]], z, grid=16)
        assert gpu.statistics() == before
        # disjoint views of one allocation: accepted, and exact
        op = VADD.launch(buf[:N], y, buf[N:], grid=16)
        assert await gpu.run(op) is not None
        got = await gpu.to_host(buf)
        np.testing.assert_array_equal(got[:N], host())
        np.testing.assert_array_equal(got[N:], host() + host() * 2 + 1)
        # overlapping reads: accepted
        assert await gpu.run(VADD.launch(x, x.as_readonly(), z, grid=16)) is z
        np.testing.assert_array_equal(await gpu.to_host(z), 2 * host())
        assert await gpu.run(PAIR.launch((x, x), z, grid=16)) is z
        assert await gpu.run(LIST.launch([x, x[:N], x], z, grid=16)) is z
        np.testing.assert_array_equal(await gpu.to_host(z), 3 * host())


async def test_a_borrowed_alias_of_an_argument_is_refused(sim: SimDevice) -> None:
    """``trio_cuda.borrow`` gives a second handle (another allocation record)
    to the same bytes: the byte ranges, not the records, decide."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, _ = await vadd_setup(gpu)
        alias = trio_cuda.borrow(x, access="write")
        assert alias.ptr == x.ptr
        assert internals.allocation_of(alias) is not internals.allocation_of(x)
        fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
        with pytest.raises(KernelArgumentError, match=r"argument 0 \(a\) and argument 2 \(out\) overlap"):
            fresh.launch(x, y, alias, grid=16)
        alias.close()
        await settle(gpu)  # the export's release reaches the loop


def test_a_borrowed_alias_is_refused_on_the_fast_path_too() -> None:
    # a plain test running trio.run (the fast path is what it checks)
    sim = SimDevice()
    refused: list[KernelArgumentError] = []

    async def main() -> None:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x, y, z = await vadd_setup(gpu)
            alias = trio_cuda.borrow(x, access="write")
            fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
            fresh.launch(y, z, alias, grid=16)  # the recipe (and its fast path) of three float32[256]
            try:
                fresh.launch(x, y, alias, grid=16)
            except KernelArgumentError as exc:
                refused.append(exc)
            alias.close()
            await settle(gpu)  # the export's release reaches the loop

    trio.run(main)
    assert sim.violations == []
    assert refused, "an aliasing launch was accepted"
    assert "argument 0 (a) and argument 2 (out) overlap" in str(refused[0])


async def test_arrays_of_different_devices_never_alias(sim: SimDevice) -> None:
    other = SimDevice()
    async with trio_cuda.open_scope(device=sim) as gpu, trio_cuda.open_scope(device=other) as gpu2:
        x = await gpu.to_device(host())
        far = gpu2.zeros(N, F4)
        assert far.ptr == x.ptr  # the same address, in another device's memory
        op = VADD.launch(x, x, gpu.zeros(N, F4), grid=16)
        assert op is not None
        VADD.launch(far, gpu2.zeros(N, F4), gpu2.zeros(N, F4), grid=16)  # nothing to refuse either
    assert other.violations == []


# --------------------------------------------------------------------------- 6. composition


async def test_submit_then_map_zip_shared_and_await(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x, y, z = await vadd_setup(gpu)
        w = gpu.zeros(N, F4)
        fut = gpu.submit(vadd_of(x, y, z))
        assert await fut.wait() is z
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())
        # then: a tile launch, a SIMT launch, a tile launch again, on one stream
        chain = vadd_of(x, y, z).then(lambda out: add(out, 1.0)).then(lambda out: ACC.launch(x, out, grid=16))
        assert await gpu.run(chain) is z
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd() + 1 + host())
        assert await gpu.run(vadd_of(x, y, z).map(lambda out: (out is z, "mapped"))) == (True, "mapped")
        assert await gpu.run(trio_cuda.zip(vadd_of(x, y, z), vadd_of(y, x, w))) == (z, w)
        np.testing.assert_array_equal(await gpu.to_host(w), expected_vadd())
        launches = sim.statistics().launches
        once = ACC.launch(x, w, grid=16).shared()
        assert await gpu.run(trio_cuda.zip(once, once, once.map(lambda a: a.size))) == (w, w, N)
        assert sim.statistics().launches == launches + 1
        np.testing.assert_array_equal(await gpu.to_host(w), expected_vadd() + host())
        assert await ACC.launch(x, w, grid=16) is w  # `await op` in a scope
        np.testing.assert_array_equal(await gpu.to_host(w), expected_vadd() + 2 * host())


async def test_unsafe_async_on(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        s = gpu.streams[0]
        await settle(gpu)
        before = gpu.statistics()
        assert unsafe.async_on(vadd_of(x, y, z), s) is z
        for _ in range(2):
            unsafe.async_on(ACC.launch(x, z, grid=16), s)
        got = np.empty(N, F4)
        unsafe.async_on(ops.copy(got, z), s)
        after = gpu.statistics()
        assert (after.submitted, after.leases_held) == (before.submitted, 0)
        np.testing.assert_array_equal(got, expected_vadd() + 2 * host())


async def test_graph_capture_and_replay(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        w = gpu.zeros(N, F4)
        op = vadd_of(x, y, z).then(lambda out: ACC.launch(out, w, grid=16))
        launches = sim.statistics().launches
        graph = await gpu.capture(op)
        assert sim.statistics().launches == launches  # recorded, not run
        np.testing.assert_array_equal(await gpu.to_host(w), np.zeros(N, F4))
        for i in range(1, 4):
            assert await gpu.run(graph.launch()) is w
            np.testing.assert_array_equal(await gpu.to_host(w), i * expected_vadd())
        assert sim.graph_launches == 3
        graph.close()
    assert sim.live_allocations == []


async def test_tile_and_simt_kernels_share_leases_across_streams(sim: SimDevice) -> None:
    """The tile kernel writes z on stream 0 behind a gate; the SIMT kernel
    updating z in place on stream 1, and a tile kernel reading z on stream 2,
    wait for it device-side."""
    async with trio_cuda.open_scope(device=sim, streams=3) as gpu:
        s0, s1, s2 = gpu.streams
        x, y, z = await vadd_setup(gpu)
        w = gpu.zeros(N, F4)
        await gpu.load(vadd_of(x, y, z), ADD)
        for s in gpu.streams:
            await gpu.run(ops.value(None), stream=s)
        await trio.testing.wait_all_tasks_blocked()
        sim.clear_trace()
        ran: list[str] = []
        gate = gpu.submit(ops.host_closure(ran.append, "gate"), stream=s0)
        tile = gpu.submit(vadd_of(x, y, z), stream=s0)  # behind the gate
        simt = gpu.submit(add(z, 1.0), stream=s1)  # RAW/WAW on z
        last = gpu.submit(vadd_of(z, y, w), stream=s2)  # reads z after the SIMT kernel
        sim.run_until_idle()  # synchronously: the loop has not opened the gate
        assert ran == []
        assert sim.peek(z.ptr, z.nbytes) == bytes(z.nbytes)  # nothing wrote z yet
        assert sim.peek(w.ptr, w.nbytes) == bytes(w.nbytes)
        assert not tile.done()
        assert not simt.done()
        assert not last.done()
        await gate.wait()
        assert await tile.wait() is z
        assert await simt.wait() is z
        assert await last.wait() is w
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd() + 1)
        np.testing.assert_array_equal(await gpu.to_host(w), expected_vadd() + 1 + host() * 2 + 1)
        assert wait_labels(sim, 1)
        assert wait_labels(sim, 2)


async def test_simt_writer_then_tile_reader_on_another_stream(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        x, y, z = await vadd_setup(gpu)
        await gpu.load(vadd_of(x, y, z))
        await settle(gpu)
        sim.clear_trace()
        with held(sim):
            first = gpu.submit(add(x, 100.0), stream=s0)
            second = gpu.submit(vadd_of(x, y, z), stream=s1)
        await first.wait()
        assert await second.wait() is z
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd() + 100)
        assert wait_labels(sim, 1)


# --------------------------------------------------------------------------- 7. cancellation


async def test_cancelled_waiter_raises_promptly_and_leases_stay(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        op = vadd_of(x, y, z)
        await gpu.load(op)
        await settle(gpu)
        sim.hold()
        outcome: list[str] = []

        async def waiter() -> None:
            try:
                await gpu.run(op)
            except trio.Cancelled:
                outcome.append("cancelled")
                raise

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            st = gpu.statistics()
            assert (st.in_flight, st.leases_held) == (1, 3)
            t0 = time.perf_counter()
            nursery.cancel_scope.cancel()
        assert time.perf_counter() - t0 < 1.0
        assert outcome == ["cancelled"]
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held, st.retained_bytes) == (1, 3, 3 * N * 4)
        x.close()
        z.close()
        assert len(sim.live_allocations) == 3  # retained by the submission
        sim.release()
        await settle(gpu)
        st = gpu.statistics()
        assert (st.in_flight, st.leases_held, st.failed) == (0, 0, 0)
        assert len(sim.live_allocations) == 1  # only y
        np.testing.assert_array_equal(await gpu.to_host(y), host() * 2 + 1)
        assert sim.statistics().launches == 1  # the cancelled launch did run
    assert sim.violations == []
    assert sim.live_allocations == []


async def test_pre_cancelled_run_submits_and_compiles_nothing(
    sim: SimDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled: list[object] = []
    real = tc.compile_tile
    monkeypatch.setattr(tc, "compile_tile", lambda *a, **kw: compiled.append(1) or real(*a, **kw))
    fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        await settle(gpu)
        before = gpu.statistics()
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.run(fresh.launch(x, y, z, grid=16))
        assert cs.cancelled_caught
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.load(fresh.launch(x, y, z, grid=16))
        assert cs.cancelled_caught
        assert gpu.statistics() == before
        assert sim.statistics().launches == sim.statistics().kernel_loads == 0
        assert compiled == []
        np.testing.assert_array_equal(await gpu.to_host(z), np.zeros(N, F4))


async def test_cancelled_while_compiling_submits_nothing(
    sim: SimDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = threading.Event()
    go = threading.Event()
    real = tc.compile_tile

    def slow(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(tc, "compile_tile", slow)
    fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        await settle(gpu)
        before = gpu.statistics()
        op = fresh.launch(x, y, z, grid=16)
        with trio.move_on_after(10) as outer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gpu.run, op)
                assert await trio.to_thread.run_sync(entered.wait, 10)
                nursery.cancel_scope.cancel()
                go.set()
        assert not outer.cancelled_caught
        assert gpu.statistics() == before
        assert sim.statistics().launches == 0
        assert await gpu.run(op) is z  # compiled once already: runs now
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())


async def test_deadline_cancels_promptly_and_keeps_leases(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        op = vadd_of(x, y, z)
        await gpu.load(op)
        await settle(gpu)
        sim.hold()
        t0 = time.perf_counter()
        with trio.move_on_after(0.02) as cs:
            await gpu.run(op)
        assert cs.cancelled_caught
        assert time.perf_counter() - t0 < 1.0
        assert gpu.statistics().leases_held == 3
        await trio.sleep(0.02)
        assert gpu.statistics().leases_held == 3  # still: the GPU has not run it
        sim.release()
        await settle(gpu)
        assert gpu.statistics().leases_held == 0
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())


async def test_dropped_future_keeps_its_submission(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        await gpu.load(vadd_of(x, y, z))
        await settle(gpu)
        sim.hold()
        fut = gpu.submit(vadd_of(x, y, z))
        del fut
        for arr in (x, y, z):
            arr.close()
        gc.collect()
        assert gpu.statistics().leases_held == 3
        assert len(sim.live_allocations) == 3
        sim.release()
    assert sim.live_allocations == []
    assert sim.statistics().launches == 1


async def test_failing_tile_kernel_error_surfaces(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        await gpu.load(vadd_of(x, y, z))
        sim.inject_fault("kernel_fault")
        with pytest.raises(trio_cuda.LaunchError, match="CUDA_ERROR_LAUNCH_FAILED"):
            await gpu.run(vadd_of(x, y, z))
        await settle(gpu)
        assert gpu.statistics().leases_held == 0
        assert await gpu.run(vadd_of(x, y, z)) is z  # the scope goes on
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())
    with pytest.RaisesGroup(pytest.RaisesExc(trio_cuda.LaunchError, match="CUDA_ERROR_LAUNCH_FAILED")):
        async with trio_cuda.open_scope(device=sim) as gpu:
            x, y, z = await vadd_setup(gpu)
            sim.inject_fault("kernel_fault")
            gpu.submit(vadd_of(x, y, z))  # forgotten: its error surfaces at exit
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- 8. memcheck


async def test_async_on_with_a_freed_array_is_a_violation(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        op = vadd_of(x, y, z)
        await gpu.load(op)
        await settle(gpu)
        sim.hold()
        assert unsafe.async_on(op, gpu.streams[0]) is z
        x.close()
        assert len(sim.live_allocations) == 2  # freed at once: nothing retained it
        sim.release()
        await settle(gpu)
        assert [v.kind for v in sim.violations] == ["use_after_free"]
        assert sim.violations[0].address == x.ptr
        sim.clear_violations()


async def test_unchecked_access_past_the_extent_is_an_out_of_bounds_violation(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.arange(40, dtype=F4))
        y = gpu.zeros(T, F4)
        assert await gpu.run(UNCHECKED.launch(x, y, grid=2)) is y  # in bounds: clean
        np.testing.assert_array_equal(await gpu.to_host(y), np.arange(16, 32, dtype=F4))
        assert sim.violations == []
        with pytest.raises(trio_cuda.LaunchError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as info:
            await gpu.run(UNCHECKED.launch(x, y, grid=3))  # block 2 reads [32:48] of 40
        assert (
            "tile kernel unchecked_load: its execution on NumPy tiles accessed memory out of bounds"
            in str(info.value)
        )
        assert [v.kind for v in sim.violations] == ["out_of_bounds"]
        assert "unchecked_load" in sim.violations[0].op
        sim.clear_violations()


# --------------------------------------------------------------------------- 9. compiling


async def test_run_load_and_capture_compile_in_a_worker_thread(
    sim: SimDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[threading.Thread] = []
    real = tc.compile_tile

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(tc, "compile_tile", recording)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        for how in ("run", "load", "capture"):
            fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
            op = fresh.launch(x, y, z, grid=16)
            del threads[:]
            if how == "run":
                assert await gpu.run(op) is z
            elif how == "load":
                await gpu.load(op)
            else:
                graph = await gpu.capture(op.map(lambda out: out))
                assert await gpu.run(graph.launch()) is z
                graph.close()
            assert len(threads) == 1, how
            assert threads[0] is not threading.main_thread(), how
            # loaded: a second use compiles nothing
            await gpu.run(op)
            assert len(threads) == 1, how
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())


async def test_submit_of_a_kernel_not_compiled_yet_compiles_inline(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
        fut = gpu.submit(fresh.launch(x, y, z, grid=16))
        assert await fut.wait() is z
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())


async def test_compile_error_raises_before_anything_is_enqueued(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = await gpu.to_device(host())
        b = await gpu.to_device(host())
        out = gpu.zeros(N, F4)
        await settle(gpu)
        op = BAD.launch(a, b, out, grid=16)
        before = gpu.statistics()
        with pytest.raises(TileCompileError) as info:
            await gpu.run(op)
        err = info.value
        assert isinstance(err, trio_cuda.TrioCudaError)
        assert err.kernel == "bad_shapes"
        assert "bad_shapes" in str(err)
        assert (err.filename, err.line) == (__file__, BAD_LINE)
        with pytest.raises(TileCompileError, match="bad_shapes"):
            await gpu.load(op)
        with pytest.raises(TileCompileError, match="bad_shapes"):
            gpu.submit(op)
        with pytest.raises(TileCompileError, match="bad_shapes"):
            await gpu.capture(op)
        with pytest.raises(TileCompileError, match="bad_shapes"):
            await gpu.run(trio_cuda.zip(add(a, 1.0), op))
        after = gpu.statistics()
        assert after == before
        assert (after.leases_held, after.in_flight) == (0, 0)
        assert sim.statistics().launches == 0
        np.testing.assert_array_equal(await gpu.to_host(a), host())  # the zip's add never ran


async def test_an_argument_the_kernel_cannot_take_is_a_compile_error(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        y, z = gpu.zeros(N, F4), gpu.zeros(N, F4)
        await settle(gpu)
        before = gpu.statistics()
        op = VADD.launch(1.0, y, z, grid=16)  # a scalar where the kernel loads an array
        with pytest.raises(TileCompileError, match="vadd"):
            await gpu.run(op)
        assert gpu.statistics() == before


async def test_one_compile_per_signature_and_a_disk_cache(sim: SimDevice, tmp_path: Path) -> None:
    tc.clear_memory_cache()
    kernel = trio_cuda.Kernel.from_tile(vadd, cache=tmp_path)
    start = tc.compile_statistics()
    async with trio_cuda.open_scope(device=sim) as gpu:
        for n in (N, 2 * N, 4 * N):  # every length a multiple of 16: one signature
            x, y, z = await vadd_setup(gpu, n)
            await gpu.run(kernel.launch(x, y, z, grid=n // T))
            await gpu.run(kernel.launch(y, x, z, grid=n // T))
            np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd(n))
    assert len(kernel.tile.specialisations()) == 1
    async with trio_cuda.open_scope(device=SimDevice()) as gpu:  # another scope loads, compiles nothing
        x, y, z = await vadd_setup(gpu)
        await gpu.run(kernel.launch(x, y, z, grid=16))
    mid = tc.compile_statistics()
    assert mid["compiled"] - start["compiled"] == 1
    assert cubins(tmp_path) == 1
    # a new process (memory forgotten): the disk cache answers
    tc.clear_memory_cache()
    again = trio_cuda.Kernel.from_tile(vadd, cache=tmp_path)
    async with trio_cuda.open_scope(device=SimDevice()) as gpu:
        x, y, z = await vadd_setup(gpu)
        await gpu.run(again.launch(x, y, z, grid=16))
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())
    end = tc.compile_statistics()
    assert end["compiled"] == mid["compiled"]
    assert end["disk_hits"] == mid["disk_hits"] + 1


async def test_default_cache_follows_the_environment(
    sim: SimDevice, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_CUDA_TILE_CACHE", str(tmp_path / "first"))
    kernel = trio_cuda.Kernel.from_tile(vadd)  # cache="default": read at each compile
    monkeypatch.setenv("TRIO_CUDA_TILE_CACHE", str(tmp_path / "tiles"))
    tc.clear_memory_cache()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        await gpu.run(kernel.launch(x, y, z, grid=16))
    assert cubins(tmp_path / "tiles") == 1
    assert not (tmp_path / "first").exists()


async def test_load_compiles_ahead(sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = tc.compile_tile
    monkeypatch.setattr(tc, "compile_tile", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        op = fresh.launch(x, y, z, grid=16)
        launch = fresh.launch(y, x, z, grid=16)  # the same signature
        await gpu.load(op)
        assert calls == [1]
        assert sim.statistics().kernel_loads == 1
        await gpu.load(launch, op)  # loaded: nothing more
        await gpu.run(launch)
        await gpu.run(trio_cuda.zip(op.map(lambda o: o)))
        assert calls == [1]
        assert sim.statistics().kernel_loads == 1


# --------------------------------------------------------------------------- 10. checkpoints


async def test_run_and_load_of_tile_launches_are_checkpoints(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
        with trio.testing.assert_checkpoints():
            await gpu.load(fresh.launch(x, y, z, grid=16))  # compiles
        with trio.testing.assert_checkpoints():
            await gpu.load(fresh.launch(x, y, z, grid=16))  # nothing to do
        with trio.testing.assert_checkpoints():
            assert await gpu.run(fresh.launch(x, y, z, grid=16)) is z
        other = trio_cuda.Kernel.from_tile(vadd, cache=None)
        with trio.testing.assert_checkpoints():
            assert await gpu.run(other.launch(x, y, z, grid=16)) is z  # compiles first
        with trio.testing.assert_checkpoints(), pytest.raises(TileCompileError):
            await gpu.run(BAD.launch(x, y, z, grid=16))


# --------------------------------------------------------------------------- 11. no toolchain


async def test_without_the_toolchain_the_simulator_runs_unchecked_and_warns_once(
    sim: SimDevice, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first = trio_cuda.Kernel.from_tile(vadd, cache=None)
    second = trio_cuda.Kernel.from_tile(accumulate, cache=None)
    monkeypatch.setattr(tk, "_warned_sim", False)

    def missing() -> Any:
        raise TileToolchainError("cuda.tile is not importable: blocked by the test")

    monkeypatch.setattr(tc, "_import_tile", missing)
    caplog.set_level(logging.WARNING, logger="trio_cuda")
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        assert await gpu.run(first.launch(x, y, z, grid=16)) is z
        assert await gpu.run(second.launch(x, z, grid=16)) is z
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd() + host())
    warned = [r for r in caplog.records if r.name == "trio_cuda" and r.levelno == logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    message = warned[0].getMessage()
    assert "pip install 'trio_cuda[tile]'" in message
    assert "'vadd'" in message
    assert "blocked by the test" in message
    # the compile itself still refuses, naming the extra
    with pytest.raises(TileToolchainError, match=r"pip install 'trio_cuda\[tile\]'"):
        tc.compile_tile(vadd, tc.TileSignature([tc.spec_of_array("float32", (N,))] * 3))


async def test_sim_compile_check_can_be_turned_off(sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("compiled although TRIO_CUDA_SIM_COMPILE=0")

    monkeypatch.setattr(tc, "compile_tile", refuse)
    monkeypatch.setenv("TRIO_CUDA_SIM_COMPILE", "0")
    fresh = trio_cuda.Kernel.from_tile(vadd, cache=None)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        assert await gpu.run(fresh.launch(x, y, z, grid=16)) is z
        np.testing.assert_array_equal(await gpu.to_host(z), expected_vadd())


# --------------------------------------------------------------------------- reference= and pickling


def _vadd_on_cpu(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    out[:] = a - b  # deliberately not what the kernel does: shows which one ran


async def test_reference_wins_over_emulation(sim: SimDevice) -> None:
    k = trio_cuda.Kernel.from_tile(vadd, cache=None, reference=_vadd_on_cpu)
    assert "reference=_vadd_on_cpu" in repr(k)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        assert await gpu.run(k.launch(x, y, z, grid=16)) is z
        np.testing.assert_array_equal(await gpu.to_host(z), host() - (host() * 2 + 1))


async def test_a_tile_kernel_pickles_as_its_definition(sim: SimDevice) -> None:
    k = trio_cuda.Kernel.from_tile(vadd, cache=None, access={"b": "read_write"}, reference=_vadd_on_cpu)
    again = pickle.loads(pickle.dumps(k))
    assert again is not k
    assert again.name == "vadd"
    assert again.reference is _vadd_on_cpu
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y, z = await vadd_setup(gpu)
        op = again.launch(x, y, z, grid=16)
        assert v(op)[1] == (y.ptr, Access.WRITE)  # the declared access came along
        assert await gpu.run(op) == (y, z)
        np.testing.assert_array_equal(await gpu.to_host(z), host() - (host() * 2 + 1))  # and the reference


def test_a_tile_kernel_defined_in_a_function_does_not_pickle() -> None:
    @ct.kernel
    def local(a):  # type: ignore[no-untyped-def]
        ct.store(a, index=(0,), tile=ct.load(a, index=(0,), shape=(16,)))

    with pytest.raises((TypeError, pickle.PicklingError), match="module level"):
        pickle.dumps(trio_cuda.Kernel.from_tile(local, cache=None))


# --------------------------------------------------------------------------- 12. properties


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), extra_blocks=st.integers(0, 2), offset=st.integers(0, 4))
def test_vadd_matches_numpy_for_any_length(n: int, extra_blocks: int, offset: int) -> None:
    """Any length, a grid of at least cdiv(n, 16) blocks (extra blocks load
    and store nothing in bounds), inputs at any 16-element-aligned offset."""
    a = rng.standard_normal(n + offset * T).astype(F4)
    b = rng.standard_normal(n).astype(F4)

    async def main() -> None:
        sim = SimDevice()
        async with trio_cuda.open_scope(device=sim) as gpu:
            da = await gpu.to_device(a)
            db = await gpu.to_device(b)
            out = gpu.zeros(n, F4)
            grid = -(-n // T) + extra_blocks
            assert await gpu.run(VADD.launch(da[offset * T :], db, out, grid=grid)) is out
            np.testing.assert_array_equal(await gpu.to_host(out), a[offset * T :] + b)
        assert sim.violations == []
        assert sim.live_allocations == []

    trio.run(main)


@pytest.mark.parametrize("kernel", ["vadd", "list"])
async def test_a_launch_shape_is_checked_once_unless_its_check_prepares_lists(
    sim: SimDevice, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scope checks each launch shape of a kernel against the device
    once; a tile specialisation with list arguments has them prepared by the
    backend's check, so its launches are checked each time."""
    from trio_cuda._backends.sim.context import SimContext

    checks: list[object] = []
    real = SimContext.check_launch

    def counting(self: Any, function: Any, launch: Any) -> None:
        checks.append(launch)
        real(self, function, launch)

    monkeypatch.setattr(SimContext, "check_launch", counting)
    async with trio_cuda.open_scope(device=sim) as gpu:
        xs = [gpu.zeros(N, F4) for _ in range(3)]
        out = gpu.zeros(N, F4)
        for _ in range(4):
            op = VADD.launch(*xs[:2], out, grid=16) if kernel == "vadd" else LIST.launch(xs, out, grid=16)
            await gpu.run(op)
        assert len(checks) == (1 if kernel == "vadd" else 4)
