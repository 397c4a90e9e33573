"""The tracers' lock where the compiled paths are in use
(``_claunch.TraceLock``): ``threading.RLock``'s behaviour, which the pure
path uses, compared call by call; waiting across threads; an interrupted
wait (the compiled records taking it: ``test_trace_compiled.py``)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_cuda._core import _compiled, _trace

pytestmark = pytest.mark.skipif(
    _compiled.ext is None,
    reason="the compiled paths are not in use (not built at install, or TRIO_CUDA_PURE set)",
)


def _new() -> Any:
    assert _compiled.ext is not None
    return _compiled.ext.TraceLock()


def test_tracers_use_it_where_the_compiled_paths_are_in_use() -> None:
    assert type(_trace.Tracer(limit=4).lock) is type(_new())
    with pytest.raises(TypeError, match="no arguments"):
        type(_new())(1)


_calls = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from([(), (True,), (False,), (True, 0.0), (True, 0.001)])),
    st.tuples(st.just("acquire_kw"), st.sampled_from([{"blocking": False}, {"timeout": 0}, {"timeout": -1}])),
    st.tuples(
        st.just("bad"),
        st.sampled_from(
            [
                (False, 1.0),
                (True, -2.0),
                (True, float("nan")),
                (True, 1e300),
                (True, float("inf")),
                (True, -float("inf")),
                (False, float("inf")),
                (False, float("nan")),
                (False, -2.0),
                (False, 1e300),
            ]
        ),
    ),
    st.tuples(st.just("release"), st.just(())),
    st.tuples(st.just("owned"), st.just(())),
    st.tuples(st.just("with"), st.just(())),
)


def _apply(lock: Any, call: tuple[str, Any]) -> Any:
    what, args = call
    try:
        if what in ("acquire", "bad"):
            return lock.acquire(*args)
        if what == "acquire_kw":
            return lock.acquire(**args)
        if what == "release":
            return lock.release()
        if what == "owned":
            return lock._is_owned()
        with lock as got:
            return ("inside", got, lock._is_owned())
    except (RuntimeError, ValueError, OverflowError) as exc:
        return type(exc)


@settings(max_examples=200, deadline=None)
@given(st.lists(_calls, max_size=30))
def test_it_answers_as_rlock_does(calls: list[tuple[str, Any]]) -> None:
    """Any sequence of calls on one thread: the same results and error types."""
    mine, ref = _new(), threading.RLock()
    for call in calls:
        assert _apply(mine, call) == _apply(ref, call), call
    while ref._is_owned():  # (it ends free, as the reference does)
        ref.release()
        mine.release()
    assert not mine._is_owned()
    assert mine.acquire(False)
    mine.release()


def test_another_thread_waits_for_it_and_times_out() -> None:
    lock = _new()
    lock.acquire()
    lock.acquire()
    got: list[Any] = []

    def other() -> None:
        t0 = time.monotonic()
        got.append(lock.acquire(timeout=0.05))
        got.append(time.monotonic() - t0)
        got.append(lock.acquire(blocking=False))
        with pytest.raises(RuntimeError, match="un-acquired"):
            lock.release()
        got.append(lock.acquire())  # (waits for the two releases below)
        got.append(lock._is_owned())
        lock.release()

    th = threading.Thread(target=other)
    th.start()
    time.sleep(0.2)
    assert got[0] is False
    assert got[1] >= 0.04
    assert got[2] is False
    lock.release()
    time.sleep(0.05)
    assert len(got) == 3  # (still held once)
    lock.release()
    th.join(5)
    assert not th.is_alive()
    assert got[3:] == [True, True]
    assert lock.acquire(False)
    lock.release()


def test_threads_hammering_it_keep_one_owner() -> None:
    lock = _new()
    inside = [0]
    worst = [0]

    def work() -> None:
        for _ in range(2000):
            with lock, lock:  # (reentered)
                inside[0] += 1
                worst[0] = max(worst[0], inside[0])
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert worst == [1]
    assert lock.acquire(False)
    lock.release()


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_a_wait_interrupted_by_ctrl_c_raises_and_takes_nothing() -> None:
    """SIGINT while the main thread waits: KeyboardInterrupt from the wait
    (the handlers run), and the lock stays the other thread's."""
    lock = _new()
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            done.wait(10)

    th = threading.Thread(target=holder)
    th.start()
    assert held.wait(5)
    main = threading.main_thread().ident
    assert main == threading.get_ident()
    timer = threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            lock.acquire(timeout=5)
        assert time.monotonic() - t0 < 4
        assert not lock._is_owned()
    finally:
        timer.cancel()
        done.set()
        th.join(5)
    assert lock.acquire(timeout=5)
    lock.release()
