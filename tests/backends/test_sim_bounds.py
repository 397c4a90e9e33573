"""The memcheck of a reference's accesses: an index past a view's extent is out of bounds.

NumPy clamps ``y[:1000]`` of 16 elements to 16; a GPU kernel with ``n = 1000``
touches 984 elements past the array. The simulator hands references
bounds-checked views: the first access past an argument's extent (or the
extent of a view derived from it) is an ``out_of_bounds`` violation, stops the
reference and fails the launch with CUDA_ERROR_ILLEGAL_ADDRESS, on every path.
"""

from __future__ import annotations

import copy as copy_module
import gc
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trio_cuda
from tests.helpers import internals
from tests.helpers.kernels import stub_source
from trio_cuda import In, InOut, Kernel, LaunchError, Out, Scalar, Slice, unsafe
from trio_cuda._backends.sim import views
from trio_cuda.testing import SimDevice, Violation

F4 = np.float32
N = 16

AXPY_SRC = r"""
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
"""


def axpy_ref(a: Any, x: Any, y: Any, n: Any) -> None:
    y[:n] += a * x[:n]


AXPY = Kernel.from_source(
    AXPY_SRC,
    "axpy",
    params=[Scalar("f4"), In("f4", name="x"), InOut("f4", name="y"), Scalar("i4")],
    reference=axpy_ref,
)


def kernel(params: list[Any], reference: Callable[..., object], name: str = "k") -> Kernel:
    return Kernel.from_source(stub_source(name), name, params=params, reference=reference)


def oob(sim: SimDevice) -> Violation:
    """The one violation recorded, which must be out of bounds; clears it."""
    (v,) = sim.violations
    assert v.kind == "out_of_bounds"
    sim.clear_violations()
    return v


def assert_illegal_address(err: BaseException, *texts: str) -> None:
    assert isinstance(err, LaunchError), repr(err)
    assert (err.code, err.name) == (700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    for text in texts:
        assert text in str(err), (text, str(err))
    assert isinstance(err.__cause__, IndexError)


# --------------------------------------------------------------------------- the reported case


async def test_the_reported_case_is_out_of_bounds_not_clean(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.ones(N, F4))
        y = await gpu.to_device(np.zeros(N, F4))
        with pytest.raises(LaunchError) as info:
            await gpu.run(AXPY.launch(2.0, x, y, 1000, grid=4, block=256))
        assert_illegal_address(
            info.value,
            "kernel axpy: its reference accessed memory out of bounds",
            "argument 2 (y: InOut(float32)) indexed [:1000]",
            "slice stop 1000 lies past the end of dimension 0 of extent 16",
            "recorded an out_of_bounds violation",
        )
        v = oob(sim)
        assert v.address == y.ptr + N * 4  # the first element past the array
        assert v.size == 4
        assert v.op.startswith("launch axpy: argument 2 (y: InOut(float32)) indexed [:1000]")
        assert v.stream == gpu.streams[0].index or v.stream is not None
        # the reference stopped at that access: y is untouched
        np.testing.assert_array_equal(await gpu.to_host(y), np.zeros(N, F4))
        # and the device is not broken: the same kernel in bounds runs
        await gpu.run(AXPY.launch(2.0, x, y, N, grid=1, block=N))
        np.testing.assert_array_equal(await gpu.to_host(y), np.full(N, 2, F4))
    assert sim.violations == []


@pytest.mark.parametrize("path", ["run", "submit", "async_on", "forgotten"])
async def test_every_path_fails_the_launch(sim: SimDevice, path: str) -> None:
    errors: list[BaseException] = []
    try:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = await gpu.to_device(np.ones(N, F4))
            y = await gpu.to_device(np.zeros(N, F4))
            launch = AXPY.launch(2.0, x, y, 17, grid=1, block=32)
            try:
                if path == "run":
                    await gpu.run(launch)
                elif path == "submit":
                    await gpu.submit(launch).wait()
                elif path == "async_on":
                    unsafe.async_on(launch, gpu.streams[0])
                    await gpu.to_host(y, stream=gpu.streams[0])  # the stream's next marker fails
                else:
                    gpu.submit(launch)  # never awaited: the error surfaces at the scope's exit
            except LaunchError as exc:
                errors.append(exc)
    except ExceptionGroup as group:
        errors.extend(group.exceptions)
    (err,) = errors
    assert_illegal_address(err, "argument 2 (y: InOut(float32)) indexed [:17]")
    oob(sim)


async def test_a_graph_replay_checks_each_replay(sim: SimDevice) -> None:
    n = np.zeros((), np.int32)  # what the reference reads at each replay

    def ref(a: Any, x: Any, y: Any, _n: Any) -> None:
        y[: int(n)] += a * x[: int(n)]

    k = kernel([Scalar("f4"), In("f4"), InOut("f4"), Scalar("i4")], ref, "replayed")
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.ones(N, F4))
        y = await gpu.to_device(np.zeros(N, F4))
        graph = await gpu.capture(k.launch(F4(1), x, y, N, grid=1, block=N))
        n[()] = N
        await gpu.run(graph.launch())
        assert sim.violations == []
        n[()] = N + 1
        with pytest.raises(LaunchError, match="ILLEGAL_ADDRESS"):
            await gpu.run(graph.launch())
        assert oob(sim).address == y.ptr + N * 4
        graph.close()
        np.testing.assert_array_equal(await gpu.to_host(y), np.ones(N, F4))


