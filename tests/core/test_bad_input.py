"""Bad input: every mistake raises the documented error, with a message that
names the argument, what was expected and what was given; nothing is
enqueued, retained or leaked (checked on the simulator's and the scope's
counters before and after)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers.kernels import ADD, COPY, SAXPY, add, stub_source
from trio_cuda import In, InOut, KernelArgumentError, Out, Scalar, ScopeClosedError, Slice, ops, unsafe
from trio_cuda._core import _dlpack
from trio_cuda.testing import SimDevice

F4 = np.float32


def counters(sim: SimDevice, gpu: trio_cuda.ResourceScope | None) -> tuple[Any, ...]:
    # (A rejected launch may have loaded its module into the scope: that is a
    # cache the scope owns and unloads at exit, not work or a leak.)
    s = sim.statistics()
    sim_part = (
        sim.pending,
        s.launches,
        s.copies,
        s.fills,
        s.commands_executed,
        s.live_allocations,
        s.allocations,
        s.frees,
    )
    if gpu is None:
        return sim_part
    g = gpu.statistics()
    return (
        *sim_part,
        g.submitted,
        g.in_flight,
        g.leases_held,
        g.retained_bytes,
        g.live_allocations,
        g.pending_errors,
        g.failed,
    )


@contextlib.contextmanager
def nothing_happens(sim: SimDevice, gpu: trio_cuda.ResourceScope | None = None) -> Iterator[None]:
    """The block raises (checked by an inner pytest.raises) and changes nothing."""
    before = counters(sim, gpu)
    trace = len(sim.trace)
    yield
    assert counters(sim, gpu) == before
    assert len(sim.trace) == trace


def kernel(*params: Any, name: str = "k") -> trio_cuda.Kernel:
    return trio_cuda.Kernel.from_source(
        stub_source(name), name, params=list(params), reference=trio_cuda.NO_REFERENCE
    )


def saxpy_args(x: trio_cuda.DeviceArray, y: trio_cuda.DeviceArray) -> tuple[Any, ...]:
    return (F4(2), x, y, x.size)


# --------------------------------------------------------------------------- launch arguments


async def test_wrong_argument_count_names_every_parameter(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y = gpu.zeros(8, F4), gpu.zeros(8, F4)
        with nothing_happens(sim, gpu):
            with pytest.raises(
                KernelArgumentError,
                match=r"^saxpy: expected 4 arguments \(argument 0 \(Scalar\('<f4'\)\), "
                r"argument 1 \(In\('<f4'\)\), argument 2 \(InOut\('<f4'\)\), argument 3 "
                r"\(Scalar\('<i4'\)\)\), "
                r"got 2$",
            ):
                SAXPY.launch(F4(2), x, grid=1, block=8)
            with pytest.raises(KernelArgumentError, match=r"^saxpy: expected 4 arguments .*, got 5$"):
                SAXPY.launch(F4(2), x, y, 8, 8, grid=1, block=8)
            with pytest.raises(KernelArgumentError, match=r"^saxpy: expected 4 arguments .*, got 0$"):
                SAXPY.launch(grid=1, block=8)
    assert sim.live_allocations == []


async def test_wrong_array_dtype(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y = gpu.zeros(8, np.float64), gpu.zeros(8, F4)
        with nothing_happens(sim, gpu):
            with pytest.raises(
                KernelArgumentError,
                match=r"^saxpy: argument 1 \(In\('<f4'\)\): expected dtype float32, got float64$",
            ):
                SAXPY.launch(F4(2), x, y, 8, grid=1, block=8)
            with pytest.raises(
                KernelArgumentError,
                match=r"argument 2 \(InOut\('<f4'\)\): expected dtype "
                r"float32, got float64",
            ):
                SAXPY.launch(F4(2), y, x, 8, grid=1, block=8)


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (np.float64(2.0), r"argument 0 \(Scalar\('<f4'\)\): expected a float32 scalar, got float64"),
        (np.int32(2), r"argument 0 \(Scalar\('<f4'\)\): expected a float32 scalar, got int32"),
        ("2.0", r"argument 0 \(Scalar\('<f4'\)\): expected a float32 scalar, got str \('2.0'\)"),
        (None, r"argument 0 \(Scalar\('<f4'\)\): expected a float32 scalar, got NoneType"),
        (True, r"argument 0 \(Scalar\('<f4'\)\): expected a float32 scalar, got bool"),
        (1e40, r"argument 0 \(Scalar\('<f4'\)\): value 1e\+40 overflows float32"),
        (-1e40, r"argument 0 \(Scalar\('<f4'\)\): value -1e\+40 overflows float32"),
    ],
)
async def test_wrong_float_scalar(sim, value, pattern):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y = gpu.zeros(8, F4), gpu.zeros(8, F4)
        with nothing_happens(sim, gpu), pytest.raises(KernelArgumentError, match=f"^saxpy: {pattern}"):
            SAXPY.launch(value, x, y, 8, grid=1, block=8)


@pytest.mark.parametrize(
    ("dtype", "value", "pattern"),
    [
        ("i4", 2**31, r"value 2147483648 is out of range for int32 \[-2147483648, 2147483647\]"),
        ("i4", -(2**31) - 1, r"value -2147483649 is out of range for int32 \[-2147483648, 2147483647\]"),
        ("u1", 256, r"value 256 is out of range for uint8 \[0, 255\]"),
        ("u1", -1, r"value -1 is out of range for uint8 \[0, 255\]"),
        ("i4", 3.5, r"expected a int32 scalar, got float \(3.5\)"),
        ("i4", 3.0, r"expected a int32 scalar, got float \(3.0\)"),
        ("u1", np.int64(3), r"expected a uint8 scalar, got int64"),
        ("i4", True, r"expected a int32 scalar, got bool"),
        ("i4", "3", r"expected a int32 scalar, got str"),
    ],
)
async def test_wrong_int_scalar(sim, dtype, value, pattern):
    k = kernel(InOut("f4"), Scalar(dtype, name="n"))
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(8, F4)
        label = re.escape(f"k: argument 1 (n: Scalar({np.dtype(dtype).str!r})): ")
        with nothing_happens(sim, gpu), pytest.raises(KernelArgumentError, match=f"^{label}{pattern}"):
            k.launch(y, value, grid=1, block=8)
        k.launch(y, np.iinfo(dtype).max, grid=1, block=8)  # the boundary itself is fine


async def test_structured_scalar_mismatch(sim):
    pair = np.dtype([("a", "f4"), ("b", "i4")])
    k = kernel(Scalar(pair))
    async with trio_cuda.open_scope(device=sim):
        with (
            nothing_happens(sim),
            pytest.raises(
                KernelArgumentError,
                match=r"argument 0 \(Scalar\(.*\)\): expected a NumPy structured scalar "
                r"of dtype .* or a tuple, got float",
            ),
        ):
            k.launch(1.0, grid=1, block=1)
        with (
            nothing_happens(sim),
            pytest.raises(
                KernelArgumentError,
                match=r"argument 0 \(Scalar\(.*\)\): expected a tuple matching .*, got "
                r"\(1.0,\)",
            ),
        ):
            k.launch((1.0,), grid=1, block=1)


@pytest.mark.parametrize(
    ("value", "given"),
    [
        (np.zeros(8, F4), "ndarray"),
        ([0.0] * 8, "list"),
        (None, "NoneType"),
        (3, "int"),
    ],
)
async def test_non_device_array_for_array_params(sim, value, given):
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(8, F4)
        with nothing_happens(sim, gpu):
            with pytest.raises(
                KernelArgumentError,
                match=rf"^saxpy: argument 1 \(In\('<f4'\)\): expected a trio_cuda DeviceArray, got {given}$",
            ):
                SAXPY.launch(F4(2), value, y, 8, grid=1, block=8)
            with pytest.raises(
                KernelArgumentError,
                match=rf"argument 2 \(InOut\('<f4'\)\): expected a trio_cuda DeviceArray, got {given}$",
            ):
                SAXPY.launch(F4(2), y, value, 8, grid=1, block=8)


async def test_read_only_array_for_written_params(sim):
    slice_k = kernel(Slice("f4"))
    read_slice_k = kernel(Slice("f4", access="read"))
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        ro = x.as_readonly()
        writes = "the kernel writes this argument, but the array is read-only"
        with nothing_happens(sim, gpu):
            with pytest.raises(KernelArgumentError, match=rf"saxpy: argument 2 \(InOut\('<f4'\)\): {writes}"):
                SAXPY.launch(F4(2), x, ro, 8, grid=1, block=8)
            with pytest.raises(KernelArgumentError, match=rf"copy_f4: argument 1 \(Out\('<f4'\)\): {writes}"):
                COPY.launch(x, ro, 8, grid=1, block=8)
            with pytest.raises(KernelArgumentError, match=rf"k: argument 0 \(Slice\('<f4'\)\): {writes}"):
                slice_k.launch(ro, grid=1, block=8)
            with pytest.raises(
                ValueError, match=r"^fill: arr: expected a writable array, got a read-only one"
            ):
                ops.fill(ro, 1.0)
            with pytest.raises(
                ValueError, match=r"^copy: dst: expected a writable array, got a read-only one"
            ):
                ops.copy(ro, np.zeros(8, F4))
            with pytest.raises(
                ValueError, match=r"copy: dst: expected a writable array, got a read-only one"
            ):
                ops.copy(ro, x)
            b = ADD.builder().grid(1).block(8)
            with pytest.raises(KernelArgumentError, match=r"^argument 0: write access to a read-only array"):
                b.arg(ro)  # ADD declares InOut for argument 0
            with pytest.raises(KernelArgumentError, match=r"^argument 0: write access to a read-only array"):
                kernel().builder().arg(ro, access="readwrite")
        # reading through it is fine
        await gpu.run(read_slice_k.launch(ro, grid=1, block=8))
        await gpu.run(SAXPY.launch(F4(2), ro, x, 8, grid=1, block=8))


async def test_closed_array(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x, y = gpu.zeros(8, F4), gpu.zeros(8, F4)
        y.close()
        with nothing_happens(sim, gpu):
            with pytest.raises(
                KernelArgumentError,
                match=r"^saxpy: argument 2 \(InOut\('<f4'\)\): the array "
                r"is "
                r"closed$",
            ):
                SAXPY.launch(F4(2), x, y, 8, grid=1, block=8)
            with pytest.raises(KernelArgumentError, match=r"^argument 0: the array is closed$"):
                ADD.builder().arg(y)
            with pytest.raises(ScopeClosedError, match=r"^fill: arr: the array is closed$"):
                ops.fill(y, 1.0)
            with pytest.raises(ScopeClosedError, match=r"^copy: src: the array is closed$"):
                ops.copy(np.zeros(8, F4), y)
            with pytest.raises(ScopeClosedError, match=r"^copy: dst: the array is closed$"):
                ops.copy(y, x)
            with pytest.raises(ScopeClosedError, match=r"^as_readonly: the array is closed$"):
                y.as_readonly()
            with pytest.raises(ScopeClosedError, match=r"the array is closed"):
                await gpu.to_host(y)


async def test_launch_built_before_close_is_refused_at_submission(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        op = add(x, 1.0)
        x.close()
        with nothing_happens(sim, gpu), pytest.raises(ScopeClosedError, match=r"add_f4: the array is closed"):
            gpu.submit(op)
    assert sim.live_allocations == []


async def test_array_of_another_scope(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = a.zeros(8, F4)
        op = add(x, 1.0)  # nothing in a launch ties it to a scope yet
        with nothing_happens(sim, a), nothing_happens(sim, b):
            with pytest.raises(
                KernelArgumentError,
                match=r"^add_f4: expected an array of this scope, got one of another scope \(<DeviceArray",
            ):
                b.submit(op)
            with pytest.raises(KernelArgumentError, match=r"^fill: expected an array of this scope"):
                b.submit(ops.fill(x, 1.0))
            with pytest.raises(KernelArgumentError, match=r"^copy: dst: expected an array of this scope"):
                b.submit(ops.copy(x, np.zeros(8, F4)))
            with pytest.raises(KernelArgumentError, match=r"expected an array of this scope"):
                await b.to_host(x)
        await a.run(op)  # in its own scope it is fine
        np.testing.assert_array_equal(await a.to_host(x), np.ones(8, F4))


async def test_array_of_an_exited_scope(sim):
    async with trio_cuda.open_scope(device=sim) as old:
        x = old.zeros(8, F4)
    assert x.closed
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(8, F4)
        with nothing_happens(sim, gpu):
            with pytest.raises(
                KernelArgumentError,
                match=r"^saxpy: argument 1 \(In\('<f4'\)\): the array is "
                r"closed$",
            ):
                SAXPY.launch(F4(2), x, y, 8, grid=1, block=8)
            with pytest.raises(ScopeClosedError, match=r"^copy: src: the array's scope has exited$"):
                ops.copy(y, x)
            with pytest.raises(ScopeClosedError, match=r"^as_readonly: the array's scope has exited$"):
                x.as_readonly()
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- launch geometry


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"grid": 0, "block": 8}, r"^grid: every dimension must be >= 1, got 0$"),
        ({"grid": -1, "block": 8}, r"^grid: every dimension must be >= 1, got -1$"),
        ({"grid": (2, 0), "block": 8}, r"^grid: every dimension must be >= 1, got \(2, 0\)$"),
        ({"grid": 1, "block": 0}, r"^block: every dimension must be >= 1, got 0$"),
        ({"grid": 1, "block": (8, -2, 1)}, r"^block: every dimension must be >= 1, got \(8, -2, 1\)$"),
        (
            {"grid": (1, 1, 1, 1), "block": 8},
            r"^grid: expected an int or a tuple of 1 to 3 ints, got \(1, 1, 1, 1\)$",
        ),
        (
            {"grid": 1, "block": (1, 1, 1, 1)},
            r"^block: expected an int or a tuple of 1 to 3 ints, got \(1, 1, 1, 1\)$",
        ),
        ({"grid": (), "block": 8}, r"^grid: expected an int or a tuple of 1 to 3 ints, got \(\)$"),
        ({"grid": 2.0, "block": 8}, r"^grid: expected an int or a tuple of 1 to 3 ints, got 2.0$"),
        ({"grid": "4", "block": 8}, r"^grid: expected an int or a tuple of 1 to 3 ints, got '4'$"),
        (
            {"grid": (2, 1.5), "block": 8},
            r"^grid: expected an int or a tuple of 1 to 3 ints, got \(2, 1.5\)$",
        ),
        ({"grid": 1, "block": None}, r"^block: expected an int or a tuple of 1 to 3 ints, got None$"),
        ({"grid": 1, "block": 8, "shared_mem": -1}, r"^shared_mem: expected a non-negative int, got -1$"),
        ({"grid": 1, "block": 8, "shared_mem": 1.5}, r"^shared_mem: expected a non-negative int, got 1.5$"),
        (
            {"grid": 6, "block": 8, "cluster": 4},
            r"^cluster: dimension 0 \(4\) must divide grid dimension 6; "
            r"got grid=\(6, 1, 1\), cluster=\(4, 1, 1\)$",
        ),
        (
            {"grid": (4, 3), "block": 8, "cluster": (2, 2)},
            r"^cluster: dimension 1 \(2\) must divide grid dimension 3",
        ),
        ({"grid": 4, "block": 8, "cluster": 0}, r"^cluster: every dimension must be >= 1, got 0$"),
        # limits no device lifts, and the most any supported device allows
        (
            {"grid": 1, "block": (32, 64)},
            r"^block: expected at most 1024 threads per block, got 2048 \(32 x 64 x 1\)$",
        ),
        (
            {"grid": 1, "block": 1025},
            r"^block: expected at most 1024 threads per block, got 1025 \(1025 x 1 x 1\)$",
        ),
        (
            {"grid": 1, "block": (1, 1, 128)},
            r"^block: expected at most 64 threads in dimension z, got 128 \(1 x 1 x 128\)$",
        ),
        (
            {"grid": (1, 65536), "block": 1},
            r"^grid: expected at most 65535 blocks in dimension y, got 65536 \(1 x 65536 x 1\)$",
        ),
        (
            {"grid": 1, "block": 8, "shared_mem": 300_000},
            r"^shared_mem: expected at most 232448 bytes of dynamic shared memory .*, got 300000$",
        ),
    ],
)
async def test_malformed_geometry_is_refused_by_launch(sim, kwargs, pattern):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        with nothing_happens(sim, gpu), pytest.raises(KernelArgumentError, match=pattern):
            ADD.launch(x, F4(1), 8, **kwargs)
        b = ADD.builder().arg(x).arg(F4(1)).arg(np.int32(8))
        b.grid(*(kwargs["grid"] if isinstance(kwargs["grid"], tuple) else (kwargs["grid"],)))
        b.block(*(kwargs["block"] if isinstance(kwargs["block"], tuple) else (kwargs["block"],)))
        if "shared_mem" in kwargs:
            b.shared_mem(kwargs["shared_mem"])
        if "cluster" in kwargs:
            c = kwargs["cluster"]
            b.cluster(*(c if isinstance(c, tuple) else (c,)))
        with nothing_happens(sim, gpu), pytest.raises(KernelArgumentError):
            b.finalize_unchecked()


@pytest.mark.parametrize(
    ("valid", "bad", "shown"),
    [
        ({"grid": 1, "block": 8}, {"grid": True, "block": 8}, "grid: .*got True"),
        ({"grid": 2, "block": 8}, {"grid": 2.0, "block": 8}, "grid: .*got 2.0"),
        ({"grid": 1, "block": 8}, {"grid": 1, "block": 8.0}, "block: .*got 8.0"),
        ({"grid": (2, 2), "block": 8}, {"grid": (2.0, 2), "block": 8}, r"grid: .*got \(2.0, 2\)"),
        (
            {"grid": 1, "block": 8, "shared_mem": 0},
            {"grid": 1, "block": 8, "shared_mem": False},
            "shared_mem: expected a non-negative int, got False",
        ),
    ],
)
async def test_geometry_types_are_checked_even_after_an_equal_valid_launch(sim, valid, bad, shown):
    # 1 == True == 1.0: a launch with valid geometry must not make an equal
    # but ill-typed one acceptable afterwards.
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        ADD.launch(x, F4(1), 8, **valid)
        with nothing_happens(sim, gpu), pytest.raises(KernelArgumentError, match=shown):
            ADD.launch(x, F4(1), 8, **bad)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"grid": 16, "block": 8, "cluster": 16},
            r"^add_f4: cluster: expected at most 8 blocks per cluster, got 16$",
        ),
        (
            {"grid": 100_000, "block": 1024, "cooperative": True},
            r"^add_f4: cooperative launch of 100000 blocks exceeds the co-resident limit \d+ \(132 SMs\)$",
        ),
    ],
)
async def test_geometry_beyond_the_device_is_refused_before_enqueue(sim, kwargs, pattern):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(8, F4)
        op = ADD.launch(x, F4(1), 8, **kwargs)  # device-independent checks pass
        with nothing_happens(sim, gpu):
            with pytest.raises(KernelArgumentError, match=pattern):
                gpu.submit(op)
            with pytest.raises(KernelArgumentError, match=pattern):
                await gpu.run(op, stream=gpu.streams[1])
            with pytest.raises(KernelArgumentError, match=pattern):
                gpu.submit(ops.value(1).then(lambda _: op))
            with pytest.raises(KernelArgumentError, match=pattern):
                unsafe.async_on(op, gpu.streams[0])
        x.close()
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- scopes, ops and helpers


async def test_closed_scope_refuses_everything(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        op = ops.value(1)
    assert gpu.closed
    with nothing_happens(sim):
        with pytest.raises(ScopeClosedError, match=r"^submit: the scope is closed$"):
            gpu.submit(op)
        with pytest.raises(ScopeClosedError, match=r"^run: the scope is closed$"):
            await gpu.run(op)
        with pytest.raises(ScopeClosedError, match=r"^empty: the scope is closed$"):
            gpu.empty(8, F4)
        with pytest.raises(ScopeClosedError, match=r"the scope is closed"):
            gpu.zeros(8, F4)
        with pytest.raises(ScopeClosedError, match=r"the scope is closed"):
            await gpu.to_device(np.zeros(8, F4))
        with pytest.raises(ScopeClosedError, match=r"^copy: src: the array's scope has exited$"):
            await gpu.to_host(x)
        with pytest.raises(ScopeClosedError, match=r"async_on: the scope is closed"):
            unsafe.async_on(op, gpu.streams[0])
        with pytest.raises(RuntimeError, match=r"no trio_cuda scope is open in this task"):
            await op
    assert sim.live_allocations == []


async def test_closed_scope_refuses_a_kernel_launch_through_async_on(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        op = add(x, 1.0)
        await gpu.run(op)
        stream = gpu.streams[0]
    with nothing_happens(sim), pytest.raises(ScopeClosedError, match=r"async_on: the scope is closed"):
        unsafe.async_on(op, stream)


async def test_unfinalized_builder_cannot_be_scheduled(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        b = ADD.builder().grid(1).block(8).arg(x).arg(F4(1)).arg(np.int32(8))
        assert not isinstance(b, trio_cuda.DeviceOp)
        with nothing_happens(sim, gpu):
            with pytest.raises(TypeError, match=r"^op: a LaunchBuilder is inert .*finalize_unchecked\(\)"):
                gpu.submit(b)
            with pytest.raises(TypeError, match=r"^op: a LaunchBuilder is inert .*finalize_unchecked\(\)"):
                await gpu.run(b)
            with pytest.raises(TypeError, match=r"finalize_unchecked"):
                unsafe.async_on(b, gpu.streams[0])
            with pytest.raises(
                TypeError, match=r"^then: the closure .* must return a DeviceOp, got LaunchBuilder"
            ):
                gpu.submit(ops.value(None).then(lambda _: b))
            with pytest.raises(TypeError):
                trio_cuda.zip(ops.value(1), b)
        await gpu.run(b.finalize_unchecked())
        np.testing.assert_array_equal(await gpu.to_host(x), np.ones(8, F4))


@pytest.mark.parametrize(("op", "given"), [(42, "int"), (None, "NoneType"), (np.zeros(3), "ndarray")])
async def test_non_device_op_is_refused(sim, op, given):
    async with trio_cuda.open_scope(device=sim) as gpu:
        with nothing_happens(sim, gpu):
            with pytest.raises(TypeError, match=rf"^op: expected a DeviceOp, got {given}$"):
                gpu.submit(op)
            with pytest.raises(TypeError, match=rf"^op: expected a DeviceOp, got {given}$"):
                await gpu.run(op)
            with pytest.raises(TypeError, match=rf"^op: expected a DeviceOp, got {given}$"):
                unsafe.async_on(op, gpu.streams[0])
            with pytest.raises(TypeError, match=rf"^zip: argument 1: expected a DeviceOp, got {given}$"):
                trio_cuda.zip(ops.value(1), op)
            with pytest.raises(TypeError, match=r"^then: expected a callable returning a DeviceOp, got"):
                ops.value(1).then(op)
            with pytest.raises(TypeError, match=r"^map: expected a callable, got"):
                ops.value(1).map(op)
            with pytest.raises(TypeError, match=r"^host_closure: fn: expected a callable, got"):
                ops.host_closure(op)


class _DoesNothing(trio_cuda.DeviceOp[None]):
    """A subclass that forgot to implement ``_enqueue``."""

    __slots__ = ()


_NO_WORK = (
    r"expected a DeviceOp that does work \(from Kernel.launch, .* or a subclass that implements _enqueue\)"
)


@pytest.mark.parametrize(
    ("make", "given"),
    [
        (trio_cuda.DeviceOp, r"a bare DeviceOp\(\)"),
        (_DoesNothing, r"_DoesNothing \(a DeviceOp subclass that does not implement _enqueue\)"),
    ],
)
async def test_op_that_does_no_work_is_refused_before_anything_is_enqueued(sim, make, given):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        await gpu.run(ops.value(None))
        with nothing_happens(sim, gpu):
            for submit in (
                gpu.submit,
                lambda op: unsafe.async_on(op, gpu.streams[0]),
            ):
                with pytest.raises(TypeError, match=rf"^op: {_NO_WORK}, got {given}$"):
                    submit(make())
            with pytest.raises(TypeError, match=rf"^op: {_NO_WORK}, got {given}$"):
                await gpu.run(make())
            with pytest.raises(TypeError, match=rf"^op: {_NO_WORK}, got {given}$"):
                await make()
            with pytest.raises(TypeError, match=rf"^op: {_NO_WORK}, got {given}$"):
                await gpu.capture(make())
            with pytest.raises(TypeError, match=rf"^zip: argument 1: {_NO_WORK}, got {given}$"):
                trio_cuda.zip(ops.fill(x, 1.0), make())
            for combinator in ("then", "map"):
                with pytest.raises(TypeError, match=rf"^{combinator}: self: {_NO_WORK}, got {given}$"):
                    getattr(make(), combinator)(lambda _: ops.value(None))
            with pytest.raises(TypeError, match=rf"^shared: self: {_NO_WORK}, got {given}$"):
                make().shared()
            with pytest.raises(
                TypeError, match=rf"^then: the closure .*: its result: {_NO_WORK}, got {given}$"
            ):
                gpu.submit(ops.value(None).then(lambda _: make()))
        np.testing.assert_array_equal(await gpu.to_host(x), np.zeros(8, F4))


async def test_unsafe_async_on_refuses_a_non_stream(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        with nothing_happens(sim, gpu):
            with pytest.raises(TypeError, match=r"^stream: expected a Stream, got int$"):
                unsafe.async_on(ops.fill(x, 1.0), 0)
            with pytest.raises(TypeError, match=r"^stream: expected a Stream, got int$"):
                unsafe.async_on(add(x, 1.0), 0)
            with pytest.raises(TypeError, match=r"host_closure cannot run through unsafe.async_on"):
                unsafe.async_on(ops.host_closure(print), gpu.streams[0])


@pytest.mark.parametrize(
    ("dst_shape", "dst_dtype", "src_shape", "src_dtype", "pattern"),
    [
        ((8,), "f4", (4,), "f4", r"^copy: expected dst and src of the same shape, got \(8,\) and \(4,\)$"),
        (
            (2, 4),
            "f4",
            (8,),
            "f4",
            r"^copy: expected dst and src of the same shape, got \(2, 4\) and "
            r"\(8,\)$",
        ),
        ((8,), "f4", (8,), "f8", r"^copy: expected dst and src of the same dtype, got float32 and float64$"),
        ((8,), "i4", (8,), "f4", r"^copy: expected dst and src of the same dtype, got int32 and float32$"),
    ],
)
async def test_copy_shape_and_dtype_mismatch(sim, dst_shape, dst_dtype, src_shape, src_dtype, pattern):
    async with trio_cuda.open_scope(device=sim) as gpu:
        d_dst, d_src = gpu.zeros(dst_shape, dst_dtype), gpu.zeros(src_shape, src_dtype)
        h_dst, h_src = np.zeros(dst_shape, dst_dtype), np.zeros(src_shape, src_dtype)
        with nothing_happens(sim, gpu):
            for dst, src in ((d_dst, d_src), (d_dst, h_src), (h_dst, d_src)):
                with pytest.raises(ValueError, match=pattern):
                    ops.copy(dst, src)
            with pytest.raises(ValueError, match=pattern):
                await gpu.to_host(d_src, out=h_dst)


async def test_copy_of_wrong_kinds(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        with nothing_happens(sim, gpu):
            with pytest.raises(TypeError, match=r"^copy: at least one of dst and src must be a DeviceArray$"):
                ops.copy(np.zeros(8, F4), np.zeros(8, F4))
            with pytest.raises(
                TypeError, match=r"^copy: src: expected a DeviceArray or a NumPy array, got list$"
            ):
                ops.copy(x, [0.0] * 8)
            with pytest.raises(
                TypeError, match=r"^copy: dst: expected a DeviceArray or a NumPy array, got int$"
            ):
                ops.copy(3, x)
            ro = np.zeros(8, F4)
            ro.setflags(write=False)
            with pytest.raises(
                ValueError, match=r"^copy: dst: expected a writable NumPy array, got a read-only one$"
            ):
                ops.copy(ro, x)


@pytest.mark.parametrize(
    ("dtype", "value", "error", "pattern"),
    [
        ("u1", 256, KernelArgumentError, r"^fill: x: value 256 is out of range for uint8 \[0, 255\]$"),
        ("i2", -40000, KernelArgumentError, r"^fill: x: value -40000 is out of range for int16"),
        ("i4", 1.5, KernelArgumentError, r"^fill: x: expected a int32 scalar, got float \(1.5\)$"),
        ("f4", 1e40, KernelArgumentError, r"^fill: x: value 1e\+40 overflows float32"),
        ("f8", "1", KernelArgumentError, r"^fill: x: expected a float64 scalar, got str"),
        ("f4", np.float64(1), KernelArgumentError, r"^fill: x: expected a float32 scalar, got float64"),
        (
            "c16",
            1.0,
            TypeError,
            r"^fill: arr: expected an element size of 1, 2, 4 or 8 bytes, got dtype complex128 \(16 bytes\)$",
        ),
        (
            [("a", "f4"), ("b", "f4")],
            (1.0, 2.0),
            TypeError,
            r"^fill: arr: expected a non-structured dtype, got the struct dtype ",
        ),
    ],
)
async def test_fill_with_a_bad_value(sim, dtype, value, error, pattern):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.empty(8, dtype)
        with nothing_happens(sim, gpu), pytest.raises(error, match=pattern):
            ops.fill(x, value)
        x.close()
    assert sim.live_allocations == []


@pytest.mark.parametrize(
    ("dtype", "value", "error", "pattern"),
    [
        ("u1", 256, KernelArgumentError, r"^fill: x: value 256 is out of range for uint8 \[0, 255\]$"),
        ("f4", 1e40, KernelArgumentError, r"^fill: x: value 1e\+40 overflows float32"),
        ("i4", "1", KernelArgumentError, r"^fill: x: expected a int32 scalar, got str"),
        ("c16", 1.0, TypeError, r"^fill: arr: expected an element size of 1, 2, 4 or 8 bytes"),
    ],
)
async def test_full_with_a_bad_value_allocates_nothing(sim, dtype, value, error, pattern):
    async with trio_cuda.open_scope(device=sim) as gpu:
        with nothing_happens(sim, gpu), pytest.raises(error, match=pattern):
            gpu.full(8, value, dtype)
    assert sim.live_allocations == []


async def test_fill_and_to_host_of_non_device_arrays(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        with nothing_happens(sim, gpu):
            with pytest.raises(TypeError, match=r"^fill: arr: expected a DeviceArray, got ndarray$"):
                ops.fill(np.zeros(8, F4), 1.0)
            with pytest.raises(TypeError, match=r"^to_host: arr: expected a DeviceArray, got ndarray$"):
                await gpu.to_host(np.zeros(8, F4))
            with pytest.raises(TypeError, match=r"^to_host: arr: expected a DeviceArray, got list$"):
                await gpu.to_host([1, 2])
            with pytest.raises(
                TypeError, match=r"^to_device: host: expected a NumPy array, got a DeviceArray$"
            ):
                await gpu.to_device(x)
            with pytest.raises(
                TypeError, match=r"^dtype: object dtypes cannot live on a device, got object$"
            ):
                await gpu.to_device(np.array([object()]))


@pytest.mark.parametrize(
    ("shape", "dtype", "error", "pattern"),
    [
        (-1, "f4", ValueError, r"^shape: expected non-negative ints, got -1$"),
        ((2, -3), "f4", ValueError, r"^shape: expected non-negative ints, got \(2, -3\)$"),
        (2.5, "f4", TypeError, r"^shape: expected an int or a tuple of ints, got 2.5$"),
        ((2, 1.5), "f4", ValueError, r"^shape: expected non-negative ints, got \(2, 1.5\)$"),
        (8, "nope", TypeError, r"dtype"),
        (8, object, TypeError, r"^dtype: object dtypes cannot live on a device, got object$"),
        (8, "V0", TypeError, r"^dtype: expected a dtype with a size, got \|V0$"),
    ],
)
async def test_bad_shapes_and_dtypes_allocate_nothing(sim, shape, dtype, error, pattern):
    async with trio_cuda.open_scope(device=sim) as gpu:
        with nothing_happens(sim, gpu):
            with pytest.raises(error, match=pattern):
                gpu.empty(shape, dtype)
            with pytest.raises(error, match=pattern):
                gpu.zeros(shape, dtype)


_DIM = r"^shape: expected dimensions of at most 2\*\*63 - 1 \(int64\), got "
_SPAN = (
    r"^shape: expected an array of at most 2\*\*63 - 1 bytes "
    r"\(every dimension counted at least once, as NumPy does\), got shape "
)


@pytest.mark.parametrize(
    ("shape", "dtype", "pattern"),
    [
        ((0, 2**63), "f4", _DIM + r"\(0, 9223372036854775808\)$"),
        ((2**64 + 5, 0), "u1", _DIM + r"\(18446744073709551621, 0\)$"),
        ((0, 2**62, 2**62), "u1", _SPAN + r"\(0, 4611686018427387904, 4611686018427387904\) of uint8"),
        ((0, 2**61), "f4", _SPAN + r"\(0, 2305843009213693952\) of float32 \(9223372036854775808 bytes\)$"),
        ((2**62, 4), "f4", _SPAN + r"\(4611686018427387904, 4\) of float32"),
        ((0, 2**62), ("f4", (2,)), _SPAN + r"\(0, 4611686018427387904, 2\) of float32"),
    ],
)
async def test_shapes_beyond_int64_are_refused_everywhere_a_shape_enters(sim, shape, dtype, pattern):
    """Every dimension, and the bytes the array spans (zero-size arrays too),
    must fit int64: DLPack and the CUDA Array Interface carry them so."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        empty = gpu.zeros(0, np.dtype(dtype).base)
        like = gpu.zeros(1, np.uint8)
        with nothing_happens(sim, gpu):
            for make in (
                lambda: gpu.empty(shape, dtype),
                lambda: gpu.zeros(shape, dtype),
                lambda: gpu.full(shape, 0, dtype),
                lambda: gpu.empty_like(like, dtype=dtype, shape=shape),
            ):
                with pytest.raises(ValueError, match=pattern):
                    make()
            if 0 in shape and np.dtype(dtype).shape == ():  # a view of a zero-size array
                with pytest.raises(ValueError, match=pattern):
                    empty.reshape(shape)
                with pytest.raises(ValueError, match=pattern):
                    empty.reshape(*shape)


