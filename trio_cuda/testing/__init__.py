"""Test support users can import too: the simulated device and its records.

``SimDevice`` runs freely unless held; ``hold()``, ``release()``,
``complete_next()`` and ``run_until_idle()`` place work exactly; ``violations``
lists memcheck findings and ``live_allocations`` what was never freed.
``SimHost`` joins several SimDevices into one machine (peer copies,
cross-device waits).
"""

from .._backends.sim import SimAllocation as SimAllocation
from .._backends.sim import SimDevice as SimDevice
from .._backends.sim import SimStatistics as SimStatistics
from .._backends.sim import TraceEvent as TraceEvent
from .._backends.sim import Violation as Violation
from .._backends.sim_multi import SimHost as SimHost
from .._backends.sim_multi import SimHostStatistics as SimHostStatistics

__all__ = [
    "SimAllocation",
    "SimDevice",
    "SimHost",
    "SimHostStatistics",
    "SimStatistics",
    "TraceEvent",
    "Violation",
]
