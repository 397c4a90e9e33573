"""Device arrays on the simulator: layouts, dtypes, views, transfers, read-only handles, GC."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import held
from tests.helpers.kernels import stub_source
from trio_cuda import AccessConflictError, KernelArgumentError, ops
from trio_cuda._core import _array

F4 = np.float32
ROOT = Path(__file__).resolve().parents[2]
POINT = np.dtype([("x", "<f4"), ("id", "<i8"), ("tag", "S3")])  # packed: 15 bytes


def live(sim) -> set[int]:
    return {a.ptr for a in sim.live_allocations}


# --------------------------------------------------------------------------- layouts and dtypes


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 7, 1), (0, 3)])
async def test_round_trip_keeps_shape_and_order(sim, order, shape):
    host = np.asarray(np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape), order=order)
    async with trio_cuda.open_scope(device=sim) as gpu:
        d = await gpu.to_device(host)
        assert d.shape == shape
        assert d.strides == host.strides or d.size <= 1
        assert d.c_contiguous == host.flags.c_contiguous
        assert d.f_contiguous == host.flags.f_contiguous
        back = await gpu.to_host(d)
        np.testing.assert_array_equal(back, host)
        assert back.flags.f_contiguous == host.flags.f_contiguous
        d.close()


async def test_to_device_order_argument_converts_the_layout(sim):
    host = np.arange(12, dtype=F4).reshape(3, 4)
    async with trio_cuda.open_scope(device=sim) as gpu:
        f = await gpu.to_device(host, order="F")
        assert f.order == "F"
        assert f.strides == (4, 12)
        # the device bytes are column-major
        assert np.frombuffer(sim.peek(f.ptr, f.nbytes), F4).tolist() == host.ravel(order="F").tolist()
        np.testing.assert_array_equal(await gpu.to_host(f), host)


async def test_structured_dtypes_round_trip_and_zero(sim):
    host = np.zeros(4, POINT)
    host["x"] = [0.5, 1.5, 2.5, 3.5]
    host["id"] = [10, 20, 30, 40]
    host["tag"] = [b"a", b"bb", b"ccc", b""]
    async with trio_cuda.open_scope(device=sim) as gpu:
        d = await gpu.to_device(host)
        assert d.dtype == POINT
        np.testing.assert_array_equal(await gpu.to_host(d), host)
        z = gpu.zeros((2, 3), POINT, order="F")
        zb = await gpu.to_host(z)
        assert (zb.dtype, zb.shape) == (POINT, (2, 3))
        assert zb.tobytes() == bytes(POINT.itemsize * 6)
        # a struct cannot be filled with a scalar: that stays an error
        with pytest.raises(TypeError, match="struct dtype"):
            gpu.full(3, 1, POINT)


async def test_empty_like(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = gpu.empty((3, 5), np.int16, order="F")
        b = gpu.empty_like(a)
        assert (b.shape, b.dtype, b.order) == ((3, 5), np.dtype(np.int16), "F")
        c = gpu.empty_like(np.zeros((2, 2), F4, order="F"), np.float64)
        assert (c.shape, c.dtype, c.order) == ((2, 2), np.dtype(np.float64), "F")
        d = gpu.empty_like(a, order="C", shape=(7,))
        assert (d.shape, d.dtype, d.order) == ((7,), np.dtype(np.int16), "C")
        with pytest.raises(
            TypeError, match=r"^empty_like: a: expected an array \(with shape and dtype\), got int$"
        ):
            gpu.empty_like(3)
        with pytest.raises(ValueError, match=r"^empty_like: order: expected 'C', 'F' or 'K', got 'X'$"):
            gpu.empty_like(a, order="X")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^order: expected 'C' or 'F', got 'K'$"):
            gpu.empty(3, order="K")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^to_device: order: expected 'C', 'F' or 'K', got 'X'$"):
            await gpu.to_device(np.ones(3), order="X")  # type: ignore[arg-type]


SUB_ARRAY_DTYPES = [
    np.dtype(("f4", (2,))),
    np.dtype((("i2", (2,)), (4,))),  # nested: outer dimensions first
    np.dtype((POINT, (3,))),
]


def _layout_of(a: np.ndarray) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...]]:
    return a.shape, a.dtype, a.strides


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", SUB_ARRAY_DTYPES, ids=str)
async def test_sub_array_dtypes_fold_into_the_shape_as_in_numpy(sim, dtype, order):
    """A sub-array dtype's shape joins the array's, as NumPy's allocators do:
    every allocating entry point gives NumPy's shape, element dtype and layout,
    and the bytes round-trip."""
    want = np.zeros((3,), dtype, order=order)
    assert want.dtype.subdtype is None  # (what NumPy does)
    async with trio_cuda.open_scope(device=sim) as gpu:
        made = [
            gpu.empty(3, dtype, order=order),
            gpu.zeros(3, dtype, order=order),
            gpu.empty_like(np.zeros(3, F4), dtype=dtype, order=order),
            gpu.empty_like(gpu.zeros(3, F4), dtype=dtype, order=order),
        ]
        for arr in made:
            assert (arr.shape, arr.dtype, arr.strides) == _layout_of(want), arr
            assert arr.nbytes == want.nbytes
        np.testing.assert_array_equal(await gpu.to_host(made[1]), want)
        if dtype.base.fields is None:
            full = gpu.full(3, 2, dtype, order=order)
            np.testing.assert_array_equal(await gpu.to_host(full), np.full(3, 2, dtype, order=order))


async def test_a_view_as_a_sub_array_dtype_adds_trailing_dimensions(sim):
    sub = np.dtype(("f4", (2,)))
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros((3, 4), np.float64)
        v = x.view(sub)
        host = np.zeros((3, 4), np.float64)
        assert (v.shape, v.dtype, v.strides) == _layout_of(host.view(sub))
        assert v.ptr == x.ptr
        await gpu.run(ops.fill(v, 1.5))
        np.testing.assert_array_equal(
            await gpu.to_host(x), np.full((3, 4, 2), 1.5, F4).view(np.float64)[..., 0]
        )
        with pytest.raises(
            ValueError,
            match=r"^dtype: expected a dtype of 8 bytes \(as float64\), got \('<f4', \(3,\)\) \(12 bytes\)$",
        ):
            x.view(("f4", (3,)))
        f = gpu.zeros((3, 4), np.float64, order="F")
        with pytest.raises(
            ValueError, match=r"^dtype: a sub-array dtype adds trailing dimensions \(2,\), which an F-order"
        ):
            f.view(sub)
        assert f.T.view(sub).shape == (4, 3, 2)  # C order: fine


# --------------------------------------------------------------------------- views


async def test_views_share_memory_and_see_writes(sim):
    host = np.arange(24, dtype=F4).reshape(4, 6)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host)
        row = x[2]
        assert (row.shape, row.ptr) == ((6,), x.ptr + 2 * 6 * 4)
        block = x[1:3]
        np.testing.assert_array_equal(await gpu.to_host(block), host[1:3])
        np.testing.assert_array_equal(await gpu.to_host(x[-1, 2:5]), host[-1, 2:5])
        np.testing.assert_array_equal(await gpu.to_host(x[None, 1]), host[None, 1])
        np.testing.assert_array_equal(await gpu.to_host(x.reshape(6, 4)), host.reshape(6, 4))
        np.testing.assert_array_equal(await gpu.to_host(x.ravel()), host.ravel())
        np.testing.assert_array_equal(await gpu.to_host(x.T), host.T)
        assert x.T.order == "F"
        np.testing.assert_array_equal(await gpu.to_host(x.T[:, 1:3]), host.T[:, 1:3])  # F: a slice of columns
        np.testing.assert_array_equal(await gpu.to_host(x.view(np.int32)), host.view(np.int32))
        # a write through a view is visible through the parent
        await gpu.run(ops.fill(row, -1.0))
        expect = host.copy()
        expect[2] = -1
        np.testing.assert_array_equal(await gpu.to_host(x), expect)
        # closing the parent keeps the memory for the views
        x.close()
        assert len(sim.live_allocations) == 1
        np.testing.assert_array_equal(await gpu.to_host(block), expect[1:3])
        block.close()
        row.close()
        assert sim.live_allocations == []


async def test_non_contiguous_and_fancy_views_are_refused(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros((4, 6), F4)
        before = internals.allocation_of(x).handles
        with pytest.raises(ValueError, match=r"^index: expected a contiguous view, got strides \(24, 4\)"):
            x[:, 1:3]
        with pytest.raises(ValueError, match=r"^index: expected a contiguous view"):
            x[0, ::2]
        with pytest.raises(TypeError, match=r"^index: expected ints, slices, None or Ellipsis .* got list"):
            x[[0, 1]]
        with pytest.raises(TypeError, match=r"got bool"):
            x[True]
        with pytest.raises(IndexError, match=r"^index: index 4 is out of bounds"):
            x[4]
        with pytest.raises(ValueError, match=r"^reshape: order='F' needs an F-contiguous array"):
            x.reshape(6, 4, order="F")
        with pytest.raises(ValueError, match=r"^shape: cannot reshape an array of size 24 into \(5, -1\)"):
            x.reshape(5, -1)
        with pytest.raises(ValueError, match=r"^dtype: expected a dtype of 4 bytes"):
            x.view(np.float64)
        assert internals.allocation_of(x).handles == before  # nothing was created


async def test_a_views_lease_covers_its_bytes_only(sim):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(np.zeros(8, F4))
        tail = x[4:]
        sim.hold()
        head_fill = gpu.submit(ops.fill(x[:4], 1.0), stream=s0)  # writes the head only
        # the tail is disjoint from the head: no conflict, on any stream
        tail_read = gpu.submit(ops.copy(np.zeros(4, F4), tail), stream=s1)
        # the parent overlaps the head: read-after-write, refused
        with pytest.raises(AccessConflictError, match="read-after-write"):
            gpu.submit(ops.copy(np.zeros(8, F4), x), stream=s1)
        # so does a view that straddles the boundary by one element
        with pytest.raises(AccessConflictError, match=r"bytes \[0, 16\)"):
            gpu.submit(ops.copy(np.zeros(2, F4), x[3:5]), stream=s1)
        sim.release()
        await head_fill.wait()
        await tail_read.wait()
        # reads through a read-only view on two streams never conflict
        ro = tail.as_readonly()
        sim.hold()
        f0 = gpu.submit(ops.copy(np.zeros(4, F4), ro), stream=s0)
        f1 = gpu.submit(ops.copy(np.zeros(4, F4), tail), stream=s1)
        sim.release()
        await f0.wait()
        await f1.wait()
    assert sim.violations == []


async def test_view_write_on_another_stream_is_ordered_after_the_parent_read(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        s0, s1 = gpu.streams
        x = await gpu.to_device(np.arange(8, dtype=F4))
        out = np.zeros(8, F4)
        sim.clear_trace()
        with held(sim):  # the read is in flight when the write is submitted
            read = gpu.submit(ops.copy(out, x), stream=s0)
            write = gpu.submit(ops.fill(x[2:4], 9.0), stream=s1)  # WAR: waits device-side
            assert not read.done()
        await write.wait()
        assert any(e.kind == "wait_marker" for e in sim.trace if e.stream == 1)
        await read.wait()
        np.testing.assert_array_equal(out, np.arange(8, dtype=F4))
        np.testing.assert_array_equal(await gpu.to_host(x), [0, 1, 9, 9, 4, 5, 6, 7])


# --------------------------------------------------------------------------- transfers


async def test_to_host_into_given_arrays_of_any_layout(sim):
    host = np.arange(12, dtype=np.int64).reshape(3, 4)
    async with trio_cuda.open_scope(device=sim) as gpu:
        for d in (await gpu.to_device(host), await gpu.to_device(host, order="F")):
            for out in (
                np.zeros((3, 4), np.int64),
                np.zeros((3, 4), np.int64, order="F"),
                np.zeros((3, 8), np.int64)[:, ::2],
            ):
                got = await gpu.to_host(d, out=out)
                assert got is out
                np.testing.assert_array_equal(out, host)


async def test_copy_device_to_device_and_host_both_ways(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        a = await gpu.to_device(np.arange(10, dtype=F4))
        b = gpu.zeros(10, F4)
        assert await gpu.run(ops.copy(b, a)) is b
        await gpu.run(ops.copy(b[:5], a[5:]))  # views of two allocations
        await gpu.run(ops.copy(a[:3], a[7:]))  # disjoint views of one allocation
        np.testing.assert_array_equal(await gpu.to_host(b), [5, 6, 7, 8, 9, 5, 6, 7, 8, 9])
        np.testing.assert_array_equal(await gpu.to_host(a), [7, 8, 9, 3, 4, 5, 6, 7, 8, 9])
        await gpu.run(ops.copy(b, np.full(10, 3, F4)[::-1]))  # a non-contiguous host source
        np.testing.assert_array_equal(await gpu.to_host(b), np.full(10, 3, F4))
        with pytest.raises(ValueError, match=r"^copy: dst and src overlap"):
            ops.copy(a[:5], a[3:8])
        m = gpu.zeros((2, 3), F4)
        with pytest.raises(
            ValueError, match=r"^copy: expected dst and src in the same memory order, got dst order C"
        ):
            ops.copy(m, gpu.zeros((2, 3), F4, order="F"))


async def test_to_host_of_a_closed_array_fails_and_leaks_nothing(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.zeros(4, F4))
        x.close()
        with pytest.raises(trio_cuda.ScopeClosedError, match="the array is closed"):
            await gpu.to_host(x)
        assert sim.live_allocations == []


# --------------------------------------------------------------------------- read-only and writable


async def test_writing_through_a_read_only_handle_is_refused(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(8, F4)
        ro = x.as_readonly()
        assert ro.readonly
        assert ro.ptr == x.ptr
        submitted = gpu.statistics().submitted
        with pytest.raises(ValueError, match=r"^fill: arr: expected a writable array, got a read-only one"):
            ops.fill(ro, 1.0)
        with pytest.raises(ValueError, match=r"^copy: dst: expected a writable array"):
            ops.copy(ro, np.zeros(8, F4))
        k = trio_cuda.Kernel.from_source(stub_source("k"), "k", params=[trio_cuda.Out("f4")])
        with pytest.raises(KernelArgumentError, match="read-only"):
            k.launch(ro, grid=1, block=1)
        assert gpu.statistics().submitted == submitted  # nothing was enqueued
        assert ro[2:].readonly


async def test_as_writable_only_for_the_last_handle(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        assert x.as_writable() is x
        ro = x.as_readonly()
        with pytest.raises(ValueError, match=r"^as_writable: expected the only open handle .* got 1 other"):
            ro.as_writable()
        v = ro[1:]
        x.close()
        with pytest.raises(ValueError, match=r"got 1 other open handle\(s\)"):
            ro.as_writable()
        v.close()
        w = ro.as_writable()
        assert ro.closed
        assert not w.readonly
        assert w.ptr == ro.ptr
        await gpu.run(ops.fill(w, 2.0))
        np.testing.assert_array_equal(await gpu.to_host(w), np.full(4, 2, F4))


# --------------------------------------------------------------------------- garbage collection


async def test_gc_of_arrays_with_work_in_flight_never_frees_early(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.arange(4, dtype=F4))
        view = x[1:]
        out = np.zeros(3, F4)
        sim.hold()
        fut = gpu.submit(ops.copy(out, view))
        ptr = x.ptr
        del x, view
        gc.collect()
        await trio.lowlevel.checkpoint()  # the handoff task processes the GC releases
        assert ptr in live(sim)
        sim.release()
        await fut.wait()
        np.testing.assert_array_equal(out, [1, 2, 3])
        await trio.testing.wait_all_tasks_blocked()
        assert ptr not in live(sim)


async def test_unclosed_array_warning_names_where_it_was_created(sim, monkeypatch, caplog):
    monkeypatch.setattr(_array, "TRACK_UNCLOSED", True)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.zeros(3, F4))
        line = sys._getframe().f_lineno - 1  # where x was created
        closed = await gpu.to_device(np.zeros(3, F4))
        closed.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del x, closed
            gc.collect()
        messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert len(messages) == 1, messages
        assert (
            f"test_arrays.py:{line} in test_unclosed_array_warning_names_where_it_was_created" in messages[0]
        )
        assert messages[0].startswith("unclosed DeviceArray shape=(3,) dtype=float32, created at ")
        # and it is logged (logger "trio_cuda"), where warnings may be hidden
        logged = [
            r.getMessage() for r in caplog.records if r.name == "trio_cuda" and "unclosed" in r.getMessage()
        ]
        assert len(logged) == 1
        assert "test_unclosed_array_warning_names_where_it_was_created" in logged[0]


def test_unclosed_array_warning_under_minus_w_error():
    script = textwrap.dedent(
        """
        import gc, trio, trio_cuda

        async def main():
            async with trio_cuda.open_scope(device="sim") as gpu:
                leaked = gpu.zeros(5)
                del leaked
                gc.collect()
                kept = gpu.zeros(5)
                kept.close()
                del kept
                gc.collect()

        trio.run(main)
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-W", "error::ResourceWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ResourceWarning: unclosed DeviceArray shape=(5,)") == 1, proc.stderr
    assert "created at <string>:6 in main" in proc.stderr, proc.stderr


@pytest.mark.parametrize("order", ["C", "F"])
async def test_a_reference_sees_an_array_in_its_own_memory_order(sim, order):
    seen = []

    def transpose_ref(x, y):  # as the kernel sees it: the same memory, the same layout
        seen.append((x.flags.c_contiguous, x.flags.f_contiguous))
        y[...] = x.T

    k = trio_cuda.Kernel.from_source(
        stub_source("t"), "t", params=[trio_cuda.In("f4"), trio_cuda.Out("f4")], reference=transpose_ref
    )
    host = np.asarray(np.arange(12, dtype=F4).reshape(3, 4), order=order)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host)
        assert x.order == order
        y = gpu.empty((4, 3), F4)
        await gpu.run(k.launch(x, y, grid=1, block=1))
        np.testing.assert_array_equal(await gpu.to_host(y), host.T)
    assert seen == [(order == "C", order == "F")]
