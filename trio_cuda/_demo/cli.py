"""The command line of the batch job: ``python -m trio_cuda demo`` and
``examples/batch_job.py``.

Invariants: every option is checked by the same rule as its ``BatchConfig``
field, so a bad value is an argparse error (exit status 2) before anything
runs; a CUDA device that is asked for and not there is one error line and
exit status 2; the first Ctrl-C cancels the batch like the deadline (its
checks still run; exit status 130), a second one interrupts at once. The job
itself is ``batch``'s, the Ray mode ``ray``'s (its options are defined there,
and this module turns the arguments into the ``BatchConfig`` it is given).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import attrs
import trio

from .. import trace
from .batch import (
    PROGRESS_MODES,
    BatchConfig,
    BatchReport,
    DeviceUnavailableError,
    _Check,
    check_device,
    run_batch,
)
from .output import to_devnull
from .ray import add_options, maybe_run_on_ray  # neither imports Ray

__all__ = ["TRACE_LIMIT", "build_parser", "config_from_args", "main", "run_from_args", "trace_file"]


def _option(field: str) -> Callable[[str], Any]:
    """The argparse ``type`` of ``BatchConfig.field``'s option."""
    check = attrs.fields_dict(BatchConfig)[field].validator
    assert isinstance(check, _Check)
    return check.parse


TRACE_SUFFIXES = (".json", ".html", ".htm")

#: events ``demo --trace`` keeps (the oldest are dropped first). A default run
#: records about a thousand; each kept event costs about 0.5 KB, and a page of
#: 100,000 renders in seconds (14 MiB) where a million takes some 500 MiB to
#: keep, GBs to export and makes a page too large to browse.
TRACE_LIMIT = 100_000


def trace_file(text: str) -> str:
    """The argparse ``type`` of a trace's file (``demo --trace``, ``trace -o``):
    a name ending in .html, .htm or .json in any case (as ``Trace.write``
    takes), not a folder, in an existing folder that can be written, and not
    a read-only file; checked before anything runs."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file name, not a folder, got {text!r}")
    if not text.lower().endswith(TRACE_SUFFIXES):
        raise argparse.ArgumentTypeError(f"expected a file name ending in .html or .json, got {text!r}")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        why = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise argparse.ArgumentTypeError(
            f"expected a file in an existing folder, got {text!r} ({folder} {why})"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"expected a file in a folder it can write to, got {text!r}")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"expected a file it can write, got {text!r} (read-only)")
    return text


EPILOG = """\
progress: a bar on stderr when stderr is a terminal, else a plain line every
eighth of the inputs (--progress picks, --quiet turns it off). -v adds a line
per input (its stream, the time of each step, the scope's in-flight work and
leases), every cancellation, the device and per-stream counts, and the
trio_cuda logger at INFO; -vv adds every step of every input and DEBUG.

