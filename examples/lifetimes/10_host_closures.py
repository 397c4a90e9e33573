"""Rule 10, completion handoff: who retires finished work, and where host closures run.

Work is retired -- its leases released, its memory freed -- by whoever first
*observes* its completion marker. An awaiting task whose work finishes while it
looks (a short fill) retires it itself: the waiter. An awaiting task whose work
runs long parks; the scope's handoff task sees the marker, retires the work
and wakes the task. The handoff also runs ``ops.host_closure(fn)``: the stream
waits at a gate, the handoff runs ``fn`` on the Trio loop's own thread (never
on a CUDA driver thread), then opens the gate.

    python examples/lifetimes/10_host_closures.py [--device sim|cuda:N] [--out DIR]
"""

import sys
import threading

import numpy as np
import trio
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda
from trio_cuda import ops

KERNEL_TIME = 0.1  # seconds per kernel
AWAIT_SPIN = 0.01  # the simulator's model of how long a waiter polls before parking


async def lesson(L: Lesson) -> None:
    async with trio_cuda.open_scope(L.device, trace=L.trace) as gpu:
        await gpu.load(*KERNELS)  # compile ahead, so that only the work takes time
        x = await gpu.to_device(np.zeros(1024, np.float32))
        L.say(f"x is on the device ({L.names(x=x)})")

        await trio.sleep(0.01)  # a quiet moment: the handoff task is done with the setup, asleep
        await gpu.run(ops.fill(x, 1.0))  # done on the GPU in microseconds: the waiter's own look sees it
        L.say(f"awaited a short fill: retired by the {L.retired_by('fill')[0]}")
        L.check(L.retired_by("fill") == ["waiter"], "the awaiting task observed and retired it itself")

        start = L.now()
        await gpu.run(L.add(x, 1.0))  # runs for KERNEL_TIME: the task parks
        who = L.retired_by("add")[0]
        L.say(f"awaited a {KERNEL_TIME} s kernel: retired by the {who} after {L.now() - start:.3f} s")
        L.check(
            L.retired_by("add") == ["handoff"], "the task parked; the handoff retired the kernel and woke it"
        )

        loop_thread = threading.get_ident()
        ran: list[tuple[float, bool]] = []  # when note() ran, and whether on the loop's thread

        def note(tag: str) -> str:  # a plain function: the handoff task calls it in stream order
            ran.append((L.now(), threading.get_ident() == loop_thread))
            return tag.upper()

        start = L.now()
        op = (
            L.add(x, 1.0)
            .then(lambda _: ops.host_closure(note, "between the kernels"))
            .then(lambda said: L.add(x, 1.0).map(lambda _: said))
        )
        said = await gpu.run(op)  # add, then note() at the gate, then add
        took, (t_note, on_loop_thread) = L.now() - start, ran[0]
        t_note -= start
        L.say(f"add, host closure, add: the closure ran at {t_note:.3f} s and returned {said!r}")
        L.check(t_note >= 0.9 * KERNEL_TIME, "the closure ran after the first kernel had finished")
        L.check(took - t_note >= 0.9 * KERNEL_TIME, "the second kernel ran only after the closure")
        L.check(on_loop_thread, "the closure ran on the Trio loop's thread")
        L.check(bool(np.all(await gpu.to_host(x) == 4.0)), "x = 1 + 1 + 1 + 1")
        st = gpu.statistics()
        L.say(
            f"retired by awaiting tasks: {st.retired_by_waiters} of {st.completed}; the rest by the handoff"
        )


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        sim_options={"await_spin": AWAIT_SPIN},
        look_for="hover the retire markers: 'by: waiter' for the fill, 'by: handoff' for the rest; on "
        "stream 0, the host closure is the thin orange mark between the second and the third add",
    )


if __name__ == "__main__":
    sys.exit(main())
