"""Building blocks for DeviceOps: ``value``, ``copy``, ``fill`` and ``host_closure``.

Invariant: these only build lazy ops; nothing is enqueued until the op is
submitted to a scope.
"""

from ._core._ops import HostResult as HostResult
from ._core._ops import copy as copy
from ._core._ops import fill as fill
from ._core._ops import host_closure as host_closure
from ._core._ops import value as value

__all__ = ["HostResult", "copy", "fill", "host_closure", "value"]
