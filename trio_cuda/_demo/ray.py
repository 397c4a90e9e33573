"""The batch job on a Ray cluster: ``python -m trio_cuda demo --ray [auto|local|ADDRESS]``.

The inputs of the batch are split into contiguous shards, one per GPU of the
cluster (or one per CPU worker, on the simulator). Each shard is a
:mod:`trio_cuda.ray` job running ``batch``'s engine in its worker's one
scope (``shard``); this module connects, runs and collects. (``import ray``
here is Ray itself; the library's :mod:`trio_cuda.ray` is ``..ray``.)

Invariants:

* Importing this module never imports Ray: the command line's options are
  defined here, and Ray is imported only when ``--ray`` is given.
* One global deadline, an absolute wall-clock time fixed once every worker
  is warm (its kernels loaded), cancels every shard's work in flight; the
  driver's backstop (``ray.cancel`` a grace period after the deadline, then
  by force) bounds how long it waits for a report.
* The driver keeps one report per shard (a shard that Ray retried after its
  worker died is redone from its start: shards are idempotent) and checks
  each input once (``shard.verify``). A shard that never reports is a
  failed check, never a silent loss.
* Connecting is bounded: an address that does not take a TCP connection is
  refused at once, and ``ray.init`` gets :data:`CONNECT_TIMEOUT` seconds.
* Ctrl-C on the driver cancels the shards with ``ray.cancel`` (each drains
  its scope and still reports); a second Ctrl-C stops them by force.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from .._core._errors import TrioCudaError
from .batch import BatchConfig
from .output import Output
from .shard import (
    RayReport,
    ShardResult,
    ShardSpec,
    first_line,
    shard_job,
    split,
    summarize,
    verify,
    warm_up_job,
)

__all__ = ["ClusterUnavailableError", "add_options", "maybe_run_on_ray", "run_on_ray"]

#: Ray's retries of a shard whose worker died
MAX_RETRIES = 3
#: seconds to wait for a TCP answer, and for ray.init to join a cluster that answered
PROBE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 60.0
#: seconds to wait for the workers to start and load the kernels
WARM_UP_TIMEOUT = 120.0
#: seconds between two looks at the shards, and between two "still waiting" lines (-v)
TICK = 0.1
WAITING_INTERVAL = 5.0

RAY_EPILOG = """\
on a Ray cluster (--ray): the inputs are split into one shard per GPU of the
cluster (one per CPU worker, on the simulator, with --device sim or when the
cluster has no GPU); each shard runs the batch in a Ray worker, in one scope,
and the deadline is one wall-clock time for all of them, counted from when
every worker has loaded the kernels. The driver checks every completed result
against NumPy once, and prints each shard's summary and the total. --ray auto
joins the cluster that RAY_ADDRESS or a running local instance names, and
starts a local one (no dashboard) when none answers; --ray local always starts
one; --ray HOST:PORT joins that one or fails. A shard whose worker dies is
retried by Ray (up to 3 times) from its start. --ray-kill-worker SHARD is a
testing aid: that shard's worker kills itself (SIGKILL) half-way through its
first attempt.
"""


class ClusterUnavailableError(TrioCudaError):
    """The Ray cluster cannot run the job (no answer, no GPU or CPU for the
    shards, workers that do not start); the message says why."""


# --------------------------------------------------------------------------- connecting


def _parse_address(text: str) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` or ``ray://HOST:PORT``; ValueError otherwise."""
    rest = text[len("ray://") :] if text.startswith("ray://") else text
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(text)
    return host, int(port)


def _ray_address(text: str) -> str:
    """argparse ``type`` of ``--ray``."""
    if text in ("auto", "local"):
        return text
    try:
        _parse_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto', 'local', HOST:PORT or ray://HOST:PORT, got {text!r}"
        ) from None
    return text


def _answers(address: str) -> str | None:
    """None if something accepts a TCP connection at ``address``, else why not."""
    try:
        host, port = _parse_address(address)
    except ValueError:
        return f"{address!r} is not HOST:PORT"
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT):
            return None
    except TimeoutError:
        return f"no answer within {PROBE_TIMEOUT:g} s"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()


