"""Rule 8, graphs: a captured graph keeps what it captured, until closed and idle.

``graph = await gpu.capture(op)`` records the work of ``op`` without running it.
The graph owns what it captured: its own handle on every array, the kernels,
their arguments. Each replay, ``graph.launch()``, is an ordinary submission
that takes the leases again. Closing the user's arrays frees nothing the graph
still replays on; ``graph.close()`` while replays are in flight only marks the
graph closed. Its memory is freed once it is closed *and* its last replay has
completed.

    python examples/lifetimes/08_graphs.py [--device sim|cuda:N] [--out DIR]
"""

import sys

import numpy as np
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.05  # seconds per kernel
N = 1024


async def lesson(L: Lesson) -> None:
    async with trio_cuda.open_scope(L.device, trace=L.trace) as gpu:
        await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
        x = await gpu.to_device(np.arange(N, dtype=np.float32))
        y = await gpu.to_device(np.zeros(N, np.float32))
        L.say(f"x and y are on the device ({L.names(x=x, y=y)})")

        # Capture y = x + y; y += 1 -- two kernels, recorded, not run.
        graph = await gpu.capture(L.axpy(1.0, x, y).then(lambda y: L.add(y, 1.0)))
        st = graph.statistics()
        L.say(f"captured {st.kernels} kernels; the graph retains {st.retained_allocations} allocations")
        L.check(bool(np.all(await gpu.to_host(y) == 0.0)), "capturing ran nothing: y is still 0")

        x.close()  # our handle on x is gone; the graph holds its own
        L.say(f"closed x: allocations live: {gpu.statistics().live_allocations}")
        L.check(gpu.statistics().live_allocations == 2, "x's memory stays: the graph will replay on it")

        start = L.now()
        first = gpu.submit(graph.launch(), stream=gpu.streams[0])  # each replay takes the leases again,
        second = gpu.submit(graph.launch(), stream=gpu.streams[1])  # so this one waits for the first
        graph.close()  # two replays in flight: this only marks the graph closed
        st = graph.statistics()
        L.say(f"submitted two replays and closed the graph: {st.in_flight} replays in flight")
        L.check(st.closed and not st.destroyed, "the graph is closed but kept while replays run")
        L.check(gpu.statistics().leases_held == 4, "each replay holds its own leases on x and y")
        L.check(
            len(L.events("wait")) == 1, "the replay on stream 1 waits device-side for the one on stream 0"
        )

        await first.wait()
        await second.wait()
        L.say(f"both replays finished after {L.now() - start:.3f} s")
        await L.until(lambda: gpu.statistics().live_allocations == 1)
        L.say("the last replay retired: the graph was destroyed and x freed; y is still ours")
        L.check(graph.statistics().destroyed, "the graph was destroyed after its last replay")
        got = await gpu.to_host(y)
        L.check(bool(np.array_equal(got, 2 * np.arange(N) + 2)), "each replay ran both kernels: y = 2x + 2")


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="nothing runs at the capture; the two replays are submitted on streams 0 and 1 (the page "
        "draws no kernel bars for graph replays), the second with a cross-stream wait on the first; each "
        "holds its own read lease on x and write lease on y, and x is freed (]) only after the second "
        "replay, long after x.close() and graph.close()",
    )


if __name__ == "__main__":
    sys.exit(main())
