"""Whether compute-sanitizer watches this test process, for the GPU tests.

compute-sanitizer reports every failed driver call and every device fault as
an error, and serialises kernels. The GPU tests that fault, fail a driver call
on purpose, or time an overlap of kernels skip under it (``skip_under_sanitizer``
or ``skip_rest_under_sanitizer``), so that ``compute-sanitizer --tool memcheck
python -m pytest -m gpu`` counts only real errors; timing limits are relaxed by
``SLOW``.

The tool is detected by the ``NV_SANITIZER_INJECTION_*`` variables it sets for
every process it watches (children included), so no variable needs setting by
hand; ``TRIO_CUDA_SANITIZER=1`` says so explicitly (``nox -s sanitizer`` sets
it). Nothing here touches a GPU: the tests it marks still skip cleanly without
one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest


def under_sanitizer(environ: Mapping[str, str] | None = None) -> bool:
    """Whether compute-sanitizer watches the process with ``environ`` (default:
    this one): ``TRIO_CUDA_SANITIZER=1``, or the ``NV_SANITIZER_INJECTION_*``
    variables the tool sets for its targets."""
    env = os.environ if environ is None else environ
    if env.get("TRIO_CUDA_SANITIZER") == "1":
        return True
    return any(name.startswith("NV_SANITIZER_INJECTION_") for name in env)


#: compute-sanitizer watches this test session
SANITIZER = under_sanitizer()

#: timing slack: the tool slows every driver call down by an order of magnitude
SLOW = 20.0 if SANITIZER else 1.0


def skip_under_sanitizer(reason: str) -> pytest.MarkDecorator:
    """A marker that skips the test under compute-sanitizer; ``reason`` says
    what the tool would report (or hide) in it."""
    return pytest.mark.skipif(SANITIZER, reason=reason)


def skip_rest_under_sanitizer(reason: str) -> None:
    """Skip the rest of a running test under compute-sanitizer (for a test
    whose first part is clean and whose rest is not)."""
    if SANITIZER:
        pytest.skip(reason)
