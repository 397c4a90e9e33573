"""The library's private state, as the tests read and replace it: the one module of the suite
that knows the private attribute names.

Tests check what the public API and the simulator's controls (``gpu.statistics()``,
``gpu.device``, ``DeviceArray.readonly``, ``SimDevice.live_allocations``, ``SimDevice.trace``,
...) cannot show: which allocation a view shares, the submission behind a future, the commands
still queued on a simulated stream, a graph's update in progress, the launch paths of a kernel.
Each function names what it gives; when a private attribute is renamed, only this module
changes. The rest of the private access of the suite is imports of private modules whose
behaviour a test is about (the driver protocol, the simulator's engine, Trio's run state
shim, the tile compiler), each named in that test's imports.
"""

from __future__ import annotations

from typing import Any

import pytest

from trio_cuda._core import _compiled

#: a test of the compiled paths themselves: skipped where they are not in use
compiled_only = pytest.mark.skipif(
    _compiled.ext is None,
    reason="the compiled paths are not in use (not built at install, or TRIO_CUDA_PURE set)",
)

# --------------------------------------------------------------------------- scopes


def driver_of(gpu: Any) -> Any:
    """The driver context (``DeviceContext``) that a scope (or a ``ScopeManager``) runs on."""
    return gpu._driver


def set_driver(gpu: Any, driver: Any) -> None:
    """Run the scope on ``driver`` from now on (a spy wrapping its own driver, say)."""
    gpu._driver = driver
    gpu._completion.driver = driver
    gpu._memory.driver = driver
    gpu._kernels.driver = driver


def loaded_function(gpu: Any, kernel: Any) -> Any:
    """The driver's handle of ``kernel`` as the scope loaded it (loading it on first use)."""
    return gpu._functions[kernel]


def allocation_records(gpu: Any) -> Any:
    """The scope's records of its live allocations (the memory table)."""
    return gpu._memory.allocs


def policy_of(gpu: Any) -> Any:
    """The stream-choosing policy object the scope uses (its own instance)."""
    return gpu._policy


def tracer_of(obj: Any) -> Any:
    """The lifetime tracer recording ``obj`` (a scope, or a ``trio_cuda.trace`` recording)."""
    return obj._tracer


def handoff_task(gpu: Any) -> Any:
    """The scope's completion-handoff task (``None`` while there is none)."""
    return gpu._completion.handoff_task


def handoff_idle(gpu: Any) -> Any:
    """The event the completion-handoff task parks on while the scope is idle, or ``None``."""
    return gpu._completion.idle


def host_steps_pending(gpu: Any) -> Any:
    """The host steps (host closures) the scope has yet to run."""
    return gpu._completion.host_steps


def look_budget(gpu: Any) -> Any:
    """How many looks at the device an awaiting task makes before it parks."""
    return gpu._completion.look_budget


def set_look_budget(gpu: Any, budget: Any) -> None:
    gpu._completion.look_budget = budget


def submit_unwatched(gpu: Any, launch: Any) -> Any:
    """Submit a lone launch as ``run`` does (the handoff is not woken); its submission."""
    return gpu._submit_launch(launch, None)


def completion_of(gpu: Any) -> Any:
    """The scope's completion component (how its work completes)."""
    return gpu._completion


async def completed_unwatched(gpu: Any, make: Any) -> tuple[Any, Any, Any]:
    """On a fresh array ``x`` of ``gpu`` (four floats), ``make(x)`` awaited
    once (its kernel loaded), then submitted unwatched and left to complete
    on a free-running simulator, not retired: (x, the completion, that
    submission)."""
    import trio.testing

    x = gpu.zeros(4, "f4")
    await gpu.run(make(x))
    sub = submit_unwatched(gpu, make(x))
    await trio.testing.wait_all_tasks_blocked()
    return x, completion_of(gpu), sub


def submissions_numbered(gpu: Any) -> int:
    """How many submission ids the scope gave out."""
    return gpu._next_id


def extension_of(gpu: Any, cls: type) -> Any:
    """The scope's per-scope extension object of class ``cls`` (graphs, exports, ...)."""
    return gpu._extensions.find(cls)


def set_load_in_thread(gpu: Any, value: bool) -> None:
    """Load kernels in a worker thread (as the cuda backend does) or not."""
    gpu._kernels.load_in_thread = value


def fake_device_info(monkeypatch: pytest.MonkeyPatch, gpu: Any, info: Any) -> None:
    """Make the scope report ``info`` as its ``gpu.device`` for the rest of the test."""
    monkeypatch.setattr(gpu, "_info", info)


def handoff_ended(manager: Any) -> Any:
    """The event a ``ScopeManager``'s exit waits on for the handoff task's end."""
    return manager._scope._completion.handoff_ended


def set_handoff_ended(manager: Any, event: Any) -> None:
    manager._scope._completion.handoff_ended = event


# --------------------------------------------------------------------------- streams


def queued_commands(stream: Any) -> Any:
    """The commands still queued on a scope stream's simulated stream, oldest first."""
    return stream.handle._queue


def capture_of(stream: Any) -> Any:
    """The simulated stream's capture in progress, or ``None``."""
    return stream.handle._capture


def pending_submissions(stream: Any) -> Any:
    """The stream's marked submissions not yet retired, oldest first."""
    return stream._pending


def unmarked_submissions(stream: Any) -> Any:
    """The stream's submissions enqueued but not yet marked."""
    return stream._unmarked


def done_seq(stream: Any) -> int:
    """The sequence number of the last marker the scope saw done on ``stream``."""
    return stream._done_seq


# --------------------------------------------------------------------------- arrays and futures


def allocation_of(array: Any) -> Any:
    """The allocation behind a ``DeviceArray`` (shared by its views and handles)."""
    return array._alloc


