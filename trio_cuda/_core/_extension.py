"""Per-scope state kept by modules outside the scope: extension objects.

Invariants:

* State that a feature keeps per scope (exports, open graphs, other scopes'
  leases on this scope's memory) lives on the scope, as one extension object
  per feature, created on first use: never in module-level dicts.
* At exit, the scope drives every extension through the same steps: ``drain()``
  (inside ``drain_timeout``, repeated with the wait for in-flight work until
  both are quiet), ``abandon(after)`` once the drain gave up (its timeout
  passed, or a second Ctrl-C stopped it: quarantine, never free, what is
  still held) and ``close()`` after the drain, before any
  memory is freed.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["ScopeExtension"]


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
