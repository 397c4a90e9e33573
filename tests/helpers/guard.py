"""Run a Trio program under a hard wall-clock limit, so that a hang fails a test.

A scope exit that hangs is shielded: ``trio.fail_after`` around it cannot stop
it, and a test run by pytest-trio would hang the whole suite. ``run_bounded``
runs the program with ``trio.run`` in a daemon thread and fails the test, with
the stuck thread's stack, when it has not finished within ``limit`` seconds.
The stuck thread is abandoned (it is a daemon: it never blocks interpreter
exit).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import trio

#: multiplies every limit (slow machines, sanitizers, coverage)
SCALE = float(os.environ.get("TRIO_CUDA_TEST_TIME_SCALE", "1"))


class Hang(AssertionError):
    """The program did not finish within its limit."""


def run_bounded(
    async_fn: Callable[..., Awaitable[Any]],
    *args: Any,
    limit: float = 10.0,
    fail: bool = True,
    **run_kwargs: Any,
) -> Any:
    """``trio.run(async_fn, *args)`` in a thread; its result, or its exception
    re-raised here. A program still running after ``limit`` seconds fails the
    test (``fail=False``: raises :class:`Hang` instead, for callers that count
    hangs)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = trio.run(async_fn, *args, **run_kwargs)
        except BaseException as exc:
            outcome["error"] = exc

    t = threading.Thread(target=target, name=f"bounded {getattr(async_fn, '__name__', 'program')}")
    t.daemon = True
    t.start()
    t.join(limit * SCALE)
    if t.is_alive():
        frame = sys._current_frames().get(t.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
        message = (
            f"the program did not finish within {limit * SCALE:g} s (a hang); where it is stuck:\n{stack}"
        )
        if fail:
            pytest.fail(message)
        raise Hang(message)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@contextlib.contextmanager
def held(dev: Any) -> Iterator[None]:
    """Hold a SimDevice (or SimHost) for the block, and release it however the
    block ends: a failed assertion must not leave a scope exit waiting forever."""
    dev.hold()
    try:
        yield
    finally:
        dev.release()
