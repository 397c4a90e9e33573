"""Trio only: a clear error where another async library (or none) runs us.

Invariants:

* :func:`require_trio` is called where a scope or a device pool is entered,
  before the first Trio call, so that asyncio's "Task got bad yield:
  CancelShieldedCheckpoint" never reaches a user. It is not called per
  operation: every other public async function needs an entered scope.
* It asks sniffio, which Trio answers from a thread-local (tens of
  nanoseconds); it never imports asyncio or any other library.
"""

from __future__ import annotations

import sniffio

__all__ = ["require_trio"]


def require_trio(what: str) -> None:
    """Raise ``RuntimeError`` naming Trio unless Trio runs the current task."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = None
    if library == "trio":
        return
    if library is None:
        raise RuntimeError(
            f"{what}: trio_cuda runs on Trio, but no async library is running this code "
            "(a coroutine driven by hand?). Start your program with trio.run(main)."
        )
    hint = ""
    if library == "asyncio":
        hint = (
            ' (with AnyIO: anyio.run(main, backend="trio")); to call trio_cuda from asyncio code, '
            "run the program under Trio with trio-asyncio and enter trio_cuda through "
            "trio_asyncio.trio_as_aio"
        )
    raise RuntimeError(
        f"{what}: trio_cuda runs on Trio; this is {library}. Start the program with trio.run(main){hint}."
    )
