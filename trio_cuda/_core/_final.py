"""Classes that only the runtime creates.

Invariant: calling such a class raises ``TypeError`` that says how to get an
instance instead; the runtime makes them with the class's own ``_create``
factory, which never goes through the metaclass (the hot paths pay nothing).
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["NoPublicConstructor"]


class NoPublicConstructor(type):
    """Metaclass of runtime-created classes. A class using it sets
    ``_obtain``, the text that tells users how to get an instance."""

    _obtain: str

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"{cls.__name__} has no public constructor; {cls._obtain}")
