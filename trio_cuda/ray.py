"""Run Trio jobs with a trio_cuda scope inside Ray tasks (``pip install 'trio_cuda[ray]'``).

Invariants:

* Importing this module imports Ray; ``import trio_cuda`` never does. Without
  Ray, the import raises ``ModuleNotFoundError`` (an ``ImportError``) naming
  the ``ray`` extra, chained from Ray's own.
* Every call of a job runs ``trio.run`` in the Ray worker and opens ONE
  scope for it: on the GPU that Ray assigned to the task (Ray sets
  ``CUDA_VISIBLE_DEVICES``, so it is ``cuda:0`` there), or on the simulator
  where the task has no GPU. The scope is closed before the task returns: it
  drains, so nothing is freed under a running kernel, and the worker hands
  back nothing in flight.
* Ray's cancellation of a running task (``ray.cancel(ref)``, which
  interrupts the worker with SIGINT) and the job's deadline (an absolute
  wall-clock time, shared by every worker of a job) both become Trio
  cancellation of the job; the report says which. Further interrupts while
  the scope drains are ignored (``ray.cancel(ref, force=True)`` still kills
  the worker: the driver then releases the process's GPU memory).
* A call always returns a :class:`WorkerReport`, also when the job failed or
  was cancelled: the job's value or error, what it emitted with
  :meth:`WorkerContext.emit` before it ended, the scope's final statistics
  and, on the simulator, the memcheck's findings.
* Every part of a report that comes from the job is checked, in the worker,
  to survive the trip as Ray makes it (pickled with Ray's cloudpickle, then
  unpickled). A part that does not is replaced, and the rest still comes
  back: a value by a ``RuntimeError`` as the report's error (a note on the
  error where there already is one), an error by a ``RuntimeError`` naming
  its type and message (in an exception group, only the members that do not
  travel), an emitted value by a ``RuntimeError`` in its place, an emitted
  key by its ``repr``. Each replacement says what did not travel and why.
  ``run_job`` makes the same checks, so its report is what Ray would bring
  back.
"""

from __future__ import annotations as _annotations  # (aliased: this module exposes only __all__)

import contextlib
import inspect
import math
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import typing

import attrs
import trio

try:
    import ray
except ModuleNotFoundError as exc:
    note = "" if sys.version_info < (3, 14) else " (the extra installs Ray on Python before 3.14 only)"
    raise ModuleNotFoundError(
        f"trio_cuda.ray needs Ray ({exc}): pip install 'trio_cuda[ray]'{note}", name=exc.name, path=exc.path
    ) from exc

from . import _open
from . import testing as _testing
from ._core import _errors, _final, _statistics

if typing.TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping
    from typing import Any, Literal

    from ._core._scope import ResourceScope
    from ._core._statistics import ScopeStatistics

    #: what ended a job early
    CancelReason = Literal["deadline", "ray.cancel"]

__all__ = ["JobCancelledError", "RemoteJob", "WorkerContext", "WorkerReport", "remote", "run_job"]

#: options of :func:`remote` and :meth:`RemoteJob.options` that are trio_cuda's, not Ray's
_OWN_OPTIONS = frozenset({"device", "deadline", "sim", "scope_options"})


class JobCancelledError(_errors.TrioCudaError):
    """:meth:`WorkerReport.result` of a job that was cancelled before it
    returned (its deadline passed, or Ray cancelled the task)."""


