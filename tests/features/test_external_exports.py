"""Exports inside ``ops.external``: ``__cuda_array_interface__`` and
``__dlpack__`` of arrays the external's ``reads=``/``writes=`` cover, on the
simulator.

The consumers here do what CuPy and PyTorch do with an array: ``cupy.asarray``
and ``torch.as_tensor`` read ``__cuda_array_interface__`` (and synchronise the
host on its ``stream`` when one is named); ``torch.from_dlpack`` and
``cupy.from_dlpack`` call ``__dlpack__(stream=<their current stream>,
max_version=...)`` and take the capsule over. Their "work" is trio_cuda work
enqueued with ``unsafe.async_on`` on the stream the external was given, as in
``tests/features/test_foreign.py``.

Simulated memory has no CUDA address, so its arrays have no CUDA Array
Interface; the CAI tests give their scope the ``cuda`` backend's name
(``cai_scope``), which is all that export reads of it: the dict holds the
simulator's addresses, and no real library ever sees them.
"""

from __future__ import annotations

import gc
import threading

import attrs
import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import held
from tests.helpers.kernels import add
from trio_cuda import AccessConflictError, ops, unsafe
from trio_cuda._core import _dlpack

F4 = np.float32

_BASE = [0]


@pytest.fixture(autouse=True)
def _export_baseline() -> None:
    _BASE[0] = _dlpack.live_exports()


def new_exports() -> int:
    """Capsules made since this test started whose deleter has not run."""
    return _dlpack.live_exports() - _BASE[0]


def cai_scope(gpu, monkeypatch) -> None:
    """Let ``gpu`` (a simulator scope) export the CUDA Array Interface."""
    internals.fake_device_info(monkeypatch, gpu, attrs.evolve(gpu.device, backend="cuda"))


def asarray(obj) -> dict:
    """What ``cupy.asarray(obj)`` reads: the interface (after ``hasattr``)."""
    if not hasattr(obj, "__cuda_array_interface__"):
        raise TypeError(f"unsupported type {type(obj).__name__}")
    return obj.__cuda_array_interface__


def from_dlpack(obj, stream) -> _dlpack.ImportedTensor:
    """What ``torch.from_dlpack(obj)`` does on ``stream`` (its current one)."""
    device = obj.__dlpack_device__()
    return _dlpack.ImportedTensor(obj.__dlpack__(stream=stream, max_version=(1, 1), dl_device=device))


def address(stream) -> int:
    return stream.__cuda_stream__()[1]


# --------------------------------------------------------------------------- CUDA Array Interface


async def test_cai_inside_external_is_covered_by_its_leases(sim, monkeypatch):
    async with trio_cuda.open_scope(device=sim, streams=2, conflicts="error") as gpu:
        cai_scope(gpu, monkeypatch)
        x = await gpu.to_device(np.arange(8, dtype=F4))
        y = gpu.zeros(8, F4)
        seen = {}

        def foreign(stream):
            before = gpu.statistics().leases_held
            queued = stream.handle.queued
            seen["x"], seen["y"] = asarray(x), asarray(y)
            seen["view"] = asarray(y[2:6])
            seen["again"] = asarray(y)  # read twice (CuPy does): the same numbers, nothing held
            # no lease, wait or fence of their own
            seen["leases"] = gpu.statistics().leases_held - before
            seen["queued"] = stream.handle.queued - queued
            unsafe.async_on(ops.copy(y, x), stream)  # the consumer's work, on the external's stream
            unsafe.async_on(add(y, 1.0), stream)

        with held(sim):
            fut = gpu.submit(ops.external(foreign, reads=[x], writes=[y]), stream=gpu.streams[1])
            assert fut.statistics().leases == 2  # the external's, nothing more
            with pytest.raises(AccessConflictError):  # and they are real
                gpu.submit(ops.fill(y, 0.0), stream=gpu.streams[0])
        await fut.wait()
        assert seen["leases"] == 0
        assert seen["queued"] == 0
        assert seen["x"]["data"] == (x.ptr, True)  # covered by reads= only: read-only
        assert seen["y"]["data"] == (y.ptr, False)
        assert seen["view"]["data"] == (y.ptr + 8, False)
        assert seen["view"]["shape"] == (4,)
        for cai in (seen["x"], seen["y"], seen["view"], seen["again"]):
            assert cai["stream"] is None  # the consumer works on the external's stream: no sync
            assert cai["version"] == 3
            assert cai["typestr"] == "<f4"
        assert seen["again"] == seen["y"]
        np.testing.assert_array_equal(await gpu.to_host(y), np.arange(8, dtype=F4) + 1)
        assert gpu.statistics().leases_held == 0
        x.close()
        y.close()
        await trio.testing.wait_all_tasks_blocked()
        assert sim.live_allocations == []  # nothing was retained past the external's work