async def test_the_largest_shapes_are_accepted_and_export_exactly(sim):
    """At the bound itself: a zero-size array whose span is 2**63 - 1 bytes
    is an array like any other, and DLPack carries its shape and strides
    as they are (not wrapped negative)."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = gpu.zeros((0, 2**63 - 1), np.uint8)
        assert (a.shape, a.nbytes) == ((0, 2**63 - 1), 0)
        assert a.reshape(2**63 - 1, 0).shape == (2**63 - 1, 0)
        tensor = _dlpack.ImportedTensor(a.__dlpack__(max_version=(1, 0), dl_device=a.__dlpack_device__()))
        try:
            assert tensor.shape == (0, 2**63 - 1)
            assert tensor.strides == (2**63 - 1, 1)  # in elements
        finally:
            tensor.close()
        a.close()


def test_dlpack_export_refuses_values_that_do_not_fit_int64() -> None:
    released: list[int] = []
    for shape, strides, label in [
        ((2**63,), (1,), "shape"),
        ((-1,), (1,), "shape"),
        ((2,), (2**63,), "strides"),
        ((2,), (-(2**63) - 1,), "strides"),
    ]:
        with pytest.raises(ValueError, match=rf"^DLPack export: {label}: expected values that fit int64"):
            _dlpack.make_capsule(
                ptr=0,
                shape=shape,
                strides=strides,
                dtype=(2, 32),
                device=(1, 0),
                versioned=True,
                read_only=False,
                release=lambda: released.append(1),
            )
    assert released == []  # nothing was made that would need releasing


# --------------------------------------------------------------------------- open_scope, streams, kernels


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"streams": 0}, ValueError, r"^streams: expected an int >= 1, got 0$"),
        ({"streams": -2}, ValueError, r"^streams: expected an int >= 1, got -2$"),
        ({"streams": 2.0}, ValueError, r"^streams: expected an int >= 1, got 2.0$"),
        ({"streams": "4"}, ValueError, r"^streams: expected an int >= 1, got '4'$"),
        ({"streams": True}, ValueError, r"^streams: expected an int >= 1, got True$"),
        ({"conflicts": "maybe"}, ValueError, r"^conflicts: expected 'order' or 'error', got 'maybe'$"),
        ({"conflicts": None}, ValueError, r"^conflicts: expected 'order' or 'error', got None$"),
        ({"drain_timeout": -1}, ValueError, r"^drain_timeout: expected None or a number >= 0, got -1$"),
        ({"drain_timeout": "1"}, ValueError, r"^drain_timeout: expected None or a number >= 0, got '1'$"),
        ({"drain_timeout": True}, ValueError, r"^drain_timeout: expected None or a number >= 0, got True$"),
        (
            {"policy": object()},
            TypeError,
            r"^policy: expected a SchedulingPolicy \(with a choose\(\) "
            r"method\), got",
        ),
    ],
)
def test_open_scope_checks_its_arguments_at_once(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        trio_cuda.open_scope(device="sim", **kwargs)


@pytest.mark.parametrize(
    ("device", "error", "pattern"),
    [
        (42, TypeError, r"^device: expected 'auto', 'sim', 'cuda', 'cuda:N' or a SimDevice, got int$"),
        (None, TypeError, r"^device: expected 'auto', 'sim', 'cuda', 'cuda:N' or a SimDevice, got NoneType$"),
        ("gpu", ValueError, r"^device: expected 'auto', 'sim', 'cuda' or 'cuda:N', got 'gpu'$"),
        ("cuda:x", ValueError, r"^device: expected 'auto', 'sim', 'cuda' or 'cuda:N', got 'cuda:x'$"),
        ("SIM", ValueError, r"^device: expected 'auto', 'sim', 'cuda' or 'cuda:N', got 'SIM'$"),
    ],
)
async def test_open_scope_bad_device(device, error, pattern):
    with pytest.raises(error, match=pattern):
        async with trio_cuda.open_scope(device=device):
            pytest.fail("the scope must not open")  # pragma: no cover
    with pytest.raises(RuntimeError, match="no trio_cuda scope is open"):
        trio_cuda.current_scope()


async def test_stream_of_another_scope(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = b.zeros(8, F4)
        foreign = a.streams[1]
        pattern = r"^stream: expected a stream of this scope, got <Stream 1 of sim:0> of another scope$"
        with nothing_happens(sim, a), nothing_happens(sim, b):
            with pytest.raises(ValueError, match=pattern):
                b.submit(ops.value(1), stream=foreign)
            with pytest.raises(ValueError, match=pattern):
                await b.run(add(x, 1.0), stream=foreign)
            with pytest.raises(ValueError, match=pattern):
                b.empty(8, F4, stream=foreign)
            with pytest.raises(ValueError, match=pattern):
                b.zeros(8, F4, stream=foreign)
            with pytest.raises(ValueError, match=pattern):
                await b.to_device(np.zeros(8, F4), stream=foreign)
            with pytest.raises(ValueError, match=pattern):
                await b.to_host(x, stream=foreign)
            with pytest.raises(TypeError, match=r"^stream: expected a Stream of this scope, got int$"):
                b.submit(ops.value(1), stream=1)
            with pytest.raises(TypeError, match=r"^stream: expected a Stream of this scope, got str$"):
                b.empty(8, F4, stream="0")
        with pytest.raises(TypeError, match="no public constructor"):
            trio_cuda.Stream()


@pytest.mark.parametrize(
    ("params", "error", "pattern"),
    [
        ([42], TypeError, r"^params\[0\]: expected Scalar, In, Out, InOut or Slice, got 42$"),
        (
            [Scalar("f4"), "f4"],
            TypeError,
            r"^params\[1\]: expected Scalar, In, Out, InOut or Slice, got "
            r"'f4'$",
        ),
        ([In("f4"), np.float32], TypeError, r"^params\[1\]: expected Scalar, In, Out, InOut or Slice, got"),
        ([None], TypeError, r"^params\[0\]: expected Scalar, In, Out, InOut or Slice, got None$"),
    ],
)
def test_kernel_with_a_bad_parameter_list(params, error, pattern):
    with pytest.raises(error, match=pattern):
        trio_cuda.Kernel.from_source("// k", "k", params=params)


def test_kernel_and_parameter_constructors_check_their_arguments():
    with pytest.raises(TypeError, match=r"^source: expected str, got bytes$"):
        trio_cuda.Kernel.from_source(b"// k", "k", params=[])
    with pytest.raises(TypeError, match=r"^name: expected a non-empty str, got ''$"):
        trio_cuda.Kernel.from_source("// k", "", params=[])
    with pytest.raises(TypeError, match=r"^name: expected a non-empty str, got None$"):
        trio_cuda.Kernel.from_source("// k", None, params=[])
    with pytest.raises(TypeError, match=r"^dtype: expected a NumPy dtype or dtype string, got 'float33'$"):
        Scalar("float33")
    with pytest.raises(TypeError, match=r"^dtype: expected a NumPy dtype or dtype string, got 3.5$"):
        In(3.5)
    with pytest.raises(ValueError, match=r"^access: expected 'read', 'write' or 'readwrite', got 'rw'$"):
        Slice("f4", access="rw")
    for cls in (In, Out, InOut):
        with pytest.raises(TypeError):
            cls("f4", access="read")  # the access mode is the class


@pytest.mark.parametrize("cls", [In, Out, InOut, Slice])
@pytest.mark.parametrize(
    ("dtype", "element", "dims"),
    [
        (("f4", (2,)), "float32", "2"),
        (("i8", (2, 3)), "int64", "2, 3"),
        ((("f4", (2,)), (3,)), "float32", "3, 2"),  # nested: outer dimensions first, as NumPy's shape
        (np.dtype((np.uint8, 4)), "uint8", "4"),
    ],
)
def test_array_parameters_refuse_a_sub_array_dtype_when_declared(cls, dtype, element, dims):
    # an array's dtype is never a sub-array dtype: one declared here could never
    # match (a launch would fail with "expected dtype void64"), so it is refused now
    given = re.escape(str(np.dtype(dtype)))
    with pytest.raises(
        TypeError,
        match=rf"^dtype: expected the element dtype of the array \(a sub-array dtype's dimensions belong "
        rf"to the array's shape, as in NumPy\), got {given}; declare '{element}' and pass an array of "
        rf"shape \(\.\.\., {dims}\) of {element}$",
    ):
        cls(dtype)
    with pytest.raises(TypeError, match=r"^dtype: expected a numeric, bool, complex .*fixed-size array"):
        Scalar(dtype)  # a by-value parameter refuses it too


@pytest.mark.parametrize("cls", [In, Out, InOut, Slice])
def test_array_parameters_refuse_dtypes_no_array_has(cls):
    with pytest.raises(TypeError, match=r"^dtype: object dtypes cannot live on a device, got object$"):
        cls("O")
    with pytest.raises(TypeError, match=r"^dtype: expected a dtype with a size, got \|V0$"):
        cls("V0")


async def test_the_suggested_declaration_of_a_sub_array_parameter_launches(sim):
    k = kernel(InOut("f4"), name="k")
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(8, ("f4", (2,)))  # (8, 2) of float32, as in NumPy
        assert (y.shape, y.dtype) == ((8, 2), np.dtype(F4))
        await gpu.run(k.launch(y, grid=1, block=8))


async def test_wrong_array_dtype_of_the_same_name_names_both_dtypes(sim):
    # structured dtypes of one size, and byte orders, share a name ("void8",
    # "float32"): the message shows the dtypes themselves then
    pair = np.dtype([("a", "f4"), ("b", "i4")])
    other = np.dtype([("x", "i4"), ("y", "f4")])
    k = kernel(In(pair), name="k")
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, other)
        with (
            nothing_happens(sim, gpu),
            pytest.raises(
                KernelArgumentError,
                match=rf"^k: argument 0 \(In\('\|V8'\)\): expected dtype {re.escape(str(pair))}, "
                rf"got {re.escape(str(other))}$",
            ),
        ):
            k.launch(x, grid=1, block=8)


async def test_builder_argument_errors(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        b = ADD.builder()
        with nothing_happens(sim, gpu):
            with pytest.raises(
                KernelArgumentError,
                match=r"^argument 0: expected a DeviceArray or a NumPy "
                r"scalar "
                r"\(use arg_boxed for raw bytes\), got float$",
            ):
                b.arg(1.0)
            with pytest.raises(
                KernelArgumentError,
                match=r"^argument 0: expected a DeviceArray or a NumPy "
                r"scalar "
                r".*got ndarray$",
            ):
                b.arg(np.zeros(8, F4))
            with pytest.raises(KernelArgumentError, match=r"^argument 0: raw bytes must not be empty$"):
                b.arg_boxed(b"", align=4)
            for align in (0, 3, -4, 12):
                with pytest.raises(
                    KernelArgumentError, match=rf"^argument 0: align must be a power of two, got {align}$"
                ):
                    b.arg_boxed(b"abcd", align=align)
            with pytest.raises(
                ValueError, match=r"^access: expected 'read', 'write' or 'readwrite', got 'all'$"
            ):
                b.arg(x, access="all")
        assert repr(b) == "<LaunchBuilder add_f4 (0 args, not finalized)>"  # nothing was appended


async def test_inject_fault_checks_its_arguments():
    sim = SimDevice()
    with pytest.raises(
        ValueError,
        match=r"^kind: expected one of 'launch_error', 'out_of_memory', 'kernel_fault', "
        r"'completion_unknown', got 'meltdown'$",
    ):
        sim.inject_fault("meltdown")
    with pytest.raises(ValueError, match=r"^kind: expected one of .*, got None$"):
        sim.inject_fault(None)
    for count in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match=rf"^count: expected a positive int, got {count!r}$"):
            sim.inject_fault("launch_error", count=count)
    # none of these armed a fault: a launch goes through
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        await gpu.run(add(x, 1.0))
        np.testing.assert_array_equal(await gpu.to_host(x), np.ones(8, F4))
    assert sim.violations == []


async def test_out_of_memory_leaks_nothing():
    small = SimDevice(memory=1024)
    async with trio_cuda.open_scope(device=small) as gpu:
        x = gpu.zeros(128, F4)  # 512 bytes
        with nothing_happens(small, gpu):
            with pytest.raises(
                trio_cuda.OutOfMemoryError, match=r"cannot allocate 1024 bytes; 512 of 1024 bytes"
            ):
                gpu.empty(256, F4)
            with pytest.raises(trio_cuda.OutOfMemoryError, match=r"cannot allocate 1024 bytes"):
                await gpu.to_device(np.zeros(256, F4))
            with pytest.raises(trio_cuda.OutOfMemoryError, match=r"cannot allocate 1024 bytes"):
                gpu.full(256, 1.0, F4)
        x.close()
        await trio.testing.wait_all_tasks_blocked()
        y = gpu.zeros(256, F4)  # the memory came back
        assert y.nbytes == 1024
    assert small.live_allocations == []
    assert small.violations == []
