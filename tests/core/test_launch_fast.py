"""The typed launch's generated fast path against the checked reference path.

For any argument list, the fast path either builds exactly the launch the
checked path builds (same arena bytes, accesses, output and argument views),
or declines (None) and leaves the case, or the precise error, to the checked
path. The common case must take the fast path.
"""

import struct

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import stub_source
from trio_cuda import In, InOut, Kernel, KernelArgumentError, KernelLaunch, Out, Scalar, Slice
from trio_cuda._core import _compiled, _kernel
from trio_cuda._core._config import _SIMPLE_CONFIGS, cached_config, make_config
from trio_cuda._core._ops import Access
from trio_cuda._core._submit import launch_lease_plan

SCALAR_DTYPES = ["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "?"]
PAIR = np.dtype([("a", "f4"), ("b", "f8")], align=True)


def _nan(bits: int, dtype: str) -> object:
    """A NaN with a chosen payload: a Python float (``d``) or a NumPy scalar."""
    if dtype == "d":
        return struct.unpack("<d", struct.pack("<Q", bits))[0]
    width = {"f2": np.uint16, "f4": np.uint32, "f8": np.uint64}[dtype]
    return np.array([bits], dtype=width).view(dtype)[0]


ODD_VALUES = [
    None,
    "1",
    1j,
    float("nan"),
    float("inf"),
    -float("inf"),
    -0.0,
    1e300,
    65519.0,  # rounds to float16's max
    65520.0,  # overflows float16
    3.5e38,  # overflows float32
    2**53 + 1,
    2**60 + 2**36 + 1,  # double-rounds through float64
    2**64,
    -(2**63) - 1,
    _nan(0x7FF0000000000001, "d"),  # a signalling NaN
    _nan(0xFFF8000000000123, "d"),
    _nan(0x7C01, "f2"),
    _nan(0x7F800001, "f4"),
    _nan(0x7FF0000000000001, "f8"),
    np.longlong(3),  # int64's dtype, another type
    np.float64(2.5),
    np.int64(-1),
    np.bool_(True),
    np.void(b"\0" * 16),
    (1.0, 2.0),
]


def scalar_value(dt: np.dtype) -> st.SearchStrategy[object]:
    """Values a user might pass for a by-value parameter of ``dt``, right or wrong."""
    if dt.fields is not None:
        return st.sampled_from([(1.0, 2.0), np.zeros((), PAIR)[()], (1, 2, 3), 1.0])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        inside = st.integers(int(info.min), int(info.max))
        good = inside | inside.map(dt.type)
        edge = st.sampled_from([int(info.min) - 1, int(info.max) + 1, int(info.min), int(info.max)])
    elif dt.kind == "f":
        width = {2: 16, 4: 32, 8: 64}[dt.itemsize]
        good = st.floats(width=width).map(dt.type) | st.floats() | st.integers(-(2**60), 2**60)
        edge = st.floats(allow_nan=True, allow_infinity=True)
    else:
        good = st.booleans() | st.booleans().map(np.bool_)
        edge = st.sampled_from([0, 1, 1.0])
    odd = st.sampled_from(ODD_VALUES)
    return st.integers(0, 19).flatmap(lambda roll: good if roll < 16 else edge if roll < 18 else odd)


@st.composite
def params(draw: st.DrawFn) -> list[object]:
    n = draw(st.integers(0, 6))
    out: list[object] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["scalar", "in", "out", "inout", "slice", "struct"]))
        dtype = draw(st.sampled_from(["f4", "i4"]))
        if kind == "scalar":
            out.append(Scalar(draw(st.sampled_from(SCALAR_DTYPES))))
        elif kind == "struct":
            # only sometimes: a struct parameter sends the whole kernel to the checked path
            out.append(Scalar(PAIR) if draw(st.integers(0, 3)) == 0 else Scalar("i4"))
        elif kind == "in":
            out.append(In(dtype))
        elif kind == "out":
            out.append(Out(dtype))
        elif kind == "inout":
            out.append(InOut(dtype))
        else:
            access = draw(st.sampled_from(["read", "write", "readwrite"]))
            length = draw(st.sampled_from(["u1", "u4", "u8", "i8"]))
            out.append(Slice(dtype, access=access, len_dtype=length))
    return out


async def _array_pool(gpu: object) -> dict[str, trio_cuda.DeviceArray]:
    """Arrays of each kind the checks tell apart; views share allocations."""
    g: object = gpu
    x = g.empty(16, np.float32)  # type: ignore[attr-defined]
    y = g.empty(300, np.float32)  # type: ignore[attr-defined]  # longer than a u1 length
    w = g.empty(8, np.int32)  # type: ignore[attr-defined]
    m = g.empty((4, 3), np.float32)  # type: ignore[attr-defined]
    gone = g.empty(4, np.float32)  # type: ignore[attr-defined]
    gone.close()
    handle = y[1:]
    handle.close()
    return {
        "x": x,
        "y": y,
        "w": w,
        "empty": g.empty(0, np.float32),  # type: ignore[attr-defined]
        "x[2:]": x[2:],
        "x[5:9]": x[5:9],
        "w[1:]": w[1:],
        "x ro": x.as_readonly(),
        "w ro": w.as_readonly(),
        "m": m,
        "m.T": m.T,
        "freed": gone,
        "closed handle": handle,
    }


