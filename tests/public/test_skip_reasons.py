"""A skip or xfail inside an async test keeps its reason in the report (pytest-trio
re-raises it from inside ``trio.run`` without one; tests/conftest.py restores it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

PROBE = """
import pytest
import trio

async def test_skips():
    await trio.lowlevel.checkpoint()
    pytest.skip("the probe's own skip reason")

async def test_xfails():
    pytest.xfail("the probe's own xfail reason")

async def test_importorskip():
    pytest.importorskip("a_module_that_is_not_there", reason="the probe's importorskip reason")
"""


def test_async_skips_keep_their_reasons(tmp_path: Path) -> None:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrio_mode = true\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsx", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for reason in ("own skip reason", "own xfail reason", "importorskip reason"):
        assert f"the probe's {reason}" in proc.stdout, proc.stdout
    assert "python.py" not in proc.stdout, proc.stdout  # no location inside pytest instead of a reason
