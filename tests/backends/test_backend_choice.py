"""How a backend is chosen and what is said about it, with the driver faked.

* The probe's reason is one short line (``no CUDA driver: libcuda.so.1 not
  found``); the error behind it is its ``detail``, logged at DEBUG when "auto"
  falls back to the simulator and shown by ``info``.
* Records of the ``trio_cuda`` logger never repeat ``trio_cuda:``.
* A CUDA device asked for by name that is not there is DeviceUnavailableError
  (a TrioCudaError and a RuntimeError) naming what was asked for, why it is
  not there and what to use instead, for scopes and pools, before any driver
  call; a pool's default, "auto", falls back to one simulated device.
* The simulator's compile check: ``info`` says whether it is on and why not;
  where NVRTC is missing, the first unchecked kernel of a process logs one
  WARNING naming the ``compiler`` extra.

The driver is faked by replacing ``cuInit`` (or the probe itself), so these
tests give the same answers on a GPU machine.
"""

from __future__ import annotations

import ast
import logging
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
import trio_cuda._backends as backends
from trio_cuda import NO_REFERENCE, InOut, Kernel, TrioCudaError
from trio_cuda.__main__ import compile_check_line, info_lines
from trio_cuda._backends import _nvrtc
from trio_cuda.testing import SimDevice

ROOT = Path(__file__).resolve().parents[2]
NO_DRIVER = f"no CUDA driver: {backends.DRIVER_LIBRARY} not found"
LIB_TEXT = (
    '"cuda" is an NVIDIA driver library and can only be found via system search. '
    "Ensure the NVIDIA display driver is installed."
)


@pytest.fixture
def no_libcuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's first call raises what cuda.bindings raises without libcuda."""
    driver = pytest.importorskip("cuda.bindings.driver")
    pathfinder = pytest.importorskip("cuda.pathfinder")

    def cu_init(flags: int) -> Any:
        raise pathfinder.DynamicLibNotFoundError(LIB_TEXT)

    monkeypatch.setattr(driver, "cuInit", cu_init)


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, *, backend: bool = True) -> None:
    """A probe that finds ``count`` devices; opening one fails the test."""
    monkeypatch.setattr(backends, "probe_cuda", lambda: backends.CudaProbe(True, count, 12080))
    monkeypatch.setattr(backends, "_cuda_backend_available", lambda: backend)

    def never(device: str, ordinal: int) -> Any:
        pytest.fail(f"{device} was opened")

    monkeypatch.setattr(backends, "_open_cuda", never)


async def enter(device: object) -> str:
    async with trio_cuda.open_scope(device=device) as gpu:
        return gpu.backend


async def enter_manager(manager: Any) -> None:
    async with manager:
        pytest.fail("the scope opened")  # pragma: no cover


# --------------------------------------------------------------------------- the probe's reason


@pytest.mark.usefixtures("no_libcuda")
def test_without_libcuda_the_reason_is_one_short_line() -> None:
    probe = backends.probe_cuda()
    assert not probe.available
    assert probe.reason == NO_DRIVER
    assert probe.detail == f"DynamicLibNotFoundError: {LIB_TEXT}"
    lines = info_lines()
    assert lines[0] == f"backend: sim ({NO_DRIVER}; open_scope(device='auto') uses the simulator)"
    assert lines[1] == f"  the CUDA probe: DynamicLibNotFoundError: {LIB_TEXT}"  # the detail, in info


