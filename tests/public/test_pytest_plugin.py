"""The pytest plugin (trio_cuda.testing.pytest_plugin), run on users' test files with pytester."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

PLUGIN = "trio_cuda.testing.pytest_plugin"
ROOT = Path(__file__).resolve().parents[2]


def _plugin_args() -> list[str]:
    """Load the plugin once: by its entry-point name where trio_cuda is installed with it
    (naming the module as well would register it twice), else by module."""
    installed = any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))
    return ["-p", "trio_cuda" if installed else PLUGIN]


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*_plugin_args(), "-p", "no:cacheprovider", "-rsE", *args)


def _has_gpu() -> bool:
    from trio_cuda._backends import probe_cuda

    return probe_cuda().available


HAS_GPU = _has_gpu()


def assert_gpu_outcome(result: pytest.RunResult, passed: int) -> None:
    """``passed`` tests passed, and the one test on trio_cuda_gpu_scope passed too where
    there is a GPU, or was skipped with the probe's reason."""
    if HAS_GPU:
        result.assert_outcomes(passed=passed + 1)
    else:
        result.assert_outcomes(passed=passed, skipped=1)
        result.stdout.fnmatch_lines(["SKIPPED * needs a CUDA device: *"])


KERNEL = '''
import numpy as np
import pytest
import trio
import trio.testing
import trio_cuda
from trio_cuda.testing import SimDevice

SRC = r"""
extern "C" __global__ void scale(float a, float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""

def scale_on_cpu(a, x, n):
    x[:n] *= a

scale = trio_cuda.Kernel.from_source(
    SRC, "scale",
    params=[trio_cuda.Scalar("f4"), trio_cuda.InOut("f4"), trio_cuda.Scalar("i4")],
    reference=scale_on_cpu,
)
'''

USER_TESTS = (
    KERNEL
    + """

def test_sim_is_fresh(trio_cuda_sim):
    assert isinstance(trio_cuda_sim, SimDevice)
    assert not trio_cuda_sim.held
    assert trio_cuda_sim.kernel_time == 0
    assert trio_cuda_sim.live_allocations == [] and trio_cuda_sim.violations == []


async def test_scope_runs_kernels(trio_cuda_scope, trio_cuda_sim):
    gpu = trio_cuda_scope
    assert gpu.backend == "sim" and gpu.device.name == trio_cuda_sim.name
    assert trio_cuda.current_scope() is gpu       # `await op` works in the test
    x = await gpu.to_device(np.arange(8, dtype=np.float32))
    await scale.launch(np.float32(2), x, 8, grid=1, block=8)
    assert (await gpu.to_host(x)).tolist() == [2.0 * i for i in range(8)]
    assert trio_cuda_sim.statistics().launches == 1


async def test_hold_and_complete_next(trio_cuda_scope, trio_cuda_sim):
    gpu = trio_cuda_scope
    x = await gpu.to_device(np.ones(4, np.float32))
    trio_cuda_sim.hold()
    fut = gpu.submit(scale.launch(np.float32(3), x, 4, grid=1, block=4))
    await trio.testing.wait_all_tasks_blocked()
    assert not fut.done() and gpu.statistics().in_flight == 1
    assert trio_cuda_sim.complete_next()
    await trio.testing.wait_all_tasks_blocked()   # retirement happens at the next checkpoint
    assert fut.done() and gpu.statistics().in_flight == 0
    assert (await fut.wait()) is x
    trio_cuda_sim.release()


async def test_ends_holding_the_device(trio_cuda_scope, trio_cuda_sim):
    gpu = trio_cuda_scope
    x = gpu.zeros(4, np.float32)
    trio_cuda_sim.hold()
    gpu.submit(scale.launch(np.float32(3), x, 4, grid=1, block=4))   # dropped, still held


async def test_on_a_gpu(trio_cuda_gpu_scope):
    assert trio_cuda_gpu_scope.backend == "cuda"
"""
)


