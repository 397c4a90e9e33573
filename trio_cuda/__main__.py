"""The ``trio-cuda`` command (also ``python -m trio_cuda``).

* ``info``: the backend ``open_scope(device="auto")`` would pick and why, the
  CUDA devices, and the versions of trio_cuda and its dependencies. It never
  crashes on a machine without a GPU or without libcuda.
* ``demo [options]``: the cancellation-safe batch job (see ``demo --help``).
* ``trace -o OUT.html|OUT.json SCRIPT [ARGS]``: run a Python program with
  lifetime tracing on for all its scopes, and write the trace. Every option
  (the output's name and folder, ``--limit``, the script) is checked before
  the program runs; a bad one is an argparse error (one line naming the
  option, what was expected and what was given; exit status 2). A trace that
  cannot be written after the run is one error line too, and exit status 1
  unless the program's own status is not 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from ._version import __version__

__all__ = ["main"]

_DISTRIBUTIONS = ("trio", "attrs", "numpy", "cuda-bindings", "cuda-python", "cuda-pathfinder")


def _driver_version(version: int) -> str:
    if version <= 0:
        return "unknown"
    return f"{version // 1000}.{version % 1000 // 10}"


def _cuda_driver() -> Any:
    """``cuda.bindings.driver``, or None; never raises."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except Exception:
        return None


def _call(fn: Any, *args: Any) -> Any:
    """Call a cuda.bindings function; its value on success, else None."""
    try:
        result = fn(*args)
    except Exception:  # e.g. DynamicLibNotFoundError without libcuda
        return None
    if not isinstance(result, tuple) or not result:
        return None
    try:
        if int(result[0]) != 0:
            return None
    except (TypeError, ValueError):
        return None
    if len(result) == 1:
        return True
    return result[1] if len(result) == 2 else result[1:]


def cuda_devices(count: int) -> list[str]:
    """One line per CUDA device: name, compute capability, memory. Never raises."""
    cu = _cuda_driver()
    if cu is None:
        return []
    lines = []
    attr = getattr(cu, "CUdevice_attribute", None)
    for ordinal in range(count):
        dev = _call(getattr(cu, "cuDeviceGet", None), ordinal)
        if dev is None:
            lines.append(f"cuda:{ordinal}: (cuDeviceGet failed)")
            continue
        raw_name = _call(getattr(cu, "cuDeviceGetName", None), 256, dev)
        if isinstance(raw_name, bytes | bytearray):
            name = bytes(raw_name).split(b"\0", 1)[0].decode(errors="replace")
        else:
            name = "unknown device"
        parts = [name]
        if attr is not None:
            major = _call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            minor = _call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            if major is not None and minor is not None:
                parts.append(f"compute capability {int(major)}.{int(minor)}")
            sms = _call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
            if sms is not None:
                parts.append(f"{int(sms)} SMs")
        total = _call(getattr(cu, "cuDeviceTotalMem", None), dev)
        if total is not None:
            parts.append(f"{int(total) / 2**30:.1f} GiB")
        lines.append(f"cuda:{ordinal}: " + ", ".join(parts))
    return lines


def _versions() -> list[tuple[str, str]]:
    out = [("trio_cuda", __version__), ("python", f"{platform.python_version()} ({sys.executable})")]
    for dist in _DISTRIBUTIONS:
        try:
            out.append((dist, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            out.append((dist, "not installed"))
    return out


def info_lines() -> list[str]:
    """What ``trio-cuda info`` prints."""
    from ._backends import _cuda_backend_available, probe_cuda

    probe = probe_cuda()
    lines = []
    if probe.available and _cuda_backend_available():
        lines.append(
            f"backend: cuda (driver {_driver_version(probe.driver_version)}, "
            f"{probe.device_count} device(s) answer; open_scope(device='auto') uses cuda:0)"
        )
    elif probe.available:
        lines.append(
            f"backend: sim ({probe.device_count} CUDA device(s) answer, but the cuda backend is not "
            f"installed; open_scope(device='auto') uses the simulator)"
        )
    else:
        lines.append(f"backend: sim ({probe.reason}; open_scope(device='auto') uses the simulator)")
    lines.append("devices:")
    if probe.available:
        lines.extend(f"  {line}" for line in cuda_devices(probe.device_count))
    else:
        lines.append("  (no CUDA device)")
    lines.append("  sim: the simulated device (device='sim'), always available")
    lines.append("versions:")
    width = max(len(name) for name, _ in _versions())
    lines.extend(f"  {name:<{width}}  {version}" for name, version in _versions())
    return lines


def _info(args: argparse.Namespace) -> int:
    for line in info_lines():
        print(line)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ._demo_cli import run_from_args

    return run_from_args(args)


def _trace_output(text: str) -> str:
    """``-o``: a .html or .json file that can be written, checked before the program runs."""
    if not text.endswith((".json", ".html", ".htm")):
        raise argparse.ArgumentTypeError(f"expected a file name ending in .html or .json, got {text!r}")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file name, not a folder, got {text!r}")
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


def _trace_limit(text: str) -> int:
    """``--limit``: how many events the trace keeps, at least one."""
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (events kept), got {text!r}")
    return limit


def _trace_script(text: str) -> str:
    if not os.path.isfile(text):
        why = "a folder" if os.path.isdir(text) else "no such file"
        raise argparse.ArgumentTypeError(f"expected a Python file, got {text!r} ({why})")
    return text


def _trace(args: argparse.Namespace) -> int:
    import runpy

    from . import trace

    out, script = str(args.output), str(args.script)  # checked by the parser
    saved = sys.argv[:]
    sys.argv = [script, *args.args]
    recording = trace.enable(limit=args.limit)
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
        trace.disable()
        try:
            recording.write(out)
        except OSError as exc:  # the folder went away, the disk is full, ...
            print(f"{args.trace_prog}: error: -o: could not write {out!r}: {exc}", file=sys.stderr)
            status = status or 1
        else:
            print(
                f"trace: {len(recording.events)} events ({recording.dropped} dropped) written to {out}",
                file=sys.stderr,
            )
    return status


def build_parser() -> argparse.ArgumentParser:
    from ._demo_cli import build_parser as demo_parser

    parser = argparse.ArgumentParser(
        prog="trio-cuda",
        description="trio_cuda: structured concurrency for NVIDIA GPUs, on Trio.",
    )
    parser.add_argument("--version", action="version", version=f"trio_cuda {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser("info", help="backend, devices and versions")
    info.set_defaults(handler=_info)
    demo = commands.add_parser(
        "demo",
        help="run the cancellation-safe batch job",
        description="Run a cancellation-safe GPU batch job and check that nothing leaked.",
    )
    demo_parser(demo)
    demo.set_defaults(handler=_demo)
    tr = commands.add_parser(
        "trace",
        help="run a program with lifetime tracing on, and write its trace",
        description="Run SCRIPT with lifetime tracing on for all its scopes; write the trace to OUTPUT "
        "(.html: a self-contained timeline page; .json: Chrome trace-event JSON for ui.perfetto.dev).",
    )
    tr.add_argument("-o", "--output", required=True, type=_trace_output, help="OUT.html or OUT.json")
    tr.add_argument(
        "--limit", type=_trace_limit, default=1_000_000, help="events kept (oldest dropped first)"
    )
    tr.add_argument("script", metavar="SCRIPT", type=_trace_script, help="the Python program to run")
    tr.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    tr.set_defaults(handler=_trace, trace_prog=tr.prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``trio-cuda`` and ``python -m trio_cuda``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    status: int = handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
