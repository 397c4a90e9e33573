"""Several simulated GPUs of one host: peer copies and cross-device waits.

A :class:`SimHost` joins fresh :class:`~trio_cuda.testing.SimDevice` objects
into one simulated machine, so that scopes on different devices can copy
between their memories and order their streams after each other, as
``cuMemcpyPeerAsync`` and ``cuStreamWaitEvent`` do on a real multi-GPU host.

Invariants:

* Each device of a host keeps its own engine, memory, memcheck, faults and
  controls (``hold``, ``release``, ``complete_next``, ``run_until_idle``,
  ``inject_fault``, ``violations``, ``live_allocations``): a fault on one
  device never touches another's queues. The host's controls act on all.
* Address spaces are disjoint: device ``i`` of a host allocates from its own
  1 TiB window, so an address of one device is never live memory of another,
  and memcheck catches a device touching another's memory except through a
  peer copy.
* A stream may wait (``wait_marker``) on a marker of any device of its host.
  When the marker executes, its device hands the waiting streams to the host
  (``SimHost.wake_waiters``), which makes them ready on their own devices'
  engines; those run their bookkeeping at once (a held device still runs
  bookkeeping, not work), through one re-entrancy-safe kick loop per host.
* A peer copy is one work command on the stream that enqueued it. It resolves
  its source in the source device's memory and its destination in the
  destination device's when it *executes*, so a use after free on either side
  is a violation of the device whose memory it touched. Between devices
  without peer access (:meth:`SimHost.disable_peer_access`) the copy is
  staged through host memory: the same bytes, twice the ``copy_time``, and
  counted as staged.
* The host owns its counters and its kick loop; the engines reach them only
  through its internal interface, ``wake_waiters`` and ``count_peer_copy``
  (the engine that executes a peer copy counts it there).
* Everything runs on one thread (the Trio loop or synchronous test code).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..._core._final import final
from .. import _common
from .clock import SimClock
from .context import SimContext
from .device import BASE_ADDRESS, SimDevice, engine_of
from .engine import Command, SimEngine
from .records import Violation

if TYPE_CHECKING:
    from .handles import SimStream
    from .records import SimAllocation

__all__ = ["SimHost", "SimHostStatistics"]

#: address window of each device of a host (device i starts at base + i * span)
_SPAN = 1 << 40
_MAX_DEVICES = 64


@final
@attrs.frozen
class SimHostStatistics:
    """Counters of a :class:`SimHost` (a snapshot)."""

    devices: int  #: the host's simulated devices
    peer_copies: int  #: copies between two devices that executed
    staged_copies: int  #: of those, staged through host memory (no peer access)
    peer_bytes: int  #: bytes moved by peer copies
    cross_device_waits: int  #: waits on another device's marker that were released


def _check_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_DEVICES:
        raise ValueError(f"devices: expected an int from 1 to {_MAX_DEVICES} or SimDevices, got {value!r}")
    return value


@final
class SimHost:
    """Simulated GPUs of one machine that can copy between each other.

    ``SimHost(2)`` makes two fresh devices (``sim0``, ``sim1``; keyword
    arguments such as ``kernel_time`` or ``memory`` go to each
    :class:`~trio_cuda.testing.SimDevice`); ``SimHost([dev_a, dev_b])`` joins
    devices that have not allocated anything yet. ``peer_access`` says whether
    every pair starts with peer access (else copies are staged through host
    memory). Open a scope per device with ``open_scope(device=host[i])`` or
    all at once with ``trio_cuda.open_device_pool(host)``.
    """

    __slots__ = (
        "__weakref__",
        "_cross_waits",
        "_devices",
        "_kicking",
        "_kicks",
        "_no_peer",
        "_peer_bytes",
        "_peer_copies",
        "_staged_copies",
    )

    def __init__(self, devices: int | Sequence[SimDevice] = 2, *, peer_access: bool = True, **options: Any):
        if isinstance(devices, int):
            n = _check_count(devices)
            if "name" in options:
                raise TypeError(
                    "name: SimHost names its devices sim0, sim1, ...; pass SimDevices to name them"
                )
            made = [SimDevice(name=f"sim{i}", **options) for i in range(n)]
        else:
            if options:
                raise TypeError(
                    f"SimHost: device options ({', '.join(sorted(options))}) only apply with a device count"
                )
            made = list(devices)
            _check_count(len(made))
            for i, d in enumerate(made):
                if not isinstance(d, SimDevice):
                    raise TypeError(f"devices[{i}]: expected a SimDevice, got {type(d).__name__}")
                if engine_of(d).host is not None:
                    raise ValueError(f"devices[{i}]: {d.name!r} already belongs to a SimHost")
                if not engine_of(d).is_fresh():
                    raise ValueError(
                        f"devices[{i}]: expected a fresh SimDevice (nothing allocated or enqueued), got {d!r}"
                    )
            if len({id(d) for d in made}) != len(made):
                raise ValueError("devices: expected distinct SimDevices, got one twice")
        if not isinstance(peer_access, bool):
            raise TypeError(f"peer_access: expected a bool, got {peer_access!r}")
        clock = SimClock.merged(engine_of(d).clock() for d in made)  # one time for all: their times compare
        for i, d in enumerate(made):
            engine_of(d).join_host(self, clock, BASE_ADDRESS + i * _SPAN, i)
        self._devices: tuple[SimDevice, ...] = tuple(made)
        self._no_peer: set[frozenset[int]] = set()
        if not peer_access:
            for i in range(len(made)):
                for j in range(i + 1, len(made)):
                    self._no_peer.add(frozenset((i, j)))
        self._kicks: dict[SimDevice, None] = {}
        self._kicking = False
        self._peer_copies = 0
        self._staged_copies = 0
        self._peer_bytes = 0
        self._cross_waits = 0

    # ------------------------------------------------------------------ devices
    @property
    def devices(self) -> tuple[SimDevice, ...]:
        """The host's devices, by ordinal."""
        return self._devices

    def __len__(self) -> int:
        return len(self._devices)

    def __getitem__(self, index: int) -> SimDevice:
        return self._devices[index]

    def __iter__(self) -> Iterator[SimDevice]:
        return iter(self._devices)

    def __repr__(self) -> str:
        return f"<SimHost of {len(self._devices)} devices: {', '.join(d.name for d in self._devices)}>"

    def _ordinal(self, device: SimDevice | int, label: str) -> int:
        if isinstance(device, SimDevice):
            if engine_of(device).host is not self:
                raise ValueError(f"{label}: expected a device of this SimHost, got {device.name!r}")
            return next(i for i, d in enumerate(self._devices) if d is device)
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < len(self._devices):
            raise ValueError(
                f"{label}: expected a SimDevice of this host or an ordinal below {len(self._devices)}, "
                f"got {device!r}"
            )
        return device

    # ------------------------------------------------------------------ peer access
    def can_access_peer(self, a: SimDevice | int, b: SimDevice | int) -> bool:
        """True if copies between ``a`` and ``b`` go directly (peer access),
        False if they are staged through host memory."""
        i, j = self._ordinal(a, "a"), self._ordinal(b, "b")
        return i == j or frozenset((i, j)) not in self._no_peer

    def enable_peer_access(self, a: SimDevice | int, b: SimDevice | int) -> None:
        """Let ``a`` and ``b`` copy directly (both ways)."""
        self._no_peer.discard(frozenset((self._ordinal(a, "a"), self._ordinal(b, "b"))))

    def disable_peer_access(self, a: SimDevice | int, b: SimDevice | int) -> None:
        """Stage copies between ``a`` and ``b`` through host memory (as on a
        machine without a peer link); applies to copies enqueued from now on."""
        i, j = self._ordinal(a, "a"), self._ordinal(b, "b")
        if i != j:
            self._no_peer.add(frozenset((i, j)))

    # ------------------------------------------------------------------ controls
    def hold(self) -> None:
        """Hold every device (see :meth:`SimDevice.hold`)."""
        for d in self._devices:
            d.hold()

    def release(self) -> None:
        """Release every device (see :meth:`SimDevice.release`)."""
        for d in self._devices:
            d.release()

    def complete_next(self) -> bool:
        """Execute one runnable work command: the oldest by enqueue time among
        the stream heads of all devices. False if none was runnable."""
        best: SimDevice | None = None
        best_t = 0.0
        for d in self._devices:
            eng = engine_of(d)
            eng.settle()
            for s in eng.busy_streams():
                head = s.head()
                if head.work and (best is None or head.t_enqueue < best_t):
                    best, best_t = d, head.t_enqueue
        if best is None:
            return False
        return best.complete_next()

    def run_until_idle(self) -> int:
        """Execute runnable commands on every device until none is runnable
        (held devices stay held). Returns the number of work commands run."""
        count = 0
        while self.complete_next():
            count += 1
        return count

    @property
    def pending(self) -> int:
        """Commands enqueued on any device and not executed yet."""
        return sum(d.pending for d in self._devices)

    @property
    def violations(self) -> list[Violation]:
        """Memcheck records of every device, by device (a snapshot)."""
        return [v for d in self._devices for v in d.violations]

    @property
    def live_allocations(self) -> list[SimAllocation]:
        """Allocations not yet freed on any device (a snapshot)."""
        return [a for d in self._devices for a in d.live_allocations]

    def statistics(self) -> SimHostStatistics:
        """Counters of the host (a snapshot)."""
        return SimHostStatistics(
            devices=len(self._devices),
            peer_copies=self._peer_copies,
            staged_copies=self._staged_copies,
            peer_bytes=self._peer_bytes,
            cross_device_waits=self._cross_waits,
        )

    # ------------------------------------------------------------------ the engines' interface
    def wake_waiters(self, engine: SimEngine, waiters: list[SimStream]) -> None:
        """A marker of ``engine``'s device executed: the streams waiting on it
        (of any device of this host) may run their wait now."""
        foreign: list[SimDevice] = []
        for w in waiters:
            eng = w.context.engine
            eng.mark_ready(w)
            if eng is not engine:
                d = eng.device
                self._cross_waits += 1
                if d not in foreign:
                    foreign.append(d)
        for d in foreign:
            self._kick(d)

    def count_peer_copy(self, staged: bool, nbytes: int) -> None:
        """Count a peer copy that executed (``staged`` through host memory),
        and the bytes it moved."""
        self._peer_copies += 1
        if staged:
            self._staged_copies += 1
        self._peer_bytes += nbytes

    def _kick(self, device: SimDevice) -> None:
        """Let ``device`` run the bookkeeping its streams became ready for.
        Re-entrant calls (a kick that completes a marker another device waits
        on) only queue the device; the outermost call runs them all."""
        self._kicks[device] = None
        if self._kicking:
            return
        self._kicking = True
        try:
            while self._kicks:
                d = next(iter(self._kicks))
                del self._kicks[d]
                engine_of(d).pump()  # a device already pumping picks its dirty streams up itself
        finally:
            self._kicking = False


