"""Rule 10 by enumeration: every interleaving of awaiting tasks, the
completion-handoff task and the device, replayed deterministically.

Rule 10 has two retirers: an awaiting task (``ResourceScope._observe``) that
looks at its own marker between checkpoints and retires the completed prefix
of every stream itself, and the completion-handoff task, the backstop. This
module checks the protocol the way a model checker would: a small abstract
model enumerates, at collection time, every schedule of a handful of
*events*, and each schedule is replayed against the real library as its own
test, with every scheduling decision taken by the test:

* **waiters** are gated: ``_completion.checkpoint`` (the checkpoints of
  ``_observe``) is replaced by a gate that only the test opens, so each
  ``L:W`` event lets waiter ``W`` run exactly one segment (one look, then
  retire, checkpoint again or park). Whether a waiter keeps looking or parks
  (``others_runnable()``) follows its look budget ``B``: it looks ``B + 1``
  times while its work is pending, then parks.
* **the device** is held; ``D`` is one ``sim.complete_next()``. ``L:W+D`` is
  the same completion placed *inside* ``W``'s segment, right before its
  look, with no scheduling point between (nobody else can observe it first).
* **the handoff task** is not gated: after every event the test waits until
  every task is blocked, so the handoff runs whenever it was woken. ``H<k>(e)``
  places a device completion inside the handoff's ``k``-th marker poll after
  event ``e`` (between its scan and its ``wait_for_progress``, or between
  two heads): the sim's timed work completes inside ``poll_marker`` exactly so.
* **other events**: ``S:key`` submits work (a dropped future, a host closure,
  a conflicting write), ``L:W+S:key`` submits it inside ``W``'s segment right
  before its look, ``X:W`` cancels a waiter.

For every schedule the test checks, besides the model's prediction of every
waiter's state and of what the device completed after each event:

* every submission retires exactly once (``_retire`` and
  ``_quarantine_submission`` are wrapped and record who retired what), per
  stream in submission order, never before its marker completed; host
  closures run only in the handoff task, after everything before them on
  their stream retired;
* a waiter retires only inside its own look segment, and it is the retirer of
  a completion placed right before its look;
* while the handoff sleeps in ``wait_for_progress``, no stream's head is a
  completed marker (no lost wakeup);
* a cancelled waiter raises ``Cancelled`` at once (no device step between),
  while its leases stay held until the device completes the work;
* at the end ``in_flight == 0`` and ``leases_held == 0`` before the device is
  released, ``retired_by_waiters`` counts exactly the retirements made by
  awaiting tasks, the arrays hold the right values, and after the exit
  ``sim.violations == []`` and ``sim.live_allocations == []``; every program
  runs under a hard wall-clock limit (``run_bounded``), so a hang fails.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from trio.lowlevel import current_task

import trio_cuda
from tests.helpers import internals
from tests.helpers.guard import run_bounded
from tests.helpers.kernels import add
from trio_cuda import ops
from trio_cuda._backends.sim import SimContext
from trio_cuda._core import _completion
from trio_cuda._core._submit import TERMINAL, HostStep, SubState
from trio_cuda.testing import SimDevice

N = 16
BASE = np.arange(N, dtype=np.float32)

# --------------------------------------------------------------------------- the model

Token = tuple[Any, ...]


@dataclass(frozen=True)
class WaiterSpec:
    name: str
    flavor: str  #: "run": ``gpu.run(op)``; "wait": ``await fut.wait()`` on a submitted future
    sub: str  #: the key of the submission it awaits
    budget: int = 1  #: extra looks (checkpoint, look again) before it parks


@dataclass(frozen=True)
class SubSpec:
    key: str
    stream: int
    kind: str  #: "a+1", "b+1", "a+2" (kernels) or "hc" (a host closure)
    when: str  #: "setup" (before the waiters start), "waiter" (its ``run``) or "token" (an S event)


@dataclass(frozen=True)
class Scenario:
    variation: str
    subs: tuple[SubSpec, ...]
    waiters: tuple[WaiterSpec, ...] = ()
    cancellable: tuple[str, ...] = ()
    atomic_submit: bool = False  #: also place submissions inside a waiter's segment
    batch: bool = False  #: SimDevice(batch_markers=True)
    lone: bool = False  #: a waiter's first others_runnable() says nobody else is runnable

    def sub(self, key: str) -> SubSpec:
        return next(s for s in self.subs if s.key == key)


class Model:
    """What the scenario's tasks can do next, in abstract: which waiters sit at
    a gate, which kernels the device completed, whether a host closure is due.
    Kernels complete in submission order (``complete_next`` runs the oldest
    runnable command; later work on another stream that conflicts waits)."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.submitted: tuple[str, ...] = tuple(s.key for s in sc.subs if s.when == "setup")
        for w in sc.waiters:
            if w.sub not in self.submitted:
                self.submitted += (w.sub,)
        self.done: frozenset[str] = frozenset()
        self.hc_ran = False
        self.waiters: dict[str, tuple[str, int]] = {w.name: ("gated", 0) for w in sc.waiters}

    def copy(self) -> Model:
        m = object.__new__(Model)
        m.sc, m.submitted, m.done, m.hc_ran = self.sc, self.submitted, self.done, self.hc_ran
        m.waiters = dict(self.waiters)
        return m

    def pending(self) -> list[str]:
        return [k for k in self.submitted if self.sc.sub(k).kind != "hc" and k not in self.done]

    def hc_due(self) -> bool:
        return not self.hc_ran and any(self.sc.sub(k).kind == "hc" for k in self.submitted)

    def snapshot(self) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
        return tuple((n, s) for n, (s, _) in sorted(self.waiters.items())), tuple(sorted(self.done))

    def tokens(self) -> list[Token]:
        sc = self.sc
        out: list[Token] = []
        unsubmitted = [s.key for s in sc.subs if s.when == "token" and s.key not in self.submitted]
        for w in sc.waiters:
            if self.waiters[w.name][0] == "gated":
                out.append(("L", w.name, None))
                if self.pending():
                    out.append(("L", w.name, "D"))
                if sc.atomic_submit:
                    out.extend(("L", w.name, "S:" + k) for k in unsubmitted)
        if self.pending():
            out.append(("D",))
        out.extend(("S", k) for k in unsubmitted)
        out.extend(("X", n) for n in sc.cancellable if self.waiters[n][0] in ("gated", "parked"))
        return out

    def apply(self, tok: Token) -> Model:
        m = self.copy()
        kind = tok[0]
        if kind == "L":
            if tok[2] == "D":
                m._device()
            elif tok[2]:
                m._submit(tok[2][2:])
            m._look(tok[1])
        elif kind == "D":
            m._device()
        elif kind == "S":
            m._submit(tok[1])
        elif kind == "X":
            m.waiters[tok[1]] = ("cancelled", m.waiters[tok[1]][1])
        elif kind == "H":  # the event, then a completion inside the handoff's pass
            m = m.apply(tok[2])
            m._device()
        m._settle()
        return m

    def _submit(self, keys: str) -> None:
        self.submitted += tuple(keys.split("+"))

    def _device(self) -> None:
        self.done = self.done | {self.pending()[0]}

    def _look(self, name: str) -> None:
        spec = next(w for w in self.sc.waiters if w.name == name)
        _, n = self.waiters[name]
        if spec.sub in self.done:
            self.waiters[name] = ("finished", n)  # it retires (or finds retired) its work
        elif self.hc_due():
            self.waiters[name] = ("parked", n)  # a host closure is due: the handoff's job
        else:
            n += 1
            self.waiters[name] = ("parked" if n > spec.budget else "gated", n)

    def _settle(self) -> None:
        """What happens before every task blocks again: the handoff runs a due
        host closure whose stream caught up; a parked waiter whose work
        completed is retired and rescheduled."""
        for i, k in enumerate(self.submitted):
            spec = self.sc.sub(k)
            if spec.kind == "hc" and not self.hc_ran:
                before = [
                    p
                    for p in self.submitted[:i]
                    if self.sc.sub(p).stream == spec.stream and self.sc.sub(p).kind != "hc"
                ]
                if all(p in self.done for p in before):
                    self.hc_ran = True
        for w in self.sc.waiters:
            state, n = self.waiters[w.name]
            if state == "parked" and w.sub in self.done:
                self.waiters[w.name] = ("finished", n)

    def terminal(self) -> bool:
        return all(s in ("finished", "cancelled") for s, _ in self.waiters.values())