@_final.final
@attrs.frozen
class WorkerReport:
    """What one call of a job sent back from its Ray worker."""

    #: the job's return value (None unless it returned, and it survived pickling)
    value: Any
    #: what the job raised (or the scope's exit raised), else None; a RuntimeError
    #: naming what did not survive pickling in its place
    error: BaseException | None
    #: ``key -> value`` pairs the job emitted before it ended, in order (a value
    #: that did not survive pickling replaced by a RuntimeError naming it)
    emitted: dict[Any, Any]
    #: "deadline" or "ray.cancel" when the job was cancelled, else None
    cancelled: Literal["deadline", "ray.cancel"] | None
    #: the scope's statistics after it closed
    statistics: ScopeStatistics
    #: "cuda" or "sim"
    backend: str
    #: the device's name
    device: str
    #: the GPUs Ray assigned to the task (empty on the simulator)
    gpu_ids: tuple[str, ...]
    #: the name of the machine that ran the job (``socket.gethostname()``)
    hostname: str
    #: the id of the process that ran the job: the Ray worker's (the caller's,
    #: for :func:`run_job`)
    pid: int
    #: Ray's id of the node that ran the job ("" outside Ray)
    node_id: str
    #: the Ray task's attempt: 0, then one more for each retry (0 outside Ray),
    #: as :attr:`WorkerContext.attempt`
    attempt: int
    #: seconds from the job's start to the scope's close
    elapsed: float
    #: how many memcheck records (``sim.violations``) the job's simulated
    #: device holds after the scope closed (None on a GPU)
    violations: int | None
    #: how many allocations of the job's simulated device were never freed
    #: (``sim.live_allocations``) after the scope closed (None on a GPU)
    sim_live_allocations: int | None

    @property
    def leaked(self) -> bool:
        """True if anything outlived the scope: work in flight, leases,
        quarantined submissions, memory never freed, or a memcheck finding."""
        s = self.statistics
        return bool(
            s.in_flight
            or s.leases_held
            or s.quarantined
            or s.live_allocations
            or self.violations
            or self.sim_live_allocations
        )

    def result(self) -> Any:
        """The job's value; raises its error, or :class:`JobCancelledError`
        when it was cancelled before it returned."""
        if self.error is not None:
            raise self.error
        if self.cancelled is not None and self.value is None:
            raise JobCancelledError(
                f"the job was cancelled ({self.cancelled}) on {self.hostname} pid {self.pid} "
                f"after {self.elapsed:.3f} s; it emitted {len(self.emitted)} result(s)"
            )
        return self.value


@_final.final
class WorkerContext(metaclass=_final.NoPublicConstructor):
    """What a job gets as its first argument: the scope, and a way to send
    results back that survive cancellation. Made by the worker for each call."""

    _obtain = "a job receives one as its first argument"
    __slots__ = ("_emitted", "attempt", "deadline", "gpu", "gpu_ids")

    #: the scope the job runs in
    gpu: ResourceScope
    #: the job's deadline as a wall-clock time (``time.time()``), or inf
    deadline: float
    #: the Ray task's attempt: 0, then one more for each retry (0 outside Ray)
    attempt: int
    #: the GPUs Ray assigned to the task (empty on the simulator)
    gpu_ids: tuple[str, ...]
    _emitted: dict[Any, Any]

    @classmethod
    def _create(
        cls,
        gpu: ResourceScope,
        deadline: float,
        emitted: dict[Any, Any],
        attempt: int,
        gpu_ids: tuple[str, ...],
    ) -> WorkerContext:
        self = object.__new__(cls)
        self.gpu, self.deadline, self._emitted = gpu, deadline, emitted
        self.attempt, self.gpu_ids = attempt, gpu_ids
        return self

    def emit(self, key: Any, value: Any) -> None:
        """Record a result under ``key`` (a later value for the same key
        replaces the earlier one). Emitted results come back in the report
        even when the job is cancelled or fails afterwards."""
        self._emitted[key] = value

    @property
    def remaining(self) -> float:
        """Seconds until the deadline (inf without one)."""
        return self.deadline - time.time()

    def __repr__(self) -> str:
        return (
            f"<WorkerContext {self.gpu.device.backend}:{self.gpu.device.name} attempt={self.attempt} "
            f"remaining={self.remaining:.3f}s emitted={len(self._emitted)}>"
        )


# --------------------------------------------------------------------------- the worker side


def _pick_device(
    device: object, gpu_ids: tuple[str, ...], sim: Mapping[str, Any] | None
) -> tuple[object, Any]:
    """(what to open, the SimDevice when it is one)."""
    if device == "auto":
        device = "cuda:0" if gpu_ids else "sim"
    if device == "sim":
        options: dict[str, Any] = dict(_open.sim_options_from_env())
        options.update(sim or {})
        made = _testing.SimDevice(**options)
        return made, made
    if isinstance(device, _testing.SimDevice):
        return device, device
    return device, None