# --------------------------------------------------------------------------- what is out of bounds

SHAPE_1D = (16,)
SHAPE_2D = (4, 5)
MASK16 = np.arange(16) % 3 == 0

#: (shape, index): in bounds, as NumPy reads them
IN_BOUNDS: list[tuple[tuple[int, ...], Any]] = [
    (SHAPE_1D, 0),
    (SHAPE_1D, 15),
    (SHAPE_1D, -1),
    (SHAPE_1D, -16),
    (SHAPE_1D, np.int64(3)),
    (SHAPE_1D, np.array(15)),
    (SHAPE_1D, slice(None)),
    (SHAPE_1D, slice(0, 16)),
    (SHAPE_1D, slice(16, None)),  # empty, at the end: in bounds
    (SHAPE_1D, slice(-16, None)),
    (SHAPE_1D, slice(3, 2)),
    (SHAPE_1D, slice(None, None, -1)),
    (SHAPE_1D, slice(15, None, -1)),
    (SHAPE_1D, slice(5, -17, -1)),  # down to element 0
    (SHAPE_1D, slice(-16, 16, 5)),
    (SHAPE_1D, Ellipsis),
    (SHAPE_1D, None),
    (SHAPE_1D, ()),
    (SHAPE_1D, True),
    (SHAPE_1D, [0, 15, -16]),
    (SHAPE_1D, []),
    (SHAPE_1D, np.array([], dtype=np.int64)),
    (SHAPE_1D, np.array([3, 2], dtype=np.uint8)),
    (SHAPE_1D, MASK16),
    (SHAPE_1D, MASK16[:10]),  # shorter than the dimension: NumPy refuses it, not the memcheck
    (SHAPE_2D, (3, 4)),
    (SHAPE_2D, (-4, -5)),
    (SHAPE_2D, (slice(None), 4)),
    (SHAPE_2D, (Ellipsis, 4)),
    (SHAPE_2D, (slice(1, None), slice(None, 5))),
    (SHAPE_2D, ([0, 3], [4, 0])),
    (SHAPE_2D, np.ones(SHAPE_2D, bool)),
    (SHAPE_2D, np.ones(4, bool)),
    (SHAPE_2D, (slice(None), np.ones(5, bool))),
    (SHAPE_2D, (None, 3, None, 4)),
    (SHAPE_2D, (3, Ellipsis)),
    (SHAPE_2D, "f"),  # not an index of elements: left to NumPy
    (SHAPE_2D, (0, 1, 2)),  # too many indices: NumPy's own IndexError
    (SHAPE_2D, 2.0),  # not an index: NumPy's own IndexError
]

