"""Writing one file of an on-disk cache atomically.

Invariants:

* This module imports only the standard library; any layer may import it.
* :func:`write_atomic` writes to a temporary file in the target's directory
  (created if missing) and moves it over the target with ``os.replace``: a
  reader sees the old file or the whole new one, never part of it. When it
  fails, no temporary file is left behind; an ``OSError`` (read-only
  directory, full disk) is reported as ``False``, anything else propagates.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: Path, data: bytes) -> bool:
    """Replace ``path`` with ``data`` atomically; ``False`` (and ``path`` as it
    was) where it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError:
        return False
    return True