async def test_cai_coverage_is_by_bytes(sim, monkeypatch):
    async with trio_cuda.open_scope(device=sim) as gpu:
        cai_scope(gpu, monkeypatch)
        buf = gpu.zeros(16, F4)
        other = gpu.zeros(4, F4)
        part = buf[4:12]
        got = {}

        def probe(stream):
            got["inside"] = asarray(buf[6:10])  # inside the declared view: covered
            got["ro"] = asarray(part.as_readonly())  # a read-only handle exports read-only
            got["mixed"] = asarray(buf[2:6])  # bytes 8..16 from reads=, 16..24 from writes=
            got["empty"] = asarray(buf[8:8])
            for label, arr in (("across", buf[10:14]), ("outside", buf[:4]), ("other", other)):
                try:
                    asarray(arr)
                except AccessConflictError as exc:
                    got[label] = str(exc)

        await gpu.run(ops.external(probe, reads=[buf[2:4]], writes=[part]))
        assert got["inside"]["data"] == (buf.ptr + 24, False)
        assert got["ro"]["data"] == (buf.ptr + 16, True)
        assert got["mixed"]["data"] == (buf.ptr + 8, True)  # writes= cover only part of it
        assert got["empty"]["shape"] == (0,)
        assert "bytes [40, 56) of its allocation; the external covers bytes [8, 48) of it" in got["across"]
        assert "bytes [0, 16) of its allocation" in got["outside"]
        for label in ("across", "outside", "other"):
            assert got[label].startswith("__cuda_array_interface__: <DeviceArray")
            assert "is not covered by this external's reads= or writes= (ops.external(" in got[label]
            assert got[label].endswith("add it to reads= (to read it) or writes= (to write it)")
        assert "bytes" not in got["other"].split("reads=")[0]  # not a view of a declared array
        assert gpu.statistics().leases_held == 0


async def test_an_uncovered_cai_fails_the_external_and_leaves_its_work_retained(sim, monkeypatch):
    async with trio_cuda.open_scope(device=sim) as gpu:
        cai_scope(gpu, monkeypatch)
        y = gpu.zeros(4, F4)
        z = gpu.zeros(4, F4)
        await gpu.run(ops.value(None))

        def forgot_z(stream):
            unsafe.async_on(add(y, 1.0), stream)
            asarray(z)  # z is missing from writes=

        with held(sim):
            with pytest.raises(AccessConflictError, match=r"add it to reads= \(to read it\) or writes="):
                gpu.submit(ops.external(forgot_z, writes=[y]))
            assert gpu.statistics().leases_held == 1  # rule 6: y's lease, behind a marker
        await trio.testing.wait_all_tasks_blocked()
        np.testing.assert_array_equal(await gpu.to_host(y), np.ones(4, F4))
        # z was never exported: it is free to use, and nothing of it is held
        await gpu.run(ops.fill(z, 2.0))
        assert gpu.statistics().leases_held == 0


async def test_cai_after_fn_returns_is_an_ordinary_export_again(sim, monkeypatch):
    async with trio_cuda.open_scope(device=sim) as gpu:
        cai_scope(gpu, monkeypatch)
        x = gpu.zeros(4, F4)
        await gpu.run(ops.external(lambda s: asarray(x.as_readonly()), reads=[x]))
        assert gpu.statistics().leases_held == 0
        ro = x.as_readonly()
        # outside fn the handle exports with a lease of its own, held until it is collected
        assert asarray(ro)["data"] == (x.ptr, True)
        assert gpu.statistics().leases_held == 1
        del ro
        gc.collect()
        await trio.testing.wait_all_tasks_blocked()
        assert gpu.statistics().leases_held == 0
        await gpu.run(ops.fill(x, 1.0))


