"""Rule 11, leases cover byte ranges: disjoint chunks overlap, overlapping views take turns.

A lease covers the bytes a view can touch, not its whole allocation. One
buffer ``y`` is split into four chunks ``y[i*c:(i+1)*c]``, one kernel per chunk,
each on its own stream: four disjoint write leases, no conflict, so the four
kernels run at once. Two views that share even one element conflict exactly
as whole arrays do: the second waits, on the device, for the first -- and with
``conflicts="error"`` it is refused.

    python examples/lifetimes/11_disjoint_chunks.py [--device sim|cuda:N] [--out DIR]
"""

import sys

import numpy as np
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.1  # seconds per kernel
C = 1024  # elements per chunk


async def lesson(L: Lesson) -> None:
    async with trio_cuda.open_scope(L.device, streams=4, trace=L.trace) as gpu:
        await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
        y = await gpu.to_device(np.zeros(4 * C, np.float32))
        chunks = [y[i * C : (i + 1) * C] for i in range(4)]
        L.say(f"one buffer of 4 chunks ({L.names(y=y)}), chunk i = bytes [{4 * C}*i, {4 * C}*(i+1))")

        start = L.now()
        futures = [
            gpu.submit(L.add(chunk, i + 1), stream=s) for i, (chunk, s) in enumerate(zip(chunks, gpu.streams))
        ]
        for f in futures:
            await f.wait()
        took = L.now() - start
        L.say(f"add on each chunk, on streams 0-3: all four done after {took:.3f} s")
        L.check(L.events("wait") == [], "disjoint chunks never conflict: no cross-stream wait")
        L.check(took < 2 * KERNEL_TIME, f"they ran at once (4 kernels of {KERNEL_TIME} s in {took:.3f} s)")
        expected = np.repeat(np.arange(1, 5, dtype=np.float32), C)
        L.check(bool(np.array_equal(await gpu.to_host(y), expected)), "each chunk got its own value")

        # Overlapping views: y[0:C+1] and y[C:2C] share element C.
        start = L.now()
        a = gpu.submit(L.add(y[0 : C + 1], 10.0), stream=gpu.streams[0])
        b = gpu.submit(L.add(y[C : 2 * C], 10.0), stream=gpu.streams[1])
        await a.wait()
        await b.wait()
        took = L.now() - start
        L.say(f"y[0:{C + 1}] and y[{C}:{2 * C}] (sharing y[{C}]) on streams 0 and 1: done after {took:.3f} s")
        L.check(len(L.events("wait")) == 1, "the overlapping view waited, device-side, for the other")
        L.check(took >= 1.9 * KERNEL_TIME, "so the two kernels ran one after the other")

    async with trio_cuda.open_scope(L.device, streams=2, conflicts="error", trace=L.trace) as gpu:
        y = await gpu.to_device(np.zeros(2 * C, np.float32))
        first = gpu.submit(L.add(y[: C + 1], 1.0), stream=gpu.streams[0])
        gpu.submit(L.add(y[C + 1 :], 1.0), stream=gpu.streams[1])  # disjoint: accepted
        try:
            gpu.submit(L.add(y[C:], 1.0), stream=gpu.streams[1])  # overlaps at element C
        except trio_cuda.AccessConflictError:
            L.say(f'conflicts="error": y[{C + 1}:] was accepted beside y[:{C + 1}]; y[{C}:] was refused')
        else:
            L.check(False, "an overlapping view is refused under conflicts='error'")
        await first.wait()


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="four add bars stacked on streams 0-3 at the same time, and four write leases on one "
        "allocation side by side (hover them: each its own byte range); then two adds one after the other, "
        "with a cross-stream wait on stream 1",
    )


if __name__ == "__main__":
    sys.exit(main())
