"""Rule 1, retention before enqueue: a submission owns what the GPU will touch.

``gpu.submit(axpy(x, y))`` returns at once. Before it put the kernel on a
stream, the submission took ownership of everything the kernel uses: a read
lease on x, a write lease on y, the loaded module, the packed arguments. So the
program can drop every handle of its own -- close x, forget the op and the
future -- and nothing the kernel needs goes away. Each is released only after
the kernel's completion has been observed.

    python examples/lifetimes/01_retention.py [--device sim|cuda:N] [--out DIR]
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
        x = await gpu.to_device(np.arange(1024, dtype=np.float32))
        y = gpu.zeros(1024, np.float32)
        L.say(f"x and y are on the device ({L.names(x=x, y=y)})")

        op = L.axpy(2.0, x, y)  # a lazy description: nothing is retained or enqueued yet
        start = L.now()
        fut = gpu.submit(op)  # retain first, then enqueue; returns at once
        st = fut.statistics()  # this submission's own state
        L.say(f"submit() returned: state {st.state}, leases {st.leases}, retained {st.retained_bytes} bytes")
        L.check(st.leases == 2, "the submission took its two leases (x read, y write) before returning")
        L.check(st.retained_bytes == x.nbytes + y.nbytes, "it retains the memory of x and y")

        # Drop everything we hold that the kernel uses: x's handle, the op (with its packed
        # arguments), the future. The submission holds its own references to all of it.
        x.close()
        del op, fut
        gc.collect()
        L.say(
            f"closed x, dropped the op and the future: allocations live: {gpu.statistics().live_allocations}"
        )
        L.check(gpu.statistics().live_allocations == 2, "x's memory stays: the submission owns it")

        # Nobody awaits the kernel: the handoff task retires it once the GPU is done.
        await L.until(lambda: gpu.statistics().in_flight == 0 and gpu.statistics().live_allocations == 1)
        st = gpu.statistics()
        L.say(f"the kernel completed and was retired: leases {st.leases_held}, x freed, y still ours")
        L.check(L.now() - start >= 0.9 * KERNEL_TIME, "x was freed only after the kernel had run")
        got = await gpu.to_host(y)
        L.check(
            bool(np.array_equal(got, 2 * np.arange(1024, dtype=np.float32))), "y = 2 * x: it read x intact"
        )
        y.close()


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="the read (x) and write (y) lease bars begin at the submit, with the axpy bar on stream "
        "0, and end at its retirement; x's allocation is freed (]) right there, long after x.close()",
    )


if __name__ == "__main__":
    sys.exit(main())
