"""Random programs on the simulated device, checked against a NumPy model.

A hypothesis ``RuleBasedStateMachine`` *records* a program: a sequence of
scopes, each a list of steps (allocations, launches on random or pinned
streams, then/map/zip chains whose closures sometimes raise, injected faults,
hold/release/complete_next, closing and dropping handles, futures that are
awaited, kept, dropped or awaited by tasks that get cancelled, and an exit
that may raise, be cancelled, or time out while the device is held).
``teardown`` then runs the whole program inside one ``trio.run`` on a fresh
``SimDevice`` (with or without batched markers and an inline await spin).

Every outcome is predicted, not merely tolerated:

* values read back (``to_host`` and stream-ordered ``ops.copy`` snapshots)
  equal a NumPy model that applies every submitted op in submission order;
* each error (at submission, at ``wait`` and at scope exit) has the predicted
  type, and the exit ``ExceptionGroup`` holds exactly the errors nobody
  observed; work abandoned by ``drain_timeout`` is reported by one
  ``ResourceWarning`` naming how many submissions it quarantined, and
  awaiting its future raises ``CompletionUnknownError``;
* after each exit nothing is in flight, no lease is held, every allocation is
  freed unless it is quarantined, and ``sim.violations`` stays empty.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import trio_cuda
from tests.helpers.kernels import ADD, COPY, SAXPY
from trio_cuda import CompletionUnknownError, LaunchError, OutOfMemoryError, ops
from trio_cuda.testing import SimDevice

F4 = np.float32
WATCHDOG_S = 10.0  # a program that hangs is released (and fails) after this
DRAIN_BOUND_S = 1.0  # drain_timeout of scopes whose exit must not time out


class ThenBoom(Exception):
    """Raised by a then-closure."""


class HostBoom(Exception):
    """Raised by a host closure."""


class BodyError(Exception):
    """Raised by a scope body to exit it on an error."""


# =========================================================================== program


@dataclass
class Segment:
    """One scope of the program."""

    streams: int
    n: int
    steps: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    exit_kind: str = "normal"  # normal | raise | cancel
    policy: str = "release_first"  # release_first | late_release | timeout
    drain_timeout: float | None = None


@dataclass
class HRec:
    """Record-time view of one handle."""

    buf: int
    readonly: bool
    state: str = "open"  # open | closed | dropped


PICK = st.integers(0, 1000)
STREAM = st.one_of(st.none(), st.integers(0, 3))
SMALL = st.integers(-3, 3)
MODES = st.sampled_from(["await", "await_op", "keep", "drop", "task_cancel", "task_precancel", "task_linger"])
LAUNCH_ARGS = {
    "kernel": st.sampled_from(["add", "saxpy", "copy", "fill", "host"]),
    "picks": st.lists(st.integers(0, 1000), min_size=3, max_size=3),
    "mode": MODES,
    "chain": st.sampled_from([None, "then", "then_raise", "map", "zip"]),
    "stream": STREAM,
    "a": SMALL,
    "v": SMALL,
    "v2": SMALL,
    "host_raises": st.booleans(),
}
FAULTY_ARGS = {
    "kernel": st.sampled_from(["add", "saxpy", "copy"]),
    "picks": st.lists(st.integers(0, 1000), min_size=3, max_size=3),
    "mode": MODES,
    "fault": st.sampled_from(["launch_error", "kernel_fault", "completion_unknown"]),
    "stream": STREAM,
    "a": SMALL,
    "v": SMALL,
}


class ProgramMachine(RuleBasedStateMachine):
    """Records a random program; ``teardown`` runs and checks it."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[Segment] = []
        self.ids = 0

    # ------------------------------------------------------------------ record-time state
    def _fresh(self) -> int:
        self.ids += 1
        return self.ids

    def _start(self, streams: int, n: int) -> None:
        self.seg = Segment(streams, n)
        self.segments.append(self.seg)
        self.handles: dict[int, HRec] = {}
        self.held = False
        self.kept: list[int] = []
        self.lingering = 0

    def _emit(self, name: str, **kw: Any) -> None:
        self.seg.steps.append((name, kw))

    def _open(self) -> list[int]:
        return [h for h, r in self.handles.items() if r.state == "open"]

    def _writable(self) -> list[int]:
        return [h for h, r in self.handles.items() if r.state == "open" and not r.readonly]

    def _stream(self, s: int | None) -> int | None:
        return None if s is None else s % self.seg.streams

    def _has_open(self) -> bool:
        return bool(self._open())

    def _has_writable(self) -> bool:
        return bool(self._writable())

    @initialize(
        streams=st.integers(2, 4),
        n=st.integers(1, 40),
        batch_markers=st.booleans(),
        await_spin=st.sampled_from([0.0, 1e-4]),
        timed=st.booleans(),
    )
    def first_scope(self, streams: int, n: int, batch_markers: bool, await_spin: float, timed: bool) -> None:
        self.device_options = {"batch_markers": batch_markers, "await_spin": await_spin, "timed": timed}
        self._start(streams, n)

    # ------------------------------------------------------------------ rules
    ALLOC_ARGS = {
        "kind": st.sampled_from(["empty", "zeros", "full", "to_device"]),
        "stream": STREAM,
        "v": SMALL,
    }

    @rule(**ALLOC_ARGS)
    def alloc_more(self, **kw: Any) -> None:
        self.alloc(**kw)

    @rule(**ALLOC_ARGS)
    def alloc(self, kind: str, stream: int | None, v: int) -> None:
        if kind == "to_device" and self.held:
            kind = "full"  # to_device waits for its copy
        hid, bid = self._fresh(), self._fresh()
        self.handles[hid] = HRec(bid, readonly=False)
        self._emit("alloc", hid=hid, bid=bid, kind=kind, stream=self._stream(stream), v=v)

    @rule(kind=st.sampled_from(["empty", "zeros", "to_device"]))
    def alloc_out_of_memory(self, kind: str) -> None:
        self._emit("oom", kind=kind)

    @precondition(_has_open)
    @rule(pick=PICK)
    def readonly(self, pick: int) -> None:
        src = self._open()[pick % len(self._open())]
        hid = self._fresh()
        self.handles[hid] = HRec(self.handles[src].buf, readonly=True)
        self._emit("readonly", src=src, hid=hid)

    def _launch(
        self, kernel: str, picks: list[int], mode: str, chain: str | None, fault: str | None, **kw: Any
    ) -> None:
        opened, writable = self._open(), self._writable()
        if kernel == "host":
            hids: list[int] = []
            chain = None
        elif kernel in ("add", "fill"):
            hids = [writable[picks[0] % len(writable)]]
        else:  # saxpy(x, y) / copy(src, dst): the first is read, the second written
            hids = [opened[picks[0] % len(opened)], writable[picks[1] % len(writable)]]
        if chain == "zip":
            hids.append(writable[picks[2] % len(writable)])
        if self.held and mode in ("await", "await_op"):
            mode = "task_cancel"  # awaiting would wait for a held device
        if fault is not None and mode == "task_precancel":
            mode = "drop"  # a fault must hit this very launch
        if mode == "keep":
            fid = self._fresh()
            self.kept.append(fid)
        else:
            fid = None
        if mode == "task_linger":
            self.lingering += 1
        self._emit("launch", kernel=kernel, hids=hids, mode=mode, chain=chain, fault=fault, fid=fid, **kw)

    # Launches are the heart of a program: several rules record them, so that
    # they outweigh the other rules.
    @precondition(_has_writable)
    @rule(**LAUNCH_ARGS)
    def launch(self, **kw: Any) -> None:
        self._plain_launch(**kw)

    @precondition(_has_writable)
    @rule(**LAUNCH_ARGS)
    def launch_more(self, **kw: Any) -> None:
        self._plain_launch(**kw)

    @precondition(_has_writable)
    @rule(**LAUNCH_ARGS)
    def launch_even_more(self, **kw: Any) -> None:
        self._plain_launch(**kw)

    def _plain_launch(
        self,
        kernel: str,
        picks: list[int],
        mode: str,
        chain: str | None,
        stream: int | None,
        a: int,
        v: int,
        v2: int,
        host_raises: bool,
    ) -> None:
        self._launch(
            kernel,
            picks,
            mode,
            chain,
            None,
            stream=self._stream(stream),
            a=a,
            v=v,
            v2=v2,
            host_raises=host_raises,
        )

    @precondition(_has_writable)
    @rule(**FAULTY_ARGS)
    def faulty_launch(self, **kw: Any) -> None:
        self._faulty_launch(**kw)

    @precondition(_has_writable)
    @rule(**FAULTY_ARGS)
    def faulty_launch_more(self, **kw: Any) -> None:
        self._faulty_launch(**kw)

    def _faulty_launch(
        self, kernel: str, picks: list[int], mode: str, fault: str, stream: int | None, a: int, v: int
    ) -> None:
        self._launch(
            kernel, picks, mode, None, fault, stream=self._stream(stream), a=a, v=v, v2=0, host_raises=False
        )

    @rule(kind=st.sampled_from(["closed", "readonly_write", "readonly_fill"]), pick=PICK)
    def misuse(self, kind: str, pick: int) -> None:
        if kind == "closed":
            cands = [h for h, r in self.handles.items() if r.state == "closed"]
        else:
            cands = [h for h, r in self.handles.items() if r.state == "open" and r.readonly]
        if cands:
            self._emit("misuse", kind=kind, hid=cands[pick % len(cands)])

    @precondition(_has_writable)
    @rule(
        kernels=st.lists(st.sampled_from(["add", "saxpy", "copy", "fill"]), min_size=2, max_size=4),
        picks=st.lists(st.lists(PICK, min_size=3, max_size=3), min_size=4, max_size=4),
        streams=st.lists(st.integers(0, 3), min_size=5, max_size=5),
        keep=st.booleans(),
        v=SMALL,
    )
    def burst(
        self, kernels: list[str], picks: list[list[int]], streams: list[int], keep: bool, v: int
    ) -> None:
        """Dependent work on several streams with no yield in between, then a
        read back: only the runtime's cross-stream ordering keeps it right
        (timed devices run a free stream ahead of a busy one)."""
        for kernel, pk, stream in zip(kernels, picks, streams, strict=False):
            self._launch(
                kernel,
                pk,
                "keep" if keep else "drop",
                None,
                None,
                stream=self._stream(stream),
                a=v,
                v=v,
                v2=0,
                host_raises=False,
            )
        last = self.seg.steps[-1][1]["hids"][-1]  # what the last launch wrote
        self._emit("check", hid=last, fid=self._check_fid(), stream=self._stream(streams[-1] + 1))

    def _check_fid(self) -> int | None:
        if not self.held:
            return None
        fid = self._fresh()  # a stream-ordered snapshot, awaited later
        self.kept.append(fid)
        return fid

    @precondition(_has_open)
    @rule(pick=PICK, stream=STREAM)
    def check(self, pick: int, stream: int | None) -> None:
        hid = self._open()[pick % len(self._open())]
        self._emit("check", hid=hid, fid=self._check_fid(), stream=self._stream(stream))

    @precondition(lambda self: self.kept)
    @rule(pick=PICK)
    def await_future(self, pick: int) -> None:
        self._emit("await_future", fid=self.kept[pick % len(self.kept)])

    @precondition(lambda self: not self.held)
    @rule()
    def hold(self) -> None:
        self.held = True
        self._emit("hold")

    @precondition(lambda self: self.held)
    @rule()
    def release(self) -> None:
        self.held = False
        self._emit("release")

    @precondition(lambda self: self.held)
    @rule(k=st.integers(1, 3), settle=st.booleans())
    def complete_next(self, k: int, settle: bool) -> None:
        self._emit("complete_next", k=k, settle=settle)

    @precondition(lambda self: self.held)
    @rule()
    def run_until_idle(self) -> None:
        self._emit("run_until_idle")

    @rule(pick=PICK)
    def close(self, pick: int) -> None:
        cands = [h for h, r in self.handles.items() if r.state != "dropped"]
        if cands:
            hid = cands[pick % len(cands)]
            self.handles[hid].state = "closed"
            self._emit("close", hid=hid)

    @rule(pick=PICK)
    def drop_more(self, pick: int) -> None:
        self.drop(pick)

    @rule(pick=PICK)
    def drop(self, pick: int) -> None:
        cands = [h for h, r in self.handles.items() if r.state != "dropped"]
        if cands:
            hid = cands[pick % len(cands)]
            self.handles[hid].state = "dropped"
            self._emit("drop", hid=hid)

    @precondition(lambda self: not self.held)
    @rule()
    def settle(self) -> None:
        self._emit("settle")

    @precondition(lambda self: self.lingering)
    @rule()
    def cancel_lingering(self) -> None:
        self.lingering = 0
        self._emit("cancel_lingering")

    @precondition(lambda self: len(self.segments) < 3)
    @rule(
        exit_kind=st.sampled_from(["normal", "raise", "cancel"]),
        policy=st.sampled_from(["release_first", "late_release", "timeout"]),
        drain_timeout=st.sampled_from([0, 0.02]),
        streams=st.integers(2, 4),
        n=st.integers(1, 40),
    )
    def exit_scope(self, exit_kind: str, policy: str, drain_timeout: float, streams: int, n: int) -> None:
        self._finish(exit_kind, policy, drain_timeout)
        self._start(streams, n)

    def _finish(self, exit_kind: str, policy: str, drain_timeout: float | None) -> None:
        seg = self.seg
        seg.exit_kind = exit_kind
        seg.policy = policy
        seg.drain_timeout = drain_timeout if policy == "timeout" else None

    def teardown(self) -> None:
        if not self.segments:
            return
        self._finish("normal", "release_first", None)
        Runner(self.segments, **self.device_options).run()