#: CUDA_VISIBLE_DEVICES when this process first opened a GPU for a job (the
#: driver reads it once per process); None before that
_visible_at_first_gpu_job: list[str | None] = []


def _check_same_gpus(where: object) -> None:
    """A reused worker process must be given the GPUs its driver already saw."""
    if where is None or isinstance(where, _testing.SimDevice) or where == "sim":
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not _visible_at_first_gpu_job:
        _visible_at_first_gpu_job.append(visible)
    elif _visible_at_first_gpu_job[0] != visible:
        raise RuntimeError(
            f"this worker process opened its GPU with CUDA_VISIBLE_DEVICES={_visible_at_first_gpu_job[0]!r}, "
            f"and Ray now assigns CUDA_VISIBLE_DEVICES={visible!r}: a process cannot switch GPUs. "
            "Leave max_calls at Ray's default (1) for GPU jobs on nodes with several GPUs"
        )


def _check_deadline(deadline: object) -> float:
    if deadline is None:
        return math.inf
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or math.isnan(deadline):
        raise TypeError(f"deadline: expected a wall-clock time (time.time()) or None, got {deadline!r}")
    return float(deadline)


#: how Ray pickles what a task returns (untyped in Ray)
_ray_dumps: Callable[..., bytes] = ray.cloudpickle.dumps

#: types whose values always survive pickling (checked without pickling them)
_PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})


def _trip_failure(obj: object) -> str | None:
    """None if ``obj`` survives the trip as Ray makes it (pickled with Ray's
    cloudpickle, then unpickled), else what went wrong."""
    if type(obj) in _PLAIN_TYPES:
        return None
    buffers: list[pickle.PickleBuffer] = []  # out of band, as Ray sends arrays: no copy
    try:
        data = _ray_dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception as exc:
        return f"did not pickle ({type(exc).__name__}: {exc})"
    try:
        pickle.loads(data, buffers=buffers)
    except Exception as exc:
        return f"pickled, but could not be rebuilt from its pickle ({type(exc).__name__}: {exc})"
    return None


