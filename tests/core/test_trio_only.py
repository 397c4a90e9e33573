"""trio_cuda runs on Trio only, and says so where a scope or a device pool is entered.

Under asyncio, Trio's first checkpoint would fail with asyncio's "Task got bad yield:
CancelShieldedCheckpoint"; the entry points refuse first, naming Trio and the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import sniffio
import trio

import trio_cuda
from trio_cuda.testing import SimDevice


async def use_scope(sim: SimDevice) -> list[float]:
    async with trio_cuda.open_scope(sim) as gpu:
        x = await gpu.to_device(np.arange(3, dtype=np.float32))
        out: list[float] = (await gpu.to_host(x)).tolist()
        return out


async def use_pool(sim: SimDevice) -> int:
    async with trio_cuda.open_device_pool([sim, sim]) as pool:
        return len(pool.scopes)


ASYNCIO = re.escape("trio_cuda runs on Trio; this is asyncio. Start the program with trio.run(main)")


@pytest.mark.parametrize(("use", "what"), [(use_scope, "open_scope()"), (use_pool, "open_device_pool()")])
def test_asyncio_gets_a_clear_error(use: Callable[[SimDevice], Awaitable[object]], what: str) -> None:
    sim = SimDevice()

    async def main() -> object:
        return await use(sim)

    with pytest.raises(RuntimeError, match=f"^{re.escape(what)}: {ASYNCIO}") as info:
        asyncio.run(main())
    message = str(info.value)
    assert "trio-asyncio" in message
    assert "trio_asyncio.trio_as_aio" in message
    assert 'anyio.run(main, backend="trio")' in message
    assert "bad yield" not in message
    assert sim.statistics().allocations == 0  # the device was never opened
    assert sim.violations == []


def test_anyio_on_asyncio_is_refused_and_on_trio_works() -> None:
    anyio = pytest.importorskip(
        "anyio", reason="anyio is not installed (pip install anyio; the test extra brings it)"
    )
    sim = SimDevice()
    with pytest.raises(RuntimeError, match=ASYNCIO):
        anyio.run(use_scope, sim, backend="asyncio")
    assert anyio.run(use_scope, sim, backend="trio") == [0.0, 1.0, 2.0]
    assert sim.live_allocations == []


def test_a_coroutine_driven_by_hand_gets_a_clear_error() -> None:
    """Plain sync code stepping the coroutine: no async library runs it."""
    manager = trio_cuda.open_scope("sim")
    coro = manager.__aenter__()
    with pytest.raises(RuntimeError, match=r"^open_scope\(\): trio_cuda runs on Trio, but no async library"):
        coro.send(None)
    # nothing was consumed: the same manager still opens its scope under Trio
    assert trio.run(_enter, manager) == "sim"


async def _enter(manager: contextlib.AbstractAsyncContextManager[trio_cuda.ResourceScope]) -> str:
    async with manager as gpu:
        return gpu.backend


def test_another_async_library_is_named() -> None:
    token = sniffio.current_async_library_cvar.set("curio")
    try:
        coro = trio_cuda.open_device_pool([SimDevice()]).__aenter__()
        with pytest.raises(
            RuntimeError, match=r"^open_device_pool\(\): trio_cuda runs on Trio; this is curio\."
        ) as info:
            coro.send(None)
    finally:
        sniffio.current_async_library_cvar.reset(token)
    assert "trio-asyncio" not in str(info.value)


async def test_trio_is_accepted() -> None:
    sim = SimDevice()
    assert await use_scope(sim) == [0.0, 1.0, 2.0]
    assert await use_pool(sim) == 2