TestRandomPrograms = ProgramMachine.TestCase
TestRandomPrograms.settings = settings(
    max_examples=60,
    deadline=None,
    stateful_step_count=50,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# =========================================================================== interpreter


@dataclass
class Buf:
    """Runtime model of one allocation."""

    ptr: int
    nbytes: int
    value: np.ndarray | None  # None: unknown
    refs: list[weakref.ref[trio_cuda.DeviceArray]] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int]:
        return (self.ptr, self.nbytes)

    def alive(self) -> list[trio_cuda.DeviceArray]:
        return [a for a in (r() for r in self.refs) if a is not None]


@dataclass
class Entry:
    """One submission the program made (its future may be dropped)."""

    label: str
    predicted: type[BaseException] | None  # the error completion will report
    executed: Callable[[], bool]
    check_output: Callable[[object], None]
    fut: trio_cuda.DeviceFuture[Any] | None = None
    observed: bool = False
    unknown_bufs: tuple[Buf, ...] = ()  # quarantined once a completion_unknown executed
    kernel: bool = True  # needs a work command (cannot complete while held)


@dataclass
class Plan:
    op: trio_cuda.DeviceOp[Any]
    raises: type[BaseException] | None  # raised by submit itself
    effects: list[Callable[[], None]]
    entry: Entry | None  # None when submit raises
    written: list[trio_cuda.DeviceArray]
    fault: str | None


