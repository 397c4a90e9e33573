"""The cuda backend's compiled hot methods (``_direct.c``: ``HotLaunch``,
``HotRecord``, ``HotPoll``) against their reference, the Python methods
``Kernels.launch``, ``StreamTable.record_marker`` and
``StreamTable.poll_marker``.

Without a GPU: two copies of a stream table and its kernels run on a
stand-in device (ctypes functions with the driver's prototypes for
``cuLaunchKernel`` and ``cuStreamWriteValue32``; flag writes land in host
memory when the test lets them). One copy calls the compiled methods, the
other the Python ones; random programs must give the same driver calls,
markers, polls, errors and state. The real driver runs both in
``test_direct_calls.py`` (marked ``gpu``).
"""

from __future__ import annotations

import copy
import ctypes
import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_cuda
from trio_cuda import Scalar
from trio_cuda._backends.cuda import direct
from trio_cuda._backends.cuda import primary as _primary
from trio_cuda._backends.cuda.bindings import cu
from trio_cuda._backends.cuda.launch import CudaFunction, Kernels
from trio_cuda._backends.cuda.streams import CudaMarker, CudaStream, StreamTable

pytestmark = [
    pytest.mark.skipif(not direct.built() or direct.pure_requested(), reason="the extension is not built"),
    pytest.mark.skipif(cu is None, reason="cuda.bindings is not importable"),
]

P, U = ctypes.c_void_p, ctypes.c_uint
LAUNCH_T = ctypes.CFUNCTYPE(ctypes.c_int, P, U, U, U, U, U, U, U, P, P, P)
WRITE_T = ctypes.CFUNCTYPE(ctypes.c_int, P, ctypes.c_ulonglong, ctypes.c_uint32, U)

K = trio_cuda.Kernel.from_source(
    'extern "C" __global__ void k(int a, double b, char c, short d) {}',
    "k",
    params=[Scalar("i4"), Scalar("f8"), Scalar("i1"), Scalar("i2")],
)


class DriverFailed(Exception):
    pass


class FakeState:
    """The parts of ``ContextState`` the three methods use."""

    def __init__(self) -> None:
        self.ctx = None
        self.sticky: Any = None

    def fail(self, err: Any, call: str, cls: Any = None) -> None:
        raise DriverFailed(f"{call}: {int(err)}")

    def make_current_if_needed(self) -> None:
        pass

    def check_open(self) -> None:
        pass


class FakePage:
    """A flag page in host memory: the device address is the host address."""

    def __init__(self) -> None:
        self.carr = (ctypes.c_uint32 * 1024)()
        self.host = self.dptr = ctypes.addressof(self.carr)
        self.mv = memoryview(self.carr).cast("B").cast("I")


