"""Random adversarial programs for trio_cuda on the simulated device(s).

``generate(seed)`` turns a seed into a :class:`Program`: a list of segments
(one resource scope, two scopes on one SimDevice, two scopes on a two-device
SimHost, or a device pool), each a list of steps for the main task and for
concurrent tasks it spawns. The program is fixed by the seed alone (steps name
arrays by random picks that are resolved at run time), and ``Program.text()``
prints it.

``run_program(program)`` runs it in ``trio.run`` in a daemon thread, under a
hard time limit, against a NumPy model of every array, and returns a
:class:`Result` with the failures it found (empty: the program passed). See
``tests/lifetimes/test_adversarial.py`` for what is checked.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio
import trio.testing

import trio_cuda
import trio_cuda.trace
from trio_cuda import (
    AccessConflictError,
    CompletionUnknownError,
    GraphCaptureError,
    KernelArgumentError,
    LaunchError,
    OutOfMemoryError,
    ScopeClosedError,
    TrioCudaError,
    ops,
)
from trio_cuda.testing import SimDevice, SimHost

from .guard import SCALE, Hang, run_bounded
from .kernels import ADD, COPY, SAXPY

F4 = np.float32

#: features that once triggered defects (hangs at exit, leaks); each can be switched
#: off with TRIO_CUDA_ADVERSARY_SKIP=name,name (or "known" for all of them).
#: The same variable switches off the check "gc_leak" (scopes collectable
#: after the program when nothing was quarantined).
KNOWN_DEFECTS = {
    "base_exception": "host closures that raise a BaseException (handoff task dies, scope exit hangs)",
    "drain_zero": "drain_timeout=0 (finished work quarantined with a 'still in flight' ResourceWarning)",
    "bad_policy": "a SchedulingPolicy that returns garbage (the submission leaks)",
    "view_graphs": "graphs of copies and launches between two views of one allocation, replayed while "
    "another stream writes the source view (a replay leased only its destination: stale data under "
    "'order', accepted under 'error')",
    "later_conflicts": "under conflicts='error', zip/then/map/shared ops whose LATER piece conflicts "
    "(the first piece was enqueued before the refusal; a retry ran it twice); also the strict model: "
    "an op refused with AccessConflictError under 'error' enqueued none of its pieces",
    "mock_clock": "programs under trio.testing.MockClock(autojump_threshold=0) on a timed SimDevice "
    "(the simulator kept wall time: timed work never completed in virtual time)",
    "thread_probes": "gpu/pool/future/graph statistics() from a worker thread (must be refused naming "
    "statistics) and a scope trace exported from a worker thread while it records",
}


def skipped_features() -> frozenset[str]:
    raw = os.environ.get("TRIO_CUDA_ADVERSARY_SKIP", "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if "known" in names:
        names |= set(KNOWN_DEFECTS)
    return frozenset(names)


# =========================================================================== errors the program raises


class HostBoom(Exception):
    """Raised by a host closure."""


class ThenBoom(Exception):
    """Raised by a then-closure at submission."""


class BodyError(Exception):
    """Raised by a scope body to exit it on an error."""


class HostAbort(BaseException):
    """A BaseException (not an Exception) raised by a host closure."""


class ProgramFailure(AssertionError):
    """A check of the program failed (already recorded)."""


# =========================================================================== program text


@dataclass
class Step:
    kind: str
    args: dict[str, Any] = field(default_factory=dict)

    def text(self, indent: str = "") -> list[str]:
        if self.kind == "spawn":
            head = f"{indent}spawn(deadline={self.args['deadline']}, precancel={self.args['precancel']}):"
            lines = [head]
            for s in self.args["steps"]:
                lines.extend(s.text(indent + "    "))
            return lines
        inner = ", ".join(f"{k}={_fmt(v)}" for k, v in self.args.items())
        return [f"{indent}{self.kind}({inner})"]


def _fmt(v: object) -> str:
    if isinstance(v, tuple):
        return "(" + " ".join(_fmt(x) for x in v) + ")"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


@dataclass
class Segment:
    topology: str  # one | twin | pair | pool
    streams: int
    conflicts: str
    drain_timeout: float | None
    policy: str  # rr | default | least | bad
    steps: list[Step]
    exit_kind: str  # normal | raise | cancel
    exit_policy: str  # free | held_timeout | late_release
    join_tasks: bool
    parting: tuple[Any, ...] | None  # an op submitted right before the exit, with no checkpoint after it
    drop_exports: bool = False  # consumers release every export they hold right before the exit

    def text(self) -> list[str]:
        head = (
            f"segment {self.topology} streams={self.streams} conflicts={self.conflicts} "
            f"drain_timeout={self.drain_timeout} policy={self.policy} exit={self.exit_kind}/"
            f"{self.exit_policy} {'join' if self.join_tasks else 'cancel'}-tasks"
            + (f" parting={_fmt(self.parting)}" if self.parting else "")
            + (" drop-exports" if self.drop_exports else "")
        )
        lines = [head]
        for s in self.steps:
            lines.extend(s.text("  "))
        return lines


@dataclass
class Program:
    seed: int
    n: int
    devices: str  # single | host
    options: dict[str, Any]
    peer_access: bool
    segments: list[Segment]
    skip: frozenset[str]

    def text(self) -> str:
        opts = " ".join(f"{k}={_fmt(v)}" for k, v in self.options.items())
        lines = [
            f"program seed={self.seed} n={self.n} devices={self.devices} {opts} "
            f"peer_access={self.peer_access}" + (f" skip={','.join(sorted(self.skip))}" if self.skip else "")
        ]
        for seg in self.segments:
            lines.extend(seg.text())
        return "\n".join(lines)

    def steps(self) -> int:
        def count(steps: list[Step]) -> int:
            return sum(1 + (count(s.args["steps"]) if s.kind == "spawn" else 0) for s in steps)

        return sum(count(seg.steps) for seg in self.segments)


# =========================================================================== generator

PICK = 1000
SIMPLE = ("add", "saxpy", "copyk", "fill", "d2d", "h2d")
CLOSURES = ("noop", "noop", "raise", "close", "base")
DEADLINES = (0.0, 0.0, 1e-4, 1e-3, 5e-3)


class _Gen:
    def __init__(self, rng: random.Random, prog: Program, seg: Segment) -> None:
        self.r = rng
        self.prog = prog
        self.seg = seg
        self.held = False
        self.tasks = 0
        self.multi = seg.topology in ("twin", "pair", "pool")

    # ------------------------------------------------------------------ pieces
    def pick(self) -> int:
        return self.r.randrange(PICK)

    def dev(self) -> int:
        return self.r.randrange(2) if self.multi else 0

    def stream(self) -> int | None:
        return None if self.r.random() < 0.5 else self.r.randrange(4)

    def small(self) -> int:
        return self.r.randint(-3, 3)

    def closure(self) -> str:
        c = self.r.choice(CLOSURES)
        if c == "base" and "base_exception" in self.prog.skip:
            c = "raise"
        return c

    def simple(self) -> tuple[Any, ...]:
        k = self.r.choice(SIMPLE)
        if k == "add":
            return ("add", self.pick(), self.small())
        if k == "saxpy":
            return ("saxpy", self.pick(), self.pick(), self.r.randint(-2, 2))
        if k in ("copyk", "d2d"):
            return (k, self.pick(), self.pick())
        if k == "fill":
            return ("fill", self.pick(), self.small())
        return ("h2d", self.pick(), self.small())

    def shape(self) -> tuple[Any, ...]:
        x = self.r.random()
        if x < 0.45:
            return self.simple()
        if x < 0.53:
            return ("zip", self.simple(), self.simple())
        if x < 0.61:
            return ("then", self.simple(), self.simple())
        if x < 0.64:
            return ("then_raise", self.simple())
        if x < 0.68:
            return ("map", self.simple())
        if x < 0.78:
            return ("host", self.closure(), self.pick())
        if x < 0.84:
            return ("host_then", self.closure(), self.pick(), self.simple())
        if self.multi:
            return ("xcopy", self.pick(), self.pick(), self.r.randrange(2))
        return self.simple()

    def mode(self, task: bool) -> str:
        modes = ["submit_keep", "submit_drop", "submit_gc", "run", "run", "await_op", "run_deadline"]
        modes.append("run_precancel")
        if self.seg.topology == "pool":
            modes += ["pool_run", "pool_submit"]
        m = self.r.choice(modes)
        if not task and self.held and m in ("run", "await_op", "pool_run"):
            m = "run_deadline"
        return m

    # ------------------------------------------------------------------ steps
    def alloc(self, task: bool = False) -> Step:
        r = self.r
        how = r.choice(["empty", "zeros", "full", "full", "to_device", "to_device"])
        if self.seg.topology == "pool" and r.random() < 0.3:
            how = "pool_to_device"
        if not task and self.held and how in ("to_device", "pool_to_device"):
            how = "full"
        return Step("alloc", {"how": how, "v": self.small(), "dev": self.dev(), "stream": self.stream()})

    def step(self, task: bool) -> Step:
        r = self.r
        kinds: list[tuple[str, int]] = [
            ("alloc", 12),
            ("op", 34),
            ("burst", 4),
            ("wait", 5),
            ("read", 10),
            ("close", 3),
            ("drop", 3),
            ("async_with", 2),
            ("readonly", 2),
            ("export", 3),
            ("unexport", 2),
            ("cai", 1),
            ("inject", 3),
            ("flush", 1),
            ("capture", 3),
            ("replay", 5),
            ("gclose", 1),
            ("gdrop", 1),
            ("gupdate", 1),
            ("sleep", 3),
            ("misuse", 2),
        ]
        if self.seg.topology == "twin":
            kinds.append(("borrow", 3))
        if not task:
            kinds += [
                ("hold", 3),
                ("release", 3),
                ("step", 2),
                ("idle", 1),
                ("spawn", 5),
                ("cancel_tasks", 1),
                ("join", 2),
                ("settle", 2),
                ("verify", 4),
            ]
        names, weights = zip(*kinds)
        kind = r.choices(names, weights)[0]
        if kind == "alloc":
            return self.alloc(task)
        if kind == "op":
            m = self.mode(task)
            args: dict[str, Any] = {
                "shape": self.shape(),
                "dev": self.dev(),
                "stream": self.stream(),
                "mode": m,
            }
            if m == "run_deadline":
                args["deadline"] = r.choice(DEADLINES)
            return Step("op", args)
        if kind == "burst":
            k = r.randint(2, 5)
            return Step(
                "burst",
                {
                    "shapes": tuple(self.simple() for _ in range(k)),
                    "streams": tuple(r.randrange(4) for _ in range(k)),
                    "dev": self.dev(),
                    "read": not (not task and self.held),
                },
            )
        if kind == "wait":
            deadline = r.choice([None, None, *DEADLINES])
            if not task and self.held and deadline is None:
                deadline = r.choice(DEADLINES)
            return Step("wait", {"p": self.pick(), "deadline": deadline})
        if kind == "read":
            if not task and self.held:
                return Step("sleep", {"d": 0.0})
            return Step("read", {"p": self.pick()})
        if kind in ("close", "drop", "readonly", "unexport", "cai", "gclose", "gdrop"):
            return Step(kind, {"p": self.pick()})
        if kind == "async_with":
            return Step("async_with", {"p": self.pick(), "v": self.small(), "stream": self.stream()})
        if kind == "export":
            return Step("export", {"p": self.pick(), "keep": r.random() < 0.5, "ro": r.random() < 0.3})
        if kind == "borrow":
            return Step("borrow", {"p": self.pick(), "access": r.choice(["read", "write"])})
        if kind == "inject":
            fault = r.choice(["launch_error", "kernel_fault", "completion_unknown", "out_of_memory"])
            return Step("inject", {"fault": fault, "dev": self.dev(), "count": r.choice([1, 1, 1, 2])})
        if kind == "flush":
            return Step("flush", {"dev": self.dev()})
        if kind == "capture":
            chain = tuple(self.simple() for _ in range(r.randint(1, 3)))
            return Step(
                "capture",
                {"chain": chain, "dev": self.dev(), "stream": self.stream(), "bad": r.random() < 0.1},
            )
        if kind == "replay":
            modes = ["submit_keep", "submit_drop", "run", "run", "run_deadline", "run_precancel"]
            if self.seg.topology == "pool":
                modes += ["pool_run", "pool_submit"]  # a pool runs a replay where it was captured
            m = r.choice(modes)
            if not task and self.held and m in ("run", "pool_run"):
                m = "run_deadline"
            args = {"p": self.pick(), "mode": m, "stream": self.stream()}
            if m == "run_deadline":
                args["deadline"] = r.choice(DEADLINES)
            return Step("replay", args)
        if kind == "gupdate":
            return Step("gupdate", {"p": self.pick(), "v": self.small(), "repick": r.random() < 0.5})
        if kind == "sleep":
            return Step("sleep", {"d": r.choice([0.0, 0.0, 1e-4, 1e-3])})
        if kind == "misuse":
            what = r.choice(["closed", "readonly_write", "foreign", "closed_graph", "bad_capture"])
            return Step("misuse", {"what": what, "p": self.pick()})
        if kind == "hold":
            self.held = True
            return Step("hold")
        if kind == "release":
            self.held = False
            return Step("release")
        if kind == "step":
            return Step("step", {"k": r.randint(1, 4)})
        if kind == "idle":
            return Step("idle")
        if kind == "spawn":
            if self.tasks >= 6:
                return Step("sleep", {"d": 0.0})
            self.tasks += 1
            steps = [self.step(task=True) for _ in range(r.randint(1, 8))]
            deadline = r.choice([None, None, None, *DEADLINES, 0.02])
            return Step("spawn", {"steps": steps, "deadline": deadline, "precancel": r.random() < 0.08})
        if kind == "cancel_tasks":
            return Step("cancel_tasks")
        if kind == "verify":
            return Step("sleep", {"d": 0.0}) if self.held else Step("verify")
        if kind == "join":
            self.held = False  # join releases the device first
            return Step("join")
        # settle: joins the tasks and releases the device first
        self.held = False
        return Step("settle")


def generate(seed: int, skip: frozenset[str] | None = None) -> Program:
    """The program of ``seed`` (deterministic)."""
    r = random.Random(seed)
    skip = skipped_features() if skip is None else skip
    devices = r.choice(["single", "single", "host"])
    timed = r.random() < 0.4  # timed streams run concurrently: a free one runs ahead of a busy one
    options = {
        "kernel_time": r.choice([2e-4, 1e-3]) if timed else 0.0,
        "copy_time": r.choice([0.0, 5e-5]) if timed else 0.0,
        "batch_markers": r.random() < 0.25,
        "await_spin": r.choice([0.0, 0.0, 1e-5]),
    }
    prog = Program(
        seed=seed,
        n=r.choice([1, 3, 8, 33, 64]),
        devices=devices,
        options=options,
        peer_access=r.random() < 0.8,
        segments=[],
        skip=skip,
    )
    x = random.Random(f"trio_cuda adversary probes {seed}")  # the features added later draw from it
    if "mock_clock" not in skip and x.random() < 0.12:
        # virtual time: far longer than the program's wall-time limit allows, were it real
        options.update(
            kernel_time=x.choice([0.01, 0.05, 0.2]), copy_time=x.choice([1e-3, 0.02]), clock="autojump"
        )
    for _ in range(1 if r.random() < 0.75 else 2):
        topology = (
            r.choice(["one", "one", "twin"]) if devices == "single" else r.choice(["one", "pair", "pool"])
        )
        exit_policy = r.choice(["free", "free", "free", "held_timeout", "late_release"])
        if exit_policy == "held_timeout":
            drain: float | None = r.choice([0.0, 0.01] if "drain_zero" not in skip else [0.001, 0.01])
        else:
            choices: list[float | None] = [None, None, 0.5, 2.0]
            if "drain_zero" not in skip:
                choices.append(0.0)
            drain = r.choice(choices)
            if exit_policy == "late_release" and drain is not None and drain < 0.5:
                drain = None
        policy = r.choice(["rr", "default", "least"])
        if "bad_policy" not in skip and r.random() < 0.08:
            policy = "bad"
        seg = Segment(
            topology=topology,
            streams=r.randint(1, 4),
            conflicts="error" if r.random() < 0.25 else "order",
            drain_timeout=drain,
            policy=policy,
            steps=[],
            exit_kind=r.choice(["normal", "normal", "normal", "raise", "cancel"]),
            exit_policy=exit_policy,
            join_tasks=r.random() < 0.6,
            parting=None,
        )
        g = _Gen(r, prog, seg)
        if r.random() < 0.4:
            seg.parting = (g.shape(), g.dev(), g.stream())
        seg.drop_exports = r.random() < 0.3
        seg.steps = [g.alloc() for _ in range(r.randint(2, 6))]
        for _ in range(r.randint(4, 36)):
            seg.steps.append(g.step(task=False))
            if not g.held:  # a probe reads back: never on a held device
                probe = _probe(x, g, seg, skip)
                if probe is not None:
                    seg.steps.append(probe)
        prog.segments.append(seg)
    return prog


VIEW_KINDS = ("copy", "launch", "saxpy", "zip")
VIEW_OTHERS = ("wsrc", "wsrc_part", "wdst", "rdst", "wboth")
LATER_SHAPES = ("zip", "then", "map_then", "nested", "shared", "shared_twice", "closure", "map_zip")


def _probe(x: random.Random, g: _Gen, seg: Segment, skip: frozenset[str]) -> Step | None:
    """A self-checking probe step of the main task (drawn from ``x``, the
    program's second generator, so the rest of the program is what it was
    before probes existed), or None."""
    boost = 2.0 if seg.conflicts == "error" else 1.0
    u = x.random()
    dev = x.randrange(2) if g.multi else 0
    if "view_graphs" not in skip and seg.streams >= 2 and u < 0.02 * boost:
        return Step(
            "view_graph",
            {
                "kind": x.choice(VIEW_KINDS),
                "flip": x.random() < 0.5,
                "other": x.choice(VIEW_OTHERS),
                "busy": x.randint(1, 3),
                "s0": x.randrange(4),
                "s1": x.randrange(3),
                "replays": x.choice([1, 1, 2]),
                "dev": dev,
            },
        )
    u -= 0.04
    if "later_conflicts" not in skip and seg.streams >= 2 and 0 <= u < 0.02 * boost:
        return Step(
            "later_conflict",
            {
                "shape": x.choice(LATER_SHAPES),
                "access": x.choice(["write", "read"]),
                "busy": x.randint(1, 3),
                "s0": x.randrange(4),
                "s1": x.randrange(3),
                "dev": dev,
            },
        )
    u -= 0.04
    if "thread_probes" not in skip and 0 <= u < 0.008:
        return Step("thread_stats")
    u -= 0.008
    if "thread_probes" not in skip and 0 <= u < 0.006:
        return Step("thread_trace", {"rounds": x.randint(3, 12), "dev": dev, "html": x.random() < 0.3})
    return None


# =========================================================================== run-time model


@dataclass(eq=False)
class Slot:
    """One allocation, as the model sees it."""

    sid: int
    sim: int  # index of the SimDevice that holds it
    ptr: int
    value: np.ndarray | None  # None: unknown
    handles: list[H] = field(default_factory=list)
    captured: bool = False  # a graph captured it (then the graph decides when it is freed)
    exports: int = 0  # capsules and borrows a consumer holds


@dataclass(eq=False)
class H:
    """One handle (DeviceArray) the program made."""

    hid: int
    slot: Slot
    scope: int  # index into Runner.scopes
    readonly: bool
    borrowed: bool = False
    arr: trio_cuda.DeviceArray | None = None  # None once dropped
    ref: weakref.ref[trio_cuda.DeviceArray] | None = None
    closed: bool = False

    @property
    def usable(self) -> bool:
        return self.arr is not None and not self.closed and not self.arr.closed


@dataclass(eq=False)
class Eff:
    """What a submission does to the model, applied when it is submitted."""

    label: str
    sim: int
    writes: list[Slot]
    fns: list[Callable[[], None]]
    pieces: int  # pieces of device work (one: nothing is enqueued when it is refused)
    launches: int  # kernel launches and graph replays: each may take an injected fault
    handles: list[H] = field(default_factory=list)  # the handles the op names
    calls: list[tuple[str, list[int]]] = field(default_factory=list)  # then/map closures: times run


@dataclass(eq=False)
class Fut:
    fut: trio_cuda.DeviceFuture[Any]
    eff: Eff


@dataclass(eq=False)
class G:
    graph: trio_cuda.CudaGraph | None
    scope: int
    sim: int
    chain: tuple[Any, ...]
    eff: Eff


@dataclass
class Result:
    program: Program
    failures: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    hung: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and not self.hung

    def report(self) -> str:
        head = f"adversarial program seed={self.program.seed} failed"
        replay = (
            f"replay: TRIO_CUDA_ADVERSARY_SEED={self.program.seed} pytest tests/lifetimes/test_adversarial.py"
        )
        return "\n".join([head, replay, *self.failures, "--- program ---", self.program.text()])


#: errors a submission refused up front (for a one-piece op nothing was enqueued)
REFUSALS = (
    AccessConflictError,
    CompletionUnknownError,
    KernelArgumentError,
    ScopeClosedError,
    LaunchError,
    OutOfMemoryError,
)


class FlakyPolicy:
    """A SchedulingPolicy that returns garbage now and then."""

    def __init__(self) -> None:
        self.i = 0

    def choose(self, streams: Any, op: Any) -> Any:
        self.i += 1
        if self.i % 5 == 0:
            return [None, 3, "stream 0", object()][self.i // 5 % 4]
        return streams[self.i % len(streams)]


#: the stream policy of each ``Segment.policy`` but "bad"; "default" is absent
#: (None: the scope's default, FollowWriter)
_STREAM_POLICIES: dict[str, type[Any]] = {"rr": trio_cuda.RoundRobin, "least": trio_cuda.LeastLoaded}


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for e in exc.exceptions:
            out.extend(_leaves(e))
        return out
    return [exc]


def _brief(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 400 else text[:400] + "..."


class Runner:
    """Runs one program (in ``trio.run``) and checks it."""

    def __init__(self, program: Program) -> None:
        self.p = program
        self.result = Result(program)
        self.counts = self.result.counts
        o = {k: v for k, v in program.options.items() if k != "clock"}
        self.mock = program.options.get("clock") == "autojump"
        if program.devices == "single":
            self.host = None
            self.sims: list[SimDevice] = [SimDevice(**o)]
        else:
            self.host = SimHost(2, peer_access=program.peer_access, **o)
            self.sims = list(self.host)
        self.timed = o["kernel_time"] > 0 or o["copy_time"] > 0
        self.baseline: list[set[int]] = [set() for _ in self.sims]
        self.modules: list[int] = [0 for _ in self.sims]  # modules left loaded by earlier quarantines
        self.injected: set[str] = set()  # fault kinds injected so far (any device)
        self.ids = 0
        self.failed = False
        self.scope_refs: list[tuple[weakref.ref[trio_cuda.ResourceScope], str]] = []
        self.quarantined_any = False

    # ------------------------------------------------------------------ reporting
    def fail(self, message: str) -> None:
        self.failed = True
        self.result.failures.append(message)
        raise ProgramFailure(message)

    def note(self, message: str) -> None:
        self.failed = True
        self.result.failures.append(message)

    def fresh(self) -> int:
        self.ids += 1
        return self.ids

    # ------------------------------------------------------------------ program
    async def main(self) -> None:
        if self.mock:
            t0 = trio.current_time()
            try:
                await self._main()
            finally:
                self.counts["probe:mock_clock_programs"] += 1
                self.counts["probe:mock_clock_virtual_ms"] += round((trio.current_time() - t0) * 1000)
            return
        await self._main()

    async def _main(self) -> None:
        async with trio.open_nursery() as outer:
            self.outer = outer
            for i, seg in enumerate(self.p.segments):
                self.seg_index = i
                await self.segment(seg)
                if self.failed:
                    break
            outer.cancel_scope.cancel()

    # ------------------------------------------------------------------ segment state
    def reset(self, seg: Segment) -> None:
        self.seg = seg
        self.slots: list[Slot] = []
        self.handles: list[H] = []
        self.futs: list[Fut] = []
        self.graphs: list[G] = []
        self.capsules: list[tuple[Any, Slot, int]] = []
        self.tasks: list[tuple[trio.CancelScope, trio.Event]] = []
        self.pending_faults = [0 for _ in self.sims]
        self.held = False
        self.conflict_error = seg.conflicts == "error"
        self.exported = False  # exports (capsules, borrows) were taken in this segment
        self.borrowed = False
        self.closures_raise = False
        self.closures_base = False
        self.then_raise = False
        self.bad_policy = seg.policy == "bad"
        self.exit_info: dict[str, Any] = {}
        # under 'error' an op refused for a conflict (or a then-closure that raised in the
        # preflight) enqueued none of its pieces
        self.strict_refusals = self.conflict_error and "later_conflicts" not in self.p.skip
        self.all_calls: list[tuple[str, list[int]]] = []

    def sim_of(self, scope: int) -> int:
        return 0 if self.p.devices == "single" else self.scope_dev[scope]

    async def open_scopes(self, stack: contextlib.AsyncExitStack, seg: Segment) -> None:
        def policy() -> Any:
            if seg.policy == "bad":
                return FlakyPolicy()
            cls = _STREAM_POLICIES.get(seg.policy)
            return None if cls is None else cls()  # None: the default (FollowWriter)

        kw = {"streams": seg.streams, "conflicts": seg.conflicts, "drain_timeout": seg.drain_timeout}
        self.pool: trio_cuda.DevicePool | None = None
        if seg.topology == "pool":
            assert self.host is not None
            pool = await stack.enter_async_context(
                trio_cuda.open_device_pool(
                    self.host,
                    **kw,
                    policy=trio_cuda.RoundRobinDevices() if seg.policy == "rr" else None,
                    stream_policy=FlakyPolicy if seg.policy == "bad" else _STREAM_POLICIES.get(seg.policy),
                )
            )
            self.pool = pool
            self.scopes = list(pool)
            self.scope_dev = [0, 1]
        elif seg.topology == "one":
            dev = self.sims[0]
            self.scopes = [await stack.enter_async_context(trio_cuda.open_scope(dev, policy=policy(), **kw))]
            self.scope_dev = [0]
        elif seg.topology == "twin":
            dev = self.sims[0]
            self.scopes = [
                await stack.enter_async_context(trio_cuda.open_scope(dev, policy=policy(), **kw))
                for _ in range(2)
            ]
            self.scope_dev = [0, 0]
        else:
            self.scopes = [
                await stack.enter_async_context(trio_cuda.open_scope(d, policy=policy(), **kw))
                for d in self.sims
            ]
            self.scope_dev = [0, 1]

    def scope_index(self, dev: int) -> int:
        return dev % len(self.scopes)

    def stream(self, scope: int, pick: int | None) -> trio_cuda.Stream | None:
        if pick is None:
            return None
        streams = self.scopes[scope].streams
        return streams[pick % len(streams)]

    # ------------------------------------------------------------------ handles
    def register(self, arr: trio_cuda.DeviceArray, scope: int, value: np.ndarray | None) -> H:
        slot = Slot(self.fresh(), self.sim_of(scope), arr.ptr, value)
        self.slots.append(slot)
        return self.add_handle(arr, slot, scope, readonly=False)

    def add_handle(
        self, arr: trio_cuda.DeviceArray, slot: Slot, scope: int, *, readonly: bool, borrowed: bool = False
    ) -> H:
        h = H(self.fresh(), slot, scope, readonly, borrowed, arr, weakref.ref(arr))
        slot.handles.append(h)
        self.handles.append(h)
        return h

    def choose(
        self, pick: int, *, scope: int | None = None, write: bool = False, exclude: H | None = None
    ) -> H | None:
        cands = [
            h
            for h in self.handles
            if h.usable
            and (scope is None or h.scope == scope)
            and not (write and h.readonly)
            and h is not exclude
        ]
        if not cands:
            return None
        return cands[pick % len(cands)]

    # ------------------------------------------------------------------ errors
    def allowed(self, exc: BaseException) -> bool:
        """Whether ``exc`` is an error the program's hostile actions explain."""
        if isinstance(exc, OutOfMemoryError):
            return "out_of_memory" in self.injected
        if isinstance(exc, LaunchError):
            return bool({"launch_error", "kernel_fault"} & self.injected)
        if isinstance(exc, CompletionUnknownError):
            return "completion_unknown" in self.injected
        if isinstance(exc, AccessConflictError):
            return self.conflict_error or self.exported
        if type(exc) is TrioCudaError:  # a cross-scope copy of data its writer's failed submission wrote
            failing = {"launch_error", "kernel_fault", "completion_unknown"} & self.injected
            failing_work = failing or self.closures_raise or self.closures_base or self.then_raise
            return bool(failing_work) and "cannot be trusted" in str(exc)
        if isinstance(exc, HostBoom):
            return self.closures_raise
        if isinstance(exc, ThenBoom):
            return self.then_raise
        if isinstance(exc, HostAbort):
            return self.closures_base
        if isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, TrioCudaError):
            text = str(exc).lower()
            return self.bad_policy and ("stream" in text or "policy" in text)
        return False

    def expect(self, exc: BaseException, where: str) -> None:
        """Record ``exc`` (raised by a step) as allowed, or fail."""
        if isinstance(exc, ProgramFailure):
            raise exc
        if self.allowed(exc):
            self.counts[f"error:{type(exc).__name__}"] += 1
            return
        tb = "".join(traceback.format_exception(exc, limit=-6))
        self.fail(f"{where}: unexpected {_brief(exc)}\n{tb}")

    # ------------------------------------------------------------------ effects
    def commit(self, eff: Eff) -> None:
        """The submission was enqueued: advance the model."""
        self.counts["committed"] += 1
        for f in eff.fns:
            f()
        if eff.launches and self.pending_faults[eff.sim]:
            self.counts["tainted_submissions"] += 1
            for s in eff.writes:
                s.value = None

    def refused(self, eff: Eff, exc: BaseException) -> None:
        """The submission raised at submit time: a one-piece op enqueued
        nothing; otherwise what it wrote is unknown."""
        if eff.pieces <= 1 and isinstance(exc, REFUSALS):
            return
        if self.strict_refusals and isinstance(exc, (AccessConflictError, ThenBoom)):
            self.counts["strict_refusals"] += 1
            return  # the preflight refused the whole op: no piece ran (the model keeps every value)
        for s in eff.writes:
            s.value = None

    def raced_close(self, eff: Eff, exc: BaseException) -> bool:
        """run() waited for released exports before it submitted, and another
        task (or a host closure) closed an array of the op meanwhile."""
        if (
            isinstance(exc, (ScopeClosedError, KernelArgumentError))
            and "closed" in str(exc)
            and any(h.arr is None or h.closed or h.arr.closed for h in eff.handles)
        ):
            self.counts["raced_closes"] += 1
            return True
        return False

    def check_calls(self, eff: Eff, enqueued: bool, where: str) -> None:
        """Each then/map closure of one submission ran at most once (a then-closure
        of an op that was enqueued exactly once)."""
        for kind, c in eff.calls:
            self.counts["closure_calls_checked"] += 1
            if c[0] > 1 or (enqueued and kind == "then" and c[0] != 1):
                self.fail(
                    f"{where}: a {kind}-closure of {eff.label} ran {c[0]} time(s) for one submission "
                    f"({'enqueued' if enqueued else 'not enqueued'})"
                )

    def completed_with_error(self, eff: Eff) -> None:
        for s in eff.writes:
            s.value = None

    def hooked(self, op: trio_cuda.DeviceOp[Any], eff: Eff, flag: list[bool]) -> trio_cuda.DeviceOp[Any]:
        """``op`` followed by a then-closure that runs, at submission, right
        after ``op`` was enqueued: it records that it was and commits ``eff``."""

        def hook(out: object) -> trio_cuda.DeviceOp[Any]:
            flag.append(True)
            self.commit(eff)
            return ops.value(out)

        return op.then(hook)

    # ------------------------------------------------------------------ op builders
    def build(self, shape: tuple[Any, ...], scope: int) -> tuple[trio_cuda.DeviceOp[Any], Eff] | None:
        """The op of ``shape`` on arrays of ``scope`` and its effect, or None
        when there are no arrays to use."""
        fns: list[Callable[[], None]] = []
        writes: list[Slot] = []
        counts: dict[str, Any] = {"pieces": 0, "launches": 0, "reads": [], "handles": [], "calls": []}
        op = self._build(shape, scope, fns, writes, counts)
        if op is None:
            return None
        label = shape[0]
        eff = Eff(label, self.sim_of(scope), writes, fns, counts["pieces"], counts["launches"])
        eff.handles = counts["handles"]
        eff.calls = counts["calls"]
        self.all_calls += eff.calls
        return op, eff

    def _build(
        self,
        shape: tuple[Any, ...],
        scope: int,
        fns: list[Callable[[], None]],
        writes: list[Slot],
        counts: dict[str, Any],
    ) -> trio_cuda.DeviceOp[Any] | None:
        kind = shape[0]
        n = self.p.n
        grid = (n + 127) // 128
        if kind in ("zip", "then"):
            a = self._build(shape[1], scope, fns, writes, counts)
            b = self._build(shape[2], scope, fns, writes, counts)
            if a is None or b is None:
                return None
            if kind == "zip":
                return trio_cuda.zip(a, b)
            c = [0]
            counts.setdefault("calls", []).append(("then", c))

            def nxt(
                _out: object, b: trio_cuda.DeviceOp[Any] = b, c: list[int] = c
            ) -> trio_cuda.DeviceOp[Any]:
                c[0] += 1
                return b

            return a.then(nxt)
        if kind == "then_raise":
            a = self._build(shape[1], scope, fns, writes, counts)
            if a is None:
                return None
            self.then_raise = True
            counts["pieces"] += 1

            def boom(_out: object) -> trio_cuda.DeviceOp[Any]:
                raise ThenBoom("then-closure failed")

            return a.then(boom)
        if kind == "map":
            a = self._build(shape[1], scope, fns, writes, counts)
            if a is None:
                return None
            c = [0]
            counts.setdefault("calls", []).append(("map", c))

            def mapped(out: object, c: list[int] = c) -> object:
                c[0] += 1
                return ("mapped", out)

            return a.map(mapped)
        if kind in ("host", "host_then"):
            variant, pick = shape[1], shape[2]
            fn = self.closure(variant, pick)
            counts["pieces"] += 1
            op: trio_cuda.DeviceOp[Any] = ops.host_closure(fn, pick)
            if kind == "host_then":
                b = self._build(shape[3], scope, fns, writes, counts)
                if b is None:
                    return None
                c = [0]
                counts.setdefault("calls", []).append(("then", c))

                def after(
                    _res: object, b: trio_cuda.DeviceOp[Any] = b, c: list[int] = c
                ) -> trio_cuda.DeviceOp[Any]:
                    c[0] += 1
                    return b

                op = op.then(after)
            return op
        if kind == "xcopy":
            if len(self.scopes) < 2:
                return None
            other = 1 - scope
            dst_scope, src_scope = (scope, other) if shape[3] == 0 else (other, scope)
            d = self.choose(shape[1], scope=dst_scope, write=True)
            s = self.choose(shape[2], scope=src_scope)
            if d is None or s is None:
                return None
            dslot, sslot = d.slot, s.slot
            counts["handles"] += [d, s]
            counts["pieces"] += 1
            counts["reads"].append(sslot)
            writes.append(dslot)
            fns.append(lambda: setattr(dslot, "value", None if sslot.value is None else sslot.value.copy()))
            assert d.arr is not None
            assert s.arr is not None
            return ops.copy(d.arr, s.arr)
        counts["pieces"] += 1
        if kind in ("add", "fill", "h2d"):
            h = self.choose(shape[1], scope=scope, write=True)
            if h is None:
                return None
            slot, v = h.slot, shape[2]
            counts["handles"].append(h)
            assert h.arr is not None
            writes.append(slot)
            if kind == "add":
                counts["launches"] += 1

                def add_fn() -> None:
                    if slot.value is not None:
                        slot.value = slot.value + F4(v)

                fns.append(add_fn)
                return ADD.launch(h.arr, F4(v), n, grid=grid, block=128)
            if kind == "fill":
                fns.append(lambda: setattr(slot, "value", np.full(n, v, F4)))
                return ops.fill(h.arr, v)
            data = np.arange(n, dtype=F4) * F4(v)
            fns.append(lambda: setattr(slot, "value", data.copy()))
            return ops.copy(h.arr, data)
        src = self.choose(shape[1], scope=scope)
        dst = self.choose(shape[2], scope=scope, write=True)
        if src is None or dst is None:
            return None
        assert src.arr is not None
        assert dst.arr is not None
        sslot, dslot = src.slot, dst.slot
        counts["handles"] += [src, dst]
        writes.append(dslot)
        counts["reads"].append(sslot)
        if kind == "saxpy":
            counts["launches"] += 1
            a = shape[3]

            def saxpy_fn() -> None:
                if sslot.value is None or dslot.value is None:
                    dslot.value = None
                else:
                    dslot.value = F4(a) * sslot.value + dslot.value

            fns.append(saxpy_fn)
            return SAXPY.launch(F4(a), src.arr, dst.arr, n, grid=grid, block=128)
        fns.append(lambda: setattr(dslot, "value", None if sslot.value is None else sslot.value.copy()))
        if kind == "copyk":
            counts["launches"] += 1
            return COPY.launch(src.arr, dst.arr, n, grid=grid, block=128)
        return ops.copy(dst.arr, src.arr)

    def closure(self, variant: str, pick: int) -> Callable[[int], object]:
        if variant == "raise":
            self.closures_raise = True

            def raising(x: int) -> object:
                raise HostBoom(f"host closure {x} failed")

            return raising
        if variant == "base":
            self.closures_base = True

            def aborting(x: int) -> object:
                raise HostAbort(f"host closure {x} raised a BaseException")

            return aborting
        if variant == "close":
            h = self.choose(pick)
            arr = None if h is None else h.arr

            def closing(x: int) -> object:
                if arr is not None and h is not None:
                    h.closed = True
                    arr.close()
                return x

            return closing
        return lambda x: x

    # ------------------------------------------------------------------ steps
    async def run_steps(self, steps: list[Step], where: str) -> None:
        for i, step in enumerate(steps):
            self.counts[f"action:{step.kind}"] += 1
            try:
                await getattr(self, f"do_{step.kind}")(**step.args)
            except ProgramFailure:
                raise
            except trio.Cancelled:
                raise
            except HostAbort as exc:  # may reach a waiter: allowed where closures raise it
                self.expect(exc, f"{where} step {i} {step.kind}")
            except Exception as exc:
                self.expect(exc, f"{where} step {i} {step.text()[0]}")

    # ---- allocation
    async def do_alloc(self, how: str, v: int, dev: int, stream: int | None) -> None:
        scope = self.scope_index(dev)
        gpu = self.scopes[scope]
        s = self.stream(scope, stream)
        n = self.p.n
        if how == "empty":
            self.register(gpu.empty(n, F4, stream=s), scope, None)
        elif how == "zeros":
            self.register(gpu.zeros(n, F4, stream=s), scope, np.zeros(n, F4))
        elif how == "full":
            self.register(gpu.full(n, v, F4, stream=s), scope, np.full(n, v, F4))
        else:
            host = np.arange(n, dtype=F4) * F4(v)
            value = host.copy()
            if how == "pool_to_device" and self.pool is not None:
                arr = await self.pool.to_device(host)
                scope = self.scopes.index(arr.scope)
            else:
                arr = await gpu.to_device(host, stream=s)
            host[:] = 99  # the device copy is independent of the host array
            self.register(arr, scope, value)

    # ---- ops
    async def do_op(
        self, shape: tuple[Any, ...], dev: int, stream: int | None, mode: str, deadline: float | None = None
    ) -> None:
        scope = self.scope_index(dev)
        built = self.build(shape, scope)
        if built is None:
            self.counts["ops_without_arrays"] += 1
            return
        op, eff = built
        if mode.startswith("pool") and shape[0] == "host_then":
            mode = "run" if mode == "pool_run" else "submit_keep"  # names no array up front: any device
        await self.submit(op, eff, scope, stream, mode, deadline)

    async def submit(
        self,
        op: trio_cuda.DeviceOp[Any],
        eff: Eff,
        scope: int,
        stream: int | None,
        mode: str,
        deadline: float | None,
    ) -> None:
        gpu = self.scopes[scope]
        s = self.stream(scope, stream)
        if mode in ("submit_keep", "submit_drop", "submit_gc", "pool_submit"):
            # a pool routes the op to the scope of its arrays
            submit = self.pool.submit if mode == "pool_submit" and self.pool is not None else gpu.submit
            try:
                fut = submit(op, stream=s)
            except Exception as exc:
                self.check_calls(eff, False, "submit")
                self.refused(eff, exc)
                raise
            self.check_calls(eff, True, "submit")
            self.commit(eff)
            if mode == "submit_keep":
                self.futs.append(Fut(fut, eff))
            del fut
            if mode == "submit_gc":
                gc.collect(0)
            return
        flag: list[bool] = []
        hooked = self.hooked(op, eff, flag)
        cs = trio.CancelScope()
        if mode == "run_precancel":
            cs.cancel()
        elif mode == "run_deadline":
            cs.deadline = trio.current_time() + (deadline or 0.0)
        try:
            with cs:
                if mode == "await_op" and trio_cuda.current_scope() is gpu:
                    await hooked
                elif mode == "pool_run" and self.pool is not None:
                    await self.pool.run(hooked, stream=s)
                else:
                    await gpu.run(hooked, stream=s)
        except Exception as exc:
            self.check_calls(eff, bool(flag), mode)
            if flag:
                self.completed_with_error(eff)
            else:
                self.refused(eff, exc)
                if self.raced_close(eff, exc):
                    return
            raise
        self.check_calls(eff, bool(flag), mode)
        if cs.cancelled_caught:
            self.counts["cancellations"] += 1
            if mode == "run_precancel" and flag:
                self.fail(f"run() cancelled before it started submitted its op ({eff.label})")

    async def do_burst(
        self, shapes: tuple[tuple[Any, ...], ...], streams: tuple[int, ...], dev: int, read: bool
    ) -> None:
        """Dependent work on several streams, submitted with no checkpoint in
        between, then a read of what the last op wrote: only the runtime's
        cross-stream ordering keeps the values right (on a timed device a
        free stream runs ahead of a busy one)."""
        scope = self.scope_index(dev)
        last: Slot | None = None
        for shape, stream in zip(shapes, streams):
            built = self.build(shape, scope)
            if built is None:
                continue
            op, eff = built
            await self.submit(op, eff, scope, stream, "submit_drop", None)
            last = eff.writes[-1] if eff.writes else last
        if read and last is not None:
            h = next((h for h in last.handles if h.usable), None)
            if h is not None:
                await self.read(h)

    async def do_wait(self, p: int, deadline: float | None) -> None:
        if not self.futs:
            return
        f = self.futs[p % len(self.futs)]
        with trio.CancelScope() as cs:
            if deadline is not None:
                cs.deadline = trio.current_time() + deadline
            try:
                await f.fut.wait()
            except Exception:
                self.completed_with_error(f.eff)
                raise
        if cs.cancelled_caught:
            self.counts["cancellations"] += 1

    # ---- read back and compare
    async def do_read(self, p: int) -> None:
        h = self.choose(p)
        if h is not None:
            await self.read(h)

    async def do_verify(self) -> None:
        """Read back every array whose content the model knows."""
        seen: set[int] = set()
        for h in list(self.handles):
            if h.usable and h.slot.sid not in seen and h.slot.value is not None:
                seen.add(h.slot.sid)
                try:
                    await self.read(h)
                except ProgramFailure:
                    raise
                except Exception as exc:
                    self.expect(exc, "verify")

    async def read(self, h: H) -> None:
        """Read ``h`` back and compare it with the model, as of the moment
        the copy was submitted (other tasks may submit meanwhile)."""
        arr = h.arr
        assert arr is not None
        gpu = self.scopes[h.scope]
        expected = None if h.slot.value is None else h.slot.value.copy()
        quarantined = arr.quarantined
        try:
            if self.exported or h.borrowed or self.tasks:
                host = np.full(self.p.n, -7, F4)
                fut = gpu.submit(ops.copy(host, arr))
                got = await fut.wait()
                del fut
            else:  # nothing can run between the snapshot and the submission
                got = await gpu.to_host(arr)
        except CompletionUnknownError:
            h.slot.value = None
            raise
        if quarantined:
            self.fail(f"reading a quarantined array (slot {h.slot.sid}) did not raise CompletionUnknownError")
        self.counts["reads"] += 1
        if expected is None:
            return
        self.counts["checked_reads"] += 1
        if not np.array_equal(got, expected, equal_nan=True):
            self.fail(
                f"slot {h.slot.sid} (handle {h.hid}, scope {h.scope}) read back {got!r}, "
                f"the model expects {expected!r}"
            )

    # ---- handles
    async def do_close(self, p: int) -> None:
        h = self.choose(p)
        if h is not None and h.arr is not None:
            h.closed = True
            h.arr.close()
            assert h.arr.closed

    async def do_drop(self, p: int) -> None:
        h = self.choose(p)
        if h is None:
            return
        h.arr = None
        gc.collect(0)

    async def do_async_with(self, p: int, v: int, stream: int | None) -> None:
        h = self.choose(p, write=True)
        if h is None:
            return
        arr = h.arr
        assert arr is not None
        h.closed = True  # ours to close: no other task picks it now
        gpu = self.scopes[h.scope]
        slot = h.slot
        n = self.p.n

        def add_fn() -> None:
            if slot.value is not None:
                slot.value = slot.value + F4(v)

        eff = Eff("async_with", slot.sim, [slot], [add_fn], 1, 1, [h])
        async with arr:
            if arr.closed:  # a host closure closed it while we entered
                return
            op = ADD.launch(arr, F4(v), n, grid=(n + 127) // 128, block=128)
            try:
                gpu.submit(op, stream=self.stream(h.scope, stream))
            except Exception as exc:
                self.refused(eff, exc)
                raise
            self.commit(eff)
        assert arr.closed

    async def do_readonly(self, p: int) -> None:
        h = self.choose(p)
        if h is None or h.arr is None:
            return
        ro = h.arr.as_readonly()
        self.add_handle(ro, h.slot, h.scope, readonly=True, borrowed=h.borrowed)

    # ---- exports
    async def do_export(self, p: int, keep: bool, ro: bool) -> None:
        h = self.choose(p)
        if h is None or h.arr is None or h.borrowed:
            return
        arr = h.arr.as_readonly() if ro else h.arr
        self.exported = True
        capsule = arr.__dlpack__(max_version=(1, 0), dl_device=arr.__dlpack_device__())
        if arr is not h.arr:
            arr.close()
        del arr
        if keep:
            self.capsules.append((capsule, h.slot, h.scope))
            h.slot.exports += 1
        del capsule

    async def do_unexport(self, p: int) -> None:
        if not self.capsules:
            return
        _capsule, slot, _scope = self.capsules.pop(p % len(self.capsules))
        slot.exports -= 1
        del _capsule
        gc.collect(0)

    async def do_cai(self, p: int) -> None:
        h = self.choose(p)
        if h is None or h.arr is None:
            return
        if hasattr(h.arr, "__cuda_array_interface__"):
            self.fail("__cuda_array_interface__ exists on the simulator")

    async def do_borrow(self, p: int, access: str) -> None:
        h = self.choose(p)
        if h is None or h.arr is None or len(self.scopes) < 2 or h.borrowed:
            return
        target = 1 - h.scope
        src = h.arr
        if access == "write" and h.readonly:
            access = "read"
        self.exported = True
        y = trio_cuda.borrow(src, access, scope=self.scopes[target])  # type: ignore[arg-type]
        self.add_handle(y, h.slot, target, readonly=access == "read", borrowed=True)
        self.borrowed = True
        self.counts["borrows"] += 1

    # ---- faults
    async def do_inject(self, fault: str, dev: int, count: int) -> None:
        sim = self.sim_of(self.scope_index(dev))
        self.injected.add(fault)
        self.sims[sim].inject_fault(fault, count=count)  # type: ignore[arg-type]
        self.pending_faults[sim] += count
        self.counts[f"fault:{fault}"] += count

    async def do_flush(self, dev: int) -> None:
        self.flush(self.sim_of(self.scope_index(dev)))

    def flush(self, sim: int) -> None:
        """Consume every fault injected on ``sim`` and not consumed yet:
        each round allocates (an injected out_of_memory fails it) and then
        launches (an injected launch fault hits it), on a fresh sink array,
        without a checkpoint, so no other task's work takes them."""
        k = self.pending_faults[sim]
        if not k:
            return
        scope = next(i for i in range(len(self.scopes)) if self.sim_of(i) == sim)
        gpu = self.scopes[scope]
        s = gpu.streams[0]
        for _ in range(k):
            try:
                sink = gpu.empty(1, F4, stream=s)
            except OutOfMemoryError:
                continue
            try:
                gpu.submit(ADD.launch(sink, F4(1), 1, grid=1, block=32), stream=s)
            except (LaunchError, CompletionUnknownError):
                pass
            finally:
                sink.close()
        self.pending_faults[sim] = 0

    # ---- graphs
    def graph_of(self, p: int) -> G | None:
        live = [g for g in self.graphs if g.graph is not None]
        return live[p % len(live)] if live else None

    def build_chain(
        self, chain: tuple[Any, ...], scope: int
    ) -> tuple[trio_cuda.DeviceOp[Any], Eff, list[trio_cuda.DeviceOp[Any]]] | None:
        parts = []
        fns: list[Callable[[], None]] = []
        writes: list[Slot] = []
        counts: dict[str, Any] = {"pieces": 0, "launches": 0, "reads": [], "handles": []}
        for shape in chain:
            op = self._build(shape, scope, fns, writes, counts)
            if op is None:
                return None
            parts.append(op)
        whole = parts[0]
        for nxt in parts[1:]:
            whole = whole.then(lambda _o, nxt=nxt: nxt)
        for slot in (*writes, *counts["reads"]):
            slot.captured = True  # conservative: a refused capture keeps nothing, but no check needs it
        return whole, Eff("replay", self.sim_of(scope), writes, fns, 1, 1), parts

    async def do_capture(self, chain: tuple[Any, ...], dev: int, stream: int | None, bad: bool) -> None:
        scope = self.scope_index(dev)
        gpu = self.scopes[scope]
        built = self.build_chain(chain, scope)
        if built is None:
            return
        op, eff, _parts = built
        if bad:
            op = op.then(lambda _o: ops.host_closure(print))
            try:
                await gpu.capture(op, stream=self.stream(scope, stream))
            except GraphCaptureError:
                self.counts["refused_captures"] += 1
                return
            self.fail("capturing a host closure did not raise GraphCaptureError")
        graph = await gpu.capture(op, stream=self.stream(scope, stream))
        self.graphs.append(G(graph, scope, self.sim_of(scope), chain, eff))
        self.counts["graphs"] += 1

    async def do_replay(self, p: int, mode: str, stream: int | None, deadline: float | None = None) -> None:
        g = self.graph_of(p)
        if g is None or g.graph is None:
            return
        if g.graph.closed:
            return
        eff = Eff("replay", g.eff.sim, list(g.eff.writes), list(g.eff.fns), 1, 1)
        await self.submit(g.graph.launch(), eff, g.scope, stream, mode, deadline)

    async def do_gclose(self, p: int) -> None:
        g = self.graph_of(p)
        if g is not None and g.graph is not None:
            g.graph.close()
            assert g.graph.closed

    async def do_gdrop(self, p: int) -> None:
        g = self.graph_of(p)
        if g is not None:
            g.graph = None
            gc.collect(0)

    async def do_gupdate(self, p: int, v: int, repick: bool) -> None:
        g = self.graph_of(p)
        if g is None or g.graph is None or g.graph.closed:
            return
        chain = tuple(self._update_shape(s, v, repick) for s in g.chain)
        built = self.build_chain(chain, g.scope)
        if built is None:
            return
        op, eff, _parts = built
        await g.graph.update(op)
        g.chain, g.eff = chain, eff
        self.counts["graph_updates"] += 1

    @staticmethod
    def _update_shape(shape: tuple[Any, ...], v: int, repick: bool) -> tuple[Any, ...]:
        """The same kind of work (the graph's topology), new parameters."""
        out = list(shape)
        kind = shape[0]
        if repick:
            for i in (1,) if kind in ("add", "fill", "h2d") else (1, 2):
                out[i] = (out[i] * 7 + 13) % PICK
        if kind in ("add", "fill", "h2d"):
            out[2] = v
        elif kind == "saxpy":
            out[3] = max(-2, min(2, v))
        return tuple(out)

    # ---- device controls (main task only)
    async def do_hold(self) -> None:
        for sim in self.sims:
            sim.hold()
        self.held = True

    async def do_release(self) -> None:
        self.release_all()
        await trio.testing.wait_all_tasks_blocked(cushion=0.0)

    def release_all(self) -> None:
        if self.host is not None:
            self.host.release()
        else:
            self.sims[0].release()
        self.held = False

    async def do_step(self, k: int) -> None:
        for _ in range(k):
            if self.host is not None:
                self.host.complete_next()
            else:
                self.sims[0].complete_next()
        await trio.lowlevel.checkpoint()

    async def do_idle(self) -> None:
        if self.host is not None:
            self.host.run_until_idle()
        else:
            self.sims[0].run_until_idle()
        await trio.lowlevel.checkpoint()

    async def do_sleep(self, d: float) -> None:
        await trio.sleep(d)

    # ---- tasks
    async def do_spawn(self, steps: list[Step], deadline: float | None, precancel: bool) -> None:
        cs = trio.CancelScope()
        if precancel:
            cs.cancel()
        elif deadline is not None:
            cs.deadline = trio.current_time() + deadline
        done = trio.Event()
        name = f"task {len(self.tasks)}"
        self.tasks.append((cs, done))

        async def task() -> None:
            try:
                with cs:
                    await self.run_steps(steps, name)
                if cs.cancelled_caught:
                    self.counts["cancellations"] += 1
                    self.counts["cancelled_tasks"] += 1
            finally:
                done.set()

        self.nursery.start_soon(task)
        self.counts["tasks"] += 1

    async def do_cancel_tasks(self) -> None:
        for cs, _done in self.tasks:
            cs.cancel()
        await trio.lowlevel.checkpoint()

    async def do_join(self) -> None:
        if self.held:
            self.release_all()
        for _cs, done in self.tasks:
            await done.wait()

    async def do_settle(self) -> None:
        await self.do_join()
        gc.collect()
        await self.quiesce()
        for i, gpu in enumerate(self.scopes):
            st = gpu.statistics()
            if (st.in_flight, st.host_closures_pending) != (0, 0):
                self.fail(f"settle: scope {i} still has work after everything completed: {st}")
            if st.leases_held and not self.exported:
                self.fail(f"settle: scope {i} holds {st.leases_held} lease(s) with nothing in flight: {st}")
        for i, sim in enumerate(self.sims):
            if sim.pending:
                self.fail(
                    f"settle: device {i} has {sim.pending} command(s) pending after everything completed"
                )
        self.check_frees()
        await self.do_verify()

    def check_frees(self) -> None:
        """Memory with no open handle, export, graph or quarantine is freed."""
        for i, sim in enumerate(self.sims):
            live = {a.ptr for a in sim.live_allocations}
            for slot in self.slots:
                if slot.sim != i or slot.captured or slot.exports or slot.ptr not in live:
                    continue
                arrays = [
                    a for a in (h.ref() if h.ref is not None else None for h in slot.handles) if a is not None
                ]
                if any(not a.closed or a.quarantined for a in arrays):
                    continue
                self.fail(
                    f"slot {slot.sid} at {slot.ptr:#x}: every handle is closed or collected and nothing "
                    f"in flight uses it, but the memory is still allocated"
                )

    async def quiesce(self, limit: float = 3.0) -> None:
        t0 = time.monotonic()
        while True:
            await trio.testing.wait_all_tasks_blocked(cushion=0.0)
            if all(
                (st.in_flight, st.host_closures_pending) == (0, 0)
                for st in (g.statistics() for g in self.scopes)
            ):
                return
            if time.monotonic() - t0 > limit:
                return
            # (virtual time: a step of a fraction of a kernel, or the wait would take wall time)
            await trio.sleep(self.p.options["kernel_time"] / 4 if self.mock else 0.0005)

    # ---- probes: self-checking scenarios on private arrays (main task, device not held)
    def probe_scope(self, dev: int, s0: int, s1: int) -> tuple[int, Any, Any, Any] | None:
        """The scope of ``dev`` and two distinct streams of it, after every fault
        injected on its device was consumed; None if it cannot run a probe."""
        if self.held:
            self.counts["probe:skipped"] += 1
            return None
        scope = self.scope_index(dev)
        gpu = self.scopes[scope]
        streams = gpu.streams
        if len(streams) < 2:
            return None
        sa = streams[s0 % len(streams)]
        sb = streams[(s0 + 1 + s1 % (len(streams) - 1)) % len(streams)]
        self.flush(self.sim_of(scope))
        return scope, gpu, sa, sb

    def in_flight(self, gpu: Any, sb: Any, sim: SimDevice, busy: int) -> tuple[Any, Callable[[], None]]:
        """Keep the next work of ``sb`` in flight while a probe submits more (no
        checkpoint in between): under 'error' or on an untimed device hold the
        device (timed work could complete, and be retired, before the probe's
        next submission: then it is rightly accepted); under 'order' on a timed
        one first queue ``busy`` kernels on ``sb`` (so another stream runs ahead
        unless the runtime orders it). Returns the busy array and the undo."""
        y = gpu.zeros(16, F4, stream=sb)
        if not self.timed or self.conflict_error:
            sim.hold()
            return y, sim.release
        for _ in range(busy):
            gpu.submit(ADD.launch(y, F4(1), 16, grid=1, block=128), stream=sb)
        return y, lambda: None

    def same_submissions(self, gpu: Any, before: Any, what: str) -> None:
        after = gpu.statistics()
        for name in ("in_flight", "leases_held", "retained_bytes", "submitted"):
            if getattr(after, name) != getattr(before, name):
                self.fail(
                    f"{what}: refused with AccessConflictError, but {name} went from "
                    f"{getattr(before, name)} to {getattr(after, name)} (something was enqueued or kept)"
                )

    async def probe_read(self, gpu: Any, arr: Any, stream: Any, expected: np.ndarray, what: str) -> bool:
        """Read ``arr`` back and compare it strictly; False if an allowed error
        (a fault another task injected meanwhile) made the read inconclusive."""
        try:
            got = await gpu.to_host(arr, stream=stream)
        except (LaunchError, CompletionUnknownError, OutOfMemoryError) as exc:
            self.expect(exc, what)
            return False
        self.counts["reads"] += 1
        self.counts["checked_reads"] += 1
        if not np.array_equal(got, expected):
            self.fail(f"{what}: read back {got!r}, the model expects {expected!r}")
        return True

    async def do_view_graph(
        self, kind: str, flip: bool, other: str, busy: int, s0: int, s1: int, replays: int, dev: int
    ) -> None:
        """A graph of work between two views of ONE allocation, replayed on one
        stream while another writes its source view (or writes/reads its
        destination): under 'order' the replay sees the other stream's earlier
        work (strict data check); under 'error' it is refused, nothing enqueued."""
        got = self.probe_scope(dev, s0, s1)
        if got is None:
            return
        scope, gpu, sa, sb = got
        sim = self.sims[self.sim_of(scope)]
        m = 8
        lo_s, lo_d = (m, 0) if flip else (0, m)
        src, dst = slice(lo_s, lo_s + m), slice(lo_d, lo_d + m)
        model = np.arange(2 * m, dtype=F4) + F4(1)
        x = gpu.zeros(2 * m, F4, stream=sa)
        gpu.submit(ops.copy(x, model), stream=sa)
        if kind == "copy":
            op: Any = ops.copy(x[dst], x[src])
        elif kind == "launch":
            op = COPY.launch(x[src], x[dst], m, grid=1, block=128)
        elif kind == "saxpy":
            op = SAXPY.launch(F4(2), x[src], x[dst], m, grid=1, block=128)
        else:
            op = trio_cuda.zip(
                ops.fill(x[lo_d + 6 : lo_d + 8], 2.0), ops.copy(x[lo_d : lo_d + 6], x[lo_s : lo_s + 6])
            )

        def apply(v: np.ndarray) -> None:
            if kind in ("copy", "launch"):
                v[dst] = v[src]
            elif kind == "saxpy":
                v[dst] = F4(2) * v[src] + v[dst]
            else:
                v[lo_d + 6 : lo_d + 8] = 2
                v[lo_d : lo_d + 6] = v[lo_s : lo_s + 6]

        graph = await gpu.capture(op, stream=sa)
        self.flush(self.sim_of(scope))  # a task may have injected a fault meanwhile
        host = np.full(m, -1, F4)
        what = f"view_graph {kind} {other}"
        y, undo = self.in_flight(gpu, sb, sim, busy)
        released = False
        try:
            if other == "wsrc":
                w = gpu.submit(ops.fill(x[src], 7), stream=sb)
                model[src] = 7
            elif other == "wsrc_part":
                w = gpu.submit(ops.fill(x[lo_s + 2 : lo_s + 5], 7), stream=sb)
                model[lo_s + 2 : lo_s + 5] = 7
            elif other == "wdst":
                w = gpu.submit(ops.fill(x[lo_d + 1 : lo_d + 5], 9), stream=sb)
                model[lo_d + 1 : lo_d + 5] = 9
            elif other == "rdst":
                w = gpu.submit(ops.copy(host, x[dst]), stream=sb)
            else:  # both views: the boundary between them
                w = gpu.submit(ops.fill(x[m - 2 : m + 2], 7), stream=sb)
                model[m - 2 : m + 2] = 7
            old_dst = model[dst].copy()
            if self.conflict_error:
                before = gpu.statistics()
                replayed = graph.statistics().replays
                try:
                    gpu.submit(graph.launch(), stream=sa)
                except AccessConflictError:
                    self.counts["probe:view_graph_refused"] += 1
                else:
                    self.fail(
                        f"{what}: a replay of a graph that uses a view another stream has in flight "
                        f"was accepted under conflicts='error'"
                    )
                self.same_submissions(gpu, before, what)
                if graph.statistics().replays != replayed:
                    self.fail(f"{what}: the refused replay counted as a replay")
                undo()
                released = True
                await w.wait()
                replays = 1  # retried once the other stream's work completed: it runs
            futs = [gpu.submit(graph.launch(), stream=sa) for _ in range(replays)]
            if not released:
                undo()
                released = True
            for _ in range(replays):
                apply(model)
            await w.wait()
            for f in futs:
                await f.wait()
        finally:
            if not released:
                undo()
        if other == "rdst" and not np.array_equal(host, old_dst):
            self.fail(
                f"{what}: the other stream's read of the destination saw {host!r}, expected {old_dst!r} "
                f"(the replay overwrote it first)"
            )
        await self.probe_read(gpu, x, sa, model, what)
        self.counts["probe:view_graph"] += 1
        graph.close()
        x.close()
        y.close()

    async def do_later_conflict(self, shape: str, access: str, busy: int, s0: int, s1: int, dev: int) -> None:
        """An op of several pieces whose FIRST piece writes ``a`` and only a later
        one touches ``b``, which another stream has a writer of in flight: under
        'error' refused whole, no piece ran, each closure at most once; retried
        once the writer completed, it runs once. Under 'order' it runs after
        the writer, each closure once."""
        got = self.probe_scope(dev, s0, s1)
        if got is None:
            return
        scope, gpu, sa, sb = got
        sim = self.sims[self.sim_of(scope)]
        a = gpu.zeros(8, F4, stream=sa)
        b = gpu.zeros(8, F4, stream=sa)
        c = gpu.zeros(8, F4, stream=sa)
        va, vb, vc = np.zeros(8, F4), np.zeros(8, F4), np.zeros(8, F4)
        calls: Counter[str] = Counter()

        def later_op() -> Any:
            if access == "write":
                return ADD.launch(b, F4(1), 8, grid=1, block=128)
            return ops.copy(c, b)

        def later(_out: object) -> Any:
            calls["then"] += 1
            return later_op()

        def mapped(out: object) -> object:
            calls["map"] += 1
            return out

        def host() -> None:
            calls["host"] += 1

        def add_a() -> Any:
            return ADD.launch(a, F4(1), 8, grid=1, block=128)

        first = "fill" if shape in ("map_then", "nested", "shared_twice") else "add"
        if shape == "zip":
            op: Any = trio_cuda.zip(add_a(), later_op())
        elif shape == "then":
            op = add_a().then(later)
        elif shape == "map_then":
            op = ops.fill(a, 1.0).map(mapped).then(later)
        elif shape == "nested":
            op = trio_cuda.zip(ops.fill(a, 1.0), trio_cuda.zip(ops.value(3), later_op()))
        elif shape == "shared":
            op = trio_cuda.zip(add_a().shared(), later_op())
        elif shape == "shared_twice":
            twice = ops.fill(a, 1.0).map(mapped).shared()
            op = trio_cuda.zip(twice, twice.then(later))
        elif shape == "closure":
            first = "host"
            op = ops.host_closure(host).then(later)
        else:  # map_zip
            op = trio_cuda.zip(add_a().map(mapped), later_op())
        closures = {
            "then": shape in ("then", "map_then", "shared_twice", "closure"),
            "map": shape in ("map_then", "shared_twice", "map_zip"),
        }

        def run_model() -> None:
            if first == "add":
                va[:] += 1
            elif first == "fill":
                va[:] = 1
            if access == "write":
                vb[:] += 1
            else:
                vc[:] = vb

        def check_closures(what: str, enqueued: bool) -> None:
            for name, present in closures.items():
                n = calls[name]
                if n > 1 or (enqueued and present and n != 1) or (not present and n):
                    self.fail(f"{what}: the {name}-closure ran {n} time(s) for one submission")
            if not enqueued and calls["host"]:
                self.fail(f"{what}: a host closure of a refused op ran")

        what = f"later_conflict {shape} ({access})"
        self.flush(self.sim_of(scope))
        y, undo = self.in_flight(gpu, sb, sim, busy)
        released = False
        try:
            w = gpu.submit(ops.fill(b, 5.0), stream=sb)  # b's writer, in flight on another stream
            vb[:] = 5
            if self.conflict_error:
                before = gpu.statistics()
                try:
                    gpu.submit(op, stream=sa)
                except AccessConflictError:
                    self.counts["probe:later_conflict_refused"] += 1
                else:
                    self.fail(f"{what}: accepted under conflicts='error' with b's writer in flight")
                self.same_submissions(gpu, before, what)
                check_closures(what + " (refused)", False)
                undo()
                released = True
                await w.wait()
                # no piece ran: a (the first piece's target) is untouched
                if not await self.probe_read(
                    gpu, a, sa, va, what + ": the first piece ran although the op was refused"
                ):
                    return
                calls.clear()
            fut = gpu.submit(op, stream=sa)
            check_closures(what, True)
            run_model()
            if not released:
                undo()
                released = True
            await w.wait()
            await fut.wait()
        finally:
            if not released:
                undo()
        for arr, v, name in ((a, va, "a"), (b, vb, "b"), (c, vc, "c")):
            if not await self.probe_read(gpu, arr, sa, v, f"{what}: {name}"):
                return
        self.counts["probe:later_conflict"] += 1
        for arr in (a, b, c, y):
            arr.close()

    async def do_thread_stats(self) -> None:
        """From a worker thread, statistics() of every open scope (and the pool,
        a kept future, an open graph) is refused with a RuntimeError naming it."""
        targets: list[tuple[str, Callable[[], object]]] = [
            (f"scope {i}", g.statistics) for i, g in enumerate(self.scopes) if not g.closed
        ]
        if self.pool is not None:
            targets.append(("pool", self.pool.statistics))
        if self.futs:
            targets.append(("future", self.futs[-1].fut.statistics))
        live = [g.graph for g in self.graphs if g.graph is not None and not g.graph.closed]
        if live:
            targets.append(("graph", live[-1].statistics))

        def worker() -> list[tuple[str, str, str]]:
            out = []
            for name, fn in targets:
                try:
                    fn()
                except RuntimeError as exc:
                    out.append((name, "refused", str(exc)))
                except BaseException as exc:
                    out.append((name, "raised", _brief(exc)))
                else:
                    out.append((name, "accepted", ""))
            return out

        for name, how, text in await trio.to_thread.run_sync(worker):
            self.counts["probe:thread_stats"] += 1
            if how != "refused" or "statistics" not in text:
                self.fail(
                    f"thread_stats: {name}.statistics() from a worker thread was {how} {text!r}; "
                    f"it must be refused with a RuntimeError naming statistics"
                )

    async def do_thread_trace(self, rounds: int, dev: int, html: bool) -> None:
        """A scope traced into a Trace records work while a worker thread
        exports it: every export is valid JSON."""
        if self.held:
            self.counts["probe:skipped"] += 1
            return
        await self.do_join()  # no other task injects a fault into the traced scope's work
        sim_i = self.sim_of(self.scope_index(dev))
        self.flush(sim_i)
        t = trio_cuda.trace.Trace()
        done = threading.Event()
        problems: list[str] = []

        def exporter() -> int:
            n = 0
            while (not done.is_set() or n < 2) and n < 60:
                try:
                    doc = json.loads(json.dumps(t.to_chrome(), allow_nan=False))
                    if not isinstance(doc.get("traceEvents"), list):
                        problems.append(f"export {n} has no traceEvents list: {list(doc)}")
                    if html and n == 1:
                        t.to_html()
                except BaseException as exc:
                    problems.append(f"export {n} raised {_brief(exc)}")
                    return n
                n += 1
                time.sleep(0.0005)
            return n

        async with trio_cuda.open_scope(device=self.sims[sim_i], streams=2, trace=t) as g2:
            xs = g2.zeros(16, F4)

            async def work() -> None:
                try:
                    for i in range(rounds):
                        fut = g2.submit(
                            ADD.launch(xs, F4(1), 16, grid=1, block=128), stream=g2.streams[i % 2]
                        )
                        await fut.wait()
                finally:
                    done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(work)
                exports = await trio.to_thread.run_sync(exporter)
            await self.probe_read(g2, xs, None, np.full(16, rounds, F4), "thread_trace")
            xs.close()
        if problems:
            self.fail(
                f"thread_trace: exporting from a worker thread while the scope recorded: {problems[:3]}"
            )
        names = {(e.cat, e.name) for e in t.events}
        if not {("scope", "open"), ("scope", "close")} <= names:
            self.fail(f"thread_trace: the trace lacks the scope's open/close events: {sorted(names)[:10]}")
        self.counts["probe:thread_trace"] += 1
        self.counts["probe:thread_trace_exports"] += exports

    # ---- misuse: refused up front, nothing submitted
    async def do_misuse(self, what: str, p: int) -> None:
        n = self.p.n
        if what == "closed_graph":
            closed = [g for g in self.graphs if g.graph is not None and g.graph.closed]
            if not closed:
                return
            g = closed[p % len(closed)]
            assert g.graph is not None
            try:
                g.graph.launch()
            except ScopeClosedError:
                return
            self.fail("launch() of a closed graph did not raise ScopeClosedError")
        if what == "bad_capture":
            h = self.choose(p, write=True)
            if h is None or h.arr is None:
                return
            gpu = self.scopes[h.scope]
            try:
                await gpu.capture(ops.fill(h.arr, 1).then(lambda x: ops.copy(np.empty(n, F4), x)))
            except GraphCaptureError:
                return
            self.fail("capturing a copy to host memory did not raise GraphCaptureError")
        if what == "closed":
            cands = [h for h in self.handles if h.arr is not None and h.arr.closed]
            if not cands:
                return
            h = cands[p % len(cands)]
            assert h.arr is not None
            try:
                ADD.launch(h.arr, F4(1), n, grid=1, block=128)
            except KernelArgumentError:
                return
            self.fail("a launch with a closed array was not refused")
        if what == "readonly_write":
            cands = [h for h in self.handles if h.usable and h.readonly]
            if not cands:
                return
            h = cands[p % len(cands)]
            assert h.arr is not None
            try:
                ADD.launch(h.arr, F4(1), n, grid=1, block=128)
            except KernelArgumentError:
                return
            self.fail("a launch writing a read-only array was not refused")
        if what == "foreign" and len(self.scopes) > 1:
            h = self.choose(p, write=True)
            if h is None or h.arr is None:
                return
            other = self.scopes[1 - h.scope]
            before = other.statistics().submitted
            try:
                other.submit(ADD.launch(h.arr, F4(1), n, grid=1, block=128))
            except (KernelArgumentError, CompletionUnknownError):
                if other.statistics().submitted != before:
                    self.fail("a refused launch with another scope's array was submitted")
                return
            self.fail("a launch with another scope's array was not refused")

    # ------------------------------------------------------------------ the segment
    async def segment(self, seg: Segment) -> None:
        self.reset(seg)
        caught: BaseException | None = None
        outer = trio.CancelScope()
        with warnings.catch_warnings(record=True) as wlog:
            warnings.simplefilter("always")
            try:
                with outer:
                    async with contextlib.AsyncExitStack() as stack:
                        await self.open_scopes(stack, seg)
                        try:
                            async with trio.open_nursery() as nursery:
                                self.nursery = nursery
                                await self.run_steps(seg.steps, "main")
                                await self.prepare_exit(seg)
                        except BaseException as exc:
                            if any(isinstance(e, ProgramFailure) for e in _leaves(exc)):
                                self.release_all()  # or the scope exit would wait for a held device
                            raise
                        if self.exit_info:
                            # Counted again now that every task has ended: a task cancelled
                            # before it first ran still runs its steps up to its first
                            # checkpoint (a DLPack export kept is one), after prepare_exit.
                            self.exit_info["exports"] = self.held_exports()
                        if seg.drop_exports and self.capsules:
                            for entry in self.capsules:
                                entry[1].exports -= 1
                            self.capsules.clear()  # released now: the exit finds them releasing
                            del entry
                            gc.collect(0)
                            self.exit_info["exports"] = [0 for _ in self.scopes]
                        if seg.parting is not None:
                            self.parting(*seg.parting)
                            self.exit_info["closures"] = any(
                                g.statistics().host_closures_pending for g in self.scopes
                            )
                        if seg.exit_kind == "raise":
                            raise BodyError("the scope body failed")
                        if seg.exit_kind == "cancel":
                            outer.cancel()
                            await trio.lowlevel.checkpoint()
            except BaseException as exc:
                caught = exc
            messages = [w.message for w in wlog]
        self.capsules.clear()
        for h in self.handles:
            h.arr = None
        self.futs.clear()
        gc.collect()
        self.check_exit(seg, caught, messages)

    async def prepare_exit(self, seg: Segment) -> None:
        for i in range(len(self.sims)):
            self.flush(i)
        if seg.exit_policy == "free":
            if self.held:
                self.release_all()
            if seg.join_tasks:
                await self.do_join()
            else:
                await self.do_cancel_tasks()
            if random.Random(self.p.seed + 2).random() < 0.5:
                await self.do_verify()  # else the exit may find work not yet retired
        elif seg.exit_policy == "held_timeout":
            await self.do_cancel_tasks()
            for _cs, done in self.tasks:
                await done.wait()  # cancelled: they end promptly
            for sim in self.sims:
                sim.hold()
            self.held = True
        else:
            for sim in self.sims:
                sim.hold()
            self.held = True
            self.outer.start_soon(self.releaser, self.sims, random.Random(self.p.seed).choice([0.001, 0.005]))
            if seg.join_tasks:
                for _cs, done in self.tasks:
                    await done.wait()
            else:
                await self.do_cancel_tasks()
        if random.Random(self.p.seed + 1).random() < 0.3:
            gc.collect()
        stats = [g.statistics() for g in self.scopes]
        self.exit_info = {
            "held": any(s.held for s in self.sims),
            "closures": any(st.host_closures_pending for st in stats),
            "exports": self.held_exports(),
            "borrows": sum(1 for h in self.handles if h.borrowed and h.usable),
            "stats": stats,
        }

    def held_exports(self) -> list[int]:
        """Per scope, the DLPack capsules the program holds."""
        return [sum(1 for _c, _s, sc in self.capsules if sc == i) for i in range(len(self.scopes))]

    def parting(self, shape: tuple[Any, ...], dev: int, stream: int | None) -> None:
        """Submit work and leave the scope at once: the exit finds it not
        yet retired (or, on a held device, not yet run)."""
        scope = self.scope_index(dev)
        self.counts["action:parting"] += 1
        eff: Eff | None = None
        try:
            built = self.build(shape, scope)  # may raise: a quarantined array
            if built is None:
                return
            op, eff = built
            self.scopes[scope].submit(op, stream=self.stream(scope, stream))
        except ProgramFailure:
            raise
        except Exception as exc:
            if eff is not None:
                self.refused(eff, exc)
            self.expect(exc, "parting submission")
            return
        self.commit(eff)

    async def releaser(self, sims: list[SimDevice], delay: float) -> None:
        await trio.sleep(delay)
        for sim in sims:
            sim.release()

    # ------------------------------------------------------------------ exit checks
    def check_exit(self, seg: Segment, caught: BaseException | None, warned: list[Warning | str]) -> None:
        info = self.exit_info
        leaves = [] if caught is None else _leaves(caught)
        if any(isinstance(e, ProgramFailure) for e in leaves):
            return  # recorded where it happened
        if not info:  # the body failed before its exit was prepared
            for e in leaves:
                self.note(f"segment {self.seg_index}: body failed: {_brief(e)}")
            return
        timed_exit = seg.drain_timeout is not None and (
            seg.exit_policy == "held_timeout" or self.timed or (seg.drain_timeout == 0 and info["closures"])
        )
        body = 0
        for e in leaves:
            if isinstance(e, trio.Cancelled):
                self.note(f"segment {self.seg_index}: trio.Cancelled leaked out of the program: {caught!r}")
            elif isinstance(e, BodyError):
                body += 1
            elif self.allowed(e):
                self.counts[f"exit_error:{type(e).__name__}"] += 1
            else:
                tb = "".join(traceback.format_exception(e, limit=-8))
                self.note(f"segment {self.seg_index}: unexpected error at scope exit: {_brief(e)}\n{tb}")
        if body != (1 if seg.exit_kind == "raise" else 0):
            self.note(f"segment {self.seg_index}: the body's BodyError came out {body} time(s): {caught!r}")

        # -- warnings: each explained by what the program did
        quarantine_warned = False
        for w in warned:
            text = str(w)
            if not isinstance(w, ResourceWarning):
                self.note(f"segment {self.seg_index}: unexpected warning {type(w).__name__}: {text}")
                continue
            quarantine_warned = True
            self.counts["quarantine_warnings"] += 1
            held = any(info["exports"]) or self.borrowed  # exports a consumer still held at the exit
            if "still held by their consumer" in text:
                ok = held
            elif "still in flight after drain_timeout" in text or "lease(s) of other scopes" in text:
                ok = timed_exit
            elif "not finished after drain_timeout" in text:
                # (a held export is reported so too when the drain timed out first)
                ok = (timed_exit and self.exported) or held
            else:
                ok = False
            if not ok:
                self.note(f"segment {self.seg_index}: unexpected ResourceWarning: {text}")

        # -- quarantine only where the program explains it
        unknown = "completion_unknown" in self.injected
        quarantined_sims: set[int] = set()
        for i, gpu in enumerate(self.scopes):
            self.scope_refs.append((weakref.ref(gpu), f"segment {self.seg_index} scope {i}"))
            st = gpu.statistics()
            if not gpu.closed:
                self.note(f"segment {self.seg_index}: scope {i} is not closed after its exit")
            if st.in_flight:
                self.note(f"segment {self.seg_index}: scope {i} exited with {st.in_flight} in flight: {st}")
            if st.quarantined or st.quarantined_leases or st.quarantined_bytes:
                self.counts["quarantined_scopes"] += 1
                quarantined_sims.add(self.sim_of(i))
                if not (unknown or quarantine_warned):
                    self.note(
                        f"segment {self.seg_index}: scope {i} quarantined work although no "
                        f"completion_unknown fault was injected and no drain timeout or held export "
                        f"was reported: {st}"
                    )
        if quarantine_warned:
            quarantined_sims.update(range(len(self.sims)))
        if quarantined_sims:
            self.quarantined_any = True

        # -- graphs: closed by the exit, destroyed unless quarantined
        for g in self.graphs:
            if g.graph is None:
                continue
            if not g.graph.closed:
                self.note(f"segment {self.seg_index}: a graph is still open after its scope exited")
            if not quarantined_sims and not g.graph.statistics().destroyed:
                self.note(f"segment {self.seg_index}: a graph was not destroyed after its scope exited")

        # -- memory: nothing live but what was quarantined; memcheck clean, even
        # after abandoned work runs on
        for i, sim in enumerate(self.sims):
            live = {a.ptr for a in sim.live_allocations} - self.baseline[i]
            if live and i not in quarantined_sims:
                self.note(
                    f"segment {self.seg_index}: device {i} leaks {len(live)} allocation(s) after the "
                    f"scope(s) exited, with nothing quarantined: {sorted(hex(x) for x in live)}"
                )
            st = sim.statistics()
            loaded = st.kernel_loads - st.kernel_unloads
            if i not in quarantined_sims and loaded != self.modules[i]:
                self.note(
                    f"segment {self.seg_index}: device {i} has {loaded - self.modules[i]} module(s) "
                    f"still loaded after the scope(s) exited, with nothing quarantined"
                )
            self.modules[i] = loaded
        # abandoned work runs on (on memory that was never freed); work on one
        # device may wait for the other's
        for sim in self.sims:
            sim.release()
        while sum(sim.run_until_idle() for sim in self.sims):
            pass
        for i, sim in enumerate(self.sims):
            if sim.violations:
                self.note(f"segment {self.seg_index}: memcheck on device {i}: {sim.violations[:5]}")
            if sim.pending:
                self.note(
                    f"segment {self.seg_index}: device {i} has {sim.pending} command(s) stuck after exit"
                )
            self.baseline[i] = {a.ptr for a in sim.live_allocations}


# =========================================================================== running


@dataclass
class Totals:
    programs: int = 0
    steps: int = 0
    hangs: int = 0
    failures: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    failed: list[Result] = field(default_factory=list)

    def add(self, res: Result) -> None:
        self.programs += 1
        self.steps += res.program.steps()
        self.counts.update(res.counts)
        if res.hung:
            self.hangs += 1
        if not res.ok:
            self.failures += 1
            self.failed.append(res)

    def summary(self) -> str:
        c = self.counts
        actions = {k.split(":", 1)[1]: v for k, v in sorted(c.items()) if k.startswith("action:")}
        faults = {k.split(":", 1)[1]: v for k, v in sorted(c.items()) if k.startswith("fault:")}
        errors = {
            k.split(":", 1)[1]: v for k, v in sorted(c.items()) if k.startswith(("error:", "exit_error:"))
        }
        probes = {k.split(":", 1)[1]: v for k, v in sorted(c.items()) if k.startswith("probe:")}
        return "\n".join(
            [
                f"programs run: {self.programs} ({self.steps} steps)",
                f"actions executed: {sum(actions.values())} {actions}",
                f"faults injected: {sum(faults.values())} {faults}",
                f"cancellations: {c['cancellations']} (tasks cancelled: {c['cancelled_tasks']})",
                f"quarantines: {c['quarantined_scopes']} scope(s), {c['quarantine_warnings']} warning(s)",
                f"reads: {c['reads']} ({c['checked_reads']} compared with the model), "
                f"submissions committed to the model: {c['committed']} (tainted by a pending fault: "
                f"{c['tainted_submissions']}), ops without arrays: {c['ops_without_arrays']}",
                f"allowed errors: {errors}",
                f"probes: {probes}; strict refusals (nothing enqueued): {c['strict_refusals']}, "
                f"then/map closures checked: {c['closure_calls_checked']}",
                f"hangs: {self.hangs}",
                f"failures: {self.failures}",
            ]
        )


#: wall seconds a program under the autojump clock may take (times TRIO_CUDA_TEST_TIME_SCALE): its
#: simulated kernels take up to seconds of virtual time, which only the mock clock can skip
MOCK_WALL = 2.5


def run_program(program: Program, limit: float = 5.0) -> Result:
    """Run ``program`` under a hard time limit; never raises."""
    runner = Runner(program)
    res = runner.result
    unraisable: list[str] = []
    old_hook = sys.unraisablehook

    def hook(u: Any) -> None:
        unraisable.append(f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}")

    sys.unraisablehook = hook
    t0 = time.perf_counter()
    try:
        clock = trio.testing.MockClock(autojump_threshold=0) if runner.mock else None
        run_bounded(runner.main, limit=limit, fail=False, clock=clock)
    except Hang as exc:
        res.hung = True
        res.failures.append(f"hang: {exc}")
    except BaseException as exc:  # the program must not fail outside its checks
        leaves = _leaves(exc)
        if not all(isinstance(e, ProgramFailure) for e in leaves):
            tb = "".join(traceback.format_exception(exc, limit=-10))
            res.failures.append(f"the program raised {_brief(exc)}\n{tb}")
    finally:
        res.seconds = time.perf_counter() - t0
        refs, quarantined = runner.scope_refs, runner.quarantined_any
        for sim in runner.sims:
            sim.clear_trace()
        if not res.hung:
            runner.__dict__.clear()  # the program's own references: only the library's remain
        # A collected array's finalizer releases its allocation, and with it the
        # last reference to a scope in the same garbage: that takes a second pass.
        for _ in range(3):
            if not gc.collect():
                break
        sys.unraisablehook = old_hook
    for u in unraisable:
        res.failures.append(f"unraisable exception: {u}")
    if program.options.get("clock") == "autojump" and not res.hung and res.seconds > MOCK_WALL * SCALE:
        res.failures.append(
            f"under MockClock(autojump_threshold=0) the program took {res.seconds:.2f} s of wall time "
            f"(limit {MOCK_WALL * SCALE:g} s): timed work must take virtual time"
        )
    if res.ok and not quarantined and "gc_leak" not in program.skip:
        # With nothing quarantined, nothing keeps a scope once the program let go of it.
        alive = [label for ref, label in refs if ref() is not None]
        if alive:
            res.failures.append(
                f"leak: {', '.join(alive)} still alive after the program ended and gc.collect() "
                f"(nothing was quarantined; the library keeps a reference)"
            )
    return res


def seeds_from_env(default: list[int]) -> list[int]:
    raw = os.environ.get("TRIO_CUDA_ADVERSARY_SEED")
    if raw:
        return [int(s) for s in raw.replace(",", " ").split()]
    return default


__all__ = [
    "KNOWN_DEFECTS",
    "Program",
    "Result",
    "Totals",
    "generate",
    "run_program",
    "seeds_from_env",
    "skipped_features",
]
