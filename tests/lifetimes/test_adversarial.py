"""Adversarial random programs: concurrency, cancellation and hostile actions.

Unlike ``test_stateful.py``, which predicts every outcome of one task's
sequence of steps, these programs are deliberately hostile and concurrent, and
check invariants that must hold whatever happens. A seeded generator
(``tests/helpers/adversary.py``, ``random.Random(seed)``) writes each program: one or
two segments, each one resource scope, two scopes on one ``SimDevice``, two
scopes on a two-device ``SimHost`` or a device pool (multiple streams, pinned
streams, ``conflicts="order"`` or ``"error"``, a ``drain_timeout``, the
default, a round-robin, least-loaded or garbage-returning scheduling policy), whose
main task and concurrent tasks (in a nursery, some with deadlines or cancelled
before they start, some cancelled while they await) mix:

* submissions (``submit``, ``run``, ``await op``, ``pool.run``) of kernel
  launches, fills, copies (host, device, cross-scope and cross-device), host
  closures (some raise an ``Exception``, some a ``BaseException``, some close
  an array), ``zip``/``then``/``map`` chains and then-closures that raise;
  cancel scopes with random deadlines (0 included) and pre-cancelled ones;
  futures kept and awaited (with deadlines) or dropped and garbage-collected;
* arrays closed (``close()``, ``async with arr``), dropped and collected, made
  read-only; DLPack exports dropped at once or held (to the scope exit),
  ``borrow`` into the other scope, ``__cuda_array_interface__`` (absent on the
  simulator);
* graphs captured (also of work that cannot be captured), replayed, updated,
  closed and dropped;
* injected faults (``launch_error``, ``out_of_memory``, ``kernel_fault``,
  ``completion_unknown``), device holds, releases and single steps, misuse
  (closed arrays, read-only writes, another scope's arrays, closed graphs);
* an exit that is normal, raises or is cancelled, on a free device, on a held
  one with a short ``drain_timeout``, or on a held one released a little later,
  sometimes right after a last submission.

A NumPy model follows every array: each submission's effect is applied when it
is submitted (a then-closure on the op tells exactly when, and whether, a
``run`` submitted it; ``run`` cancelled before it started must not have). An
array is *unknown* after work that may have taken an injected fault, after a
submission that failed part-way, or when its source was unknown; writing it
whole (fill, host copy, copy of a known array) makes it known again.

After every program: ``sim.violations == []`` on every device (also after
work abandoned by a drain timeout ran on); nothing is live after the exit
unless a scope reported quarantine, and nothing is quarantined unless a
``completion_unknown`` fault was injected or a ``ResourceWarning`` reported a
drain timeout or an export held at exit (each warning must be explained by
what the program did); no hang (each program runs in ``trio.run`` in a thread
under a hard limit, ``tests/helpers/guard.py``); every read back of a known array
equals the model; every error is one the program's hostile actions explain
(``trio.Cancelled`` never leaks), at each step and in the exit's exception
group; no unraisable exception; after a ``settle`` step nothing is in
flight, nothing is pending on the device, and memory with no open handle,
export or graph is freed; and once a program that quarantined nothing has
ended, its scopes can be garbage-collected (check ``gc_leak``).

Main-task probes (drawn from a second generator seeded by the program's seed,
so the rest of the program is unchanged by them) check, strictly, on arrays of
their own:

* ``view_graph``: a graph of a copy, a kernel (``COPY``, ``SAXPY``) or a zip
  between two views of ONE allocation, replayed on one stream right after
  another stream's writer of the source view (all of it, part of it, or both
  views across their boundary) or writer/reader of the destination view, with
  no checkpoint in between: under ``"order"`` the read back equals the model
  (the replay ran after the other stream's work; a reader saw the old
  destination), under ``"error"`` the replay raises ``AccessConflictError``
  with nothing enqueued or leased and no replay counted, and runs once retried;
* ``later_conflict``: under ``"error"``, a zip/then/map/shared/nested op (or a
  host closure then work) whose first piece writes ``a`` and only a later one
  touches ``b``, which another stream is writing: refused whole (``a``
  untouched, statistics unchanged, then/map closures at most once, the host
  closure never), then retried once (each closure exactly once, ``a`` written
  once); under ``"order"`` it runs after the writer. Everywhere else, under
  ``"error"`` an op refused with ``AccessConflictError`` (or a then-closure
  that raised) leaves the model as it was (no piece ran), and each then/map
  closure of a random op runs at most once per submission (a then-closure of
  an enqueued op exactly once);
* ``thread_stats``: from ``trio.to_thread.run_sync``, ``statistics()`` of every
  open scope, the pool, a kept future and an open graph raises a RuntimeError
  naming statistics; ``thread_trace``: a scope opened with
  ``trace=trio_cuda.trace.Trace()`` records work while a worker thread exports
  it (``to_chrome`` as strict JSON, ``to_html``), every export valid.

Some programs (``clock=autojump``) run under
``trio.testing.MockClock(autojump_threshold=0)`` on devices whose kernels take
0.01-0.2 s and copies 1-20 ms: they must finish in virtual time (under
``helpers.adversary.MOCK_WALL`` s of wall time) with the model holding.

Features that once triggered defects (see ``tests/lifetimes/test_attacks.py`` and the
probes above) are generated too; switch them off with
``TRIO_CUDA_ADVERSARY_SKIP=base_exception,drain_zero,bad_policy,view_graphs,later_conflicts,mock_clock,thread_probes``
(or ``known`` for all of them; see ``helpers.adversary.KNOWN_DEFECTS``), and the
``gc_leak`` check with ``TRIO_CUDA_ADVERSARY_SKIP=gc_leak``.

A failure prints its seed and the program. Replay it (or several)::

    TRIO_CUDA_ADVERSARY_SEED=123 pytest tests/lifetimes/test_adversarial.py
    TRIO_CUDA_ADVERSARY_SEED="123 456" pytest tests/lifetimes/test_adversarial.py

The slow variant runs many programs and prints what they did; it is skipped
unless it is selected with ``-m slow`` or ``TRIO_CUDA_ADVERSARY_PROGRAMS``::

    pytest -m slow tests/lifetimes/test_adversarial.py -s      # 10,000 programs
    TRIO_CUDA_ADVERSARY_PROGRAMS=2000 TRIO_CUDA_ADVERSARY_FIRST=50000 \\
        pytest tests/lifetimes/test_adversarial.py -k many -s
"""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.adversary import (
    KNOWN_DEFECTS,
    Totals,
    generate,
    run_program,
    seeds_from_env,
    skipped_features,
)
from tests.helpers.guard import SCALE