class Device:
    """Stand-in entry points: launches are logged with the parameters read
    through their ``void**``; flag writes are queued until :meth:`complete`."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.queued: list[tuple[int, int]] = []
        self.launch_err = 0
        self.write_err = 0
        slots = K.plan.slots

        def launch(
            fn: Any,
            gx: int,
            gy: int,
            gz: int,
            bx: int,
            by: int,
            bz: int,
            smem: int,
            s: Any,
            params: Any,
            extra: Any,
        ) -> int:
            # (read through plain addresses: ctypes.cast keeps a cycle per call)
            argv = [ctypes.c_void_p.from_address(params + 8 * i).value for i in range(len(slots))]
            args = tuple(ctypes.string_at(argv[i], slot.size) for i, slot in enumerate(slots))
            self.log.append(("launch", fn, (gx, gy, gz), (bx, by, bz), smem, s, args, extra))
            err, self.launch_err = self.launch_err, 0
            return err

        def write(s: Any, addr: int, value: int, flags: int) -> int:
            self.log.append(("write", s, addr, value, flags))
            err, self.write_err = self.write_err, 0
            if not err:
                self.queued.append((addr, value))
            return err

        self.launch_cb, self.write_cb = LAUNCH_T(launch), WRITE_T(write)
        self.launch_addr = ctypes.cast(self.launch_cb, P).value
        self.write_addr = ctypes.cast(self.write_cb, P).value

    def complete(self, n: int) -> None:
        """The GPU gets to the first ``n`` queued flag writes."""
        for addr, value in self.queued[:n]:
            ctypes.c_uint32.from_address(addr).value = value
        del self.queued[:n]


class Setup:
    """A stream table with 3 streams and its kernels on a stand-in device,
    called through the compiled methods (``hot``) or the Python ones."""

    def __init__(self, hot: bool) -> None:
        self.dev = Device()
        self.state = FakeState()
        table = self.table = StreamTable(self.state)  # type: ignore[arg-type]
        table._direct = self.dev.write_addr
        page = self.page = FakePage()
        self.streams = []
        for i in range(3):
            s = CudaStream(table, i, cu.CUstream(0x1000 + i), page, i, self.dev.write_addr)  # type: ignore[arg-type]
            table.streams[s] = None
            self.streams.append(s)
        page.used = 3
        kernels = self.kernels = Kernels(self.state, table)  # type: ignore[arg-type]
        kernels._direct = self.dev.launch_addr
        kernels._launch_packed = direct.launch_packed()
        self.functions = [self._function(kernels, 0xF00 + i) for i in range(2)]
        other = Kernels(self.state, table)  # type: ignore[arg-type]
        self.functions.append(self._function(other, 0xBAD))  # another context's (refused)
        if hot:
            methods = direct.hot_methods(kernels, table)
            assert methods is not None
            self.launch, self.record, self.poll, self.notify = methods
            assert [type(m).__name__ for m in methods] == ["HotLaunch", "HotRecord", "HotPoll", "HotNotify"]
        else:
            self.launch, self.record, self.poll = kernels.launch, table.record_marker, table.poll_marker
            self.notify = table.notify_submitted
        # the launches of the program, fresh per setup (their caches are per setup)
        self.launches = [self.made(i) for i in range(4)]
        # one whose plan is not its kernel's (its first enqueue takes the general path)
        odd = K.launch(np.int32(9), 0.5, np.int8(2), np.int16(3), grid=3, block=64).prepared
        odd.plan = copy.copy(K.plan)
        self.launches.append(odd)
        self.markers: list[Any] = []

    @staticmethod
    def made(i: int) -> Any:
        """A fresh launch of shape ``i`` (its first enqueue: the first-launch path, whose
        checks are kept for the last function, shape and stream that took them)."""
        return K.launch(
            np.int32(i), i / 4, np.int8(-i), np.int16(7 * i), grid=(i + 1, 2), block=32 * (i + 1)
        ).prepared

    @staticmethod
    def _function(owner: Kernels, addr: int) -> CudaFunction:
        f = CudaFunction.__new__(CudaFunction)
        f.owner, f.kernel, f.module, f.fn, f.addr = owner, K, None, cu.CUfunction(addr), addr
        f.dyn_smem, f.packed, f.argv, f.unloaded = 48 * 1024, None, None, False
        f.image_kind, f.arch, f.from_cache, f.limits, f.ok = "cubin", "sm_90", False, None, set()
        f.params, f.params_end = None, None
        return f

    def step(self, op: tuple[Any, ...]) -> Any:
        kind, a, b, c = op
        s = self.streams[a % 3]
        if kind == "launch":
            return self.launch(s, self.functions[c % 3], self.launches[b % 5])
        if kind == "record":
            m = self.record(s)
            self.markers.append(m)
            return ("marker", m.stream.index, m.seq, m.event, type(m).__name__)
        if kind == "poll":
            if not self.markers:
                return None
            p = self.poll(self.markers[b % len(self.markers)])
            return ("poll", p.state, None if p.error is None else str(p.error))
        if kind == "fresh":  # (the same shape as the one it replaces, made again)
            self.launches[b % 4] = self.made(b % 4)
            return None
        if kind == "complete":
            self.dev.complete(b)
            return None
        if kind == "launch_err":
            self.dev.launch_err = (100, 201, 700)[b % 3]
            return None
        if kind == "write_err":
            self.dev.write_err = (1, 999)[b % 2]
            return None
        if kind == "mode":
            self.table.marker_mode = ("eager", "hybrid", "deferred", "".join(["ea", "ger"]))[b % 4]
            return None
        if kind == "flush":
            self.table.flush()
            return None
        if kind == "watch":
            s.watched = not s.watched
            return None
        if kind == "capture":
            self.table.capturing = s if self.table.capturing is None else None
            return None
        if kind == "destroy":
            s.destroyed = True
            return None
        if kind == "unload":
            self.functions[c % 2].unloaded = not self.functions[c % 2].unloaded
            return None
        if kind == "sticky":
            self.state.sticky = None if self.state.sticky is not None else DriverFailed("sticky")
            return None
        raise AssertionError(kind)

    def snapshot(self) -> Any:
        t = self.table
        keys = {s.key: s.index for s in self.streams}
        return (
            [(s.seq, s.watched, s.dirty, s.hot, s.destroyed) for s in self.streams],
            t.new_head,
            list(self.page.carr[:96]),
            [
                {
                    (f"stream {keys[k]}", v[0].addr, v[1]) if k in keys else (k, type(v).__name__)
                    for k, v in (lp.cache or {}).items()
                }
                | {("enqueued", lp.enqueued)}
                for lp in self.launches
            ],
            [f.packed for f in self.functions],
        )


def run(setup: Setup, program: list[tuple[Any, ...]]) -> list[Any]:
    out: list[Any] = []
    for op in program:
        try:
            out.append(setup.step(op))
        except Exception as exc:
            out.append(("raised", type(exc).__name__, str(exc)))
        out.append(setup.snapshot())
    out.append(setup.dev.log)
    return out


kinds = st.sampled_from(
    ["launch"] * 8
    + ["fresh"] * 3
    + ["record"] * 4
    + ["poll"] * 4
    + ["complete"] * 2
    + ["launch_err", "write_err", "mode", "flush", "watch", "capture", "destroy", "unload", "sticky"]
)
programs = st.lists(
    st.tuples(kinds, st.integers(0, 5), st.integers(0, 7), st.integers(0, 5)), min_size=1, max_size=60
)


def _agree(program: list[tuple[Any, ...]]) -> list[Any]:
    """``program`` run through the compiled methods and the Python ones:
    the same outcomes (what it returns). The two setups' flag pages are at
    different addresses: the writes' offsets within them are compared."""
    hot, ref = Setup(hot=True), Setup(hot=False)
    got, want = run(hot, program), run(ref, program)
    for out, setup in ((got, hot), (want, ref)):
        out[-1] = [(e[0], e[1], e[2] - setup.page.dptr, *e[3:]) if e[0] == "write" else e for e in out[-1]]
    assert got == want
    return got