#: (shape, index, dimension, element past the extent, what the message says)
OUT_OF_BOUNDS: list[tuple[tuple[int, ...], Any, int, int, str]] = [
    (SHAPE_1D, 16, 0, 16, "index 16 is outside dimension 0 of extent 16"),
    (SHAPE_1D, -17, 0, -1, "index -17 is outside dimension 0 of extent 16 (negative indices count"),
    (SHAPE_1D, np.int32(99), 0, 99, "index 99 is outside"),
    (SHAPE_1D, slice(None, 1000), 0, 16, "slice stop 1000 lies past the end of dimension 0"),
    (SHAPE_1D, slice(2, 17), 0, 16, "slice stop 17 lies past the end"),
    (SHAPE_1D, slice(17, None), 0, 17, "slice start 17 lies past the end"),
    (SHAPE_1D, slice(17, 30), 0, 17, "slice start 17"),  # empty, but past the end
    (SHAPE_1D, slice(-17, None), 0, -1, "slice start -17 lies before the start of dimension 0"),
    (SHAPE_1D, slice(None, -17), 0, -1, "slice stop -17 lies before the start"),
    (SHAPE_1D, slice(16, None, -1), 0, 16, "slice start 16 lies past the end"),
    (SHAPE_1D, slice(-17, None, -1), 0, -1, "slice start -17"),
    (SHAPE_1D, slice(5, -18, -1), 0, -2, "slice stop -18"),
    (SHAPE_1D, [0, 16], 0, 16, "an index array holds 16, outside dimension 0 of extent 16"),
    (SHAPE_1D, np.array([-17, 0]), 0, -1, "an index array holds -17"),
    (SHAPE_1D, np.zeros(17, bool), 0, 16, "a boolean mask of length 17 spans dimension 0 of extent 16"),
    (SHAPE_1D, (Ellipsis, 16), 0, 16, "index 16"),
    (SHAPE_2D, 4, 0, 4, "index 4 is outside dimension 0 of extent 4"),
    (SHAPE_2D, (0, 5), 1, 5, "index 5 is outside dimension 1 of extent 5"),
    (SHAPE_2D, (slice(None), slice(6, None)), 1, 6, "slice start 6 lies past the end of dimension 1"),
    (SHAPE_2D, (Ellipsis, 5), 1, 5, "dimension 1 of extent 5"),
    (SHAPE_2D, (None, 0, None, 5), 1, 5, "dimension 1 of extent 5"),
    (SHAPE_2D, ([0, 1], [2, 5]), 1, 5, "an index array holds 5, outside dimension 1"),
    (SHAPE_2D, np.ones(5, bool), 0, 4, "a boolean mask of length 5 spans dimension 0 of extent 4"),
    (SHAPE_2D, (slice(None), np.ones(6, bool)), 1, 5, "mask of length 6 spans dimension 1 of extent 5"),
    (SHAPE_2D, np.ones((4, 6), bool), 1, 5, "mask of length 6 spans dimension 1"),
]

PTR = 0x7F00_0000_1000


def checked(shape: tuple[int, ...], *, readonly: bool = False) -> tuple[Any, views.LaunchCheck, list[Any]]:
    """A bounds-checked view of ``shape`` (float32, C order) as a launch's
    reference sees it, with its check and the list it records into."""
    recorded: list[Any] = []
    check = views.LaunchCheck("k", 0, recorded)
    plain = np.arange(int(np.prod(shape)), dtype=F4).reshape(shape)
    if readonly:
        plain.setflags(write=False)
    describe = lambda: ("argument 0 (In(float32))", "In")  # noqa: E731
    return views.bounded(plain, check, PTR, readonly, describe), check, recorded


def plain_result(shape: tuple[int, ...], key: Any) -> Any:
    a = np.arange(int(np.prod(shape)), dtype=F4).reshape(shape)
    try:
        return a[key]
    except Exception as exc:
        return type(exc)


@pytest.mark.parametrize(("shape", "key"), IN_BOUNDS, ids=[f"{s}-{k!r}"[:60] for s, k in IN_BOUNDS])
def test_an_index_in_bounds_reads_what_numpy_reads(shape: tuple[int, ...], key: Any) -> None:
    a, _, recorded = checked(shape)
    expected = plain_result(shape, key)
    if isinstance(expected, type):
        with pytest.raises(expected):
            a[key]
    else:
        np.testing.assert_array_equal(a[key], expected)
    assert recorded == []


