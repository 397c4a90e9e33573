"""Interop: DLPack and CUDA Array Interface exports, and trio_cuda.borrow.

The simulator tests run everywhere: a DeviceArray of one scope is exported with
DLPack and borrowed by another scope on the same SimDevice. The ``gpu`` tests
need a CUDA device, and CuPy or PyTorch for their round trips (each skips
cleanly without them). Under compute-sanitizer (detected by
``tests/helpers/sanitizer.py`` from the variables it sets, or ``TRIO_CUDA_SANITIZER=1``)
timing slack is larger.
"""

from __future__ import annotations

import ctypes
import gc
import time

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers import internals
from tests.helpers.sanitizer import SANITIZER
from trio_cuda import AccessConflictError, In, Kernel, Out, Scalar, ops
from trio_cuda._backends import probe_cuda
from trio_cuda._core import _dlpack

F4 = np.float32


_BASE = [0]


@pytest.fixture(autouse=True)
def _export_baseline() -> None:
    """Capsules still alive from earlier tests (memory quarantined on purpose
    keeps its capsule forever) are not this test's: count from here."""
    _BASE[0] = _dlpack.live_exports()


def new_exports() -> int:
    """Capsules made since this test started whose deleter has not run."""
    return _dlpack.live_exports() - _BASE[0]


async def settle() -> None:
    """Let released exports reach the loop and the handoff task retire them."""
    await trio.testing.wait_all_tasks_blocked()


async def eventually(predicate, timeout: float = 60.0) -> None:
    """Wait (on a real GPU, where retirement is asynchronous) until ``predicate()``."""
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await trio.sleep(0.005)
    assert predicate()


# --------------------------------------------------------------------------- simulator


async def test_cuda_array_interface_is_absent_on_the_simulator(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.zeros(4, F4))
        await settle()
        assert not hasattr(x, "__cuda_array_interface__")
        with pytest.raises(
            AttributeError, match=r"expected an array on the cuda backend, got one on the 'sim'"
        ):
            x.__cuda_array_interface__  # noqa: B018
        assert x.__dlpack_device__() == (_dlpack.kDLExtDev, internals.dlpack_device_id(sim))
        assert gpu.statistics().leases_held == 0  # no export was taken


