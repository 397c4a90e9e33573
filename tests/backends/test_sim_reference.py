"""The simulator never runs a kernel that it silently does nothing for, nor
hides what its reference did wrong.

A kernel without ``reference=`` is refused at submission, on every path, with
nothing enqueued or retained; ``reference=NO_REFERENCE`` runs it as a no-op on
purpose. Where NVRTC can be loaded (no driver needed), a kernel's source is
compiled once per process, so a compile error or a missing kernel name
surfaces on a machine without a GPU as it would on one. A reference that
raises fails its launch as a faulting kernel does (CUDA_ERROR_LAUNCH_FAILED),
with a message that names the kernel and what the reference raised (the
expected arguments for a wrong arity, the argument for a write to a read-only
one) and the exception as its cause.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers.kernels import ADD, add, stub_source
from tests.helpers.sanitizer import skip_under_sanitizer
from trio_cuda import (
    NO_REFERENCE,
    CudaError,
    In,
    InOut,
    Kernel,
    LaunchError,
    MissingReferenceError,
    Out,
    Scalar,
    Slice,
    ops,
    unsafe,
)
from trio_cuda._backends import _nvrtc
from trio_cuda.testing import SimAllocation, SimDevice, Violation

F4 = np.float32
N = 8

SCALE_SRC = r"""
extern "C" __global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""
SCALE_PARAMS = [InOut("f4"), Scalar("f4"), Scalar("i4")]
#: the kernel of the report: no reference, so the simulator used to return its input unchanged
SCALE = Kernel.from_source(SCALE_SRC, "scale", params=SCALE_PARAMS)
SCALE_OFF = Kernel.from_source(SCALE_SRC, "scale", params=SCALE_PARAMS, reference=NO_REFERENCE)


def _scale_ref(x: Any, a: Any, n: Any) -> None:
    x[:n] *= a


SCALE_OK = Kernel.from_source(SCALE_SRC, "scale", params=SCALE_PARAMS, reference=_scale_ref)

BROKEN_SRC = 'extern "C" __global__ void broken(float* x) { x[0] = undeclared_name; }'

needs_nvrtc = pytest.mark.skipif(not _nvrtc.nvrtc_available(), reason="NVRTC cannot be loaded here")


def scale(k: Kernel, x: trio_cuda.DeviceArray) -> trio_cuda.KernelLaunch:
    return k.launch(x, F4(2), x.size, grid=1, block=N)


def host() -> np.ndarray[Any, Any]:
    return np.arange(N, dtype=F4)


def counters(sim: SimDevice, gpu: trio_cuda.ResourceScope) -> tuple[Any, ...]:
    """Everything that enqueuing or retaining anything would change (loading a
    kernel is neither: a kernel loaded before the refused one stays loaded)."""
    st = gpu.statistics()
    ss = sim.statistics()
    return (
        st.submitted,
        st.in_flight,
        st.leases_held,
        st.retained_bytes,
        st.pending_errors,
        ss.launches,
        ss.commands_executed,
        ss.pending,
        len(sim.trace),
    )


def assert_refused(info: pytest.ExceptionInfo[MissingReferenceError], name: str = "scale") -> None:
    err = info.value
    assert isinstance(err, trio_cuda.TrioCudaError)
    text = str(err)
    assert f"kernel {name!r} has no reference=" in text
    assert "reference=fn" in text
    assert "one argument per kernel parameter" in text
    assert "reference=trio_cuda.NO_REFERENCE" in text
    assert "refused before it was enqueued" in text


# --------------------------------------------------------------------------- refused at submission


