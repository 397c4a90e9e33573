"""Trio's private run state, read in this one module.

The runtime asks Trio two things that its public API answers only slowly (about
2 µs for ``trio.lowlevel.current_statistics()``) or not at all, and it asks the
first on every await of a future:

* how many tasks are runnable now (:func:`runnable_tasks`, and the hot-path
  :func:`others_runnable`);
* which Trio run the calling thread is in (:func:`current_run`);
* what a checkpoint yields to Trio's run loop (:func:`checkpoint_message`), so
  that compiled code can make the same schedule point without Trio's frames.

The first two read ``trio._core._run.GLOBAL_RUN_CONTEXT``, a ``threading.local`` whose
``runner`` attribute is the calling thread's ``Runner`` while ``trio.run`` runs
there, and ``Runner.runq``, the deque of runnable tasks (the current task is
not in it while it runs).

Invariants:

* Checked against Trio 0.35 (run by the tests) and the source of every release
  from 0.28 (the lowest the project requires) to 0.34: the same
  ``GLOBAL_RUN_CONTEXT``, ``runner`` and ``runq``. ``tests/core/test_trio_internals.py`` pins the range
  (:data:`CHECKED_TRIO`) and checks each answer against a run whose runnable
  tasks it arranges, so an upgrade that moves these internals fails there.
* Never crashes on another layout: when the run context cannot be imported or
  has no ``runner.runq``, :func:`runnable_tasks` falls back to the public
  ``current_statistics().tasks_runnable``, :func:`others_runnable` answers True
  (assume busy: a waiter then checkpoints between looks, which is always safe)
  and :func:`current_run` answers with the run's public ``TrioToken``.
* No indirection on the hot path: callers bind these functions at import time
  (``from ._trio_internals import others_runnable``), and each is one attribute
  chain in a ``try``.
"""

from __future__ import annotations

from typing import Any, Final

import trio

__all__ = [
    "CHECKED_TRIO",
    "INTERNALS_FOUND",
    "checkpoint_message",
    "current_run",
    "others_runnable",
    "runnable_tasks",
]

#: the Trio versions (lowest, highest ``major.minor``) these internals were checked against
CHECKED_TRIO: Final = ((0, 28), (0, 35))


def _find_run_context() -> Any:
    """Trio's ``GLOBAL_RUN_CONTEXT``, or None where the module layout differs."""
    try:
        from trio._core import _run
    except ImportError:  # pragma: no cover - another Trio layout
        return None
    return getattr(_run, "GLOBAL_RUN_CONTEXT", None)


_RUN_CONTEXT: Any = _find_run_context()

#: whether Trio's run context was found (False: every answer is a fallback)
INTERNALS_FOUND: Final = _RUN_CONTEXT is not None


def others_runnable() -> bool:
    """True when other Trio tasks are ready to run (then an awaiting task
    checkpoints between looks instead of busy-polling its marker); True too
    where Trio's run queue cannot be read."""
    try:
        return bool(_RUN_CONTEXT.runner.runq)
    except AttributeError:  # another Trio layout: assume busy
        return True


def runnable_tasks() -> int:
    """How many Trio tasks are ready to run, besides the calling one (from
    inside a Trio run). Reads the run queue where reachable, else the public
    (slower) ``current_statistics()``."""
    try:
        return len(_RUN_CONTEXT.runner.runq)
    except AttributeError:
        return int(trio.lowlevel.current_statistics().tasks_runnable)


def current_run() -> object:
    """The Trio run of the calling thread (an opaque identity), or None in a
    thread with no Trio run (a worker thread, or outside ``trio.run``)."""
    try:
        return _RUN_CONTEXT.runner
    except AttributeError:
        pass
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


def checkpoint_message() -> object | None:
    """What ``trio.lowlevel.cancel_shielded_checkpoint`` yields to Trio's run
    loop (which then reschedules the task and sends it ``outcome.Value(None)``),
    taken by stepping that coroutine once, outside any run; None where it
    yields nothing, or not the same object each time (another Trio: the
    compiled step is not used)."""
    messages = []
    for _ in range(2):
        coro = trio.lowlevel.cancel_shielded_checkpoint()  # noqa: ASYNC105 (stepped by hand, never run)
        try:
            messages.append(coro.send(None))
        except BaseException:  # (it finished, or raised: nothing to take)
            return None
        finally:
            coro.close()
    first, second = messages
    return first if first is second and first is not None else None