async def test_dlpack_round_trip_between_scopes_with_leases(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = await a.to_device(np.arange(6, dtype=F4))
        y = trio_cuda.borrow(x, "write", scope=b)
        assert (y.borrowed, y.readonly, y.ptr, y.shape) == (True, False, x.ptr, (6,))
        assert new_exports() == 1
        await b.run(ops.fill(y[3:], 7.0))
        np.testing.assert_array_equal(await b.to_host(y), [0, 1, 2, 7, 7, 7])
        # while the consumer holds the export, the producer cannot order after it
        with pytest.raises(
            AccessConflictError, match="conflicts with a DLPack export that holds a write lease"
        ):
            a.submit(ops.fill(x, 0.0))
        with pytest.raises(AccessConflictError):
            await a.to_host(x)  # a read conflicts with a write export too
        y.close()
        # the release reaches the loop, and the next access orders after the consumer
        np.testing.assert_array_equal(await a.to_host(x), [0, 1, 2, 7, 7, 7])
        await settle()
        assert new_exports() == 0
        assert a.statistics().leases_held == 0
        await a.run(ops.fill(x, 1.0))
    assert sim.live_allocations == []


async def test_read_only_export_shares_reads_and_refuses_writes(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim) as b:
        x = await a.to_device(np.arange(4, dtype=np.int32))
        ro = x.as_readonly()
        y = trio_cuda.borrow(ro, "read", scope=b)
        assert y.readonly
        np.testing.assert_array_equal(await a.to_host(x), [0, 1, 2, 3])  # reads never conflict
        with pytest.raises(AccessConflictError, match="holds a read lease"):
            a.submit(ops.fill(x, 0))
        with pytest.raises(
            ValueError, match=r"^borrow: access: expected 'read' for memory its producer exported"
        ):
            trio_cuda.borrow(ro, "write", scope=b)
        with pytest.raises(ValueError, match=r"as_writable: expected memory this scope may write"):
            y.as_writable()
        with pytest.raises(
            BufferError, match=r"read-only array can only be exported to consumers of DLPack 1.0"
        ):
            ro.__dlpack__(dl_device=ro.__dlpack_device__())
        y.close()
        await settle()
        await a.run(ops.fill(x, 5))
        np.testing.assert_array_equal(await a.to_host(x), [5, 5, 5, 5])
    assert new_exports() == 0


async def test_export_makes_the_consumer_stream_wait_for_in_flight_writes(sim):
    async with trio_cuda.open_scope(device=sim) as a, trio_cuda.open_scope(device=sim, streams=1) as b:
        x = await a.to_device(np.zeros(1024, F4))
        sim.hold()
        a.submit(ops.fill(x, 3.0))  # in flight
        y = trio_cuda.borrow(x, "read", scope=b)
        consumer = b.streams[0].handle
        assert consumer.queued >= 1  # the device-side wait sits on the consumer's stream
        out = np.zeros(1024, F4)
        fut = b.submit(ops.copy(out, y))
        sim.release()
        await fut.wait()
        np.testing.assert_array_equal(out, np.full(1024, 3.0, F4))
        y.close()


async def test_an_unconsumed_capsule_releases_its_lease(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.ones(4, F4))
        capsule = x.__dlpack__(max_version=(1, 0), dl_device=x.__dlpack_device__())
        assert gpu.statistics().leases_held == 1
        del capsule
        # found at the scope's next look (a retirement pass, statistics(), a
        # conflicting access, the exit), released, then retired on the loop
        gpu.statistics()
        await settle()
        assert gpu.statistics().leases_held == 0
        assert new_exports() == 0
        await gpu.run(ops.fill(x, 2.0))


async def test_scope_exit_quarantines_exports_still_held(sim):
    async with trio_cuda.open_scope(device=sim) as b:
        with pytest.warns(ResourceWarning, match=r"1 export\(s\) were still held by their consumer"):
            async with trio_cuda.open_scope(device=sim) as a:
                x = await a.to_device(np.arange(4, dtype=F4))
                ptr = x.ptr
                y = trio_cuda.borrow(x, access="write", scope=b)
                assert a.statistics().leases_held == 1
        # `a` exited with the export held: its memory is leaked, not freed under `y`
        assert a.statistics().quarantined_leases == 1
        assert ptr in {al.ptr for al in sim.live_allocations}
        await b.run(ops.fill(y, 5.0))
        np.testing.assert_array_equal(await b.to_host(y), np.full(4, 5.0, F4))
        y.close()
    assert sim.violations == []
    gc.collect()
    assert new_exports() == 0


async def test_a_capsule_released_after_its_scope_exited_is_harmless(sim):
    with pytest.warns(ResourceWarning, match="still held by their consumer"):
        async with trio_cuda.open_scope(device=sim) as a:
            x = await a.to_device(np.ones(4, F4))
            capsule = x.__dlpack__(stream=None, max_version=(1, 0), dl_device=x.__dlpack_device__())
    del capsule
    gc.collect()
    assert new_exports() == 0
    assert sim.violations == []


async def test_dlpack_export_bad_input(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        s = gpu.zeros(3, [("a", "<i4"), ("b", "<f4")])
        with pytest.raises(
            BufferError, match=r"^__dlpack__: expected a dtype DLPack can carry .* got \[\('a'"
        ):
            s.__dlpack__(max_version=(1, 0), dl_device=s.__dlpack_device__())
        be = gpu.zeros(3, ">f4")
        with pytest.raises(BufferError, match="native byte order"):
            be.__dlpack__(max_version=(1, 0), dl_device=be.__dlpack_device__())
        x = gpu.zeros(3, F4)
        with pytest.raises(BufferError, match=r"^__dlpack__: dl_device: expected \(12, "):
            x.__dlpack__(dl_device=(2, 0))
        with pytest.raises(BufferError, match=r"^__dlpack__: copy: expected None or False"):
            x.__dlpack__(copy=True)
        dev = x.__dlpack_device__()
        with pytest.raises(TypeError, match=r"^__dlpack__: stream: expected None or an int"):
            x.__dlpack__(stream="s", dl_device=dev)
        with pytest.raises(ValueError, match=r"^stream: expected the address of a live stream"):
            x.__dlpack__(stream=12345, dl_device=dev)
        # simulated memory goes only to a consumer that names its device (trio_cuda.borrow):
        # NumPy gets a clear error and nothing is taken
        with pytest.raises(BufferError, match=r"simulated memory can only be imported by trio_cuda.borrow"):
            x.__dlpack__(max_version=(1, 0))
        with pytest.raises(BufferError, match=r"simulated memory can only be imported"):
            np.from_dlpack(x)
        await gpu.run(ops.fill(x, 1.0))  # no lease was left behind
        await settle()
        assert new_exports() == 0
        assert gpu.statistics().leases_held == 0


class _FakeCAI:
    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (ptr, False), "version": 3}


async def test_borrow_bad_input(sim):
    async with trio_cuda.open_scope(device=sim) as gpu:
        with pytest.raises(
            ValueError, match=r"^borrow: obj: expected device memory, got a host array \(ndarray"
        ):
            trio_cuda.borrow(np.zeros(3))
        with pytest.raises(TypeError, match=r"^borrow: obj: expected an object with __dlpack__ or "):
            trio_cuda.borrow([1, 2, 3])
        with pytest.raises(ValueError, match=r"^borrow: access: expected 'read' or 'write', got 'rw'$"):
            trio_cuda.borrow(np.zeros(3), "rw")  # type: ignore[arg-type]
        with pytest.raises(
            ValueError, match=r"CUDA memory \(_FakeCAI, CUDA Array Interface\) in a scope on the 'sim'"
        ):
            trio_cuda.borrow(_FakeCAI(0x1000))
        other = trio_cuda.testing.SimDevice(name="other")
        async with trio_cuda.open_scope(device=other) as elsewhere:
            z = elsewhere.zeros(2, F4)
            with pytest.raises(ValueError, match=r"expected memory of this scope's device \(kDLExtDev, id"):
                trio_cuda.borrow(z, scope=gpu)
            await settle()
            assert elsewhere.statistics().leases_held == 0
        assert gpu.statistics().live_allocations == 0
    assert new_exports() == 0


class _AnyCAI:
    """A CUDA Array Interface producer of any dict, valid or not (a producer
    may hand out negative dimensions, a shape whose bytes overflow int64, or
    strides that do not fit it)."""

    def __init__(self, **fields: object) -> None:
        self.__cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (0x1000, False),
            "version": 3,
            **fields,
        }