def _auto_address() -> tuple[str | None, str]:
    """The cluster ``ray.init(address="auto")`` would join, if it answers:
    (address, "") or (None, why none). ``"auto"`` where Ray cannot tell."""
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:  # another Ray version: let ray.init look
        return "auto", ""
    try:
        found = get_ray_address_from_environment("auto", None)
    except ConnectionError:
        return None, "no Ray cluster is running here"
    except Exception:  # another Ray version
        return "auto", ""
    if not isinstance(found, str) or found == "auto":
        return "auto", ""
    why = _answers(found)
    if why is not None:
        return None, f"the Ray cluster at {found} does not answer ({why})"
    return found, ""


def _init(prog: str, **options: Any) -> None:
    """``ray.init``, bounded: a cluster that takes the TCP connection and never
    answers Ray makes it wait for minutes. Past :data:`CONNECT_TIMEOUT` the
    process ends with exit status 2 (nothing was started to clean up)."""
    import ray

    address = options.get("address")

    def give_up() -> None:
        print(
            f"{prog}: error: --ray: the Ray cluster at {address} did not accept the driver "
            f"within {CONNECT_TIMEOUT:g} s",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)

    watchdog = threading.Timer(CONNECT_TIMEOUT, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        ray.init(**options)
    finally:
        watchdog.cancel()


def connect(address: str, *, verbose: int = 0, prog: str = "demo") -> str:
    """Connect this process to a Ray cluster as ``--ray address`` says; a line
    saying how. Raises :class:`ClusterUnavailableError` when an explicit
    address does not answer."""
    common: dict[str, Any] = {
        "logging_level": logging.INFO if verbose >= 2 else logging.WARNING,
        "log_to_driver": True,
    }

    def start_local(why: str) -> str:
        os.environ.pop("RAY_ADDRESS", None)  # the local cluster's workers must not look elsewhere
        _init(prog, address="local", include_dashboard=False, **common)
        return f"started a local Ray cluster{why}"

    if address == "local":
        return start_local("")
    if address == "auto":
        found, why = _auto_address()
        if found is None:
            return start_local(f" ({why})")
        if found == "auto":  # this Ray cannot be asked where: ray.init looks
            try:
                _init(prog, address="auto", **common)
            except ConnectionError as exc:
                return start_local(f" ({first_line(exc)})")
            return f"joined the Ray cluster at {_gcs_address('auto')}"
        address = found
    else:
        why_not = _answers(address)
        if why_not is not None:
            raise ClusterUnavailableError(f"no Ray cluster answers at {address} ({why_not})")
    os.environ.pop("RAY_ADDRESS", None)  # ray.init would prefer it to the address given
    _init(prog, address=address, **common)
    return f"joined the Ray cluster at {_gcs_address(address)}"


def _gcs_address(fallback: str) -> str:
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return fallback


def _describe_cluster(resources: dict[str, float]) -> str:
    import ray

    try:
        nodes = len([n for n in ray.nodes() if n.get("Alive")])  # type: ignore[no-untyped-call]
    except Exception:
        nodes = 0
    cpus, gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
    return f"{nodes} node(s), {cpus} CPU(s), {gpus or 'no'} GPU(s)"


# --------------------------------------------------------------------------- running the shards


def _grace(config: BatchConfig) -> float:
    """Seconds after the deadline before the backstop cancels a shard: enough
    for a scope to retire everything its places can have queued."""
    return 10.0 + 2 * config.concurrency * config.kernel_ms / 1e3


def run_on_ray(
    config: BatchConfig,
    *,
    shards: int | None = None,
    kill_shard: int | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    grace: float | None = None,
    connected: str = "",
) -> RayReport:
    """Run the batch on the Ray cluster this process is connected to; print
    what happens and the summary to ``out`` (stdout). ``shards``: how many
    (default: one per GPU, or per CPU on the simulator). ``kill_shard``: a
    testing aid (see :data:`RAY_EPILOG`). ``grace``: seconds after the
    deadline before the backstop cancels the shards still running.
    ``connected``: how this process reached the cluster (the first line).

    Raises :class:`ClusterUnavailableError` before the deadline starts when
    the cluster cannot run the shards."""
    output = Output(
        sys.stdout if out is None else out,
        (sys.stderr or sys.stdout) if err is None else err,
        verbose=config.verbose,
        progress="none",
    )
    with output:
        if connected:
            output.say(f"ray: {connected}")
        return _run(config, output, shards, kill_shard, grace)


def _gpus_per_node() -> int:
    """The most GPUs any live node of the cluster has."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return max((int(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive")), default=0)


def _plan(config: BatchConfig, shards: int | None) -> tuple[bool, int, dict[str, float]]:
    """(on GPUs, how many shards, the cluster's resources)."""
    import ray

    resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    if config.device.startswith("cuda:"):
        raise ClusterUnavailableError(
            f"--device {config.device}: Ray assigns each shard its GPU; use auto, cuda or sim"
        )
    if config.device == "cuda" and not gpus:
        raise ClusterUnavailableError("--device cuda: the Ray cluster has no GPU")
    use_gpus = config.device in ("auto", "cuda") and gpus > 0
    workers = gpus if use_gpus else cpus
    if workers < 1:
        raise ClusterUnavailableError(f"the Ray cluster has no {'GPU' if use_gpus else 'CPU'} for a shard")
    return use_gpus, min(shards or workers, config.inputs), resources


def _run(
    config: BatchConfig, output: Output, shards: int | None, kill_shard: int | None, grace: float | None
) -> RayReport:
    import ray

    from .. import ray as trio_cuda_ray

    say = output.say
    use_gpus, count, resources = _plan(config, shards)
    report = RayReport(config, use_gpus=use_gpus, cluster=_describe_cluster(resources))
    parts = split(config.inputs, count)
    report.shards = [ShardResult(i, part) for i, part in enumerate(parts)]
    if kill_shard is not None and not 0 <= kill_shard < count:
        raise ClusterUnavailableError(
            f"--ray-kill-worker: expected a shard from 0 to {count - 1}, got {kill_shard}"
        )
    where = "one per GPU" if use_gpus else "one per CPU worker, on the simulator"
    deadline = "none" if math.isinf(config.deadline) else f"{config.deadline:.3f} s"
    say(
        f"trio_cuda batch job on Ray: {config.inputs} inputs of {config.size} float32 in {count} "
        f"shard(s) ({where}), {config.concurrency} at a time per shard on {config.streams} streams, "
        f"deadline {deadline}, {config.kernel_ms:g} ms per launch"
    )
    say(f"cluster: {report.cluster}")
    resource: dict[str, Any] = {"num_gpus": 1} if use_gpus else {"num_cpus": 1}
    if use_gpus and _gpus_per_node() <= 1:
        # one GPU per node: a worker process always gets the same GPU, so it may serve
        # several shards and stay warm (Ray's default for GPU tasks is a fresh process
        # each, since a process keeps the CUDA_VISIBLE_DEVICES it started with)
        resource["max_calls"] = 0
    elif use_gpus:
        say(
            "several GPUs per node: every shard starts a fresh worker process; "
            "its start counts against the deadline"
        )
    job = trio_cuda_ray.remote(
        shard_job,
        device="auto" if use_gpus else "sim",
        sim={"kernel_time": config.kernel_ms / 1e3},
        scope_options={"streams": config.streams},
        max_retries=MAX_RETRIES,
        **resource,
    )
    started = time.perf_counter()

    # Warm-up: start the workers and load the kernels before the deadline starts.
    warmer = trio_cuda_ray.remote(
        warm_up_job, device="auto" if use_gpus else "sim", sim={"kernel_time": 0.0}, **resource
    )
    workers = int(resources.get("GPU" if use_gpus else "CPU", 1))
    refs = [warmer.remote() for _ in range(min(count, workers))]
    t0 = time.perf_counter()
    try:
        ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=WARM_UP_TIMEOUT)
        if not_ready:
            for ref in not_ready:
                ray.cancel(ref, force=True)
            raise ClusterUnavailableError(
                f"{len(not_ready)} of {len(refs)} worker(s) did not start within {WARM_UP_TIMEOUT:g} s"
            )
        try:
            warm = ray.get(ready, timeout=WARM_UP_TIMEOUT)
        except ray.exceptions.RayError as exc:  # a worker that died at its start
            raise ClusterUnavailableError(f"a worker could not start: {first_line(exc)}") from None
        devices = []
        for rep in warm:
            if rep.error is not None:
                raise ClusterUnavailableError(f"a worker could not start: {first_line(rep.error)}")
            devices.append(f"{rep.backend} {rep.device}")
    except KeyboardInterrupt:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise
    report.warm_up = time.perf_counter() - t0
    kinds = sorted(set(devices))
    say(
        f"warm-up: {len(refs)} worker(s) ready ({', '.join(kinds)}), kernels loaded in "
        f"{report.warm_up:.3f} s (before the deadline starts)"
    )

    deadline_at = time.time() + config.deadline
    submitted = job.options(deadline=None if math.isinf(deadline_at) else deadline_at)
    pending: dict[Any, ShardResult] = {}
    for sr in report.shards:
        spec = ShardSpec(
            sr.shard,
            sr.inputs.start,
            sr.inputs.stop,
            config,
            kill_after=max(1, len(sr.inputs) // 2) if sr.shard == kill_shard else 0,
            driver_pid=os.getpid(),
        )
        pending[submitted.remote(spec)] = sr
        output.detail(
            f"shard {sr.shard}: inputs {sr.inputs.start} to {sr.inputs.stop - 1} submitted"
            + (" (its worker kills itself half-way through its first attempt)" if spec.kill_after else "")
        )
    _collect(report, pending, output, deadline_at, _grace(config) if grace is None else grace)
    report.elapsed = time.perf_counter() - started
    verify(report, output)
    summarize(report, output)
    return report


def _collect(
    report: RayReport, pending: dict[Any, ShardResult], output: Output, deadline_at: float, grace: float
) -> None:
    """Wait for every shard's report: bounded by the deadline plus the
    backstop's grace periods, or by Ctrl-C."""
    import ray

    soft_at = deadline_at + grace
    force_at = soft_at + grace
    give_up_at = force_at + grace
    soft_sent = force_sent = False
    started = time.perf_counter()
    next_waiting = started + WAITING_INTERVAL
    done = 0
    while pending:
        try:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=TICK)
            for ref in ready:
                sr = pending[ref]
                try:
                    sr.report = ray.get(ref, timeout=30)
                except ray.exceptions.GetTimeoutError:
                    continue  # ready but not yet here: next round
                except ray.exceptions.TaskCancelledError as exc:
                    # A task that was running returns its report when cancelled (its job
                    # ends as Trio cancellation); this one never started, unless by force.
                    sr.never_ran = not force_sent
                    sr.lost = "cancelled before it started" if sr.never_ran else first_line(exc)
                except Exception as exc:  # the task failed for good (its retries spent)
                    sr.lost = first_line(exc)
                del pending[ref]
                done += 1
                _progress(output, sr, done, len(report.shards), time.perf_counter() - started)
            now = time.time()
            if now >= soft_at and not soft_sent and pending:
                soft_sent = True
                report.backstop = sorted(sr.shard for sr in pending.values())
                output.say(
                    f"backstop: {len(pending)} shard(s) {report.backstop} still running {grace:g} s "
                    f"after the deadline: cancelling them (ray.cancel)"
                )
                for ref in pending:
                    ray.cancel(ref)
            if now >= force_at and not force_sent and pending:
                force_sent = True
                _force(report, pending, output)
            if now >= give_up_at:
                for sr in pending.values():
                    sr.lost = "no report: the driver stopped waiting"
                pending.clear()
            if output.verbose >= 1 and time.perf_counter() >= next_waiting and pending:
                next_waiting = time.perf_counter() + WAITING_INTERVAL
                output.detail(
                    f"waiting for shard(s) {sorted(sr.shard for sr in pending.values())}, "
                    f"{time.perf_counter() - started:.1f} s"
                )
        except KeyboardInterrupt:
            now = time.time()
            if not report.interrupted:
                report.interrupted = True
                output.say("Ctrl-C: cancelling the shards (ray.cancel); each drains its scope and reports")
                for ref in pending:
                    ray.cancel(ref)
                soft_sent = True
                force_at = min(force_at, now + grace)
                give_up_at = min(give_up_at, now + 2 * grace)
            else:
                output.say("Ctrl-C again: stopping the shards by force")
                _force(report, pending, output)
                force_sent = True
                give_up_at = min(give_up_at, now + 2.0)


def _force(report: RayReport, pending: dict[Any, ShardResult], output: Output) -> None:
    import ray

    report.forced = sorted(sr.shard for sr in pending.values())
    output.say(f"backstop: stopping shard(s) {report.forced} by force (their workers are killed)")
    for ref in pending:
        try:
            ray.cancel(ref, force=True)
        except Exception as exc:  # already finished, or its worker gone
            output.detail(f"ray.cancel(force=True): {first_line(exc)}")


def _progress(output: Output, sr: ShardResult, done: int, total: int, elapsed: float) -> None:
    rep = sr.report
    if output.verbose >= 1:
        if rep is None:
            output.detail(f"shard {sr.shard}: no report ({sr.lost})")
        else:
            s = sr.summary
            finished = "" if s is None else f"{s.completed} done, {s.cancelled_total} cancelled, "
            how = f"cancelled ({rep.cancelled})" if rep.cancelled else "failed" if rep.error else "finished"
            output.detail(
                f"shard {sr.shard}: {how} on {rep.hostname} pid {rep.pid}, attempt {rep.attempt}: "
                f"{finished}{rep.elapsed:.3f} s in its scope"
            )
    if output.progress != "none" or output.verbose >= 1:
        output.say(f"progress: {done:3d}/{total} shard(s) reported, {elapsed:6.3f} s")


# --------------------------------------------------------------------------- command line


def add_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--ray`` and its options to the demo's ``parser`` (Ray is not imported)."""
    group = parser.add_argument_group("on a Ray cluster")
    group.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="auto|local|ADDRESS",
        type=_ray_address,
        help="run the shards on a Ray cluster: 'auto' (the default value) joins a running one or "
        "starts a local one; 'local' starts one; HOST:PORT joins that one",
    )
    group.add_argument(
        "--ray-shards",
        type=_positive,
        metavar="N",
        help="shards (default: one per GPU of the cluster, or per CPU on the simulator)",
    )
    group.add_argument(
        "--ray-kill-worker",
        type=_natural,
        metavar="SHARD",
        help="testing aid: that shard's worker kills itself (SIGKILL) half-way through its first "
        "attempt, so that Ray retries the shard",
    )
    parser.epilog = (parser.epilog or "") + "\n" + RAY_EPILOG