Step = tuple[Token, Any]  # an event and the model's state after it


def enumerate_schedules(sc: Scenario) -> list[tuple[Step, ...]]:
    """Every schedule of ``sc``'s events the model allows, to completion."""
    out: list[tuple[Step, ...]] = []

    def dfs(m: Model, prefix: tuple[Step, ...]) -> None:
        tokens = m.tokens()
        if not tokens:
            assert m.terminal(), (sc.variation, prefix)
            out.append(prefix)
            return
        for tok in tokens:
            nxt = m.apply(tok)
            dfs(nxt, (*prefix, (tok, nxt.snapshot())))

    dfs(Model(sc), ())
    return out


def replay_of(sc: Scenario, tokens: list[Token]) -> tuple[Step, ...]:
    """A hand-written schedule, with the model's states along it."""
    m = Model(sc)
    steps: list[Step] = []
    for tok in tokens:
        m = m.apply(tok)
        steps.append((tok, m.snapshot()))
    assert m.terminal(), (sc.variation, tokens)
    assert not m.pending(), (sc.variation, tokens)
    return tuple(steps)


def _token_id(tok: Token) -> str:
    kind = tok[0]
    if kind == "L":
        return f"L:{tok[1]}" + (f"+{tok[2]}" if tok[2] else "")
    if kind in ("S", "X"):
        return f"{kind}:{tok[1]}"
    if kind == "H":
        return f"H{tok[1]}({_token_id(tok[2])})"
    return kind


