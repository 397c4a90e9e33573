"""Rule 9, freeing: closing an array the GPU still uses defers the free.

Three ways to be done with an array -- ``arr.close()``, ``async with arr:`` and
letting it be garbage collected -- while a kernel that uses it is still
running. Each handle is closed at once, but no memory is freed while a lease
on it is in flight: the free happens when the last use has retired.

    python examples/lifetimes/09_close_an_array_in_use.py [--device sim|cuda:N] [--out DIR]
"""

import gc
import sys

import numpy as np
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.1  # seconds per kernel
N = 1024


async def lesson(L: Lesson) -> None:
    async with trio_cuda.open_scope(L.device, streams=3, trace=L.trace) as gpu:
        a, b, c = gpu.streams
        await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
        x = await gpu.to_device(np.zeros(N, np.float32), stream=a)
        y = await gpu.to_device(np.zeros(N, np.float32), stream=b)
        z = await gpu.to_device(np.zeros(N, np.float32), stream=c)
        L.say(f"three arrays: {L.names(x=x, y=y, z=z)}")

        start = L.now()
        gpu.submit(L.add(x, 1.0), stream=a)
        x.close()  # 1. close() while the kernel runs
        L.say(f"add(x) submitted, then x.close(): x.closed = {x.closed}")

        async with y:  # 2. the array as a context manager: closed when the block ends
            gpu.submit(L.add(y, 1.0), stream=b)
        L.say(f"add(y) submitted inside 'async with y': y.closed = {y.closed}")

        gpu.submit(L.add(z, 1.0), stream=c)
        del z  # 3. the last reference dropped: garbage collection closes it
        gc.collect()
        L.say("add(z) submitted, then the last reference to z dropped and collected")

        live = gpu.statistics().live_allocations
        L.say(f"allocations live while the kernels run: {live}")
        L.check(live == 3, "no memory was freed: every kernel still uses its array")

        await L.until(lambda: gpu.statistics().live_allocations == 0)
        L.say(f"all three freed after {L.now() - start:.3f} s, when the kernels had retired")
        # From the trace: when each add was submitted (by the array it leases), when each array was freed.
        submitted = {e.args["leases"][0][0]: e.t for e in L.events("submit") if e.name == "add"}
        freed = {e.allocation: e.t for e in L.events("free")}
        waited = [freed[ptr] - t for ptr, t in submitted.items()]
        L.check(min(waited) >= 0.9 * KERNEL_TIME, "each array was freed only after its kernel had run")


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="three add bars, one per stream; each array's write lease and 'alive' bar end together, "
        "with the free mark (]) at the kernel's retirement, not at the close",
    )


if __name__ == "__main__":
    sys.exit(main())