def _view_key(view: object) -> object:
    """An ArgView's fields, a scalar as its type and bytes (NaN != NaN)."""
    fields = attrs.astuple(view, recurse=False)
    value = getattr(view, "value", None)
    if isinstance(value, np.void):  # a struct: its fields (its padding is not zeroed)
        raw = tuple(np.asarray(value[name]).tobytes() for name in value.dtype.names or ())
        return (fields[0], type(value), raw, *fields[1:4], *fields[5:])
    if isinstance(value, np.generic):
        return (fields[0], type(value), value.tobytes(), *fields[1:4], *fields[5:])
    return fields


def _same_launch(fast: KernelLaunch, checked: KernelLaunch) -> None:
    assert type(fast) is KernelLaunch
    fp, cp = fast.prepared, checked.prepared
    assert fp.arena == cp.arena
    assert fp.kernel is cp.kernel
    assert fp.config is cp.config
    assert fp.plan is cp.plan
    assert [(id(a), m) for a, m in internals.accesses_of(fast)] == [
        (id(a), m) for a, m in internals.accesses_of(checked)
    ]
    if isinstance(internals.output_of(checked), tuple):
        assert isinstance(internals.output_of(fast), tuple)
        assert [id(a) for a in internals.output_of(fast)] == [id(a) for a in internals.output_of(checked)]
    else:
        assert internals.output_of(fast) is internals.output_of(checked)
    assert [_view_key(v) for v in fp.arg_views()] == [_view_key(v) for v in cp.arg_views()]
    plan = internals.lease_plan_of(fast)
    if plan is not None:  # (the compiled path makes it with the launch: the one a first submission makes)
        want = launch_lease_plan(checked)
        assert [id(a) for a in plan[0]] == [id(a) for a in want[0]]
        assert plan[1] is want[1]
    assert set(fp.cache or ()) <= {"views"}  # its own scratch space, unused so far
    assert fp.enqueued is False
    with pytest.raises(AttributeError):
        internals.set_output(fast, None)


@settings(max_examples=600, deadline=None)
@given(data=st.data())
async def test_fast_path_builds_the_checked_launch_or_declines(data: st.DataObject) -> None:
    ps = data.draw(params())
    k = Kernel.from_source(stub_source("k"), "k", params=ps)
    has_struct = any(isinstance(p, Scalar) and p.dtype.fields is not None for p in ps)
    assert (internals.fast_launch(k) is None) == has_struct
    if _compiled.ext is not None and not has_struct:
        assert type(internals.fast_launch(k)).__name__ == "TypedLaunch"  # the compiled one is in use
    async with trio_cuda.open_scope(device="sim") as gpu:
        pool = await _array_pool(gpu)
        names = sorted(pool)
        args: list[object] = []
        for p in ps:
            if isinstance(p, Scalar):
                args.append(data.draw(scalar_value(p.dtype)))
            else:
                roll = data.draw(st.integers(0, 19))
                if roll == 0:
                    args.append(data.draw(st.sampled_from([1, 1.0, None, np.zeros(3, np.float32)])))
                elif roll < 3:  # anything: wrong dtype, read-only, closed...
                    args.append(pool[data.draw(st.sampled_from(names))])
                else:  # a usable array of the right dtype
                    writes = p.access is Access.WRITE
                    usable = [
                        a
                        for a in names
                        if pool[a].dtype == p.dtype
                        and not pool[a].closed
                        and not (writes and pool[a].readonly)
                    ]
                    args.append(pool[data.draw(st.sampled_from(usable))])
        arity = data.draw(st.sampled_from([0] * 18 + [-1, 1]))
        if arity < 0 and args:
            args.pop()
        elif arity > 0:
            args.append(pool["x"])
        event(_check_equivalent(k, args))


_GENERATED: dict[int, tuple[Kernel, object]] = {}


def _generated(k: Kernel) -> object:
    """The kernel's generated (pure-Python) fast path, compiled once per kernel."""
    entry = _GENERATED.get(id(k))
    if entry is None or entry[0] is not k:
        if len(_GENERATED) > 64:
            _GENERATED.clear()
        entry = _GENERATED[id(k)] = (k, _kernel._compile_fast_py(k))
    return entry[1]