def _scenarios() -> list[Scenario]:
    out: list[Scenario] = []
    for flavor in ("run", "wait"):
        when = "waiter" if flavor == "run" else "setup"
        a = SubSpec("A", 0, "a+1", when)
        for budget in (0, 1):
            w = (WaiterSpec("W", flavor, "A", budget),)
            out.append(Scenario(f"alone-{flavor}-B{budget}", (a,), w))
            out.append(Scenario(f"cancel-{flavor}-B{budget}", (a,), w, cancellable=("W",)))
        w = (WaiterSpec("W", flavor, "A"),)
        for lone in (False, True):
            out.append(
                Scenario(f"batched-{flavor}-{'lone' if lone else 'busy'}", (a,), w, batch=True, lone=lone)
            )
        for s in (0, 1):
            pre = SubSpec("drop", s, "b+1", "setup")
            late = SubSpec("drop", s, "b+1", "token")
            out.append(Scenario(f"dropped-before-s{s}-{flavor}", (pre, a), w))
            out.append(Scenario(f"dropped-before-s{s}-{flavor}-batched", (pre, a), w, batch=True))
            out.append(Scenario(f"dropped-during-s{s}-{flavor}", (a, late), w))
            hc = SubSpec("hc", s, "hc", "token")
            out.append(Scenario(f"hostclosure-s{s}-{flavor}", (a, hc), w, atomic_submit=True))
        out.append(Scenario(f"conflict-s1-{flavor}", (a, SubSpec("C", 1, "a+2", "token")), w))
        out.append(
            Scenario(
                f"two-waiters-one-stream-{flavor}",
                (a, SubSpec("B", 0, "b+1", when)),
                (WaiterSpec("W1", flavor, "A"), WaiterSpec("W2", flavor, "B")),
            )
        )
    shared = (SubSpec("A", 0, "a+1", "setup"),)
    both = (WaiterSpec("W1", "wait", "A"), WaiterSpec("W2", "wait", "A"))
    out.append(Scenario("two-waiters-one-future", shared, both))
    out.append(Scenario("two-waiters-one-future-cancel", shared, both, cancellable=("W1",)))
    return out