def test_fixtures_in_trio_mode(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(test_user=USER_TESTS)
    result = run(pytester)
    assert_gpu_outcome(result, passed=4)


def test_fixtures_with_the_trio_marker(pytester: pytest.Pytester) -> None:
    """Without trio_mode, tests marked trio get the scope fixtures; a sync test
    asking for one is refused (it cannot run a Trio fixture)."""
    marked = USER_TESTS.replace("\nasync def", "\n@pytest.mark.trio\nasync def")
    pytester.makepyfile(
        test_user=marked
        + """

def test_sync_test_cannot_use_the_scope(trio_cuda_scope):
    pass
"""
    )
    result = run(pytester)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == (5 if HAS_GPU else 4), result.stdout.str()
    assert outcomes.get("skipped", 0) == (0 if HAS_GPU else 1), result.stdout.str()
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) == 1, result.stdout.str()
    assert "test_sync_test_cannot_use_the_scope" in result.stdout.str()


VIOLATIONS = (
    KERNEL
    + """

async def test_use_after_free(trio_cuda_scope, trio_cuda_sim):
    gpu = trio_cuda_scope
    x = await gpu.to_device(np.ones(4, np.float32))
    trio_cuda_sim.hold()
    trio_cuda.unsafe.async_on(scale.launch(np.float32(2), x, 4, grid=1, block=4), gpu.streams[1])
    x.close()   # wrong: the unsafe launch has not run yet
    trio_cuda_sim.release()


async def quarantine(gpu, sim):
    x = await gpu.to_device(np.ones(4, np.float32))
    sim.inject_fault("completion_unknown")
    with pytest.raises(trio_cuda.CompletionUnknownError):
        await gpu.run(scale.launch(np.float32(2), x, 4, grid=1, block=4))


async def test_quarantine_leaks(trio_cuda_scope, trio_cuda_sim):
    await quarantine(trio_cuda_scope, trio_cuda_sim)


@pytest.mark.trio_cuda_sim(check=False)
async def test_quarantine_on_purpose(trio_cuda_scope, trio_cuda_sim):
    await quarantine(trio_cuda_scope, trio_cuda_sim)
    assert len(trio_cuda_sim.live_allocations) == 1


async def test_expected_violation(trio_cuda_scope, trio_cuda_sim):
    await test_use_after_free(trio_cuda_scope, trio_cuda_sim)
    await trio_cuda_scope.run(trio_cuda.ops.value(None))
    assert [v.kind for v in trio_cuda_sim.violations] == ["use_after_free"]
    trio_cuda_sim.clear_violations()


async def test_own_scope_on_the_sim(trio_cuda_sim):
    async with trio_cuda.open_scope(trio_cuda_sim) as gpu:
        await quarantine(gpu, trio_cuda_sim)
"""
)


def test_violations_and_leaks_fail_the_test_readably(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(test_user=VIOLATIONS)
    result = run(pytester)
    result.assert_outcomes(passed=5, errors=3)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at teardown of test_use_after_free _*",
            "trio_cuda_sim: the test left the simulated device 'sim0' unclean",
            "  1 memcheck violation(s):",
            "    use_after_free: 16 bytes at 0x*, by launch scale (argument 1) on stream 1",
            "Violations the test expects: assert on trio_cuda_sim.violations, "
            "then call trio_cuda_sim.clear_violations().",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at teardown of test_quarantine_leaks _*",
            "trio_cuda_sim: the test left the simulated device 'sim0' unclean",
            "  1 allocation(s) never freed (16 bytes):",
            "    16 bytes at 0x*",
            "Memory left on purpose (quarantined work): mark the test "
            "@pytest.mark.trio_cuda_sim(check=False).",
        ]
    )
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_own_scope_on_the_sim*"])
    for name in ("test_quarantine_on_purpose", "test_expected_violation"):
        assert f"ERROR test_user.py::{name}" not in out
    assert "Traceback" not in out.split("short test summary")[0].split("ERRORS")[1]


OPTIONS = """
import pytest

def test_default(trio_cuda_sim):
    assert trio_cuda_sim.kernel_time == EXPECTED

@pytest.mark.trio_cuda_sim(kernel_time=0.25, memory=1 << 20)
def test_marker(trio_cuda_sim):
    assert trio_cuda_sim.kernel_time == 0.25 and trio_cuda_sim.memory == 1 << 20

@pytest.mark.trio_cuda_scope(streams=2, conflicts="error")
async def test_scope_options(trio_cuda_scope):
    assert len(trio_cuda_scope.streams) == 2
"""