_CAI_REFUSED = r"^borrow: obj: CUDA Array Interface "
_BIG = 2**62


@pytest.mark.parametrize(
    ("fields", "error", "pattern"),
    [
        ({"shape": (-1, 4)}, ValueError, r"shape: expected non-negative dimensions, got \(-1, 4\)$"),
        ({"shape": (4, -(2**63))}, ValueError, r"shape: expected non-negative dimensions, got \(4, -9223"),
        (
            {"shape": (2**63,)},
            ValueError,
            r"shape: expected dimensions of at most 2\*\*63 - 1 \(int64\), got \(9223372036854775808,\)$",
        ),
        (  # np.prod(shape, dtype=np.int64) wraps to 0: a borrow of 0 bytes
            {"shape": (2**32, 2**32)},
            ValueError,
            r"shape: expected an array of at most 2\*\*63 - 1 bytes \(every dimension counted at least "
            r"once, as NumPy does\), got shape \(4294967296, 4294967296\) of float32 "
            r"\(73786976294838206464 bytes\)$",
        ),
        ({"shape": (_BIG, 2)}, ValueError, r"shape: expected an array of at most 2\*\*63 - 1 bytes"),
        (  # a zero-size array spans its other dimensions too, as in NumPy
            {"shape": (0, _BIG, _BIG)},
            ValueError,
            r"shape: expected an array of at most 2\*\*63 - 1 bytes",
        ),
        (  # a sub-array dtype's dimensions count: (2**61, 4) of float32 is 2**65 bytes
            {"shape": (2**61,), "typestr": "(4,)<f4"},
            ValueError,
            r"shape: expected an array of at most 2\*\*63 - 1 bytes .* got shape \(2305843009213693952, 4\) "
            r"of float32",
        ),
        ({"shape": (4.0,)}, TypeError, r"shape: expected a tuple of ints, got \(4.0,\)$"),
        ({"shape": (True, 4)}, TypeError, r"shape: expected a tuple of ints, got \(True, 4\)$"),
        ({"shape": 4}, TypeError, r"shape: expected a tuple of ints, got 4$"),
        (  # strides that wrap in int64: 2**64 + 4 is 4
            {"shape": (1, 4), "strides": (2**64 + 16, 4)},
            ValueError,
            r"strides: expected values that fit int64 \(from -2\*\*63 to 2\*\*63 - 1\), got "
            r"\(18446744073709551632, 4\)$",
        ),
        (
            {"shape": (2, 4), "strides": (-(2**63) - 1, 4)},
            ValueError,
            r"strides: expected values that fit int64",
        ),
        (
            {"shape": (2, 4), "strides": (16,)},
            ValueError,
            r"strides: expected one stride per dimension of shape \(2, 4\), got \(16,\)$",
        ),
        ({"shape": (2, 4), "strides": (16, "4")}, TypeError, r"strides: expected a tuple of ints"),
        ({"data": 0x1000}, TypeError, r"data: expected a \(pointer, read_only\) pair, got 4096$"),
        (
            {"data": (-8, False)},
            ValueError,
            r"data: expected a device pointer from 0 to 2\*\*64 - 1, got -8$",
        ),
        ({"data": (2**64, False)}, ValueError, r"data: expected a device pointer from 0 to 2\*\*64 - 1"),
        ({"data": ("0x1000", False)}, TypeError, r"data: expected an int device pointer, got '0x1000'$"),
        ({"typestr": "|O"}, TypeError, r"dtype: object dtypes cannot live on a device, got object$"),
    ],
)
async def test_borrow_refuses_a_cuda_array_interface_beyond_int64_before_anything_is_taken(
    sim, fields, error, pattern
):
    async with trio_cuda.open_scope(device=sim) as gpu:
        before = gpu.statistics()
        producer = _AnyCAI(**fields)
        with pytest.raises(error, match=_CAI_REFUSED + pattern):
            trio_cuda.borrow(producer)
        assert gpu.statistics() == before
        # a valid one gets as far as the backend check (the simulator has no CUDA memory)
        with pytest.raises(ValueError, match=r"CUDA memory \(_AnyCAI, CUDA Array Interface\) in a scope on"):
            trio_cuda.borrow(_AnyCAI(shape=(_BIG - 1,), typestr="|u1"))
        assert gpu.statistics() == before