@settings(max_examples=300, deadline=None)
@given(program=programs)
def test_compiled_and_python_methods_agree_on_random_programs(program: list[tuple[Any, ...]]) -> None:
    _agree(program)


def test_a_fresh_launch_of_the_last_first_launch_s_shape_reads_what_can_change() -> None:
    """The first-launch path keeps its checks for the last function, shape
    and stream: a fresh launch of those is checked again for an unloaded
    function and a destroyed stream, as the Python method checks them (the
    same driver calls and errors)."""
    launch, fresh = ("launch", 0, 0, 0), ("fresh", 0, 0, 0)
    unload, destroy = ("unload", 0, 0, 0), ("destroy", 0, 0, 0)
    other_stream = ("launch", 1, 0, 0)
    program = [launch, fresh, launch, fresh, unload, launch, unload, fresh, launch]
    program += [fresh, destroy, launch, fresh, other_stream]
    out = _agree(program)
    calls = [e for e in out[-1] if e[0] == "launch"]
    assert len(calls) == 4  # (not while unloaded; not on the destroyed stream)
    raised = {r[1] for r in out if isinstance(r, tuple) and r[0] == "raised"}
    assert raised == {"CudaError", "ScopeClosedError"}  # (the unloaded function; the destroyed stream)


def test_the_common_case_takes_the_compiled_steps() -> None:
    """Not vacuous: a fresh launch, a launch enqueued again, a flag write
    and a poll each reach the device from the compiled methods without the
    Python ones (which are replaced by ones that fail)."""
    setup = Setup(hot=True)

    def refuse(*args: Any) -> Any:
        raise AssertionError("the Python method was called")

    launch, record, poll = (type(m) for m in (setup.launch, setup.record, setup.poll))
    kernels, table = setup.kernels, setup.table
    setup.launch = launch(kernels, refuse, table, CudaStream, CudaFunction, _primary, kernels._direct)
    setup.record = record(table, refuse, CudaStream, CudaMarker, _primary)
    from trio_cuda._core._driver import DONE, PENDING

    setup.poll = poll(table, refuse, CudaStream, CudaMarker, DONE, PENDING)
    s, f, lp = setup.streams[0], setup.functions[0], setup.launches[0]
    f.packed = direct.packed_offsets(K.plan.slots)  # (decided by the Python method's first call)
    setup.launch(s, f, lp)  # a first enqueue, from the packed parameters
    assert (lp.cache, lp.enqueued) == (None, True)  # (no memory of its own; a flag, no dict)
    kernels._prepare_launch(s, f, lp)  # (what the Python method does on the second enqueue)
    setup.launch(s, f, lp)  # a prepared one
    m = setup.record(s)
    assert (type(m), m.stream, m.seq, m.event) == (CudaMarker, s, 1, None)
    assert setup.poll(m).state is PENDING.state
    setup.dev.complete(1)
    assert setup.poll(m) is DONE
    kinds_ = [e[0] for e in setup.dev.log]
    assert kinds_ == ["launch", "launch", "write"]
    assert setup.dev.log[0][6] == setup.dev.log[1][6]  # the same parameters either way
    with pytest.raises(AssertionError, match="Python method"):
        setup.launch(s, setup.functions[2], lp)  # another context's function: the Python method decides


