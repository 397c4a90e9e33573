"""A tile kernel's fast launch paths agree: the compiled one, the generated
Python one (the reference) and the checked path.

Each recipe's fast path (made by the checked path at a recipe's first launch)
is made both ways here; random arguments, right and wrong (other dtypes,
shapes, orders and alignments, read-only and closed arrays, aliases, scalars
of every type, NaN and signed-zero constants), go through both: they decline
(None) alike or build the same launch, which is the checked path's."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ct = pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")

import trio_cuda  # noqa: E402
from tests.helpers import internals  # noqa: E402
from tests.tile.test_tile_kernels import affine, fill_base, scale, vadd  # noqa: E402
from trio_cuda._core import _compiled, _tilefast  # noqa: E402
from trio_cuda._core._config import cached_config  # noqa: E402
from trio_cuda._tile import launching  # noqa: E402

STATS: dict[str, int] = {"made": 0, "declined": 0}
#: (compiled, generated) fast paths of each recipe made so far
PAIRS: list[tuple[Any, Any]] = []
KERNELS = {
    "vadd": trio_cuda.Kernel.from_tile(vadd, cache=None),
    "affine": trio_cuda.Kernel.from_tile(affine, cache=None),
    "scale": trio_cuda.Kernel.from_tile(scale, cache=None),
    "fill": trio_cuda.Kernel.from_tile(fill_base, cache=None),
}
#: arrays of each argument: (kernel, position) -> the pool's names that fit it
SCALARS: list[object] = [
    0,
    3,
    -1,
    2**40,
    2**70,
    True,
    1.5,
    -0.0,
    0.0,
    math.nan,
    math.inf,
    np.float32(2.0),
    np.float64(-0.0),
    np.float16(1.0),
    np.int32(7),
    np.int64(-3),
    np.uint8(200),
    np.bool_(True),
    "2",
    None,
]


#: arguments each kernel takes as they are meant
GOOD = {
    "vadd": lambda p: (p["x"], p["y"], p["z"]),
    "affine": lambda p: (p["x"], p["z"], 1.5, 3),
    "scale": lambda p: (p["x"], p["z"], 2.0),
    "fill": lambda p: (p["i"], 7),
}


def _summary(launch: Any) -> tuple[Any, ...]:
    p = launch.prepared
    out = internals.output_of(launch)
    return (
        type(launch),
        p.kernel,
        p.config,
        p.plan,
        p.arena,
        p.values,
        p.args,
        [(id(a), m) for a, m in internals.accesses_of(launch)],
        [id(a) for a in out] if isinstance(out, tuple) else id(out),
    )


@pytest.mark.skipif(_compiled.ext is None, reason="the compiled paths are not in use")
def test_compiled_tile_fast_path_is_the_generated_one() -> None:
    """The property, then a check that it saw both outcomes (it cannot hold vacuously)."""
    STATS.update(made=0, declined=0)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        trio.run(_example, data)

    check()
    assert STATS["made"] > 100, STATS
    assert STATS["declined"] > 100, STATS
    assert len(PAIRS) > 4


async def _example(data: st.DataObject) -> None:
    pairs = PAIRS  # (the recipes, and their fast paths, outlive an example)
    real = launching.compile_tile_fast

    def both(kernel: Any, plan: Any, packer: Any, args: Any) -> Any:
        c = _tilefast.compile_tile_fast_c(kernel, plan, packer, args)
        py = _tilefast.compile_tile_fast_py(kernel, plan, packer, args)
        assert c is not None, "a recipe the compiled path does not take"
        pairs.append((c, py))
        return c

    launching.compile_tile_fast = both
    try:
        async with trio_cuda.open_scope(device="sim") as gpu:
            x = gpu.zeros(256, np.float32)
            w = gpu.zeros(257, np.float32)
            pool = {
                "x": x,
                "y": gpu.zeros(256, np.float32),
                "z": gpu.zeros(256, np.float32),
                "x[16:]": x[16:],
                "x[1:]": x[1:],
                "w[1:]": w[1:],  # the same shape, another address alignment
                "w[:256]": w[:256],
                "x[:128]": x[:128],  # another shape
                "i": gpu.zeros(256, np.int32),
                "m": gpu.zeros((16, 16), np.float32),
                "m.T": gpu.zeros((16, 16), np.float32).T,  # another order
                "ro": x.as_readonly(),
                "closed": gpu.zeros(256, np.float32),
            }
            pool["closed"].close()
            names = sorted(pool)
            for _ in range(data.draw(st.integers(1, 6))):
                name = data.draw(st.sampled_from(sorted(KERNELS)))
                k = KERNELS[name]
                arity = {"vadd": (3, 0), "affine": (2, 2), "scale": (2, 1), "fill": (1, 1)}[name]
                if data.draw(st.booleans()):  # arguments that fit: most launches match a recipe
                    args = list(GOOD[name](pool))
                    if data.draw(st.booleans()):  # ... but one of them
                        at = data.draw(st.integers(0, len(args) - 1))
                        args[at] = (
                            pool[data.draw(st.sampled_from(names))]
                            if at < arity[0]
                            else data.draw(st.sampled_from(SCALARS))
                        )
                else:
                    args = [pool[data.draw(st.sampled_from(names))] for _ in range(arity[0])]
                    args += [data.draw(st.sampled_from(SCALARS)) for _ in range(arity[1])]
                if data.draw(st.integers(0, 9)) == 0:
                    args.append(pool["x"])  # a wrong count
                grid = data.draw(st.sampled_from([1, 16]))
                checked = None
                try:
                    checked = k.launch(*args, grid=grid)
                except (trio_cuda.KernelArgumentError, trio_cuda.TileCompileError):
                    pass
                config = cached_config(grid, 1, 0, None, False, False)
                for c, py in pairs:
                    got, want = c(tuple(args), config), py(tuple(args), config)
                    assert (got is None) == (want is None), (name, args)
                    STATS["made" if want is not None else "declined"] += 1
                    if want is not None:
                        assert _summary(got) == _summary(want)
                        assert checked is not None
                        assert internals.lease_plan_of(want) is None
                        plan = internals.lease_plan_of(got)
                        if plan is not None:  # made with the launch: no two arrays of one allocation
                            assert len({id(a._alloc) for a, _ in internals.accesses_of(got)}) == len(plan[0])
                        ref = _summary(checked)
                        assert _summary(got)[3:5] == ref[3:5]  # the plan and the arena bytes
                        assert _summary(got)[7:] == ref[7:]  # the accesses and the output
    finally:
        launching.compile_tile_fast = real


async def test_an_int_s_recipe_depends_on_whether_it_fits_int32() -> None:
    """Found by the property above: after a launch with an int beyond int32
    (a recipe whose int parameter is 64-bit), a launch with a small int must
    not take that recipe's fast path: the checked path gives it the int32
    recipe. (Either fast path, compiled or generated.)"""
    k = trio_cuda.Kernel.from_tile(affine, cache=None)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, out = gpu.zeros(256, np.float32), gpu.zeros(256, np.float32)
        small = k.launch(x, out, 1, 3, grid=16)
        big = k.launch(x, out, 2**40, 3, grid=16)
        assert big.kernel is not small.kernel  # two recipes
        again = k.launch(x, out, 1, 3, grid=16)  # (the big recipe's fast path is the most recent)
        assert again.kernel is small.kernel
        assert again.prepared.plan is small.prepared.plan
        assert k.launch(x, out, 2**41, 3, grid=16).kernel is big.kernel