@pytest.mark.parametrize(
    ("shape", "key", "dim", "element", "why"),
    OUT_OF_BOUNDS,
    ids=[f"{c[0]}-{c[1]!r}"[:60] for c in OUT_OF_BOUNDS],
)
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_an_index_out_of_bounds_is_recorded_and_stops_the_reference(
    shape: tuple[int, ...], key: Any, dim: int, element: int, why: str, write: bool
) -> None:
    a, check, recorded = checked(shape)
    before = a.view(np.ndarray).copy()
    with pytest.raises(views.OutOfBounds) as info:
        if write:
            a[key] = 0
        else:
            a[key]
    assert why in str(info.value)
    (v,) = recorded
    assert v.kind == "out_of_bounds"
    assert v.address == PTR + element * a.strides[dim]
    assert v.size == 4
    assert v.stream == 0
    action = "assigned to" if write else "indexed"
    assert v.op.startswith(f"launch k: argument 0 (In(float32)) {action} [")
    assert why in v.op
    assert check.first is not None
    np.testing.assert_array_equal(a.view(np.ndarray), before)  # nothing was written


def test_derived_views_are_checked_against_their_own_extent() -> None:
    a, check, recorded = checked((16,))
    tail = a[2:]
    assert tail[:14].shape == (14,)
    with pytest.raises(views.OutOfBounds, match=r"\(a view of shape \(14,\) of it\) indexed \[:15\]"):
        tail[:15]
    (v,) = recorded
    assert v.address == PTR + 16 * 4  # past the whole argument, through the view
    check.first = None
    recorded.clear()
    with pytest.raises(views.OutOfBounds, match=r"\(a view of shape \(16,\) of it\) indexed \[:20\]"):
        a[::-1][:20]  # a view of the same shape, reversed
    assert recorded[0].address == PTR - 4  # element 16 of the reversed view: just before the argument
    b, check, recorded = checked((4, 5))  # another launch
    for access, address in (
        (lambda: b.T[0, 4], PTR + 4 * 20),  # shape (5, 4): row 4 of the argument
        (lambda: b.reshape(20)[20], PTR + 20 * 4),
        (lambda: b[1:][3], PTR + 4 * 20),  # b[1:] has 3 rows
        (lambda: b[:, 1:][:, 4], PTR + 5 * 4),
        (lambda: b.view(np.int32)[0, 5], PTR + 5 * 4),
        (lambda: b.ravel()[::2][10], PTR + 20 * 4),
        (lambda: b[np.newaxis][0, 4], PTR + 4 * 20),
    ):
        recorded.clear()
        check.first = None
        with pytest.raises(views.OutOfBounds):
            access()
        assert [v.address for v in recorded] == [address]
    # a derived view in bounds reads what NumPy reads
    recorded.clear()
    np.testing.assert_array_equal(b[1:][2][1:3], np.arange(20, dtype=F4).reshape(4, 5)[3, 1:3])
    assert recorded == []


def test_only_the_first_access_of_a_launch_is_recorded_the_rest_counted() -> None:
    a, check, recorded = checked((16,))
    for key in (16, 17, slice(0, 99)):
        with pytest.raises(views.OutOfBounds):
            a[key]
    assert len(recorded) == 1
    assert check.more == 2


def test_take_put_and_ufunc_at_are_checked_in_raise_mode_only() -> None:
    a, check, recorded = checked((4, 5))
    np.testing.assert_array_equal(a.take([0, 19]), [0, 19])
    np.testing.assert_array_equal(a.take([99], mode="clip"), [19])  # explicit clamping is no access past
    np.testing.assert_array_equal(a.take(4, axis=1), [4, 9, 14, 19])
    a.put([0], [100])
    np.add.at(a, (0, [1, 1]), 1)
    assert a[0, 0] == 100
    assert a[0, 1] == 3
    assert recorded == []
    for call, action in (
        (lambda: a.take([0, 20]), "took [[0, 20]]"),
        (lambda: a.take(5, axis=1), "took [5, axis=1]"),
        (lambda: a.put([20], [0]), "put to [[20]]"),
        (lambda: np.add.at(a, (0, [5]), 1), "add.at [0, [5]]"),
    ):
        check.first = None
        recorded.clear()
        with pytest.raises(views.OutOfBounds):
            call()
        (v,) = recorded
        assert action in v.op, v.op


