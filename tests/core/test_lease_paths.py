"""The fast lease path of single kernel launches agrees with the general one.

``take_launch_leases`` (``trio_cuda._core._submit``) records a launch's leases
from its precomputed access plan, ordering leases of other streams in its way
itself under ``conflicts="order"``, and falls back to ``take_leases`` where
a conflict must be refused, an exported or quarantined submission is in the
way, a lease table is indexed, or an array is closed, read-only (for a
write) or not live. Setting the module global
``FAST_LEASES = False`` sends every launch through ``take_leases``. A
hypothesis property runs random programs (arrays, views, read-only views,
closed handles, launches of kernels with In/Out/InOut parameters built once
and submitted again later, on policy-chosen or pinned streams, bursts of
launches on up to four streams that all write the same buffers (every launch a
cross-stream conflict), bursts of up to 40 reads of one whole or partial view
(past the lease-table index threshold), with
``conflicts="order"`` or ``"error"``, a held device stepped at random,
injected faults) twice on fresh simulated devices, once with each setting,
and compares after every step: the exceptions (type and message), every
allocation's lease table (``active``, ``writers``, ``readers`` with their extents, state,
handles, whether it has a range index), the commands queued on every stream (cross-stream
``wait_marker`` commands included), the scope's statistics; at the end the
device trace and counters, the memory contents and the exit's errors. Both
runs must also leave ``sim.violations == []``.

Launches that took the fast path (with and without cross-stream waits) and
launches that fell back are counted, each path must be taken exactly when
predicted, and each kind must occur, so that the property cannot hold
vacuously.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import run_bounded
from tests.helpers.kernels import stub_source
from trio_cuda import In, InOut, Out, Scalar
from trio_cuda._core import _completion, _scope, _submit
from trio_cuda._core._array import AllocState
from trio_cuda._core._extent import array_extent, overlaps
from trio_cuda._core._ops import Access
from trio_cuda._core._submit import SubState
from trio_cuda.testing import SimDevice

N = 16
I4 = np.int32


def _flat(a: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
    return a.reshape(-1)[:n]


def _copy_ref(x: Any, y: Any, n: Any) -> None:
    n = min(int(n), x.size, y.size)
    _flat(y, n)[:] = _flat(x, n) + 1


def _mix_ref(x: Any, y: Any, z: Any, n: Any) -> None:
    n = min(int(n), x.size, y.size, z.size)
    _flat(z, n)[:] = 0.5 * _flat(z, n) + _flat(x, n) - _flat(y, n)


def _bump_ref(x: Any, v: Any) -> None:
    x += v


def _read2_ref(x: Any, y: Any) -> None:
    pass


KERNELS = [
    trio_cuda.Kernel.from_source(
        stub_source("copy1"), "copy1", params=[In("f4"), Out("f4"), Scalar("i4")], reference=_copy_ref
    ),
    trio_cuda.Kernel.from_source(
        stub_source("mix"), "mix", params=[In("f4"), In("f4"), InOut("f4"), Scalar("i4")], reference=_mix_ref
    ),
    trio_cuda.Kernel.from_source(
        stub_source("bump"), "bump", params=[InOut("f4"), Scalar("f4")], reference=_bump_ref
    ),
    trio_cuda.Kernel.from_source(
        stub_source("read2"), "read2", params=[In("f4"), In("f4")], reference=_read2_ref
    ),
]

# --------------------------------------------------------------------------- programs

idx = st.integers(0, 63)
stream_choice = st.integers(-1, 3)  # -1: the scheduling policy picks
kernel = st.integers(0, len(KERNELS) - 1)
arg_picks = st.tuples(idx, idx, idx)
#: each kind of step, and how often it is drawn
STEPS: dict[str, tuple[int, st.SearchStrategy[tuple[Any, ...]]]] = {
    "launch": (12, st.tuples(st.just("launch"), kernel, arg_picks, stream_choice)),
    "submit": (6, st.tuples(st.just("submit"), idx, stream_choice)),  # a launch built before
    "complete_next": (6, st.tuples(st.just("complete_next"))),
    "build": (2, st.tuples(st.just("build"), kernel, arg_picks)),
    #: launches of a writing kernel on streams first, first + 1, ...
    "writes": (
        3,
        st.tuples(st.just("writes"), st.sampled_from([0, 1, 2]), arg_picks, st.integers(2, 8), idx),
    ),
    #: reads of one array on streams first, first + 1, ... (up to past ``INDEX_AT``)
    "reads": (3, st.tuples(st.just("reads"), idx, st.one_of(st.integers(1, 8), st.integers(30, 40)), idx)),
    "alloc": (2, st.tuples(st.just("alloc"), st.integers(0, 9), stream_choice)),
    "view": (2, st.tuples(st.just("view"), idx, st.integers(0, N - 1), st.integers(1, N))),
    "reshape": (1, st.tuples(st.just("reshape"), idx)),
    "readonly": (3, st.tuples(st.just("readonly"), idx)),
    "close": (2, st.tuples(st.just("close"), idx)),
    "hold": (2, st.tuples(st.just("hold"))),
    "release": (2, st.tuples(st.just("release"))),
    "run_until_idle": (1, st.tuples(st.just("run_until_idle"))),
    "settle": (3, st.tuples(st.just("settle"))),
    "fault": (1, st.tuples(st.just("fault"), st.sampled_from(["kernel_fault", "completion_unknown"]))),
}
step = st.sampled_from([k for k, (w, _) in STEPS.items() for _ in range(w)]).flatmap(lambda k: STEPS[k][1])
programs = st.fixed_dictionaries(
    {
        "conflicts": st.sampled_from(["order", "error"]),
        "streams": st.integers(1, 4),
        "held": st.booleans(),
        #: the arrays made first (by the stream each is allocated on)
        "arrays": st.lists(stream_choice, min_size=2, max_size=4),
        "steps": st.lists(step, min_size=10, max_size=40),
    }
)


def _describe(exc: BaseException) -> Any:
    if isinstance(exc, BaseExceptionGroup):
        return ("group", type(exc).__name__, tuple(_describe(e) for e in exc.exceptions))
    return (type(exc).__name__, str(exc))


class Run:
    """One execution of a program; ``record`` is what the other run must match."""

    def __init__(self, program: dict[str, Any]) -> None:
        self.program = program
        self.sim = SimDevice()
        self.record: list[Any] = []

    def snapshot(self, gpu: trio_cuda.ResourceScope, what: Any, outcome: Any) -> None:
        allocs = []
        for alloc in internals.allocation_records(gpu):
            allocs.append(
                (
                    alloc.ptr,
                    alloc.nbytes,
                    alloc.state.value,
                    alloc.handles,
                    alloc.active,
                    alloc.index is not None,
                    tuple(sorted((w.id, e) for w, e in alloc.writers.items())),
                    tuple(sorted((r.id, e) for r, e in alloc.readers.items())),
                )
            )
        queues = tuple(
            tuple((c.seq, c.kind, c.label) for c in internals.queued_commands(s)) for s in gpu.streams
        )
        pending = tuple(
            tuple(getattr(p, "id", "host") for p in internals.pending_submissions(s)) for s in gpu.streams
        )
        streams = tuple(s.statistics() for s in gpu.streams)
        self.record.append((what, outcome, tuple(allocs), queues, pending, gpu.statistics(), streams))

    async def main(self) -> None:
        prog = self.program
        sim = self.sim
        try:
            async with trio_cuda.open_scope(
                device=sim, streams=prog["streams"], conflicts=prog["conflicts"]
            ) as gpu:
                try:
                    await self.steps(gpu)
                finally:
                    sim.release()  # whatever happened, the exit must not wait for a held device
        except BaseException as exc:
            self.record.append(("exit", _describe(exc)))
        trace = tuple((e.seq, e.stream, e.kind, e.label) for e in sim.trace)
        self.record.append(("trace", trace, sim.statistics(), len(sim.live_allocations)))

    async def steps(self, gpu: trio_cuda.ResourceScope) -> None:
        prog = self.program
        sim = self.sim
        if prog["held"]:
            sim.hold()
        handles: list[Any] = []
        launches: list[Any] = []

        def stream_of(choice: int) -> Any:
            return None if choice < 0 else gpu.streams[choice % len(gpu.streams)]

        def handle(i: int) -> Any:
            if not handles:
                raise LookupError("no array yet")
            return handles[i % len(handles)]

        def build(k: int, args: tuple[int, ...]) -> Any:
            kernel = KERNELS[k]
            values: list[Any] = []
            arrays = iter(args)
            for p in kernel.params:
                if isinstance(p, Scalar):
                    values.append(I4(N) if p.dtype == np.int32 else np.float32(1.5))
                else:
                    values.append(handle(next(arrays)))
            return kernel.launch(*values, grid=1, block=N)

        first = [("alloc", i, choice) for i, choice in enumerate(prog["arrays"])]
        for n, step_ in enumerate(first + prog["steps"]):
            kind = step_[0]
            outcome: Any = "ok"
            try:
                if kind == "alloc":
                    handles.append(gpu.full(N, float(step_[1]), np.float32, stream=stream_of(step_[2])))
                elif kind == "view":
                    lo, hi = sorted((step_[2], step_[3]))
                    handles.append(handle(step_[1])[lo : max(hi, lo + 1)])
                elif kind == "reshape":
                    h = handle(step_[1])
                    handles.append(h.reshape(2, -1) if h.size % 2 == 0 else h.reshape(-1))
                elif kind == "readonly":
                    handles.append(handle(step_[1]).as_readonly())
                elif kind == "close":
                    handle(step_[1]).close()
                elif kind == "build":
                    launches.append(build(step_[1], step_[2]))
                elif kind == "submit":
                    if not launches:
                        raise LookupError("no launch yet")
                    gpu.submit(launches[step_[1] % len(launches)], stream=stream_of(step_[2]))
                elif kind == "launch":
                    op = build(step_[1], step_[2])
                    launches.append(op)
                    gpu.submit(op, stream=stream_of(step_[3]))
                elif kind == "writes":  # copy1, mix, bump: each writes
                    for j in range(step_[3]):
                        gpu.submit(build(step_[1], step_[2]), stream=stream_of(step_[4] + j))
                elif kind == "reads":
                    h = handle(step_[1])
                    for j in range(step_[2]):
                        gpu.submit(KERNELS[3].launch(h, h, grid=1, block=N), stream=stream_of(step_[3] + j))
                elif kind == "hold":
                    sim.hold()
                elif kind == "release":
                    sim.release()
                elif kind == "complete_next":
                    outcome = sim.complete_next()
                elif kind == "run_until_idle":
                    outcome = sim.run_until_idle()
                elif kind == "settle":
                    await trio.testing.wait_all_tasks_blocked()
                elif kind == "fault":
                    sim.inject_fault(step_[1])
            except (trio_cuda.TrioCudaError, LookupError, ValueError) as exc:
                outcome = _describe(exc)
            self.snapshot(gpu, (n, step_), outcome)
        sim.release()
        sim.run_until_idle()
        await trio.testing.wait_all_tasks_blocked()
        contents = [
            (alloc.ptr, sim.peek(alloc.ptr, alloc.nbytes))
            for alloc in internals.allocation_records(gpu)
            if alloc.state is AllocState.LIVE
        ]
        self.snapshot(gpu, "end", tuple(contents))
        for h in handles:
            h.close()


def _why_general(scope: Any, stream: Any, op: Any) -> str:
    """Why ``take_launch_leases`` should leave its fast path ("-": it should
    not; "- ordered": it should not, and orders leases of other streams)."""
    in_way: list[Any] = []
    for arr, access in internals.accesses_of(op):
        alloc = internals.allocation_of(arr)
        write = access is Access.WRITE
        if internals.handle_closed(arr):
            return "closed handle"
        if alloc.state is not AllocState.LIVE:
            return f"{alloc.state.value} memory"
        if alloc.index is not None:
            return "indexed lease table"
        if write and arr.readonly:  # pragma: no cover - k.launch refuses it
            return "read-only write"
        ext = array_extent(arr)
        tables = (alloc.writers, alloc.readers) if write else (alloc.writers,)
        for table in tables:
            in_way += [s for s, e in table.items() if s.stream is not stream and overlaps(e, ext)]
    if not in_way:
        return "-"
    if internals.conflict_mode(scope) == "error":
        return "conflict to refuse"
    if any(s.state in (SubState.EXPORTED, SubState.QUARANTINED) for s in in_way):
        return "exported or quarantined work in the way"
    return "- ordered"


def _run(program: dict[str, Any], fast: bool, counts: Counter[str], *, compiled: bool = True) -> Run:
    """Run ``program``: on the fast path (its compiled common case too where
    it exists and ``compiled``), or on the general path only."""
    run = Run(program)
    saved = _submit.FAST_LEASES
    real = _scope.take_launch_leases
    saved_whole = _submit.take_whole
    saved_retire = _completion.retire_done
    saved_submit = _scope.submit_launch
    saved_scan = _completion.scan_streams
    saved_look = _scope.look

    def whole(*args: Any) -> bool:
        assert saved_whole is not None
        took: bool = saved_whole(*args)
        counts["compiled common case"] += took
        counts["compiled common case with waits"] += took and args[2].dirty
        return took

    def retire(*args: Any) -> bool:
        assert saved_retire is not None
        took: bool = saved_retire(*args)
        counts["compiled retire"] += took
        return took

    def submit(*args: Any) -> Any:
        assert saved_submit is not None
        made = saved_submit(*args)
        counts["compiled submit"] += made is not None
        return made

    def scan(completion: Any) -> bool:
        assert saved_scan is not None
        counts["compiled scan"] += 1
        return saved_scan(completion)

    def counting(scope: Any, stream: Any, sub: Any, op: Any) -> None:
        why = _why_general(scope, stream, op)
        took = "error"  # from either path: the records compare them
        try:
            real(scope, stream, sub, op)
            # the general path makes a dict
            took = "fast" if type(sub.leases) is tuple else "fallback"
        finally:
            counts[took] += 1
            counts[f"{took}: {why}"] += 1
            if took == "fast" and sub.dirty:
                counts["fast with waits"] += 1

    _submit.FAST_LEASES = fast
    if fast:
        _scope.take_launch_leases = counting
    _submit.take_whole = whole if compiled and saved_whole is not None else None
    _completion.retire_done = retire if compiled and saved_retire is not None else None
    _scope.submit_launch = submit if compiled and saved_submit is not None else None
    _completion.scan_streams = scan if compiled and saved_scan is not None else None
    _scope.look = saved_look if compiled else None
    try:
        run_bounded(run.main, limit=20.0)
    finally:
        _submit.FAST_LEASES = saved
        _scope.take_launch_leases = real
        _submit.take_whole = saved_whole
        _completion.retire_done = saved_retire
        _scope.submit_launch = saved_submit
        _completion.scan_streams = saved_scan
        _scope.look = saved_look
    return run


#: a program that surely reaches an indexed lease table (35 reads of a view
#: held in flight, then a launch on it): the random ones reach it only now
#: and then, and the counts below must see every path
INDEXED = {
    "conflicts": "order",
    "streams": 2,
    "held": True,
    "arrays": [0, 1],
    "steps": [("view", 0, 2, 9), ("reads", 2, 35, 0), ("reads", 2, 1, 1), ("launch", 0, (2, 1, 2), 0)]
    + [("complete_next",)] * 6,
}


def test_fast_and_general_lease_paths_agree() -> None:
    counts: Counter[str] = Counter()

    @settings(
        max_examples=500,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(programs, st.booleans())
    @example(INDEXED, True)
    @example(INDEXED, False)
    def check(program: dict[str, Any], compiled: bool) -> None:
        # the fast path with the compiled common cases (where built: taking a
        # launch's leases, submitting it, scanning and retiring) or all in
        # Python, against all in Python
        fast = _run(program, True, counts, compiled=compiled)
        general = _run(program, False, Counter(), compiled=False)
        assert fast.sim.violations == []
        assert general.sim.violations == []
        assert len(fast.record) == len(general.record)
        for a, b in zip(fast.record, general.record):
            assert a == b
        trace = fast.record[-1][1]
        counts["programs with cross-stream waits"] += any(e[2] == "wait_marker" for e in trace)
        counts["programs with conflicts refused"] += "AccessConflictError" in repr(fast.record)

    check()
    print(dict(sorted(counts.items())))
    assert _submit.FAST_LEASES is True
    # the fast path was taken exactly when nothing called for the general one
    assert counts["fast"] == counts["fast: -"] + counts["fast: - ordered"], counts
    assert counts["fallback: -"] == counts["fallback: - ordered"] == 0, counts
    assert counts["fast: -"] > 0, counts
    assert counts["fast: - ordered"] > 0, counts
    assert counts["fast with waits"] > 0, counts
    assert counts["fallback"] > 0, counts
    assert counts["fallback: indexed lease table"] > 0, counts
    assert counts["fallback: conflict to refuse"] > 0, counts
    assert counts["programs with cross-stream waits"] > 0, counts
    assert counts["programs with conflicts refused"] > 0, counts
    if _submit.take_whole is not None:
        assert counts["compiled common case"] > 0, counts
        assert counts["compiled common case with waits"] > 0, counts
        assert counts["compiled retire"] > 0, counts
        assert counts["compiled submit"] > 0, counts
        assert counts["compiled scan"] > 0, counts


def test_zeros_and_full_do_not_conflict_with_their_own_allocation() -> None:
    """Found by the programs above: with no stream given, ``zeros`` and
    ``full`` let the policy pick the allocation's stream and then, again, the
    fill's; with every stream busy they differ, so the fill of a brand-new
    array conflicts with the allocation's own publication (a write lease on
    the other stream): ``conflicts="error"`` raises ``AccessConflictError``,
    ``"order"`` makes the fill wait for unrelated work on the other stream."""

    async def main(conflicts: str) -> None:
        sim = SimDevice()
        async with trio_cuda.open_scope(device=sim, streams=2, conflicts=conflicts) as gpu:
            s0, s1 = gpu.streams
            a = gpu.zeros(N, np.float32, stream=s0)
            b = gpu.zeros(N, np.float32, stream=s1)
            await trio.testing.wait_all_tasks_blocked()
            sim.hold()
            try:
                bump = KERNELS[2]
                gpu.submit(bump.launch(a, np.float32(1), grid=1, block=N), stream=s0)  # both streams busy
                gpu.submit(bump.launch(b, np.float32(1), grid=1, block=N), stream=s1)
                made = [gpu.zeros(N, np.float32), gpu.full(N, 2.0, np.float32)]
                waits = [
                    c.label
                    for s in gpu.streams
                    for c in internals.queued_commands(s)
                    if c.kind == "wait_marker"
                ]
                assert waits == []  # a new array depends on no earlier work
            finally:
                sim.release()
            for arr in (a, b, *made):
                arr.close()
        assert sim.violations == []
        assert sim.live_allocations == []

    for conflicts in ("error", "order"):
        run_bounded(main, conflicts, limit=10.0)
