"""The kernel launch layer on the simulator and on the CPU: argument marshalling
(every scalar type, float16 and bfloat16, structs with padding and
over-alignment, Slice, boxed blobs), the launch modes (clusters, cooperative
launches with their occupancy limit, programmatic dependent launch), and bad
input that is refused with nothing enqueued. The GPU side of the same
contract is tests/backends/test_cuda_launch.py."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import stub_source
from trio_cuda import DeviceInfo, In, InOut, KernelArgumentError, Out, Scalar, Slice, ops, unsafe
from trio_cuda._core._arena import MAX_PARAM_BYTES, check_param_layout
from trio_cuda._core._config import check_device_limits, make_config, modeled_blocks_per_sm
from trio_cuda.testing import SimDevice

ROOT = Path(__file__).resolve().parents[2]
F4 = np.float32

NUMERIC = ["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16", "?"]

PAD = np.dtype([("a", "u1"), ("b", "f8"), ("c", "i2")], align=True)  # C: a@0, b@8, c@16, sizeof 24
# struct __align__(16) { float x; float4 v; }: v@16, sizeof 32, alignof 16
OVER = np.dtype({"names": ["x", "v"], "formats": ["f4", ("f4", 4)], "offsets": [0, 16], "itemsize": 32})


def struct(dtype: np.dtype[Any], value: tuple[Any, ...]) -> np.void:
    """A struct scalar with zeroed padding."""
    buf = np.zeros(1, dtype)
    buf[0] = value
    return buf[0]


def kernel(*params: Any, name: str = "k", reference: Any = trio_cuda.NO_REFERENCE) -> trio_cuda.Kernel:
    return trio_cuda.Kernel.from_source(stub_source(name), name, params=list(params), reference=reference)


def recorder() -> tuple[list[tuple[Any, ...]], Any]:
    got: list[tuple[Any, ...]] = []

    def reference(*args: Any) -> None:
        got.append(tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args))

    return got, reference


def counters(sim: SimDevice, gpu: trio_cuda.ResourceScope) -> tuple[Any, ...]:
    s = sim.statistics()
    g = gpu.statistics()
    return (
        sim.pending,
        s.launches,
        s.commands_executed,
        s.live_allocations,
        g.submitted,
        g.in_flight,
        g.leases_held,
        g.retained_bytes,
        g.live_allocations,
        g.pending_errors,
        g.failed,
    )


@contextlib.contextmanager
def nothing_happens(sim: SimDevice, gpu: trio_cuda.ResourceScope) -> Iterator[None]:
    before = counters(sim, gpu)
    trace = len(sim.trace)
    yield
    assert counters(sim, gpu) == before
    assert len(sim.trace) == trace


def slot_bytes(launch: trio_cuda.KernelLaunch, index: int) -> bytes:
    slot = launch.prepared.plan.slots[index]
    return launch.prepared.arena[slot.offset : slot.offset + slot.size]


# --------------------------------------------------------------------------- scalars


def extreme(dt: np.dtype[Any]) -> Any:
    if dt.kind in "iu":
        return dt.type(np.iinfo(dt).min if dt.kind == "i" else np.iinfo(dt).max)
    if dt.kind == "f":
        return dt.type(-1.5)
    if dt.kind == "c":
        return dt.type(complex(1.25, -2.5))
    return np.bool_(True)


@pytest.mark.parametrize("code", NUMERIC)
async def test_every_numeric_scalar_type_is_packed_and_passed_as_itself(sim, code):
    dt = np.dtype(code)
    got, ref = recorder()
    k = kernel(Scalar("u1"), Scalar(dt), Scalar("u1"), reference=ref)
    value = extreme(dt)
    align = dt.itemsize if dt.kind == "c" else dt.alignment  # complex: like float2 / double2
    assert k.plan.slots[1].offset == align
    assert k.plan.slots[1].align == align
    async with trio_cuda.open_scope(device=sim) as gpu:
        launch = k.launch(np.uint8(7), value, np.uint8(9), grid=1, block=1)
        assert slot_bytes(launch, 1) == np.asarray(value, dt).tobytes()
        assert launch.prepared.arena[1 : k.plan.slots[1].offset] == bytes(k.plan.slots[1].offset - 1)
        await gpu.run(launch)
    ((a, v, b),) = got
    assert (a, b) == (7, 9)
    assert type(v) is dt.type
    assert v == value


async def test_float16_scalars(sim):
    got, ref = recorder()
    k = kernel(Scalar("f2"), Scalar("f2"), reference=ref)
    assert internals.fast_launch(k) is not None  # float16 takes the struct fast path
    async with trio_cuda.open_scope(device=sim) as gpu:
        launch = k.launch(0.1, np.float16(-65504.0), grid=1, block=1)
        assert launch.prepared.arena == np.array([0.1, -65504.0], np.float16).tobytes()
        assert internals.checked_launch(k, (0.1, np.float16(-65504.0)), launch.config).prepared.arena == (
            launch.prepared.arena
        )
        await gpu.run(launch)
        with nothing_happens(sim, gpu):
            with pytest.raises(KernelArgumentError, match=r"argument 0 .*value 70000.0 overflows float16"):
                k.launch(70000.0, np.float16(0), grid=1, block=1)
            with pytest.raises(KernelArgumentError, match=r"expected a float16 scalar, got float32"):
                k.launch(np.float32(1), np.float16(0), grid=1, block=1)
    ((x, y),) = got
    assert type(x) is np.float16
    assert x == np.float16(0.1)
    assert y == np.float16(-65504.0)


async def test_bfloat16_and_float8_scalars_with_ml_dtypes(sim):
    ml_dtypes = pytest.importorskip(
        "ml_dtypes",
        reason="ml_dtypes is not installed (pip install ml_dtypes): bfloat16 and float8 scalars need it",
    )
    bf16 = np.dtype(ml_dtypes.bfloat16)
    f8 = np.dtype(ml_dtypes.float8_e4m3fn)
    got, ref = recorder()
    k = kernel(Scalar("u1"), Scalar(bf16), Scalar(f8), Scalar(bf16), reference=ref)
    assert [s.offset for s in k.plan.slots] == [0, 2, 4, 6]
    async with trio_cuda.open_scope(device=sim) as gpu:
        launch = k.launch(np.uint8(1), 1.5, 2.0, ml_dtypes.bfloat16(-3.0), grid=1, block=1)
        assert slot_bytes(launch, 1) == np.asarray(1.5, bf16).tobytes()
        assert slot_bytes(launch, 2) == np.asarray(2.0, f8).tobytes()
        assert slot_bytes(launch, 3) == np.asarray(-3.0, bf16).tobytes()
        await gpu.run(launch)
        with nothing_happens(sim, gpu):
            with pytest.raises(KernelArgumentError, match=r"argument 1 .*value 1e\+39 overflows bfloat16"):
                k.launch(np.uint8(1), 1e39, 2.0, 1.0, grid=1, block=1)
            with pytest.raises(
                KernelArgumentError, match=r"argument 2 .*value 1000.0 overflows float8_e4m3fn"
            ):
                k.launch(np.uint8(1), 1.0, 1000.0, 1.0, grid=1, block=1)
            with pytest.raises(
                KernelArgumentError,
                match=r"argument 3 .*expected a bfloat16 scalar, got float32 .*ml_dtypes.bfloat16\(x\)",
            ):
                k.launch(np.uint8(1), 1.0, 1.0, np.float32(1), grid=1, block=1)
            with pytest.raises(
                KernelArgumentError, match=r"argument 1 .*expected a bfloat16 scalar, got str"
            ):
                k.launch(np.uint8(1), "1.0", 1.0, 1.0, grid=1, block=1)
    ((_, a, b, c),) = got
    assert a.dtype == bf16
    assert float(a) == 1.5
    assert b.dtype == f8
    assert float(b) == 2.0
    assert float(c) == -3.0


async def test_scalar_range_and_overflow_messages(sim):
    k = kernel(Scalar("i2"), Scalar("f4"), Scalar("c8"))
    async with trio_cuda.open_scope(device=sim) as gpu:
        with (
            nothing_happens(sim, gpu),
            pytest.raises(KernelArgumentError, match=r"argument 0 .*value 40000 is out of range for int16"),
        ):
            k.launch(40000, 1.0, 1j, grid=1, block=1)
        with (
            nothing_happens(sim, gpu),
            pytest.raises(KernelArgumentError, match=r"argument 1 .*overflows float32"),
        ):
            k.launch(1, 2**2000, 1j, grid=1, block=1)  # an int too large for a double
        with (
            nothing_happens(sim, gpu),
            pytest.raises(KernelArgumentError, match=r"argument 2 .*overflows complex64"),
        ):
            k.launch(1, 1.0, complex(1e300, 0), grid=1, block=1)
        with (
            nothing_happens(sim, gpu),
            pytest.raises(KernelArgumentError, match=r"argument 0 .*expected a int16 scalar, got bool"),
        ):
            k.launch(True, 1.0, 1j, grid=1, block=1)


@pytest.mark.parametrize(
    ("dtype", "pattern"),
    [
        ("O", r"'O' dtypes are not kernel parameter types"),
        ("U4", r"'U' dtypes are not kernel parameter types"),
        ("M8[s]", r"'M' dtypes are not kernel parameter types"),
        (">f4", r"not in the native byte order"),
        (np.longdouble, r"has no CUDA equivalent"),
        (np.dtype(("f4", 4)), r"a fixed-size array is not a C parameter type"),
        (
            np.dtype([("a", "u1"), ("b", "f4")]),
            r"field 'b' \(float32\) is at offset 1, not a multiple of its ",
        ),
        (np.dtype([("a", "u1"), ("b", "c8")], align=True), r"field 'b' \(complex64\) is at offset 4"),
        (np.dtype([("a", "u1"), ("b", "O")], align=True), r"field 'b': 'O' dtypes"),
    ],
)
def test_scalar_refuses_what_c_cannot_receive(dtype, pattern):
    if np.dtype(dtype).itemsize == 8 and np.dtype(dtype).kind == "f":
        pytest.skip("long double is a double on this platform")
    with pytest.raises(
        TypeError, match=r"^dtype: expected a numeric, bool, complex or C-layout structured dtype"
    ):
        Scalar(dtype)
    with pytest.raises(TypeError, match=pattern):
        Scalar(dtype)


def test_scalar_align_is_checked():
    with pytest.raises(ValueError, match=r"^align: expected a power of two, got 3$"):
        Scalar("f4", align=3)
    with pytest.raises(ValueError, match=r"^align: expected a power of two, got True$"):
        Scalar("f4", align=True)
    with pytest.raises(
        ValueError, match=r"^align: expected a power of two >= 8 \(the alignment of float64\), got 4$"
    ):
        Scalar("f8", align=4)
    assert Scalar("f4", align=16).alignment == 16
    assert Scalar("f4", align=16).size == 16
    assert Scalar("f8").alignment == 8


# --------------------------------------------------------------------------- structs


async def test_struct_with_padding_follows_the_c_layout(sim):
    got, ref = recorder()
    k = kernel(Scalar("u1"), Scalar(PAD), Scalar("u1"), reference=ref)
    assert [(s.offset, s.size, s.align) for s in k.plan.slots] == [(0, 1, 1), (8, 24, 8), (32, 1, 1)]
    value = np.array((200, -2.5, -7), PAD)[()]  # its padding bytes are whatever NumPy left there
    async with trio_cuda.open_scope(device=sim) as gpu:
        by_tuple = k.launch(np.uint8(1), (200, -2.5, -7), np.uint8(2), grid=1, block=1)
        by_void = k.launch(np.uint8(1), value, np.uint8(2), grid=1, block=1)
        assert by_tuple.prepared.arena == by_void.prepared.arena
        arena = by_void.prepared.arena
        assert arena[8:32] == struct(PAD, (200, -2.5, -7)).tobytes()
        assert arena[9:16] == bytes(7)
        assert arena[26:32] == bytes(6)
        assert arena[8:9] == bytes([200])
        assert arena[16:24] == np.float64(-2.5).tobytes()
        await gpu.run(by_void)
        with nothing_happens(sim, gpu):
            with pytest.raises(KernelArgumentError, match=r"argument 1 .*expected a tuple matching"):
                k.launch(np.uint8(1), (1, "x", 2), np.uint8(2), grid=1, block=1)
            with pytest.raises(KernelArgumentError, match=r"argument 1 .*structured scalar of dtype"):
                k.launch(np.uint8(1), 3.0, np.uint8(2), grid=1, block=1)
    ((_, s, _),) = got
    assert s.dtype == PAD
    assert s["a"] == 200
    assert s["b"] == -2.5
    assert s["c"] == -7


async def test_over_aligned_struct_by_align_and_by_metadata(sim):
    by_align = kernel(Scalar("u1"), Scalar(OVER, align=16), Scalar("u1"))
    meta = np.dtype(OVER, metadata={"align": 16})
    by_meta = kernel(Scalar("u1"), Scalar(meta), Scalar("u1"))
    natural = kernel(Scalar("u1"), Scalar(OVER), Scalar("u1"))
    for k in (by_align, by_meta):
        assert [(s.offset, s.size, s.align) for s in k.plan.slots] == [(0, 1, 1), (16, 32, 16), (48, 1, 1)]
    assert [(s.offset, s.size, s.align) for s in natural.plan.slots] == [(0, 1, 1), (4, 32, 4), (36, 1, 1)]
    value = struct(OVER, (1.5, (1, 2, 3, 4)))
    async with trio_cuda.open_scope(device=sim):
        arena = by_align.launch(np.uint8(5), value, np.uint8(6), grid=1, block=1).prepared.arena
    assert len(arena) == 49
    assert arena[16:48] == value.tobytes()
    assert arena[1:16] == bytes(15)
    assert arena[48] == 6


async def test_struct_size_is_rounded_up_to_its_alignment(sim):
    # offsets given explicitly with an itemsize that C would pad: sizeof is 16
    odd = np.dtype({"names": ["a", "b"], "formats": ["f8", "u1"], "offsets": [0, 8], "itemsize": 9})
    k = kernel(Scalar(odd), Scalar("u1"))
    assert [(s.offset, s.size) for s in k.plan.slots] == [(0, 16), (16, 1)]
    async with trio_cuda.open_scope(device=sim):
        arena = k.launch((1.0, 3), np.uint8(4), grid=1, block=1).prepared.arena
    assert arena[:9] == np.array((1.0, 3), odd).tobytes()
    assert arena[9:16] == bytes(7)
    assert arena[16] == 4


def test_parameter_bytes_are_bounded():
    big = np.dtype([("a", "u1", (MAX_PARAM_BYTES,))])
    with pytest.raises(KernelArgumentError, match=rf"^params: expected at most {MAX_PARAM_BYTES} bytes"):
        kernel(Scalar("u8"), Scalar(big))
    kernel(Scalar(np.dtype([("a", "u1", (MAX_PARAM_BYTES,))])))  # exactly the limit fits


# --------------------------------------------------------------------------- Slice


@pytest.mark.parametrize(("len_dtype", "len_size"), [("u8", 8), ("u4", 4), ("i8", 8), ("u2", 2)])
async def test_slice_is_a_pointer_then_a_length(sim, len_dtype, len_size):
    got, ref = recorder()
    k = kernel(Scalar("u1"), Slice("f4", access="read", len_dtype=len_dtype), Out("f4"), reference=ref)
    assert [(s.offset, s.size) for s in k.plan.slots] == [
        (0, 1),
        (8, 8),
        (16, len_size),
        (_up(16 + len_size), 8),
    ]
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.arange(12, dtype=F4).reshape(3, 4))
        y = gpu.zeros(1, F4)
        launch = k.launch(np.uint8(3), x, y, grid=1, block=1)
        assert slot_bytes(launch, 1) == np.uint64(x.ptr).tobytes()
        assert slot_bytes(launch, 2) == np.asarray(12, len_dtype).tobytes()  # the element count
        assert (
            internals.checked_launch(k, (np.uint8(3), x, y), launch.config).prepared.arena
            == launch.prepared.arena
        )
        await gpu.run(launch)
    ((tag, view, n, out),) = got
    assert tag == 3
    assert view.shape == (3, 4)
    assert view.dtype == F4
    assert type(n) is np.dtype(len_dtype).type
    assert n == 12
    np.testing.assert_array_equal(view, np.arange(12, dtype=F4).reshape(3, 4))
    assert out.shape == (1,)


def _up(n: int) -> int:
    return (n + 7) // 8 * 8


async def test_slice_errors(sim):
    k = kernel(Slice("f4", len_dtype="u1"), Slice("f4", access="read"))
    async with trio_cuda.open_scope(device=sim) as gpu:
        big = gpu.zeros(300, F4)
        small = gpu.zeros(3, F4)
        ints = gpu.zeros(3, np.int32)
        with nothing_happens(sim, gpu):
            with pytest.raises(KernelArgumentError, match=r"argument 0 .*length 300 does not fit uint8"):
                k.launch(big, small, grid=1, block=1)
            with pytest.raises(KernelArgumentError, match=r"argument 1 .*expected dtype float32, got int32"):
                k.launch(small, ints, grid=1, block=1)
            with pytest.raises(KernelArgumentError, match=r"argument 0 .*read-only"):
                k.launch(small.as_readonly(), small, grid=1, block=1)
    with pytest.raises(TypeError, match=r"^len_dtype: expected a native integer dtype .*got float32$"):
        Slice("f4", len_dtype="f4")


# --------------------------------------------------------------------------- builder and boxed blobs


async def test_builder_boxed_struct_matches_the_typed_arena(sim):
    got, ref = recorder()
    k = kernel(Scalar("u1"), Scalar(OVER, align=16), InOut("f4"), reference=ref)
    value = struct(OVER, (2.5, (1, 2, 3, 4)))
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        typed = k.launch(np.uint8(1), value, y, grid=2, block=32, cluster=2, pdl=True)
        built = (
            k.builder()
            .grid(2)
            .block(32)
            .cluster(2)
            .pdl()
            .arg(np.uint8(1))
            .arg_boxed(value.tobytes(), align=16)
            .arg(y)
            .finalize_unchecked()
        )
        assert built.prepared.arena == typed.prepared.arena
        assert [(s.offset, s.size) for s in built.prepared.plan.slots] == [
            (s.offset, s.size) for s in k.plan.slots
        ]
        assert (built.config.grid, built.config.cluster, built.config.pdl) == ((2, 1, 1), (2, 1, 1), True)
        assert await gpu.run(built) is y
        assert await gpu.run(typed) is y
    (b_tag, b_raw, b_y), (t_tag, t_struct, t_y) = got
    assert b_tag == t_tag == 1
    assert b_raw == value.tobytes()
    assert t_struct == value
    assert b_y.shape == t_y.shape == (4,)


async def test_builder_struct_scalar_gets_c_size_and_alignment(sim):
    k = kernel()
    async with trio_cuda.open_scope(device=sim):
        launch = (
            k.builder()
            .arg(np.uint8(1))
            .arg(
                np.array(
                    (1.0, 2),
                    np.dtype(
                        {"names": ["a", "b"], "formats": ["f8", "u1"], "offsets": [0, 8], "itemsize": 9}
                    ),
                )[()]
            )
            .arg(np.uint8(3))
            .arg(np.complex64(1j))
            .finalize_unchecked()
        )
    assert [(s.offset, s.size, s.align) for s in launch.prepared.plan.slots] == [
        (0, 1, 1),
        (8, 16, 8),
        (24, 1, 1),
        (32, 8, 8),
    ]


async def test_builder_input_errors(sim):
    k = kernel()
    async with trio_cuda.open_scope(device=sim) as gpu:
        b = k.builder()
        before = counters(sim, gpu)
        with pytest.raises(
            KernelArgumentError, match=r"^argument 0: align must be a power of two, got True$"
        ):
            b.arg_boxed(b"abcd", align=True)
        with pytest.raises(KernelArgumentError, match=r"^argument 0: align must be a power of two, got 4.0$"):
            b.arg_boxed(b"abcd", align=4.0)  # type: ignore[arg-type]
        with pytest.raises(
            KernelArgumentError, match=r"^argument 0: expected bytes, bytearray or memoryview, got str$"
        ):
            b.arg_boxed("abcd", align=4)  # type: ignore[arg-type]
        with pytest.raises(
            KernelArgumentError, match=r"^argument 0: expected a numeric.*got <U1: 'U' dtypes"
        ):
            b.arg(np.str_("x"))
        with pytest.raises(
            KernelArgumentError,
            match=r"^params: expected at most 32764 bytes of kernel parameters, got 40008$",
        ):
            b.arg(np.uint8(1)).arg_boxed(bytes(40000), align=8).finalize_unchecked()
        with pytest.raises(KernelArgumentError, match=r"^cooperative: expected a bool, got 'yes'$"):
            k.builder().grid(1).block(1).cooperative("yes").finalize_unchecked()  # type: ignore[arg-type]
        assert counters(sim, gpu) == before


# --------------------------------------------------------------------------- modes on the simulator


async def test_every_mode_runs_the_reference_with_the_same_arguments(sim):
    got, record = recorder()

    def ref(a: Any, x: Any, y: Any, n: Any) -> None:
        record(a, x, y, n)
        y[:n] += a * x[:n]

    k = kernel(Scalar("f4"), In("f4"), InOut("f4"), Scalar("i4"), reference=ref)
    modes: list[dict[str, Any]] = [
        {},
        {"cluster": 2},
        {"cluster": (2, 2)},
        {"cooperative": True},
        {"pdl": True},
        {"cluster": 2, "cooperative": True, "pdl": True},
        {"shared_mem": 100 * 1024},
    ]
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(np.arange(8, dtype=F4))
        y = gpu.zeros(8, F4)
        for mode in modes:
            launch = k.launch(F4(1), x, y, 8, grid=(4, 2), block=32, **mode)
            assert launch.config.cooperative is bool(mode.get("cooperative", False))
            assert launch.config.pdl is bool(mode.get("pdl", False))
            assert await gpu.run(launch) is y
            b = k.builder().grid(4, 2).block(32).arg(F4(1)).arg(x).arg(y).arg(np.int32(8))
            if "cluster" in mode:
                c = mode["cluster"]
                b.cluster(*(c if isinstance(c, tuple) else (c,)))
            b.cooperative(mode.get("cooperative", False)).pdl(mode.get("pdl", False))
            b.shared_mem(mode.get("shared_mem", 0))
            built = b.finalize_unchecked()
            assert built.config.cluster == launch.config.cluster
            assert built.prepared.arena == launch.prepared.arena
            unsafe.async_on(built, gpu.streams[1])
            await gpu.run(ops.value(None), stream=gpu.streams[1])
        np.testing.assert_array_equal(await gpu.to_host(y), np.arange(8, dtype=F4) * 2 * len(modes))
    assert len(got) == 2 * len(modes)
    first = got[0]
    for args in got:
        assert [type(a) for a in args] == [type(a) for a in first]
        assert args[0] == F4(1)
        assert args[3] == np.int32(8)
        np.testing.assert_array_equal(args[1], first[1])


def test_modeled_occupancy():
    info = SimDevice().info
    assert modeled_blocks_per_sm(info, (1024, 1, 1), 0) == 2
    assert modeled_blocks_per_sm(info, (256, 1, 1), 0) == 8
    assert (
        modeled_blocks_per_sm(info, (33, 1, 1), 0) == 32
    )  # rounded up to 2 warps: 32 by threads, 32 by blocks
    assert modeled_blocks_per_sm(info, (32, 1, 1), 0) == 32  # block limit
    assert modeled_blocks_per_sm(info, (128, 1, 1), 100 * 1024) == 2  # shared memory limit
    assert modeled_blocks_per_sm(info, (128, 1, 1), 200 * 1024) == 1


@pytest.mark.parametrize(
    ("sms", "block", "shared_mem", "limit"),
    [(132, 256, 0, 1056), (132, 1024, 0, 264), (132, 128, 100 * 1024, 264), (4, 64, 0, 128)],
)
async def test_cooperative_limit_is_checked_up_front(sms, block, shared_mem, limit):
    sim = SimDevice(multiprocessor_count=sms)
    got, ref = recorder()
    k = kernel(InOut("f4"), reference=ref)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(4, F4)
        fits = k.launch(x, grid=limit, block=block, shared_mem=shared_mem, cooperative=True)
        await gpu.run(fits)
        assert len(got) == 1
        too_many = k.launch(x, grid=limit + 1, block=block, shared_mem=shared_mem, cooperative=True)
        built = (
            k.builder()
            .grid(limit + 1)
            .block(block)
            .shared_mem(shared_mem)
            .cooperative()
            .arg(x)
            .finalize_unchecked()
        )
        pattern = (
            rf"^k: cooperative launch of {limit + 1} blocks exceeds the co-resident limit {limit} "
            rf"\({sms} SMs\)$"
        )
        with nothing_happens(sim, gpu):
            for op in (too_many, built):
                with pytest.raises(KernelArgumentError, match=pattern):
                    gpu.submit(op)
                with pytest.raises(KernelArgumentError, match=pattern):
                    await gpu.run(op, stream=gpu.streams[1])
                with pytest.raises(KernelArgumentError, match=pattern):
                    unsafe.async_on(op, gpu.streams[0])
                with pytest.raises(KernelArgumentError, match=pattern):
                    gpu.submit(ops.value(1).then(lambda _, op=op: op))
        # the same grid without cooperative=True is fine
        await gpu.run(k.launch(x, grid=limit + 1, block=block, shared_mem=shared_mem))
    assert len(got) == 2
    assert sim.live_allocations == []


async def test_clusters_and_pdl_need_sm_90_on_the_simulator_too():
    sim = SimDevice(compute_capability=(8, 0))
    k = kernel(InOut("f4"))
    async with trio_cuda.open_scope(device=sim) as gpu:
        assert gpu.device.compute_capability == (8, 0)
        x = gpu.zeros(4, F4)
        with nothing_happens(sim, gpu):
            with pytest.raises(
                KernelArgumentError,
                match=r"^k: cluster: thread-block clusters need compute capability 9.0 or newer, "
                r"the device \(sim0\) has 8.0; got cluster=\(2, 1, 1\)$",
            ):
                gpu.submit(k.launch(x, grid=4, block=32, cluster=2))
            with pytest.raises(KernelArgumentError, match=r"^k: pdl: programmatic dependent launch needs"):
                unsafe.async_on(k.launch(x, grid=4, block=32, pdl=True), gpu.streams[0])
        await gpu.run(k.launch(x, grid=4, block=32, cooperative=True))  # cooperative is fine on sm_80


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"grid": 6, "block": 32, "cluster": 4}, r"^cluster: dimension 0 \(4\) must divide grid dimension 6"),
        ({"grid": 1, "block": 32, "cooperative": 1}, r"^cooperative: expected a bool, got 1$"),
        ({"grid": 1, "block": 32, "pdl": "no"}, r"^pdl: expected a bool, got 'no'$"),
    ],
)
async def test_impossible_modes_are_refused_by_launch(sim, kwargs, pattern):
    k = kernel(InOut("f4"))
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        k.launch(x, grid=kwargs["grid"], block=32)  # a valid launch of the same geometry first
        with nothing_happens(sim, gpu), pytest.raises(KernelArgumentError, match=pattern):
            k.launch(x, **kwargs)


#: geometry no device can run, refused by ``launch`` and ``finalize_unchecked``
IMPOSSIBLE = [
    (
        {"grid": 1, "block": 2048},
        r"^block: expected at most 1024 threads per block, got 2048 \(2048 x 1 x 1\)$",
    ),
    (
        {"grid": 1, "block": (32, 32, 2)},
        r"^block: expected at most 1024 threads per block, got 2048 \(32 x 32 x 2\)$",
    ),
    (
        {"grid": 1, "block": (1, 1, 65)},
        r"^block: expected at most 64 threads in dimension z, got 65 \(1 x 1 x 65\)$",
    ),
    (
        {"grid": 1, "block": 2**64},
        r"^block: expected at most 1024 threads per block, got 18446744073709551616 "
        r"\(18446744073709551616 x 1 x 1\)$",
    ),
    (
        {"grid": 2**31, "block": 32},
        r"^grid: expected at most 2147483647 blocks in dimension x, got 2147483648 \(2147483648 x 1 x 1\)$",
    ),
    (
        {"grid": (1, 65536), "block": 32},
        r"^grid: expected at most 65535 blocks in dimension y, got 65536 \(1 x 65536 x 1\)$",
    ),
    (
        {"grid": (1, 1, np.int64(65536)), "block": 32},
        r"^grid: expected at most 65535 blocks in dimension z, got 65536 \(1 x 1 x 65536\)$",
    ),
    (
        {"grid": 1, "block": 32, "shared_mem": 232449},
        r"^shared_mem: expected at most 232448 bytes of dynamic shared memory \(the most any supported "
        r"GPU gives a block\), got 232449$",
    ),
    (
        {"grid": 1, "block": 32, "shared_mem": np.uint64(2**63)},
        r"^shared_mem: expected at most 232448 bytes .*, got 9223372036854775808$",
    ),
    (
        {"grid": 32, "block": 32, "cluster": 32},
        r"^cluster: expected at most 16 blocks per cluster \(the most any GPU runs\), got 32 \(32 x 1 x 1\)$",
    ),
    (
        {"grid": (8, 8), "block": 32, "cluster": (4, 8)},
        r"^cluster: expected at most 16 blocks per cluster .*, got 32 \(4 x 8 x 1\)$",
    ),
    ({"grid": True, "block": 32}, r"^grid: expected an int or a tuple of 1 to 3 ints, got True$"),
    (
        {"grid": 1, "block": (32, True)},
        r"^block: expected an int or a tuple of 1 to 3 ints, got \(32, True\)$",
    ),
    ({"grid": 4, "block": 32, "cluster": (True,)}, r"^cluster: expected an int or a tuple of 1 to 3 ints"),
    ({"grid": 1, "block": 32, "shared_mem": True}, r"^shared_mem: expected a non-negative int, got True$"),
]


def _build(k: trio_cuda.Kernel, x: trio_cuda.DeviceArray, kwargs: dict[str, Any]) -> trio_cuda.LaunchBuilder:
    def dims(v: Any) -> tuple[Any, ...]:
        return v if isinstance(v, tuple) else (v,)

    b = k.builder().grid(*dims(kwargs["grid"])).block(*dims(kwargs["block"])).arg(x)
    if "shared_mem" in kwargs:
        b.shared_mem(kwargs["shared_mem"])
    if "cluster" in kwargs:
        b.cluster(*dims(kwargs["cluster"]))
    return b


@pytest.mark.parametrize(("kwargs", "pattern"), IMPOSSIBLE)
async def test_geometry_no_device_runs_is_refused_at_launch(sim, kwargs, pattern):
    k = kernel(InOut("f4"))
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        with nothing_happens(sim, gpu):
            for _ in range(2):  # a refusal is not cached
                with pytest.raises(KernelArgumentError, match=pattern) as info:
                    k.launch(x, **kwargs)
                assert info.value.__context__ is None  # (no cache lookup error chained to it)
            b = _build(k, x, kwargs)  # (its dims are tuples: compare up to what was given)
            with pytest.raises(KernelArgumentError, match=pattern.split(", got ")[0]):
                b.finalize_unchecked()
        assert sim.statistics().launches == 0


async def test_geometry_at_the_limits_is_accepted_at_launch(sim):
    got, ref = recorder()
    k = kernel(InOut("f4"), reference=ref)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        for kwargs in (
            {"grid": 1, "block": 1024},
            {"grid": 1, "block": (1, 16, 64)},
            {"grid": 1, "block": (np.int32(32), np.uint8(32))},
            {"grid": (2**31 - 1, 65535, 65535), "block": 1},
            {"grid": 1, "block": 32, "shared_mem": 232448},
            {"grid": 1, "block": 32, "shared_mem": np.int64(1024)},
            {"grid": 16, "block": 32, "cluster": 16},
            {"grid": (4, 4), "block": 32, "cluster": (4, 4)},
        ):
            op = k.launch(x, **kwargs)
            assert attrs.astuple(_build(k, x, kwargs).finalize_unchecked().config) == attrs.astuple(op.config)
        # the cheap ones run; a 2**31 - 1 x 65535 x 65535 grid is only built
        await gpu.run(k.launch(x, grid=1, block=(1, 16, 64)))
        await gpu.run(k.launch(x, grid=1, block=32, shared_mem=232448))
        assert len(got) == 2


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"grid": 16, "block": 32, "cluster": 16},
            r"^k: cluster: expected at most 8 blocks per cluster, got 16$",
        ),
        (
            {"grid": 1000, "block": 1024, "cooperative": True},
            r"^k: cooperative launch of 1000 blocks exceeds the co-resident limit 264 \(132 SMs\)$",
        ),
    ],
)
async def test_device_limits_of_built_launches_are_refused_before_enqueue(sim, kwargs, pattern):
    # within what some device runs (so finalize_unchecked accepts it), beyond this one
    k = kernel(InOut("f4"))
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        b = _build(k, x, kwargs)
        if kwargs.get("cooperative"):
            b.cooperative()
        op = b.finalize_unchecked()
        assert attrs.astuple(k.launch(x, **kwargs).config) == attrs.astuple(op.config)
        with nothing_happens(sim, gpu):
            with pytest.raises(KernelArgumentError, match=pattern):
                gpu.submit(op)
            with pytest.raises(KernelArgumentError, match=pattern):
                unsafe.async_on(op, gpu.streams[0])


async def test_the_device_limits_still_apply_after_the_launch_checks(sim):
    # a device with smaller limits than any launch-time bound: the submission's
    # check (check_device_limits) refuses what Kernel.launch let through
    small = DeviceInfo(
        backend="sim",
        name="small",
        ordinal=0,
        total_memory=2**30,
        compute_capability=(9, 0),
        max_threads_per_block=512,
        max_shared_memory_per_block_optin=166912,
        max_grid_dim=(2**31 - 1, 1024, 1024),
        max_block_dim=(512, 512, 32),
    )
    k = kernel(InOut("f4"))
    cases = [
        (
            {"grid": 1, "block": 1024},
            r"^k: block: expected at most 512 threads per block, got \(1024, 1, 1\)",
        ),
        ({"grid": 1, "block": (1, 1, 64)}, r"^k: block: dimension 2 is 64, the device allows 32$"),
        ({"grid": (1, 2048), "block": 1}, r"^k: grid: dimension 1 is 2048, the device allows 1024$"),
        ({"grid": 1, "block": 1, "shared_mem": 200_000}, r"^k: shared_mem: expected at most 166912 bytes"),
        ({"grid": 16, "block": 1, "cluster": 16}, r"^k: cluster: expected at most 8 blocks per cluster"),
    ]
    async with trio_cuda.open_scope(device=sim) as gpu:
        arr = gpu.zeros(4, F4)
        for kwargs, pattern in cases:
            op = k.launch(arr, **kwargs)
            with pytest.raises(KernelArgumentError, match=pattern):
                check_device_limits(op.prepared, small)
        check_device_limits(k.launch(arr, grid=(1, 1024), block=(16, 32)).prepared, small)


def test_mode_flags_are_not_confused_by_the_config_cache():
    # cooperative=1 must not hit the cache entry of cooperative=False (1 == True)
    a = make_config(1, 32)
    assert not a.cooperative
    with pytest.raises(KernelArgumentError, match=r"^cooperative: expected a bool"):
        kernel(InOut("f4")).launch(None, grid=1, block=32, cooperative=1)
    assert make_config(1, 32, cooperative=np.bool_(True)).cooperative is True


def test_sim_device_checks_its_new_arguments():
    with pytest.raises(
        TypeError, match=r"^compute_capability: expected a \(major, minor\) tuple of ints, got \(9,\)$"
    ):
        SimDevice(compute_capability=(9,))
    with pytest.raises(ValueError, match=r"^multiprocessor_count: expected a positive int, got 0$"):
        SimDevice(multiprocessor_count=0)


# --------------------------------------------------------------------------- layout check (cuda's)


async def test_param_layout_check_names_the_argument(sim):
    k = kernel(Scalar("u1"), Slice("f4"), Scalar(PAD), name="lay")
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        launch = k.launch(np.uint8(1), x, (1, 2.0, 3), grid=1, block=1)
        good = [(s.offset, s.size) for s in k.plan.slots]
        assert good == [(0, 1), (8, 8), (16, 8), (24, 24)]
        check_param_layout(launch.prepared, good)  # the compiled kernel agrees
        with pytest.raises(
            KernelArgumentError,
            match=r"^lay: argument 1 \(Slice\('<f4'\)\) length: the compiled kernel's parameter 2 takes 4 "
            r"bytes at offset 16, the argument packs 8 bytes at offset 16",
        ):
            check_param_layout(launch.prepared, [(0, 1), (8, 8), (16, 4), (24, 24)])
        with pytest.raises(
            KernelArgumentError, match=r"^lay: argument 2 \(Scalar\('\|V24'\)\): .* 32 bytes at offset 32"
        ):
            check_param_layout(launch.prepared, [(0, 1), (8, 8), (16, 8), (32, 32)])
        with pytest.raises(
            KernelArgumentError,
            match=r"^lay: params: expected 5 kernel parameters \(as compiled\), the launch packs 4$",
        ):
            check_param_layout(launch.prepared, [*good, (48, 4)])
        built = k.builder().arg(np.uint8(1)).arg_boxed(b"abcd", align=4).finalize_unchecked()
        with pytest.raises(
            KernelArgumentError,
            match=r"^lay: argument 1 \(boxed bytes\): .* 8 bytes at offset 8, "
            r"the argument packs 4 bytes at offset 4",
        ):
            check_param_layout(built.prepared, [(0, 1), (8, 8)])


# --------------------------------------------------------------------------- in-place update example


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("inplace_update", ROOT / "examples" / "inplace_update.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("inplace_update", module)
    spec.loader.exec_module(module)
    return module


async def test_inplace_update_example_on_the_simulator(sim):
    example = _load_example()
    facts = await example.run(sim, 1000)
    assert facts == {
        "backend": "sim",
        "same_array": True,
        "same_pointer": True,
        "no_new_allocation": True,
        "values_ok": True,
        "max_error": 0.0,
    }
    assert sim.live_allocations == []


async def test_inplace_update_keeps_the_allocation(sim):
    example = _load_example()
    async with trio_cuda.open_scope(device=sim) as gpu:
        buf = gpu.empty(300, F4)
        alloc, ptr = internals.allocation_of(buf), buf.ptr
        allocations = sim.statistics().allocations
        out = await gpu.run(
            example.produce.launch(buf, grid=2, block=256).then(
                lambda a: example.update.launch(a, F4(3), F4(1), grid=2, block=256)
            )
        )
        assert out is buf
        assert internals.allocation_of(out) is alloc
        assert out.ptr == ptr
        assert sim.statistics().allocations == allocations  # nothing new was allocated
        np.testing.assert_array_equal(await gpu.to_host(buf), np.arange(300, dtype=F4) * 3 + 1)


async def test_run_loads_an_unloaded_kernel_off_the_loop_where_the_driver_can(sim, monkeypatch):
    import threading

    k = trio_cuda.Kernel.from_source(
        stub_source("fill7"), "fill7", params=[Out("i4")], reference=lambda y: y.fill(7)
    )
    async with trio_cuda.open_scope(device=sim) as gpu:
        internals.set_load_in_thread(gpu, True)  # as on the cuda backend
        threads = []
        cls = type(internals.driver_of(gpu))
        load = cls.load_kernel

        def recording_load(self, kernel):
            threads.append(threading.current_thread())
            return load(self, kernel)

        monkeypatch.setattr(cls, "load_kernel", recording_load)
        y = gpu.zeros(4, np.int32)
        await gpu.run(k.launch(y, grid=1, block=1))
        await gpu.run(k.launch(y, grid=1, block=1))  # loaded once
        assert len(threads) == 1
        assert threads[0] is not threading.main_thread()
        np.testing.assert_array_equal(await gpu.to_host(y), [7, 7, 7, 7])
        # submit() cannot wait: it loads on the loop
        k2 = trio_cuda.Kernel.from_source(
            stub_source("fill8"), "fill8", params=[Out("i4")], reference=lambda y: y.fill(8)
        )
        await gpu.submit(k2.launch(y, grid=1, block=1)).wait()
        assert threads[1] is threading.main_thread()


def _double_on_cpu(x, n):
    x[: int(n)] *= 2


async def test_a_kernel_pickles_as_its_definition_and_runs_after():
    import pickle

    import trio_cuda
    from trio_cuda import InOut, Kernel, Scalar

    src = 'extern "C" __global__ void dbl(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] *= 2; }'
    k = Kernel.from_source(src, "dbl", params=[InOut("f4"), Scalar("i4")], reference=_double_on_cpu)
    again = pickle.loads(pickle.dumps(k))
    assert again is not k
    assert (again.name, again.params, again.source, again.reference) == (
        k.name,
        k.params,
        k.source,
        k.reference,
    )
    assert repr(again) == repr(k)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = await gpu.to_device(np.arange(4, dtype=np.float32))
        await gpu.run(again.launch(x, np.int32(4), grid=1, block=4))
        np.testing.assert_array_equal(await gpu.to_host(x), [0, 2, 4, 6])
    stub = pickle.loads(
        pickle.dumps(Kernel.from_source(src, "dbl", params=[], reference=trio_cuda.NO_REFERENCE))
    )
    assert stub.reference is trio_cuda.NO_REFERENCE
