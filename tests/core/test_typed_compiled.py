"""The compiled typed-launch fast path: what it holds and refuses.

Its launches are compared with the generated (pure-Python) fast path's and
the checked path's in ``test_launch_fast.py``; here: it leaks nothing, and
the table it is made from is checked."""

from __future__ import annotations

import gc
import sys
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers import internals
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import stub_source
from trio_cuda import In, InOut, Out, Scalar, Slice
from trio_cuda._core import _compiled
from trio_cuda._core._config import cached_config


@compiled_only
async def test_compiled_typed_launch_leaks_nothing():
    """Launches made, declined (a NaN, a closed array, a wrong count) and
    merged (two views of one allocation) return every reference they took."""
    k = trio_cuda.Kernel.from_source(
        stub_source("k"),
        "k",
        params=[In("f4"), Out("f4"), Slice("f4", len_dtype="u4"), Scalar("f2"), Scalar("i8")],
    )
    fast = internals.fast_launch(k)
    assert type(fast).__name__ == "TypedLaunch"
    config = cached_config(1, 1, 0, None, False, False)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        closed = gpu.zeros(2, "f4")
        closed.close()
        n, h = np.int64(5), np.float16(1.5)
        calls = [
            ((x, y, x[2:], h, n), True),
            ((x, x, y, 2.0, 7), True),  # merged: two entries of one allocation
            ((x, y, y, float("nan"), n), False),  # a half NaN: declined
            ((x, closed, y, h, n), False),
            ((x, y, y, h), False),
            ((x, y, y, h, 2**70), False),
        ]

        def run() -> None:
            for args, made in calls:
                assert (fast(args, config) is not None) == made

        def counts() -> list[int]:
            gc.collect()
            held = (x, y, x._alloc, y._alloc, closed, n, h, k, config, type(fast), k.plan)
            return [sys.getrefcount(o) for o in held]

        for _ in range(20):
            run()
        before = counts()
        for _ in range(500):
            run()
        assert counts() == before


@compiled_only
def test_the_table_is_checked_and_calls_are_positional():
    ext = _compiled.ext
    assert ext is not None
    k = trio_cuda.Kernel.from_source(stub_source("k"), "k", params=[InOut("f4")])
    dt = np.dtype("f4")
    bad = [
        (5, dt, None, "Q", 0, 0),  # no such kind
        (3, dt, None, "Q", 4, 0),  # past the end
        (0, np.int32, None, "f", 0, 0),  # an int packed as a float
        (1, np.float32, None, "i", 0, 0),  # a float packed as an int
        (2, np.bool_, None, "b", 0, 0),  # a bool not as "?"
        (4, dt, None, "Q", 0, 8),  # a slice's length past the end
        (0, np.int32, None, "ii", 0, 0),
        (0, np.int32, None, "i"),  # too short
    ]
    for entry in bad:
        with pytest.raises((ValueError, TypeError)):
            ext.typed(k, k.plan, 8, (entry,))
    with pytest.raises(ValueError):
        ext.typed(k, k.plan, -1, ())
    fast = internals.fast_launch(k)
    config = cached_config(1, 1, 0, None, False, False)
    with pytest.raises(TypeError, match="two positional arguments"):
        fast((), config, 1)
    with pytest.raises(TypeError, match="two positional arguments"):
        fast(args=(), config=config)
    assert fast([], config) is None  # (a list: declined, as the generated path declines it)


@compiled_only
async def test_a_kernel_made_before_and_used_from_a_worker_thread():
    """The compiled path holds no per-thread state: a launch made in a worker
    thread is the launch made on the loop's thread."""
    k = trio_cuda.Kernel.from_source(stub_source("k"), "k", params=[Out("f4"), Scalar("i4")])
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(4, "f4")
        here = k.launch(x, 3, grid=1, block=1)
        there: Any = await trio.to_thread.run_sync(lambda: k.launch(x, 3, grid=1, block=1))
        assert there.prepared.arena == here.prepared.arena
        assert internals.output_of(there) is x


def test_info_says_how_launches_are_made():
    from trio_cuda.__main__ import info_lines, launch_making_line

    line = launch_making_line()
    assert line in info_lines()
    if _compiled.ext is not None:
        assert line == (
            "launch making: compiled (Kernel.launch, the launch builder, submission, awaiting and retirement)"
        )
    else:
        assert line.startswith("launch making: pure Python (")


@compiled_only
async def test_compiled_leases_leak_nothing_and_are_used():
    """The compiled common case of a launch's leases takes them (each run
    goes through it) and returns every reference it took once retired."""
    from trio_cuda._core import _submit

    k = trio_cuda.Kernel.from_source(
        stub_source("k"), "k", params=[In("f4"), InOut("f4")], reference=trio_cuda.NO_REFERENCE
    )
    assert _submit.take_whole is not None
    real = _submit.take_whole
    taken = []

    def counting(*args: Any) -> bool:
        assert real is not None
        took: bool = real(*args)
        taken.append(took)
        return took

    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        op = k.launch(x, y, grid=1, block=1)
        await gpu.run(op)

        def counts() -> list[int]:
            gc.collect()
            held = (x, y, x._alloc, y._alloc, x._extent, y._extent, op, op._accesses)
            return [sys.getrefcount(o) for o in held]

        before = counts()
        _submit.take_whole = counting
        try:
            for _ in range(200):
                await gpu.run(op)
            futures = [gpu.submit(op) for _ in range(50)]
            for f in futures:
                await f.wait()
            del futures, f
        finally:
            _submit.take_whole = real
        assert counts() == before
        assert taken == [True] * 250


@compiled_only
async def test_a_tile_array_s_constants_are_packed_once_or_each_call():
    """A tile array's constants (packed after its pointer) are packed into
    the arena's start when the launcher is made; one that does not fit its
    code is packed by each call instead, which declines (the checked path
    then decides), as before."""
    ext = _compiled.ext
    assert ext is not None
    k = trio_cuda.Kernel.from_source(stub_source("k"), "k", params=[InOut("f4")])
    dt = np.dtype("f4")
    from trio_cuda._core._ops import Access

    write = Access.WRITE
    config = cached_config(1, 1, 0, None, False, False)

    def launcher(*consts: tuple[str, int, int]) -> Any:
        entry = (5, dt, write, "Q", 0, 0, ((8,), "C", 0, consts))
        return ext.typed(k, k.plan, 24, (entry,), True)

    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(8, "f4")
        if x._alloc.ptr % 16:  # (the entry asks for an address 16-aligned)
            pytest.skip("the simulator's allocation is not 16-aligned")
        fits = launcher(("i", 8, 8), ("h", 12, -2), ("Q", 16, 2**64 - 1))((x,), config)
        assert fits is not None
        arena = fits.prepared.arena
        assert arena[:8] == int(x._alloc.ptr + x._offset).to_bytes(8, "little")
        assert arena[8:] == (8).to_bytes(4, "little") + (-2).to_bytes(2, "little", signed=True) + bytes(2) + (
            2**64 - 1
        ).to_bytes(8, "little")
        assert launcher(("b", 8, 300))((x,), config) is None  # does not fit: declined
        assert launcher(("b", 8, 300), ("i", 12, 1))((x,), config) is None
        again = launcher(("i", 8, 8), ("h", 12, -2), ("Q", 16, 2**64 - 1))((x,), config)
        assert again.prepared.arena == arena  # (each call starts from the same bytes)
