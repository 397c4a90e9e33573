"""The ``trio-cuda`` command (also ``python -m trio_cuda``).

* ``info``: the backend ``open_scope(device="auto")`` would pick and why, the
  CUDA devices, whether the simulator checks kernel sources (NVRTC), and the
  versions of trio_cuda and its dependencies. It never crashes on a machine
  without a GPU or without libcuda.
* ``demo [options]``: the cancellation-safe batch job (see ``demo --help``).
* ``trace SCRIPT [ARGS] -o OUT.html|OUT.json`` or
  ``trace -o OUT.html|OUT.json SCRIPT [ARGS]``: run a Python program with
  lifetime tracing on for all its scopes, and write the trace.

Which arguments are trace's (:data:`TRACE_RULE`, also in ``trace --help``):
trace's options (``-o``, ``--limit``) come before SCRIPT, and ``--`` may end
them; everything after SCRIPT is the program's, except that when ``-o`` was
not given before SCRIPT (nor ``--``), a final ``-o OUT`` (or ``--output OUT``,
``--output=OUT``) ending the command line is trace's. A program whose own
arguments end in ``-o X`` is run with trace's ``-o`` before SCRIPT.

Every option (the output's name and folder, ``--limit``, the script) is
checked before the program runs; a bad one is an argparse error (one line
naming the option, what was expected and what was given; exit status 2). A
trace that cannot be written after the run is one error line too, and exit
status 1 unless the program's own status is not 0.
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

_DISTRIBUTIONS = ("trio", "attrs", "numpy", "cuda-bindings", "cuda-pathfinder", "cuda-tile")


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


def compile_check_line() -> str:
    """``info``'s line on the simulator's compile check (NVRTC). Never raises."""
    try:
        from ._backends import _nvrtc

        on, why = _nvrtc.check_status()
    except Exception as exc:  # pragma: no cover - a broken install
        on, why = False, f"{type(exc).__name__}: {exc}"
    return f"sim compile check: {'on' if on else 'off'} ({why})"


def tile_line() -> str:
    """``info``'s line on tile kernels (cuTile). Never raises."""
    try:
        from ._tile.compile import toolchain_status

        status = toolchain_status()
    except Exception as exc:  # pragma: no cover - a broken install
        status = f"{type(exc).__name__}: {exc}"
    return f"tile kernels: {status}"


def launch_path_line(driver_answers: bool) -> str:
    """``info``'s line on the cuda backend's launch path (direct driver calls
    through the compiled extension, or cuda.bindings' wrappers). Never raises."""
    try:
        from ._backends.cuda import direct

        if direct.pure_requested():
            path = "cuda.bindings wrappers (TRIO_CUDA_PURE is set)"
        elif not direct.built():
            path = "cuda.bindings wrappers (the compiled extension was not built at install)"
        elif not driver_answers:
            path = "direct driver calls where a CUDA driver answers (the compiled extension is built)"
        elif direct.entries() is not None:
            path = "direct driver calls (the compiled extension: launch, marker record and poll)"
        else:
            path = "cuda.bindings wrappers (the driver gave no entry points for direct calls)"
    except Exception as exc:  # pragma: no cover - a broken install
        path = f"unknown ({type(exc).__name__}: {exc})"
    return f"cuda launch path: {path}"


def launch_making_line() -> str:
    """``info``'s line on how launches are made, submitted and awaited: the
    compiled paths, or the pure-Python ones. Never raises."""
    try:
        from ._core import _compiled

        if _compiled.ext is not None:
            how = "compiled (Kernel.launch, the launch builder, submission, awaiting and retirement)"
        elif _compiled.pure_requested():
            how = "pure Python (TRIO_CUDA_PURE is set)"
        else:
            how = "pure Python (the compiled extension was not built at install)"
    except Exception as exc:  # pragma: no cover - a broken install
        how = f"unknown ({type(exc).__name__}: {exc})"
    return f"launch making: {how}"


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
        if probe.detail:
            lines.append(f"  the CUDA probe: {probe.detail}")
    lines.append("devices:")
    if probe.available:
        lines.extend(f"  {line}" for line in cuda_devices(probe.device_count))
    else:
        lines.append("  (no CUDA device)")
    lines.append("  sim: the simulated device (device='sim'), always available")
    lines.append(launch_path_line(probe.available))
    lines.append(launch_making_line())
    lines.append(compile_check_line())
    lines.append(tile_line())
    lines.append("versions:")
    width = max(len(name) for name, _ in _versions())
    lines.extend(f"  {name:<{width}}  {version}" for name, version in _versions())
    return lines


