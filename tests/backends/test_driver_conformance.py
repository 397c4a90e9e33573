"""DeviceContext conformance: the driver protocol, called directly, on every backend.

Every test takes the ``drv`` fixture: it runs on the simulated device and,
where a CUDA device answers (``trio_cuda._backends.probe_cuda()``), on the real
GPU (those params are marked ``gpu``; elsewhere they skip cleanly), as in
``test_contract.py``. The tests call ``trio_cuda._core._driver.DeviceContext``
and ``InteropContext`` themselves, without a scope, and prove that the two
backends agree on what the protocol promises: streams, memory, copies and
fills, markers and gates, graph capture, interop answers, and the checks and
errors of ``trio_cuda._backends._common`` (same type, same message but for the
backend's class names). Under compute-sanitizer (detected by
``tests/helpers/sanitizer.py``) the parts that make a driver call fail on purpose are
skipped on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers.sanitizer import skip_rest_under_sanitizer
from trio_cuda import CudaError, DeviceInfo, GraphCaptureError, OutOfMemoryError, ScopeClosedError
from trio_cuda._backends import open_device, probe_cuda
from trio_cuda._core._driver import Capabilities, MarkerState, Poll
from trio_cuda.testing import SimDevice

_PROBE = probe_cuda()
N = 256  # bytes of the buffers below

NOP = trio_cuda.Kernel.from_source(
    'extern "C" __global__ void nop() {}', "nop", params=[], reference=lambda: None
)


class Driver:
    """Two contexts of one backend (``ctx`` and ``other``) and what a test
    needs to name the backend's classes in expected messages."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sim: SimDevice | None = SimDevice() if name == "sim" else None
        device: object = self.sim if self.sim is not None else "cuda"
        self.ctx: Any = open_device(device)
        self.other: Any = open_device(device)
        self.cls = "Sim" if self.sim is not None else "Cuda"  # class-name prefix
        self.kind = "simulator" if self.sim is not None else "CUDA"  # "another ... context"
        self.gates: list[Any] = []

    def gate(self, stream: Any) -> Any:
        """A gate that the fixture opens at the latest on the way out."""
        g = self.ctx.create_gate(stream)
        self.gates.append(g)
        return g

    def close(self) -> None:
        for g in self.gates:
            if not g.opened:
                self.ctx.open_gate(g)
        self.other.close()
        self.ctx.close()


#: the backends, as ``test_contract.py`` parametrises them: the cuda one is marked
#: ``gpu`` and skips cleanly without a CUDA device
CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}"),
    ],
)


