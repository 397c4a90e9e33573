"""Rule 2, leases: conflicting work on two streams is ordered on the device, or refused.

Each array argument takes a lease: ``In`` a shared read, ``Out``/``InOut`` an
exclusive write. Kernel A writes y on stream 0; kernel B reads y on stream 1.
With the default ``conflicts="order"`` the read-after-write becomes a wait *on
the device*: submitting B returns at once, and stream 1 starts B only when A is
done. Two reads never conflict: they run side by side. With
``conflicts="error"`` the same conflict raises ``AccessConflictError`` at
submission, and nothing of B is enqueued or retained.

    python examples/lifetimes/02_leases.py [--device sim|cuda:N] [--out DIR]
"""

import sys

import numpy as np
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.1  # seconds per kernel
N = 1024


async def lesson(L: Lesson) -> None:
    async with trio_cuda.open_scope(L.device, streams=2, trace=L.trace) as gpu:
        s0, s1 = gpu.streams
        await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
        x = await gpu.to_device(np.ones(N, np.float32))
        y = gpu.zeros(N, np.float32, stream=s0)
        p, q = gpu.zeros(N, np.float32, stream=s1), gpu.zeros(N, np.float32, stream=s1)
        L.say(f"arrays on the device: {L.names(x=x, y=y)}")

        # Read after write, across streams: ordered by a device-side wait.
        start = L.now()
        fa = gpu.submit(L.axpy(1.0, x, y), stream=s0)  # A: y = x + y   (writes y)
        fb = gpu.submit(L.axpy(1.0, y, p), stream=s1)  # B: p = y + p   (reads y)
        L.say(f"submitted A (writes y, stream 0) and B (reads y, stream 1) in {L.now() - start:.4f} s")
        L.check(L.now() - start < KERNEL_TIME / 4, "the host did not block")
        L.check(len(L.events("wait")) == 1, "B got one device-side wait, on A's completion marker")
        await fa.wait()
        t_a = L.now() - start
        await fb.wait()
        t_b = L.now() - start
        L.say(f"A finished after {t_a:.3f} s, B after {t_b:.3f} s: stream 1 waited for A")
        L.check(t_b >= 1.9 * KERNEL_TIME, "B ran after A, not beside it")
        L.check(bool(np.all(await gpu.to_host(p) == 1.0)), "B read what A wrote (p = 1)")

        # Read and read: shared leases, no wait, the two kernels run at once.
        waits, start = len(L.events("wait")), L.now()
        fc = gpu.submit(L.axpy(1.0, y, p), stream=s0)  # C reads y
        fd = gpu.submit(L.axpy(1.0, y, q), stream=s1)  # D reads y
        await fc.wait()
        await fd.wait()
        L.say(f"C and D both read y, on streams 0 and 1: both done after {L.now() - start:.3f} s")
        L.check(len(L.events("wait")) == waits, "reads never conflict with reads: no wait")
        L.check(L.now() - start < 1.6 * KERNEL_TIME, "C and D ran side by side")

    # conflicts="error": the same conflict is refused, at submission.
    async with trio_cuda.open_scope(L.device, streams=2, conflicts="error", trace=L.trace) as gpu:
        s0, s1 = gpu.streams
        y, z = gpu.zeros(N, np.float32, stream=s0), gpu.zeros(N, np.float32, stream=s1)
        fa = gpu.submit(L.add(y, 1.0), stream=s0)  # A writes y
        before = gpu.statistics()
        try:
            gpu.submit(L.axpy(1.0, y, z), stream=s1)  # B reads y: refused
        except trio_cuda.AccessConflictError as exc:
            L.say(f'conflicts="error": AccessConflictError: {exc}')
        after = gpu.statistics()
        L.check(after.submitted == before.submitted, "B raised AccessConflictError: nothing submitted")
        L.check(after.leases_held == before.leases_held, "and nothing retained: no lease taken")
        await fa.wait()


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="scope #1: the wait marker on stream 1, and B's axpy bar starting only where A's ends; "
        "then C and D side by side, with two read lease bars on y at once. "
        "Scope #2: one add on stream 0, and nothing on stream 1",
    )


if __name__ == "__main__":
    sys.exit(main())
