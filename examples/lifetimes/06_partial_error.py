"""Rule 6, partial errors: what was enqueued before a failure stays retained.

An op can be a chain: ``axpy(x, y).then(next_step)``. Submitting it enqueues
the axpy, then calls ``next_step`` to build the rest. Here ``next_step`` raises.
The error reaches the caller at once, but the axpy is already on the stream:
the scope puts a completion marker behind it and keeps it retained -- its
leases on x and y, their memory -- until the GPU has run it. Nothing it uses is
freed early, even if the caller closes x right away.

    python examples/lifetimes/06_partial_error.py [--device sim|cuda:N] [--out DIR]
"""

import sys

import numpy as np
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.1  # seconds per kernel
N = 1024


def next_step(y: trio_cuda.DeviceArray) -> trio_cuda.DeviceOp[object]:
    raise ValueError("next_step failed while building the rest of the op")


async def lesson(L: Lesson) -> None:
    async with trio_cuda.open_scope(L.device, trace=L.trace) as gpu:
        await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
        x = await gpu.to_device(np.arange(N, dtype=np.float32))
        y = await gpu.to_device(np.zeros(N, np.float32))
        L.say(f"x and y are on the device ({L.names(x=x, y=y)})")

        start = L.now()
        try:
            gpu.submit(L.axpy(2.0, x, y).then(next_step))
        except ValueError as exc:
            L.say(f"submit raised at once, after {L.now() - start:.4f} s: ValueError: {exc}")
        st = gpu.statistics()
        L.check(L.now() - start < KERNEL_TIME / 2, "the error reached the caller without waiting for the GPU")
        L.say(f"yet the axpy was enqueued first: in flight {st.in_flight}, leases {st.leases_held}")
        L.check((st.in_flight, st.leases_held) == (1, 2), "the enqueued part keeps its leases on x and y")

        x.close()  # the caller gives up on x; the axpy on the stream has not
        L.say(f"closed x: allocations still live: {gpu.statistics().live_allocations}")
        L.check(gpu.statistics().live_allocations == 2, "x's memory stays while the axpy may read it")

        await L.until(lambda: gpu.statistics().live_allocations == 1)
        L.say("the GPU finished the axpy; the handoff retired it, released x and y, and freed x")
        L.check(L.retired_by("axpy") == ["handoff"], "the handoff task retired the orphaned part")
        got = await gpu.to_host(y)
        L.check(bool(np.array_equal(got, 2 * np.arange(N, dtype=np.float32))), "the axpy ran: y = 2 * x")
        L.check(
            gpu.statistics().pending_errors == 0, "the error was the caller's: nothing is left for the exit"
        )


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="the axpy bar on stream 0 starts at the failed submission and runs its full length; "
        "the read lease on x and its allocation end only with it, long after x.close()",
    )


if __name__ == "__main__":
    sys.exit(main())
