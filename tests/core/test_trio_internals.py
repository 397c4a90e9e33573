"""The shim over Trio's private run state (``trio_cuda._core._trio_internals``):
pinned to the Trio versions it was checked against, its answers checked against
runs whose runnable tasks these tests arrange, and its fallbacks safe.

A Trio upgrade fails here first: either the version pin (check the internals
still hold, then widen ``CHECKED_TRIO``) or the answers (the internals moved).
"""

from __future__ import annotations

import re
import threading
import tomllib
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_cuda._core import _completion, _trio_internals
from trio_cuda._core._trio_internals import CHECKED_TRIO, current_run, others_runnable, runnable_tasks

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def test_the_installed_trio_is_a_checked_one() -> None:
    low, high = CHECKED_TRIO
    assert low <= _version(trio.__version__) <= high, (
        f"trio {trio.__version__} is outside the versions trio_cuda._core._trio_internals was checked "
        f"against ({low} to {high}): check its internals, then widen CHECKED_TRIO"
    )


def test_the_checked_range_starts_at_the_required_trio() -> None:
    deps = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    (req,) = [d for d in deps if re.match(r"trio\s*[><=]", d)]
    assert _version(req.split(">=", 1)[1]) == CHECKED_TRIO[0], (req, CHECKED_TRIO)


def test_the_internals_are_found() -> None:
    assert _trio_internals.INTERNALS_FOUND, "trio._core._run.GLOBAL_RUN_CONTEXT is gone"


def test_the_hot_path_binds_the_shim() -> None:
    # the completion's waiters call it with no extra indirection
    assert _completion.others_runnable is others_runnable


@pytest.mark.parametrize("n", [0, 1, 5])
def test_runnable_tasks_counts_the_tasks_arranged(n: int) -> None:
    async def main() -> None:
        assert current_run() is not None
        await trio.testing.wait_all_tasks_blocked()
        assert runnable_tasks() == 0
        assert others_runnable() is False
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(trio.sleep_forever)
            # no checkpoint since: the n new tasks are runnable, the caller runs
            assert runnable_tasks() == n == trio.lowlevel.current_statistics().tasks_runnable
            assert others_runnable() is (n > 0)
            await trio.testing.wait_all_tasks_blocked()
            assert runnable_tasks() == 0
            assert others_runnable() is False
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_current_run_is_one_identity_per_run_and_none_outside() -> None:
    assert current_run() is None
    seen: list[object] = []

    async def main() -> None:
        seen.append(current_run())
        await trio.lowlevel.checkpoint()
        seen.append(current_run())
        seen.append(await trio.to_thread.run_sync(current_run))  # a worker thread runs no loop

    trio.run(main)
    first, again, worker = seen
    assert first is not None
    assert again is first
    assert worker is None
    other: list[object] = []
    thread = threading.Thread(target=lambda: trio.run(lambda: _append_run(other)))
    thread.start()
    thread.join()
    (theirs,) = other
    assert theirs is not None
    assert theirs is not first
    assert current_run() is None


async def _append_run(out: list[object]) -> None:
    out.append(current_run())


@pytest.mark.parametrize("context", [None, object()], ids=["not-imported", "another-layout"])
def test_missing_internals_degrade_safely(monkeypatch: pytest.MonkeyPatch, context: object) -> None:
    monkeypatch.setattr(_trio_internals, "_RUN_CONTEXT", context)
    assert current_run() is None

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(trio.sleep_forever)
            assert runnable_tasks() == 3  # from the public statistics
            assert others_runnable() is True  # assume busy
            assert current_run() is trio.lowlevel.current_trio_token()
            nursery.cancel_scope.cancel()

    trio.run(main)
