"""Make the trace pictures the docs embed: run small programs on the simulator
with a lifetime trace, render each trace's timeline page, and screenshot it
in headless Chromium.

    python3 docs/make_pictures.py        # writes docs/_static/traces/*.png
                                         # and docs/_static/lessons/*.png

Each picture is the whole page and nothing more: ``WIDTH`` CSS pixels wide,
as tall as the drawn page (measured in a first pass), at ``PIXEL_RATIO`` device
pixels per CSS pixel, so that the text stays sharp when the docs scale it
down or a reader opens it full size.

Needs a ``chromium`` binary on PATH. The pictures are committed; run this
again when the trace page or the programs change.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np
import trio

import trio_cuda
from trio_cuda import In, InOut, Kernel, Scalar
from trio_cuda.testing import SimDevice

DOCS = Path(__file__).resolve().parent
OUT = DOCS / "_static" / "traces"
LESSONS_OUT = DOCS / "_static" / "lessons"
LESSONS = DOCS.parent / "examples" / "lifetimes"
#: the page's width in CSS pixels, and device pixels per CSS pixel
WIDTH, PIXEL_RATIO = 1000, 2
#: once the page is drawn, its height goes to an attribute (read by --dump-dom)
MEASURE = """<script>
window.addEventListener("load", function () {
  var bottom = document.body.getBoundingClientRect().bottom + window.scrollY;
  document.body.setAttribute("data-page-height", String(Math.ceil(bottom)));
});
</script>
</body>"""
SRC = r"""
extern "C" __global__ void scale(float* x, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] *= 2.0f;
}
"""


def _scale_ref(x: np.ndarray, n: np.int32) -> None:  # what ``scale`` does, on the CPU
    x[:n] *= 2


SCALE = Kernel.from_source(SRC, "scale", params=[InOut("f4"), Scalar("i4")], reference=_scale_ref)
READ = Kernel.from_source(
    'extern "C" __global__ void read(const float* x, int n) {}',
    "read",
    params=[In("f4"), Scalar("i4")],
    reference=lambda x, n: None,
)


def scale(x: trio_cuda.DeviceArray) -> trio_cuda.KernelLaunch:
    return SCALE.launch(x, np.int32(x.size), grid=1, block=64)


async def cancel_while_running(trace: trio_cuda.trace.Trace | Literal[False]) -> None:
    """A task is cancelled while its kernel runs: it leaves at once, the
    leases stay held, and the handoff retires the work when it finished."""
    sim = SimDevice(kernel_time=0.02)
    async with trio_cuda.open_scope(device=sim, streams=2, trace=trace) as gpu:
        x = await gpu.to_device(np.ones(1024, np.float32))
        with trio.move_on_after(0.005):
            await gpu.run(scale(x))
        await gpu.run(READ.launch(x, np.int32(x.size), grid=1, block=64), stream=gpu.streams[1])


async def disjoint_chunks(trace: trio_cuda.trace.Trace | Literal[False]) -> None:
    """Four chunks of one buffer on four streams overlap; a fifth kernel over
    the whole buffer waits for all of them."""
    sim = SimDevice(kernel_time=0.01, copy_time=0.002)
    async with trio_cuda.open_scope(device=sim, streams=4, trace=trace) as gpu:
        y = gpu.zeros(4096, np.float32)
        futs = [gpu.submit(scale(y[i * 1024 : (i + 1) * 1024])) for i in range(4)]
        for f in futs:
            await f.wait()
        await gpu.run(scale(y))
        await gpu.to_host(y)


PROGRAMS = {"cancel_while_running": cancel_while_running, "disjoint_chunks": disjoint_chunks}


def _chromium(chromium: str, page: Path, *args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=3000",
                *args,
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout


def page_height(page: Path, chromium: str) -> int:
    """The height of ``page`` drawn ``WIDTH`` CSS pixels wide."""
    measured = page.with_name(page.stem + ".measure.html")
    measured.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE, 1), encoding="utf-8")
    dom = _chromium(chromium, measured, f"--window-size={WIDTH},200", "--dump-dom")
    found = re.search(r'data-page-height="(\d+)"', dom)
    if found is None:
        raise RuntimeError(f"{page.name}: the page did not report its height")
    return int(found.group(1))


def screenshot(page: Path, png: Path, chromium: str) -> None:
    """``page``, whole and cropped to it, as ``png``."""
    height = page_height(page, chromium)
    _chromium(
        chromium,
        page,
        f"--window-size={WIDTH},{height}",
        f"--force-device-scale-factor={PIXEL_RATIO}",
        f"--screenshot={png}",
    )


def main() -> int:
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if chromium is None:
        print("no chromium binary on PATH", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, program in PROGRAMS.items():
            trio.run(program, False)  # once untraced: one-time costs (compiling kernels) stay out
            trace = trio_cuda.trace.Trace()
            trio.run(program, trace)
            page = Path(tmp) / f"{name}.html"
            trace.write(page)
            screenshot(page, OUT / f"{name}.png", chromium)
            print(f"{OUT / (name + '.png')}: {len(trace.events)} events")
        # the lessons of the lifetimes chapter, each run on the simulator
        LESSONS_OUT.mkdir(parents=True, exist_ok=True)
        for lesson in sorted(LESSONS.glob("[0-9][0-9]_*.py")):
            page = Path(tmp) / f"{lesson.stem}.html"
            subprocess.run(
                [sys.executable, str(lesson), "--device", "sim", "--trace", str(page)],
                check=True,
                capture_output=True,
                timeout=300,
            )
            screenshot(page, LESSONS_OUT / f"{lesson.stem}.png", chromium)
            print(f"{LESSONS_OUT / (lesson.stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