@pytest.mark.parametrize(
    ("fields", "layout"),
    [
        ({"shape": (2, 3)}, ((2, 3), "float32", "C")),
        ({"shape": (2, 3), "strides": (12, 4)}, ((2, 3), "float32", "C")),
        ({"shape": (2, 3), "strides": (4, 8)}, ((2, 3), "float32", "F")),
        ({"shape": (1, 4), "strides": (2**63 - 1, 4)}, ((1, 4), "float32", "C")),  # fits int64: unused
        ({"shape": (3,), "typestr": "(2,)<f4"}, ((3, 2), "float32", "C")),  # folded, as in NumPy
        ({"shape": (3, 1), "typestr": "(2,)<f4", "strides": (8, 8)}, ((3, 1, 2), "float32", "C")),
        ({"shape": (_BIG - 1,), "typestr": "|u1"}, ((_BIG - 1,), "uint8", "C")),
        ({"shape": (0, 2**30), "data": (None, False)}, ((0, 2**30), "float32", "C")),
    ],
)
def test_a_valid_cuda_array_interface_layout_is_taken_as_given(fields, layout):
    from trio_cuda._core import _borrow

    cai = _AnyCAI(**fields).__cuda_array_interface__
    _ptr, shape, dt, order, read_only = _borrow.cai_layout(cai, "borrow: obj")
    assert (shape, dt.name, order) == layout
    assert read_only is False


