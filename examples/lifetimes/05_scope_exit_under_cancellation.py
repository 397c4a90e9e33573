"""Rule 5, scope exit: the exit waits for the GPU, even when the body is cancelled.

A scope's body submits two kernels and is then cancelled by a deadline. The
exit does not free anything yet: it first waits -- shielded from the
cancellation, without blocking the loop -- until every submission of the scope
has completed, and only then frees the memory. ``drain_timeout=`` bounds that
wait: work still in flight when it passes is quarantined, with a
``ResourceWarning``, and its memory is deliberately leaked, never freed, since
the GPU may still write to it.

    python examples/lifetimes/05_scope_exit_under_cancellation.py [--device sim|cuda:N] [--out DIR]
"""

import math
import sys
import warnings

import numpy as np
import trio
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.2  # seconds per kernel
DEADLINE = 0.05


async def lesson(L: Lesson) -> None:
    with trio.CancelScope() as body:
        async with trio_cuda.open_scope(L.device, streams=2, trace=L.trace) as gpu:
            await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
            x = await gpu.to_device(np.zeros(1024, np.float32))
            y = await gpu.to_device(np.zeros(1024, np.float32))
            L.say(
                f"the body submits add(x) on stream 0, then awaits add(y) on stream 1 ({L.names(x=x, y=y)})"
            )
            start = L.now()
            body.deadline = trio.current_time() + DEADLINE  # from now on, the body has DEADLINE seconds
            gpu.submit(L.add(x, 1.0), stream=gpu.streams[0])
            await gpu.run(L.add(y, 1.0), stream=gpu.streams[1])  # cancelled by the deadline
    st = gpu.statistics()
    L.say(f"the body was cancelled after {DEADLINE:.3f} s; the exit returned after {L.now() - start:.3f} s")
    L.check(body.cancelled_caught, "the deadline cancelled the scope's body")
    L.check(L.now() - start >= 0.9 * KERNEL_TIME, "the exit waited, shielded, for both kernels")
    L.check((st.in_flight, st.live_allocations) == (0, 0), "then freed everything: nothing in flight or live")
    frees = [e.t for e in L.events("free")]
    last_retire = max((e.t for e in L.events("retire")), default=math.inf)
    L.check(min(frees, default=0.0) >= last_retire, "every free came after the last retirement")

    # drain_timeout: stop waiting, and leak (quarantine) what is still in flight.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with trio_cuda.open_scope(L.device, drain_timeout=DEADLINE, trace=L.trace) as gpu:
            z = await gpu.to_device(np.zeros(1024, np.float32))
            z_ptr = z.ptr
            start = L.now()
            gpu.submit(L.add(z, 1.0))
            L.say(f"a scope with drain_timeout={DEADLINE} submits add(z) and ends ({L.names(z=z)})")
    st = gpu.statistics()
    L.say(f"its exit gave up after {L.now() - start:.3f} s, with the kernel still running")
    for w in caught:
        L.say(f"{w.category.__name__}: {str(w.message)[:100]}...")
    L.check(any(issubclass(w.category, ResourceWarning) for w in caught), "the exit issued a ResourceWarning")
    L.check(st.quarantined == 1, "the unfinished submission was quarantined")
    L.check(st.live_allocations == 1, f"z's memory ({st.quarantined_bytes} bytes) was leaked, not freed")

    # Why leak it? Freed memory goes to the next allocation, and the GPU may still write to it.
    async with trio_cuda.open_scope(L.device, trace=L.trace) as gpu2:
        w = gpu2.zeros(1024, np.float32)
        L.say(f"a new scope allocates w of the same size while the kernel runs: {L.names(w=w)}")
        L.check(w.ptr != z_ptr, "w did not get z's memory: a leaked allocation is never handed out again")
        await trio.sleep(KERNEL_TIME)  # the kernel on z finishes meanwhile
    L.check(gpu.statistics().live_allocations == 1, "z is still leaked after its kernel ended: never freed")


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="scope #1: the red diamond (the deadline) on the task's lane; the scope's close marker and "
        "the frees (]) come only after both add bars end. Scope #2: the quarantine marker at the drain "
        "timeout, and z's allocation, hatched from there on, never freed. Scope #3 allocates elsewhere",
    )


if __name__ == "__main__":
    sys.exit(main())
