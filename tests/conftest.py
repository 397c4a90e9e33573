import pytest

from trio_cuda.testing import SimDevice


@pytest.fixture
def sim():
    """A fresh simulated device; every test must leave it without violations."""
    dev = SimDevice()
    yield dev
    assert dev.violations == [], dev.violations
