"""The launch fast path packs exactly what the checked reference path packs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_cuda
from tests.helpers import internals
from trio_cuda import In, InOut, Scalar, Slice

DTYPES = ["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "?"]


def scalar_values(dt):
    dt = np.dtype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return st.integers(int(info.min), int(info.max)) | st.integers(int(info.min), int(info.max)).map(
            dt.type
        )
    if dt.kind == "f":
        return st.floats(-1e4, 1e4, width=16 if dt.itemsize == 2 else 32).map(dt.type) | st.floats(-1e4, 1e4)
    return st.booleans()


@st.composite
def signatures(draw):
    n = draw(st.integers(1, 6))
    params = []
    for _ in range(n):
        kind = draw(st.sampled_from(["scalar", "in", "inout", "slice"]))
        if kind == "scalar":
            params.append(Scalar(draw(st.sampled_from(DTYPES))))
        elif kind == "in":
            params.append(In("f4"))
        elif kind == "inout":
            params.append(InOut("f4"))
        else:
            params.append(Slice("f4", len_dtype=draw(st.sampled_from(["u4", "u8", "i8"]))))
    return params


@settings(max_examples=150, deadline=None)
@given(data=st.data())
async def test_fast_and_checked_paths_pack_the_same_arena(data):
    params = data.draw(signatures())
    k = trio_cuda.Kernel.from_source("", "k", params=params)
    assert internals.fast_launch(k) is not None
    async with trio_cuda.open_scope(device="sim") as gpu:
        arrays = [gpu.empty(data.draw(st.integers(0, 64)), np.float32) for _ in params]
        args = []
        for p, arr in zip(params, arrays, strict=True):
            args.append(data.draw(scalar_values(p.dtype)) if isinstance(p, Scalar) else arr)
        fast = k.launch(*args, grid=1, block=1)
        checked = internals.checked_launch(k, tuple(args), fast.config)
        assert fast.prepared.arena == checked.prepared.arena
        assert len(fast.prepared.arena) == k.plan.size
        assert fast.prepared.arg_views() == checked.prepared.arg_views()
        assert internals.accesses_of(fast) == internals.accesses_of(checked)


async def test_fast_path_rejections_fall_back_to_precise_errors():
    k = trio_cuda.Kernel.from_source("", "k", params=[Scalar("f4"), Scalar("u1"), InOut("f4")])
    async with trio_cuda.open_scope(device="sim") as gpu:
        y = gpu.empty(4, np.float32)
        with pytest.raises(trio_cuda.KernelArgumentError, match=r"overflows float32"):
            k.launch(1e40, 1, y, grid=1, block=1)
        with pytest.raises(
            trio_cuda.KernelArgumentError, match=r"value 256 is out of range for uint8 \[0, 255\]"
        ):
            k.launch(1.0, 256, y, grid=1, block=1)
        with pytest.raises(trio_cuda.KernelArgumentError, match=r"expected a float32 scalar, got float64"):
            k.launch(np.float64(1.0), 1, y, grid=1, block=1)
        with pytest.raises(trio_cuda.KernelArgumentError, match=r"read-only"):
            k.launch(1.0, 1, y.as_readonly(), grid=1, block=1)


def test_struct_and_complex_params_use_the_general_path():
    pair = np.dtype([("a", "f4"), ("b", "f8")], align=True)
    k = trio_cuda.Kernel.from_source("", "k", params=[Scalar(pair), Scalar("c8")])
    assert internals.fast_launch(k) is None
    assert [s.offset for s in k.plan.slots] == [0, 16]
    assert k.plan.size == 24
