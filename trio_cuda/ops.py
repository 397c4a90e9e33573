"""Building blocks for DeviceOps: ``value``, ``copy``, ``fill``, ``host_closure``,
and foreign work: ``external`` (another library's work on a trio_cuda stream,
under leases) and ``after`` (order after a foreign stream or event).

Invariant: these only build lazy ops; nothing is enqueued until the op is
submitted to a scope.
"""

from ._core._foreign import after as after
from ._core._foreign import external as external
from ._core._ops import HostResult as HostResult
from ._core._ops import copy as copy
from ._core._ops import fill as fill
from ._core._ops import host_closure as host_closure
from ._core._ops import value as value

__all__ = ["HostResult", "after", "copy", "external", "fill", "host_closure", "value"]
