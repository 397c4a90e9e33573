"""The compiled submission's memo of the driver's ``launch`` and
``notify_submitted`` where the instance's own dict holds them (the cuda
backend stores its compiled methods there): a change to the instance's
dict or to its class is seen at the next submission."""

from __future__ import annotations

from typing import Any

import pytest

import trio_cuda
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import stub_kernel
from trio_cuda import In, InOut, Scalar
from trio_cuda._backends.sim.context import SimContext
from trio_cuda.testing import SimDevice


def _kernel() -> trio_cuda.Kernel:
    return stub_kernel(In("f4"), Scalar("i4"), InOut("f4"))


class _DictContext(SimContext):  # (no __slots__: its instances have a dict, as the cuda backend's)
    pass


class _Counting:
    """Calls ``fn``, counting the calls under ``name``."""

    def __init__(self, calls: list[str], name: str, fn: Any) -> None:
        self.calls, self.name, self.fn = calls, name, fn

    def __call__(self, *args: Any) -> Any:
        self.calls.append(self.name)
        return self.fn(*args)


@compiled_only
async def test_the_driver_s_methods_in_its_dict_are_read_again_after_every_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    k = _kernel()
    monkeypatch.setattr(SimDevice, "open_context", lambda self: _DictContext(self, self._engine))
    async with trio_cuda.open_scope(device=SimDevice()) as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        driver: Any = gpu._driver
        assert type(driver) is _DictContext
        cls = type(driver)
        calls: list[str] = []

        async def submit_three() -> None:
            for i in range(3):
                await gpu.submit(k.launch(x, i, y, grid=1, block=8)).wait()

        await submit_three()
        assert calls == []
        driver.launch = _Counting(calls, "a", cls.launch.__get__(driver))
        driver.notify_submitted = _Counting(calls, "n", cls.notify_submitted.__get__(driver))
        await submit_three()
        assert calls.count("a") == 3
        assert calls.count("n") >= 3
        calls.clear()
        driver.launch = _Counting(calls, "b", cls.launch.__get__(driver))  # replaced: seen at once
        await submit_three()
        assert calls.count("b") == 3
        assert "a" not in calls
        calls.clear()
        driver.unrelated = 1  # another entry of the dict changes: still the same launch
        await submit_three()
        assert calls.count("b") == 3
        calls.clear()
        del driver.launch, driver.notify_submitted  # the class's methods again
        await submit_three()
        assert calls == []
        driver.launch = _Counting(calls, "c", cls.launch.__get__(driver))
        await submit_three()
        assert calls.count("c") == 3
        calls.clear()
        # the class gets a data descriptor of that name: it wins over the dict
        original = SimContext.__dict__["launch"]
        seen: list[str] = []

        class Data:
            def __get__(self, obj: Any, owner: Any = None) -> Any:
                seen.append("d")
                return original.__get__(obj, owner)

            def __set__(self, obj: Any, value: Any) -> None:
                raise AttributeError("read-only")

        cls.launch = Data()
        try:
            await submit_three()
            assert seen == ["d"] * 3
            assert calls == []
        finally:
            del cls.launch
        await submit_three()
        assert calls.count("c") == 3  # the dict's entry decides again
    assert gpu.closed


@compiled_only
async def test_two_drivers_in_turn_each_get_their_own_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call site's memo, two drivers with dicts, submissions alternating
    between their scopes: each launch reaches its own driver."""
    k = _kernel()
    monkeypatch.setattr(SimDevice, "open_context", lambda self: _DictContext(self, self._engine))
    calls: list[str] = []
    async with (
        trio_cuda.open_scope(device=SimDevice()) as one,
        trio_cuda.open_scope(device=SimDevice()) as two,
    ):
        arrays = {gpu: (gpu.zeros(8, "f4"), gpu.zeros(8, "f4")) for gpu in (one, two)}
        for name, gpu in (("one", one), ("two", two)):
            driver: Any = gpu._driver
            driver.launch = _Counting(calls, name, SimContext.launch.__get__(driver))
        for i in range(6):
            gpu = (one, two)[i % 2]
            x, y = arrays[gpu]
            await gpu.submit(k.launch(x, i, y, grid=1, block=8)).wait()
        assert calls == ["one", "two"] * 3
