"""Source fragments of the generated launch fast paths (a typed SIMT launch,
``_kernel._compile_fast``; a tile launch, ``_tilefast.compile_tile_fast``).

Invariants:

* Each fragment is a piece of the body of ``def fast(args, config)``: every
  name it uses is bound in the namespace :func:`namespace` makes, or is a
  local the fragments define (``a{i}`` arguments, ``m{i}`` allocations,
  ``arena``, ``accesses``); no text comes from the user.
* A guard that fails returns None (the checked path then runs); nothing here
  raises for a bad argument.
* The launch is built as ``_launch._make_launch`` builds one: a
  ``PreparedLaunch`` and a ``KernelLaunch`` filled by plain stores.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

from ._array import AllocState, DeviceArray
from ._launch import KernelLaunch, PreparedLaunch, _LaunchUnderConstruction, _merge_accesses

__all__ = ["array_guard", "build", "launch_tail", "namespace", "pack", "unpack"]


def namespace(kernel: Any, plan: Any, packer: struct.Struct) -> dict[str, object]:
    """The names every generated fast path uses."""
    return {
        "DeviceArray": DeviceArray,
        "LIVE": AllocState.LIVE,
        "StructError": struct.error,
        "pack": packer.pack,
        "merge": _merge_accesses,
        "new": object.__new__,
        "PreparedLaunch": PreparedLaunch,
        "KernelLaunch": KernelLaunch,
        "UnderConstruction": _LaunchUnderConstruction,
        "kernel": kernel,
        "plan": plan,
    }


def unpack(names: Sequence[str]) -> str:
    """Bind the arguments to ``names`` (a wrong count: the checked path names it)."""
    if names:
        return f"    try:\n        {', '.join(names)}, = args\n    except ValueError:\n        return None"
    return "    if args:\n        return None"


def array_guard(a: str, m: str, i: int) -> str:
    """``a`` is an open DeviceArray of a live allocation ``m`` of an open
    scope, with the dtype ``dt{i}``."""
    return (
        f"    if type({a}) is not DeviceArray or {a}._closed:\n        return None\n"
        f"    {m} = {a}._alloc\n"
        f"    if {m}.state is not LIVE or {m}.scope._closed:\n        return None\n"
        f"    d = {a}._dtype\n"
        f"    if d is not dt{i} and d != dt{i}:\n        return None"
    )


def pack(packed: Sequence[str]) -> str:
    """``arena`` packed from ``packed`` (``pack`` refuses what its C types cannot hold)."""
    return (
        f"    try:\n        arena = pack({', '.join(packed)})\n"
        "    except (StructError, OverflowError):\n        return None"
    )


def launch_tail(outputs: Sequence[str]) -> str:
    """Build and return the launch (``accesses`` and ``arena`` are bound)."""
    output = "None" if not outputs else outputs[0] if len(outputs) == 1 else f"({', '.join(outputs)},)"
    return (
        "    p = new(PreparedLaunch)\n"
        "    p.kernel = kernel\n    p.config = config\n    p.plan = plan\n"
        "    p.arena = arena\n    p.args = None\n    p.values = args\n"
        "    p.cache = None\n    p.enqueued = False\n    p.ready = None\n"
        "    launch = new(UnderConstruction)\n"
        "    launch.prepared = p\n    launch._acc = accesses\n"
        "    launch._lease_plan = None\n    launch._lease_simple = False\n"
        f"    launch._output = {output}\n"
        "    launch.__class__ = KernelLaunch\n"
        "    return launch"
    )


def build(body: Sequence[str], ns: dict[str, object], what: str) -> Callable[..., Any]:
    """Compile ``def fast(args, config)`` from ``body`` in ``ns``; its
    ``__doc__`` is the generated source (for debugging)."""
    source = "def fast(args, config):\n" + "\n".join(body) + "\n"
    exec(compile(source, f"<trio_cuda {what}>", "exec"), ns)
    fast: Callable[..., Any] = ns["fast"]  # type: ignore[assignment]
    fast.__doc__ = source
    return fast
