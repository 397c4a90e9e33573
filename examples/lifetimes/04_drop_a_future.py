"""Rule 4, dropped futures: work nobody awaits still runs, and its error is not lost.

``gpu.submit(op)`` returns a ``DeviceFuture``. Dropping it -- never awaiting it,
letting it be garbage collected -- cancels nothing: the submission keeps its
leases and memory until the GPU has finished, and the handoff task retires it.
If that work fails, the error is kept, and the scope's exit raises it in an
``ExceptionGroup``, the way a nursery reports the errors of its tasks.

The second part makes a kernel fail with ``sim.inject_fault("kernel_fault")``,
so it runs on the simulator only (on a GPU it is skipped: real kernel faults
break the whole context).

    python examples/lifetimes/04_drop_a_future.py [--device sim|cuda:N] [--out DIR]
"""

import gc
import sys

import numpy as np
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.1  # seconds per kernel


async def lesson(L: Lesson) -> None:
    async with trio_cuda.open_scope(L.device, trace=L.trace) as gpu:
        await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
        y = await gpu.to_device(np.zeros(1024, np.float32))
        L.say(f"y is on the device ({L.names(y=y)})")

        fut = gpu.submit(L.add(y, 1.0))
        del fut  # dropped: nobody will ever await this kernel
        gc.collect()
        st = gpu.statistics()
        L.say(
            f"submitted add(y, 1.0) and dropped its future: in flight {st.in_flight}, leases {st.leases_held}"
        )
        L.check(L.events("drop") != [], "the trace recorded the dropped future")
        L.check((st.in_flight, st.leases_held) == (1, 1), "the submission and its lease on y stay")

        await L.until(lambda: gpu.statistics().in_flight == 0)
        L.say("the GPU finished it; the handoff task retired it")
        L.check(L.retired_by("add") == ["handoff"], "retired by the handoff task, nobody else was looking")
        L.check(bool(np.all(await gpu.to_host(y) == 1.0)), "the dropped work really ran: y = 1")

    if L.sim is None:
        L.say("(part 2, a forgotten error, needs the simulator's fault injection: skipped on a GPU)")
        return
    # Part 2: a forgotten future whose kernel fails. The error waits for the scope's exit.
    try:
        async with trio_cuda.open_scope(L.device, trace=L.trace) as gpu:
            z = gpu.zeros(1024, np.float32)
            L.sim.inject_fault("kernel_fault")  # the next kernel fails on the device
            gpu.submit(L.add(z, 1.0))  # its future is dropped at once
            L.say("submitted a kernel that will fail, and dropped its future; the scope body ends")
    except* trio_cuda.LaunchError as group:
        L.say(f"the scope's exit raised {group!r}")
        L.check(
            len(group.exceptions) == 1, "the forgotten error surfaced at scope exit, in an ExceptionGroup"
        )
    else:
        L.check(False, "the forgotten error surfaced at scope exit")
    L.check(L.sim.live_allocations == [], "and its memory was freed once the failed work retired")


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="the orange diamond (future dropped) at the start of the add bar; y's write lease bar "
        "still runs to the end of the kernel. In scope #2, the dark cross marks the device error, "
        "kept until the scope's exit",
    )


if __name__ == "__main__":
    sys.exit(main())
