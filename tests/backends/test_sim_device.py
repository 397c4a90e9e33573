"""The simulated device, used directly through the DeviceContext protocol (no scope)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from trio_cuda import (
    NO_REFERENCE,
    CompletionUnknownError,
    CudaError,
    In,
    InOut,
    Kernel,
    LaunchConfig,
    LaunchError,
    MissingReferenceError,
    Out,
    OutOfMemoryError,
    Scalar,
    ScopeClosedError,
    Slice,
)
from trio_cuda._backends.sim import SimContext, SimMarker, SimStream
from trio_cuda._core._driver import DONE, PENDING, MarkerState, Poll
from trio_cuda._core._kernel import Reference
from trio_cuda._core._launch import ArgView, PreparedLaunch
from trio_cuda._core._ops import Access
from trio_cuda.testing import SimAllocation, SimCommandRecord, SimDevice, SimStatistics, Violation

F4 = np.dtype(np.float32)


# --------------------------------------------------------------------------- helpers


def kernel(name: str, params: list[Any], reference: Reference) -> Kernel:
    """A kernel ``name`` whose CPU behaviour is ``reference`` (its CUDA code
    does nothing: these tests are about the device, not the kernel)."""
    return Kernel.from_source(
        f'extern "C" __global__ void {name}() {{}}', name, params=params, reference=reference
    )


def array(ptr: int, shape: tuple[int, ...], dtype: Any = F4, access: Access = Access.WRITE) -> ArgView:
    return ArgView("array", ptr, shape, np.dtype(dtype), access=access)


def prepared(k: Kernel, *args: ArgView, block: tuple[int, int, int] = (1, 1, 1)) -> PreparedLaunch:
    return PreparedLaunch(k, LaunchConfig((1, 1, 1), block), k.plan, b"", args)


class Dev:
    """A device, one context and two streams, with small conveniences."""

    def __init__(self, **kwargs: Any) -> None:
        self.sim = SimDevice(**kwargs)
        self.ctx = self.sim.open_context()
        self.s0 = self.ctx.create_stream(0)
        self.s1 = self.ctx.create_stream(1)
        self._fns: dict[Kernel, object] = {}

    def launch(self, stream: SimStream, k: Kernel, *args: ArgView) -> None:
        fn = self._fns.get(k)
        if fn is None:
            fn = self._fns[k] = self.ctx.load_kernel(k)
        self.ctx.launch(stream, fn, prepared(k, *args))

    def upload(self, host: np.ndarray[Any, Any], stream: SimStream | None = None) -> int:
        s = stream or self.s0
        ptr = self.ctx.alloc(host.nbytes, s)
        self.ctx.copy_h2d(s, ptr, host)
        return ptr

    def download(
        self, ptr: int, shape: tuple[int, ...], dtype: Any = F4, stream: SimStream | None = None
    ) -> np.ndarray[Any, Any]:
        out = np.full(shape, 7, dtype=dtype)
        self.ctx.copy_d2h(stream or self.s0, out, ptr)
        return out


def recorder(log: list[str], tag: str) -> Kernel:
    def ref(*_args: object) -> None:
        log.append(tag)

    return kernel(tag.replace(" ", "_"), [], ref)


# --------------------------------------------------------------------------- basics


def test_info_and_open_context() -> None:
    sim = SimDevice(name="simX", memory=1 << 20)
    ctx = sim.open_context()
    assert isinstance(ctx, SimContext)
    assert ctx.info.backend == "sim"
    assert ctx.info.name == "simX"
    assert ctx.info.total_memory == 1 << 20
    assert ctx.info.compute_capability == (9, 0)
    assert ctx.info.multiprocessor_count == 132
    assert ctx.info.max_shared_memory_per_block_optin == 232448
    assert ctx.create_stream(3).index == 3
    assert not sim.held
    assert sim.pending == 0
    assert sim.violations == []


def test_constructor_validates_arguments() -> None:
    with pytest.raises(ValueError, match="memory"):
        SimDevice(memory=-1)
    with pytest.raises(ValueError, match="kernel_time"):
        SimDevice(kernel_time=-0.5)
    with pytest.raises(ValueError, match="copy_time"):
        SimDevice(copy_time=float("nan"))


# --------------------------------------------------------------------------- memory


def test_alloc_addresses_are_aligned_unique_and_never_reused() -> None:
    d = Dev()
    seen = set()
    for n in [0, 1, 255, 256, 257, 0, 4096]:
        ptr = d.ctx.alloc(n, d.s0)
        assert ptr % 256 == 0
        assert ptr >= 0x7F0000000000
        assert ptr not in seen
        seen.add(ptr)
        d.ctx.free(ptr, n)
    again = d.ctx.alloc(16, d.s0)
    assert again not in seen
    assert again > max(seen)


def test_live_allocations_and_statistics() -> None:
    d = Dev()
    a = d.ctx.alloc(100, d.s0)
    b = d.ctx.alloc(0, d.s0)
    c = d.ctx.alloc(300, d.s1)
    assert d.sim.live_allocations == [SimAllocation(a, 100), SimAllocation(b, 0), SimAllocation(c, 300)]
    d.ctx.free(b, 0)
    snapshot = d.sim.live_allocations
    assert snapshot == [SimAllocation(a, 100), SimAllocation(c, 300)]
    stats = d.sim.statistics()
    assert isinstance(stats, SimStatistics)
    assert (stats.live_allocations, stats.live_bytes, stats.allocations, stats.frees) == (2, 400, 3, 1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snapshot[0].ptr = 0  # type: ignore[misc]
    d.ctx.free(a, 100)
    d.ctx.free(c, 300)
    assert d.sim.live_allocations == []
    assert d.sim.violations == []


def test_out_of_memory_counts_live_bytes_only() -> None:
    d = Dev(memory=1000)
    a = d.ctx.alloc(600, d.s0)
    with pytest.raises(OutOfMemoryError) as info:
        d.ctx.alloc(401, d.s0)
    assert info.value.code == 2
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "401" in str(info.value)
    b = d.ctx.alloc(400, d.s0)  # exactly fills the device
    d.ctx.free(a, 600)
    d.ctx.alloc(600, d.s0)
    assert len(d.sim.live_allocations) == 2
    d.ctx.free(b, 400)


def test_alloc_rejects_negative_size() -> None:
    d = Dev()
    with pytest.raises(ValueError, match="nbytes"):
        d.ctx.alloc(-1, d.s0)


def test_free_poisons_memory_seen_through_stale_views() -> None:
    d = Dev()
    ptr = d.upload(np.arange(8, dtype=np.uint8))
    stash: list[np.ndarray[Any, Any]] = []
    k = kernel("keep", [InOut(np.uint8)], lambda v: stash.append(v))
    d.launch(d.s0, k, array(ptr, (8,), np.uint8))
    assert stash[0].tolist() == list(range(8))
    assert d.sim.peek(ptr, 8) == bytes(range(8))
    d.ctx.free(ptr, 8)
    assert stash[0].tolist() == [0xDB] * 8
    with pytest.raises(ValueError, match="live allocation"):
        d.sim.peek(ptr, 8)


def test_double_free_and_invalid_free_are_violations() -> None:
    d = Dev()
    ptr = d.ctx.alloc(64, d.s0)
    d.ctx.free(ptr, 64)
    d.ctx.free(ptr, 64)
    d.ctx.free(0x1234, 8)
    other = d.ctx.alloc(64, d.s0)
    d.ctx.free(other + 8, 8)  # interior pointer
    d.ctx.free(other, 32)  # wrong size: not freed
    assert [v.kind for v in d.sim.violations] == [
        "double_free",
        "invalid_free",
        "invalid_free",
        "invalid_free",
    ]
    assert d.sim.violations[0] == Violation("double_free", ptr, 64, "free", None)
    assert d.sim.violations[1].address == 0x1234
    assert d.sim.live_allocations == [SimAllocation(other, 64)]
    d.sim.clear_violations()
    assert d.sim.violations == []


# --------------------------------------------------------------------------- memcheck


def test_kernel_argument_use_after_free_is_caught_and_skipped() -> None:
    d = Dev()
    calls: list[object] = []
    k = kernel("touch", [In("f4"), Out("f4")], lambda *a: calls.append(a))
    good = d.ctx.alloc(16, d.s0)
    gone = d.ctx.alloc(16, d.s0)
    d.ctx.free(gone, 16)
    d.launch(d.s1, k, array(good, (4,), access=Access.READ), array(gone, (4,)))
    assert calls == []  # the reference did not run
    assert d.sim.violations == [Violation("use_after_free", gone, 16, "launch touch (argument 1)", 1)]
    assert d.sim.statistics().launches == 1


def test_memcheck_resolves_addresses_at_execution_time() -> None:
    d = Dev()
    calls: list[object] = []
    k = kernel("late", [Out("f4")], lambda a: calls.append(a))
    ptr = d.ctx.alloc(16, d.s0)
    d.sim.hold()
    d.launch(d.s0, k, array(ptr, (4,)))
    assert d.sim.violations == []  # enqueue did not resolve anything
    d.ctx.free(ptr, 16)  # a lifetime bug: freed while the launch is in flight
    assert d.sim.complete_next()
    assert [v.kind for v in d.sim.violations] == ["use_after_free"]
    assert calls == []


def test_copies_and_host_reads_of_freed_memory_are_caught() -> None:
    d = Dev()
    live = d.upload(np.ones(4, F4))
    gone = d.ctx.alloc(16, d.s0)
    d.ctx.free(gone, 16)
    d.ctx.copy_h2d(d.s0, gone, np.zeros(4, F4))
    host = d.download(gone, (4,))
    d.ctx.copy_d2d(d.s1, live, gone, 16)
    d.ctx.copy_d2d(d.s1, gone, live, 16)
    d.ctx.fill(d.s1, gone, b"\x00", 16)
    kinds = [(v.kind, v.op, v.stream) for v in d.sim.violations]
    assert kinds == [
        ("use_after_free", "h2d destination", 0),
        ("use_after_free", "d2h source (host read)", 0),
        ("use_after_free", "d2d source", 1),
        ("use_after_free", "d2d destination", 1),
        ("use_after_free", "fill destination", 1),
    ]
    assert host.tolist() == [7, 7, 7, 7]  # the host read was skipped
    assert d.download(live, (4,)).tolist() == [1, 1, 1, 1]  # the bad d2d was skipped


def test_unallocated_and_out_of_bounds_ranges() -> None:
    d = Dev()
    ptr = d.ctx.alloc(100, d.s0)
    after = d.ctx.alloc(16, d.s0)
    assert after >= ptr + 512  # a 256-byte red zone separates allocations
    d.ctx.fill(d.s0, ptr + 96, b"\x01", 8)  # runs 4 bytes past the end
    d.ctx.fill(d.s0, 0x1000, b"\x01", 1)  # below the address space
    d.ctx.fill(d.s0, ptr + 256, b"\x01", 1)  # in the red zone after the allocation
    d.ctx.fill(d.s0, ptr + 92, b"\x01", 8)  # exactly the last 8 bytes: fine
    assert [(v.kind, v.address, v.size) for v in d.sim.violations] == [
        ("out_of_bounds", ptr + 96, 8),
        ("unallocated", 0x1000, 1),
        ("unallocated", ptr + 256, 1),
    ]
    assert d.sim.peek(ptr + 90, 10) == b"\x00\x00" + b"\x01" * 8


def test_zero_byte_accesses() -> None:
    d = Dev()
    seen: list[np.ndarray[Any, Any]] = []
    k = kernel("empty", [Out("f4")], lambda a: seen.append(a))
    empty = d.ctx.alloc(0, d.s0)
    d.launch(d.s0, k, array(empty, (0,)))
    d.launch(d.s0, k, array(0, (0,)))  # a null pointer for an empty array touches nothing
    assert [a.shape for a in seen] == [(0,), (0,)]
    assert d.sim.violations == []
    d.ctx.free(empty, 0)
    d.launch(d.s0, k, array(empty, (0,)))
    assert [v.kind for v in d.sim.violations] == ["use_after_free"]
    assert len(seen) == 2


# --------------------------------------------------------------------------- data path


def test_h2d_stages_at_enqueue_and_d2h_writes_at_execution() -> None:
    d = Dev()
    ptr = d.ctx.alloc(16, d.s0)
    src = np.arange(4, dtype=F4)
    d.sim.hold()
    assert d.ctx.copy_h2d(d.s0, ptr, src) is None
    src[:] = -1  # the caller may reuse its buffer at once
    dst = np.zeros(4, F4)
    assert d.ctx.copy_d2h(d.s0, dst, ptr) is None
    assert d.sim.pending == 2
    assert d.sim.complete_next()
    assert dst.tolist() == [0, 0, 0, 0]  # not read yet
    assert d.sim.complete_next()
    assert dst.tolist() == [0, 1, 2, 3]
    stats = d.sim.statistics()
    assert (stats.copies, stats.bytes_copied, stats.pending) == (2, 32, 0)


def test_d2h_rejects_non_contiguous_destination() -> None:
    d = Dev()
    ptr = d.ctx.alloc(16, d.s0)
    with pytest.raises(ValueError, match="C-contiguous"):
        d.ctx.copy_d2h(d.s0, np.zeros(8, F4)[::2], ptr)
    assert d.sim.pending == 0


@pytest.mark.parametrize("pattern", [b"\xab", b"\x01\x02", b"\x01\x02\x03\x04", bytes(range(8))])
def test_fill_repeats_the_pattern(pattern: bytes) -> None:
    d = Dev()
    ptr = d.ctx.alloc(64, d.s0)
    d.ctx.fill(d.s0, ptr + len(pattern), pattern, 3)
    assert d.sim.peek(ptr, 64) == bytes(len(pattern)) + pattern * 3 + bytes(64 - 4 * len(pattern))
    assert d.sim.statistics().fills == 1


def test_fill_rejects_bad_pattern() -> None:
    d = Dev()
    ptr = d.ctx.alloc(64, d.s0)
    with pytest.raises(ValueError, match="pattern"):
        d.ctx.fill(d.s0, ptr, b"abc", 1)


def test_d2d_copies_including_overlap() -> None:
    d = Dev()
    ptr = d.upload(np.arange(8, dtype=np.uint8))
    other = d.ctx.alloc(8, d.s0)
    d.ctx.copy_d2d(d.s0, other, ptr, 8)
    d.ctx.copy_d2d(d.s0, ptr + 2, ptr, 6)
    assert d.sim.peek(other, 8) == bytes(range(8))
    assert d.sim.peek(ptr, 8) == bytes([0, 1, 0, 1, 2, 3, 4, 5])


# --------------------------------------------------------------------------- references


def test_reference_receives_views_scalars_slices_and_raw() -> None:
    d = Dev()
    got: dict[str, Any] = {}

    def ref(alpha: Any, x: Any, y: Any, s: Any, n: Any, raw: Any) -> None:
        got.update(alpha=alpha, x=x, y=y, s=s, n=n, raw=raw)
        y[:] = alpha * x
        s[:] += 1

    k = kernel("saxpy", [Scalar("f4"), In("f4"), Out("f4"), Slice("i4", len_dtype="u4"), Scalar("u1")], ref)
    base = d.ctx.alloc(64, d.s0)
    d.ctx.copy_h2d(d.s0, base + 16, np.arange(3, dtype=F4))
    launch = prepared(
        k,
        ArgView("scalar", dtype=F4, value=np.float32(2.0)),
        array(base + 16, (3,), access=Access.READ),
        array(base + 32, (3,)),
        ArgView(
            "slice", base, (2, 2), np.dtype("i4"), length=4, access=Access.WRITE, len_dtype=np.dtype("u4")
        ),
        ArgView("raw", value=b"\x05"),
    )
    d.ctx.launch(d.s0, d.ctx.load_kernel(k), launch)
    assert type(got["alpha"]) is np.float32
    assert got["x"].shape == (3,)
    assert got["x"].dtype == F4
    assert not got["x"].flags.writeable  # READ access
    assert got["y"].flags.writeable
    assert got["s"].shape == (2, 2)
    assert got["s"].dtype == np.dtype("i4")
    assert type(got["n"]) is np.uint32
    assert got["n"] == 4
    assert got["raw"] == b"\x05"
    assert d.download(base + 32, (3,)).tolist() == [0, 2, 4]
    assert d.download(base, (4,), "i4").tolist() == [1, 1, 1, 1]
    assert d.sim.violations == []


def test_reference_writing_a_read_view_fails_the_next_marker() -> None:
    d = Dev()

    def ref(x: np.ndarray[Any, Any]) -> None:
        x[0] = 1

    k = kernel("bad_write", [In("f4")], ref)
    ptr = d.upload(np.zeros(2, F4))
    d.launch(d.s0, k, array(ptr, (2,), access=Access.READ))
    poll = d.ctx.poll_marker(d.ctx.record_marker(d.s0))
    assert poll.state is MarkerState.FAILED
    assert d.download(ptr, (2,)).tolist() == [0, 0]


def test_reference_exception_fails_only_the_next_marker() -> None:
    d = Dev()
    boom = ZeroDivisionError("boom")

    def ref() -> None:
        raise boom

    before = d.ctx.record_marker(d.s0)
    d.launch(d.s0, kernel("explode", [], ref))
    m1 = d.ctx.record_marker(d.s0)
    log: list[str] = []
    d.launch(d.s0, recorder(log, "after"))
    m2 = d.ctx.record_marker(d.s0)
    assert d.ctx.poll_marker(before) is DONE
    p1 = d.ctx.poll_marker(m1)
    assert p1.state is MarkerState.FAILED
    assert isinstance(p1.error, LaunchError)
    assert p1.error.code == 719
    assert p1.error.name == "CUDA_ERROR_LAUNCH_FAILED"
    assert "explode" in str(p1.error)
    assert p1.error.__cause__ is boom
    assert d.ctx.poll_marker(m2) == DONE  # not sticky
    assert log == ["after"]
    assert d.ctx.poll_marker(m1) == p1  # stable


def test_several_errors_before_one_marker_keep_the_first() -> None:
    d = Dev()
    d.sim.inject_fault("kernel_fault", count=2)
    d.launch(d.s0, kernel("one", [], NO_REFERENCE))
    d.launch(d.s0, kernel("two", [], NO_REFERENCE))
    p = d.ctx.poll_marker(d.ctx.record_marker(d.s0))
    assert p.state is MarkerState.FAILED
    assert "one" in str(p.error)
    assert any("1 more error" in n for n in getattr(p.error, "__notes__", []))


def test_no_reference_does_nothing_but_executes() -> None:
    d = Dev()
    d.launch(d.s0, kernel("noop", [], NO_REFERENCE))
    assert d.ctx.poll_marker(d.ctx.record_marker(d.s0)) is DONE
    assert d.sim.statistics().launches == 1


def test_a_kernel_without_reference_is_refused_at_load() -> None:
    d = Dev()
    with pytest.raises(MissingReferenceError, match=r"'noop' has no reference="):
        d.ctx.load_kernel(kernel("noop", [], None))
    assert d.sim.statistics().kernel_loads == 0
    assert d.sim.pending == 0


def test_launch_config_is_checked() -> None:
    d = Dev()
    k = kernel("big", [], NO_REFERENCE)
    with pytest.raises(LaunchError) as info:
        d.ctx.launch(d.s0, d.ctx.load_kernel(k), prepared(k, block=(2048, 1, 1)))
    assert info.value.code == 1
    assert d.sim.pending == 0
    assert d.sim.statistics().launches == 0


def test_function_must_come_from_this_context() -> None:
    d = Dev()
    other = d.sim.open_context()
    k = kernel("k", [], NO_REFERENCE)
    with pytest.raises(ValueError, match=r"^function: .* belongs to another simulator context$"):
        d.ctx.launch(d.s0, other.load_kernel(k), prepared(k))
    assert d.sim.pending == 0
    with pytest.raises(TypeError, match="SimFunction"):
        d.ctx.launch(d.s0, object(), prepared(k))


def test_launch_of_an_unloaded_module_is_a_violation() -> None:
    d = Dev()
    log: list[str] = []
    k = recorder(log, "mod")
    fn = d.ctx.load_kernel(k)
    d.sim.hold()
    d.ctx.launch(d.s0, fn, prepared(k))
    d.ctx.unload_kernel(fn)
    d.sim.run_until_idle()
    assert log == []
    assert [(v.kind, v.address) for v in d.sim.violations] == [("use_after_free", fn.handle)]
    with pytest.raises(CudaError, match="INVALID_HANDLE"):
        d.ctx.launch(d.s0, fn, prepared(k))
    d.ctx.unload_kernel(fn)
    assert d.sim.violations[-1].kind == "double_free"
    stats = d.sim.statistics()
    assert (stats.kernel_loads, stats.kernel_unloads) == (1, 1)


# --------------------------------------------------------------------------- engine


def test_streams_are_fifo() -> None:
    d = Dev()
    log: list[str] = []
    d.sim.hold()
    for i in range(5):
        d.launch(d.s0, recorder(log, f"a{i}"))
    ptr = d.ctx.alloc(4, d.s0)
    d.ctx.fill(d.s0, ptr, b"\x01", 4)
    d.ctx.fill(d.s0, ptr, b"\x02", 4)
    assert d.sim.run_until_idle() == 7
    assert log == [f"a{i}" for i in range(5)]
    assert d.sim.peek(ptr, 4) == b"\x02" * 4
    seqs = [e.seq for e in d.sim.trace]
    assert seqs == sorted(seqs)


def test_hold_complete_next_run_until_idle_release() -> None:
    d = Dev()
    log: list[str] = []
    d.sim.hold()
    assert d.sim.held
    d.launch(d.s1, recorder(log, "first"))
    d.launch(d.s0, recorder(log, "second"))
    m0 = d.ctx.record_marker(d.s0)
    d.launch(d.s0, recorder(log, "third"))
    d.launch(d.s1, recorder(log, "fourth"))
    d.launch(d.s0, recorder(log, "fifth"))
    assert log == []
    assert d.sim.pending == 6
    assert d.ctx.poll_marker(m0) is PENDING
    assert d.sim.complete_next()
    assert log == ["first"]  # oldest by enqueue order across stream heads
    assert d.sim.complete_next()
    assert log == ["first", "second"]
    assert d.ctx.poll_marker(m0) is DONE  # bookkeeping it unblocked ran with it
    assert d.sim.pending == 3
    assert d.sim.run_until_idle() == 3
    assert d.sim.held  # run_until_idle does not release
    assert log == ["first", "second", "third", "fourth", "fifth"]
    assert d.sim.pending == 0
    d.launch(d.s1, recorder(log, "sixth"))
    assert log[-1] == "fifth"
    d.sim.release()
    assert not d.sim.held
    assert log[-1] == "sixth"
    assert d.sim.pending == 0
    assert not d.sim.complete_next()
    assert d.sim.run_until_idle() == 0


def test_bookkeeping_runs_while_held() -> None:
    d = Dev()
    d.sim.hold()
    m = d.ctx.record_marker(d.s0)
    assert isinstance(m, SimMarker)
    assert m.stream is d.s0
    assert d.ctx.poll_marker(m) is DONE
    d.launch(d.s0, kernel("k", [], NO_REFERENCE))
    m2 = d.ctx.record_marker(d.s0)
    assert d.ctx.poll_marker(m2) is PENDING  # behind held work
    assert d.sim.pending == 2


def test_free_running_executes_on_enqueue() -> None:
    d = Dev()
    log: list[str] = []
    d.launch(d.s0, recorder(log, "now"))
    assert log == ["now"]
    assert d.sim.pending == 0


def test_wait_marker_orders_streams() -> None:
    d = Dev()
    log: list[str] = []
    gate = d.ctx.create_gate(d.s0)
    d.launch(d.s0, recorder(log, "producer"))
    m = d.ctx.record_marker(d.s0)
    d.ctx.wait_marker(d.s1, m)
    d.launch(d.s1, recorder(log, "consumer"))
    m1 = d.ctx.record_marker(d.s1)
    assert log == []  # free-running, but everything waits on the gate
    assert d.ctx.poll_marker(m1) is PENDING
    d.ctx.open_gate(gate)
    assert log == ["producer", "consumer"]
    assert d.ctx.poll_marker(m1) is DONE


def test_wait_marker_while_held_blocks_the_consumer() -> None:
    d = Dev()
    log: list[str] = []
    d.sim.hold()
    d.launch(d.s0, recorder(log, "slow0"))
    d.launch(d.s0, recorder(log, "producer"))
    m = d.ctx.record_marker(d.s0)
    d.ctx.wait_marker(d.s1, m)
    d.launch(d.s1, recorder(log, "consumer"))
    assert d.sim.complete_next()
    assert d.sim.complete_next()
    assert d.sim.complete_next()
    assert log == ["slow0", "producer", "consumer"]
    assert not d.sim.complete_next()


def test_wait_on_an_already_done_marker_does_not_block() -> None:
    d = Dev()
    log: list[str] = []
    m = d.ctx.record_marker(d.s0)
    d.ctx.wait_marker(d.s1, m)
    d.launch(d.s1, recorder(log, "go"))
    assert log == ["go"]


def test_wait_marker_across_contexts_of_one_device() -> None:
    sim = SimDevice()
    a, b = sim.open_context(), sim.open_context()
    sa, sb = a.create_stream(0), b.create_stream(0)
    log: list[str] = []
    k1, k2 = recorder(log, "a"), recorder(log, "b")
    sim.hold()
    a.launch(sa, a.load_kernel(k1), prepared(k1))
    b.wait_marker(sb, a.record_marker(sa))
    b.launch(sb, b.load_kernel(k2), prepared(k2))
    assert sim.pending == 4
    sim.release()
    assert log == ["a", "b"]
    other = SimDevice().open_context()
    with pytest.raises(ValueError, match="another simulated device"):
        other.wait_marker(other.create_stream(0), a.record_marker(sa))


def test_gates_hold_the_stream_until_opened() -> None:
    d = Dev()
    log: list[str] = []
    g = d.ctx.create_gate(d.s0)
    d.launch(d.s0, recorder(log, "behind"))
    d.launch(d.s1, recorder(log, "other stream"))
    assert log == ["other stream"]
    d.ctx.open_gate(g)
    assert log == ["other stream", "behind"]
    d.ctx.open_gate(g)  # idempotent
    assert log == ["other stream", "behind"]


def test_gate_opened_before_it_reaches_the_head() -> None:
    d = Dev()
    log: list[str] = []
    d.sim.hold()
    d.launch(d.s0, recorder(log, "x"))
    g = d.ctx.create_gate(d.s0)
    d.launch(d.s0, recorder(log, "y"))
    d.ctx.open_gate(g)
    assert log == []
    assert d.sim.run_until_idle() == 2
    assert log == ["x", "y"]


def test_gate_stays_closed_while_held_until_opened() -> None:
    d = Dev()
    log: list[str] = []
    d.sim.hold()
    g = d.ctx.create_gate(d.s0)
    d.launch(d.s0, recorder(log, "z"))
    assert not d.sim.complete_next()
    d.ctx.open_gate(g)
    assert log == []  # still held
    assert d.sim.complete_next()
    assert log == ["z"]


# --------------------------------------------------------------------------- faults


def test_inject_fault_validates_kind_and_count() -> None:
    sim = SimDevice()
    with pytest.raises(ValueError, match="kind") as info:
        sim.inject_fault("meltdown")  # type: ignore[arg-type]
    text = str(info.value)
    assert "'meltdown'" in text
    for kind in ("launch_error", "out_of_memory", "kernel_fault", "completion_unknown"):
        assert kind in text
    with pytest.raises(ValueError, match="count"):
        sim.inject_fault("kernel_fault", count=0)


def test_fault_launch_error_raises_and_enqueues_nothing() -> None:
    d = Dev()
    log: list[str] = []
    k = recorder(log, "k")
    d.sim.hold()
    d.sim.inject_fault("launch_error", count=2)
    for _ in range(2):
        with pytest.raises(LaunchError) as info:
            d.launch(d.s0, k)
        assert info.value.code == 701
        assert info.value.name == "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
    assert d.sim.pending == 0
    d.launch(d.s0, k)  # the faults are used up
    d.sim.release()
    assert log == ["k"]


def test_fault_out_of_memory_hits_the_next_alloc() -> None:
    d = Dev()
    d.sim.inject_fault("out_of_memory")
    with pytest.raises(OutOfMemoryError) as info:
        d.ctx.alloc(8, d.s0)
    assert info.value.code == 2
    assert d.sim.live_allocations == []
    d.ctx.alloc(8, d.s0)
    assert len(d.sim.live_allocations) == 1


def test_fault_kernel_fault_is_not_sticky() -> None:
    d = Dev()
    log: list[str] = []
    d.sim.inject_fault("kernel_fault")
    d.launch(d.s0, recorder(log, "faulty"))
    m1 = d.ctx.record_marker(d.s0)
    d.launch(d.s0, recorder(log, "later"))
    m2 = d.ctx.record_marker(d.s0)
    p = d.ctx.poll_marker(m1)
    assert p.state is MarkerState.FAILED
    assert isinstance(p.error, LaunchError)
    assert (p.error.code, p.error.name) == (719, "CUDA_ERROR_LAUNCH_FAILED")
    assert log == ["later"]
    assert d.ctx.poll_marker(m2) is DONE


def test_fault_completion_unknown_marks_the_next_marker_forever() -> None:
    d = Dev()
    log: list[str] = []
    d.sim.inject_fault("completion_unknown")
    d.launch(d.s0, recorder(log, "lost"))
    m1 = d.ctx.record_marker(d.s0)
    d.ctx.wait_marker(d.s1, m1)  # unknown completion counts as satisfied
    d.launch(d.s1, recorder(log, "waiter"))
    d.launch(d.s0, recorder(log, "later"))
    m2 = d.ctx.record_marker(d.s0)
    for _ in range(3):
        p = d.ctx.poll_marker(m1)
        assert p.state is MarkerState.UNKNOWN
        assert isinstance(p.error, CompletionUnknownError)
    assert d.ctx.poll_marker(m2) is DONE
    assert log == ["waiter", "later"]


def test_faults_do_not_touch_other_streams_markers() -> None:
    d = Dev()
    d.sim.inject_fault("kernel_fault")
    d.launch(d.s0, kernel("k", [], NO_REFERENCE))
    assert d.ctx.poll_marker(d.ctx.record_marker(d.s1)) is DONE
    assert d.ctx.poll_marker(d.ctx.record_marker(d.s0)).state is MarkerState.FAILED


# --------------------------------------------------------------------------- lifecycle


def test_destroy_stream_with_queued_commands_raises() -> None:
    d = Dev()
    d.sim.hold()
    d.launch(d.s1, kernel("k", [], NO_REFERENCE))
    d.ctx.record_marker(d.s1)
    with pytest.raises(RuntimeError, match=r"stream 1 .*2 queued"):
        d.ctx.destroy_stream(d.s1)
    d.sim.release()
    d.ctx.destroy_stream(d.s1)
    with pytest.raises(ScopeClosedError):
        d.ctx.record_marker(d.s1)


def test_close_keeps_queued_work_running() -> None:
    d = Dev()
    log: list[str] = []
    d.sim.hold()
    d.launch(d.s0, recorder(log, "in flight"))
    m = d.ctx.record_marker(d.s0)
    d.ctx.close()
    d.ctx.close()  # idempotent
    with pytest.raises(ScopeClosedError):
        d.ctx.create_stream(5)
    with pytest.raises(ScopeClosedError):
        d.launch(d.s0, recorder(log, "too late"))
    d.sim.release()
    assert log == ["in flight"]
    assert d.ctx.poll_marker(m) is DONE


def test_streams_of_another_context_are_rejected() -> None:
    d = Dev()
    other = d.sim.open_context()
    with pytest.raises(ValueError, match="another simulator context"):
        other.record_marker(d.s0)


# --------------------------------------------------------------------------- trace and scale


def test_trace_records_executed_commands() -> None:
    d = Dev(trace_limit=4)
    ptr = d.ctx.alloc(4, d.s0)
    d.ctx.fill(d.s1, ptr, b"\x00", 4)
    d.ctx.record_marker(d.s1)
    events = d.sim.trace
    assert [(e.stream, e.kind) for e in events] == [(1, "fill"), (1, "marker")]
    assert all(isinstance(e, SimCommandRecord) and e.t_enqueue <= e.t_start <= e.t_end for e in events)
    for _ in range(5):
        d.ctx.record_marker(d.s0)
    assert len(d.sim.trace) == 4
    d.sim.clear_trace()
    assert d.sim.trace == []


def test_the_command_record_has_a_name_of_its_own_and_the_old_one_warns() -> None:
    import trio_cuda.testing
    import trio_cuda.trace

    assert trio_cuda.testing.SimCommandRecord is SimCommandRecord
    assert SimCommandRecord is not trio_cuda.trace.TraceEvent
    assert "TraceEvent" not in trio_cuda.testing.__all__
    with pytest.warns(DeprecationWarning, match=r"testing\.TraceEvent is deprecated: use .*SimCommandRecord"):
        from trio_cuda.testing import TraceEvent
    assert TraceEvent is SimCommandRecord
    with pytest.warns(DeprecationWarning, match="SimCommandRecord") as caught:
        assert trio_cuda.testing.TraceEvent is SimCommandRecord
    assert caught[0].filename == __file__  # it points at the line that used the old name
    with pytest.raises(AttributeError, match="has no attribute 'TraceEvents'"):
        trio_cuda.testing.TraceEvents  # noqa: B018


def test_ten_thousand_commands_are_fast() -> None:
    d = Dev()
    streams = [d.s0, d.s1, d.ctx.create_stream(2), d.ctx.create_stream(3)]
    k = kernel("k", [], NO_REFERENCE)
    fn = d.ctx.load_kernel(k)
    pl = prepared(k)
    start = time.perf_counter()
    d.sim.hold()
    markers = []
    for i in range(5000):
        s = streams[i % 4]
        d.ctx.launch(s, fn, pl)
        markers.append(d.ctx.record_marker(s))
    assert d.sim.pending == 10000
    assert d.sim.run_until_idle() == 5000
    d.sim.release()
    for _ in range(5000):  # free-running: each executes on enqueue
        d.ctx.launch(d.s0, fn, pl)
    assert d.sim.pending == 0
    elapsed = time.perf_counter() - start
    assert all(d.ctx.poll_marker(m) is DONE for m in markers)
    assert d.sim.statistics().launches == 10000
    assert elapsed < 5.0


# --------------------------------------------------------------------------- async


@pytest.mark.trio
async def test_timed_free_running_with_wait_for_progress() -> None:
    d = Dev(kernel_time=0.03)
    k = kernel("slow", [], NO_REFERENCE)
    start = time.perf_counter()
    for _ in range(3):
        d.launch(d.s0, k)
    d.launch(d.s1, k)
    m0 = d.ctx.record_marker(d.s0)
    m1 = d.ctx.record_marker(d.s1)
    assert d.ctx.poll_marker(m0) is PENDING
    assert d.sim.pending == 6
    with trio.fail_after(5):
        while d.ctx.poll_marker(m0) is PENDING:
            await d.ctx.wait_for_progress([m0, m1])
    elapsed = time.perf_counter() - start
    assert elapsed >= 0.09
    assert d.ctx.poll_marker(m1) is DONE
    launches = [e for e in d.sim.trace if e.kind == "launch"]
    s0 = [e for e in launches if e.stream == 0]
    (s1,) = [e for e in launches if e.stream == 1]
    for e in launches:
        assert e.t_end - e.t_start == pytest.approx(0.03)
    for a, b in itertools.pairwise(s0):
        assert b.t_start == pytest.approx(a.t_end)  # back to back on one stream
    assert s1.t_start < s0[0].t_end  # the two streams ran concurrently


@pytest.mark.trio
async def test_wait_for_progress_wakes_on_complete_next() -> None:
    d = Dev()
    d.sim.hold()
    d.launch(d.s0, kernel("k", [], NO_REFERENCE))
    m = d.ctx.record_marker(d.s0)
    woke: list[Poll] = []

    async def waiter() -> None:
        while d.ctx.poll_marker(m) is PENDING:
            await d.ctx.wait_for_progress([m])
        woke.append(d.ctx.poll_marker(m))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.02)
            assert woke == []  # nothing happened yet, and the loop was not blocked
            assert d.sim.complete_next()
    assert woke == [DONE]


@pytest.mark.trio
async def test_wait_for_progress_is_cancellable_while_held() -> None:
    d = Dev()
    d.sim.hold()
    d.launch(d.s0, kernel("k", [], NO_REFERENCE))
    m = d.ctx.record_marker(d.s0)
    with trio.move_on_after(0.02) as cs:
        await d.ctx.wait_for_progress([m])
    assert cs.cancelled_caught
    d.sim.release()  # sets the now unwatched event
    assert d.ctx.poll_marker(m) is DONE


@pytest.mark.trio
async def test_release_wakes_a_timed_waiter_promptly() -> None:
    d = Dev(kernel_time=0.01)
    d.sim.hold()
    d.launch(d.s0, kernel("k", [], NO_REFERENCE))
    m = d.ctx.record_marker(d.s0)

    async def releaser() -> None:
        await trio.sleep(0.02)
        d.sim.release()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(releaser)
            while d.ctx.poll_marker(m) is PENDING:
                await d.ctx.wait_for_progress([m])
    assert not d.sim.held


def test_controls_work_without_a_trio_run() -> None:
    d = Dev()
    d.sim.hold()
    d.launch(d.s0, kernel("k", [], NO_REFERENCE))
    m = d.ctx.record_marker(d.s0)

    async def park() -> None:
        with trio.move_on_after(0.01):
            await d.ctx.wait_for_progress([m])

    trio.run(park)  # leaves an event behind that nobody waits on
    d.sim.release()  # sets it outside any run
    assert d.ctx.poll_marker(m) is DONE
    d.ctx.notify_submitted()