def _info(args: argparse.Namespace) -> int:
    for line in info_lines():
        print(line)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ._demo.cli import run_from_args

    return run_from_args(args)


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
    """Run the program traced (its options already checked), write the trace."""
    import runpy

    from . import trace

    out, script = str(args.output), str(args.script)  # checked by the parser
    saved, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as ``python SCRIPT`` finds its neighbours
    recording = trace.enable(limit=args.limit)
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
        sys.path[:] = saved_path
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
    from ._demo.cli import build_parser as demo_parser
    from ._demo.cli import trace_file

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
        usage="%(prog)s [-h] [-o OUT] [--limit N] [--] SCRIPT [ARGS ...] [-o OUT]",
        description="Run SCRIPT with lifetime tracing on for all its scopes; write the trace to OUT\n"
        "(.html: a self-contained timeline page; .json: Chrome trace-event JSON for\nui.perfetto.dev).",
        epilog=TRACE_RULE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tr.add_argument(
        "-o", "--output", metavar="OUT", type=trace_file, help="OUT.html or OUT.json (before or after SCRIPT)"
    )
    tr.add_argument(
        "--limit",
        metavar="N",
        type=_trace_limit,
        default=1_000_000,
        help="events kept, the oldest dropped first (default 1,000,000; each takes about 0.5 KB)",
    )
    tr.add_argument("script", metavar="SCRIPT", type=_trace_script, help="the Python program to run")
    tr.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments")
    tr.set_defaults(handler=_trace, trace_prog=tr.prog, trace_parser=tr)
    return parser


TRACE_RULE = """\
which arguments are trace's:
  trace's options (-o, --limit) come before SCRIPT; '--' may end them (then
  SCRIPT may start with '-'). Everything after SCRIPT is its own, except that
  when -o was not given before SCRIPT (nor '--'), a final '-o OUT' (or
  '--output OUT', '--output=OUT') that ends the command line is trace's:

    trio-cuda trace my_job.py --its-args -o run.html    # trace writes run.html
    trio-cuda trace -o run.html my_job.py --its-args    # the same
    trio-cuda trace -o run.html my_job.py -o its.json   # my_job.py gets '-o its.json'
"""

#: trace's options that take a value, by their spellings (long ones may be abbreviated)
_VALUED = ("--output", "--limit")
_FLAGS = ("--help",)


def _option_takes_value(token: str) -> bool:
    """Whether ``token``, one of trace's options before SCRIPT, takes the next
    argument as its value (argparse's rules: ``-o X``, ``-oX``, ``--output X``,
    ``--output=X``, unambiguous prefixes of the long options)."""
    if token.startswith("--"):
        if "=" in token:
            return False
        matches = [o for o in (*_VALUED, *_FLAGS) if o.startswith(token)]
        return len(matches) == 1 and matches[0] in _VALUED
    return token == "-o"


def _is_output_option(token: str) -> bool:
    if token.startswith("--"):
        name = token.split("=", 1)[0]
        return len(name) > 2 and "--output".startswith(name)
    return token.startswith("-o")


def split_trace_argv(argv: Sequence[str]) -> tuple[list[str], list[str] | None, bool]:
    """``argv`` for the parser, the arguments of ``trace``'s SCRIPT (None when
    the command is not ``trace``), and whether ``--`` ended trace's options, by
    :data:`TRACE_RULE`: the parser sees trace's options, a trailing ``-o OUT``
    moved before SCRIPT, then ``--`` and SCRIPT; the program's arguments never
    go through the parser."""
    argv = list(argv)
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 1  # the top level's options (--version, --help) take no value
    if i >= len(argv) or argv[i] != "trace":
        return argv, None, False
    head, rest = argv[: i + 1], argv[i + 1 :]
    options: list[str] = []
    given = separator = False
    j = 0
    while j < len(rest):
        token = rest[j]
        if token == "--":
            separator = True
            j += 1
            break
        if not token.startswith("-") or token == "-":
            break  # SCRIPT
        given = given or _is_output_option(token)
        step = 2 if _option_takes_value(token) else 1
        options.extend(rest[j : j + step])
        j += step
    if j >= len(rest):  # no SCRIPT: the parser says so
        return head + options, [], separator
    script, args = rest[j], rest[j + 1 :]
    if not given and not separator:
        if len(args) >= 2 and args[-2] in ("-o", "--output"):
            options, args = [*options, *args[-2:]], args[:-2]
        elif args and args[-1].startswith("--output="):
            options, args = [*options, args[-1]], args[:-1]
    return [*head, *options, "--", script], args, separator


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``trio-cuda`` and ``python -m trio_cuda``; returns the exit status."""
    parser = build_parser()
    parser_argv, script_args, separator = split_trace_argv(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(parser_argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    if script_args is not None:
        args.args = script_args
        if args.output is None:
            where = (
                "before '--' (what follows '--' is SCRIPT and its arguments)"
                if separator
                else "before SCRIPT or as the last two arguments ('-o OUT')"
            )
            args.trace_parser.error(f"argument -o/--output: expected OUT.html or OUT.json {where}, got none")
    status: int = handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
