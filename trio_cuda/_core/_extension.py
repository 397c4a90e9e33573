"""Per-scope state kept by modules outside the scope: extension objects.

Invariants:

* State that a feature keeps per scope (exports, open graphs) lives on the
  scope, as one extension object per feature, created on first use: never in
  module-level dicts. The scope holds them in its :class:`Extensions`
  component.
* At exit, the scope drives every extension through the same steps: ``drain()``
  (inside ``drain_timeout``, repeated with the wait for in-flight work until
  both are quiet), ``abandon(after)`` once the drain gave up (its timeout
  passed, or a second Ctrl-C stopped it: quarantine, never free, what is
  still held) and ``close()`` after the drain, before any
  memory is freed.
* The runtime never imports a feature module: it calls a feature only
  through a hook the feature's extension object registered on the scope's
  :class:`Extensions` (``exports``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from ._final import final

if TYPE_CHECKING:
    from ._array import DeviceArray
    from ._ops import Access
    from ._scope import ResourceScope
    from ._submit import Submission

__all__ = ["ExportHooks", "Extensions", "ScopeExtension"]


class ScopeExtension(Protocol):
    """What the scope asks of each of its extension objects at exit."""

    async def drain(self) -> None:
        """Return once this extension keeps nothing of the scope busy (a
        checkpoint when there is nothing to do)."""
        ...

    def abandon(self, after: str) -> None:
        """The drain gave up: quarantine what is still held, with a
        ``ResourceWarning`` that says why (``after`` is a phrase such as
        ``"after drain_timeout=0.5 s"``)."""
        ...

    def close(self) -> None:
        """After the drain, before memory is freed: release what is left."""
        ...


E = TypeVar("E", bound=ScopeExtension)


class ExportHooks(Protocol):
    """What the runtime asks of a scope's exports (``_export``'s extension
    object registers itself as ``Extensions.exports`` when it is made)."""

    def conflict(self, other: Submission, arr: DeviceArray, access: Access, what: str) -> Submission:
        """``other`` is an export's submission that a new access conflicts
        with: return it (in flight) once released and finished, else raise
        :class:`~trio_cuda.AccessConflictError`."""
        ...

    async def finish_releases(self) -> None:
        """Wait until every export a consumer released is finished."""
        ...


@final
class Extensions:
    """A scope's extension objects, one per feature (a component of
    :class:`~trio_cuda.ResourceScope`), and the hooks the runtime calls."""

    __slots__ = ("_made", "exports", "exports_releasing", "scope")

    def __init__(self, scope: ResourceScope) -> None:
        self.scope = scope
        self._made: dict[object, ScopeExtension] = {}
        #: the export feature's hooks, once the scope exported anything
        self.exports: ExportHooks | None = None
        #: an export's consumer released it and its fence is not finished yet:
        #: the next awaited access waits for it (``ExportHooks.finish_releases``)
        self.exports_releasing = False

    def get(self, cls: Callable[[ResourceScope], E]) -> E:
        """This scope's extension object of class ``cls``, made on first use."""
        ext = self._made.get(cls)
        if ext is None:
            ext = self._made[cls] = cls(self.scope)
        return cast(E, ext)

    def find(self, cls: type[E]) -> E | None:
        """This scope's extension object of class ``cls``, if it was made."""
        return cast("E | None", self._made.get(cls))

    def all(self) -> list[ScopeExtension]:
        """Every extension object made so far, in the order they were made."""
        return list(self._made.values())

    async def finish_export_releases(self) -> None:
        """Before an awaited access: finish what export consumers released."""
        if self.exports is not None:
            await self.exports.finish_releases()
        self.exports_releasing = False