async def test_exports_in_a_then_closure_are_still_refused_and_point_to_external(sim, monkeypatch):
    async with trio_cuda.open_scope(device=sim) as gpu:
        cai_scope(gpu, monkeypatch)
        x = gpu.zeros(4, F4)
        dev = x.__dlpack_device__()
        for export in (
            lambda: asarray(x),
            lambda: x.__dlpack__(stream=-1, max_version=(1, 1), dl_device=dev),
        ):
            with pytest.raises(
                RuntimeError,
                match=r"cannot export .* from inside a then/map closure.*ops\.external\(fn, reads=",
            ):
                await gpu.run(ops.value(None).then(lambda _, export=export: export()))
        # a then closure after an external is not inside its fn
        with pytest.raises(RuntimeError, match="then/map closure"):
            await gpu.run(ops.external(lambda s: None, reads=[x]).then(lambda _: asarray(x)))
        await trio.testing.wait_all_tasks_blocked()
        assert gpu.statistics().leases_held == 0
        assert new_exports() == 0


# --------------------------------------------------------------------------- DLPack


async def test_dlpack_inside_external_takes_no_lease_and_no_wait(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(np.arange(8, dtype=F4))
        y = gpu.zeros(8, F4)
        got = {}

        def foreign(stream):
            before, queued = gpu.statistics().leases_held, stream.handle.queued
            tx = from_dlpack(x, address(stream))
            ty = from_dlpack(y[4:], address(stream))
            t1 = from_dlpack(y, -1)  # no synchronisation asked for
            got["x"] = (tx.ptr, tx.read_only, tx.shape)
            got["y"] = (ty.ptr, ty.read_only, ty.shape)
            got["-1"] = t1.read_only
            got["leases"] = gpu.statistics().leases_held - before
            got["queued"] = stream.handle.queued - queued
            unsafe.async_on(ops.copy(y, x), stream)
            for t in (tx, ty, t1):
                t.close()  # the consumer's deleter: nothing to release

        await gpu.run(ops.external(foreign, reads=x, writes=y), stream=gpu.streams[1])
        assert got["x"] == (x.ptr, True, (8,))  # reads=: the read-only flag (DLPack 1.x)
        assert got["y"] == (y.ptr + 16, False, (4,))
        assert got["-1"] is False
        assert (got["leases"], got["queued"]) == (0, 0)
        np.testing.assert_array_equal(await gpu.to_host(y), np.arange(8, dtype=F4))
        assert new_exports() == 0
        assert gpu.statistics().leases_held == 0


async def test_dlpack_inside_external_refuses_what_its_leases_do_not_cover(sim):
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = gpu.zeros(8, F4)
        y = gpu.zeros(8, F4)
        z = gpu.zeros(8, F4)
        dev = x.__dlpack_device__()
        errors = {}

        def probe(stream):
            other = address(gpu.streams[0])
            for label, call in {
                "uncovered": lambda: from_dlpack(z, address(stream)),
                "view": lambda: from_dlpack(y[:6], address(stream)),
                "legacy_read": lambda: x.__dlpack__(stream=address(stream), dl_device=dev),
                "other_stream": lambda: from_dlpack(y[4:], other),
            }.items():
                try:
                    call()
                except Exception as exc:
                    errors[label] = exc
            # a legacy consumer can write what writes= cover
            _dlpack.ImportedTensor(y[4:].__dlpack__(stream=address(stream), dl_device=dev)).close()

        await gpu.run(ops.external(probe, reads=[x], writes=[y[4:]]), stream=gpu.streams[1])
        assert isinstance(errors["uncovered"], AccessConflictError)
        assert "is not covered by this external's reads= or writes=" in str(errors["uncovered"])
        assert isinstance(errors["view"], AccessConflictError)
        assert "bytes [0, 24) of its allocation; the external covers bytes [16, 32) of it" in str(
            errors["view"]
        )
        assert isinstance(errors["legacy_read"], BufferError)
        assert "covered only by this external's reads=" in str(errors["legacy_read"])
        assert "Add it to writes= to let the consumer write it" in str(errors["legacy_read"])
        assert isinstance(errors["other_stream"], AccessConflictError)
        assert str(errors["other_stream"]).startswith(
            f"__dlpack__: stream: expected the stream of the running ops.external "
            f"({address(gpu.streams[1]):#x}), on which its leases order the consumer's work, or -1; "
            f"got {address(gpu.streams[0]):#x}"
        )
        assert new_exports() == 0  # nothing was made for the refused ones
        assert gpu.statistics().leases_held == 0
        await gpu.run(ops.fill(z, 1.0))


async def test_a_capsule_not_consumed_before_fn_returns_is_expired(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        kept = {}

        def foreign(stream):
            dev = x.__dlpack_device__()
            kept["later"] = x.__dlpack__(stream=address(stream), max_version=(1, 1), dl_device=dev)
            kept["taken"] = from_dlpack(x, address(stream))  # consumed, kept past fn
            x.__dlpack__(stream=address(stream), max_version=(1, 1), dl_device=dev)  # dropped

        await gpu.run(ops.external(foreign, writes=[x]))
        # a consumer that takes the capsule only now is refused: the leases have ended
        with pytest.raises(BufferError, match="not named 'dltensor' or 'dltensor_versioned'"):
            _dlpack.ImportedTensor(kept["later"])
        assert new_exports() == 1  # the consumed one, until its consumer deletes it
        kept["taken"].close()
        assert new_exports() == 0
        assert gpu.statistics().leases_held == 0
        await gpu.run(ops.fill(x, 1.0))  # no export holds x


async def test_an_external_that_raises_expires_its_capsules_and_ends_its_coverage(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(4, F4)
        await gpu.run(ops.value(None))
        kept = []

        def failing(stream):
            unsafe.async_on(add(y, 1.0), stream)
            kept.append(
                y.__dlpack__(stream=address(stream), max_version=(1, 1), dl_device=y.__dlpack_device__())
            )
            raise ValueError("foreign library failed")

        with held(sim):
            with pytest.raises(ValueError, match="foreign library failed"):
                gpu.submit(ops.external(failing, writes=[y]))
            assert gpu.statistics().leases_held == 1
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(BufferError):
            _dlpack.ImportedTensor(kept[0])
        assert new_exports() == 0
        # outside fn, y exports as usual again: an ordinary lease, held by the consumer
        t = from_dlpack(y, None)
        assert gpu.statistics().leases_held == 1
        t.close()
        await trio.testing.wait_all_tasks_blocked()
        assert gpu.statistics().leases_held == 0
        np.testing.assert_array_equal(await gpu.to_host(y), np.ones(4, F4))


# --------------------------------------------------------------------------- scopes, nesting, threads


async def test_another_scopes_array_inside_fn_is_an_ordinary_export(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = a.zeros(4, F4)
        bx = await b.to_device(np.arange(4, dtype=F4))
        held_by = {}

        def foreign(stream):
            t = from_dlpack(bx, address(stream))  # b is not enqueuing: b's own lease
            held_by["b"] = b.statistics().leases_held
            held_by["t"] = t

        await a.run(ops.external(foreign, writes=[x]))
        assert held_by["b"] == 1
        assert b.statistics().leases_held == 1  # held until the consumer deletes it
        held_by.pop("t").close()
        await trio.testing.wait_all_tasks_blocked()
        assert b.statistics().leases_held == 0
        assert new_exports() == 0


async def test_nested_externals_cover_only_their_own_arrays(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = a.zeros(4, F4)
        w = a.zeros(4, F4)
        bx = b.zeros(4, F4)
        log = {}

        def inner_b(stream):
            log["bx"] = from_dlpack(bx, address(stream)).read_only  # b's external covers it
            try:
                from_dlpack(x, address(stream))  # a is enqueuing, not in its own external
            except RuntimeError as exc:
                log["a_in_b"] = str(exc)

        def inner_a(stream):
            try:
                from_dlpack(x, address(stream))  # the innermost external covers only w
            except AccessConflictError as exc:
                log["x_in_inner"] = str(exc)
            log["w"] = from_dlpack(w, address(stream)).read_only

        def outer(stream):
            unsafe.async_on(ops.external(inner_b, reads=[bx]), b.streams[0])
            unsafe.async_on(ops.external(inner_a, reads=[w]), stream)
            log["x"] = from_dlpack(x, address(stream)).read_only  # the outer one's again

        await a.run(ops.external(outer, writes=[x], reads=[w]))
        assert log["bx"] is True
        assert "nor inside another scope's ops.external fn" in log["a_in_b"]
        assert "is not covered by this external's reads= or writes=" in log["x_in_inner"]
        assert log["w"] is True
        assert log["x"] is False
        await trio.testing.wait_all_tasks_blocked()
        assert new_exports() == 0  # every capsule was consumed (and deleted with its tensor)
        assert a.statistics().leases_held == 0
        assert b.statistics().leases_held == 0


async def test_a_worker_thread_inside_fn_gets_no_coverage(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(4, F4)
        errors = []

        def in_thread(stream):
            try:
                from_dlpack(x, address(stream))
            except Exception as exc:
                errors.append(exc)

        def foreign(stream):
            t = threading.Thread(target=in_thread, args=(stream,))
            t.start()
            t.join()

        await gpu.run(ops.external(foreign, writes=[x]))
        assert len(errors) == 1
        assert isinstance(errors[0], RuntimeError)
        assert "thread" in str(errors[0])
        assert new_exports() == 0
        assert gpu.statistics().leases_held == 0


async def test_unsafe_async_on_of_an_external_covers_its_exports_with_no_lease(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.arange(4, dtype=F4))
        z = gpu.zeros(4, F4)
        got = {}

        def foreign(stream):
            before = gpu.statistics().leases_held
            got["x"] = from_dlpack(x, address(stream)).read_only
            got["leases"] = gpu.statistics().leases_held - before
            with pytest.raises(AccessConflictError, match="reads= or writes="):
                from_dlpack(z, address(stream))
            unsafe.async_on(add(x, 1.0), stream)
            return "ok"

        assert unsafe.async_on(ops.external(foreign, writes=[x]), gpu.streams[0]) == "ok"
        assert got == {"x": False, "leases": 0}
        await gpu.run(ops.value(None), stream=gpu.streams[0])
        np.testing.assert_array_equal(await gpu.to_host(x), np.arange(4, dtype=F4) + 1)
        assert new_exports() == 0


# --------------------------------------------------------------------------- graphs and composites


async def test_exports_inside_a_captured_external(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.arange(4, dtype=F4))
        y = gpu.zeros(4, F4)
        runs = []

        def scale(stream):
            t = from_dlpack(y, address(stream))  # the capture's stream
            runs.append(t.ptr)
            t.close()
            unsafe.async_on(ops.copy(y, x), stream)
            unsafe.async_on(add(y, 1.0), stream)

        graph = await gpu.capture(ops.external(scale, reads=[x], writes=[y]))
        try:
            assert runs == [y.ptr]  # fn ran once, at capture
            for _ in range(2):
                await gpu.run(graph.launch())
            np.testing.assert_array_equal(await gpu.to_host(y), np.arange(4, dtype=F4) + 1)
        finally:
            graph.close()
        # an uncovered export fails the capture, and leaves nothing behind
        z = gpu.zeros(4, F4)
        with pytest.raises(AccessConflictError, match="reads= or writes="):
            await gpu.capture(ops.external(lambda s: from_dlpack(z, address(s)), writes=[y]))
        await trio.testing.wait_all_tasks_blocked()
        assert new_exports() == 0
        assert gpu.statistics().leases_held == 0
        await gpu.run(ops.fill(z, 1.0))


async def test_exports_in_chained_externals_under_conflicts_error(sim):
    async with trio_cuda.open_scope(device=sim, conflicts="error") as gpu:
        y = gpu.zeros(4, F4)
        flags = []

        def produce(stream):
            flags.append(from_dlpack(y, address(stream)).read_only)
            unsafe.async_on(add(y, 2.0), stream)
            return y

        def consume(stream):
            flags.append(from_dlpack(y, address(stream)).read_only)

        op = trio_cuda.zip(
            ops.external(produce, writes=[y]).then(lambda out: ops.external(consume, reads=[out])),
            ops.value(1),
        )
        await gpu.run(op)
        assert flags == [False, True]  # fn ran once each, at the real enqueue
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(4, 2.0, F4))
        assert new_exports() == 0


async def test_borrow_inside_fn_is_refused_naming_the_external(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = a.zeros(4, F4)
        bx = b.zeros(4, F4)
        errors = []

        def foreign(stream):
            try:
                trio_cuda.borrow(bx, scope=a)
            except RuntimeError as exc:
                errors.append(str(exc))

        await a.run(ops.external(foreign, writes=[x]))
        assert len(errors) == 1
        assert errors[0].startswith(
            "borrow: cannot borrow from inside a then/map closure or an ops.external fn"
        )
        assert "pass the borrowed array in the external's reads= or writes=" in errors[0]
        assert new_exports() == 0  # refused before bx was asked for a capsule
        await b.run(ops.fill(bx, 1.0))
