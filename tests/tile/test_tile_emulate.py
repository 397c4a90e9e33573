"""The NumPy emulation of cuTile kernels (trio_cuda._tile.emulate) against NumPy."""

import threading
import time

import numpy as np
import pytest

ct = pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")

from trio_cuda import TrioCudaError  # noqa: E402
from trio_cuda._tile.emulate import (  # noqa: E402
    TileEmulationError,
    TileNotEmulatedError,
    TileSpinError,
    run_tile_kernel,
)

ConstInt = ct.Constant[int]
rng = np.random.default_rng(1234)


# --------------------------------------------------------------------------- kernels


@ct.kernel
def vadd(a, b, out, TILE: ConstInt):
    i = ct.bid(0)
    x = ct.load(a, index=(i,), shape=(TILE,))
    y = ct.load(b, index=(i,), shape=(TILE,))
    ct.store(out, index=(i,), tile=x + y)


@ct.kernel
def vadd_gather(a, b, out, TILE: ConstInt):
    offs = ct.bid(0) * TILE + ct.arange(TILE, dtype=ct.int32)
    x = ct.gather(a, offs)
    y = ct.gather(b, offs)
    ct.scatter(out, offs, x + y)


@ct.kernel
def matmul(A, B, C, TM: ConstInt, TN: ConstInt, TK: ConstInt):
    bm = ct.bid(0)
    bn = ct.bid(1)
    acc = ct.full((TM, TN), 0, dtype=ct.float32)
    zero = ct.PaddingMode.ZERO
    for k in range(ct.num_tiles(A, axis=1, shape=(TM, TK))):
        a = ct.load(A, index=(bm, k), shape=(TM, TK), padding_mode=zero)
        b = ct.load(B, index=(k, bn), shape=(TK, TN), padding_mode=zero)
        acc = ct.mma(a, b, acc)
    ct.store(C, index=(bm, bn), tile=ct.astype(acc, C.dtype))