def test_a_sub_array_cuda_array_interface_in_f_order_is_refused():
    from trio_cuda._core import _borrow

    cai = _AnyCAI(shape=(2, 3), typestr="(2,)<f4", strides=(8, 16)).__cuda_array_interface__
    with pytest.raises(
        ValueError,
        match=r"^borrow: obj: a sub-array dtype adds trailing dimensions \(2,\), which an F-order array "
        r"cannot take and stay contiguous; got \('<f4', \(2,\)\) for an F-order array of shape \(2, 3\)$",
    ):
        _borrow.cai_layout(cai, "borrow: obj")


class _RawDLPack:
    """A DLPack producer of simulated memory with any shape, valid or not
    (DLPack carries dimensions as int64: a producer may hand out negative
    ones, or a shape whose bytes overflow). It counts its deleter's calls."""

    def __init__(self, sim: trio_cuda.testing.SimDevice, ptr: int, shape: tuple[int, ...]) -> None:
        self.device = (_dlpack.kDLExtDev, internals.dlpack_device_id(sim))
        self.deleted = 0
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self._deleter = _dlpack._Deleter(self._on_delete)
        mt = self._struct = _dlpack.DLManagedTensorVersioned()
        mt.version.major, mt.version.minor = 1, 0
        mt.deleter = self._deleter
        t = mt.dl_tensor
        t.data = ptr
        t.device.device_type, t.device.device_id = self.device
        t.ndim = len(shape)
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 32, 1  # float32
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        self.capsule: object = None

    def _on_delete(self, _addr: int | None) -> None:
        self.deleted += 1

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **_: object) -> object:
        addr = ctypes.addressof(self._struct)
        self.capsule = _dlpack._PyCapsule_New(addr, _dlpack._name(b"dltensor_versioned"), None)
        return self.capsule

    def still_the_producers(self) -> bool:
        """The capsule was not taken over (its name is unchanged) and not deleted."""
        named = bool(_dlpack._PyCapsule_IsValid(self.capsule, _dlpack._name(b"dltensor_versioned")))
        return named and self.deleted == 0


@pytest.mark.parametrize(
    ("shape", "pattern"),
    [
        ((-1, 4), r"^DLPack tensor: shape: expected non-negative dimensions, got \(-1, 4\)$"),
        (
            (4, -(2**63)),
            r"^DLPack tensor: shape: expected non-negative dimensions, got \(4, -9223372036854775808\)$",
        ),
        (
            (2**62, 4),
            r"^DLPack tensor: shape: expected a tensor of at most 2\*\*63 - 1 bytes .* "
            r"got shape \(4611686018427387904, 4\)",
        ),
        ((0, 2**62, 2**62), r"^DLPack tensor: shape: expected a tensor of at most 2\*\*63 - 1 bytes"),
    ],
)
async def test_borrow_refuses_a_foreign_shape_beyond_int64_and_leaves_the_tensor_to_its_producer(
    sim, shape, pattern
):
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.zeros(16, F4)
        producer = _RawDLPack(sim, x.ptr, shape)
        before = gpu.statistics()
        with pytest.raises(ValueError, match=pattern):
            trio_cuda.borrow(producer)
        assert producer.still_the_producers()
        assert gpu.statistics() == before
        ok = _RawDLPack(sim, x.ptr, (2, 8))  # the same producer, a valid shape: borrowed
        y = trio_cuda.borrow(ok)
        assert (y.shape, y.dtype) == ((2, 8), np.dtype(F4))
        y.close()
        await settle()
        assert ok.deleted == 1