def test_a_check_ends_with_its_launch() -> None:
    a, check, recorded = checked((16,))
    kept = a[2:]
    assert check.close() is None
    assert check.args == []
    np.testing.assert_array_equal(a[:1000], np.arange(16, dtype=F4))  # plain NumPy again
    assert kept[:1000].shape == (14,)
    assert recorded == []


# --------------------------------------------------------------------------- views stay NumPy arrays


def test_arithmetic_gives_plain_arrays_and_views_keep_working_as_arrays() -> None:
    a, _, recorded = checked((4, 5))
    x = a[0]
    for result in (x + 1, x * x, np.sqrt(x), np.outer(x, x), np.maximum(x, 2), a.T @ a, -x, x[x > 2]):
        assert type(result) is np.ndarray
    assert type(x.sum()) is np.float32
    assert type(x @ x) is np.float32
    assert type(a.sum(axis=0)) is np.ndarray
    assert type(a.mean()) in (np.float32, np.float64)
    assert type(np.cumsum(x)) is np.ndarray
    assert type(np.asarray(x)) is np.ndarray
    assert np.shares_memory(np.asarray(x), a)
    assert repr(x) == repr(np.arange(5, dtype=F4))
    assert type(pickle.loads(pickle.dumps(x))) is np.ndarray
    for copy in (a.copy(), a.astype(np.float64), a[[0, 1]], np.copy(a), copy_module.deepcopy(a)):
        assert type(copy) is np.ndarray  # host memory, not the argument's
    assert type(np.sort(a)) is np.ndarray
    assert a.astype(F4, copy=False) is a  # not a copy: still the checked view
    for other in (np.concatenate([a, a]), np.where(a > 2, a, 0), np.stack([a, a]), np.unique(a)):
        assert other[:1000].shape[0] in (8, 4, 2, 20)  # new arrays, not checked
    assert a[[0, 1]][:1000].shape == (2, 5)  # a fancy-indexing result is a copy too
    assert recorded == []
    # in place through a view writes the argument, and gives the view back
    y = a[1]
    y += 1
    assert type(y) is views.BoundedView
    np.testing.assert_array_equal(a[1], [6, 7, 8, 9, 10])
    out = np.add(a[2], 1, out=a[3])
    assert type(out) is views.BoundedView
    np.testing.assert_array_equal(a[3], [11, 12, 13, 14, 15])
    q, r = np.divmod(a[0], 2, out=(None, a[0]))
    assert type(q) is np.ndarray
    assert type(r) is views.BoundedView
    a[2:4] *= 2
    a[[0, 1], 0] = -1
    a[a < 0] = 0
    assert recorded == []


def test_iterating_and_unpacking_stay_in_bounds() -> None:
    a, _, recorded = checked((4, 5))
    rows = list(a)
    assert len(rows) == 4
    assert all(type(r) is views.BoundedView for r in rows)
    assert [float(v) for v in a[1]] == [5, 6, 7, 8, 9]
    first, second = a[0, :2]
    assert (first, second) == (0, 1)
    assert [int(u) + int(v) for u, v in zip(a[0], a[1], strict=True)] == [5, 7, 9, 11, 13]
    assert sorted(a[3], reverse=True)[0] == 19
    assert list(reversed(a[0])) == [4, 3, 2, 1, 0]
    assert 7 in a
    with pytest.raises(TypeError, match="iteration over a 0-d array"):
        iter(a[0, 0, ...])
    assert recorded == []


