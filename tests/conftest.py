from __future__ import annotations

from collections.abc import Generator

import pytest

from trio_cuda.testing import SimDevice


@pytest.fixture
def sim():
    """A fresh simulated device; every test must leave it without violations."""
    dev = SimDevice()
    yield dev
    assert dev.violations == [], dev.violations


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    # pytest-trio re-raises a skip or xfail from inside trio.run as a bare pytest.skip() or
    # pytest.xfail(), without its reason; the original is in the group it handled
    try:
        return (yield)
    except (pytest.skip.Exception, pytest.xfail.Exception) as exc:
        context = exc.__context__
        if not exc.msg and isinstance(context, BaseExceptionGroup):
            (leaf, *rest) = _leaves(context)
            if not rest and type(leaf) is type(exc):
                raise leaf from None
        raise
