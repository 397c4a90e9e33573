"""The CUDA backend's direct driver calls (``_backends/cuda/_direct.c``, the
compiled part built at install) against their reference, cuda.bindings'
wrappers.

Without a GPU: the compiled calls pass exactly the values they were given to
the entry point (a ctypes function with the driver's prototype stands in for
it), return its CUresult, and refuse bad values by name; the selection
honours ``TRIO_CUDA_PURE`` and a missing extension. On a GPU (marked
``gpu``): random programs give the same results, statistics and errors on
both paths.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import ADD, SAXPY
from trio_cuda._backends import probe_cuda
from trio_cuda._backends.cuda import direct

PURE = direct.pure_requested()
needs_ext = pytest.mark.skipif(PURE, reason="TRIO_CUDA_PURE is set: the extension is not built")

P, U = ctypes.c_void_p, ctypes.c_uint
LAUNCH_T = ctypes.CFUNCTYPE(ctypes.c_int, P, U, U, U, U, U, U, U, P, P, P)
WRITE_T = ctypes.CFUNCTYPE(ctypes.c_int, P, ctypes.c_ulonglong, ctypes.c_uint32, U)

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)


class Recorder:
    """A stand-in entry point: records its arguments, returns ``result``."""

    def __init__(self, proto: Any, result: int) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.result = result

        def record(*args: Any) -> int:
            self.calls.append(tuple(0 if a is None else a for a in args))
            return self.result

        self.fn = proto(record)
        self.addr = ctypes.cast(self.fn, P).value


def ext() -> Any:
    from trio_cuda._backends.cuda import _direct  # type: ignore[attr-defined]

    return _direct


@needs_ext
def test_the_extension_was_built() -> None:
    """The install built it (CI checks the compiled path exists, not only the fallback)."""
    assert direct.built()


@needs_ext
@settings(max_examples=200, deadline=None)
@given(
    f=u64,
    dims=st.tuples(u32, u32, u32, u32, u32, u32, u32),
    stream=u64,
    params=u64,
    result=st.integers(0, 999),
)
def test_launch_passes_exactly_its_values(
    f: int, dims: tuple[int, ...], stream: int, params: int, result: int
) -> None:
    rec = Recorder(LAUNCH_T, result)
    prepared = ext().Launch(rec.addr, f, *dims, stream, params)
    assert prepared() == result
    assert prepared() == result  # a prepared call is reusable
    assert rec.calls == [(f, *dims, stream, params, 0)] * 2


@needs_ext
@settings(max_examples=200, deadline=None)
@given(
    layout=st.lists(st.tuples(st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 4)), max_size=80),
    f=u64,
    dims=st.tuples(u32, u32, u32, u32, u32, u32, u32),
    stream=u64,
    data=st.data(),
)
def test_launch_packed_points_the_driver_at_each_packed_parameter(
    layout: list[tuple[int, int]], f: int, dims: tuple[int, ...], stream: int, data: Any
) -> None:
    """Parameter i is read at ``arena + offsets[i]``: the stand-in reads
    each parameter through the ``void**`` it gets, during the call (past 64
    parameters the array is on the heap rather than the stack)."""
    from trio_cuda._core._arena import ParamPlan

    plan = ParamPlan.from_layout([(align * count, align) for align, count in layout])
    arena = data.draw(st.binary(min_size=plan.size, max_size=plan.size))
    offsets = direct.packed_offsets(plan.slots)
    assert offsets is not None
    seen: list[list[bytes]] = []

    def record(
        fn: Any,
        gx: int,
        gy: int,
        gz: int,
        bx: int,
        by: int,
        bz: int,
        smem: int,
        st_: Any,
        params: Any,
        extra: Any,
    ) -> int:
        argv = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        seen.append([ctypes.string_at(argv[i], slot.size) for i, slot in enumerate(plan.slots)])
        assert (fn or 0, gx, gy, gz, bx, by, bz, smem, st_ or 0, extra) == (f, *dims, stream, None)
        return 3

    cb = LAUNCH_T(record)
    addr = ctypes.cast(cb, P).value
    assert ext().launch_packed(addr, f, *dims, stream, arena, offsets) == 3
    assert seen == [[arena[s.offset : s.offset + s.size] for s in plan.slots]]


def test_packed_offsets_refuse_over_aligned_slots() -> None:
    from trio_cuda._core._arena import ParamPlan

    assert direct.packed_offsets(ParamPlan.from_layout([(8, 8), (64, 32)]).slots) is None
    assert direct.packed_offsets(ParamPlan.from_layout([(1, 1), (16, 16)]).slots) == bytes(
        [0, 0, 0, 0, 16, 0, 0, 0]
    )


@needs_ext
@settings(max_examples=200, deadline=None)
@given(stream=u64, addr=u64, value=st.integers(0, 2**70), result=st.integers(0, 999))
def test_writer_passes_the_value_modulo_2_32(stream: int, addr: int, value: int, result: int) -> None:
    rec = Recorder(WRITE_T, result)
    w = ext().Writer(rec.addr, stream, addr)
    assert w(value) == result
    assert rec.calls == [(stream, addr, value % 2**32, 0)]


@needs_ext
@pytest.mark.parametrize(
    ("index", "value", "name"),
    [(1, -1, "function"), (2, 2**32, "gx"), (8, -5, "shared_mem"), (9, "s", "stream"), (10, 1.5, "params")],
)
def test_bad_values_are_refused_by_name(index: int, value: object, name: str) -> None:
    rec = Recorder(LAUNCH_T, 0)
    args: list[object] = [rec.addr, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    args[index] = value
    with pytest.raises(TypeError, match=f"^{name}: expected"):
        ext().Launch(*args)
    if index < 10:  # (launch_packed takes the arena and offsets instead of params)
        with pytest.raises(TypeError, match=f"^{name}: expected"):
            ext().launch_packed(*args[:10], b"", b"")
    assert rec.calls == []
    with pytest.raises(ValueError, match="entry: expected the address of cuLaunchKernel, got 0"):
        ext().Launch(0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0)
    with pytest.raises(TypeError, match="expected 12 arguments"):
        ext().launch_packed(rec.addr, 1)
    ok: list[object] = [rec.addr, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    with pytest.raises(TypeError, match="arena, offsets: expected bytes, got bytearray and bytes"):
        ext().launch_packed(*ok, bytearray(8), b"")
    with pytest.raises(ValueError, match="offsets: expected a multiple of 4 bytes, got 3"):
        ext().launch_packed(*ok, bytes(8), b"abc")
    with pytest.raises(ValueError, match="parameter 1 at offset 8 is past the arena"):
        ext().launch_packed(*ok, bytes(8), bytes([0, 0, 0, 0, 8, 0, 0, 0]))
    assert rec.calls == []
    with pytest.raises(TypeError, match="takes no arguments"):
        ext().Launch(rec.addr, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0)(1)
    with pytest.raises(TypeError, match="expected 3 arguments"):
        ext().Writer(rec.addr, 1)
    with pytest.raises(TypeError, match="takes one argument"):
        ext().Writer(rec.addr, 1, 2)()


def test_selection_honours_the_environment_and_a_missing_extension() -> None:
    """In a fresh interpreter: TRIO_CUDA_PURE=1 selects the wrappers; so does an
    extension that is not there, and the backend still imports and reports it."""
    script = textwrap.dedent(
        """
        import sys
        if sys.argv[1] == "missing":
            sys.modules["trio_cuda._backends.cuda._direct"] = None  # as if never built
        from trio_cuda._backends.cuda import direct, launch, streams  # the backend imports
        print(direct.built(), direct.pure_requested(), direct.entries())
        direct.reset(pure=False)  # forced direct: still None without the extension
        print(direct.entries() is None or direct.built())
        """
    )
    env = dict(os.environ, TRIO_CUDA_PURE="1")
    out = subprocess.run(
        [sys.executable, "-c", script, "pure"], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0].split(" ")[1:] == ["True", "None"]
    env["TRIO_CUDA_PURE"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", script, "missing"], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == "False False None"
    assert out[1] == "True"


def test_reset_decides_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_CUDA_PURE", "1")
    direct.reset()
    try:
        assert direct.entries() is None
        direct.reset(pure=True)
        assert direct.entries() is None
    finally:
        monkeypatch.delenv("TRIO_CUDA_PURE")
        direct.reset()


# --------------------------------------------------------------------------- on a GPU

_PROBE = probe_cuda()

#: (kernel, stream, array a, array b, value) steps of a random program over 3 arrays
steps = st.lists(
    st.tuples(
        st.sampled_from(["saxpy", "add", "fill"]),
        st.integers(0, 3),
        st.integers(0, 2),
        st.integers(0, 2),
        st.integers(-4, 4),
    ),
    min_size=1,
    max_size=40,
)


async def _run_program(
    program: list[tuple[str, int, int, int, int]], *, pure: bool, hot: bool = True
) -> tuple[Any, ...]:
    direct.reset(pure=pure)
    direct.HOT = hot
    try:
        async with trio_cuda.open_scope(device="cuda", streams=4) as gpu:
            uses_direct = (internals.uses_direct_calls(gpu), internals.uses_hot_methods(gpu))
            arrs = [await gpu.to_device(np.arange(257, dtype=np.float32) * (i + 1)) for i in range(3)]
            s = gpu.streams
            futs = []
            for kind, si, a, b, v in program:
                if kind == "saxpy":
                    op = SAXPY.launch(np.float32(v), arrs[a], arrs[b], 257, grid=2, block=256)
                elif kind == "add":
                    op = ADD.launch(arrs[a], np.float32(v), 257, grid=2, block=256)
                else:
                    op = trio_cuda.ops.fill(arrs[a], float(v))
                futs.append(gpu.submit(op, stream=s[si]))
                if v == 0:  # some of them awaited in between
                    await futs[-1].wait()
            out = [await gpu.to_host(x) for x in arrs]
            stats = gpu.statistics()
        return uses_direct, out, stats.completed, stats.in_flight
    finally:
        direct.reset()
        direct.HOT = True


@pytest.mark.gpu
@pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}")
@pytest.mark.skipif(not direct.built(), reason="the extension is not built")
@settings(max_examples=25, deadline=None)
@given(program=steps)
def test_both_paths_agree_on_random_programs(program: list[tuple[str, int, int, int, int]]) -> None:
    """Direct calls with the compiled hot methods, direct calls without
    them, and the wrappers: the same arrays and statistics."""
    on, got_direct, done_d, left_d = trio.run(lambda: _run_program(program, pure=False))
    cold, got_cold, done_c, left_c = trio.run(lambda: _run_program(program, pure=False, hot=False))
    off, got_pure, done_p, left_p = trio.run(lambda: _run_program(program, pure=True))
    assert (on, cold, off) == ((True, True), (True, False), (False, False))
    for a, b, c in zip(got_direct, got_cold, got_pure, strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
    assert (done_d, left_d) == (done_c, left_c) == (done_p, left_p)
    assert left_d == 0


@pytest.mark.parametrize("code", [1, 2, 201, 400, 700, 719, 999])
def test_a_direct_calls_result_is_reported_as_the_wrappers_is(code: int) -> None:
    """A direct call returns the CUresult as an int, the wrapper as the enum:
    the error raised for either is the same (class, code, name)."""
    from cuda.bindings import driver as cu

    from trio_cuda._backends.cuda.errors import cuda_error

    a, b = cuda_error(code, "cuLaunchKernel(k)"), cuda_error(cu.CUresult(code), "cuLaunchKernel(k)")
    assert (type(a), a.code, a.name, str(a)) == (type(b), b.code, b.name, str(b))
    assert a.name.startswith("CUDA_ERROR_")


def test_info_says_which_launch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_cuda.__main__ import launch_path_line

    monkeypatch.setenv("TRIO_CUDA_PURE", "1")
    assert launch_path_line(True) == "cuda launch path: cuda.bindings wrappers (TRIO_CUDA_PURE is set)"
    monkeypatch.setenv("TRIO_CUDA_PURE", "0")
    if direct.built():
        assert "direct driver calls where a CUDA driver answers" in launch_path_line(False)
    monkeypatch.setattr(direct, "_ext", None)
    assert launch_path_line(True).endswith("(the compiled extension was not built at install)")