def test_other_driver_failures_are_short_too(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = pytest.importorskip("cuda.bindings.driver")

    def broken(flags: int) -> Any:
        raise OSError("x" * 500 + "\nsecond line")

    monkeypatch.setattr(driver, "cuInit", broken)
    probe = backends.probe_cuda()
    assert probe.reason.startswith("no CUDA driver (OSError: xxx")
    assert probe.reason.endswith("...)")
    assert len(probe.reason) < 110
    assert "second line" in probe.detail
    monkeypatch.setattr(driver, "cuInit", lambda flags: (driver.CUresult.CUDA_ERROR_NO_DEVICE,))
    assert backends.probe_cuda().reason == "cuInit failed: CUDA_ERROR_NO_DEVICE"


@pytest.mark.usefixtures("no_libcuda")
def test_the_fallback_is_logged_once_without_a_doubled_prefix(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_cuda")
    assert trio.run(enter, "auto") == "sim"
    mine = [r for r in caplog.records if "CUDA" in r.getMessage() or "simulated" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in mine] == [
        ("INFO", f"using the simulated device: {NO_DRIVER}"),
        ("DEBUG", f"the CUDA probe: DynamicLibNotFoundError: {LIB_TEXT}"),
    ]
    assert not [r for r in caplog.records if r.getMessage().startswith("trio_cuda")]


def _log_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, first argument) of each ``log.X("...")`` / ``logger.X("...")`` call."""
    calls = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("debug", "info", "warning", "error", "exception", "critical")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in ("log", "logger")
            and node.args
        ):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                calls.append((node.lineno, first.value))
            elif isinstance(first, ast.JoinedStr) and first.values:
                head = first.values[0]
                if isinstance(head, ast.Constant) and isinstance(head.value, str):
                    calls.append((node.lineno, head.value))
    return calls


def test_no_log_message_of_the_package_starts_with_its_name() -> None:
    found = []
    count = 0
    for path in sorted((ROOT / "trio_cuda").rglob("*.py")):
        for line, text in _log_calls(ast.parse(path.read_text(encoding="utf-8"))):
            count += 1
            if text.lower().startswith("trio_cuda"):
                found.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert count > 10  # the scan sees the package's log calls
    assert found == []


# --------------------------------------------------------------------------- DeviceUnavailableError

INSTEAD = re.escape("use device='auto' (a GPU when one answers, else the simulator) or device='sim'")


@pytest.mark.usefixtures("no_libcuda")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_device_without_a_driver_is_unavailable(device: str) -> None:
    manager = trio_cuda.open_scope(device=device)  # made: nothing is asked yet
    with pytest.raises(trio_cuda.DeviceUnavailableError) as info:
        trio.run(enter_manager, manager)
    message = str(info.value)
    assert re.fullmatch(
        f"device: '{device}' was asked for, but no CUDA device answered "
        f"\\({re.escape(NO_DRIVER)}\\); {INSTEAD}",
        message,
    ), message
    err = info.value
    assert isinstance(err, TrioCudaError)
    assert isinstance(err, RuntimeError)
    assert (err.device, err.reason) == (device, NO_DRIVER)
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), str(again), again.device, again.reason) == (type(err), message, device, NO_DRIVER)


def test_an_ordinal_past_the_last_device_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    with pytest.raises(trio_cuda.DeviceUnavailableError) as info:
        trio.run(enter_manager, trio_cuda.open_scope(device="cuda:2"))
    assert str(info.value) == (
        "device: 'cuda:2' was asked for, but no such CUDA device answered (the CUDA driver reports "
        "2 device(s): cuda:0 to cuda:1); use one of those, device='auto' or device='sim'"
    )
    assert info.value.reason == "the CUDA driver reports 2 device(s): cuda:0 to cuda:1"
    fake_gpus(monkeypatch, 1)
    with pytest.raises(trio_cuda.DeviceUnavailableError, match=r"reports 1 device\(s\): cuda:0\); use"):
        trio.run(enter_manager, trio_cuda.open_scope(device="cuda:1"))


def test_devices_without_the_cuda_backend_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2, backend=False)
    with pytest.raises(trio_cuda.DeviceUnavailableError) as info:
        trio.run(enter_manager, trio_cuda.open_scope(device="cuda:0"))
    assert str(info.value) == (
        "device: 'cuda:0' was asked for, but the cuda backend cannot be imported (2 CUDA device(s) "
        "answer); use device='auto' (a GPU when one answers, else the simulator) or device='sim'"
    )
    with pytest.raises(
        trio_cuda.DeviceUnavailableError, match=r"^devices: 'cuda' was asked for, but the cuda"
    ):
        trio_cuda.open_device_pool("cuda")
    assert backends.auto_devices() == ["sim"]  # auto: not usable, so the simulator


POOL_INSTEAD = re.escape(
    "use devices='auto' (every GPU when one answers, else one simulated device), "
    "['sim'] or a trio_cuda.testing.SimHost"
)


@pytest.mark.usefixtures("no_libcuda")
@pytest.mark.parametrize("devices", ["cuda", "all"])
def test_a_pool_of_cuda_devices_without_a_driver_is_refused_when_made(devices: str) -> None:
    with pytest.raises(trio_cuda.DeviceUnavailableError) as info:
        trio_cuda.open_device_pool(devices)
    assert re.fullmatch(
        f"devices: '{devices}' was asked for, but no CUDA device answered \\({re.escape(NO_DRIVER)}\\); "
        f"{POOL_INSTEAD}",
        str(info.value),
    ), str(info.value)


def test_a_pool_naming_a_missing_ordinal_is_refused_when_entered(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    sim = SimDevice()
    with pytest.raises(
        trio_cuda.DeviceUnavailableError, match=r"^device: 'cuda:7' was asked for, but no such"
    ):
        trio.run(enter_manager, trio_cuda.open_device_pool([sim, "cuda:7"]))
    assert sim.live_allocations == []


# --------------------------------------------------------------------------- a pool's "auto"


def test_the_pool_default_is_auto_as_for_a_scope() -> None:
    import inspect

    assert inspect.signature(trio_cuda.open_device_pool).parameters["devices"].default == "auto"
    assert inspect.signature(trio_cuda.open_scope).parameters["device"].default == "auto"


@pytest.mark.usefixtures("no_libcuda")
def test_auto_without_a_gpu_is_one_simulated_device(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_CUDA_SIM_KERNEL_TIME", "0.001")
    caplog.set_level(logging.INFO, logger="trio_cuda")

    async def main() -> tuple[list[str], list[float]]:
        async with trio_cuda.open_device_pool() as pool:
            x = await pool.to_device(np.arange(4, dtype=np.float32))
            return [s.backend for s in pool.scopes], (await x.scope.to_host(x)).tolist()

    assert trio.run(main) == (["sim"], [0.0, 1.0, 2.0, 3.0])
    assert f"device pool: using one simulated device: {NO_DRIVER}" in caplog.messages


def test_auto_with_gpus_is_every_gpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_gpus(monkeypatch, 3)
    caplog.set_level(logging.INFO, logger="trio_cuda")
    assert backends.auto_devices() == ["cuda:0", "cuda:1", "cuda:2"]
    assert "device pool: using the cuda backend (3 device(s))" in caplog.messages
    trio_cuda.open_device_pool()  # made; each device is opened only when it is entered
    trio_cuda.open_device_pool("cuda")


def test_a_bad_devices_name_lists_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"^devices: expected 'auto' \(every CUDA device when one answers"):
        trio_cuda.open_device_pool("gpu")
    with pytest.raises(TypeError, match=r"^devices: expected 'auto', 'cuda', a SimHost or a sequence"):
        trio_cuda.open_device_pool(3)


# --------------------------------------------------------------------------- the compile check


@pytest.fixture
def no_nvrtc(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVRTC cannot be loaded, as in the default install; nothing warned yet."""

    def load() -> Any:
        raise RuntimeError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.delenv(_nvrtc.SIM_COMPILE_ENV, raising=False)
    monkeypatch.setattr(_nvrtc, "load_nvrtc", load)
    monkeypatch.setattr(_nvrtc, "_available", None)
    monkeypatch.setattr(_nvrtc, "_unavailable", "")
    monkeypatch.setattr(_nvrtc, "_nvrtc_version", None)
    monkeypatch.setattr(_nvrtc, "_warned", False)


SRC = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n'


def _inc(x: np.ndarray[Any, Any]) -> None:
    x += 1


async def _run_kernels(*kernels: Kernel) -> None:
    async with trio_cuda.open_scope(device=SimDevice()) as gpu:
        x = await gpu.to_device(np.zeros(4, np.float32))
        for k in kernels:
            await gpu.run(k.launch(x, grid=1, block=4))


@pytest.mark.usefixtures("no_nvrtc")
async def test_the_first_unchecked_kernel_warns_once_naming_the_extra(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_cuda")
    # "kk" is not what the source defines: with NVRTC this is refused, without it runs
    kk = Kernel.from_source(SRC, "kk", params=[InOut("f4")], reference=_inc)
    other = Kernel.from_source(SRC + "// another source\n", "k", params=[InOut("f4")], reference=_inc)
    await _run_kernels(kk, other)
    await _run_kernels(other, kk)  # another scope and device: no more warnings
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert message.startswith("the simulator runs kernel 'kk' without checking its source: NVRTC is not")
    assert "(RuntimeError: libnvrtc.so.13: cannot open shared object file)" in message
    assert "pip install 'trio_cuda[compiler]' installs NVRTC" in message
    assert "TRIO_CUDA_SIM_COMPILE=0 turns the check off" in message
    assert warnings[0].name == "trio_cuda"


@pytest.mark.usefixtures("no_nvrtc")
async def test_no_warning_when_the_check_is_turned_off_or_not_needed(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_cuda")
    # PTX is checked for its entries without NVRTC; a cubin is not read: neither warns
    ptx = Kernel.from_ptx(
        ".visible .entry k(.param .u64 x) { ret; }", "k", params=[InOut("f4")], reference=_inc
    )
    cubin = Kernel.from_cubin(b"\x7fELF not read", "k", params=[InOut("f4")], reference=NO_REFERENCE)
    await _run_kernels(ptx, cubin)
    monkeypatch.setenv(_nvrtc.SIM_COMPILE_ENV, "0")
    await _run_kernels(Kernel.from_source(SRC, "kk", params=[InOut("f4")], reference=_inc))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not _nvrtc._warned


@pytest.mark.usefixtures("no_nvrtc")
def test_info_says_the_check_is_off_and_how_to_turn_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    line = compile_check_line()
    assert line.startswith("sim compile check: off (NVRTC cannot be loaded (RuntimeError: libnvrtc.so.13")
    assert line.endswith("pip install 'trio_cuda[compiler]' installs NVRTC)")
    assert line in info_lines()
    monkeypatch.setenv(_nvrtc.SIM_COMPILE_ENV, "off")
    assert compile_check_line() == "sim compile check: off (turned off by TRIO_CUDA_SIM_COMPILE=off)"


def test_info_says_the_check_is_on_where_nvrtc_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_nvrtc.SIM_COMPILE_ENV, raising=False)
    if not _nvrtc.nvrtc_available():
        pytest.skip("NVRTC cannot be loaded here")
    major, minor = _nvrtc.nvrtc_version()
    assert compile_check_line() == (
        f"sim compile check: on (NVRTC {major}.{minor} compiles each kernel's source once "
        "and checks its name)"
    )


def test_info_as_a_program_names_the_compile_check(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env[_nvrtc.SIM_COMPILE_ENV] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "trio_cuda", "info"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "sim compile check: off (turned off by TRIO_CUDA_SIM_COMPILE=0)" in proc.stdout.splitlines()
    assert proc.stderr == ""
