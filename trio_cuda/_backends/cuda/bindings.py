"""The ``cuda.bindings.driver`` module, as every module of the cuda backend uses it.

Invariants: importing this module never calls the driver, so it imports on
machines without libcuda (where ``cuda.bindings.driver`` imports but the first
call raises ``DynamicLibNotFoundError``). ``cu`` is None where cuda-python is
not installed at all.
"""

from __future__ import annotations

__all__ = ["cu"]

try:  # importing the bindings never touches libcuda
    from cuda.bindings import driver as cu
except Exception:  # pragma: no cover - no cuda-python at all
    cu = None