#: schedules that place a completion inside the handoff's own pass
def _handoff_cases() -> list[tuple[Scenario, list[Token]]]:
    one = Scenario("handoff-one-head", (SubSpec("X0", 0, "b+1", "token"),))
    two = Scenario("handoff-two-heads", (SubSpec("X0", 0, "b+1", "token"), SubSpec("X1", 1, "a+1", "token")))
    a = SubSpec("A", 0, "a+1", "waiter")
    park = Scenario("handoff-parked-waiter", (a,), (WaiterSpec("W", "run", "A", 0),))
    cancel = Scenario("handoff-cancelled-waiter", (a,), (WaiterSpec("W", "run", "A"),), cancellable=("W",))
    cases: list[tuple[Scenario, list[Token]]] = []
    cases += [(one, [("H", k, ("S", "X0"))]) for k in (1, 2)]
    cases += [(one, [("S", "X0"), ("D",)])]
    cases += [(two, [("H", k, ("S", "X0+X1")), ("D",)]) for k in (1, 2, 3, 4)]
    cases += [(two, [("S", "X0+X1"), ("D",), ("D",)])]
    cases += [(park, [("H", k, ("L", "W", None))]) for k in (1, 2)]
    cases += [(cancel, [("H", k, ("X", "W"))]) for k in (1, 2)]
    return cases


CASES: list[tuple[Scenario, tuple[Step, ...]]] = [
    (sc, steps) for sc in _scenarios() for steps in enumerate_schedules(sc)
] + [(sc, replay_of(sc, tokens)) for sc, tokens in _handoff_cases()]


def _case_id(case: tuple[Scenario, tuple[Step, ...]]) -> str:
    sc, steps = case
    return f"{sc.variation}/" + ",".join(_token_id(tok) for tok, _ in steps)


# --------------------------------------------------------------------------- the replay

_WORLD: World | None = None
_REAL_OTHERS_RUNNABLE = _completion.others_runnable
_REAL_RETIRE, _REAL_QUARANTINE, _REAL_HOST_STEP = internals.completion_steps()
_REAL_POLL = SimContext.poll_marker


@dataclass(eq=False)
class Waiter:
    spec: WaiterSpec
    task: Any = None
    gate: trio.Event | None = None
    passed: int = 0  #: gates passed (looks started)
    pre: list[Any] = field(default_factory=list)  #: run inside the next segment, before the look
    cs: trio.CancelScope | None = None
    outcome: tuple[str, Any] | None = None


@dataclass
class Retirement:
    sub: int
    stream: int
    who: str
    step: int
    what: str


