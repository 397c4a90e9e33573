"""Opening scopes and device pools: the one place that picks a backend.

Invariants:

* ``open_scope(device=...)`` and ``open_device_pool(devices=...)`` turn what the
  user names (``"auto"``, ``"sim"``, ``"cuda"``, ``"cuda:N"``, a ``SimDevice``
  or a ``SimHost``) into backend driver contexts here and nowhere else; the core
  only ever sees a :class:`~trio_cuda._core._driver.DeviceContext`.
* Every option is checked when the manager is made, before any device is
  touched; the device itself is opened when the manager is entered. A pool's
  ``"auto"`` and ``"cuda"`` ask the driver then, when the manager is made,
  since they decide how many scopes it opens.
* A CUDA device asked for by name that is not there ("cuda", "cuda:N", a
  pool's "cuda") is :class:`~trio_cuda.DeviceUnavailableError`; only
  "auto" falls back to the simulator.
* The simulator that ``"sim"`` and the ``"auto"`` fallback make takes its
  timing from the environment (:data:`SIM_ENVIRONMENT`), read and checked
  when the manager is made; an explicit ``SimDevice`` is used as it is.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from ._backends import auto_devices, check_cuda, open_device
from ._backends.sim import SimDevice
from ._core._manager import ScopeManager, scope_manager
from ._core._multi import DevicePolicy, DevicePool, LeastLoadedDevice, PoolManager
from ._core._policy import FollowWriter, SchedulingPolicy
from ._core._scope import ResourceScope
from ._core._trace import Tracer
from .trace import Trace

__all__ = ["SIM_ENVIRONMENT", "open_device_pool", "open_scope", "sim_options_from_env"]

#: the environment variables that set the timing of the simulator trio_cuda
#: makes itself (``device="sim"``, and "auto" without a GPU): the SimDevice
#: option each one sets, in seconds
SIM_ENVIRONMENT: Mapping[str, str] = {
    "TRIO_CUDA_SIM_KERNEL_TIME": "kernel_time",
    "TRIO_CUDA_SIM_COPY_TIME": "copy_time",
}


def sim_options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """The :class:`~trio_cuda.testing.SimDevice` options that the variables of
    :data:`SIM_ENVIRONMENT` set in ``environ`` (``os.environ`` when None); an
    unset or empty variable sets nothing. Raises ``ValueError`` naming the
    variable unless its value is a finite number of seconds >= 0."""
    env = os.environ if environ is None else environ
    options: dict[str, float] = {}
    for var, option in SIM_ENVIRONMENT.items():
        raw = env.get(var, "").strip()
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"{var}: expected a number of seconds >= 0 (for SimDevice({option}=...)), got {raw!r}"
            )
        options[option] = value
    return options


def _sim_factory() -> Callable[[], SimDevice] | None:
    options: dict[str, Any] = dict(sim_options_from_env())
    return functools.partial(SimDevice, **options) if options else None


def open_scope(
    device: object = "auto",
    streams: int = 4,
    conflicts: Literal["order", "error"] = "order",
    drain_timeout: float | None = None,
    *,
    policy: SchedulingPolicy | None = None,
    trace: Trace | Literal[False] | None = None,
) -> contextlib.AbstractAsyncContextManager[ResourceScope]:
    """Open a :class:`~trio_cuda.ResourceScope`: ``async with open_scope() as gpu:``.

    ``device`` is "auto" (the real GPU when a driver and a device answer, else
    the simulator; the choice is logged), "sim", a
    :class:`~trio_cuda.testing.SimDevice`, "cuda" or "cuda:N". The simulator
    that "sim" and "auto" make runs each kernel for
    ``TRIO_CUDA_SIM_KERNEL_TIME`` seconds and each copy or fill for
    ``TRIO_CUDA_SIM_COPY_TIME`` seconds when these environment variables are
    set (0 otherwise: work completes as soon as it is enqueued), so that a
    program can be cancelled mid-kernel without a GPU or a code change. ``streams`` is
    the size of the stream pool; ``conflicts`` is "order" (cross-stream
    conflicts become device-side waits) or "error" (they raise
    :class:`~trio_cuda.AccessConflictError`). ``drain_timeout`` bounds the
    wait at exit (None or ``math.inf``: no bound); what is still in flight then
    is quarantined. ``policy`` (a :class:`~trio_cuda.SchedulingPolicy`)
    chooses the stream of work not pinned to one; the default,
    :class:`~trio_cuda.FollowWriter`, puts independent work on the least-loaded
    stream so that it overlaps, and a kernel that depends on the last work of
    a stream after that work. :class:`~trio_cuda.RoundRobin` and
    :class:`~trio_cuda.LeastLoaded` are the alternatives. ``trace``: a
    :class:`trio_cuda.trace.Trace` to record the scope's lifetime events
    into; None (the default) records into the process's trace when
    :func:`trio_cuda.trace.enable` turned one on; False never records. The
    manager opens one scope once.
    """
    return _scope_manager(device, streams, conflicts, drain_timeout, policy, trace)


def _scope_manager(
    device: object,
    streams: int,
    conflicts: Literal["order", "error"],
    drain_timeout: float | None,
    policy: SchedulingPolicy | None,
    trace: Trace | Literal[False] | None,
) -> ScopeManager:
    tracer: Tracer | Literal[False] | None
    if trace is None or trace is False:
        tracer = trace
    elif isinstance(trace, Trace):
        tracer = trace._tracer
    else:
        raise TypeError(f"trace: expected None, False or a trio_cuda.trace.Trace, got {trace!r}")
    make_sim = _sim_factory() if isinstance(device, str) and device in ("sim", "auto") else None
    return scope_manager(
        functools.partial(open_device, device, make_sim), streams, conflicts, drain_timeout, policy, tracer
    )


_DEVICES = "'auto', 'cuda', a SimHost or a sequence of devices"


def _resolve_devices(devices: object) -> list[object]:
    if isinstance(devices, str):
        if devices == "auto":
            return [*auto_devices()]
        if devices not in ("cuda", "all"):
            raise ValueError(
                f"devices: expected 'auto' (every CUDA device when one answers, else one simulated "
                f"device), 'cuda' (every CUDA device), a SimHost or a sequence of devices, got {devices!r}"
            )
        probe = check_cuda(devices, None, argument="devices")
        return [f"cuda:{i}" for i in range(probe.device_count)]
    if not isinstance(devices, Iterable):
        raise TypeError(f"devices: expected {_DEVICES}, got {type(devices).__name__}")
    out = list(devices)
    if not out:
        raise ValueError("devices: expected at least one device, got none")
    return out


def open_device_pool(
    devices: object = "auto",
    streams: int = 4,
    conflicts: Literal["order", "error"] = "order",
    drain_timeout: float | None = None,
    *,
    policy: DevicePolicy | None = None,
    stream_policy: type[SchedulingPolicy] | None = None,
) -> contextlib.AbstractAsyncContextManager[DevicePool]:
    """Open a :class:`~trio_cuda.DevicePool`: ``async with open_device_pool(["cuda:0",
    "cuda:1"]) as pool:``.

    ``devices`` is ``"auto"`` (the default: every CUDA device of the host
    when the driver answers with at least one device, else one simulated
    device, as ``open_scope()`` falls back to one; the choice is logged),
    ``"cuda"`` (every CUDA device of the host, and
    :class:`~trio_cuda.DeviceUnavailableError` when none answers), a
    :class:`~trio_cuda.testing.SimHost` (its simulated devices), or a sequence
    of what ``open_scope(device=...)`` accepts. ``"auto"`` and ``"cuda"`` ask
    the driver when the pool's manager is made. One scope is opened per entry,
    in order, each with ``streams``, ``conflicts`` and ``drain_timeout``, and a
    fresh ``stream_policy()`` (a :class:`~trio_cuda.SchedulingPolicy` class;
    :class:`~trio_cuda.FollowWriter` by default, as for ``open_scope``).
    ``policy`` places ops that name no array
    (:class:`~trio_cuda.LeastLoadedDevice` by default). On exit the scopes exit
    in reverse order, each by its own rules.
    """
    if policy is None:
        policy = LeastLoadedDevice()
    elif not callable(getattr(policy, "choose", None)):
        raise TypeError(f"policy: expected a DevicePolicy (with a choose() method), got {policy!r}")
    if stream_policy is not None and not callable(stream_policy):
        raise TypeError(f"stream_policy: expected a SchedulingPolicy class, got {stream_policy!r}")
    managers = []
    for device in _resolve_devices(devices):
        sp = stream_policy() if stream_policy is not None else FollowWriter()
        managers.append(_scope_manager(device, streams, conflicts, drain_timeout, sp, None))
    return PoolManager(managers, policy)
