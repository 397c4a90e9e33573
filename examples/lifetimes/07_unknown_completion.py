"""Rule 7, unknown completion: when nobody can tell if the GPU is done, leak, never free.

Sometimes the host cannot learn whether work completed: a sticky driver error,
a lost context. Then the scope cannot know whether the GPU still writes to that
work's memory, so it quarantines the submission: its leases and memory are
deliberately leaked, never freed (freeing would hand the memory to the next
allocation while the GPU might still write to it). Later work that touches a
quarantined array fails with ``CompletionUnknownError`` before anything is
enqueued; other work goes on. ``statistics().quarantined`` counts them.

The simulator produces this with ``sim.inject_fault("completion_unknown")``,
so this lesson runs on the simulator only.

    python examples/lifetimes/07_unknown_completion.py [--out DIR]
"""

import sys

import numpy as np
from _lesson import Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.05  # seconds per kernel
N = 1024


async def lesson(L: Lesson) -> None:
    assert L.sim is not None  # run_lesson(sim_only=...) made sure of it
    async with trio_cuda.open_scope(L.sim, streams=2, trace=L.trace) as gpu:
        x = await gpu.to_device(np.arange(N, dtype=np.float32))
        y = await gpu.to_device(np.zeros(N, np.float32))
        L.say(f"x and y are on the device ({L.names(x=x, y=y)})")

        L.sim.inject_fault("completion_unknown")  # the next kernel's completion can never be established
        try:
            await gpu.run(L.axpy(2.0, x, y))
        except trio_cuda.CompletionUnknownError as exc:
            L.say(f"run(axpy(x, y)) raised CompletionUnknownError: ...{str(exc).partition(': ')[2]}")
        st = gpu.statistics()
        L.say(f"quarantined: {st.quarantined} submission, {st.quarantined_leases} leases (x read, y write)")
        L.check(
            (st.quarantined, st.quarantined_leases) == (1, 2),
            "the submission and its leases were quarantined",
        )
        L.check(x.quarantined and y.quarantined, "x and y are marked quarantined")

        submitted = gpu.statistics().submitted
        try:
            gpu.submit(L.add(y, 1.0))
        except trio_cuda.CompletionUnknownError as exc:
            L.say(f"submit(add(y)) raised CompletionUnknownError: {exc}")
        L.check(gpu.statistics().submitted == submitted, "work on y fails before anything is enqueued")

        z = await gpu.to_device(np.zeros(N, np.float32), stream=gpu.streams[1])
        await gpu.run(L.add(z, 1.0), stream=gpu.streams[1])
        L.say(f"other work goes on: add(z) ran on stream 1 ({L.names(z=z)})")
        L.check(bool(np.all(await gpu.to_host(z) == 1.0)), "z = 1")
        leaked = {x.ptr, y.ptr}
        x.close()
        y.close()
    live = {a.ptr for a in L.sim.live_allocations}
    L.say(
        f"after the scope's exit, allocations still on the device: {', '.join(hex(p) for p in sorted(live))}"
    )
    L.check(live == leaked, "x and y are leaked for good; z was freed")


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        sim_only="it injects a fault with sim.inject_fault",
        look_for="the magenta quarantine diamonds on the axpy and on x and y; from there on their "
        "allocations are hatched (leaked, never freed) to the end, while z's is freed (])",
    )


if __name__ == "__main__":
    sys.exit(main())