class World:
    """One replay: the scope, the controlled tasks and what was recorded."""

    def __init__(self, sc: Scenario, steps: tuple[Step, ...]) -> None:
        self.sc = sc
        self.steps = steps
        self.sim = SimDevice(batch_markers=sc.batch)
        self.gpu: Any = None
        self.arrays: dict[str, Any] = {}
        self.ops: dict[str, Any] = {}
        self.subs: dict[str, Any] = {}
        self.futs: dict[str, Any] = {}
        self.launch_seq: dict[str, int] = {}
        self.waiters = {w.name: Waiter(w) for w in sc.waiters}
        self.by_task: dict[Any, Waiter] = {}
        self.step = 0
        self.token: Token = ("setup",)
        #: (waiter, its submission's key) when the event places a completion right before its look
        self.first_look: tuple[str, Any] | None = None
        self.log: list[Retirement] = []
        self.retired: set[int] = set()
        self.last_on_stream: dict[int, int] = {}
        self.errors: list[str] = []
        self.hook = 0  #: fire a device step at the handoff's hook-th poll from now
        self.hook_polls = 0
        self.hook_fired = False
        self.hc_runs: list[tuple[str, np.ndarray[Any, Any]]] = []
        self.submitted_at: dict[str, int] = {}  #: key -> step
        self.device_at: dict[str, int] = {}  #: kernel key -> step it completed

    # ------------------------------------------------------------------ who
    def who(self) -> str:
        task = current_task()
        if self.gpu is not None and task is internals.handoff_task(self.gpu):
            return "handoff"
        w = self.by_task.get(task)
        return w.spec.name if w is not None else "main"

    # ------------------------------------------------------------------ records
    def record(self, sub: Any, what: str) -> None:
        who = self.who()
        m = sub.marker
        if what == "retire" and (m is None or m.seq > internals.done_seq(m.stream)):
            self.errors.append(f"step {self.step}: {who} retired #{sub.id} before its marker completed")
        if what == "quarantine":
            self.errors.append(f"step {self.step}: #{sub.id} was quarantined by {who}")
        if sub.id in self.retired:
            self.errors.append(f"step {self.step}: #{sub.id} retired twice (now by {who})")
        self.retired.add(sub.id)
        s = sub.stream.index
        if sub.id < self.last_on_stream.get(s, 0):
            self.errors.append(
                f"step {self.step}: #{sub.id} retired on stream {s} after #{self.last_on_stream[s]}"
            )
        self.last_on_stream[s] = max(sub.id, self.last_on_stream.get(s, 0))
        if who in self.waiters and self.token[:2] != ("L", who):
            self.errors.append(
                f"step {self.step}: waiter {who} retired #{sub.id} outside its look ({self.token})"
            )
        self.log.append(Retirement(sub.id, s, who, self.step, what))

    def host_step(self, step: HostStep) -> None:
        who = self.who()
        if who != "handoff":
            self.errors.append(f"step {self.step}: a host closure ran in {who}, not the handoff")
        hc = step.submission
        for sub in self.subs.values():
            if sub.stream is hc.stream and sub.id < hc.id and sub.state not in TERMINAL:
                self.errors.append(f"step {self.step}: host closure ran before #{sub.id} retired")

    # ------------------------------------------------------------------ actions
    def make_op(self, key: str) -> Any:
        spec = self.sc.sub(key)
        if spec.kind == "hc":
            a = self.arrays["a"]

            def closure() -> str:
                self.hc_runs.append((self.who(), np.frombuffer(self.sim.peek(a.ptr, a.nbytes), np.float32)))
                return "ran"

            op = ops.host_closure(closure)
        else:
            arr = self.arrays[spec.kind[0]]
            op = add(arr, float(spec.kind[2:]))
        self.ops[key] = op
        return op

    def submit(self, keys: str) -> None:
        for key in keys.split("+"):
            spec = self.sc.sub(key)
            fut = self.gpu.submit(self.make_op(key), stream=self.gpu.streams[spec.stream])
            self.adopt(key, internals.submission_of(fut))
            if any(w.sub == key and w.flavor == "wait" for w in self.sc.waiters):
                self.futs[key] = fut
            # else: the future is dropped here, never awaited

    def adopt(self, key: str, sub: Any) -> None:
        self.subs[key] = sub
        self.submitted_at[key] = self.step
        if self.sc.sub(key).kind != "hc":
            launches = [c for c in internals.queued_commands(sub.stream) if c.kind == "launch"]
            self.launch_seq[key] = launches[-1].seq

    def device_step(self) -> None:
        if not self.sim.complete_next():
            self.errors.append(f"step {self.step}: the device had nothing to complete")

    def apply(self, tok: Token) -> None:
        kind = tok[0]
        if kind == "L":
            w = self.waiters[tok[1]]
            if w.gate is None:
                raise AssertionError(f"step {self.step} {tok}: waiter {tok[1]} is not at a gate")
            if tok[2] == "D":
                w.pre.append(self.device_step)
                sub = self.subs[w.spec.sub]
                if sub.state is SubState.IN_FLIGHT and not internals.host_steps_pending(self.gpu):
                    self.first_look = (w.spec.name, w.spec.sub)
            elif tok[2]:
                w.pre.append(lambda: self.submit(tok[2][2:]))
            w.gate.set()
        elif kind == "D":
            self.device_step()
        elif kind == "S":
            self.submit(tok[1])
        elif kind == "X":
            w = self.waiters[tok[1]]
            assert w.cs is not None
            w.cs.cancel()
        elif kind == "H":
            self.hook, self.hook_polls, self.hook_fired = tok[1], 0, False
            self.apply(tok[2])
        else:  # pragma: no cover
            raise AssertionError(tok)

    # ------------------------------------------------------------------ checks
    def real_status(self, w: Waiter) -> str:
        if w.outcome is not None:
            return "finished" if w.outcome[0] == "ok" else "cancelled"
        if w.gate is not None:
            return "gated"
        parked = self.subs[w.spec.sub].waiter
        if parked is w.task or (type(parked) is list and w.task in parked):
            return "parked"
        return "running?"

    def device_done(self) -> tuple[str, ...]:
        executed = {e.seq for e in self.sim.trace if e.kind == "launch"}
        return tuple(sorted(k for k, seq in self.launch_seq.items() if seq in executed))

    def check_step(self, tok: Token, expected: Any) -> None:
        gpu = self.gpu
        for key in self.device_done():
            self.device_at.setdefault(key, self.step)
        got = (tuple((n, self.real_status(w)) for n, w in sorted(self.waiters.items())), self.device_done())
        assert got == expected, f"step {self.step} {_token_id(tok)}: real {got} != model {expected}"
        if tok[0] == "H":
            assert self.hook_fired, f"step {self.step}: the handoff made fewer than {tok[1]} polls"
        # no lost wakeup: the handoff never sleeps in wait_for_progress over a completed head
        if internals.handoff_idle(gpu) is None and internals.handoff_task(gpu) is not None:
            for s in gpu.streams:
                head = internals.pending_submissions(s)[0] if internals.pending_submissions(s) else None
                if head is not None and head.marker.seq <= internals.done_seq(head.marker.stream):
                    sid = head.submission.id if isinstance(head, HostStep) else head.id
                    self.errors.append(
                        f"step {self.step} {_token_id(tok)}: the handoff sleeps in wait_for_progress "
                        f"although the head of stream {s.index} (#{sid}) completed: a lost wakeup"
                    )
        if self.first_look is not None:
            # a completion of its work placed right before a waiter's look, with
            # no host closure due: that waiter observed it first, so it retired it
            name, key = self.first_look
            sub = self.subs[key]
            mine = [r.who for r in self.log if r.sub == sub.id]
            if key in expected[1] and mine != [name]:
                self.errors.append(f"step {self.step}: {name} looked first, but #{sub.id} retired by {mine}")
        if tok[0] == "X":
            w = self.waiters[tok[1]]
            sub = self.subs[w.spec.sub]
            assert w.outcome is not None, "cancellation was not prompt"
            assert w.outcome[0] == "cancelled"
            if sub.state is SubState.IN_FLIGHT:  # the work runs on: its leases stay
                assert sub.leases
                assert all(alloc.active >= 1 for alloc in sub.leases)
                assert gpu.statistics().leases_held >= 1