#: NumPy functions whose own indexing of their argument must not trip the check
NUMPY_FUNCTIONS: dict[str, Callable[[Any, Any], object]] = {
    "diff": lambda x, a: (np.diff(x), np.diff(a, axis=1, n=2)),
    "gradient": lambda x, a: (np.gradient(x), np.gradient(a)),
    "convolve": lambda x, a: (np.convolve(x, x[:5]), np.correlate(x, x[:3], "full")),
    "roll": lambda x, a: (np.roll(x, 5), np.roll(a, 2, axis=1)),
    "sort": lambda x, a: (np.sort(x), np.argsort(a, axis=0), np.partition(x, 5), np.lexsort((x, x))),
    "statistics": lambda x, a: (
        np.median(a, axis=1),
        np.percentile(x, [10, 90]),
        np.quantile(a, 0.3, axis=0),
    ),
    "histogram": lambda x, a: (np.histogram(x, bins=5), np.bincount(x.astype(int)), np.digitize(x, [5, 10])),
    "sets": lambda x, a: (np.unique(a), np.isin(x, [1, 2]), np.setdiff1d(x, x[:3])),
    "pad": lambda x, a: (np.pad(x, 3), np.pad(a, 2, mode="reflect"), np.resize(x, 50)),
    "split": lambda x, a: (np.array_split(x, 5), np.split(a, 3), np.trim_zeros(x)),
    "edit": lambda x, a: (np.delete(x, [0, 36]), np.insert(x, 3, 9), np.append(x, 1)),
    "windows": lambda x, a: np.lib.stride_tricks.sliding_window_view(x, 4).sum(),
    "along_axis": lambda x, a: (
        np.take_along_axis(a, np.argsort(a, axis=1), axis=1),
        np.apply_along_axis(np.sum, 1, a),
    ),
    "linear_algebra": lambda x, a: (np.linalg.norm(a), a @ a.T, np.einsum("ij->j", a), np.kron(x[:3], x[:3])),
    "ufunc_methods": lambda x, a: (
        np.add.accumulate(a, axis=1),
        np.add.reduceat(x, [0, 5, 36]),
        np.add.reduce(a, where=a > 3),
        np.multiply.outer(x[:3], x[:3]),
    ),
    "shapes": lambda x, a: (
        np.rot90(a),
        np.moveaxis(a, 0, 1)[6, 5],
        np.triu(a),
        np.diag(a),
        np.stack([x, x]),
    ),
    "text": lambda x, a: (str(a), repr(a), np.array2string(a), a.tolist(), f"{x}"),
    "fft": lambda x, a: np.fft.fft(x),
}


@pytest.mark.parametrize("name", list(NUMPY_FUNCTIONS))
def test_numpy_functions_do_not_trip_the_check(name: str) -> None:
    x, _, recorded = checked((37,))
    a, _, recorded_2d = checked((6, 7))
    NUMPY_FUNCTIONS[name](x, a)
    assert recorded == recorded_2d == []


def test_a_write_to_a_read_only_argument_names_it() -> None:
    a, _, _ = checked((16,), readonly=True)
    message = r"argument 0 \(In\(float32\)\) is read-only \(In\): the kernel only reads it"
    for write in (
        lambda: a.__setitem__(0, 1),
        lambda: a.__setitem__(slice(None), 1),
        lambda: a[2:].__setitem__(0, 1),
        lambda: a.__iadd__(1),
        lambda: np.multiply(a, 2, out=a),
        lambda: np.add.at(a, [0], 1),
        lambda: a.put([0], [1]),
    ):
        with pytest.raises(ValueError, match=message):
            write()
    assert a[0] == 0
    assert a.sum() == sum(range(16))  # reading is fine


def test_checking_a_big_index_array_costs_no_python_per_element() -> None:
    a, _, recorded = checked((1 << 22,))
    plain = a.view(np.ndarray)
    idx = np.arange(1 << 22)[::-1].copy()
    mask = np.ones(1 << 22, bool)

    def timed(arr: Any) -> float:
        t0 = time.perf_counter()
        arr[idx]
        arr[mask]
        arr[idx] = 1
        return time.perf_counter() - t0

    base = min(timed(plain) for _ in range(3))
    cost = min(timed(a) for _ in range(3))
    assert recorded == []
    # one Python step per element would take seconds; a min and a max take a fraction of the indexing
    assert cost < 3 * base + 0.05, (cost, base)


# --------------------------------------------------------------------------- through the simulator