@pytest.mark.parametrize(
    ("env", "args", "expected"),
    [
        (None, (), 0.0),
        (None, ("--trio-cuda-kernel-time=0.125",), 0.125),
        ("0.5", (), 0.5),
        ("0.5", ("--trio-cuda-kernel-time", "0.125"), 0.125),
    ],
)
def test_kernel_time_option_and_environment(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    env: str | None,
    args: tuple[str, ...],
    expected: float,
) -> None:
    if env is None:
        monkeypatch.delenv("TRIO_CUDA_SIM_KERNEL_TIME", raising=False)
    else:
        monkeypatch.setenv("TRIO_CUDA_SIM_KERNEL_TIME", env)
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(test_user=OPTIONS.replace("EXPECTED", repr(expected)))
    run(pytester, *args).assert_outcomes(passed=3)


@pytest.mark.parametrize("value", ["nan", "-1", "soon", "inf"])
def test_bad_kernel_time_option_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(test_user="def test_x(): pass\n")
    result = run(pytester, f"--trio-cuda-kernel-time={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--trio-cuda-kernel-time*expected a number of seconds >= 0*"])


def test_bad_environment_names_the_variable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_CUDA_SIM_KERNEL_TIME", "fast")
    pytester.makepyfile(test_user="def test_x(trio_cuda_sim): pass\ndef test_y(): pass\n")
    result = run(pytester)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*ValueError: TRIO_CUDA_SIM_KERNEL_TIME: expected a number of seconds >= 0*'fast'*"]
    )


def test_bad_marker_arguments(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_user="""
import pytest

@pytest.mark.trio_cuda_sim(0.5)
def test_positional(trio_cuda_sim): pass

@pytest.mark.trio_cuda_sim(check="no")
def test_check(trio_cuda_sim): pass

@pytest.mark.trio_cuda_sim(kernel_time=-1)
def test_value(trio_cuda_sim): pass
"""
    )
    result = run(pytester)
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(
        [
            "*TypeError: @pytest.mark.trio_cuda_sim: expected keyword arguments only, got (0.5,)",
            "*TypeError: @pytest.mark.trio_cuda_sim: check: expected a bool, got 'no'",
            "*ValueError: @pytest.mark.trio_cuda_sim: kernel_time: expected a non-negative number of "
            "seconds, got -1",
        ]
    )


BAD_MARKERS = """
import pytest

@pytest.mark.trio_cuda_sim(kernel_tme=0.5)
def test_sim_unknown(trio_cuda_sim): pass

@pytest.mark.trio_cuda_scope(device="cuda:1")
async def test_scope_device(trio_cuda_scope): pass

@pytest.mark.trio_cuda_scope(device="cuda:1")
async def test_gpu_scope_device(trio_cuda_gpu_scope): pass

@pytest.mark.trio_cuda_scope(stream=2)
async def test_scope_unknown(trio_cuda_scope): pass

@pytest.mark.trio_cuda_scope(streams=0)
async def test_scope_value(trio_cuda_scope): pass

@pytest.mark.trio_cuda_scope(conflicts=1)
async def test_scope_type(trio_cuda_scope): pass

@pytest.mark.trio_cuda_scope(2)
async def test_scope_positional(trio_cuda_scope): pass

@pytest.mark.trio_cuda_scope(streams=2, trace=False)
async def test_scope_fine(trio_cuda_scope):
    assert len(trio_cuda_scope.streams) == 2
"""