exit status: 0 every check passed; 1 a check failed (a result differed from
the reference, an input failed, or something leaked); 2 the job could not run
(a bad option, or the device asked for is not there); 130 interrupted.
"""


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the batch job's options to ``parser`` (or a new one)."""
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="batch_job",
            description="Run a cancellation-safe GPU batch job and check that nothing leaked.",
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    else:
        parser.epilog = EPILOG
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    d = BatchConfig()
    parser.add_argument(
        "--inputs", type=_option("inputs"), default=d.inputs, help=f"input vectors (default {d.inputs})"
    )
    parser.add_argument(
        "--size",
        type=_option("size"),
        default=d.size,
        help=f"elements per vector (default {d.size})",
    )
    parser.add_argument(
        "--concurrency",
        type=_option("concurrency"),
        default=d.concurrency,
        help=f"inputs in flight at once (default {d.concurrency})",
    )
    parser.add_argument(
        "--deadline",
        type=_option("deadline"),
        default=d.deadline,
        help=f"seconds before the rest of the batch is cancelled, or 'none' (default {d.deadline})",
    )
    parser.add_argument(
        "--kernel-ms",
        type=_option("kernel_ms"),
        default=d.kernel_ms,
        help=f"time each kernel launch takes, simulated or spun on the GPU (default {d.kernel_ms:g})",
    )
    parser.add_argument(
        "--device",
        type=_option("device"),
        default=d.device,
        help="'auto' (default), 'sim', 'cuda' or 'cuda:N'",
    )
    parser.add_argument(
        "--streams",
        type=_option("streams"),
        default=d.streams,
        help=f"streams (default {d.streams})",
    )
    parser.add_argument("--seed", type=_option("seed"), default=d.seed, help="random seed of the inputs")
    parser.add_argument(
        "--progress",
        choices=("auto", *PROGRESS_MODES),
        default="auto",
        help="'bar' (on stderr: tqdm's where tqdm is installed, else a built-in one), 'lines' "
        "(plain lines), 'none'; 'auto' (default): a bar when stderr is a terminal, else lines",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress (same as --progress none)")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: a line per input and cancellation, the device, trio_cuda's log (INFO); "
        "-vv: every step too (DEBUG)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        type=trace_file,
        help="record the run's lifetime trace and write it to FILE (.html: a timeline page; "
        f".json: Chrome trace-event JSON for ui.perfetto.dev); the last {TRACE_LIMIT:,} events are kept",
    )
    add_options(parser)  # Ray itself is imported only when --ray is given
    parser.set_defaults(demo_prog=parser.prog)
    return parser


def _is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):  # a closed or unusual stream
        return False


def config_from_args(args: argparse.Namespace) -> BatchConfig:
    mode = getattr(args, "progress", "auto")
    if args.quiet:
        mode = "none"
    elif mode == "auto":
        mode = "bar" if _is_terminal(sys.stderr) else "lines"
    return BatchConfig(
        inputs=args.inputs,
        size=args.size,
        concurrency=args.concurrency,
        deadline=args.deadline,
        kernel_ms=args.kernel_ms,
        device=args.device,
        streams=args.streams,
        seed=args.seed,
        progress=mode,
        verbose=int(args.verbose),
    )


async def _run_interruptible(config: BatchConfig) -> BatchReport:
    """``run_batch``, where the first Ctrl-C cancels the rest of the batch as
    the deadline does (the scope still retires what is in flight, and the
    checks still run); a second Ctrl-C interrupts at once."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is signal.SIG_IGN:
        return await run_batch(config)
    stop = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def on_sigint(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, previous)
        token.run_sync_soon(stop.set)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        return await run_batch(config, stop=stop)
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, previous)


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(KeyboardInterrupt) is not None
    return isinstance(exc, KeyboardInterrupt)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the job for parsed arguments; the exit status (see ``EPILOG``)."""
    config = config_from_args(args)
    if (ray_status := maybe_run_on_ray(args, config)) is not None:
        return ray_status
    prog = getattr(args, "demo_prog", "batch_job")
    try:
        check_device(config.device)
    except DeviceUnavailableError as exc:
        print(f"{prog}: error: --device {config.device}: {exc}", file=sys.stderr)
        return 2
    path: str | None = getattr(args, "trace", None)
    recording = trace.enable(limit=TRACE_LIMIT) if path is not None else None
    status = 0
    try:
        report = trio.run(_run_interruptible, config)
        status = 130 if report.interrupted else 0 if report.ok else 1
    except DeviceUnavailableError as exc:  # it went away since the check
        print(f"{prog}: error: --device {config.device}: {exc}", file=sys.stderr)
        status = 2
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        status = 130
    finally:
        if recording is not None and path is not None:
            trace.disable()
            try:
                recording.write(path)
            except OSError as exc:
                print(f"{prog}: error: --trace: could not write {path!r}: {exc}", file=sys.stderr)
                status = status or 1
            else:
                try:
                    print(
                        f"trace: {len(recording.events)} events ({recording.dropped} dropped) "
                        f"written to {path}",
                        flush=True,
                    )
                except BrokenPipeError:  # the reader of stdout went away
                    to_devnull(sys.stdout)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """``batch_job [options]``: run the job, return the exit status."""
    return run_from_args(build_parser().parse_args(argv))
