"""The simulated device: a deterministic GPU for machines without one, and for tests.

Invariants:

* Importing this package never imports ``cuda``.
* Modules, one concept each, importing only downward in this order:
  ``clock`` (the device time: Trio's clock inside a run, ``perf_counter``
  outside), ``records`` (what the device records and reports), ``views``
  (the bounds-checked views a reference gets), ``launch_errors`` (what a
  launch's CPU behaviour raises, and how it names arguments), ``handles`` (streams,
  markers, gates, loaded kernels, graphs; a stream owns its queue, markers
  and errors), ``engine`` (memory, memcheck, faults and the scheduling of
  the streams' commands: the device-wide mutable state),
  ``context`` (:class:`SimContext`, the DeviceContext of one scope),
  ``device`` (:class:`SimDevice`: settings and test controls; it holds its
  engine as a field), ``host`` (:class:`SimHost`: several devices of one machine).
  ``context`` reaches ``host`` only through imports inside the functions
  that need it (peer copies); ``engine`` only through its ``host``
  attribute (cross-device waits, the host's peer-copy counters).
* Checks and errors the cuda backend raises alike come from
  ``trio_cuda._backends._common``.
* The names below are this package's import surface (tests monkeypatch
  classes through it; ``trio_cuda.testing`` re-exports the public ones).
"""

from .context import DLPACK_SIM_DEVICE as DLPACK_SIM_DEVICE
from .context import SimContext as SimContext
from .device import SimDevice as SimDevice
from .handles import SimFunction as SimFunction
from .handles import SimGate as SimGate
from .handles import SimGraph as SimGraph
from .handles import SimGraphExec as SimGraphExec
from .handles import SimMarker as SimMarker
from .handles import SimStream as SimStream
from .host import SimHost as SimHost
from .host import SimHostStatistics as SimHostStatistics
from .records import FaultKind as FaultKind
from .records import SimAllocation as SimAllocation
from .records import SimCommandRecord as SimCommandRecord
from .records import SimStatistics as SimStatistics
from .records import Violation as Violation
from .records import ViolationKind as ViolationKind

__all__ = [
    "DLPACK_SIM_DEVICE",
    "FaultKind",
    "SimAllocation",
    "SimCommandRecord",
    "SimContext",
    "SimDevice",
    "SimFunction",
    "SimGate",
    "SimGraph",
    "SimGraphExec",
    "SimHost",
    "SimHostStatistics",
    "SimMarker",
    "SimStatistics",
    "SimStream",
    "Violation",
    "ViolationKind",
]
