"""Public names report the module users import them from.

Classes and functions are defined in private modules (``trio_cuda._core._errors``)
and re-exported from public ones (``trio_cuda``). :func:`publish` sets each
re-exported object's ``__module__`` to the public module, so tracebacks, reprs and
the API reference say ``trio_cuda.KernelArgumentError``, and pickling finds the
object where users import it.

Invariants: only objects defined in a private module (a dotted component starting
with ``_``) are changed, and each at most once (the first public module that
publishes it wins); the defining module is kept in :data:`ORIGINS` (for the
documentation's source links).
"""

from __future__ import annotations

import types
from collections.abc import Iterable, MutableMapping

__all__ = ["ORIGINS", "publish"]

#: ``"trio_cuda.Kernel"`` -> ``"trio_cuda._core._kernel"``: where each published object is defined.
ORIGINS: dict[str, str] = {}


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def publish(namespace: MutableMapping[str, object], module: str, names: Iterable[str] | None = None) -> None:
    """Make the public classes and functions in ``namespace`` (a module's globals) report
    ``module`` as their ``__module__``. ``names`` defaults to every name without a leading
    underscore."""
    for name in list(namespace) if names is None else names:
        if name.startswith("_"):
            continue
        obj = namespace[name]
        if not isinstance(obj, (type, types.FunctionType)):
            continue
        origin = getattr(obj, "__module__", None)
        if not isinstance(origin, str) or not origin.startswith("trio_cuda.") or not _private(origin):
            continue
        if getattr(obj, "__name__", None) != name:
            continue  # an alias under another name: its own name is the one to publish
        obj.__module__ = module
        ORIGINS[f"{module}.{name}"] = origin