#: the fast subset: about 20-30 s on two cores
FAST_SEEDS = seeds_from_env(list(range(200)))
#: hard limit of one program, in seconds (times TRIO_CUDA_TEST_TIME_SCALE)
LIMIT = 5.0


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_program(seed: int) -> None:
    res = run_program(generate(seed), limit=LIMIT)
    if not res.ok:
        pytest.fail(res.report(), pytrace=False)


def test_programs_are_fixed_by_their_seed() -> None:
    for seed in (0, 1, 12345):
        assert generate(seed).text() == generate(seed).text()
    assert generate(1).text() != generate(2).text()


def test_known_defect_features_are_generated() -> None:
    """The generator keeps exercising the known-defect features (unless
    switched off): they must be covered once the defects are fixed."""
    text = "\n".join(generate(seed).text() for seed in range(200))
    skip = skipped_features()
    markers = {
        "base_exception": "host base",
        "drain_zero": "drain_timeout=0.0 ",
        "bad_policy": "policy=bad",
        "view_graphs": "view_graph(",
        "later_conflicts": "later_conflict(",
        "mock_clock": "clock=autojump",
        "thread_probes": "thread_stats(",
    }
    for name, marker in markers.items():
        assert name in KNOWN_DEFECTS
        assert (marker in text) is (name not in skip), name


def _slow_selected(config: pytest.Config) -> bool:
    if os.environ.get("TRIO_CUDA_ADVERSARY_PROGRAMS"):
        return True
    markexpr = str(config.getoption("-m", default="") or "")
    return "slow" in markexpr and "not slow" not in markexpr


@pytest.mark.slow
def test_many_programs(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    """``TRIO_CUDA_ADVERSARY_PROGRAMS`` programs (10,000 by default) from seed
    ``TRIO_CUDA_ADVERSARY_FIRST`` on (1,000,000 by default, apart from the
    fast subset); prints what they did, and fails on any hang or failure."""
    if not _slow_selected(request.config):
        pytest.skip("slow: select it with -m slow or TRIO_CUDA_ADVERSARY_PROGRAMS=N")
    count = int(os.environ.get("TRIO_CUDA_ADVERSARY_PROGRAMS", "10000"))
    first = int(os.environ.get("TRIO_CUDA_ADVERSARY_FIRST", "1000000"))
    totals = Totals()
    t0 = time.perf_counter()
    for seed in range(first, first + count):
        totals.add(run_program(generate(seed), limit=LIMIT))
    elapsed = time.perf_counter() - t0
    summary = (
        f"{totals.summary()}\nseeds {first}..{first + count - 1} in {elapsed:.0f} s (time scale {SCALE:g})"
    )
    with capsys.disabled():
        print("\n--- adversarial programs ---\n" + summary)
        for res in totals.failed[:20]:
            print(f"FAILED seed {res.program.seed}: {res.failures[0].splitlines()[0][:300]}")
    if totals.failed:
        reports = "\n\n".join(r.report() for r in totals.failed[:3])
        seeds = " ".join(str(r.program.seed) for r in totals.failed)
        head = f"{totals.failures} program(s) failed ({totals.hangs} hang(s)); seeds: {seeds}"
        pytest.fail(f"{head}\n{summary}\n\n{reports}", pytrace=False)