async def test_slice_parameters_pass_a_view_and_its_length(sim: SimDevice) -> None:
    seen: list[Any] = []

    def ref(x: Any, n: Any, out: Any) -> None:
        seen.append((type(x), int(n)))
        out[0] = x[:n].sum()
        x[: n + 1]

    k = kernel([Slice("f4", access="read"), Out("f4")], ref, "slice_sum")
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.ones(N, F4))
        out = gpu.zeros(1, F4)
        with pytest.raises(LaunchError) as info:
            await gpu.run(k.launch(x, out, grid=1, block=1))
        assert_illegal_address(info.value, "argument 0 (Slice(float32)) indexed [:17]", "extent 16")
        assert seen == [(views.BoundedView, N)]
        assert oob(sim).address == x.ptr + N * 4
        np.testing.assert_array_equal(await gpu.to_host(out), [N])  # what ran before the fault stays


async def test_a_2d_argument_and_a_view_of_an_allocation(sim: SimDevice) -> None:
    def ref(a: Any) -> None:
        a[:, :6] = 1

    k = kernel([InOut("f4", name="a")], ref, "rows")
    async with trio_cuda.open_scope(device=sim) as gpu:
        whole = gpu.zeros((6, 5), F4)
        part = whole[1:5]  # rows 1..4 of one allocation: a row past it is still inside the allocation
        with pytest.raises(LaunchError) as info:
            await gpu.run(k.launch(part, grid=1, block=1))
        assert_illegal_address(info.value, "argument 0 (a: InOut(float32)) assigned to [:, :6]")
        assert "slice stop 6 lies past the end of dimension 1 of extent 5" in str(info.value)
        assert oob(sim).address == part.ptr + 5 * 4
        np.testing.assert_array_equal(await gpu.to_host(whole), np.zeros((6, 5), F4))

        def rows_ref(a: Any) -> None:
            a[4] = 1  # row 4 of a 4-row view: inside the allocation, outside the argument

        with pytest.raises(LaunchError, match="index 4 is outside dimension 0 of extent 4"):
            await gpu.run(kernel([InOut("f4")], rows_ref, "rows2").launch(part, grid=1, block=1))
        assert oob(sim).address == part.ptr + 4 * 5 * 4
        np.testing.assert_array_equal(await gpu.to_host(whole), np.zeros((6, 5), F4))


async def test_negative_indices_count_from_the_end(sim: SimDevice) -> None:
    def ref(y: Any) -> None:
        y[-1] = 7
        y[-N:][:1] = 5

    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(N, F4)
        await gpu.run(kernel([InOut("f4")], ref, "neg").launch(y, grid=1, block=1))
        out = await gpu.to_host(y)
    assert out[-1] == 7
    assert out[0] == 5
    assert sim.violations == []


async def test_an_empty_argument_has_no_element_to_touch(sim: SimDevice) -> None:
    def ref(y: Any) -> None:
        y[:0] = 1
        y[:] = 2
        y[0] = 3

    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(0, F4)
        with pytest.raises(LaunchError, match="index 0 is outside dimension 0 of extent 0"):
            await gpu.run(kernel([InOut("f4")], ref, "empty").launch(y, grid=1, block=1))
        assert oob(sim).address == y.ptr


async def test_a_reference_that_catches_the_fault_still_fails(sim: SimDevice) -> None:
    caught: list[str] = []

    def ref(y: Any) -> None:
        try:
            y[:100] = 1
        except Exception:  # an OutOfBounds is no Exception: this does not run
            caught.append("Exception")
        except BaseException:
            caught.append("BaseException")
        try:
            y[N]
        except BaseException:
            caught.append("again")
        y[0] = 9  # the reference carries on: what it does after is kept, as a faulting kernel's

    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(N, F4)
        with pytest.raises(LaunchError) as info:
            await gpu.run(kernel([InOut("f4")], ref, "catches").launch(y, grid=1, block=1))
        assert_illegal_address(info.value, "assigned to [:100]", "(1 more out-of-bounds access(es) after it)")
        assert caught == ["BaseException", "again"]
        assert oob(sim).op.startswith("launch catches: argument 0 (InOut(float32)) assigned to [:100]")
        assert (await gpu.to_host(y))[0] == 9


