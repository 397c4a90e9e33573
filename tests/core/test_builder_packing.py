"""The launch builder packs what the typed path packs, and what a plain
reference builder (the layout rules written out, one NumPy scalar per
argument) packs; its argument errors are the documented ones, and a refused
argument leaves the builder as it was."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_cuda
from tests.helpers import internals
from trio_cuda import In, InOut, KernelArgumentError, Out, Scalar, unsafe
from trio_cuda._core._arena import ParamPlan
from trio_cuda._core._launch import ArgView, _merge_accesses
from trio_cuda._core._ops import Access

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - an optional dependency
    ml_dtypes = None

NUMERIC = ["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "?", "c8", "c16"]
ML = ["bfloat16", "float8_e4m3fn", "int4"] if ml_dtypes is not None else []
PAIR = np.dtype([("a", "f4"), ("b", "f8")], align=True)
ODD = np.dtype({"names": ["a", "b"], "formats": ["f8", "u1"], "offsets": [0, 8], "itemsize": 9})
OVER = np.dtype([("x", "f4"), ("y", "f4")], metadata={"align": 16})
STRUCTS = [PAIR, ODD, OVER]


def dtype_of(name: Any) -> np.dtype[Any]:
    if isinstance(name, np.dtype):
        return name
    if name in ML:
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def scalars(dt: np.dtype[Any]) -> st.SearchStrategy[np.generic]:
    """NumPy scalars of ``dt`` with any bit pattern (NaN payloads, struct
    padding bytes included)."""

    def make(raw: bytes) -> np.generic:
        value: np.generic = np.frombuffer(raw, dtype=dt)[0]
        return value

    if dt.kind in "iu":
        info = np.iinfo(dt)
        return st.integers(int(info.min), int(info.max)).map(dt.type)
    if dt.kind == "b":
        return st.booleans().map(np.bool_)
    if dt.name == "int4":
        return st.integers(-8, 7).map(dt.type)
    return st.binary(min_size=dt.itemsize, max_size=dt.itemsize).map(make)


# --------------------------------------------------------------------------- the reference builder


def reference(kernel: trio_cuda.Kernel, program: list[tuple[Any, ...]]) -> dict[str, Any]:
    """What a builder running ``program`` (``("arg", value, access)`` and
    ``("boxed", raw, align)`` steps) makes, by the layout rules of the C ABI:
    each slot at a multiple of its alignment, a scalar's slot its dtype's size
    rounded up to its alignment, padding zero."""
    layout: list[tuple[int, int]] = []
    raws: list[bytes] = []
    views: list[ArgView] = []
    accesses: list[tuple[Any, Access]] = []
    outputs: list[Any] = []
    for index, (what, value, extra) in enumerate(program):
        if what == "boxed":
            data = bytes(value)
            raws.append(data)
            layout.append((len(data), extra))
            views.append(ArgView("raw", value=data))
        elif isinstance(value, trio_cuda.DeviceArray):
            if extra is not None:
                mode = Access.READ if extra == "read" else Access.WRITE
            else:
                declared = kernel.params[index].access if index < len(kernel.params) else None
                mode = Access.WRITE if declared is None else declared
            raws.append(np.uint64(value.ptr).tobytes())
            layout.append((8, 8))
            views.append(
                ArgView("array", value.ptr, value.shape, value.dtype, access=mode, order=value.order)
            )
            accesses.append((value, mode))
            if mode is Access.WRITE:
                outputs.append(value)
        else:
            dt = value.dtype
            if dt.fields is None:
                raws.append(np.asarray(value, dtype=dt).tobytes())
            else:
                buf = np.zeros(1, dtype=dt)
                buf[0] = value
                raws.append(buf.tobytes())
            align = max(
                dt.itemsize if dt.kind == "c" else max(1, dt.alignment),
                int((dt.metadata or {}).get("align", 0)),
            )
            if dt.fields:
                align = max([align] + [max(1, f[0].alignment) for f in dt.fields.values()])
            layout.append((-(-dt.itemsize // align) * align, align))
            views.append(ArgView("scalar", dtype=dt, value=value))
    own = [(s.size, s.align) for s in kernel.plan.slots]
    plan = kernel.plan if layout == own else ParamPlan.from_layout(layout)
    arena = bytearray(plan.size)
    for slot, raw in zip(plan.slots, raws, strict=True):
        arena[slot.offset : slot.offset + len(raw)] = raw
    output = None if not outputs else outputs[0] if len(outputs) == 1 else tuple(outputs)
    return {
        "arena": bytes(arena),
        "plan": plan,
        "own": plan is kernel.plan,
        "views": tuple(views),
        "accesses": [(id(a), m) for a, m in _merge_accesses(accesses)],
        "output": output,
    }


def summary(launch: Any) -> dict[str, Any]:
    prepared = launch.prepared
    out = internals.output_of(launch)
    return {
        "arena": prepared.arena,
        "plan": prepared.plan,
        "own": prepared.plan is launch.kernel.plan,
        "views": prepared.arg_views(),
        "accesses": [(id(a), m) for a, m in internals.accesses_of(launch)],
        "output": out,
    }


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["arena"] == want["arena"]
    assert got["plan"] == want["plan"]
    assert got["own"] == want["own"]  # the kernel's own plan, when the layouts agree
    assert [view_key(v) for v in got["views"]] == [view_key(v) for v in want["views"]]
    assert got["accesses"] == want["accesses"]
    out, ref = got["output"], want["output"]
    if isinstance(ref, tuple):
        assert isinstance(out, tuple)
        assert [id(a) for a in out] == [id(a) for a in ref]
    else:
        assert out is ref


def view_key(view: ArgView) -> tuple[Any, ...]:
    """An argument view, its scalar by identity (a NaN is not equal to itself)."""
    value = id(view.value) if view.kind == "scalar" else view.value
    return (view.kind, view.ptr, view.shape, view.dtype, value, view.length, view.access, view.order)


def config_of(launch: Any) -> tuple[Any, ...]:
    c = launch.config  # (configurations compare by identity)
    return (c.grid, c.block, c.shared_mem, c.cluster, c.cooperative, c.pdl)


def run(builder: Any, program: list[tuple[Any, ...]]) -> Any:
    for what, value, extra in program:
        if what == "boxed":
            builder.arg_boxed(value, align=extra)
        elif extra is None:
            builder.arg(value)
        else:
            builder.arg(value, access=extra)
    return builder


@st.composite
def geometries(draw: Any) -> dict[str, Any]:
    dims = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
    grid = draw(dims)
    cluster = draw(st.sampled_from([None, (1,), grid, (3,)]))
    return {
        "grid": grid,
        "block": draw(dims),
        "shared_mem": draw(st.integers(0, 4096)),
        "cluster": cluster,
        "cooperative": draw(st.booleans()),
        "pdl": draw(st.booleans()),
    }


def configure(builder: Any, geometry: dict[str, Any], order: list[str]) -> None:
    for name in order:
        value = geometry[name]
        if name in ("grid", "block"):
            getattr(builder, name)(*value)
        elif name == "cluster":
            if value is not None:
                builder.cluster(*value)
        else:
            getattr(builder, name)(value)


SETTERS = ["grid", "block", "shared_mem", "cluster", "cooperative", "pdl"]


# --------------------------------------------------------------------------- typed path vs builder


@settings(max_examples=150, deadline=None)
@given(data=st.data())
async def test_builder_launch_equals_the_typed_launch(data):
    """A builder given a kernel's own parameters in order makes the launch
    ``k.launch`` makes: the same bytes, plan, views, accesses, output,
    configuration and repr."""
    kinds = data.draw(
        st.lists(st.sampled_from(["scalar", "struct", "in", "out", "inout"]), min_size=0, max_size=7)
    )
    params: list[Any] = []
    for kind in kinds:
        if kind == "scalar":
            params.append(Scalar(dtype_of(data.draw(st.sampled_from(NUMERIC + ML)))))
        elif kind == "struct":
            params.append(Scalar(data.draw(st.sampled_from(STRUCTS))))
        else:
            params.append(
                {"in": In, "out": Out, "inout": InOut}[kind](data.draw(st.sampled_from(["f4", "i2"])))
            )
    k = trio_cuda.Kernel.from_source("", "k", params=params)
    geometry = data.draw(geometries())
    async with trio_cuda.open_scope(device="sim") as gpu:
        bases = {dt: gpu.zeros(64, dt) for dt in ("f4", "i2")}
        args: list[Any] = []
        for p in params:
            if isinstance(p, Scalar):
                args.append(data.draw(scalars(p.dtype)))
                continue
            base = bases[p.dtype.str[1:]]
            lo = data.draw(st.integers(0, 63))
            hi = data.draw(st.integers(lo, 64))
            view = data.draw(st.sampled_from([base, base[lo:hi]]))  # views of one allocation, too
            if p.access is Access.READ and data.draw(st.booleans()):
                view = view.as_readonly()
            args.append(view)
        builder = k.builder()
        order = data.draw(st.permutations(SETTERS))
        cut = data.draw(st.integers(0, len(order)))
        configure(builder, geometry, order[:cut])
        run(builder, [("arg", a, None) for a in args])
        configure(builder, geometry, order[cut:])
        refused = None
        try:
            typed = k.launch(*args, **geometry)
        except KernelArgumentError as exc:  # a geometry no GPU runs: refused alike
            refused = str(exc)
        if refused is not None:
            with pytest.raises(KernelArgumentError) as info:
                builder.finalize_unchecked()
            assert str(info.value) == refused
            return
        built = builder.finalize_unchecked()
        assert built.prepared.plan is k.plan
        checked = internals.checked_launch(k, tuple(args), typed.config)
        assert built.prepared.arena == checked.prepared.arena
        if not any(isinstance(a, np.floating | np.complexfloating) for a in args):
            assert built.prepared.arena == typed.prepared.arena  # (NaN payloads: see _arena)
        assert config_of(built) == config_of(typed)
        assert repr(built) == repr(typed)
        assert built.kernel is typed.kernel
        assert [view_key(v) for v in built.prepared.arg_views()] == [
            view_key(v) for v in typed.prepared.arg_views()
        ]
        assert [(id(a), m) for a, m in internals.accesses_of(built)] == [
            (id(a), m) for a, m in internals.accesses_of(typed)
        ]
        out, ref = internals.output_of(built), internals.output_of(typed)
        assert [id(a) for a in out] == [id(a) for a in ref] if isinstance(ref, tuple) else out is ref
        same(summary(built), reference(k, [("arg", a, None) for a in args]))


# --------------------------------------------------------------------------- any program vs the reference


@st.composite
def programs(draw: Any, arrays: list[Any]) -> list[tuple[Any, ...]]:
    steps: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(0, 8))):
        what = draw(st.sampled_from(["array", "scalar", "struct", "boxed"]))
        if what == "array":
            steps.append(
                ("arg", draw(st.sampled_from(arrays)), draw(st.sampled_from([None, "read", "readwrite"])))
            )
        elif what == "scalar":
            steps.append(("arg", draw(scalars(dtype_of(draw(st.sampled_from(NUMERIC + ML))))), None))
        elif what == "struct":
            steps.append(("arg", draw(scalars(draw(st.sampled_from(STRUCTS)))), None))
        else:
            raw = draw(st.binary(min_size=1, max_size=40))
            form = draw(st.sampled_from([bytes, bytearray, memoryview]))
            steps.append(("boxed", form(raw), draw(st.sampled_from([1, 2, 4, 8, 16, 32]))))
    return steps


@settings(max_examples=200, deadline=None)
@given(data=st.data())
async def test_any_builder_program_packs_as_the_reference(data):
    """Any sequence of ``arg``/``arg_boxed`` packs the reference's bytes, in
    the reference's plan (the kernel's own when the layouts agree), with its
    views, accesses and output; a builder finalized twice, or used on after
    it was finalized, leaves its earlier launches as they were."""
    params: list[Any] = data.draw(
        st.sampled_from([[], [In("f4"), Scalar("i4")], [Out("f4"), Out("f4"), Scalar("f8"), Scalar("u1")]])
    )
    k = trio_cuda.Kernel.from_source("", "k", params=params)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(32, "f4")
        y = gpu.zeros(16, "i2")
        arrays = [x, x[:8], x[8:], x[:8], y, y.as_readonly(), x.reshape(4, 8, order="F")]
        arrays = [a for a in arrays if not a.readonly]  # (readonly ones: the error test)
        program = data.draw(programs(arrays))
        builder = k.builder().grid(2).block(4)
        run(builder, program)
        first = builder.finalize_unchecked()
        again = builder.finalize_unchecked()
        want = reference(k, program)
        own = [(s.size, s.align) for s in k.plan.slots]
        assert (first.prepared.plan is k.plan) == (
            [(s.size, s.align) for s in want["plan"].slots] == own and want["plan"] is k.plan
        )
        same(summary(first), want)
        same(summary(again), want)
        assert first.prepared is not again.prepared
        # the builder goes on: the launches it made keep their arguments
        more = data.draw(programs(arrays))
        run(builder, more)
        later = builder.finalize_unchecked()
        same(summary(later), reference(k, program + more))
        same(summary(first), want)


# --------------------------------------------------------------------------- errors


BAD_ARGS: list[tuple[Any, str]] = [
    (1.0, "expected a DeviceArray or a NumPy scalar (use arg_boxed for raw bytes), got float"),
    (3, "expected a DeviceArray or a NumPy scalar (use arg_boxed for raw bytes), got int"),
    (None, "expected a DeviceArray or a NumPy scalar (use arg_boxed for raw bytes), got NoneType"),
    (b"abcd", "expected a DeviceArray or a NumPy scalar (use arg_boxed for raw bytes), got bytes"),
    (
        np.zeros(2, "f4"),
        "expected a DeviceArray or a NumPy scalar (use arg_boxed for raw bytes), got ndarray",
    ),
    (
        np.str_("x"),
        "expected a numeric, bool, complex or C-layout struct scalar, got <U1: 'U' dtypes are not kernel "
        "parameter types",
    ),
    (
        np.bytes_(b"xy"),
        "expected a numeric, bool, complex or C-layout struct scalar, got |S2: 'S' dtypes are not kernel "
        "parameter types",
    ),
    (
        np.datetime64(1, "s"),
        "expected a numeric, bool, complex or C-layout struct scalar, got datetime64[s]: 'M' dtypes are not "
        "kernel parameter types",
    ),
    (
        np.longdouble(1),
        "expected a numeric, bool, complex or C-layout struct scalar, got float128: float128 (long double) "
        "has no CUDA equivalent",
    ),
    (
        np.zeros(1, np.dtype({"names": ["a", "b"], "formats": ["u1", "f8"], "offsets": [0, 1]}))[0],
        "expected a numeric, bool, complex or C-layout struct scalar, got [('a', 'u1'), ('b', '<f8')]: field "
        "'b' (float64) is at offset 1, not a multiple of its alignment 8 as in C (build the dtype with "
        "align=True, or give C offsets)",
    ),
]
BAD_BOXED: list[tuple[Any, Any, str]] = [
    ("abcd", 4, "expected bytes, bytearray or memoryview, got str"),
    (np.zeros(4, "u1"), 4, "expected bytes, bytearray or memoryview, got ndarray"),
    (b"", 4, "raw bytes must not be empty"),
    (bytearray(), 1, "raw bytes must not be empty"),
    (b"abcd", 0, "align must be a power of two, got 0"),
    (b"abcd", 3, "align must be a power of two, got 3"),
    (b"abcd", -4, "align must be a power of two, got -4"),
    (b"abcd", 12, "align must be a power of two, got 12"),
    (b"abcd", True, "align must be a power of two, got True"),
    (b"abcd", 4.0, "align must be a power of two, got 4.0"),
]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
async def test_each_bad_argument_keeps_its_error_and_changes_nothing(data):
    """Every refused ``arg``/``arg_boxed`` raises its documented error, naming
    the index it would have taken, and the builder finalizes as if it had
    never been called; the same argument type refused after one accepted
    (a cached kind) is refused the same way."""
    k = trio_cuda.Kernel.from_source("", "k", params=[Out("f4"), In("f4"), Scalar("i4")])
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(8, "f4")
        ro = x.as_readonly()
        closed = gpu.zeros(8, "f4")
        closed.close()
        arrays = [x, x[2:]]
        good = data.draw(programs(arrays))
        cut = data.draw(st.integers(0, len(good)))
        builder = k.builder().grid(1).block(1)
        run(builder, good[:cut])
        for _ in range(data.draw(st.integers(1, 4))):
            index = cut
            case = data.draw(st.sampled_from(["arg", "boxed", "closed", "readonly", "access"]))
            if case == "arg":
                value, msg = data.draw(st.sampled_from(BAD_ARGS))
                with pytest.raises(KernelArgumentError) as info:
                    builder.arg(value)
                assert str(info.value) == f"argument {index}: {msg}"
            elif case == "boxed":
                raw, align, msg = data.draw(st.sampled_from(BAD_BOXED))
                with pytest.raises(KernelArgumentError) as info:
                    builder.arg_boxed(raw, align=align)
                assert str(info.value) == f"argument {index}: {msg}"
            elif case == "closed":
                with pytest.raises(KernelArgumentError) as info:
                    builder.arg(closed, access=data.draw(st.sampled_from([None, "read"])))
                assert str(info.value) == f"argument {index}: the array is closed"
            elif case == "readonly":
                # a write: asked for, or declared by the kernel's parameter at that index
                access = data.draw(st.sampled_from(["write", "readwrite"] + ([None] if index != 1 else [])))
                with pytest.raises(KernelArgumentError) as info:
                    builder.arg(ro, access=access)
                assert str(info.value) == f"argument {index}: write access to a read-only array"
            else:
                with pytest.raises(ValueError) as info:
                    builder.arg(x, access=data.draw(st.sampled_from(["all", "READ", ""])))
                assert str(info.value).startswith("access: expected 'read', 'write' or 'readwrite', got ")
            assert repr(builder) == f"<LaunchBuilder k ({index} args, not finalized)>"
        run(builder, good[cut:])
        # a read-only array read, declared or asked
        builder.arg(ro, access="read")
        got = summary(builder.finalize_unchecked())
        same(got, reference(k, [*good, ("arg", ro, "read")]))


async def test_a_builder_launch_fails_on_a_closed_scope_as_the_typed_one_does():
    def ref(x: Any, n: Any) -> None:
        x[:n] += 1

    k = trio_cuda.Kernel.from_source(
        'extern "C" __global__ void k(float* x, int n) {}',
        "k",
        params=[InOut("f4"), Scalar("i4")],
        reference=ref,
    )
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(8, "f4")
        stream = gpu.streams[0]
        typed = k.launch(x, 8, grid=1, block=8)
        built = k.builder().grid(1).block(8).arg(x).arg(np.int32(8)).finalize_unchecked()
        assert await gpu.run(built) is x  # the reference runs on the launch's views
        assert await gpu.run(typed) is x
        np.testing.assert_array_equal(await gpu.to_host(x), np.full(8, 2, np.float32))
    for attempt in (
        lambda op: gpu.submit(op),
        lambda op: unsafe.async_on(op, stream),
    ):
        errors = []
        for op in (typed, built):
            with pytest.raises(Exception) as info:
                attempt(op)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1]