# --------------------------------------------------------------------------- patches


async def _gated_checkpoint() -> None:
    world = _WORLD
    w = world.by_task.get(current_task()) if world is not None else None
    if w is None:
        await trio.lowlevel.checkpoint()
        return
    gate = w.gate = trio.Event()
    try:
        await gate.wait()
    finally:
        w.gate = None
    w.passed += 1
    pre, w.pre = w.pre, []
    for fn in pre:
        fn()  # inside this segment: nothing can run between it and the look


def _others_runnable() -> bool:
    world = _WORLD
    w = world.by_task.get(current_task()) if world is not None else None
    if w is None:
        return _REAL_OTHERS_RUNNABLE()
    if w.passed == 0:  # the pre-flush question, before the first checkpoint
        return not world.sc.lone
    return w.passed <= w.spec.budget


def _retire(self: Any, sub: Any, p: Any) -> None:
    world = _WORLD
    if world is not None and self is world.gpu:
        world.record(sub, "retire")
    _REAL_RETIRE(self, sub, p)


def _quarantine(self: Any, sub: Any, cause: Any, *, report: bool = True) -> None:
    world = _WORLD
    if world is not None and self is world.gpu:
        world.record(sub, "quarantine")
    _REAL_QUARANTINE(self, sub, cause, report=report)


