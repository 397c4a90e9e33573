"""Tile kernels follow the same rules: their leases come from what they do to each array.

A tile kernel (cuTile, ``@ct.kernel``) has no parameter list saying what it
reads and writes: trio_cuda finds out from the kernel. ``double`` loads x (a
shared read lease) and stores y (an exclusive write lease); from there on it
is a kernel like any other. A SIMT kernel A writes x on stream 0; the tile
kernel B reads x and writes y on stream 1; a SIMT kernel C reads y on stream
2. Each conflict becomes a device-side wait, and the host never blocks. The
task awaiting C is cancelled while the work runs: it leaves at once, closes x
and y, and the scope keeps both until the work that uses them has retired
(rules 1, 2, 3 and 9). Arguments that overlap, one of them written, are
refused before anything is enqueued: a tile kernel is compiled for arrays
that do not alias.

    python examples/lifetimes/12_tile_kernels.py [--device sim|cuda:N] [--out DIR]
"""

import sys

import cuda.tile as ct
import numpy as np
import trio
from _lesson import KERNELS, Lesson, run_lesson

import trio_cuda

KERNEL_TIME = 0.15  # seconds per kernel
DEADLINE = 0.03
N, TILE = 1024, 256


@ct.kernel
def double(x, y, TILE: ct.Constant[int]):
    """``y = 2 * x``, one tile per block."""
    i = ct.bid(0)
    ct.store(y, index=(i,), tile=2 * ct.load(x, index=(i,), shape=(TILE,)))


DOUBLE = trio_cuda.Kernel.from_tile(double)


async def lesson(L: Lesson) -> None:
    # Kernels are compiled once per process (a tile kernel once per signature of its
    # arguments), and each scope loads them; the simulator's first run of a tile kernel
    # sets up its NumPy version of cuTile. All that is done here first, in a scope of
    # its own, untraced, so that the timeline shows only the work.
    async with trio_cuda.open_scope(L.device, trace=False) as gpu:
        await gpu.load(*KERNELS)
        x, y = gpu.zeros(N, np.float32), gpu.zeros(N, np.float32)
        await gpu.run(DOUBLE.launch(x, y, TILE, grid=N // TILE))
    L.say("the kernels are compiled (or read from the disk cache), and the tile kernel ran once")

    async with trio_cuda.open_scope(L.device, streams=3, trace=L.trace) as gpu:
        s0, s1, s2 = gpu.streams
        x = await gpu.to_device(np.ones(N, np.float32))
        y = await gpu.to_device(np.zeros(N, np.float32))
        z = await gpu.to_device(np.zeros(N, np.float32))
        b = DOUBLE.launch(x, y, TILE, grid=N // TILE)  # the tile kernel: y = 2x
        await gpu.load(*KERNELS, b)  # load them into this scope ahead, so that only the work takes time
        L.say(f"arrays on the device: {L.names(x=x, y=y, z=z)}")

        start = L.now()
        fa = gpu.submit(L.add(x, 1.0), stream=s0)  # A (SIMT) writes x: x += 1
        fb = gpu.submit(b, stream=s1)  # B (tile) reads x, writes y: y = 2x
        fc = gpu.submit(L.axpy(1.0, y, z), stream=s2)  # C (SIMT) reads y, writes z: z = y + z
        L.say(
            f"submitted A (SIMT, stream 0), B (tile, stream 1), C (SIMT, stream 2) in {L.now() - start:.4f} s"
        )
        L.check(L.now() - start < KERNEL_TIME / 4, "the host did not block")
        names = {x.ptr: "x", y.ptr: "y"}
        [sub] = [e for e in L.events("submit") if e.name == "double"]
        leases = ", ".join(f"{names[ptr]} {mode}" for ptr, _, _, mode in sub.args["leases"])
        L.say(f"B's leases, from the tile kernel's loads and stores: {leases}")
        L.check(leases == "x read, y write", "the tile kernel reads x and writes y: one lease each")
        waits = [(e.stream, e.args["on_stream"]) for e in L.events("wait")]
        L.say(f"device-side waits (stream, on stream): {waits}")
        L.check(waits == [(1, 0), (2, 1)], "B waits on the device for A (x), C for B (y)")

        # The task awaiting C is cancelled; x and y are closed while B and C still use them.
        with trio.move_on_after(DEADLINE):
            await fc.wait()
        L.say(f"the task awaiting C was cancelled after {L.now() - start:.3f} s")
        L.check(
            L.now() - start < KERNEL_TIME / 2, "Cancelled came promptly: the task did not wait for the GPU"
        )
        x.close()
        y.close()
        st = gpu.statistics()
        L.say(f"closed x and y: submissions in flight {st.in_flight}, allocations live {st.live_allocations}")
        L.check(st.live_allocations == 3, "closing x and y freed nothing: B and C still use them")

        await L.until(lambda: gpu.statistics().live_allocations == 1)
        L.check(
            fa.done() and fb.done() and fc.done(), "the scope retired A, B and C: nobody awaits them any more"
        )
        L.say(f"x and y freed after {L.now() - start:.3f} s, when the work had retired")
        L.check(L.now() - start >= 1.8 * KERNEL_TIME, "x and y were freed only after A, B and C had run")
        L.check(
            bool(np.all(await gpu.to_host(z) == 4.0)), "C read what B wrote from what A wrote: z = 2(1 + 1)"
        )

        # Overlapping arguments, one of them written: refused when the launch is made.
        submitted = gpu.statistics().submitted
        try:
            DOUBLE.launch(z[: N // 2], z[N // 4 : 3 * N // 4], TILE, grid=2)
        except trio_cuda.KernelArgumentError as exc:
            L.say(f"double(z[:512], z[256:768]): KernelArgumentError: {exc}")
        L.check(
            gpu.statistics().submitted == submitted, "the overlapping launch was refused: nothing submitted"
        )


def main(argv: list[str] | None = None) -> int:
    return run_lesson(
        lesson,
        argv,
        file=__file__,
        doc=__doc__,
        kernel_time=KERNEL_TIME,
        look_for="the add on stream 0, the double (tile) on stream 1 after a wait marker, the axpy on "
        "stream 2 after another; the red diamond on the task lane long before they end, and x's and y's "
        "lease bars and frees (]) only at the retirements",
    )


if __name__ == "__main__":
    sys.exit(main())