async def test_borrowed_memory_is_never_freed_by_the_borrower(sim):
    async with trio_cuda.open_scope(device=sim) as a:
        x = await a.to_device(np.arange(4, dtype=F4))
        async with trio_cuda.open_scope(device=sim) as b:
            y = trio_cuda.borrow(x, "write", scope=b)
            await b.run(ops.fill(y, 1.0))
        # b exited: it let go of the memory without freeing it
        assert x.ptr in {al.ptr for al in sim.live_allocations}
        await settle()
        np.testing.assert_array_equal(await a.to_host(x), np.ones(4, F4))


# --------------------------------------------------------------------------- sanitizer detection


@pytest.mark.parametrize(
    ("environ", "watched"),
    [
        ({}, False),
        ({"TRIO_CUDA_SANITIZER": "1"}, True),
        ({"TRIO_CUDA_SANITIZER": "0"}, False),
        ({"NV_SANITIZER_INJECTION_PORT_BASE": "49152"}, True),  # set by the tool, no variable by hand
        ({"NV_SANITIZER_INJECTION_PORT_RANGE_BEGIN": "49152", "TRIO_CUDA_SANITIZER": "0"}, True),
        ({"NV_SANITIZER": "1", "SANITIZER_INJECTION": "1"}, False),
    ],
)
def test_compute_sanitizer_is_detected_by_the_variables_it_sets(environ, watched):
    from tests.helpers.sanitizer import under_sanitizer

    assert under_sanitizer(environ) is watched


def test_every_gpu_test_file_detects_compute_sanitizer_through_the_shared_helper():
    # a file that reads the variables itself misses the ones the tool sets (or the
    # explicit one): its deliberate faults would count as errors under the tool
    import re
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    helper = tests / "helpers" / "sanitizer.py"
    word = "SANI" + "TIZER"  # spelled apart: this line is no reader
    own = re.compile(rf"environ[^\n]*{word}|getenv\([^\n]*{word}|NV_{word}_INJECTION_[^\n]*environ")
    readers = sorted(p.name for p in tests.rglob("*.py") if p != helper and own.search(p.read_text()))
    assert readers == []
    users = {
        p.name for p in tests.rglob("test_*.py") if "from tests.helpers.sanitizer import" in p.read_text()
    }
    expected = {
        "test_contract.py",
        "test_cuda_backend.py",
        "test_cuda_graphs.py",
        "test_cuda_launch.py",
        "test_driver_conformance.py",
        "test_interop.py",
        "test_sim_reference.py",
    }
    assert expected <= users


# --------------------------------------------------------------------------- GPU

_PROBE = probe_cuda()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}")