def _host_step(self: Any, step: Any, p: Any) -> None:
    world = _WORLD
    if world is not None and self is world.gpu:
        world.host_step(step)
    _REAL_HOST_STEP(self, step, p)


def _poll(self: Any, marker: Any) -> Any:
    world = _WORLD
    if world is not None and world.hook and world.gpu is not None:
        try:
            task = current_task()
        except RuntimeError:  # pragma: no cover - outside Trio
            task = None
        if task is internals.handoff_task(world.gpu):
            world.hook_polls += 1
            if world.hook_polls == world.hook:
                world.hook = 0
                world.hook_fired = True
                world.device_step()  # the device completes work during this poll
    return _REAL_POLL(self, marker)


@pytest.fixture
def controlled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_completion, "checkpoint", _gated_checkpoint)
    monkeypatch.setattr(_completion, "others_runnable", _others_runnable)
    internals.patch_completion_steps(
        monkeypatch, retire=_retire, quarantine=_quarantine, host_step=_host_step
    )
    monkeypatch.setattr(SimContext, "poll_marker", _poll)
    rng = getattr(trio._core._run, "_r", None)  # Trio's batch-order coin, for reproducibility
    state = rng.getstate() if rng is not None else None
    yield
    if rng is not None:
        rng.setstate(state)
    global _WORLD
    _WORLD = None


# --------------------------------------------------------------------------- the program


async def _waiter_main(world: World, w: Waiter) -> None:
    w.task = current_task()
    world.by_task[w.task] = w
    gpu = world.gpu
    spec = w.spec
    with trio.CancelScope() as cs:
        w.cs = cs
        if spec.flavor == "run":
            out = await gpu.run(world.make_op(spec.sub), stream=gpu.streams[world.sc.sub(spec.sub).stream])
        else:
            out = await world.futs[spec.sub].wait()
        w.outcome = ("ok", out)
    if cs.cancelled_caught:
        w.outcome = ("cancelled", None)


def _find_submission(world: World, key: str) -> Any:
    op = world.ops[key]
    for s in world.gpu.streams:
        for sub in (*internals.pending_submissions(s), *internals.unmarked_submissions(s)):
            if not isinstance(sub, HostStep) and sub.op is op:
                return sub
    raise AssertionError(f"submission {key} not found")


