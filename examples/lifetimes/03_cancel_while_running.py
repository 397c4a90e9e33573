"""Rule 3, cancellation: a cancelled task moves on at once; its GPU work does not.

A task awaits ``gpu.run(axpy(x, y))`` under a deadline much shorter than the
kernel. When the deadline passes, ``Cancelled`` is raised at once -- the task
does not wait for the GPU -- but the kernel keeps running, so the scope keeps
its leases on x and y (and their memory) until the device has finished; then
the scope's handoff task retires it. An op that is cancelled *before* it is
submitted is really cancelled: nothing of it reaches the GPU.

    python examples/lifetimes/03_cancel_while_running.py [--device sim|cuda:N] [--out DIR]
"""

import sys

import numpy as np
import trio
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.2  # seconds per kernel
DEADLINE = 0.02


async def lesson(L: Lesson) -> None:
    async with trio_cuda.open_scope(L.device, trace=L.trace) as gpu:
        await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
        x = await gpu.to_device(np.arange(1024, dtype=np.float32))
        y = await gpu.to_device(np.zeros(1024, np.float32))
        L.say(f"x and y are on the device ({L.names(x=x, y=y)})")

        # 1. Cancelled before it is submitted: run() checks first, and submits nothing.
        submitted = gpu.statistics().submitted
        with trio.CancelScope() as cs:
            cs.cancel()
            await gpu.run(L.add(x, 1.0))
        L.say("a run() whose task was already cancelled raised Cancelled before submitting")
        L.check(gpu.statistics().submitted == submitted, "nothing was submitted, nothing enqueued")

        # 2. Cancelled while the kernel runs.
        L.say(f"a task awaits gpu.run(axpy(x, y)) under a {DEADLINE} s deadline")
        start = L.now()
        with trio.move_on_after(DEADLINE):
            await gpu.run(L.axpy(2.0, x, y))
        waited, st = L.now() - start, gpu.statistics()
        L.say(f"cancelled after {waited:.3f} s while the kernel was still running")
        L.check(waited < KERNEL_TIME / 2, "Cancelled came promptly: the task did not wait for the GPU")
        L.say(f"still in flight: {st.in_flight}; leases still held: {st.leases_held} (x read, y write)")
        L.check((st.in_flight, st.leases_held) == (1, 2), "the scope kept the submission and its leases")

        x.close()  # we are done with both arrays; the kernel is not
        y.close()
        L.say(f"closed x and y: allocations still live: {gpu.statistics().live_allocations}")
        L.check(gpu.statistics().live_allocations == 2, "closing them freed nothing: the kernel uses them")

        # 3. Nobody awaits the kernel any more: the handoff task retires it when the GPU is done.
        await L.until(lambda: gpu.statistics().live_allocations == 0)
        st = gpu.statistics()
        L.say(
            f"after the device finished: leases {st.leases_held}, memory freed ({st.live_allocations} live)"
        )
        L.check(L.now() - start >= KERNEL_TIME * 0.9, "the memory was freed only once the kernel had run")
        L.check(
            L.retired_by("axpy") == ["handoff"], "the handoff task retired it: nobody awaited it any more"
        )


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="the red diamond on the task's lane is the cancel; the axpy bar on stream 0 runs on, "
        "and the read and write lease bars of x and y end with it, where the allocations are freed (])",
    )


if __name__ == "__main__":
    sys.exit(main())