def _natural(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = _natural(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def maybe_run_on_ray(args: argparse.Namespace, config: BatchConfig) -> int | None:
    """``demo --ray ...``: connect, run, summarize; the exit status (0 ok, 1 a
    check failed, 2 the job could not run, 130 interrupted). None without
    ``--ray`` (the demo runs here). ``args``: the parsed command line (the
    options :func:`add_options` adds among them); ``config``: the batch its
    other options describe."""
    prog = getattr(args, "demo_prog", "batch_job")
    address: str | None = getattr(args, "ray", None)

    def error(text: str) -> int:
        print(f"{prog}: error: {text}", file=sys.stderr)
        return 2

    if address is None:
        given = [o for o in ("ray_shards", "ray_kill_worker") if getattr(args, o, None) is not None]
        return error(f"--{given[0].replace('_', '-')}: only with --ray") if given else None

    if getattr(args, "trace", None) is not None:
        return error("--trace: not available with --ray (the scopes live in the Ray workers)")
    if config.device.startswith("cuda:"):
        return error(f"--device {config.device}: Ray assigns each shard its GPU; use auto, cuda or sim")
    try:
        import ray
    except ImportError:
        return error("--ray: Ray is not installed (pip install 'trio_cuda[ray]')")
    status = 0
    try:
        try:
            how = connect(address, verbose=config.verbose, prog=prog)
        except ClusterUnavailableError as exc:
            return error(f"--ray {address}: {exc}")
        except Exception as exc:  # Ray could not start a cluster, or refused the driver
            return error(f"--ray {address}: {first_line(exc)}")
        report = run_on_ray(config, shards=args.ray_shards, kill_shard=args.ray_kill_worker, connected=how)
        status = 130 if report.interrupted else 0 if report.ok else 1
    except ClusterUnavailableError as exc:
        status = error(f"--ray {address}: {exc}")
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        status = 130
    finally:
        with _ignoring_interrupts():
            ray.shutdown()
    return status


@contextlib.contextmanager
def _ignoring_interrupts() -> Iterator[None]:
    """Ctrl-C does not stop the cluster's shutdown half-way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