@ct.kernel
def transpose(x, y, T: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    t = ct.load(x, index=(i, j), shape=(T, T))
    ct.store(y, index=(j, i), tile=ct.transpose(t))


@ct.kernel
def transpose_order(x, y, T: ConstInt):
    i, j = ct.bid(0), ct.bid(1)
    t = ct.load(x, index=(j, i), shape=(T, T), order="F")
    ct.store(y, index=(j, i), tile=t)


@ct.kernel
def batch_matmul(A, B, C, TM: ConstInt, TN: ConstInt, TK: ConstInt):
    b, m, n = ct.bid(0), ct.bid(1), ct.bid(2)
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(ct.cdiv(A.shape[2], TK)):
        a = ct.load(A, index=(b, m, k), shape=(1, TM, TK), padding_mode=ct.PaddingMode.ZERO)
        bb = ct.load(B, index=(b, k, n), shape=(1, TK, TN), padding_mode=ct.PaddingMode.ZERO)
        acc = ct.mma(ct.reshape(a, (TM, TK)), ct.reshape(bb, (TK, TN)), acc)
    ct.store(C, index=(b, m, n), tile=ct.reshape(acc, (1, TM, TN)).astype(C.dtype))


@ct.kernel
def row_reduce(x, sums, maxes, mins, N: ConstInt):
    r = ct.bid(0)
    t = ct.load(x, index=(r, 0), shape=(1, N))
    ct.store(sums, index=(r,), tile=ct.sum(t, axis=1))
    ct.store(maxes, index=(r,), tile=ct.max(t, axis=1))
    ct.store(mins, index=(r,), tile=ct.reshape(ct.min(t, axis=1, keepdims=True), (1,)))


def _mean(t, n):
    return ct.sum(t, axis=1, keepdims=True) / n


@ct.function
def _rstd(centered, n, eps):
    return 1.0 / ct.sqrt(ct.sum(centered * centered, axis=1, keepdims=True) / n + eps)


@ct.kernel
def layer_norm(x, w, b, y, eps, N: ConstInt):
    r = ct.bid(0)
    t = ct.load(x, index=(r, 0), shape=(1, N)).astype(ct.float32)
    c = t - _mean(t, N)
    out = c * _rstd(c, N, eps) * ct.load(w, index=(0,), shape=(N,)) + ct.load(b, index=(0,), shape=(N,))
    ct.store(y, index=(r, 0), tile=out.astype(y.dtype))


@ct.kernel
def softmax(x, y, TILE: ConstInt):
    r = ct.bid(0)
    t = ct.load(x, index=(r, 0), shape=(1, TILE), padding_mode=ct.PaddingMode.NEG_INF)
    t = t - ct.max(t, axis=1, keepdims=True)
    e = ct.exp(t)
    ct.store(y, index=(r, 0), tile=e / ct.sum(e, axis=1, keepdims=True))


@ct.kernel
def softmax_undetermined(x, y, TILE: ConstInt):
    r = ct.bid(0)
    t = ct.load(x, index=(r, 0), shape=(1, TILE))  # padding undetermined
    e = ct.exp(t - ct.max(t, axis=1, keepdims=True))
    ct.store(y, index=(r, 0), tile=e / ct.sum(e, axis=1, keepdims=True))


@ct.kernel
def count_positive(x, counter, TILE: ConstInt):
    t = ct.load(x, index=(ct.bid(0),), shape=(TILE,), padding_mode=ct.PaddingMode.ZERO)
    n = ct.sum(ct.where(t > 0, 1, 0))
    ct.atomic_add(counter, 0, n)


@ct.kernel
def locked_accumulate(x, acc, lock, TILE: ConstInt):
    t = ct.load(x, index=(ct.bid(0),), shape=(TILE,))
    while ct.atomic_cas(lock, 0, 0, 1, memory_order=ct.MemoryOrder.ACQUIRE) == 1:
        pass
    cur = ct.load(acc, index=(0,), shape=(TILE,))
    ct.store(acc, index=(0,), tile=cur + t)
    ct.atomic_xchg(lock, 0, 0, memory_order=ct.MemoryOrder.RELEASE)


@ct.kernel
def wait_for_later_block(flag, out):
    if ct.bid(0) == 0:
        while ct.atomic_cas(flag, 0, 1, 2) != 1:  # block 1 sets the flag: never, here
            pass
        ct.store(out, index=(0,), tile=1)
    else:
        ct.atomic_xchg(flag, 0, 1)


@ct.kernel
def spin_on_load(flag):
    while ct.load(flag, index=(0,), shape=(), memory_order=ct.MemoryOrder.ACQUIRE) == 0:
        pass


@ct.kernel
def list_sum(arrays, out, TILE: ConstInt):
    i = ct.bid(0)
    acc = ct.zeros((TILE,), dtype=ct.float32)
    for k in range(len(arrays)):
        acc = acc + ct.load(arrays[k], index=(i,), shape=(TILE,))
    ct.store(out, index=(i,), tile=acc)


@ct.kernel
def uses_unsupported(x):
    ct.store(x, index=(0,), tile=ct.reduce(ct.load(x, index=(0,), shape=(4,)), 0, None, 0))


@ct.kernel
def half_scale(x, y, s, TILE: ConstInt):
    t = ct.load(x, index=(ct.bid(0),), shape=(TILE,))
    u = t * 2.0 + 1  # a Python scalar keeps f16
    ct.store(y, index=(ct.bid(0),), tile=u * s)  # s is a float32 scalar argument: f32


@ct.kernel
def store_wrong_dtype(x, TILE: ConstInt):
    t = ct.load(x, index=(0,), shape=(TILE,)).astype(ct.float32)
    ct.store(x, index=(0,), tile=t)


@ct.kernel
def builtin_minmax(x, y, TILE: ConstInt):
    t = ct.load(x, index=(ct.bid(0),), shape=(TILE,))
    ct.store(y, index=(ct.bid(0),), tile=abs(min(max(t, -1.0), 1.0)))


@ct.kernel
def unchecked_load(x, y, TILE: ConstInt):
    ct.store(y, index=(0,), tile=ct.load(x, index=(ct.bid(0),), shape=(TILE,), check_bounds=False))


@ct.kernel
def shapes(x, y):
    t = ct.arange(8, dtype=ct.int32)
    a = ct.reshape(t, (2, 4))
    b = ct.cat((a, a + 8), 0)  # (4, 4)
    c = ct.permute(ct.reshape(b, (2, 2, 4)), (1, 0, 2)).reshape((4, 4))
    d = ct.extract(c, (1, 0), shape=(2, 4))
    ct.store(y, index=(0, 0), tile=d)
    ct.store(x, index=(0,), tile=t[None, :].reshape((8,)))


# --------------------------------------------------------------------------- tests


def test_vector_add_partial_last_tile():
    n = 1000
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = np.zeros(n, np.float32)
    run_tile_kernel(vadd, (-(n // -128), 1, 1), [a, b, out, 128])
    np.testing.assert_array_equal(out, a + b)


def test_vector_add_gather_scatter():
    n = 1000
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = np.full(n + 24, -7, np.float32)
    run_tile_kernel(vadd_gather, (8, 1, 1), [a, b, out[:n], 128])
    np.testing.assert_array_equal(out[:n], a + b)
    assert (out[n:] == -7).all()  # nothing written past the view


@pytest.mark.parametrize(("m", "n", "k"), [(128, 128, 64), (100, 72, 50)])
def test_matmul_f16_f32_acc(m, n, k):
    A = rng.standard_normal((m, k)).astype(np.float16)
    B = rng.standard_normal((k, n)).astype(np.float16)
    C = np.zeros((m, n), np.float32)
    run_tile_kernel(matmul, (-(m // -64), -(n // -32), 1), [A, B, C, 64, 32, 16])
    np.testing.assert_allclose(C, A.astype(np.float32) @ B.astype(np.float32), rtol=1e-4, atol=1e-4)


def test_matmul_f16_output():
    A = rng.standard_normal((64, 64)).astype(np.float16)
    B = rng.standard_normal((64, 64)).astype(np.float16)
    C = np.zeros((64, 64), np.float16)
    run_tile_kernel(matmul, (2, 2, 1), [A, B, C, 32, 32, 32])
    np.testing.assert_allclose(C, (A.astype(np.float32) @ B.astype(np.float32)), rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("kernel", [transpose, transpose_order])
def test_transpose(kernel):
    x = rng.standard_normal((64, 96)).astype(np.float32)
    y = np.zeros((96, 64), np.float32)
    run_tile_kernel(kernel, (2, 3, 1), [x, y, 32])
    np.testing.assert_array_equal(y, x.T)


def test_batch_matmul():
    A = rng.standard_normal((3, 40, 24)).astype(np.float16)
    B = rng.standard_normal((3, 24, 48)).astype(np.float16)
    C = np.zeros((3, 40, 48), np.float32)
    run_tile_kernel(batch_matmul, (3, 3, 2), [A, B, C, 16, 32, 16])
    np.testing.assert_allclose(C, A.astype(np.float32) @ B.astype(np.float32), rtol=1e-4, atol=1e-4)


def test_row_reductions():
    x = rng.standard_normal((5, 64)).astype(np.float32)
    s, mx, mn = (np.zeros(5, np.float32) for _ in range(3))
    run_tile_kernel(row_reduce, (5, 1, 1), [x, s, mx, mn, 64])
    np.testing.assert_allclose(s, x.sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(mx, x.max(axis=1))
    np.testing.assert_array_equal(mn, x.min(axis=1))


def test_layer_norm_calling_functions():
    x = rng.standard_normal((6, 32)).astype(np.float16)
    w = rng.standard_normal(32).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    y = np.zeros((6, 32), np.float32)
    run_tile_kernel(layer_norm, (6, 1, 1), [x, w, b, y, 1e-5, 32])
    xf = x.astype(np.float32)
    ref = (xf - xf.mean(1, keepdims=True)) / np.sqrt(xf.var(1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_softmax_neg_inf_padding():
    x = rng.standard_normal((4, 100)).astype(np.float32)
    y = np.zeros((4, 100), np.float32)
    run_tile_kernel(softmax, (4, 1, 1), [x, y, 128])
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_undetermined_padding_is_caught_as_nan():
    x = rng.standard_normal((4, 100)).astype(np.float32)
    y = np.zeros((4, 100), np.float32)
    run_tile_kernel(softmax_undetermined, (4, 1, 1), [x, y, 128])
    assert np.isnan(y).all()
    y2 = np.zeros((4, 128), np.float32)  # no padding: the same kernel is right
    x2 = rng.standard_normal((4, 128)).astype(np.float32)
    run_tile_kernel(softmax_undetermined, (4, 1, 1), [x2, y2, 128])
    assert not np.isnan(y2).any()


def test_undetermined_padding_of_integers_is_a_pattern():
    @ct.kernel
    def k(x, y):
        ct.store(y, index=(0,), tile=ct.load(x, index=(0,), shape=(8,)))

    x = np.arange(5, dtype=np.int32)
    y = np.zeros(8, np.int32)
    run_tile_kernel(k, (1, 1, 1), [x, y])
    assert list(y[:5]) == [0, 1, 2, 3, 4]
    assert (y[5:] == np.frombuffer(b"\xa5" * 4, np.int32)[0]).all()


def test_atomic_counter():
    x = rng.standard_normal(1000).astype(np.float32)
    counter = np.zeros(1, np.int32)
    run_tile_kernel(count_positive, (8, 1, 1), [x, counter, 128])
    assert counter[0] == (x > 0).sum()


def test_atomic_add_repeated_indices_and_return_value():
    @ct.kernel
    def k(hist, old_out):
        idx = ct.arange(8, dtype=ct.int32) % 2  # 0, 1, 0, 1, ...
        old = ct.atomic_add(hist, idx, 1)
        ct.store(old_out, index=(0,), tile=old)

    hist = np.zeros(2, np.int32)
    old = np.zeros(8, np.int32)
    run_tile_kernel(k, (1, 1, 1), [hist, old])
    assert list(hist) == [4, 4]
    assert sorted(old[::2]) == [0, 1, 2, 3]


def test_atomic_cas_spin_lock():
    x = rng.standard_normal(16 * 32).astype(np.float32)
    acc = np.zeros(32, np.float32)
    lock = np.zeros(1, np.int32)
    run_tile_kernel(locked_accumulate, (16, 1, 1), [x, acc, lock, 32])
    np.testing.assert_allclose(acc, x.reshape(16, 32).sum(0), rtol=1e-5, atol=1e-5)
    assert lock[0] == 0


def _in_thread(fn, timeout):
    box = {}

    def target():
        try:
            fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the emulated kernel hung"
    return box.get("error")


def test_block_waiting_on_later_block_raises():
    flag = np.zeros(1, np.int32)
    out = np.zeros(1, np.int32)
    err = _in_thread(lambda: run_tile_kernel(wait_for_later_block, (2, 1, 1), [flag, out]), 20)
    assert isinstance(err, TileSpinError)
    assert err.block == (0, 0, 0)
    assert "atomic_cas" in str(err)
    assert out[0] == 0


def test_spin_on_acquire_load_raises():
    flag = np.zeros(1, np.int32)
    err = _in_thread(lambda: run_tile_kernel(spin_on_load, (1, 1, 1), [flag], spin_limit=100), 20)
    assert isinstance(err, TileSpinError)
    flag[0] = 1
    run_tile_kernel(spin_on_load, (1, 1, 1), [flag])


def test_list_of_arrays_argument():
    arrays = [rng.standard_normal(256).astype(np.float32) for _ in range(3)]
    out = np.zeros(256, np.float32)
    run_tile_kernel(list_sum, (4, 1, 1), [arrays, out, 64])
    np.testing.assert_allclose(out, sum(arrays), rtol=1e-6)


def test_unsupported_op_names_it():
    x = np.zeros(4, np.float32)
    with pytest.raises(
        TileNotEmulatedError, match=r"ct\.reduce is not emulated on the simulator; pass reference="
    ):
        run_tile_kernel(uses_unsupported, (1, 1, 1), [x])
    assert issubclass(TileNotEmulatedError, NotImplementedError)
    assert issubclass(TileNotEmulatedError, TrioCudaError)


def test_unsupported_op_imported_by_name():
    from cuda.tile import mma_scaled

    @ct.kernel
    def k(x):
        mma_scaled(x, x, x, x, x)

    with pytest.raises(TileNotEmulatedError, match="ct.mma_scaled"):
        run_tile_kernel(k, (1, 1, 1), [np.zeros(4, np.float32)])


def test_promotion_follows_cutile():
    x = rng.standard_normal(64).astype(np.float16)
    y16 = np.zeros(64, np.float16)
    with pytest.raises(TileEmulationError, match="float32"):  # f16 * f32 scalar arg is f32
        run_tile_kernel(half_scale, (1, 1, 1), [x, y16, 0.5, 64])
    y32 = np.zeros(64, np.float32)
    run_tile_kernel(half_scale, (1, 1, 1), [x, y32, 0.5, 64])
    ref = (x * np.float16(2.0) + np.float16(1)).astype(np.float32) * np.float32(0.5)
    np.testing.assert_array_equal(y32, ref)


def test_store_needs_implicitly_convertible_dtype():
    with pytest.raises(TileEmulationError, match="ct.astype"):
        run_tile_kernel(store_wrong_dtype, (1, 1, 1), [np.zeros(8, np.float16), 8])


def test_builtin_max_min_abs_on_tiles():
    x = (rng.standard_normal(32) * 3).astype(np.float32)
    y = np.zeros(32, np.float32)
    run_tile_kernel(builtin_minmax, (1, 1, 1), [x, y, 32])
    np.testing.assert_array_equal(y, np.abs(np.clip(x, -1, 1)))


def test_check_bounds_false_past_extent_raises():
    x = np.arange(10, dtype=np.float32)
    y = np.zeros(8, np.float32)
    run_tile_kernel(unchecked_load, (1, 1, 1), [x, y, 8])
    np.testing.assert_array_equal(y, x[:8])
    with pytest.raises(TileEmulationError, match="check_bounds=False"):
        run_tile_kernel(unchecked_load, (2, 1, 1), [x, y, 8])


def test_shape_ops():
    x = np.zeros(8, np.int32)
    y = np.zeros((2, 4), np.int32)
    run_tile_kernel(shapes, (1, 1, 1), [x, y])
    b = np.concatenate([np.arange(8).reshape(2, 4), np.arange(8, 16).reshape(2, 4)])
    c = b.reshape(2, 2, 4).transpose(1, 0, 2).reshape(4, 4)
    np.testing.assert_array_equal(y, c[2:4])
    np.testing.assert_array_equal(x, np.arange(8))


def test_non_power_of_two_tile_refused():
    with pytest.raises(TileEmulationError, match="power of two"):
        run_tile_kernel(vadd, (1, 1, 1), [np.zeros(8, np.float32)] * 3 + [6])


def test_argument_count_and_grid_checked():
    with pytest.raises(TypeError, match="takes 4 arguments"):
        run_tile_kernel(vadd, (1, 1, 1), [np.zeros(8, np.float32)])
    with pytest.raises(ValueError, match="grid"):
        run_tile_kernel(vadd, (0, 1, 1), [np.zeros(8, np.float32)] * 3 + [8])
    with pytest.raises(TypeError, match="@ct.kernel"):
        run_tile_kernel(object(), (1, 1, 1), [])


def test_grid_order_and_num_blocks():
    @ct.kernel
    def k(order, dims):
        i = ct.bid(0) + ct.num_blocks(0) * (ct.bid(1) + ct.num_blocks(1) * ct.bid(2))
        ct.store(order, index=(i,), tile=ct.atomic_add(dims, 3, 1))
        ct.store(dims, index=(0,), tile=ct.num_blocks(0))
        ct.store(dims, index=(1,), tile=ct.num_blocks(1))
        ct.store(dims, index=(2,), tile=ct.num_blocks(2))

    order = np.zeros(12, np.int32)
    dims = np.zeros(4, np.int32)
    run_tile_kernel(k, (2, 3, 2), [order, dims])
    assert list(order) == list(range(12))
    assert list(dims[:3]) == [2, 3, 2]


def test_threads_run_independently():
    errors = []

    def one():
        try:
            test_vector_add_partial_last_tile()
            test_grid_order_and_num_blocks()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_op_outside_a_launch_refused():
    from trio_cuda._tile.emulate import _bid

    with pytest.raises(TileEmulationError, match="outside run_tile_kernel"):
        _bid(0)


def test_matmul_speed():
    A = rng.standard_normal((256, 256)).astype(np.float16)
    B = rng.standard_normal((256, 256)).astype(np.float16)
    C = np.zeros((256, 256), np.float32)
    start = time.perf_counter()
    run_tile_kernel(matmul, (4, 4, 1), [A, B, C, 64, 64, 32])
    elapsed = time.perf_counter() - start
    np.testing.assert_allclose(C, A.astype(np.float32) @ B.astype(np.float32), rtol=1e-4, atol=1e-3)
    assert elapsed < 5.0, elapsed


# --------------------------------------------------------------------------- under the simulator's memcheck


def _checked(*arrays, readonly=()):
    from trio_cuda._backends.sim.views import LaunchCheck, bounded

    violations = []
    check = LaunchCheck("k", 0, violations)
    views = [
        bounded(a, check, 0x1000 * (i + 1), i in readonly, lambda i=i: (f"argument {i}", "In"))
        for i, a in enumerate(arrays)
    ]
    return check, violations, views


def test_legal_kernels_stay_in_bounds_under_memcheck():
    m, n, k = 100, 72, 50
    A = rng.standard_normal((m, k)).astype(np.float16)
    B = rng.standard_normal((k, n)).astype(np.float16)
    C = np.zeros((m, n), np.float32)
    check, violations, (a, b, c) = _checked(A, B, C, readonly=(0, 1))
    run_tile_kernel(matmul, (2, 3, 1), [a, b, c, 64, 32, 16])
    x = rng.standard_normal((3, 100)).astype(np.float32)
    y = np.zeros((3, 100), np.float32)
    check1, violations1, (xv, yv) = _checked(x, y)
    run_tile_kernel(softmax, (3, 1, 1), [xv, yv, 128])
    t = rng.standard_normal((40, 24)).astype(np.float32)
    tt = np.zeros((24, 40), np.float32)
    check3, violations3, (tv, ttv) = _checked(t, tt)
    run_tile_kernel(transpose_order, (2, 1, 1), [tv, ttv, 32])  # tiles partly past both extents
    v = rng.standard_normal(1000).astype(np.float32)
    out = np.zeros(1000, np.float32)
    cnt = np.zeros(1, np.int32)
    check2, violations2, (vv, wv, ov, cv) = _checked(v, v.copy(), out, cnt)
    run_tile_kernel(vadd_gather, (8, 1, 1), [vv, wv, ov, 128])
    run_tile_kernel(count_positive, (8, 1, 1), [vv, cv, 128])
    for c_ in (check, check1, check2, check3):
        assert c_.close() is None
    assert violations + violations1 + violations2 + violations3 == []
    np.testing.assert_allclose(C, A.astype(np.float32) @ B.astype(np.float32), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(tt[:24, :40], t.T)
    np.testing.assert_array_equal(out, 2 * v)
    assert cnt[0] == (v > 0).sum()


def test_unchecked_access_past_extent_is_a_violation():
    from trio_cuda._backends.sim.views import OutOfBounds

    x = np.arange(10, dtype=np.float32)
    y = np.zeros(8, np.float32)
    check, violations, (xv, yv) = _checked(x, y)
    with pytest.raises(OutOfBounds):
        run_tile_kernel(unchecked_load, (2, 1, 1), [xv, yv, 8])
    assert len(violations) == 1
    assert violations[0].kind == "out_of_bounds"
    check.close()


def test_write_to_read_only_argument_refused():
    x = np.zeros(8, np.float32)
    check, _, (xv, yv, ov) = _checked(x, x.copy(), x.copy(), readonly=(0, 1, 2))
    with pytest.raises(ValueError, match="read-only"):
        run_tile_kernel(vadd, (1, 1, 1), [xv, yv, ov, 8])
    check.close()


# --------------------------------------------------------------------------- dtypes


def test_bf16_mma_and_tf32():
    ml_dtypes = pytest.importorskip("ml_dtypes")

    @ct.kernel
    def k(A, B, C, D):
        a = ct.load(A, index=(0, 0), shape=(16, 16))
        b = ct.load(B, index=(0, 0), shape=(16, 16))
        ct.store(C, index=(0, 0), tile=ct.mma(a, b, ct.zeros((16, 16), dtype=ct.float32)))
        a32 = ct.astype(a, ct.float32)
        acc = ct.mma(ct.astype(a32, ct.tfloat32), ct.astype(a32, ct.tfloat32), ct.zeros((16, 16), ct.float32))
        ct.store(D, index=(0, 0), tile=acc)

    A = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    B = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    C = np.zeros((16, 16), np.float32)
    D = np.zeros((16, 16), np.float32)
    run_tile_kernel(k, (1, 1, 1), [A, B, C, D])
    Af, Bf = A.astype(np.float32), B.astype(np.float32)
    np.testing.assert_allclose(C, Af @ Bf, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(D, Af @ Af, rtol=1e-5, atol=1e-5)  # bf16 values are exact in tf32


def test_mma_refuses_wrong_accumulator():
    @ct.kernel
    def k(A):
        a = ct.load(A, index=(0, 0), shape=(16, 16))
        ct.mma(a, a, ct.zeros((16, 16), dtype=ct.float64))

    with pytest.raises(TileEmulationError, match="accumulator"):
        run_tile_kernel(k, (1, 1, 1), [np.zeros((16, 16), np.float16)])


def test_scalar_arguments_are_typed():
    @ct.kernel
    def k(out, i32, i64: ct.ScalarInt64, f32, flag, c: ConstInt):
        ct.store(out, index=(0,), tile=i32 + 0)
        ct.store(out, index=(1,), tile=i64 + 0)
        ct.store(out, index=(2,), tile=ct.astype(f32 * 4, ct.int64))
        ct.store(out, index=(3,), tile=ct.astype(flag, ct.int64))
        ct.store(out, index=(4,), tile=c)
        assert i32.dtype == ct.int32
        assert i64.dtype == ct.int64
        assert f32.dtype == ct.float32
        assert isinstance(c, int)

    out = np.zeros(5, np.int64)
    run_tile_kernel(k, (1, 1, 1), [out, 7, 2**40, 0.5, True, 9])
    assert list(out) == [7, 2**40, 2, 1, 9]


def test_mixed_signedness_refused():
    @ct.kernel
    def k(a, b):
        ct.load(a, index=(0,), shape=(4,)) + ct.load(b, index=(0,), shape=(4,))

    with pytest.raises(TileEmulationError, match="signedness"):
        run_tile_kernel(k, (1, 1, 1), [np.zeros(4, np.int32), np.zeros(4, np.uint32)])


def test_array_attribute_not_emulated():
    @ct.kernel
    def k(a):
        a.tiled_view((4,))

    with pytest.raises(TileNotEmulatedError, match=r"ct\.Array\.tiled_view"):
        run_tile_kernel(k, (1, 1, 1), [np.zeros(4, np.float32)])


def test_closures_and_recursion():
    scale = 3

    def scaled(t, depth):
        return t if depth == 0 else scaled(t * scale, depth - 1)

    @ct.kernel
    def k(x):
        ct.store(x, index=(0,), tile=scaled(ct.load(x, index=(0,), shape=(4,)), 2))

    x = np.ones(4, np.float32)
    run_tile_kernel(k, (1, 1, 1), [x])
    assert list(x) == [9, 9, 9, 9]


def test_every_cuda_tile_name_is_emulated_or_refused_by_name():
    from trio_cuda._tile.emulate import EMULATED_OPS, _emulation, _ops

    assert set(_ops()) - {"Tile", "Array"} == EMULATED_OPS
    module = _emulation().module
    for name in ct.__all__:
        value = getattr(module, name)
        if name in EMULATED_OPS:
            assert value is not getattr(ct, name)
        elif value is not getattr(ct, name) and name not in ("Tile", "Array"):
            with pytest.raises(TileNotEmulatedError, match=f"ct.{name} is not emulated"):
                value()
    for name in (
        "load",
        "store",
        "gather",
        "scatter",
        "atomic_cas",
        "atomic_xchg",
        "atomic_add",
        "mma",
        "cat",
    ):
        assert name in EMULATED_OPS
    for name in ("mma_scaled", "reduce", "scan", "load_advanced_indexing", "launch"):
        assert name not in EMULATED_OPS
    with pytest.raises(TileNotEmulatedError, match="ct.no_such_op"):
        module.no_such_op  # noqa: B018