def test_the_hot_methods_follow_the_switch_and_the_direct_calls() -> None:
    setup = Setup(hot=False)
    assert direct.hot_methods(setup.kernels, setup.table) is not None
    direct.HOT = False
    try:
        assert direct.hot_methods(setup.kernels, setup.table) is None
    finally:
        direct.HOT = True
    setup.kernels._direct = None  # the wrappers: nothing compiled
    assert direct.hot_methods(setup.kernels, setup.table) is None


def test_hot_methods_do_not_leak() -> None:
    """Reference counts and memory: many calls of each path leave nothing
    behind (not the objects they read, nor the ints they make)."""
    import sys
    import tracemalloc

    setup = Setup(hot=True)
    s, f = setup.streams[1], setup.functions[1]
    run(setup, [("launch", 1, i, 1) for i in range(10)] + [("record", 1, 0, 0), ("poll", 1, 0, 0)])
    prepared = [v[2] for lp in setup.launches for k, v in (lp.cache or {}).items() if k == s.key]
    assert len(prepared) == len(setup.launches)  # (each enqueued again: a prepared call)
    held = (s.write, f, f.packed, setup.table, setup.kernels, s, *setup.launches, *prepared)
    held += tuple(lp.cache for lp in setup.launches)

    def rounds(n: int) -> None:
        for _ in range(n):
            fresh = K.launch(np.int32(1), 0.5, np.int8(1), np.int16(1), grid=2, block=32).prepared
            setup.launch(s, f, fresh)  # (a first enqueue, from the packed parameters)
            for lp in setup.launches:
                setup.launch(s, f, lp)
            setup.dev.complete(len(setup.dev.queued))
            setup.poll(setup.record(s))
            setup.dev.log.clear()

    rounds(20)
    counts = [sys.getrefcount(o) for o in held]
    tracemalloc.start()
    try:
        rounds(20)
        gc.collect()  # (the stand-in's ctypes objects are collected in cycles)
        before = tracemalloc.get_traced_memory()[0]
        rounds(2000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(o) for o in held] == counts
    assert grown < 16_000, grown  # (a leaked int per call would be 2000 x 28 bytes and more)


def test_several_devices_take_the_python_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    """With scopes on several devices each call makes its context current
    first: the compiled launch and record leave that to the Python methods."""
    setup = Setup(hot=True)
    calls: list[str] = []

    def python(name: str) -> Any:
        def method(*args: Any) -> str:
            calls.append(name)
            return name

        return method

    kernels, table = setup.kernels, setup.table
    launch = type(setup.launch)(
        kernels, python("launch"), table, CudaStream, CudaFunction, _primary, kernels._direct
    )
    record = type(setup.record)(table, python("record"), CudaStream, CudaMarker, _primary)
    s, f, lp = setup.streams[0], setup.functions[0], setup.launches[0]
    f.packed = direct.packed_offsets(K.plan.slots)
    monkeypatch.setattr(_primary, "multi_device", True)
    assert (launch(s, f, lp), record(s)) == ("launch", "record")
    monkeypatch.setattr(_primary, "multi_device", False)
    assert (launch(s, f, lp), type(record(s))) == (None, CudaMarker)
    assert calls == ["launch", "record"]
    assert [e[0] for e in setup.dev.log] == ["launch", "write"]


