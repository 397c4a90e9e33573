"""Final classes, and classes that only the runtime creates.

Invariants:

* Subclassing a class decorated with :func:`final` raises ``TypeError`` when
  the subclass is created, naming the final class; for type checkers
  :func:`final` is ``typing.final``. It costs nothing after class creation: it
  only sets the class's ``__init_subclass__`` (no metaclass, so attrs classes,
  ``slots=True``, ``attrs.evolve``, pickling and generics work as before). It
  must be the outermost decorator, above ``@attrs.define``/``@attrs.frozen``
  (which may replace the class).
* Calling a class whose metaclass is :class:`NoPublicConstructor` raises
  ``TypeError`` that says how to get an instance instead; the runtime makes
  them with the class's own ``_create`` factory, which never goes through the
  metaclass (the hot paths pay nothing). Such a class is public, so it is
  :func:`final` too.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

__all__ = ["NoPublicConstructor", "final"]

_C = TypeVar("_C", bound=type)


def _final(cls: _C) -> _C:
    """Make ``cls`` final at runtime (subclassing it raises ``TypeError``) and
    for type checkers (``typing.final``)."""

    def refuse(sub: type, /, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} is final: it cannot be subclassed (by {sub.__qualname__})"
        )

    cls.__init_subclass__ = classmethod(refuse)  # type: ignore[assignment]
    return typing.final(cls)


if TYPE_CHECKING:
    from typing import final as final
else:
    final = _final


class NoPublicConstructor(type):
    """Metaclass of runtime-created classes. A class using it sets
    ``_obtain``, the text that tells users how to get an instance."""

    _obtain: str

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"{cls.__name__} has no public constructor; {cls._obtain}")
