"""The simulator trio_cuda makes itself (device="sim", and "auto" without a GPU) takes its
timing from TRIO_CUDA_SIM_KERNEL_TIME / TRIO_CUDA_SIM_COPY_TIME, so that a program can be
cancelled mid-kernel without a GPU and without a code change."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio

import trio_cuda
import trio_cuda._backends as backends
from tests.helpers.kernels import ADD
from trio_cuda._open import sim_options_from_env
from trio_cuda.testing import SimDevice

KERNEL = "TRIO_CUDA_SIM_KERNEL_TIME"
COPY = "TRIO_CUDA_SIM_COPY_TIME"
SLOW = 0.3


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNEL, raising=False)
    monkeypatch.delenv(COPY, raising=False)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make "auto" fall back to the simulator, also on a machine with a GPU."""
    monkeypatch.setattr(
        backends, "probe_cuda", lambda: backends.CudaProbe(False, reason="hidden by the test")
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, {}),
        ({KERNEL: ""}, {}),
        ({KERNEL: "  "}, {}),
        ({KERNEL: "0"}, {"kernel_time": 0.0}),
        ({KERNEL: " 0.25 "}, {"kernel_time": 0.25}),
        ({KERNEL: "1e-3", COPY: "2"}, {"kernel_time": 0.001, "copy_time": 2.0}),
        ({COPY: "0.5"}, {"copy_time": 0.5}),
    ],
)
def test_options_from_the_environment(env: dict[str, str], expected: dict[str, float]) -> None:
    assert sim_options_from_env(env) == expected


@pytest.mark.parametrize("value", ["nan", "NaN", "-1", "-0.5", "inf", "-inf", "fast", "1s", "0x10", "1,5"])
@pytest.mark.parametrize("var", [KERNEL, COPY])
def test_bad_values_name_the_variable(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"^{var}: expected a number of seconds >= 0 .*got '{value}'$"):
        sim_options_from_env({var: value})


@pytest.mark.parametrize("device", ["sim", "auto"])
def test_a_bad_value_is_refused_when_the_scope_is_made(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    monkeypatch.setenv(KERNEL, "nan")
    with pytest.raises(ValueError, match=f"^{KERNEL}: "):
        trio_cuda.open_scope(device)
    with pytest.raises(ValueError, match=f"^{KERNEL}: "):
        trio_cuda.open_device_pool([device])


def test_an_explicit_device_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL, "garbage")
    trio_cuda.open_scope(SimDevice())  # the variable is not read: nothing to refuse
    trio_cuda.open_scope("cuda:0")  # checked when entered, and the GPU is not simulated


async def _cancel_mid_kernel(device: object) -> tuple[float, float]:
    """How long a task waited before its cancel took effect, and how long the scope's exit waited."""
    async with trio_cuda.open_scope(device) as gpu:
        await gpu.load(ADD)  # compiling (the first time in a process) is not the kernel's time
        x = gpu.zeros(4, np.float32)
        t0 = time.perf_counter()
        with trio.move_on_after(0.05) as cs:
            await gpu.run(ADD.launch(x, np.float32(1), 4, grid=1, block=4))
        assert cs.cancelled_caught  # the kernel was still running
        waited = time.perf_counter() - t0
        assert gpu.statistics().in_flight == 1
        t1 = time.perf_counter()
    return waited, time.perf_counter() - t1


@pytest.mark.parametrize("device", ["sim", "auto"])
async def test_kernel_time_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, no_gpu: None, device: str
) -> None:
    monkeypatch.setenv(KERNEL, str(SLOW))
    waited, exit_waited = await _cancel_mid_kernel(device)
    assert waited < SLOW  # cancelled promptly, while the simulated kernel ran
    assert waited + exit_waited >= SLOW * 0.9  # and the exit waited for it


async def test_copy_time_from_the_environment(monkeypatch: pytest.MonkeyPatch, no_gpu: None) -> None:
    monkeypatch.setenv(COPY, str(SLOW))
    async with trio_cuda.open_scope() as gpu:
        await gpu.load(ADD)
        t0 = time.perf_counter()
        await gpu.to_device(np.ones(4))
        assert time.perf_counter() - t0 >= SLOW * 0.9
        with trio.move_on_after(0.05) as cs:
            await gpu.run(ADD.launch(gpu.zeros(4, np.float32), np.float32(1), 4, grid=1, block=4))
        assert cs.cancelled_caught  # the zeros() fill is a timed copy; the kernel waits for it


async def test_device_pool_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL, str(SLOW))
    async with trio_cuda.open_device_pool(["sim", "sim"]) as pool:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for gpu in pool.scopes:
                x = gpu.zeros(4, np.float32)
                nursery.start_soon(gpu.run, ADD.launch(x, np.float32(1), 4, grid=1, block=4))
        assert time.perf_counter() - t0 >= SLOW * 0.9


async def test_without_the_variables_the_simulator_is_instant(no_gpu: None) -> None:
    async with trio_cuda.open_scope() as gpu:
        await gpu.load(ADD)  # bound the work, not the first compile of a process
        x = gpu.zeros(4, np.float32)
        with trio.fail_after(SLOW):
            for _ in range(20):
                await gpu.run(ADD.launch(x, np.float32(1), 4, grid=1, block=4))
        assert (await gpu.to_host(x)).tolist() == [20.0] * 4


async def test_an_explicit_device_keeps_its_own_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL, "5")
    sim = SimDevice()
    async with trio_cuda.open_scope(sim) as gpu:
        await gpu.load(ADD)
        x = gpu.zeros(4, np.float32)
        with trio.fail_after(SLOW):
            await gpu.run(ADD.launch(x, np.float32(1), 4, grid=1, block=4))
    assert sim.kernel_time == 0
