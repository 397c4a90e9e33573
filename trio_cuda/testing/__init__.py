"""Test support users can import too: the simulated device and its records.

``SimDevice`` runs freely unless held; ``hold()``, ``release()``,
``complete_next()`` and ``run_until_idle()`` place work exactly; ``violations``
lists memcheck findings and ``live_allocations`` what was never freed;
``trace`` lists the executed commands (``SimCommandRecord``).
``SimHost`` joins several SimDevices into one machine (peer copies,
cross-device waits).

``trio_cuda.testing.pytest_plugin`` is the pytest plugin (loaded by pytest
where trio_cuda is installed): the fixtures ``trio_cuda_sim``,
``trio_cuda_scope`` and ``trio_cuda_gpu_scope``; see :doc:`testing`.

``TraceEvent``, the former name of ``SimCommandRecord``, is a deprecated
alias: it warns (``DeprecationWarning``) and is not listed in ``__all__``.
"""

import warnings as _warnings
from typing import TYPE_CHECKING as _TYPE_CHECKING

from .._backends.sim.device import SimDevice as SimDevice
from .._backends.sim.host import SimHost as SimHost
from .._backends.sim.host import SimHostStatistics as SimHostStatistics
from .._backends.sim.records import SimAllocation as SimAllocation
from .._backends.sim.records import SimCommandRecord as SimCommandRecord
from .._backends.sim.records import SimStatistics as SimStatistics
from .._backends.sim.records import Violation as Violation

__all__ = [
    "SimAllocation",
    "SimCommandRecord",
    "SimDevice",
    "SimHost",
    "SimHostStatistics",
    "SimStatistics",
    "Violation",
]


if not _TYPE_CHECKING:  # type checkers see no __getattr__: a misspelt name stays an error

    def __getattr__(name: str) -> object:
        if name == "TraceEvent":
            _warnings.warn(
                "trio_cuda.testing.TraceEvent is deprecated: use trio_cuda.testing.SimCommandRecord "
                "(one command the simulated device executed); trio_cuda.trace.TraceEvent is an event "
                "of the lifetime trace",
                DeprecationWarning,
                stacklevel=2,
            )
            return SimCommandRecord
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