def _check_equivalent(k: Kernel, args: list[object]) -> str:
    """Run both paths on ``args``: the fast path builds the checked path's
    launch or declines; the public entry point agrees. Where the fast path in
    use is the compiled one, it declines exactly where the generated one does,
    and builds the same launch. Returns the outcome."""
    config = cached_config(1, 1, 0, None, False, False)
    fast = internals.fast_launch(k)(tuple(args), config) if internals.fast_launch(k) is not None else None
    generated = _generated(k)
    if generated is not None and generated is not internals.fast_launch(k):
        reference = generated(tuple(args), config)  # type: ignore[operator]
        assert (fast is None) == (reference is None), (fast, reference)
        if reference is not None:
            _same_launch(fast, reference)
    refusal: KernelArgumentError | None = None
    try:
        checked = internals.checked_launch(k, tuple(args), config)
    except KernelArgumentError as exc:
        refusal = exc
    if refusal is not None:
        assert fast is None, f"fast path accepted what the checked path refuses: {refusal}"
        with pytest.raises(KernelArgumentError) as info:
            k.launch(*args, grid=1, block=1)
        assert str(info.value) == str(refusal)
        return "refused"
    if fast is not None:
        _same_launch(fast, checked)
    # the public entry point gives the same launch, by whichever path
    _same_launch(k.launch(*args, grid=1, block=1), checked)
    return "fast" if fast is not None else "declined, checked builds it"


def _edge_values(dt: np.dtype) -> list[object]:
    values: list[object] = [*ODD_VALUES, 0, 1, -1, 0.5, True, False]
    values += [np.dtype(d).type(1) for d in SCALAR_DTYPES]
    if dt.kind in "iu":
        info = np.iinfo(dt)
        values += [int(info.min) - 1, int(info.min), int(info.max), int(info.max) + 1]
    return values


@pytest.mark.parametrize("dtype", SCALAR_DTYPES)
async def test_edge_values_of_each_scalar_dtype(dtype: str) -> None:
    dt = np.dtype(dtype)
    k = Kernel.from_source(stub_source("k"), "k", params=[Scalar(dt), InOut("f4")])
    async with trio_cuda.open_scope(device="sim") as gpu:
        y = gpu.empty(4, np.float32)
        outcomes = {_check_equivalent(k, [v, y]) for v in _edge_values(dt)}
    assert outcomes >= {"fast", "refused"}


@pytest.mark.parametrize(
    "param", [In("f4"), Out("f4"), InOut("i4"), Slice("f4", len_dtype="u1"), Slice("i4")]
)
async def test_every_kind_of_array_for_each_array_param(param: object) -> None:
    k = Kernel.from_source(stub_source("k"), "k", params=[param, Scalar("i4"), In("f4")])
    async with trio_cuda.open_scope(device="sim") as gpu:
        pool = await _array_pool(gpu)
        for first in pool.values():
            for third in (pool["x"], pool["x[2:]"], pool["x ro"], pool["m.T"]):
                _check_equivalent(k, [first, 7, third])


@st.composite
def common_case(draw: st.DrawFn) -> tuple[list[object], list[str]]:
    """Right dtypes, in-range Python numbers or exact NumPy scalars, usable arrays."""
    n = draw(st.integers(1, 8))
    ps: list[object] = []
    args: list[str] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["int", "float", "bool", "in", "inout", "slice"]))
        if kind == "int":
            dt = np.dtype(draw(st.sampled_from(["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8"])))
            info = np.iinfo(dt)
            ps.append(Scalar(dt))
            args.append(draw(st.integers(int(info.min), int(info.max))))
        elif kind == "float":
            dt = np.dtype(draw(st.sampled_from(["f2", "f4", "f8"])))
            ps.append(Scalar(dt))
            width = {2: 16, 4: 32, 8: 64}[dt.itemsize]
            args.append(draw(st.floats(width=width, allow_nan=False) | st.floats(-1e4, 1e4)))
        elif kind == "bool":
            ps.append(Scalar("?"))
            args.append(draw(st.booleans()))
        else:
            ps.append({"in": In("f4"), "inout": InOut("f4"), "slice": Slice("f4")}[kind])
            args.append(draw(st.sampled_from(["x", "y", "x[2:]", "empty"])))
    return ps, args