async def test_the_reported_case_is_an_error_not_the_input_unchanged(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        before = counters(sim, gpu)
        with pytest.raises(MissingReferenceError) as info:
            await gpu.run(scale(SCALE, x))
        assert_refused(info)
        assert "scale(InOut(float32), Scalar(float32), Scalar(int32))" in str(info.value)
        assert counters(sim, gpu) == before
        # the scope is unharmed: the same work with a reference runs
        await gpu.run(scale(SCALE_OK, x))
        np.testing.assert_array_equal(await gpu.to_host(x), host() * 2)
    assert sim.live_allocations == []


@pytest.mark.parametrize(
    "path", ["submit", "run", "await", "zip", "then", "map", "shared", "builder", "unsafe", "load"]
)
async def test_every_submission_path_refuses_with_nothing_enqueued(sim: SimDevice, path: str) -> None:
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        before = counters(sim, gpu)
        with pytest.raises(MissingReferenceError) as info:
            if path == "submit":
                gpu.submit(scale(SCALE, x))
            elif path == "run":
                await gpu.run(scale(SCALE, x))
            elif path == "await":
                await scale(SCALE, x)
            elif path == "zip":  # the good part first: it is not enqueued either
                gpu.submit(trio_cuda.zip(add(y, 1), ops.fill(y, 3.0), scale(SCALE, x)))
            elif path == "then":
                gpu.submit(scale(SCALE, x).then(lambda _: add(y, 1)))
            elif path == "map":
                gpu.submit(trio_cuda.zip(add(y, 1), scale(SCALE, x).map(lambda a: a)))
            elif path == "shared":
                gpu.submit(trio_cuda.zip(add(y, 1), scale(SCALE, x).shared()))
            elif path == "builder":
                launch = (
                    SCALE.builder().grid(1).block(N).arg(x).arg(F4(2)).arg(np.int32(N)).finalize_unchecked()
                )
                gpu.submit(launch)
            elif path == "unsafe":
                unsafe.async_on(trio_cuda.zip(add(y, 1), scale(SCALE, x)), gpu.streams[1])
            else:
                await gpu.load(ADD, SCALE)
        assert_refused(info)
        assert counters(sim, gpu) == before
        np.testing.assert_array_equal(await gpu.to_host(y), host())
    assert sim.violations == []


async def test_capture_refuses_and_leaves_no_graph(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        before = counters(sim, gpu)
        with pytest.raises(MissingReferenceError) as info:
            await gpu.capture(trio_cuda.zip(add(y, 1), scale(SCALE, x)))
        assert_refused(info)
        assert counters(sim, gpu) == before
        graph = await gpu.capture(add(y, 1))  # capturing still works
        await gpu.run(graph.launch())
        graph.close()
        np.testing.assert_array_equal(await gpu.to_host(y), host() + 1)


async def test_a_device_pool_refuses_too() -> None:
    async with trio_cuda.open_device_pool([SimDevice(), SimDevice()]) as pool:
        x = await pool[1].to_device(host())
        before = [s.statistics().submitted for s in pool]
        with pytest.raises(MissingReferenceError):
            await pool.run(scale(SCALE, x))
        with pytest.raises(MissingReferenceError):
            pool.submit(scale(SCALE, x))
        assert [s.statistics().submitted for s in pool] == before
        assert [s.statistics().in_flight for s in pool] == [0, 0]


async def test_a_kernel_returned_by_a_then_closure_follows_the_partial_error_rule(sim: SimDevice) -> None:
    """What a ``then`` closure returns is only known once the first part was
    enqueued: that part stays retained until it completed, and the error
    reaches the caller (the partial-error rule)."""
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        sim.hold()
        with pytest.raises(MissingReferenceError):
            gpu.submit(add(y, 1).then(lambda _: scale(SCALE, x)))
        assert gpu.statistics().in_flight == 1  # the add, retained behind its marker
        assert sim.pending >= 1
        sim.release()
        np.testing.assert_array_equal(await gpu.to_host(y), host() + 1)
        np.testing.assert_array_equal(await gpu.to_host(x), host())


async def test_the_refusal_is_not_cached_as_a_load(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        for _ in range(3):
            with pytest.raises(MissingReferenceError):
                gpu.submit(scale(SCALE, x))
        assert sim.statistics().kernel_loads == 0


# --------------------------------------------------------------------------- NO_REFERENCE


async def test_no_reference_runs_as_a_no_op_that_still_takes_leases_and_time() -> None:
    sim = SimDevice(kernel_time=0.02)
    async with trio_cuda.open_scope(device=sim, streams=2) as gpu:
        x = await gpu.to_device(host())
        t0 = trio.current_time()
        fut = gpu.submit(scale(SCALE_OFF, x), stream=gpu.streams[0])
        st = gpu.statistics()
        assert st.in_flight == 1
        assert st.leases_held == 1
        assert st.retained_bytes == x.nbytes
        await fut.wait()
        assert trio.current_time() - t0 >= 0.015
        assert sim.statistics().launches == 1
        np.testing.assert_array_equal(await gpu.to_host(x), host())  # unchanged, on purpose
    assert sim.violations == []


def test_no_reference_is_one_typed_sentinel() -> None:
    assert trio_cuda.NO_REFERENCE is NO_REFERENCE
    assert repr(NO_REFERENCE) == "trio_cuda.NO_REFERENCE"
    assert type(NO_REFERENCE).__members__ == {"NO_REFERENCE": NO_REFERENCE}
    for make in (
        lambda r: Kernel.from_source(SCALE_SRC, "scale", params=SCALE_PARAMS, reference=r),
        lambda r: Kernel.from_ptx(".visible .entry k()\n{\n}\n", "k", params=[], reference=r),
        lambda r: Kernel.from_cubin(b"\x7fELF", "k", params=[], reference=r),
    ):
        assert make(NO_REFERENCE).reference is NO_REFERENCE
        assert make(None).reference is None
        assert make(_scale_ref).reference is _scale_ref
        refused = r"^reference: expected a function .*, trio_cuda.NO_REFERENCE or None, got "
        for bad in (True, "none", 0, object()):
            with pytest.raises(TypeError, match=refused):
                make(bad)


# --------------------------------------------------------------------------- the source check


@needs_nvrtc
async def test_a_compile_error_surfaces_on_the_simulator_as_on_a_gpu(sim: SimDevice) -> None:
    from trio_cuda._backends.cuda import nvrtc as cuda_nvrtc

    k = Kernel.from_source(BROKEN_SRC, "broken", params=[InOut("f4")], reference=lambda x: None)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        before = counters(sim, gpu)
        with pytest.raises(CudaError) as info:
            await gpu.run(k.launch(x, grid=1, block=1))
        assert counters(sim, gpu) == before
    err = info.value
    assert err.name == "NVRTC_ERROR_COMPILATION"
    assert err.call == "nvrtcCompileProgram(broken)"
    assert "undeclared_name" in err.text
    assert "error" in err.text
    # the cuda backend's compiler (no driver needed) raises the same error
    with pytest.raises(CudaError) as on_gpu:
        cuda_nvrtc.compile_source(BROKEN_SRC, "broken", (), (9, 0), 0, use_cache=False)
    assert type(on_gpu.value) is type(err)
    assert (on_gpu.value.code, on_gpu.value.name, on_gpu.value.call) == (err.code, err.name, err.call)
    assert re.findall(r"error: .*", on_gpu.value.text) == re.findall(r"error: .*", err.text)


@needs_nvrtc
async def test_the_compile_check_comes_before_the_reference_check(sim: SimDevice) -> None:
    k = Kernel.from_source(BROKEN_SRC, "broken", params=[InOut("f4")])  # neither compiles nor has one
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        with pytest.raises(CudaError, match="NVRTC_ERROR_COMPILATION"):
            gpu.submit(k.launch(x, grid=1, block=1))


@needs_nvrtc
async def test_an_empty_source_defines_no_kernel(sim: SimDevice) -> None:
    k = Kernel.from_source("", "k", params=[], reference=NO_REFERENCE)
    async with trio_cuda.open_scope(device=sim) as gpu:
        before = counters(sim, gpu)
        with pytest.raises(CudaError) as info:
            await gpu.run(k.launch(grid=1, block=1))
        assert counters(sim, gpu) == before
    err = info.value
    assert (err.code, err.name) == (500, "CUDA_ERROR_NOT_FOUND")
    assert err.call == "cuModuleGetFunction('k')"
    assert "no kernel named 'k' in its source (it defines no kernel at all)" in str(err)
    assert 'extern "C" __global__ void k(...)' in str(err)


@needs_nvrtc
async def test_a_misnamed_kernel_names_what_the_source_defines(sim: SimDevice) -> None:
    # a C++ (mangled) kernel and a misspelt name
    src = SCALE_SRC + "__global__ void cpp_kernel(int* p) { *p = 1; }\n"
    k = Kernel.from_source(src, "scal", params=SCALE_PARAMS, reference=_scale_ref)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        with pytest.raises(
            CudaError, match=r"no kernel named 'scal' in its source \(it defines 'scale', '_Z10"
        ):
            gpu.submit(scale(k, x))
        # the mangled name is a valid name
        mangled = Kernel.from_source(src, "_Z10cpp_kernelPi", params=[InOut("i4")], reference=NO_REFERENCE)
        await gpu.run(mangled.launch(gpu.zeros(1, np.int32), grid=1, block=1))


async def test_ptx_is_checked_for_its_entry_without_nvrtc(sim: SimDevice) -> None:
    ptx = (
        ".version 8.0\n.target sm_90\n.address_size 64\n// .entry k( is not here\n"
        "/* nor .entry k( */ .visible .entry other(\n)\n{\n\tret;\n}\n"
    )
    async with trio_cuda.open_scope(device=sim) as gpu:
        with pytest.raises(CudaError, match=r"no kernel named 'k' in its PTX \(it defines 'other'\)"):
            await gpu.run(
                Kernel.from_ptx(ptx, "k", params=[], reference=NO_REFERENCE).launch(grid=1, block=1)
            )
        await gpu.run(
            Kernel.from_ptx(ptx, "other", params=[], reference=NO_REFERENCE).launch(grid=1, block=1)
        )
        # a cubin is machine code the simulator does not read; only its reference matters
        cubin = Kernel.from_cubin(b"\x7fELF", "k", params=[])
        with pytest.raises(MissingReferenceError, match=r"Kernel\.from_cubin\(\.\.\., reference=fn\)"):
            await gpu.run(cubin.launch(grid=1, block=1))


def test_compiling_is_lazy_and_cached_per_source_and_options() -> None:
    """Nothing is compiled when a kernel is made; the first load compiles, and
    any other kernel, scope or device with the same source and options reuses
    the outcome (a compile error too, raised anew)."""
    if not _nvrtc.nvrtc_available():
        pytest.skip("NVRTC cannot be loaded here")
    src = stub_source("cached") + "// test_compiling_is_lazy_and_cached_per_source_and_options\n"
    start = _nvrtc.check_statistics()
    kernels = [Kernel.from_source(src, "cached", params=[], reference=NO_REFERENCE) for _ in range(3)]
    broken = [Kernel.from_source(BROKEN_SRC + "//lazy", "broken", params=[], reference=NO_REFERENCE)] * 2
    assert _nvrtc.check_statistics() == start  # lazy

    async def main() -> None:
        for k in kernels:
            async with trio_cuda.open_scope(device=SimDevice()) as gpu:
                await gpu.run(k.launch(grid=1, block=1))
                await gpu.run(k.launch(grid=1, block=1))
        errors = []
        for k in broken:
            async with trio_cuda.open_scope(device="sim") as gpu:
                with pytest.raises(CudaError) as info:
                    gpu.submit(k.launch(grid=1, block=1))
                errors.append(info.value)
        assert errors[0] is not errors[1]
        assert str(errors[0]) == str(errors[1])
        assert errors[1].__traceback__ is not None
        depth = len(list(_walk(errors[1].__traceback__)))
        assert depth < 30  # a fresh traceback, not one grown by re-raising
        # other options are another compilation
        other = Kernel.from_source(src, "cached", params=[], reference=NO_REFERENCE, options=["-DX=1"])
        async with trio_cuda.open_scope(device="sim") as gpu:
            await gpu.run(other.launch(grid=1, block=1))

    trio.run(main)
    end = _nvrtc.check_statistics()
    assert end["compiled"] - start["compiled"] == 3  # src, the broken one, src with -DX=1
    assert end["hits"] - start["hits"] >= 3


@needs_nvrtc
async def test_options_that_make_no_ptx_skip_the_entry_check_only(sim: SimDevice) -> None:
    src = stub_source("lto") + "// -dlto"
    async with trio_cuda.open_scope(device=sim) as gpu:
        k = Kernel.from_source(src, "lto", params=[], reference=NO_REFERENCE, options=["-dlto"])
        await gpu.run(k.launch(grid=1, block=1))
        misnamed = Kernel.from_source(src, "not_lto", params=[], reference=NO_REFERENCE, options=["-dlto"])
        await gpu.run(misnamed.launch(grid=1, block=1))  # (its name cannot be checked without PTX)
        lto = ["-dlto"]
        broken = Kernel.from_source(BROKEN_SRC, "broken", params=[], reference=NO_REFERENCE, options=lto)
        with pytest.raises(CudaError, match="NVRTC_ERROR_COMPILATION"):
            await gpu.run(broken.launch(grid=1, block=1))


@needs_nvrtc
def test_compiling_writes_only_into_its_own_buffers() -> None:
    """NVRTC writes the image and the log into buffers the caller provides: never into an
    immutable bytes object, which for one byte (an -dlto compile's empty PTX is its NUL) is
    the interpreter's shared b" ", corrupting every later use of it."""
    src = stub_source("own_buffers") + "// buffers"
    for opts in (["-dlto"], []):
        image, _ = _nvrtc.compile_program(src, "own_buffers", (*opts, "--gpu-architecture=compute_90"), "ptx")
        assert isinstance(image, bytes)
    assert bytes([32]) == b"\x20"
    assert bytes([32])[0] == 32
    assert " ".join(["a", "b"]).encode() == b"a b"


@needs_nvrtc
async def test_kernels_sharing_a_broken_source_each_get_their_own_error(sim: SimDevice) -> None:
    src = BROKEN_SRC + "\n// two kernels of one source"
    start = _nvrtc.check_statistics()
    errors = {}
    async with trio_cuda.open_scope(device=sim) as gpu:
        for name in ("first", "second"):
            k = Kernel.from_source(src, name, params=[], reference=NO_REFERENCE)
            with pytest.raises(CudaError) as info:
                gpu.submit(k.launch(grid=1, block=1))
            errors[name] = info.value
    assert _nvrtc.check_statistics()["compiled"] - start["compiled"] == 1
    for name, err in errors.items():
        assert err.call == f"nvrtcCompileProgram({name})"
        assert f"{name}.cu(1): error" in err.text
    assert errors["first"].text.replace("first.cu", "second.cu") == errors["second"].text


def _walk(tb: Any) -> Any:
    while tb is not None:
        yield tb
        tb = tb.tb_next


async def test_where_nvrtc_cannot_be_loaded_the_check_is_skipped_and_logged_once(
    sim: SimDevice, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_nvrtc() -> Any:
        raise RuntimeError("libnvrtc.so: cannot open shared object file")

    monkeypatch.setattr(_nvrtc, "load_nvrtc", no_nvrtc)
    monkeypatch.setattr(_nvrtc, "_available", None)
    monkeypatch.setattr(_nvrtc, "_nvrtc_version", None)
    monkeypatch.setattr(_nvrtc, "_checked", {})
    caplog.set_level(logging.DEBUG, logger="trio_cuda")
    ran: list[int] = []
    k = Kernel.from_source(BROKEN_SRC, "broken", params=[InOut("f4")], reference=lambda x: ran.append(1))
    start = _nvrtc.check_statistics()
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        await gpu.run(k.launch(x, grid=1, block=1))  # not checked: it runs its reference
        async with trio_cuda.open_scope(device=sim) as gpu2:
            await gpu2.run(k.launch(await gpu2.to_device(host()), grid=1, block=1))
        # the reference check does not need NVRTC
        with pytest.raises(MissingReferenceError):
            gpu.submit(scale(SCALE, x))
    assert ran == [1, 1]
    skipped = [r for r in caplog.records if "NVRTC cannot be loaded" in r.getMessage()]
    assert len(skipped) == 1
    assert skipped[0].levelno == logging.DEBUG
    assert "libnvrtc.so" in skipped[0].getMessage()
    assert _nvrtc.check_statistics()["skipped"] - start["skipped"] == 3
    assert _nvrtc.check_statistics()["compiled"] == start["compiled"]


def test_with_cuda_unimportable_the_check_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def guarded(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(f"blocked: {name}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)
    monkeypatch.setattr(_nvrtc, "_available", None)
    monkeypatch.setattr(_nvrtc, "_nvrtc_version", None)
    assert _nvrtc.nvrtc_available() is False


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
async def test_the_environment_variable_turns_the_check_off(
    sim: SimDevice, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("TRIO_CUDA_SIM_COMPILE", value)
    start = _nvrtc.check_statistics()
    k = Kernel.from_source(BROKEN_SRC + f"// {value}", "not_even_its_name", params=[], reference=NO_REFERENCE)
    ptx = Kernel.from_ptx("// no entry at all", "k", params=[], reference=NO_REFERENCE)
    async with trio_cuda.open_scope(device=sim) as gpu:
        await gpu.run(k.launch(grid=1, block=1))
        await gpu.run(ptx.launch(grid=1, block=1))
        with pytest.raises(MissingReferenceError):  # not a compile check: still refused
            await gpu.run(Kernel.from_source(BROKEN_SRC, "broken", params=[]).launch(grid=1, block=1))
    assert _nvrtc.check_statistics() == start


@needs_nvrtc
@pytest.mark.parametrize("value", ["1", "", "yes"])
async def test_any_other_value_keeps_the_check_on(
    sim: SimDevice, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("TRIO_CUDA_SIM_COMPILE", value)
    async with trio_cuda.open_scope(device=sim) as gpu:
        with pytest.raises(CudaError, match="NVRTC_ERROR_COMPILATION"):
            await gpu.run(Kernel.from_source(BROKEN_SRC, "broken", params=[]).launch(grid=1, block=1))


@needs_nvrtc
async def test_the_check_compiles_for_the_simulated_devices_architecture() -> None:
    """A virtual architecture (PTX: no driver) of the simulated device: code
    for a newer GPU fails on an older simulated one, as it would there."""
    src = r"""
    extern "C" __global__ void clustered(int* x) {
    #if __CUDA_ARCH__ < 900
        this_needs_sm_90;
    #endif
        x[0] = 1;
    }
    """
    k = Kernel.from_source(src, "clustered", params=[InOut("i4")], reference=lambda x: x.fill(1))
    for cc, ok in (((9, 0), True), ((8, 0), False)):
        async with trio_cuda.open_scope(device=SimDevice(compute_capability=cc)) as gpu:
            x = gpu.zeros(1, np.int32)
            if ok:
                await gpu.run(k.launch(x, grid=1, block=1))
            else:
                with pytest.raises(CudaError, match="this_needs_sm_90"):
                    await gpu.run(k.launch(x, grid=1, block=1))
    assert _nvrtc.virtual_arch((9, 0)) == "compute_90"
    assert _nvrtc.virtual_arch((1, 0)).startswith("compute_")  # too old: NVRTC's oldest


# --------------------------------------------------------------------------- what learners see


def test_a_kernels_repr_shows_its_code_by_size_and_hash_not_in_full() -> None:
    text = repr(SCALE)
    assert SCALE_SRC not in text
    assert "blockIdx" not in text
    assert text.startswith("<Kernel scale(InOut(float32), Scalar(float32), Scalar(int32)) ")
    assert f"source=<{len(SCALE_SRC)} chars, sha256 " in text
    assert text.endswith(" reference=None>")
    assert repr(SCALE_OK).endswith(" reference=_scale_ref>")
    assert repr(SCALE_OFF).endswith(" reference=trio_cuda.NO_REFERENCE>")
    assert repr(SCALE) != repr(Kernel.from_source(SCALE_SRC + " ", "scale", params=SCALE_PARAMS))
    named = Kernel.from_source("x" * 100_000, "big", params=[Scalar("f4", name="a")], options=["-O3"])
    assert len(repr(named)) < 200
    assert "big(a: Scalar(float32))" in repr(named)
    assert "options=('-O3',)" in repr(named)
    ptx = Kernel.from_ptx(b"\0" * 5000, "p", params=[])
    assert "ptx=<5000 bytes, sha256 " in repr(ptx)


async def test_sim_records_show_addresses_in_hex_as_arrays_do(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = gpu.empty(N, F4)
        (alloc,) = sim.live_allocations
        assert isinstance(alloc.ptr, int)
        assert alloc.ptr == x.ptr
        assert repr(alloc) == f"SimAllocation(ptr={x.ptr:#x}, nbytes={x.nbytes})"
        assert f"at {x.ptr:#x}" in repr(x)
    v = Violation("use_after_free", 0x7F00_0000_1000, 4, "launch k", 0)
    assert "address=0x7f0000001000" in repr(v)
    assert SimAllocation(255, 1) == SimAllocation(0xFF, 1)


# --------------------------------------------------------------------------- the same errors on a GPU


def _cuda_available() -> bool:
    from trio_cuda._backends import probe_cuda

    return probe_cuda().available


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="no CUDA device")
@skip_under_sanitizer(
    "deliberately failing driver calls (cuModuleGetFunction), which compute-sanitizer reports"
)
async def test_a_gpu_raises_what_the_simulator_raises() -> None:
    empty = Kernel.from_source("", "k", params=[])
    misnamed = Kernel.from_source(SCALE_SRC, "scal", params=SCALE_PARAMS)
    broken = Kernel.from_source(BROKEN_SRC, "broken", params=[InOut("f4")])
    ptx = Kernel.from_ptx(".version 8.0\n.target sm_90\n.address_size 64\n", "k", params=[])
    got: dict[str, list[CudaError]] = {}
    for device in ("cuda", SimDevice()):
        async with trio_cuda.open_scope(device=device) as gpu:
            x = await gpu.to_device(host())
            submitted = gpu.statistics().submitted
            errors = []
            for launch in (
                empty.launch(grid=1, block=1),
                scale(misnamed, x),
                broken.launch(x, grid=1, block=1),
                ptx.launch(grid=1, block=1),
            ):
                with pytest.raises(CudaError) as info:
                    await gpu.run(launch)
                errors.append(info.value)
            got[gpu.statistics().backend] = errors
            assert gpu.statistics().submitted == submitted
    for on_gpu, on_sim in zip(got["cuda"], got["sim"], strict=True):
        assert type(on_gpu) is type(on_sim)
        assert (on_gpu.code, on_gpu.name, on_gpu.call) == (on_sim.code, on_sim.name, on_sim.call)
    for i in (0, 1, 3):  # the same message: no kernel named ... in its source / PTX (it defines ...)
        assert str(got["cuda"][i]) == str(got["sim"][i])
    assert "(it defines 'scale')" in str(got["cuda"][1])
    assert re.findall(r"error: .*", got["cuda"][2].text) == re.findall(r"error: .*", got["sim"][2].text)
    # on a GPU, no reference is needed: the kernel's CUDA code runs
    async with trio_cuda.open_scope(device="cuda") as gpu:
        x = await gpu.to_device(host())
        await gpu.run(scale(SCALE, x))
        np.testing.assert_array_equal(await gpu.to_host(x), host() * 2)


# --------------------------------------------------------------------------- a reference that raises

RAISING_SRC = r"""
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
"""
RAISING_PARAMS = [Scalar("f4", name="a"), In("f4", name="x"), InOut("f4", name="y"), Scalar("i4")]


def _divides(a: Any, x: Any, y: Any, n: Any) -> None:
    y[0] = 1 / (int(n) - int(n))


def _two_args(a: Any, x: Any) -> None:
    pass  # pragma: no cover - never called: the call itself fails


def _writes_x(a: Any, x: Any, y: Any, n: Any) -> None:
    x[:n] = a


def _adds_to_x(a: Any, x: Any, y: Any, n: Any) -> None:
    x += a


def _copies_into_x(a: Any, x: Any, y: Any, n: Any) -> None:
    np.copyto(x, y)  # NumPy's own read-only error


def _type_error_inside(a: Any, x: Any, y: Any, n: Any) -> None:
    len(a)  # a TypeError of the body, not of the call


#: reference -> (what the message says, the type of its __cause__)
RAISES: dict[str, tuple[Any, list[str], type[BaseException]]] = {
    "zero_division": (
        _divides,
        ["kernel axpy: its reference raised ZeroDivisionError: division by zero"],
        ZeroDivisionError,
    ),
    "arity": (
        _two_args,
        [
            "kernel axpy: its reference raised TypeError: _two_args() takes 2 positional arguments "
            "but 4 were given",
            "a reference takes one argument per kernel parameter, here 4: argument 0 (a: Scalar(float32)) "
            "as a NumPy scalar; argument 1 (x: In(float32)) as a view; argument 2 (y: InOut(float32)) as "
            "a view; argument 3 (Scalar(int32)) as a NumPy scalar",
        ],
        TypeError,
    ),
    "write_to_in": (
        _writes_x,
        [
            "kernel axpy: its reference raised ValueError: argument 1 (x: In(float32)) is read-only (In): "
            "the kernel only reads it; declare it InOut or Out to write to it"
        ],
        ValueError,
    ),
    "in_place_to_in": (_adds_to_x, ["argument 1 (x: In(float32)) is read-only (In)"], ValueError),
    "numpy_read_only": (
        _copies_into_x,
        [
            "its reference raised ValueError: assignment destination is read-only; the kernel only "
            "reads argument 1 (x: In(float32)), In"
        ],
        ValueError,
    ),
    "type_error_inside": (_type_error_inside, ["its reference raised TypeError: "], TypeError),
}


@pytest.mark.parametrize("path", ["run", "submit", "async_on"])
@pytest.mark.parametrize("case", list(RAISES))
async def test_a_reference_that_raises_says_so(sim: SimDevice, case: str, path: str) -> None:
    reference, texts, cause = RAISES[case]
    k = Kernel.from_source(RAISING_SRC, "axpy", params=RAISING_PARAMS, reference=reference)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        y = await gpu.to_device(host())
        launch = k.launch(F4(2), x, y, N, grid=1, block=N)
        with pytest.raises(LaunchError) as info:
            if path == "run":
                await gpu.run(launch)
            elif path == "submit":
                await gpu.submit(launch).wait()
            else:
                unsafe.async_on(launch, gpu.streams[0])  # enqueued: the stream's next marker fails
                await gpu.to_host(y, stream=gpu.streams[0])
        err = info.value
        assert (err.code, err.name) == (719, "CUDA_ERROR_LAUNCH_FAILED")  # as a faulting kernel on a GPU
        for text in texts:
            assert text in str(err)
        assert type(err.__cause__) is cause
        if case != "arity":
            assert "a reference takes one argument per kernel parameter" not in str(err)
        # the device goes on: a good launch after it runs
        await gpu.run(add(y, 1))
        np.testing.assert_array_equal(await gpu.to_host(x), host())  # never written
    assert sim.violations == []


async def test_a_wrong_arity_names_a_slice_as_a_view_then_its_length(sim: SimDevice) -> None:
    params = [Slice("f4", access="read", name="src"), Out("f4", name="dst")]
    k = Kernel.from_source(stub_source("sums"), "sums", params=params, reference=lambda src, dst: None)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        with pytest.raises(LaunchError) as info:
            await gpu.run(k.launch(x, gpu.zeros(1, F4), grid=1, block=1))
    assert (
        "here 3: argument 0 (src: Slice(float32)) as a view, then its length (uint64); "
        "argument 1 (dst: Out(float32)) as a view" in str(info.value)
    )


async def test_a_read_only_slice_names_its_access(sim: SimDevice) -> None:
    def ref(src: Any, n: Any, dst: Any) -> None:
        src[0] = 1

    params = [Slice("f4", access="read"), Out("f4")]
    k = Kernel.from_source(stub_source("ro"), "ro", params=params, reference=ref)
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(host())
        with pytest.raises(
            LaunchError, match=r'argument 0 \(Slice\(float32\)\) is read-only \(Slice, access="read"\)'
        ):
            await gpu.run(k.launch(x, gpu.zeros(1, F4), grid=1, block=1))