def _type_name(obj: object) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _portable(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it survives the trip back to the driver, else a RuntimeError
    naming it (its type, message, why, and its traceback as a note). In an
    exception group only the members that do not travel are replaced."""
    if exc is None:
        return None
    why = _trip_failure(exc)
    if why is None:
        return exc
    if isinstance(exc, BaseExceptionGroup):
        members = [_portable(e) or e for e in exc.exceptions]
        if any(new is not old for new, old in zip(members, exc.exceptions, strict=True)):
            try:
                group = exc.derive(members)
                group.__notes__ = list(getattr(exc, "__notes__", ()))
            except Exception:  # a subclass that derive() cannot make
                pass
            else:
                if _trip_failure(group) is None:
                    return group
    replaced = RuntimeError(f"{_type_name(exc)}: {exc} [raised by the job; it {why}]")
    if exc.__traceback__ is not None:
        replaced.add_note("".join(traceback.format_exception(exc)).rstrip())
    return replaced


def _portable_emitted(emitted: dict[Any, Any]) -> dict[Any, Any]:
    """``emitted`` with each key and value that does not travel replaced
    (a key by its repr, a value by a RuntimeError naming it)."""
    out: dict[Any, Any] = {}
    for key, value in emitted.items():
        if _trip_failure(key) is not None:
            try:
                key = repr(key)
            except Exception:
                key = f"<a key of type {_type_name(key)}>"
        why = _trip_failure(value)
        if why is not None:
            value = RuntimeError(f"emitted[{key!r}]: the emitted value of type {_type_name(value)} {why}")
        out[key] = value
    return out


def _ray_identity() -> tuple[tuple[str, ...], str, int]:
    """(GPU ids, node id, attempt) of the running Ray task, or defaults outside Ray."""
    if not ray.is_initialized():
        return (), "", 0
    ctx = ray.get_runtime_context()
    try:
        gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
    except Exception:  # the driver itself, not a worker
        gpu_ids = ()
    attempt = 0
    try:  # Ray has no public call for it: its core worker knows the attempt
        from ray._private.worker import global_worker

        attempt = int(global_worker.core_worker.get_current_task_attempt_number())  # type: ignore[attr-defined]
    except Exception:  # another Ray version: retries then all look like attempt 0
        attempt = 0
    return gpu_ids, ctx.get_node_id(), attempt


async def _run(
    fn: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: object,
    deadline: float,
    sim: Mapping[str, Any] | None,
    scope_options: Mapping[str, Any],
) -> WorkerReport:
    gpu_ids, node_id, attempt = _ray_identity()
    where, sim_device = _pick_device(device, gpu_ids, sim)
    interrupted = False
    value: Any = None
    error: BaseException | None = None
    emitted: dict[Any, Any] = {}
    cancelled: CancelReason | None = None
    t0 = time.perf_counter()
    stats: ScopeStatistics | None = None
    scope: ResourceScope | None = None
    backend = name = "?"
    in_main = threading.current_thread() is threading.main_thread()
    # Ray cancels a running task with SIGINT: received here, it cancels the job (and
    # later ones, while the scope drains, are swallowed)
    receiver = trio.open_signal_receiver(signal.SIGINT) if in_main else contextlib.nullcontext(None)
    with receiver as signals:
        try:
            _check_same_gpus(where)
            async with _open.open_scope(device=where, **scope_options) as gpu:
                scope = gpu
                backend, name = gpu.device.backend, gpu.device.name
                ctx = WorkerContext._create(gpu, deadline, emitted, attempt, gpu_ids)
                with trio.CancelScope(deadline=trio.current_time() + (deadline - time.time())) as job_cs:
                    async with trio.open_nursery() as nursery:
                        if signals is not None:

                            async def on_interrupt() -> None:
                                nonlocal interrupted
                                async for _ in signals:
                                    interrupted = True
                                    job_cs.cancel()
                                    return

                            nursery.start_soon(on_interrupt)
                        try:
                            pending = fn(ctx, *args, **kwargs)
                            if not inspect.isawaitable(pending):
                                raise TypeError(
                                    f"fn: expected an async function (async def job(ctx, ...)), got "
                                    f"{getattr(fn, '__qualname__', fn)!r}, which returned "
                                    f"{type(pending).__name__}"
                                )
                            value = await pending
                        except Exception as exc:
                            error = exc
                        nursery.cancel_scope.cancel()
                if job_cs.cancelled_caught:
                    cancelled = "ray.cancel" if interrupted else "deadline"
        except Exception as exc:  # the scope's exit: errors of work nobody awaited
            error = exc if error is None else error
        if scope is not None:
            stats = scope.statistics()  # after the exit: what outlived the scope
    elapsed = time.perf_counter() - t0
    if stats is None:
        stats = _empty_statistics(backend, name)
    # what does not survive the trip back is replaced here, not lost with the report in Ray
    error = _portable(error)
    why = _trip_failure(value)
    if why is not None:
        lost = f"value: the job's return value of type {_type_name(value)} {why}"
        value = None
        if error is None:
            error = RuntimeError(lost)
        else:
            error.add_note(f"({lost}, and was left out)")
    return WorkerReport(
        value=value,
        error=error,
        emitted=_portable_emitted(emitted),
        cancelled=cancelled,
        statistics=stats,
        backend=backend,
        device=name,
        gpu_ids=gpu_ids,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        node_id=node_id,
        attempt=attempt,
        elapsed=elapsed,
        violations=None if sim_device is None else len(sim_device.violations),
        sim_live_allocations=None if sim_device is None else len(sim_device.live_allocations),
    )


def _empty_statistics(backend: str, device: str) -> ScopeStatistics:
    fields = {f.name: 0 for f in attrs.fields(_statistics.ScopeStatistics) if f.type in (int, "int")}
    return _statistics.ScopeStatistics(backend=backend, device=device, **fields)


def run_job(
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    device: object = "auto",
    deadline: float | None = None,
    sim: Mapping[str, Any] | None = None,
    scope_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> WorkerReport:
    """Run ``await fn(ctx, *args, **kwargs)`` under ``trio.run`` with one
    scope, as a Ray worker does for :func:`remote` jobs, in this process.

    ``device``: "auto" (the GPU Ray assigned to the running task, else the
    simulator), "sim", "cuda:N" or a SimDevice. ``deadline``: a wall-clock
    time (``time.time()``) after which the job is cancelled. ``sim``: options
    of the simulator "auto" and "sim" make (e.g. ``{"kernel_time": 0.01}``;
    the ``TRIO_CUDA_SIM_*`` variables apply too). ``scope_options``: more
    arguments of :func:`trio_cuda.open_scope` (streams, drain_timeout, ...)."""
    if not callable(fn):
        raise TypeError(f"fn: expected an async function taking a WorkerContext, got {type(fn).__name__}")
    limit = _check_deadline(deadline)
    options = dict(scope_options or {})
    if "device" in options:
        raise TypeError("scope_options: 'device' is an argument of its own")
    return trio.run(_run, fn, args, kwargs, device, limit, sim, options)


def _worker(
    fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], kwargs: dict[str, Any], own: dict[str, Any]
) -> WorkerReport:
    return run_job(fn, *args, **own, **kwargs)


# --------------------------------------------------------------------------- the driver side


@_final.final
class RemoteJob:
    """A Trio job that runs as a Ray task: ``job.remote(*args)`` returns a
    Ray ``ObjectRef`` of a :class:`WorkerReport`. Made by :func:`remote`."""

    __slots__ = ("_fn", "_own", "_ray_options", "_remote")

    def __init__(
        self, fn: Callable[..., Awaitable[Any]], own: dict[str, Any], ray_options: dict[str, Any]
    ) -> None:
        self._fn = fn
        self._own = own
        self._ray_options = ray_options
        # ray.remote(**options), not .options(): only there does Ray default a GPU
        # task's max_calls to 1, so that a worker process (whose CUDA driver read
        # CUDA_VISIBLE_DEVICES once) never serves a later task given another GPU
        self._remote = ray.remote(**ray_options)(_worker) if ray_options else ray.remote(_worker)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Submit one call: ``await fn(ctx, *args, **kwargs)`` in a Ray worker."""
        return self._remote.remote(self._fn, args, kwargs, self._own)

    def options(self, **options: Any) -> RemoteJob:
        """A copy with other options: trio_cuda's (``device``, ``deadline``,
        ``sim``, ``scope_options``) and Ray's (``num_gpus``, ``num_cpus``,
        ``max_retries``, ...)."""
        own, ray_options = _split(options)
        return RemoteJob(self._fn, {**self._own, **own}, {**self._ray_options, **ray_options})

    def __repr__(self) -> str:
        return (
            f"<trio_cuda.ray.RemoteJob {getattr(self._fn, '__qualname__', self._fn)!r} {self._ray_options}>"
        )


def _split(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    own = {k: v for k, v in options.items() if k in _OWN_OPTIONS}
    if "deadline" in own:
        _check_deadline(own["deadline"])
    return own, {k: v for k, v in options.items() if k not in _OWN_OPTIONS}


def remote(fn: Callable[..., Awaitable[Any]] | None = None, /, **options: Any) -> Any:
    """Make an async function ``fn(ctx, *args)`` a Ray job (a
    :class:`RemoteJob`), as ``@trio_cuda.ray.remote`` or
    ``@trio_cuda.ray.remote(num_gpus=1, max_retries=3)``.

    Options are trio_cuda's (``device``, ``deadline``, ``sim``,
    ``scope_options``: as :func:`run_job`) and Ray's (anything
    ``ray.remote`` takes). Without ``num_gpus``, Ray schedules the task on a
    CPU and the job runs on the simulator."""
    own, ray_options = _split(options)

    def wrap(f: Callable[..., Awaitable[Any]]) -> RemoteJob:
        if not callable(f):
            raise TypeError(f"fn: expected an async function taking a WorkerContext, got {type(f).__name__}")
        return RemoteJob(f, own, ray_options)

    return wrap if fn is None else wrap(fn)