SPIN_SRC = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// spin for `ns`, then y[i] = x[i] + add for all i < n (reads x after the spin)
extern "C" __global__ void spin_add(unsigned long long ns, const float* x, float* y, float add, int n) {
    unsigned long long t0 = now_ns();
    while (now_ns() - t0 < ns) { }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = x[i] + add;
}
"""
SPIN_ADD = Kernel.from_source(
    SPIN_SRC, "spin_add", params=[Scalar("u8"), In("f4"), Out("f4"), Scalar("f4"), Scalar("i4")]
)
N = 1 << 16


def spin_add(ms: float, x, y, add: float):
    return SPIN_ADD.launch(np.uint64(int(ms * 1e6)), x, y, np.float32(add), N, grid=64, block=256)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TRIO_CUDA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "nvrtc-cache"))


@gpu
@needs_cuda
async def test_torch_round_trip_through_different_streams():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    async with trio_cuda.open_scope(device="cuda") as g:
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s1):
            t = torch.zeros(N, device="cuda")
            torch.cuda._sleep(50_000_000)  # keep s1 busy: the write below lands late
            t.fill_(2.0)
            x = trio_cuda.borrow(t, "read")  # our stream waits for s1
        y = g.empty(N, F4)
        await g.run(spin_add(20, x, y, 1.0))  # y = t + 1 on a trio_cuda stream
        with torch.cuda.stream(s2):
            u = torch.from_dlpack(y)  # s2 waits for our write
            v = u * 10  # torch reads on s2
        assert float(v.sum().item()) == pytest.approx(30.0 * N)
        # while torch holds the export, trio_cuda cannot write y
        with pytest.raises(AccessConflictError):
            g.submit(ops.fill(y, 0.0))
        del u, v
        x.close()
        await g.run(ops.fill(y, 5.0))  # ordered after torch's reads on s2
        np.testing.assert_array_equal(await g.to_host(y), np.full(N, 5.0, F4))
        torch.cuda.synchronize()


@gpu
@needs_cuda
async def test_cupy_round_trip_through_different_streams():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    async with trio_cuda.open_scope(device="cuda") as g:
        x = await g.to_device(np.full(N, 3.0, F4))
        y = g.empty(N, F4)
        g.submit(spin_add(100, x, y, 4.0))  # writes y after 100 ms
        with cupy.cuda.Stream(non_blocking=True):
            c = cupy.from_dlpack(y)  # the cupy stream waits device-side
            total = float((c * 2).sum())
        assert total == pytest.approx(14.0 * N)
        del c
        gc.collect()
        # and back: cupy writes, trio_cuda reads through another stream
        with cupy.cuda.Stream(non_blocking=True):
            a = cupy.arange(N, dtype=cupy.float32)
            b = trio_cuda.borrow(a, "read")
        z = g.empty(N, F4)
        await g.run(spin_add(1, b, z, 0.5))
        np.testing.assert_allclose(await g.to_host(z), np.arange(N, dtype=F4) + 0.5)
        b.close()


@gpu
@needs_cuda
async def test_cuda_array_interface_export_and_import():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    async with trio_cuda.open_scope(device="cuda") as g:
        x = await g.to_device(np.full(N, 1.0, F4))
        y = g.empty((N // 256, 256), F4, order="F")
        g.submit(spin_add(100, x, y, 6.0))
        cai = y.__cuda_array_interface__
        assert cai["version"] == 3
        assert cai["stream"] is not None
        assert cai["strides"] == (4, 4 * (N // 256))
        c = cupy.asarray(y)  # honours the CAI stream: sees the kernel's write
        assert float(c.sum()) == pytest.approx(7.0 * N)
        with pytest.raises(AccessConflictError):
            g.submit(ops.fill(y, 0.0))

        # import through the CUDA Array Interface (a CAI-only wrapper)
        class OnlyCAI:
            def __init__(self, a):
                self.__cuda_array_interface__ = a.__cuda_array_interface__
                self.keep = a

        src = cupy.full(N, 9.0, dtype=cupy.float32)
        b = trio_cuda.borrow(OnlyCAI(src), "read")
        np.testing.assert_array_equal(await g.to_host(b), np.full(N, 9.0, F4))
        b.close()
        del c, y
        gc.collect()  # releases the CAI export (the consumer dropped it)
        await eventually(lambda: g.statistics().leases_held == 0)
        with pytest.raises(ValueError, match=r"^borrow: obj: expected device memory, got a host array"):
            trio_cuda.borrow(np.zeros(4, F4))
        torch = pytest.importorskip("torch", reason="PyTorch is not installed")
        with pytest.raises(ValueError, match=r"got a host array \(Tensor on kDLCPU\)"):
            trio_cuda.borrow(torch.zeros(4))


@gpu
@needs_cuda
async def test_dropping_every_handle_while_a_long_kernel_runs_frees_nothing_early():
    # The check is only meaningful while the kernel still spins. A slow host
    # (a full gc.collect() late in a big test process, a sanitizer) can outlast
    # the spin, so an inconclusive round runs again with a longer spin.
    spin_ms = 300 if not SANITIZER else 1000
    rounds = []
    for _ in range(4):
        elapsed_ms = await _drop_handles_while_spinning(spin_ms)
        rounds.append((spin_ms, round(elapsed_ms)))
        if elapsed_ms < 0.7 * spin_ms:
            print(f"spin rounds (spin ms, check ms): {rounds}")
            return
        spin_ms *= 4
    pytest.fail(f"the host never checked within the kernel's spin (spin ms, check ms): {rounds}")


async def _drop_handles_while_spinning(spin_ms: float) -> float:
    """Drop every handle of a spinning kernel's arrays; check nothing is freed.
    Returns how long after the launch the check ran (ms): the check failing
    inside the spin is a failure; a check after it proves nothing."""
    async with trio_cuda.open_scope(device="cuda", streams=2) as g:
        x = await g.to_device(np.full(N, 41.0, F4))
        y = g.empty(N, F4)
        z = g.empty(N, F4)
        s = g.streams[0]
        t0 = time.monotonic()
        g.submit(spin_add(spin_ms, x, y, 1.0), stream=s)  # reads x late
        g.submit(ops.copy(z, y), stream=s)
        before = g.statistics().live_allocations
        del x, y
        gc.collect()
        await trio.sleep(0.05)
        live = g.statistics().live_allocations
        elapsed_ms = (time.monotonic() - t0) * 1e3
        if elapsed_ms < 0.7 * spin_ms:
            msg = f"freed {before - live} of {before}, {elapsed_ms:.0f} ms into a {spin_ms} ms spin"
            assert live == before, msg
        # try to get the memory reused with other values while the kernel spins
        junk = [g.full(N, 999.0, F4) for _ in range(4)]
        got = await g.to_host(z)
        np.testing.assert_array_equal(got, np.full(N, 42.0, F4))
        for j in junk:
            j.close()
        z.close()
        # (run compute-sanitizer with --show-backtrace device: host backtraces
        # keep the launching frames, and the arrays in them, alive)
        with trio.move_on_after(60):
            while g.statistics().live_allocations:  # noqa: ASYNC110 - polling the GPU's retirement
                await trio.sleep(0.01)
        assert g.statistics().live_allocations == 0, (g.statistics(), list(internals.allocation_records(g)))
    return elapsed_ms


async def test_exporting_memory_another_scope_is_writing_orders_after_that_write(sim):
    async with trio_cuda.open_scope(device=sim) as b:
        async with trio_cuda.open_scope(device=sim) as a:
            x = await a.to_device(np.zeros(6, dtype=F4))
            src = await b.to_device(np.ones(6, dtype=F4))
            sim.hold()
            fut = b.submit(ops.copy(x, src))  # b's copy writes a's x, in flight
            assert [w.scope for w in internals.allocation_of(x).writers] == [b]
            capsule = x.__dlpack__(
                max_version=(1, 0), dl_device=x.__dlpack_device__()
            )  # exported by a, ordered after b's copy
            assert not fut.done()
            sim.release()
            await fut.wait()
            del capsule
            gc.collect()
            await settle()
            assert a.statistics().quarantined_leases == 0
            np.testing.assert_array_equal(await a.to_host(x), np.ones(6, F4))
        assert (a.statistics().in_flight, a.statistics().live_allocations) == (0, 0)
    assert sim.violations == []