def test_bad_marker_arguments_name_the_marker_argument_expected_and_given(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(test_user=BAD_MARKERS)
    result = run(pytester)
    # (pytest-trio reports a failing Trio fixture as a failed test; the GPU
    # fixture skips first where there is no GPU)
    if HAS_GPU:
        result.assert_outcomes(passed=1, errors=1, failed=6)
    else:
        result.assert_outcomes(passed=1, errors=1, failed=5, skipped=1)
    lines = [
        "*TypeError: @pytest.mark.trio_cuda_sim: kernel_tme: expected a SimDevice option or check "
        "(name, memory, kernel_time, *), got kernel_tme=0.5",
        "*TypeError: @pytest.mark.trio_cuda_scope: device: expected no device (the scope fixtures open "
        "trio_cuda_sim, *), got device='cuda:1'",
        "*TypeError: @pytest.mark.trio_cuda_scope: stream: expected an open_scope option (streams, "
        "conflicts, drain_timeout, policy, trace), got stream=2",
        "*ValueError: @pytest.mark.trio_cuda_scope: streams: expected an int >= 1, got 0",
        "*@pytest.mark.trio_cuda_scope: conflicts: expected 'order' or 'error', got 1",
        "*TypeError: @pytest.mark.trio_cuda_scope: expected keyword arguments only, got (2,)",
    ]
    result.stdout.fnmatch_lines_random(lines)


GPU_MARKED = """
import pytest

@pytest.mark.gpu
def test_marked_by_hand():
    pass

async def test_uses_the_gpu_scope(trio_cuda_gpu_scope):
    pass

def test_plain():
    pass
"""


def test_gpu_marker_registered_when_the_project_has_none(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntrio_mode = true\naddopts = --strict-markers\n")
    pytester.makepyfile(test_user=GPU_MARKED)
    assert_gpu_outcome(run(pytester), passed=2)
    # tests using trio_cuda_gpu_scope are marked gpu, so `-m "not gpu"` leaves them out
    run(pytester, "-m", "not gpu").assert_outcomes(passed=1, deselected=2)
    result = run(pytester, "--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gpu: needs a real NVIDIA GPU (skipped cleanly without one)"])


def test_gpu_marker_of_the_project_is_kept(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        "[pytest]\ntrio_mode = true\naddopts = --strict-markers\n"
        "markers =\n    gpu(kind): our own GPU marker\n"
    )
    pytester.makepyfile(test_user=GPU_MARKED)
    assert_gpu_outcome(run(pytester), passed=2)
    out = run(pytester, "--markers").stdout.str()
    assert "@pytest.mark.gpu(kind): our own GPU marker" in out
    assert "needs a real NVIDIA GPU" not in out
    assert "@pytest.mark.trio_cuda_sim(**options)" in out


def _fake_install(tmp: Path) -> Path:
    """A site directory whose distribution declares the entry points of pyproject.toml,
    so that pytest finds the plugin as it does once trio_cuda is installed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry_points = project["project"]["entry-points"]["pytest11"]
    assert entry_points == {"trio_cuda": PLUGIN}
    site = tmp / "site"
    info = site / "trio_cuda_plugin_check-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trio-cuda-plugin-check\nVersion: 0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[pytest11]\n{lines}")
    return site


def test_entry_point_loads_the_plugin_without_importing_cuda(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed, the plugin loads by itself (no -p), imports no CUDA module, and
    ``-p no:trio_cuda`` turns it off."""
    site = _fake_install(pytester.path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(
        test_user="""
import sys
import numpy as np

def cuda_modules():
    return sorted(m for m in sys.modules if m == "cuda" or m.startswith("cuda."))

def test_plain():
    assert cuda_modules() == []

async def test_scope(trio_cuda_scope):
    x = await trio_cuda_scope.to_device(np.ones(3))
    assert (await trio_cuda_scope.to_host(x)).tolist() == [1, 1, 1]
    assert cuda_modules() == []
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:trio_cuda")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*fixture 'trio_cuda_scope' not found*"])


def test_plugin_module_imports_no_cuda() -> None:
    import subprocess

    code = (
        f"import sys; import {PLUGIN}; "
        "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def _documented_example() -> str:
    """The example test file of docs/testing.rst (the block captioned tests/test_double.py)."""
    text = (ROOT / "docs" / "testing.rst").read_text()
    start = text.index("   :caption: tests/test_double.py\n")
    lines = text[start:].splitlines()[1:]
    while lines[0].strip().startswith(":"):
        lines = lines[1:]
    body = []
    for line in lines:
        if line and not line.startswith("   "):
            break
        body.append(line[3:])
    return "\n".join(body)


def test_the_documented_example_runs(pytester: pytest.Pytester) -> None:
    example = _documented_example()
    assert "async def test_cancelled_while_the_kernel_runs(trio_cuda_scope, trio_cuda_sim):" in example
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(test_double=example)
    result = run(pytester)
    assert_gpu_outcome(result, passed=3)


NEEDS_PYTEST_TRIO = """
def test_sim_needs_no_pytest_trio(trio_cuda_sim):
    assert trio_cuda_sim.live_allocations == []

async def test_scope(trio_cuda_scope):
    assert trio_cuda_scope.backend == "sim"

def test_sync_test_on_the_scope(trio_cuda_scope):
    pass

async def test_gpu_scope(trio_cuda_gpu_scope):
    assert trio_cuda_gpu_scope.backend == "cuda"
"""

#: pytest, in a process where ``pytest_trio`` cannot be imported, as where pytest-trio is not
#: installed (with plugin autoloading off: no entry point imports it, and pytest's assertion
#: rewriter, which finds the modules of entry-point plugins itself, is not asked for it)
WITHOUT_PYTEST_TRIO = """
import importlib.abc
import sys

class NoPytestTrio(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "pytest_trio":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoPytestTrio())
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


def _run_apart(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str, blocked: bool, autoload: bool
) -> pytest.RunResult:
    """pytest on ``NEEDS_PYTEST_TRIO`` in a subprocess, with the plugin loaded."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if autoload:
        monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        plugin: list[str] = []
    else:
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        plugin = _plugin_args()
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(test_user=NEEDS_PYTEST_TRIO)
    run_pytest = ["-c", WITHOUT_PYTEST_TRIO] if blocked else ["-m", "pytest"]
    return pytester.run(sys.executable, *run_pytest, *plugin, "-p", "no:cacheprovider", "-rsE", *args)


def _assert_refused(result: pytest.RunResult, why: str) -> None:
    """The three tests on a scope fixture fail at setup, each naming its fixture, pytest-trio,
    ``why`` and how to make the test a Trio test; the one on trio_cuda_sim passes."""
    result.assert_outcomes(passed=1, errors=3)
    out = result.stdout.str()
    message = (
        "trio_cuda's scope fixtures are Trio fixtures and need the pytest-trio plugin, "
        f"{why}; then make the test a Trio test (trio_mode = true in the pytest configuration, "
        "or @pytest.mark.trio)"
    )
    lines = out.splitlines()
    assert lines.count(f"trio_cuda_scope: {message}") == 2, out
    assert lines.count(f"trio_cuda_gpu_scope: {message}") == 1, out
    result.stdout.fnmatch_lines_random(
        [
            "ERROR test_user.py::test_scope - Failed: trio_cuda_scope: *",
            "ERROR test_user.py::test_sync_test_on_the_scope - Failed: trio_cuda_scope: *",
            "ERROR test_user.py::test_gpu_scope - Failed: trio_cuda_gpu_scope: *",
        ]
    )
    assert "requested an async fixture" not in out, out
    assert "Traceback" not in out, out


def test_scope_fixtures_without_pytest_trio_name_it_and_the_extra(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run_apart(pytester, monkeypatch, blocked=True, autoload=False)
    _assert_refused(
        result,
        "which is not installed: pip install 'trio_cuda[pytest]' brings pytest and pytest-trio "
        "(or pip install pytest-trio)",
    )


def test_scope_fixtures_with_pytest_trio_turned_off_say_how_to_load_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run_apart(pytester, monkeypatch, "-p", "no:trio", blocked=False, autoload=True)
    _assert_refused(
        result,
        "which is installed but not loaded in this run: it was turned off (-p no:trio), or "
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD is set; load it with -p trio",
    )


@pytest.mark.parametrize("name", ["trio", "pytest_trio.plugin"])
def test_pytest_trio_loaded_by_hand_is_found(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Without autoloading, ``-p trio`` (the advice above) or the module's name loads
    pytest-trio, and the scope fixtures run (a sync test on one gets pytest-trio's refusal)."""
    result = _run_apart(pytester, monkeypatch, "-p", name, blocked=False, autoload=False)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == (3 if HAS_GPU else 2), result.stdout.str()
    assert outcomes.get("skipped", 0) == (0 if HAS_GPU else 1), result.stdout.str()
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) == 1, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "E * RuntimeError: Trio fixtures can only be used by Trio tests",
            "ERROR test_user.py::test_sync_test_on_the_scope - RuntimeError: *",
        ]
    )
    assert "need the pytest-trio plugin" not in result.stdout.str()
