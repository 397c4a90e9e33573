"""Waiter threads of the cuda backend: where the completion handoff sleeps
while a long kernel runs.

Invariants:

* A waiter thread never runs user code and never touches runtime state. It
  blocks in the driver (``cuEventSynchronize`` on a blocking-sync event, with
  the GIL released by cuda.bindings) or sleeps between reads of pinned flags,
  then wakes the Trio loop with ``TrioToken.run_sync_soon``. Everything else
  happens on the loop thread.
* No Python runs on a CUDA driver thread: there are no host-function callbacks.
* A job that was cancelled (the loop stopped waiting for it) still ends: an
  event job when its event completes, a poll job at its next wake-up. Its late
  wake-up is a harmless spurious one.
* Threads are daemons, created lazily, reused, and bounded in number; when all
  are busy the caller falls back to polling from the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["EventJob", "PollJob", "WaiterPool"]

_M32 = 0xFFFFFFFF
_HALF = 0x80000000


class EventJob:
    """Block in ``cuEventSynchronize(event)``; report the CUresult."""

    __slots__ = ("cancelled", "event", "on_done", "owner", "recycle", "result")

    def __init__(
        self, event: Any, on_done: Callable[[EventJob], None], *, owner: object = None, recycle: bool = False
    ) -> None:
        self.event = event
        self.on_done = on_done
        #: keeps the event's owner (a marker) alive while the thread waits on it
        self.owner = owner
        #: the event was recorded for this job and goes back to the pool after it
        self.recycle = recycle
        self.cancelled = False
        self.result: Any = None

    def run(self, cu: Any) -> None:
        (self.result,) = cu.cuEventSynchronize(self.event)
        self.on_done(self)


class PollJob:
    """Read pinned flags until one of ``watch`` (memoryview, slot, seq) reached
    its sequence number, sleeping ``interval`` (growing to ``max_interval``)
    between reads; ``time.sleep`` is precise to tens of microseconds, where an
    event-loop timer is not."""

    __slots__ = ("cancelled", "interval", "max_interval", "on_done", "result", "watch")

    def __init__(
        self,
        watch: Sequence[tuple[Any, int, int]],
        on_done: Callable[[PollJob], None],
        interval: float = 50e-6,
        max_interval: float = 1e-3,
    ) -> None:
        self.watch = tuple(watch)
        self.on_done = on_done
        self.cancelled = False
        self.interval = interval
        self.max_interval = max_interval
        self.result: Any = None

    def run(self, cu: Any) -> None:
        watch = self.watch
        interval = self.interval
        sleep = time.sleep
        while not self.cancelled:
            for mv, slot, seq in watch:
                if ((mv[slot] - seq) & _M32) < _HALF:
                    self.on_done(self)
                    return
            sleep(interval)
            interval = min(interval * 1.5, self.max_interval)


class _Worker:
    __slots__ = ("cond", "job", "pool", "stop", "thread")

    def __init__(self, pool: WaiterPool) -> None:
        self.pool = pool
        self.cond = threading.Condition(threading.Lock())
        self.job: EventJob | PollJob | None = None
        self.stop = False
        self.thread = threading.Thread(target=self._main, name="trio-cuda-waiter", daemon=True)
        self.thread.start()

    def give(self, job: EventJob | PollJob) -> None:
        with self.cond:
            self.job = job
            self.cond.notify()

    def _main(self) -> None:
        pool = self.pool
        try:
            pool.on_thread_start()
        except Exception:  # pragma: no cover - best effort
            pass
        while True:
            with self.cond:
                while self.job is None and not self.stop:
                    self.cond.wait()
                job = self.job
                self.job = None
                if self.stop and job is None:
                    return
            assert job is not None
            try:
                job.run(pool.cu)
            except BaseException:  # pragma: no cover - a waiter must never die silently
                job.result = None
                try:
                    job.on_done(job)  # type: ignore[arg-type]
                except BaseException:
                    pass
            with pool.lock:
                if pool.closed:
                    return
                pool.idle.append(self)


class WaiterPool:
    """A small pool of waiter threads for one backend context."""

    def __init__(self, cu: Any, on_thread_start: Callable[[], None], max_threads: int = 8) -> None:
        self.cu = cu
        self.on_thread_start = on_thread_start
        self.max_threads = max_threads
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.workers: list[_Worker] = []
        self.closed = False

    def dispatch(self, job: EventJob | PollJob) -> bool:
        """Hand ``job`` to an idle thread (starting one if allowed). False when
        every thread is busy: the caller polls from the loop instead."""
        with self.lock:
            if self.closed:
                return False
            worker = self.idle.pop() if self.idle else None
            if worker is None:
                if len(self.workers) >= self.max_threads:
                    return False
                worker = _Worker(self)
                self.workers.append(worker)
        worker.give(job)
        return True

    @property
    def busy(self) -> int:
        with self.lock:
            return len(self.workers) - len(self.idle)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            workers = list(self.workers)
            self.idle.clear()
        for w in workers:
            with w.cond:
                w.stop = True
                w.cond.notify()