@pytest.mark.parametrize(
    "modes",
    [{"cooperative": True}, {"pdl": True}, {"cluster": 2, "grid": 4}, {"shared_mem": 64 * 1024}],
    ids=["cooperative", "pdl", "cluster", "opt-in shared memory"],
)
def test_launches_with_modes_take_the_python_method(modes: dict[str, Any]) -> None:
    """A first enqueue with launch attributes, or above the function's
    dynamic shared memory, is the Python method's: nothing reaches the
    device from the compiled one."""
    setup = Setup(hot=True)
    calls: list[Any] = []
    kernels, table = setup.kernels, setup.table
    launch = type(setup.launch)(
        kernels, lambda *a: calls.append(a), table, CudaStream, CudaFunction, _primary, kernels._direct
    )
    kw: dict[str, Any] = {"grid": 2, "block": 32, **modes}
    lp = K.launch(np.int32(1), 1.0, np.int8(1), np.int16(1), **kw).prepared
    s, f = setup.streams[0], setup.functions[0]
    f.packed = direct.packed_offsets(K.plan.slots)
    launch(s, f, lp)
    assert calls == [(s, f, lp)]
    assert (lp.cache, lp.enqueued, setup.dev.log) == (None, False, [])


class _Event:
    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True


def test_notify_is_the_python_method() -> None:
    """``HotNotify`` returns at once where no marker is new or nobody is
    parked to wake (the Python method's tests), and is the Python method
    otherwise: the same state
    after each call, on both."""
    results = []
    for hot in (True, False):
        setup = Setup(hot=hot)
        table, seen = setup.table, []
        for new_head, parked in [(False, False), (False, True), (True, True), (True, False), (False, True)]:
            ev = _Event() if parked else None
            table.new_head, table.wake_ev = new_head, ev
            assert setup.notify() is None
            seen.append((table.new_head, table.wake_ev is None, ev is not None and ev.is_set))
        results.append(seen)
    assert results[0] == results[1]
    assert (False, False, False) in results[0]
    assert (True, True, True) in results[0]


def test_notify_hands_the_rest_to_the_python_method() -> None:
    from trio_cuda._backends.cuda import _direct  # type: ignore[attr-defined]

    calls: list[tuple[Any, ...]] = []

    def fallback(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "python"

    setup = Setup(hot=True)
    notify = _direct.HotNotify(setup.table, fallback)
    setup.table.new_head = False
    setup.table.wake_ev = _Event()
    assert notify() is None
    assert calls == []
    setup.table.new_head, setup.table.wake_ev = True, None  # (a new head, nobody parked to wake)
    assert notify() is None
    assert calls == []
    setup.table.wake_ev = _Event()
    assert notify() == "python"
    setup.table.new_head = 0  # (falsy, not False: the Python method decides)
    assert notify() == "python"
    setup.table.new_head = False
    assert notify(1, k=2) == "python"  # arguments: the Python method's error to raise
    assert calls == [((), {}), ((), {}), ((1,), {"k": 2})]

    class NoFlag:
        __slots__ = ()

    assert _direct.HotNotify(NoFlag(), fallback)() == "python"  # no flag to read
    with pytest.raises(TypeError):
        _direct.HotNotify(setup.table)
    for hot in (_direct.HotNotify, _direct.HotPoll, _direct.HotRecord, _direct.HotLaunch):
        with pytest.raises(TypeError, match="takes no keyword arguments"):
            hot(setup.table, fallback, colour="red")


def test_the_hot_methods_take_part_in_garbage_collection() -> None:
    """Each holds its table (and kernels) strongly and reports them to the
    collector, so a cycle through a context (which holds them) is freed."""
    import weakref

    setup = Setup(hot=True)
    assert {id(setup.kernels), id(setup.table)} <= {id(o) for o in gc.get_referents(setup.launch)}
    assert id(setup.table) in {id(o) for o in gc.get_referents(setup.record)}
    assert id(setup.table) in {id(o) for o in gc.get_referents(setup.poll)}
    assert id(setup.table) in {id(o) for o in gc.get_referents(setup.notify)}

    class Holder:
        pass

    holder = Holder()
    holder.methods = direct.hot_methods(setup.kernels, setup.table)  # type: ignore[attr-defined]
    setup.kernels.functions[holder] = None  # type: ignore[index]  # a cycle: kernels -> holder -> HotLaunch -> kernels
    gone = weakref.ref(holder)
    del holder, setup
    gc.collect()
    assert gone() is None