@settings(max_examples=150, deadline=None)
@given(case=common_case())
async def test_the_common_case_takes_the_fast_path(case: tuple[list[object], list[object]]) -> None:
    ps, raw = case
    k = Kernel.from_source(stub_source("k"), "k", params=ps, reference=trio_cuda.NO_REFERENCE)
    assert internals.fast_launch(k) is not None
    counts = {"fast": 0, "checked": 0}
    fast_path = internals.fast_launch(k)

    def counting_fast(args: tuple[object, ...], config: object) -> object:
        made = fast_path(args, config)  # type: ignore[arg-type]
        counts["fast"] += made is not None
        return made

    internals.set_fast_launch(k, counting_fast)
    checked_path = internals.checked_launch_function(Kernel)

    def counting_checked(self: Kernel, args: tuple[object, ...], config: object) -> KernelLaunch:
        counts["checked"] += 1
        return checked_path(self, args, config)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        internals.patch_checked_launch(patch, Kernel, counting_checked)
        async with trio_cuda.open_scope(device="sim") as gpu:
            pool = await _array_pool(gpu)
            args = [pool[a] if isinstance(a, str) else a for a in raw]
            for _ in range(3):
                launch = k.launch(*args, grid=1, block=1)
            assert counts == {"fast": 3, "checked": 0}
            _same_launch(launch, checked_path(k, tuple(args), launch.config))
            await gpu.run(launch)


async def test_each_launch_owns_its_arguments_and_scratch_space() -> None:
    k = Kernel.from_source(
        stub_source("k"), "k", params=[Scalar("i4"), InOut("f4")], reference=trio_cuda.NO_REFERENCE
    )
    async with trio_cuda.open_scope(device="sim") as gpu:
        y = gpu.empty(4, np.float32)
        a = k.launch(1, y, grid=1, block=1)
        b = k.launch(2, y, grid=1, block=1)
        assert a.prepared.arena != b.prepared.arena
        assert a.prepared.scratch() is not b.prepared.scratch()
        assert a.prepared.arena[:4] == np.int32(1).tobytes()
        await gpu.run(a)
        await gpu.run(b)
        await gpu.run(a)  # a launch is reusable
        assert a.prepared.scratch() is not b.prepared.scratch()
        assert a.prepared.scratch() is a.prepared.cache


def test_kernel_without_params_and_wrong_arity() -> None:
    k = Kernel.from_source(stub_source("nop"), "nop", params=[])
    config = cached_config(1, 1, 0, None, False, False)
    assert internals.fast_launch(k) is not None
    assert internals.fast_launch(k)((), config) is not None
    assert internals.fast_launch(k)((1,), config) is None
    with pytest.raises(KernelArgumentError, match="expected 0 arguments"):
        k.launch(1, grid=1, block=1)
    k2 = Kernel.from_source(stub_source("two"), "two", params=[Scalar("i4"), Scalar("f4")])
    assert internals.fast_launch(k2) is not None
    assert internals.fast_launch(k2)((1,), config) is None
    assert internals.fast_launch(k2)((1, 2.0, 3), config) is None


def test_generated_source_takes_nothing_from_user_text() -> None:
    odd = Kernel.from_source(
        "", "k\nimport os  # ')", params=[Scalar("i4", name="x\n) or __import__('os')"), In("f4", name="'")]
    )
    plain = Kernel.from_source(stub_source("k"), "k", params=[Scalar("i4"), In("f4")])
    assert internals.fast_launch(odd) is not None
    assert internals.fast_launch(plain) is not None
    # the generated source (where the compiled path is used, it is made from the same table)
    assert _kernel._compile_fast_py(odd).__doc__ == _kernel._compile_fast_py(plain).__doc__


def test_cached_config_common_case_needs_exact_ints_and_bools() -> None:
    plain = cached_config(3, 32, 0, None, False, False)
    assert plain is cached_config(3, 32, 0, None, False, False)
    assert _SIMPLE_CONFIGS[(3, 32, 0)] is plain
    assert attrs.astuple(plain) == attrs.astuple(make_config(3, 32))
    # equal-hashing look-alikes never hit the cache, and are checked
    with pytest.raises(KernelArgumentError):
        cached_config(3.0, 32, 0, None, False, False)
    with pytest.raises(KernelArgumentError):
        cached_config(True, 32, 0, None, False, False)
    with pytest.raises(KernelArgumentError):
        cached_config(3, 32, 0.0, None, False, False)
    assert attrs.astuple(cached_config(3, 32, 0, None, np.bool_(False), False)) == attrs.astuple(plain)
    assert cached_config(3, 32, 0, None, np.bool_(False), False) is not plain
    coop = cached_config(3, 32, 0, None, True, False)
    assert coop.cooperative
    assert coop is not plain


async def test_arrays_of_an_exited_scope() -> None:
    k = Kernel.from_source(stub_source("k"), "k", params=[In("f4"), Slice("f4"), Scalar("i4")])
    async with trio_cuda.open_scope(device="sim") as gpu:
        pool = await _array_pool(gpu)
        x = pool["x"]
        alive = gpu.empty(4, np.float32)
        assert _check_equivalent(k, [x, alive, 1]) == "fast"
    async with trio_cuda.open_scope(device="sim") as other:
        alive = other.empty(4, np.float32)
        for arr in pool.values():
            assert _check_equivalent(k, [arr, alive, 1]) == "refused"
