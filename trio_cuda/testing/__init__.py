"""Test support users can import too: the simulated device and its records.

``SimDevice`` runs freely unless held; ``hold()``, ``release()``,
``complete_next()`` and ``run_until_idle()`` place work exactly; ``violations``
lists memcheck findings and ``live_allocations`` what was never freed.
``SimHost`` joins several SimDevices into one machine (peer copies,
cross-device waits).

``trio_cuda.testing.pytest_plugin`` is the pytest plugin (loaded by pytest
where trio_cuda is installed): the fixtures ``trio_cuda_sim``,
``trio_cuda_scope`` and ``trio_cuda_gpu_scope``; see :doc:`testing`.
"""

from .._backends.sim.device import SimDevice as SimDevice
from .._backends.sim.host import SimHost as SimHost
from .._backends.sim.host import SimHostStatistics as SimHostStatistics
from .._backends.sim.records import SimAllocation as SimAllocation
from .._backends.sim.records import SimStatistics as SimStatistics
from .._backends.sim.records import TraceEvent as TraceEvent
from .._backends.sim.records import Violation as Violation

__all__ = [
    "SimAllocation",
    "SimDevice",
    "SimHost",
    "SimHostStatistics",
    "SimStatistics",
    "TraceEvent",
    "Violation",
]