# --------------------------------------------------------------------------- the contexts' peer copies


def check_copy_peer(ctx: SimContext, dst_context: object, src_context: object) -> None:
    """``SimContext.check_copy_peer``: raise unless the devices can copy."""
    for label, c in (("dst", dst_context), ("src", src_context)):
        if not isinstance(c, SimContext):
            raise _common.foreign_context(label, c, "a simulated device")
    assert isinstance(dst_context, SimContext)
    assert isinstance(src_context, SimContext)
    dev = ctx.device
    sd = src_context.device
    dd = dst_context.device
    if sd is dd and dd is dev:
        return
    host = ctx.engine.host
    if host is None or src_context.engine.host is not host or dst_context.engine.host is not host:
        names = ", ".join(sorted({dev.name, sd.name, dd.name}))
        raise ValueError(
            f"copy: expected simulated devices of one SimHost, got {names} (make them with "
            f"trio_cuda.testing.SimHost to copy between them)"
        )


def copy_peer(
    ctx: SimContext,
    s: SimStream,
    dst: int,
    dst_context: object,
    src: int,
    src_context: object,
    nbytes: int,
) -> object | None:
    """``SimContext.copy_peer``: see the module invariants."""
    _common.check_peer_contexts(dst_context, src_context, SimContext)
    check_copy_peer(ctx, dst_context, src_context)
    assert isinstance(dst_context, SimContext)
    assert isinstance(src_context, SimContext)
    nbytes = _common.check_count("nbytes", nbytes)
    dev = ctx.device
    sd = src_context.device
    dd = dst_context.device
    if sd is dd and dd is dev:
        ctx.copy_d2d(s, dst, src, nbytes)
        return None
    eng = ctx.engine
    host = eng.host
    assert host is not None  # check_copy_peer: devices of one host
    staged = not host.can_access_peer(sd, dd)
    how = "staged" if staged else "peer"
    label = f"{how} copy {nbytes} B {sd.name}->{dd.name}"
    duration = dev.copy_time * (2.0 if staged else 1.0)
    peers = (src_context.engine, dst_context.engine, staged)
    eng.enqueue(s, Command("peer", eng.next_seq(), label, duration, peers, dst=dst, src=src, nbytes=nbytes))
    return None