def _ids(value: object) -> object:
    """Replace handles by their identities, to compare outputs."""
    if isinstance(value, tuple):
        return tuple(_ids(v) for v in value)
    if isinstance(value, trio_cuda.DeviceArray):
        return ("handle", id(value))
    return value


class Runner:
    def __init__(
        self, segments: list[Segment], *, batch_markers: bool, await_spin: float, timed: bool
    ) -> None:
        self.segments = segments
        # With batched markers an error fails the whole burst of submissions
        # that share a marker: keep them for programs whose errors the model
        # attributes per submission only at submit time.
        faults = any(
            kw.get("fault") in ("kernel_fault", "completion_unknown")
            for seg in segments
            for name, kw in seg.steps
            if name == "launch"
        )
        # Timed work runs the streams concurrently in simulated time: a stream
        # that is free runs ahead of a busy one, unless the runtime orders it.
        self.sim = SimDevice(
            batch_markers=batch_markers and not faults,
            await_spin=await_spin,
            kernel_time=2e-4 if timed else 0.0,
            copy_time=1e-4 if timed else 0.0,
        )
        self.bufs: dict[int, Buf] = {}
        self.handles: dict[int, trio_cuda.DeviceArray] = {}
        self.futs: dict[int, Entry | None] = {}
        self.quarantined: set[tuple[int, int]] = set()
        self.kernels = 0
        self.hung = False
        self.loop_thread = 0

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        trio.run(self._main)
        sim = self.sim
        assert not self.hung, "a scope exit did not finish (released by the watchdog)"
        assert sim.violations == []
        assert sim.pending == 0
        assert {(a.ptr, a.nbytes) for a in sim.live_allocations} == self.quarantined

    async def _main(self) -> None:
        self.loop_thread = threading.get_ident()
        async with trio.open_nursery() as outer:
            self.outer = outer
            outer.start_soon(self._watchdog)
            for seg in self.segments:
                await self._segment(seg)
            outer.cancel_scope.cancel()

    async def _watchdog(self) -> None:
        await trio.sleep(WATCHDOG_S)
        self.hung = True
        self.sim.release()

    async def _releaser(self) -> None:
        await trio.testing.wait_all_tasks_blocked()
        self.released_late = True
        self.sim.release()

    # ------------------------------------------------------------------ one scope
    async def _segment(self, seg: Segment) -> None:
        sim = self.sim
        self.n = seg.n
        self.entries: list[Entry] = []
        self.seg_bufs: list[Buf] = []
        self.lingering: list[tuple[trio.CancelScope, Entry | None]] = []
        self.released_late = False
        snapshot = -1
        caught: BaseException | None = None
        cs = trio.CancelScope()
        with warnings.catch_warnings(record=True) as wlog:
            warnings.simplefilter("always")
            try:
                with cs:
                    async with trio_cuda.open_scope(
                        device=sim,
                        streams=seg.streams,
                        conflicts="order",
                        drain_timeout=seg.drain_timeout if seg.policy == "timeout" else DRAIN_BOUND_S,
                    ) as gpu:
                        self.gpu = gpu
                        assert trio_cuda.current_scope() is gpu
                        async with trio.open_nursery() as nursery:
                            self.nursery = nursery
                            for name, kw in seg.steps:
                                await getattr(self, f"_do_{name}")(**kw)
                            snapshot = await self._prepare_exit(seg.policy)
                        if seg.policy == "late_release" and snapshot:
                            self.outer.start_soon(self._releaser)
                        if seg.exit_kind == "raise":
                            raise BodyError("body failed")
                        if seg.exit_kind == "cancel":
                            cs.cancel()
                            await trio.lowlevel.checkpoint()
            except BaseException as exc:  # checked in detail below
                if snapshot < 0:
                    raise  # the program itself failed
                caught = exc
        self._check_exit(seg, snapshot, caught, [w.message for w in wlog])
        if sim.held:
            sim.release()
        sim.run_until_idle()
        assert sim.violations == []

    async def _prepare_exit(self, policy: str) -> int:
        if policy == "release_first":
            self.sim.release()
            await self._quiesce()
        else:
            self.sim.hold()
            self._cancel_lingering()
        await trio.testing.wait_all_tasks_blocked()
        gc.collect(0)
        await trio.testing.wait_all_tasks_blocked()
        in_flight = self.gpu.statistics().in_flight
        if policy == "release_first":
            assert in_flight == 0
        self.pending_at_exit = [e for e in self.entries if e.fut is not None and not e.fut.done()]
        assert len(self.pending_at_exit) <= in_flight
        return in_flight

    def _check_exit(
        self, seg: Segment, snapshot: int, caught: BaseException | None, warned: list[Warning | str]
    ) -> None:
        gpu, sim = self.gpu, self.sim
        timed_out = snapshot if seg.policy == "timeout" else 0
        if seg.policy == "late_release" and snapshot:
            assert self.released_late, "the scope exited before its in-flight work completed"

        # -- errors: exactly the unobserved ones. Work abandoned by drain_timeout
        # is reported by the ResourceWarning, not in the group (awaiting its
        # future raises CompletionUnknownError).
        expected: Counter[str] = Counter()
        not_executed = 0
        for e in self.entries:
            if not e.executed():
                not_executed += 1
            elif e.predicted is not None and not e.observed:
                expected[e.predicted.__name__] += 1
        if seg.policy != "timeout":
            assert not_executed == 0
        assert not_executed <= timed_out
        errors: list[BaseException] = []
        if caught is None:
            assert not expected
        elif not expected:
            assert seg.exit_kind == "raise", caught
            assert type(caught) is BodyError, caught
        else:
            assert isinstance(caught, ExceptionGroup), caught
            errors = list(caught.exceptions)
            if seg.exit_kind == "raise":
                assert type(errors[0]) is BodyError, errors
                errors = errors[1:]
        found: Counter[str] = Counter()
        for err in errors:
            if type(err) in (CompletionUnknownError, LaunchError, HostBoom):
                assert not isinstance(err.__cause__, TimeoutError), err
                found[type(err).__name__] += 1
            else:
                raise AssertionError(f"unexpected error at scope exit: {err!r}")
        assert found == expected, (found, expected, errors)

        # -- the drain timeout warns once, naming what it abandoned
        if timed_out:
            assert len(warned) == 1, warned
            assert isinstance(warned[0], ResourceWarning)
            assert f"{timed_out} submission(s) still in flight" in str(warned[0])
        else:
            assert warned == []

        # -- nothing in flight, no lease held, every future settled
        stats = gpu.statistics()
        assert gpu.closed
        assert (stats.in_flight, stats.leases_held, stats.host_closures_pending) == (0, 0, 0)
        unknown = [e for e in self.entries if e.predicted is CompletionUnknownError and e.executed()]
        assert stats.quarantined == len(unknown) + timed_out
        for e in self.entries:
            if e.fut is not None:
                assert e.fut.done()
        for e in self.pending_at_exit:
            if timed_out:
                with pytest.raises(CompletionUnknownError, match="drain_timeout"):
                    e.fut.wait_nowait()
            else:
                self._outcome(e, e.fut.wait_nowait, observe=False)
        for h in self.handles.values():
            assert h.closed

        # -- every allocation freed, unless quarantined (never freed)
        live = {(a.ptr, a.nbytes) for a in sim.live_allocations} - self.quarantined
        mine = {b.key for b in self.seg_bufs}
        reported = {b.key for b in self.seg_bufs if any(a.quarantined for a in b.alive())}
        must = {b.key for e in unknown for b in e.unknown_bufs}
        assert must <= reported <= live <= mine
        assert len(live) == stats.live_allocations
        assert sum(nb for _, nb in live) == stats.quarantined_bytes == stats.live_bytes
        self.quarantined |= live
        self.handles.clear()
        self.futs.clear()

    # ------------------------------------------------------------------ helpers
    def _stream(self, index: int | None) -> trio_cuda.Stream | None:
        return None if index is None else self.gpu.streams[index]

    def _register(self, hid: int, bid: int, arr: trio_cuda.DeviceArray, value: np.ndarray | None) -> None:
        buf = self.bufs.get(bid)
        if buf is None:
            buf = self.bufs[bid] = Buf(arr.ptr, arr.nbytes, value)
            self.seg_bufs.append(buf)
        assert (arr.ptr, arr.nbytes) == buf.key
        buf.refs.append(weakref.ref(arr))
        self.handles[hid] = arr

    def _buf(self, arr: trio_cuda.DeviceArray) -> Buf:
        for buf in self.seg_bufs:
            if buf.key == (arr.ptr, arr.nbytes):
                return buf
        raise AssertionError(f"unknown handle {arr!r}")

    def _cancel_lingering(self) -> None:
        for cs, _ in self.lingering:
            cs.cancel()
        self.lingering.clear()

    async def _quiesce(self) -> None:
        """Device not held: wait (in real time, for timed work) until every
        submission retired. Work that never completes fails the check after."""
        gpu, sim = self.gpu, self.sim
        with trio.move_on_after(DRAIN_BOUND_S):
            while gpu.statistics().in_flight or sim.pending:
                await trio.sleep(sim.kernel_time or 0)
                await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()

    def _doomed(self, h: trio_cuda.DeviceArray) -> bool:
        """Work of unknown completion on ``h`` was submitted, and the scope has
        not quarantined it yet. Once its marker says so (a poll may run the
        device that far), an access from another stream fails with
        CompletionUnknownError while one on the same stream is enqueued, which
        the model does not track: programs leave such arrays alone until the
        quarantine is visible."""
        if h.quarantined:
            return False
        buf = self._buf(h)
        return any(
            e.predicted is CompletionUnknownError and any(b is buf for b in e.unknown_bufs)
            for e in self.entries
        )

    async def _verify(self, arr: trio_cuda.DeviceArray, stream: trio_cuda.Stream | None = None) -> None:
        """Read ``arr`` back (device not held) and compare with the model."""
        if arr.closed or arr.quarantined or self._doomed(arr):
            return
        buf = self._buf(arr)
        expected = None if buf.value is None else buf.value.copy()
        got = await self.gpu.to_host(arr, stream=stream)
        assert got.dtype == F4
        assert got.shape == (self.n,)
        if expected is not None:
            np.testing.assert_array_equal(got, expected)

    async def _await_outcome(self, e: Entry, aw: Any) -> object:
        """Await a submission's outcome and check it against the prediction."""
        if e.predicted is not None:
            with pytest.raises(e.predicted):
                await aw
            e.observed = True
            return None
        out = await aw
        e.check_output(out)
        e.observed = True
        return out

    def _outcome(self, e: Entry, get: Callable[[], object], *, observe: bool = True) -> object:
        """Check the outcome of a completed submission against its prediction."""
        if e.predicted is not None:
            with pytest.raises(e.predicted):
                get()
            e.observed = e.observed or observe
            return None
        out = get()
        e.check_output(out)
        e.observed = e.observed or observe
        return out

    # ------------------------------------------------------------------ plans
    def _kernel(self, base: trio_cuda.Kernel, fault: str | None) -> trio_cuda.Kernel:
        if fault is None:
            return base
        # A fresh kernel per faulty launch: the trace then tells whether it executed.
        self.kernels += 1
        name = f"{base.name}_fault{self.kernels}"
        assert base.source is not None
        return trio_cuda.Kernel.from_source(
            base.source.replace(f" {base.name}(", f" {name}("),
            name,
            params=list(base.params),
            reference=base.reference,
        )

    def _executed_probe(self, name: str) -> Callable[[], bool]:
        return lambda: any(ev.kind == "launch" and ev.label == name for ev in self.sim.trace)

    def _plan(
        self,
        kernel: str,
        hids: list[int],
        chain: str | None,
        fault: str | None,
        a: int,
        v: int,
        v2: int,
        host_raises: bool,
    ) -> Plan | None:
        hs = [self.handles.get(h) for h in hids]
        if any(h is None for h in hs):
            return None  # its creation failed (as predicted) at run time
        handles: list[trio_cuda.DeviceArray] = hs  # type: ignore[assignment]
        if any(self._doomed(h) for h in handles):
            return None
        n = self.n
        grid = (n + 127) // 128
        piece_handles = handles[:2] if kernel in ("saxpy", "copy") else handles[:1]
        if kernel == "host":
            piece_handles = []
        q_piece = any(h.quarantined for h in piece_handles)
        if q_piece:
            fault = None  # the launch never reaches the driver: no fault is consumed
        executed: Callable[[], bool] = lambda: True  # noqa: E731
        written: list[trio_cuda.DeviceArray] = []
        if kernel == "add":
            (x,) = piece_handles
            k = self._kernel(ADD, fault)
            op: trio_cuda.DeviceOp[Any] = k.launch(x, F4(v), n, grid=grid, block=128)
            bx = self._buf(x)
            out: object = x
            written = [x]

            def eff() -> None:
                if bx.value is not None:
                    bx.value = bx.value + F4(v)
        elif kernel == "saxpy":
            x, y = piece_handles
            k = self._kernel(SAXPY, fault)
            op = k.launch(F4(a), x, y, n, grid=grid, block=128)
            bx, by = self._buf(x), self._buf(y)
            out = y
            written = [y]

            def eff() -> None:
                if bx.value is None or by.value is None:
                    by.value = None
                else:
                    by.value = F4(a) * bx.value + by.value
        elif kernel == "copy":
            src, dst = piece_handles
            k = self._kernel(COPY, fault)
            op = k.launch(src, dst, n, grid=grid, block=128)
            bs, bd = self._buf(src), self._buf(dst)
            out = dst
            written = [dst]

            def eff() -> None:
                bd.value = None if bs.value is None else bs.value.copy()
        elif kernel == "fill":
            (x,) = piece_handles
            if q_piece:  # ops.fill itself refuses a quarantined array
                with pytest.raises(CompletionUnknownError, match="quarantined"):
                    ops.fill(x, v)
                return None
            op = ops.fill(x, v)
            bx = self._buf(x)
            out = x
            written = [x]

            def eff() -> None:
                bx.value = np.full(n, v, F4)
        else:
            ran: list[tuple[int, int]] = []

            def host_fn(token: int) -> tuple[str, int]:
                assert threading.get_ident() == self.loop_thread  # never a driver thread
                ran.append((threading.get_ident(), token))
                if host_raises:
                    raise HostBoom(token)
                return ("host", token)

            token = self._fresh_token()
            op = ops.host_closure(host_fn, token)
            out = ("host", token)
            executed = lambda: bool(ran)  # noqa: E731

            def eff() -> None:
                pass

        predicted: type[BaseException] | None = None
        unknown_bufs: tuple[Buf, ...] = ()
        piece_eff = eff
        if fault is not None:
            executed = self._executed_probe(k.name)
        if fault == "kernel_fault":
            predicted = LaunchError
            piece_eff = lambda: None  # noqa: E731 - the kernel does not run
        elif fault == "completion_unknown":
            predicted = CompletionUnknownError
            unknown_bufs = tuple(self._buf(h) for h in piece_handles)
            bw = self._buf(written[0])

            def piece_eff() -> None:
                bw.value = None
        elif kernel == "host" and host_raises:
            predicted = HostBoom

        # The checks compare identities: an entry must not keep a handle alive.
        piece_ids = _ids(out)

        def check_piece_out(got: object) -> None:
            assert _ids(got) == piece_ids, got

        check_output = check_piece_out
        effects = [piece_eff]
        raises: type[BaseException] | None = None
        if q_piece:
            raises, effects = CompletionUnknownError, []
        elif fault == "launch_error":
            raises, effects = LaunchError, []
        elif chain == "then":
            seen: list[object] = []
            w = written[0]
            bw2 = self._buf(w)

            def then_fn(o: trio_cuda.DeviceArray) -> trio_cuda.DeviceOp[Any]:
                seen.append(o)
                assert o is w
                return ADD.launch(o, F4(v2), n, grid=grid, block=128)

            op = op.then(then_fn)

            def eff2() -> None:
                if bw2.value is not None:
                    bw2.value = bw2.value + F4(v2)

            effects.append(eff2)
        elif chain == "then_raise":
            w = written[0]

            def then_raise(o: trio_cuda.DeviceArray) -> trio_cuda.DeviceOp[Any]:
                assert o is w
                raise ThenBoom("closure failed")

            op = op.then(then_raise)
            raises = ThenBoom
        elif chain == "map":
            op = op.map(lambda o: ("mapped", o))
            map_ids = ("mapped", piece_ids)

            def check_map(got: object) -> None:
                assert _ids(got) == map_ids

            check_output = check_map
        elif chain == "zip":
            z = handles[-1]
            bz = self._buf(z)
            op = trio_cuda.zip(op, ADD.launch(z, F4(v2), n, grid=grid, block=128))
            written = [*written, z]
            if z.quarantined:
                raises = CompletionUnknownError
            else:

                def eff_z() -> None:
                    if bz.value is not None:
                        bz.value = bz.value + F4(v2)

                effects.append(eff_z)

                zip_ids = (piece_ids, _ids(z))

                def check_zip(got: object) -> None:
                    assert _ids(got) == zip_ids

                check_output = check_zip
        entry = None
        if raises is None:
            entry = Entry(
                f"{kernel}/{chain}/{fault}",
                predicted,
                executed,
                check_output,
                unknown_bufs=unknown_bufs,
                kernel=kernel != "host",
            )
        return Plan(op, raises, effects, entry, written, fault)

    _token = 0

    def _fresh_token(self) -> int:
        self._token += 1
        return self._token

    def _arm(self, plan: Plan) -> None:
        """Right before submission: inject the fault and advance the model."""
        if plan.fault is not None:
            self.sim.inject_fault(plan.fault)  # type: ignore[arg-type]
        for eff in plan.effects:
            eff()

    # ------------------------------------------------------------------ steps
    async def _do_alloc(self, hid: int, bid: int, kind: str, stream: int | None, v: int) -> None:
        gpu, n, s = self.gpu, self.n, self._stream(stream)
        value: np.ndarray | None
        if kind == "empty":
            arr = gpu.empty(n, F4, stream=s)
            value = None
        elif kind == "zeros":
            arr = gpu.zeros(n, F4, stream=s)
            value = np.zeros(n, F4)
        elif kind == "full":
            arr = gpu.full(n, v, F4, stream=s)
            value = np.full(n, v, F4)
        else:
            host = np.arange(n, dtype=F4) * F4(v)
            value = host.copy()
            arr = await gpu.to_device(host, stream=s)
            host[:] = 99  # the device copy is independent of the host array
        assert (arr.shape, arr.dtype, arr.readonly, arr.closed) == ((n,), np.dtype(F4), False, False)
        self._register(hid, bid, arr, value)

    async def _do_oom(self, kind: str) -> None:
        gpu, sim = self.gpu, self.sim
        before = (gpu.statistics(), sim.statistics().allocations, sim.live_allocations, sim.pending)
        sim.inject_fault("out_of_memory")
        with pytest.raises(OutOfMemoryError, match="out_of_memory"):
            if kind == "empty":
                gpu.empty(self.n, F4)
            elif kind == "zeros":
                gpu.zeros(self.n, F4)
            else:
                await gpu.to_device(np.zeros(self.n, F4))
        after = gpu.statistics()
        assert (after.submitted, after.live_allocations, after.leases_held) == (
            before[0].submitted,
            before[0].live_allocations,
            before[0].leases_held,
        )
        assert (sim.statistics().allocations, sim.live_allocations, sim.pending) == before[1:]

    async def _do_readonly(self, src: int, hid: int) -> None:
        h = self.handles.get(src)
        if h is None:
            return
        buf = self._buf(h)
        if h.quarantined:
            with pytest.raises(CompletionUnknownError):
                h.as_readonly()
            return
        r = h.as_readonly()
        assert r.readonly
        assert not r.closed
        assert (r.ptr, r.shape, r.dtype) == (h.ptr, h.shape, h.dtype)
        bid = next(b for b, x in self.bufs.items() if x is buf)
        self._register(hid, bid, r, None)

    async def _do_launch(
        self,
        kernel: str,
        hids: list[int],
        mode: str,
        chain: str | None,
        fault: str | None,
        fid: int | None,
        stream: int | None,
        a: int,
        v: int,
        v2: int,
        host_raises: bool,
    ) -> None:
        if fid is not None:
            self.futs[fid] = None
        gpu, s = self.gpu, self._stream(stream)

        def make_plan() -> Plan | None:
            return self._plan(kernel, hids, chain, fault, a, v, v2, host_raises)

        if mode.startswith("task"):
            # The plan is made inside the task, right before it submits: which
            # arrays are quarantined may change while the task waits to start.
            await self._task_launch(make_plan, mode, s)
            return
        plan = make_plan()
        if plan is None:
            return
        if mode in ("await", "await_op"):
            self._arm(plan)
            if plan.raises is not None:
                with pytest.raises(plan.raises):
                    await (gpu.run(plan.op, stream=s) if mode == "await" else plan.op)
                return
            e = plan.entry
            assert e is not None
            self.entries.append(e)
            # `await op` means `await current_scope().run(op)`
            aw = gpu.run(plan.op, stream=s) if mode == "await" else plan.op
            if await self._await_outcome(e, aw) is not None:
                for w in plan.written:
                    await self._verify(w)
            return
        if mode in ("keep", "drop"):
            self._arm(plan)
            if plan.raises is not None:
                with pytest.raises(plan.raises):
                    gpu.submit(plan.op, stream=s)
                return
            e = plan.entry
            assert e is not None
            self.entries.append(e)
            fut = gpu.submit(plan.op, stream=s)
            assert fut.stream in gpu.streams
            if s is not None:
                assert fut.stream is s
            if mode == "keep":
                e.fut = fut
                assert fid is not None
                self.futs[fid] = e
            del fut  # dropped: the scope keeps the submission

    async def _task_launch(
        self, make_plan: Callable[[], Plan | None], mode: str, s: trio_cuda.Stream | None
    ) -> None:
        gpu, sim = self.gpu, self.sim
        cs = trio.CancelScope()
        submitted_before = gpu.statistics().submitted
        plans: list[Plan] = []
        result: list[object] = []
        linger = mode == "task_linger"

        async def task() -> None:
            plan = make_plan()
            if plan is None:
                return
            plans.append(plan)
            with cs:
                if not cs.cancel_called:
                    self._arm(plan)
                    if plan.entry is not None:
                        self.entries.append(plan.entry)
                try:
                    out = await gpu.run(plan.op, stream=s)
                except trio.Cancelled:
                    raise
                except Exception as exc:
                    result.append(exc)
                else:
                    result.append(out)
            if linger and plan.entry is not None:
                self._task_result(plan.entry, result)

        self.nursery.start_soon(task)
        if mode == "task_precancel":
            cs.cancel()
        await trio.testing.wait_all_tasks_blocked()
        if not plans:
            return
        (plan,) = plans
        if mode == "task_precancel":
            assert cs.cancelled_caught
            assert not result
            assert gpu.statistics().submitted == submitted_before  # nothing was submitted
            return
        if plan.raises is not None:
            assert len(result) == 1
            assert isinstance(result[0], plan.raises), result
            return
        e = plan.entry
        assert e is not None
        if linger:
            self.lingering.append((cs, e))  # checked by the task when it completes
            return
        must_cancel = sim.held and e.kernel  # its work cannot run while the device is held
        cs.cancel()
        await trio.testing.wait_all_tasks_blocked()
        if must_cancel:
            # cancelled promptly, without waiting for the GPU; the scope keeps the work
            assert cs.cancelled_caught
            assert not result
            assert gpu.statistics().in_flight >= 1
        self._task_result(e, result)

    def _task_result(self, e: Entry, result: list[object]) -> None:
        if not result:
            return  # cancelled: the error (if any) is nobody's, raised at exit
        (got,) = result
        if e.predicted is not None:
            assert isinstance(got, e.predicted), (got, e)
        elif isinstance(got, BaseException):
            raise AssertionError(f"{e.label}: unexpected error {got!r}") from got
        else:
            e.check_output(got)
        e.observed = True

    async def _do_misuse(self, kind: str, hid: int) -> None:
        h = self.handles.get(hid)
        if h is None:
            return
        gpu, sim = self.gpu, self.sim
        before = (gpu.statistics().submitted, sim.pending, sim.statistics().launches)
        n = self.n
        if kind == "closed":
            assert h.closed
            with pytest.raises(trio_cuda.KernelArgumentError, match="closed"):
                ADD.launch(h, F4(1), n, grid=1, block=128)
        elif kind == "readonly_write":
            with pytest.raises(trio_cuda.KernelArgumentError, match="read-only"):
                ADD.launch(h, F4(1), n, grid=1, block=128)
        elif h.quarantined:  # checked before the write permission
            with pytest.raises(CompletionUnknownError, match="quarantined"):
                ops.fill(h, 1)
        else:
            with pytest.raises(ValueError, match="read-only"):
                ops.fill(h, 1)
        assert (gpu.statistics().submitted, sim.pending, sim.statistics().launches) == before

    async def _do_check(self, hid: int, fid: int | None, stream: int | None) -> None:
        if fid is not None:
            self.futs[fid] = None
        h = self.handles.get(hid)
        if h is None:
            return
        gpu, s = self.gpu, self._stream(stream)
        if self._doomed(h):
            return
        if h.quarantined:
            with pytest.raises(CompletionUnknownError):
                gpu.submit(ops.copy(np.empty(self.n, F4), h), stream=s)
            return
        if fid is None:  # not held: read back now
            await self._verify(h, s)
            return
        buf = self._buf(h)
        snap = None if buf.value is None else buf.value.copy()
        host = np.full(self.n, -7, F4)

        def check_copy(got: object) -> None:
            assert got is host
            if snap is not None:
                np.testing.assert_array_equal(host, snap)

        e = Entry("d2h", None, lambda: True, check_copy, kernel=True)
        e.fut = gpu.submit(ops.copy(host, h), stream=s)
        self.entries.append(e)
        self.futs[fid] = e

    async def _do_await_future(self, fid: int) -> None:
        e = self.futs.get(fid)
        if e is None or e.fut is None:
            return
        fut = e.fut
        if not self.sim.held or fut.done():
            out = await self._await_outcome(e, fut.wait())
            assert fut.done()
            if not self.sim.held:
                for w in out if isinstance(out, tuple) else (out,):
                    if isinstance(w, trio_cuda.DeviceArray):
                        await self._verify(w)
            return
        try:
            # wait_nowait observes a completion nobody observed yet (the device
            # may have finished the work before it was held) and retires it
            self._outcome(e, fut.wait_nowait)
        except trio.WouldBlock:
            assert not fut.done()
        else:
            assert fut.done()
            return
        result: list[object] = []
        with trio.move_on_after(0.001) as cs:
            try:
                result.append(await fut.wait())
            except Exception as exc:
                result.append(exc)
        if cs.cancelled_caught:
            assert not result
        else:
            self._task_result(e, result)

    async def _do_hold(self) -> None:
        self.sim.hold()
        assert self.sim.held

    async def _do_release(self) -> None:
        self.sim.release()
        await trio.testing.wait_all_tasks_blocked()

    async def _do_complete_next(self, k: int, settle: bool) -> None:
        for _ in range(k):
            self.sim.complete_next()
        if settle:
            await trio.testing.wait_all_tasks_blocked()

    async def _do_run_until_idle(self) -> None:
        self.sim.run_until_idle()
        await trio.testing.wait_all_tasks_blocked()

    async def _do_close(self, hid: int) -> None:
        h = self.handles.get(hid)
        if h is not None:
            h.close()
            assert h.closed

    async def _do_drop(self, hid: int) -> None:
        self.handles.pop(hid, None)
        gc.collect(0)

    async def _do_cancel_lingering(self) -> None:
        self._cancel_lingering()
        await trio.testing.wait_all_tasks_blocked()

    async def _do_settle(self) -> None:
        gpu, sim = self.gpu, self.sim
        gc.collect(0)
        await self._quiesce()
        stats = gpu.statistics()
        assert (stats.in_flight, stats.leases_held, stats.retained_bytes, stats.host_closures_pending) == (
            0,
            0,
            0,
            0,
        )
        assert sim.pending == 0
        live = {(a.ptr, a.nbytes) for a in sim.live_allocations}
        for buf in self.seg_bufs:
            alive = buf.alive()
            keep = any(not a.closed for a in alive) or any(a.quarantined for a in alive)
            assert (buf.key in live) == keep, (buf, alive)