async def _program(world: World) -> None:
    sc = world.sc
    sim = world.sim
    rng = getattr(trio._core._run, "_r", None)
    if rng is not None:
        rng.seed(0)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        world.gpu = gpu
        internals.set_look_budget(gpu, math.inf)  # looks are bounded by the waiters' budgets instead
        world.arrays["a"] = await gpu.to_device(BASE)
        world.arrays["b"] = await gpu.to_device(BASE)
        sim.hold()
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            for spec in sc.subs:
                if spec.when == "setup":
                    world.submit(spec.key)
            for w in world.waiters.values():
                nursery.start_soon(_waiter_main, world, w)
                await trio.testing.wait_all_tasks_blocked()
                assert w.gate is not None, f"waiter {w.spec.name} did not reach its first look"
                if w.spec.sub not in world.subs:
                    world.adopt(w.spec.sub, _find_submission(world, w.spec.sub))
            for tok, expected in world.steps:
                world.step += 1
                world.token = tok[2] if tok[0] == "H" else tok
                world.first_look = None
                world.apply(tok)
                await trio.testing.wait_all_tasks_blocked()
                world.check_step(tok, expected)
            world.token = ("end",)
        for w in world.waiters.values():
            assert w.outcome is not None
            if w.outcome[0] == "ok":
                kind = sc.sub(w.spec.sub).kind
                assert w.outcome[1] is world.arrays[kind[0]]
        st = gpu.statistics()
        # every completion was observed and retired without the exit's help
        assert (st.in_flight, st.leases_held, st.host_closures_pending) == (0, 0, 0), st
        assert st.completed == internals.submissions_numbered(gpu) == len(world.retired)
        assert st.retired_by_waiters == sum(1 for r in world.log if r.who != "handoff")
        assert st.quarantined == 0
        assert st.pending_errors == 0
        sim.release()
        a = await gpu.to_host(world.arrays["a"])
        b = await gpu.to_host(world.arrays["b"])
        kinds = [sc.sub(k).kind for k in world.subs]
        np.testing.assert_array_equal(a, BASE + sum(float(k[2:]) for k in kinds if k[0] == "a"))
        np.testing.assert_array_equal(b, BASE + sum(float(k[2:]) for k in kinds if k[0] == "b"))
        if "hc" in world.subs:
            assert [who for who, _ in world.hc_runs] == ["handoff"]
            if sc.sub("hc").stream == sc.sub("A").stream:  # in stream order: after A
                np.testing.assert_array_equal(world.hc_runs[0][1], BASE + 1)
        if "C" in world.subs:
            trace = sim.trace
            ordered = world.submitted_at["C"] < world.device_at["A"]
            waits = [e for e in trace if e.kind == "wait_marker" and e.stream == 1]
            assert bool(waits) == ordered, (ordered, waits)
            launches = [e.seq for e in trace if e.kind == "launch"]
            assert launches.index(world.launch_seq["A"]) < launches.index(world.launch_seq["C"])
        for arr in world.arrays.values():
            arr.close()
    assert internals.submissions_numbered(gpu) == len(world.retired)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_interleaving(case: tuple[Scenario, tuple[Step, ...]], controlled: None) -> None:
    global _WORLD
    sc, steps = case
    world = _WORLD = World(sc, steps)
    run_bounded(_program, world, limit=10.0)
    assert world.errors == []
    assert world.sim.violations == []
    assert world.sim.live_allocations == []
    by_stream: dict[int, list[int]] = {}
    for r in world.log:
        by_stream.setdefault(r.stream, []).append(r.sub)
    for ids in by_stream.values():
        assert ids == sorted(ids)
    assert sorted(r.sub for r in world.log) == list(range(1, len(world.log) + 1))


def test_the_enumeration_covers_every_placement() -> None:
    """The one-waiter schedules put the completion before the first look,
    between the looks (observed by the handoff first, or by the waiter) and
    after the waiter parked; cancellation before a look, between looks and
    after parking, each before and after the completion."""
    placements = {
        ",".join(_token_id(t) for t, _ in steps)
        for sc, steps in CASES
        if sc.variation in ("alone-run-B1", "cancel-run-B1")
    }
    assert {
        "D,L:W",
        "L:W+D",
        "L:W,D,L:W",
        "L:W,L:W+D",
        "L:W,L:W,D",
        "X:W,D",
        "D,X:W",
        "L:W,X:W,D",
        "L:W,D,X:W",
        "L:W,L:W,X:W,D",
    } <= placements
    counts: dict[str, int] = {}
    for sc, _ in CASES:
        counts[sc.variation] = counts.get(sc.variation, 0) + 1
    assert all(counts.values())
    assert len(CASES) == sum(counts.values())