async def test_an_access_from_a_worker_thread_of_the_reference_is_caught_too(sim: SimDevice) -> None:
    def ref(y: Any) -> None:
        def work() -> None:
            try:
                y[N + 4] = 1
            except BaseException:
                pass  # the thread ends; the record stays

        t = threading.Thread(target=work)
        t.start()
        t.join()

    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(N, F4)
        with pytest.raises(LaunchError, match="index 20 is outside dimension 0 of extent 16"):
            await gpu.run(kernel([InOut("f4")], ref, "threaded").launch(y, grid=1, block=1))
        assert oob(sim).address == y.ptr + (N + 4) * 4


async def test_a_view_kept_after_its_launch_is_a_plain_array(sim: SimDevice) -> None:
    kept: list[Any] = []

    def ref(y: Any) -> None:
        kept.append(y[2:])

    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(N, F4)
        await gpu.run(kernel([InOut("f4")], ref, "keeps").launch(y, grid=1, block=1))
        assert kept[0][:1000].shape == (N - 2,)  # not the reference's access any more: no record
        kept.clear()
    assert sim.violations == []


async def test_the_fault_of_one_launch_leaves_the_next_clean(sim: SimDevice) -> None:
    async with trio_cuda.open_scope(device=sim) as gpu:
        x = await gpu.to_device(np.ones(N, F4))
        y = gpu.zeros(N, F4)
        sim.hold()
        bad = gpu.submit(AXPY.launch(1.0, x, y, N + 1, grid=1, block=32))
        good = gpu.submit(AXPY.launch(1.0, x, y, N, grid=1, block=32))
        await trio.testing.wait_all_tasks_blocked()
        sim.release()
        with pytest.raises(LaunchError, match="ILLEGAL_ADDRESS"):
            await bad.wait()
        await good.wait()
        oob(sim)
        np.testing.assert_array_equal(await gpu.to_host(y), np.ones(N, F4))


async def test_a_use_after_free_is_still_recorded_before_the_reference_runs(sim: SimDevice) -> None:
    ran: list[int] = []
    k = kernel([InOut("f4")], lambda y: ran.append(1), "uaf")
    async with trio_cuda.open_scope(device=sim) as gpu:
        y = gpu.zeros(N, F4)
        launch = k.launch(y, grid=1, block=1)
        sim.hold()
        unsafe.async_on(launch, gpu.streams[0])
        y.close()
        await trio.testing.wait_all_tasks_blocked()
        sim.release()
    (v,) = sim.violations
    assert v.kind == "use_after_free"
    assert ran == []
    sim.clear_violations()


async def test_a_launch_leaves_no_reference_cycle_behind(sim: SimDevice) -> None:
    """The views of a launch that ran go as soon as the reference lets go of
    them, without waiting for the cyclic garbage collector (they hold the
    device's buffers); those of a launch that faulted live as long as its
    error (its traceback holds the reference's frame), and its check lets go
    of them."""
    refs: list[Any] = []
    checks: list[views.LaunchCheck] = []

    def keeps_refs(x: Any, y: Any) -> None:
        refs.extend(weakref.ref(v) for v in (x, y, y[2:]))
        checks.append(internals.launch_check_of(y))

    def faults(x: Any, y: Any) -> None:
        keeps_refs(x, y)
        try:
            y[N]
        except BaseException:
            pass  # caught: the launch still fails

    def alive() -> list[bool]:
        return [r() is not None for r in refs]

    gc.collect()
    gc.disable()
    try:
        async with trio_cuda.open_scope(device=sim) as gpu:
            x = gpu.zeros(N, F4)
            y = gpu.zeros(N, F4)
            await gpu.run(kernel([In("f4"), InOut("f4")], keeps_refs, "ran").launch(x, y, grid=1, block=1))
            assert alive() == [False] * 3
            refs.clear()
            with pytest.raises(LaunchError):
                await gpu.run(kernel([In("f4"), InOut("f4")], faults, "faults").launch(x, y, grid=1, block=1))
    finally:
        gc.enable()
    gc.collect()
    assert alive() == [False] * 3
    for check in checks:
        assert not check.active
        assert check.args == []
        assert check.error is None
    oob(sim)