@pytest.fixture(params=["sim", CUDA])
def drv(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Driver]:
    if request.param == "cuda":
        monkeypatch.setenv("TRIO_CUDA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "nvrtc-cache"))
    d = Driver(request.param)
    yield d
    d.close()
    if d.sim is not None:
        assert d.sim.violations == [], d.sim.violations


def deliberate_failure(drv: Driver) -> None:
    """What follows makes a driver call fail on purpose: compute-sanitizer
    reports every failed call as an error, so under it the rest is skipped."""
    if drv.name == "cuda":
        skip_rest_under_sanitizer(
            "the rest makes a driver call fail on purpose, which compute-sanitizer reports"
        )


async def done(ctx: Any, *markers: Any) -> list[Poll]:
    """Wait (``wait_for_progress``) until no marker polls PENDING."""
    with trio.fail_after(10):
        while True:
            polls = [ctx.poll_marker(m) for m in markers]
            pending = [m for m, p in zip(markers, polls) if p.state is MarkerState.PENDING]
            if not pending:
                return polls
            await ctx.wait_for_progress(pending)


async def download(ctx: Any, stream: Any, ptr: int, nbytes: int = N) -> np.ndarray:
    """The device bytes at ``ptr``, after the work enqueued on ``stream`` so far."""
    out = np.full(nbytes, 0xEE, dtype=np.uint8)
    finisher = ctx.copy_d2h(stream, out, ptr)
    await done(ctx, ctx.record_marker(stream))
    if finisher is not None:
        finisher()
    return out


# --------------------------------------------------------------------------- records


def test_capabilities_and_info_are_frozen_records(drv: Driver) -> None:
    caps = drv.ctx.capabilities
    assert type(caps) is Capabilities
    assert caps == drv.ctx.capabilities
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        caps.batch_markers = not caps.batch_markers
    info = drv.ctx.info
    assert type(info) is DeviceInfo
    assert info.backend == drv.name
    assert info.total_memory > 0
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        info.name = "renamed"


# --------------------------------------------------------------------------- streams and memory


async def test_streams_are_created_and_destroyed(drv: Driver) -> None:
    ctx = drv.ctx
    s = ctx.create_stream(7)
    assert s.index == 7
    fn = ctx.load_kernel(NOP)
    prepared = NOP.launch(grid=1, block=1).prepared
    ctx.launch(s, fn, prepared)
    ctx.launch(s, fn, prepared)  # (enqueued again: from what the first launch cached)
    await done(ctx, ctx.record_marker(s))
    ctx.destroy_stream(s)
    uses: list[Callable[[Any], object]] = [
        ctx.record_marker,
        ctx.create_gate,
        ctx.destroy_stream,
        ctx.stream_address,
        ctx.begin_capture,
        lambda s: ctx.alloc(N, s),
        lambda s: ctx.fill(s, 0, b"\0", 4),
        lambda s: ctx.launch(s, fn, prepared),
    ]
    for use in uses:
        with pytest.raises(ScopeClosedError, match=r"^stream 7 was destroyed$"):
            use(s)
    ctx.unload_kernel(fn)


async def test_alloc_free_and_out_of_memory(drv: Driver) -> None:
    ctx = drv.ctx
    s = ctx.create_stream(0)
    p = ctx.alloc(1 << 20, s)
    assert type(p) is int
    assert p != 0
    assert ctx.pointer_device(p, 1 << 20) is None
    await done(ctx, ctx.record_marker(s))
    ctx.free(p, 1 << 20)
    deliberate_failure(drv)
    with pytest.raises(OutOfMemoryError) as info:
        ctx.alloc(ctx.info.total_memory * 4, s)
    assert (info.value.code, info.value.name) == (2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert await done(ctx, ctx.record_marker(s)) == [Poll(MarkerState.DONE)]


async def test_copies_round_trip(drv: Driver) -> None:
    ctx = drv.ctx
    s = ctx.create_stream(0)
    a, b = ctx.alloc(N, s), ctx.alloc(N, s)
    src = np.arange(N, dtype=np.uint8)
    token = ctx.copy_h2d(s, a, src)  # retained until the copy completed
    src[:] = 0  # staged: the caller may change the source at once
    ctx.copy_d2d(s, b, a, N)
    out = np.zeros(N, dtype=np.uint8)
    finisher = ctx.copy_d2h(s, out, b)
    direct = np.zeros(N, dtype=np.uint8)
    assert ctx.copy_d2h(s, direct, a, direct=True) is None  # written without a finisher
    await done(ctx, ctx.record_marker(s))
    del token
    if finisher is not None:
        finisher()
    np.testing.assert_array_equal(out, np.arange(N, dtype=np.uint8))
    np.testing.assert_array_equal(direct, np.arange(N, dtype=np.uint8))
    # empty copies and fills are accepted and change nothing
    ctx.copy_h2d(s, a, np.zeros(0, dtype=np.uint8))
    ctx.copy_d2d(s, b, a, 0)
    ctx.fill(s, a, b"\xff", 0)
    ctx.copy_d2h(s, np.zeros(0, dtype=np.uint8), a)
    np.testing.assert_array_equal(await download(ctx, s, a), np.arange(N, dtype=np.uint8))
    ctx.free(a, N)
    ctx.free(b, N)


@pytest.mark.parametrize(
    "pattern",
    [b"\x5a", b"\x01\x02", b"\x01\x02\x03\x04", b"\x07" * 8, b"\x01\x02\x03\x04" * 2, bytes(range(1, 9))],
    ids=["1", "2", "4", "8-uniform", "8-halves", "8"],
)
async def test_fills_round_trip(drv: Driver, pattern: bytes) -> None:
    ctx = drv.ctx
    s = ctx.create_stream(0)
    p = ctx.alloc(N, s)
    ctx.fill(s, p, b"\0", N)
    count = (N - 16) // len(pattern)
    ctx.fill(s, p + 8, pattern, count)
    expected = np.zeros(N, dtype=np.uint8)
    expected[8 : 8 + count * len(pattern)] = np.frombuffer(pattern * count, dtype=np.uint8)
    np.testing.assert_array_equal(await download(ctx, s, p), expected)
    ctx.free(p, N)


# --------------------------------------------------------------------------- markers and gates


async def test_markers_and_gates_order_streams(drv: Driver) -> None:
    ctx = drv.ctx
    s1, s2 = ctx.create_stream(1), ctx.create_stream(2)
    p = ctx.alloc(N, s1)
    await done(ctx, ctx.record_marker(s1))
    first = ctx.record_marker(s1)
    gate = drv.gate(s1)
    ctx.fill(s1, p, b"\x11", N)
    m1 = ctx.record_marker(s1)
    ctx.wait_marker(s2, m1)  # s2 waits, device-side, for s1's fill
    out = np.zeros(N, dtype=np.uint8)
    finisher = ctx.copy_d2h(s2, out, p)
    m2 = ctx.record_marker(s2)
    assert await done(ctx, first) == [Poll(MarkerState.DONE)]
    await trio.sleep(0.02)
    assert [ctx.poll_marker(m).state for m in (m1, m2)] == [MarkerState.PENDING] * 2
    ctx.open_gate(gate)
    ctx.open_gate(gate)  # opening twice is a no-op
    assert gate.opened
    assert await done(ctx, m2, m1) == [Poll(MarkerState.DONE)] * 2
    if finisher is not None:
        finisher()
    np.testing.assert_array_equal(out, np.full(N, 0x11, dtype=np.uint8))
    ctx.free(p, N)


# --------------------------------------------------------------------------- shared checks


def _bad_d2h(dst: object) -> Callable[[Any, Any, int], object]:
    return lambda ctx, s, p: ctx.copy_d2h(s, dst, p)


READ_ONLY = np.zeros(N, dtype=np.uint8)
READ_ONLY.setflags(write=False)

NON_NEGATIVE = "expected a non-negative int, got"
CONTIGUOUS = "expected a writeable C-contiguous numpy array, got"
BAD_ARGUMENTS = [
    pytest.param(lambda ctx, s, p: ctx.alloc(-1, s), rf"^nbytes: {NON_NEGATIVE} -1$", id="alloc-negative"),
    pytest.param(lambda ctx, s, p: ctx.alloc(1.5, s), rf"^nbytes: {NON_NEGATIVE} 1\.5$", id="alloc-float"),
    pytest.param(lambda ctx, s, p: ctx.alloc(True, s), rf"^nbytes: {NON_NEGATIVE} True$", id="alloc-bool"),
    pytest.param(lambda ctx, s, p: ctx.copy_d2d(s, p, p, -1), rf"^nbytes: {NON_NEGATIVE} -1$", id="d2d"),
    pytest.param(
        lambda ctx, s, p: ctx.fill(s, p, b"abc", 1),
        r"^pattern: expected 1, 2, 4 or 8 bytes, got 3$",
        id="pattern",
    ),
    pytest.param(lambda ctx, s, p: ctx.fill(s, p, b"\0", -1), rf"^count: {NON_NEGATIVE} -1$", id="count"),
    pytest.param(
        _bad_d2h(np.zeros((16, 32), np.uint8)[:, ::2]), rf"^dst: {CONTIGUOUS} ndarray$", id="strided"
    ),
    pytest.param(_bad_d2h(READ_ONLY), rf"^dst: {CONTIGUOUS} ndarray$", id="read-only"),
    pytest.param(_bad_d2h([0] * N), rf"^dst: {CONTIGUOUS} list$", id="list"),
]


@pytest.mark.parametrize(("call", "message"), BAD_ARGUMENTS)
async def test_bad_arguments_raise_alike_and_enqueue_nothing(
    drv: Driver, call: Callable[[Any, Any, int], object], message: str
) -> None:
    ctx = drv.ctx
    s = ctx.create_stream(0)
    p = ctx.alloc(N, s)
    ctx.fill(s, p, b"\x42", N)
    with pytest.raises(ValueError, match=message):
        call(ctx, s, p)
    np.testing.assert_array_equal(await download(ctx, s, p), np.full(N, 0x42, dtype=np.uint8))
    ctx.free(p, N)


STREAM_USES: list[tuple[str, Callable[[Any, Any, Any], object]]] = [
    ("alloc", lambda ctx, s, m: ctx.alloc(N, s)),
    ("copy_h2d", lambda ctx, s, m: ctx.copy_h2d(s, 0, np.zeros(4, np.uint8))),
    ("copy_d2h", lambda ctx, s, m: ctx.copy_d2h(s, np.zeros(4, np.uint8), 0)),
    ("copy_d2d", lambda ctx, s, m: ctx.copy_d2d(s, 0, 0, 4)),
    ("fill", lambda ctx, s, m: ctx.fill(s, 0, b"\0", 4)),
    ("record_marker", lambda ctx, s, m: ctx.record_marker(s)),
    ("wait_marker", lambda ctx, s, m: ctx.wait_marker(s, m)),
    ("create_gate", lambda ctx, s, m: ctx.create_gate(s)),
    ("begin_capture", lambda ctx, s, m: ctx.begin_capture(s)),
    ("stream_address", lambda ctx, s, m: ctx.stream_address(s)),
    ("destroy_stream", lambda ctx, s, m: ctx.destroy_stream(s)),
    ("launch", lambda ctx, s, m: ctx.launch(s, ctx.load_kernel(NOP), NOP.launch(grid=1, block=1).prepared)),
]


@pytest.mark.parametrize("use", [u[1] for u in STREAM_USES], ids=[u[0] for u in STREAM_USES])
async def test_streams_of_another_context_and_non_streams_are_refused(
    drv: Driver, use: Callable[[Any, Any, Any], object]
) -> None:
    ctx = drv.ctx
    mine = ctx.create_stream(0)
    marker = ctx.record_marker(mine)
    theirs = drv.other.create_stream(3)
    with pytest.raises(ValueError, match=rf"^stream: .* belongs to another {drv.kind} context$"):
        use(ctx, theirs, marker)
    with pytest.raises(TypeError, match=rf"^stream: expected a {drv.cls}Stream, got object$"):
        use(ctx, object(), marker)
    # nothing was enqueued on either stream, and both are usable
    assert await done(ctx, ctx.record_marker(mine)) == [Poll(MarkerState.DONE)]
    assert await done(drv.other, drv.other.record_marker(theirs)) == [Poll(MarkerState.DONE)]


async def test_kernel_functions_of_another_context_and_unloaded_ones_are_refused(drv: Driver) -> None:
    ctx = drv.ctx
    s = ctx.create_stream(0)
    prepared = NOP.launch(grid=1, block=1).prepared
    theirs = drv.other.load_kernel(NOP)
    another = rf"^function: .* belongs to another {drv.kind} context$"
    with pytest.raises(ValueError, match=another):
        ctx.check_launch(theirs, prepared)
    with pytest.raises(ValueError, match=another):
        ctx.launch(s, theirs, prepared)
    not_one = rf"^function: expected a {drv.cls}Function from load_kernel, got object$"
    for call in (
        lambda: ctx.check_launch(object(), prepared),
        lambda: ctx.launch(s, object(), prepared),
        lambda: ctx.unload_kernel(object()),
    ):
        with pytest.raises(TypeError, match=not_one):
            call()
    fn = ctx.load_kernel(NOP)
    ctx.check_launch(fn, prepared)
    ctx.launch(s, fn, prepared)
    assert await done(ctx, ctx.record_marker(s)) == [Poll(MarkerState.DONE)]
    ctx.unload_kernel(fn)
    with pytest.raises(CudaError) as info:
        ctx.launch(s, fn, prepared)
    assert info.value.name == "CUDA_ERROR_INVALID_HANDLE"
    drv.other.unload_kernel(theirs)


def test_gates_and_markers_of_the_wrong_type_are_refused(drv: Driver) -> None:
    ctx = drv.ctx
    s = ctx.create_stream(0)
    with pytest.raises(TypeError, match=rf"^gate: expected a {drv.cls}Gate, got object$"):
        ctx.open_gate(object())
    with pytest.raises(TypeError, match=rf"^marker: expected a {drv.cls}Marker, got object$"):
        ctx.wait_marker(s, object())


# --------------------------------------------------------------------------- graphs


async def test_graph_capture_instantiate_launch_and_destroy(drv: Driver) -> None:
    ctx = drv.ctx
    s, s2 = ctx.create_stream(0), ctx.create_stream(1)
    p = ctx.alloc(N, s)
    ctx.fill(s, p, b"\0", N)
    before = ctx.record_marker(s2)
    await done(ctx, ctx.record_marker(s), before)
    direct = np.zeros(N, dtype=np.uint8)

    ctx.begin_capture(s)
    capturing = r"^{}: stream 0 is capturing a graph; completion markers, waits and gates cannot be captured$"
    refusals: list[tuple[Callable[[], object], str]] = [
        (lambda: ctx.begin_capture(s2), r"^begin_capture: stream 0 of this context is already capturing$"),
        (lambda: ctx.alloc(64, s2), r"^allocating 64 bytes while stream 0 captures a graph"),
        (lambda: ctx.record_marker(s), capturing.format(r"marker \d+")),
        (lambda: ctx.wait_marker(s, before), capturing.format(rf"wait stream 1 marker {before.seq}")),
        (lambda: ctx.create_gate(s), capturing.format("gate")),
        (
            lambda: ctx.copy_d2h(s, direct, p, direct=True),
            r"^a synchronising device-to-host copy on stream 0 while it captures a graph$",
        ),
    ]
    for call, message in refusals:
        with pytest.raises(GraphCaptureError, match=message):
            call()
    ctx.fill(s, p, b"\x07", N)  # recorded, not executed
    template = ctx.end_capture(s)
    with pytest.raises(GraphCaptureError, match=r"^end_capture: stream 0 is not capturing$"):
        ctx.end_capture(s)
    np.testing.assert_array_equal(await download(ctx, s, p), np.zeros(N, dtype=np.uint8))

    with pytest.raises(TypeError, match=r"^graph: expected a \w+ of this context from end_capture"):
        drv.other.instantiate(template)
    graph_exec = ctx.instantiate(template)
    with pytest.raises(ValueError, match=r"^graph: .* was already instantiated or used for an update$"):
        ctx.instantiate(template)
    with pytest.raises(TypeError, match=r"^graph_exec: expected a \w+ of this context from instantiate"):
        drv.other.graph_upload(graph_exec)
    ctx.graph_upload(graph_exec)  # returns once uploaded; runs nothing
    np.testing.assert_array_equal(await download(ctx, s, p), np.zeros(N, dtype=np.uint8))
    ctx.fill(s, p, b"\0", N)
    ctx.graph_launch(s, graph_exec)
    np.testing.assert_array_equal(await download(ctx, s, p), np.full(N, 7, dtype=np.uint8))

    with pytest.raises(TypeError, match=r"^graph_exec: expected a \w+ of this context from instantiate"):
        drv.other.destroy_graph(graph_exec)
    ctx.destroy_graph(graph_exec)
    with pytest.raises(CudaError, match=r"was destroyed") as info:
        ctx.graph_launch(s, graph_exec)
    assert info.value.name == "CUDA_ERROR_INVALID_HANDLE"
    with pytest.raises(CudaError, match=r"was destroyed") as info:
        ctx.graph_upload(graph_exec)
    assert info.value.name == "CUDA_ERROR_INVALID_HANDLE"

    # an aborted capture runs nothing and leaves the stream usable
    ctx.begin_capture(s)
    ctx.fill(s, p, b"\x09", N)
    ctx.abort_capture(s)
    np.testing.assert_array_equal(await download(ctx, s, p), np.full(N, 7, dtype=np.uint8))
    ctx.free(p, N)


async def test_graph_upload_and_update_run_where_the_capabilities_say(drv: Driver) -> None:
    """``instantiate``, ``graph_upload`` and ``graph_update`` run in a worker
    thread where ``instantiate_in_thread`` says so (the core's way), on the
    loop otherwise; an update changes later launches only."""
    ctx = drv.ctx
    s = ctx.create_stream(0)
    p = ctx.alloc(N, s)
    await done(ctx, ctx.record_marker(s))

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        if ctx.capabilities.instantiate_in_thread:
            return await trio.to_thread.run_sync(fn, *args)
        return fn(*args)

    def capture_fill(value: int) -> Any:
        ctx.begin_capture(s)
        ctx.fill(s, p, bytes([value]), N)
        return ctx.end_capture(s)

    graph_exec = await call(ctx.instantiate, capture_fill(3))
    await call(ctx.graph_upload, graph_exec)
    ctx.graph_launch(s, graph_exec)
    np.testing.assert_array_equal(await download(ctx, s, p), np.full(N, 3, dtype=np.uint8))
    await call(ctx.graph_update, graph_exec, capture_fill(5))
    ctx.graph_launch(s, graph_exec)
    np.testing.assert_array_equal(await download(ctx, s, p), np.full(N, 5, dtype=np.uint8))

    deliberate_failure(drv)
    ctx.begin_capture(s)
    ctx.fill(s, p, b"\x01", N)
    ctx.fill(s, p, b"\x02", N)
    other_topology = ctx.end_capture(s)
    with pytest.raises(GraphCaptureError):
        await call(ctx.graph_update, graph_exec, other_topology)
    ctx.graph_launch(s, graph_exec)  # unchanged
    np.testing.assert_array_equal(await download(ctx, s, p), np.full(N, 5, dtype=np.uint8))
    ctx.destroy_graph(graph_exec)
    ctx.free(p, N)


# --------------------------------------------------------------------------- interop and close


async def test_interop_answers(drv: Driver) -> None:
    ctx = drv.ctx
    s, s2 = ctx.create_stream(0), ctx.create_stream(1)
    device_type, device_id = ctx.dlpack_device()
    assert device_type == {"sim": 12, "cuda": 2}[drv.name]  # kDLExtDev / kDLCUDA
    assert type(device_id) is int
    addresses = {ctx.stream_address(s), ctx.stream_address(s2)}
    assert len(addresses) == 2
    assert all(type(a) is int for a in addresses)
    p = ctx.alloc(N, s)
    assert ctx.pointer_device(p, N) is None
    assert ctx.pointer_device(p, 0) is None
    await done(ctx, ctx.record_marker(s))
    ctx.free(p, N)
    deliberate_failure(drv)
    host = np.zeros(N, dtype=np.uint8)
    assert isinstance(ctx.pointer_device(host.ctypes.data, N), str)


def test_a_closed_context_refuses_new_streams(drv: Driver) -> None:
    other = drv.other
    other.close()
    other.close()  # idempotent
    with pytest.raises(ScopeClosedError, match=r": this context is closed$"):
        other.create_stream(0)