def handle_closed(array: Any) -> bool:
    """Whether this very handle was closed (``DeviceArray.closed`` also says so once the
    allocation was freed or its scope exited)."""
    return bool(array._closed)


def submission_of(future: Any) -> Any:
    """The submission behind a ``DeviceFuture``."""
    return future._sub


def dlpack_device_id(sim: Any) -> int:
    """The device id a ``SimDevice``'s arrays report in ``__dlpack_device__``."""
    return int(sim._dl_id)


def launch_check_of(view: Any) -> Any:
    """The simulator's bounds check behind a view a kernel's reference received."""
    return view._sim_arg.check


# --------------------------------------------------------------------------- graphs


def pending_update(graph: Any) -> Any:
    """A ``CudaGraph``'s update still in the driver, or ``None``."""
    return graph._pending


def executable_of(graph: Any) -> Any:
    """A ``CudaGraph``'s instantiated (executable) graph."""
    return graph._exec


def graph_execs(driver: Any) -> Any:
    """The executable graphs the cuda driver context holds."""
    return driver._graphs.execs


# --------------------------------------------------------------------------- kernels and launches


def fast_launch(kernel: Any) -> Any:
    """The kernel's generated fast launch path, or ``None`` where it has none."""
    return kernel._fast


def set_fast_launch(kernel: Any, fast: Any) -> None:
    kernel._fast = fast


def checked_launch(kernel: Any, args: tuple[Any, ...], config: Any) -> Any:
    """The kernel's checked (reference) launch path: the ``KernelLaunch`` of ``args``."""
    return kernel._launch_checked(args, config)


def checked_launch_function(kernel_class: Any) -> Any:
    """The checked launch path, as the ``Kernel`` class defines it."""
    return kernel_class._launch_checked


def patch_checked_launch(monkeypatch: pytest.MonkeyPatch, kernel_class: Any, fn: Any) -> None:
    monkeypatch.setattr(kernel_class, "_launch_checked", fn)


def accesses_of(launch: Any) -> Any:
    """The accesses (leases to take) of an op or a kernel launch."""
    return launch._accesses


def output_of(launch: Any) -> Any:
    """The value an op or a kernel launch returns when it is awaited."""
    return launch._output


def lease_plan_of(launch: Any) -> Any:
    """A kernel launch's precomputed lease plan, (allocations, simple), or None."""
    plan = launch._lease_plan
    return None if plan is None else (plan, launch._lease_simple)


def function_limits(driver: Any, function: Any) -> Any:
    """The cuda driver's resource limits of a loaded function."""
    return driver._kernels.function_limits(function)


# --------------------------------------------------------------------------- trio_cuda.ray


def check_same_gpus(tray: Any, *args: Any, **kwargs: Any) -> Any:
    """``trio_cuda.ray``'s check that the GPUs Ray assigned match the ones it asked for."""
    return tray._check_same_gpus(*args, **kwargs)


def remote_function_of(job: Any) -> Any:
    """The Ray remote function behind a ``trio_cuda.ray.remote`` job."""
    return job._remote


def default_options_of(remote: Any) -> Any:
    """A Ray remote function's default options."""
    return remote._default_options


def set_output(launch: Any, value: Any) -> None:
    """Try to replace a launch's output (an immutable launch refuses)."""
    launch._output = value


def tile_cache_key(kernel: Any, signature: Any, compiler_version: str | None) -> str:
    """The disk cache key of a tile kernel's cubin, with the installed cuTile's version."""
    from trio_cuda._tile import compile as tc

    return tc._cache_key(kernel, signature, compiler_version)


# --------------------------------------------------------------------------- completion


#: the completion's steps that ``patch_completion_steps`` instruments
_STEPS = ("retire", "quarantine_submission", "run_host_step")


def completion_steps() -> tuple[Any, ...]:
    """The scope's own retire, quarantine and host-step methods (``Completion``),
    each called with the scope first, to call from the instrumented ones that
    ``patch_completion_steps`` installs."""
    from trio_cuda._core._completion import Completion

    def on_scope(real: Any) -> Any:  # the real one, captured before any patch
        return lambda scope, *args, **kwargs: real(scope._completion, *args, **kwargs)

    return tuple(on_scope(getattr(Completion, name)) for name in _STEPS)


def patch_completion_steps(
    monkeypatch: pytest.MonkeyPatch, *, retire: Any, quarantine: Any, host_step: Any
) -> None:
    """Replace how every scope retires a submission, quarantines one and runs
    a host step; each replacement is called with the scope first (the
    compiled common case of retiring is turned off: every retirement goes
    through the replacement)."""
    from trio_cuda._core import _completion
    from trio_cuda._core._completion import Completion

    monkeypatch.setattr(_completion, "retire_done", None)

    def on_completion(fn: Any) -> Any:
        return lambda completion, *args, **kwargs: fn(completion.scope, *args, **kwargs)

    for name, fn in zip(_STEPS, (retire, quarantine, host_step), strict=True):
        monkeypatch.setattr(Completion, name, on_completion(fn))


def conflict_mode(gpu: Any) -> Any:
    """The scope's ``conflicts=`` mode ("order" or "error")."""
    return gpu._conflicts


def uses_direct_calls(scope: Any) -> bool:
    """Whether ``scope``'s CUDA context launches through the direct driver calls."""
    return scope._driver._kernels._direct is not None


def uses_hot_methods(scope: Any) -> bool:
    """Whether ``scope``'s CUDA context launches, records and polls markers
    through the compiled hot methods (``direct.hot_methods``)."""
    d = scope._driver
    return all(type(m).__name__.startswith("Hot") for m in (d.launch, d.record_marker, d.poll_marker))
