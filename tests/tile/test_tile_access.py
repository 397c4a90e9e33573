"""The tile kernel access analysis: which parameters a @ct.kernel reads and writes."""

import subprocess
import sys
import threading

import pytest

ct = pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")

from trio_cuda._tile import access  # noqa: E402
from trio_cuda._tile.access import (  # noqa: E402
    AccessPlan,
    ArrayParam,
    ConstantParam,
    ListParam,
    ScalarParam,
    TupleParam,
    analyze,
)

F1 = ArrayParam("float32", 1)
F2 = ArrayParam("float32", 2)
I1 = ArrayParam("int32", 1)
TILE = 16


@pytest.fixture(autouse=True)
def _fresh_caches():
    access._clear_caches()
    yield
    access._clear_caches()


def modes(kernel, *sig):
    plan = analyze(kernel, sig)
    assert plan.exact, plan.reason
    assert plan.reason is None
    return plan.modes


# --- kernels ------------------------------------------------------------------------


@ct.kernel
def k_copy(a, b):
    i = ct.bid(0)
    ct.store(b, index=(i,), tile=ct.load(a, index=(i,), shape=(TILE,)))


@ct.kernel
def k_inplace(a):
    i = ct.bid(0)
    ct.store(a, index=(i,), tile=ct.load(a, index=(i,), shape=(TILE,)) * 2.0)


def _load_tile(x, i):
    return ct.load(x, index=(i,), shape=(TILE,))


def _store_tile(x, i, t):
    _store_inner(x, i, t)


def _store_inner(y, i, t):
    ct.store(y, index=(i,), tile=t)


@ct.kernel
def k_calls(src, dst):
    i = ct.bid(0)
    _store_tile(dst, i, _load_tile(src, i) + 1.0)


@ct.kernel
def k_local_alias(a, b, c):
    i = ct.bid(0)
    x = a
    y = x
    out = c
    target = out
    ct.store(target, index=(i,), tile=ct.load(y, index=(i,), shape=(TILE,)))


@ct.kernel
def k_tuple(pair, out):
    i = ct.bid(0)
    first, second = pair
    t = ct.load(first, index=(i,), shape=(TILE,))
    ct.store(out, index=(i,), tile=t)
    ct.store(second, index=(i,), tile=t)


@ct.kernel
def k_nested_tuple(nest, scale: float):
    i = ct.bid(0)
    (_a, (b, c)) = nest
    t = ct.load(b, index=(i,), shape=(TILE,))
    ct.store(c, index=(i,), tile=t * scale)


@ct.kernel
def k_list(xs, out, n: ct.Constant[int]):
    i = ct.bid(0)
    acc = ct.zeros((TILE,), dtype=ct.float32)
    for j in range(n):
        acc = acc + ct.load(xs[j], index=(i,), shape=(TILE,))
    ct.store(out, index=(i,), tile=acc)


@ct.kernel
def k_list_write(xs, src):
    i = ct.bid(0)
    ct.store(xs[0], index=(i,), tile=ct.load(src, index=(i,), shape=(TILE,)))


@ct.kernel
def k_slices(a, b, start):
    sub = a.slice(0, start, start + TILE)
    dst = b.slice(0, 0, TILE)
    ct.store(dst, index=(0,), tile=ct.load(sub, index=(0,), shape=(TILE,)))


@ct.kernel
def k_tiled_view(a, b):
    i = ct.bid(0)
    j = ct.bid(1)
    src = a.tiled_view((TILE, TILE))
    dst = b.tiled_view((TILE, TILE))
    dst.store((i, j), src.load((i, j)))


@ct.kernel
def k_gather_scatter(src, idx, dst):
    i = ct.bid(0)
    offsets = ct.load(idx, index=(i,), shape=(TILE,))
    ct.scatter(dst, offsets, ct.gather(src, offsets))


@ct.kernel
def k_atomic_add(counts, values):
    i = ct.bid(0)
    ct.atomic_add(counts, ct.arange(TILE, dtype=ct.int32), ct.load(values, index=(i,), shape=(TILE,)))


@ct.kernel
def k_atomic_cas(lock, out):
    while ct.atomic_cas(lock, 0, 0, 1, memory_order=ct.MemoryOrder.ACQUIRE) == 1:
        pass
    ct.store(out, index=(0,), tile=ct.full((TILE,), 1.0, dtype=ct.float32))
    ct.atomic_xchg(lock, 0, 0, memory_order=ct.MemoryOrder.RELEASE)


@ct.kernel
def k_atomic_xchg(a, b):
    i = ct.bid(0)
    ct.atomic_xchg(a, ct.arange(TILE, dtype=ct.int32), ct.load(b, index=(i,), shape=(TILE,)))


@ct.kernel
def k_runtime_if(src, a, b, flag: int):
    i = ct.bid(0)
    t = ct.load(src, index=(i,), shape=(TILE,))
    if flag > 0:  # noqa: SIM108 (a statement, unlike the self-test's expression)
        dst = a
    else:
        dst = b
    ct.store(dst, index=(i,), tile=t)


@ct.kernel
def k_runtime_if_stores(src, a, b, flag: int):
    i = ct.bid(0)
    t = ct.load(src, index=(i,), shape=(TILE,))
    if flag > 0:
        ct.store(a, index=(i,), tile=t)
    else:
        ct.store(b, index=(i,), tile=t)


@ct.kernel
def k_untouched(a, unused, b, n: ct.Constant[int], s: float):
    i = ct.bid(0)
    ct.store(b, index=(i,), tile=ct.load(a, index=(i,), shape=(n,)) * s)


@ct.kernel
def k_dead_load(a, b):
    i = ct.bid(0)
    ct.load(a, index=(i,), shape=(TILE,))  # result unused: removed by cuTile
    ct.store(b, index=(i,), tile=ct.zeros((TILE,), dtype=ct.float32))


@ct.kernel
def k_loop_carried(a, b, c, n: int):
    i = ct.bid(0)
    src = a
    dst = b
    for _ in range(n):
        ct.store(dst, index=(i,), tile=ct.load(src, index=(i,), shape=(TILE,)))
        src, dst = dst, c


@ct.kernel
def k_printf_assert(a, b):
    t = ct.load(a, index=(0,), shape=(TILE,))
    ct.printf("%f", t)
    ct.assert_(t > 0.0)  # noqa: PT009 (cuTile's device assert)
    ct.store(b, index=(0,), tile=t)


@ct.kernel
def k_bad_type(a, b):
    ct.store(b, index=(0,), tile=ct.load(a, index=(0,), shape=(3,)))  # not a power of two


# --- the analysis ---------------------------------------------------------------------


def test_plain_load_store():
    assert modes(k_copy, F1, F1) == ("read", "write")


def test_load_and_store_one_array_is_read_write():
    assert modes(k_inplace, F1) == ("read_write",)


def test_through_called_functions():
    assert modes(k_calls, F1, F1) == ("read", "write")


def test_through_local_aliases():
    assert modes(k_local_alias, F1, F1, F1) == ("read", "none", "write")


def test_tuple_of_arrays():
    plan = analyze(k_tuple, (TupleParam((F1, F1)), F1))
    assert plan.exact
    assert plan.modes == (("read", "write"), "write")
    assert plan.mode(0) == "read_write"
    assert plan.leaves() == ("read", "write", "write")


def test_nested_tuple_with_a_scalar():
    sig = (TupleParam((F1, TupleParam((F1, F1)))), ScalarParam("float32"))
    plan = analyze(k_nested_tuple, sig)
    assert plan.modes == (("none", ("read", "write")), "scalar")
    assert plan.leaves() == ("none", "read", "write", "scalar")
    assert plan.mode(1) == "scalar"


def test_list_of_arrays():
    assert modes(k_list, ListParam("float32", 1), F1, ConstantParam(3)) == (
        "read",
        "write",
        "constant",
    )
    assert modes(k_list_write, ListParam("float32", 1), F1) == ("write", "read")


def test_slices():
    assert modes(k_slices, F1, F1, ScalarParam("int32")) == ("read", "write", "scalar")


def test_tiled_views():
    assert modes(k_tiled_view, F2, F2) == ("read", "write")


def test_gather_reads_and_scatter_writes():
    assert modes(k_gather_scatter, F1, I1, F1) == ("read", "read", "write")


def test_atomic_add_is_read_write():
    assert modes(k_atomic_add, F1, F1) == ("read_write", "read")


def test_atomic_cas_and_xchg_are_read_write():
    assert modes(k_atomic_cas, I1, F1) == ("read_write", "write")
    assert modes(k_atomic_xchg, F1, F1) == ("read_write", "read")


def test_runtime_if_choosing_the_array_writes_both():
    sig = (F1, F1, F1, ScalarParam("int32"))
    assert modes(k_runtime_if, *sig) == ("read", "write", "write", "scalar")
    assert modes(k_runtime_if_stores, *sig) == ("read", "write", "write", "scalar")


def test_loop_carried_aliases():
    # Trip 1 copies a to b, trip 2 b to c, later trips c to c.
    sig = (F1, F1, F1, ScalarParam("int32"))
    assert modes(k_loop_carried, *sig) == ("read", "read_write", "read_write", "scalar")


def test_untouched_array_constants_and_scalars():
    sig = (F1, F1, F1, ConstantParam(TILE), ScalarParam("float32"))
    assert modes(k_untouched, *sig) == ("read", "none", "write", "constant", "scalar")


def test_printf_and_assert_touch_no_array():
    assert modes(k_printf_assert, F1, F1) == ("read", "write")


def test_dead_load_does_not_count():
    assert modes(k_dead_load, F1, F1) == ("none", "write")


def test_dtypes_and_ranks_are_part_of_the_signature():
    assert modes(k_copy, ArrayParam("float16", 1), ArrayParam("float16", 1)) == ("read", "write")
    assert modes(k_copy, ArrayParam("bool", 1), ArrayParam("bool", 1)) == ("read", "write")


def test_plans_are_cached_per_kernel_and_signature():
    first = analyze(k_copy, (F1, F1))
    assert analyze(k_copy, [F1, F1]) is first
    other = analyze(k_copy, (ArrayParam("int32", 1), ArrayParam("int32", 1)))
    assert other is not first
    assert other == first


@ct.kernel
def k_constant_flag(a, b, c, flag: ct.Constant[int]):
    i = ct.bid(0)
    t = ct.load(a, index=(i,), shape=(TILE,))
    if flag == 1:
        ct.store(b, index=(i,), tile=t)
    else:
        ct.store(c, index=(i,), tile=t)


def test_constants_select_the_code_and_key_the_cache():
    assert modes(k_constant_flag, F1, F1, F1, ConstantParam(1)) == ("read", "write", "none", "constant")
    assert modes(k_constant_flag, F1, F1, F1, ConstantParam(2)) == ("read", "none", "write", "constant")
    # True == 1 in Python, yet it is another constant: not answered from the cache for 1.
    plan = analyze(k_constant_flag, (F1, F1, F1, ConstantParam(True)))
    assert plan is not analyze(k_constant_flag, (F1, F1, F1, ConstantParam(1)))


def test_threads_get_one_answer():
    results: list[AccessPlan] = []

    def run() -> None:
        results.append(analyze(k_runtime_if, (F1, F1, F1, ScalarParam("int32"))))

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6
    assert all(r.exact and r.modes == ("read", "write", "write", "scalar") for r in results)


# --- fallback -------------------------------------------------------------------------


def _all_written(plan: AccessPlan, expected_modes: tuple[object, ...]) -> None:
    assert not plan.exact
    assert plan.reason
    assert plan.modes == expected_modes


def test_fallback_when_the_analysis_raises(monkeypatch):
    def boom(kernel, sig):
        raise RuntimeError("internals moved")

    monkeypatch.setattr(access, "_analyze_uncached", boom)
    access._unusable = ""  # the self-test passed
    plan = analyze(
        k_copy,
        (
            F1,
            F1,
        ),
    )
    _all_written(plan, ("read_write", "read_write"))
    assert "internals moved" in plan.reason


def test_fallback_when_the_kernel_does_not_type_check():
    plan = analyze(k_bad_type, (F1, F1))
    _all_written(plan, ("read_write", "read_write"))
    assert "failed" in plan.reason


def test_fallback_on_another_cuda_tile_version(monkeypatch):
    monkeypatch.setattr(ct, "__version__", "1.8.0")
    plan = analyze(k_untouched, (F1, F1, F1, ConstantParam(TILE), ScalarParam("float32")))
    _all_written(plan, ("read_write", "read_write", "read_write", "constant", "scalar"))
    assert "1.8.0" in plan.reason
    assert "1.7" in plan.reason


@pytest.mark.parametrize("version", ["", "garbage", "2"])
def test_fallback_on_an_unreadable_version(monkeypatch, version):
    monkeypatch.setattr(ct, "__version__", version)
    plan = analyze(k_copy, (F1, F1))
    _all_written(plan, ("read_write", "read_write"))


def test_fallback_when_the_self_test_fails(monkeypatch):
    real = access._analyze_uncached

    def wrong(kernel, sig):
        plan = real(kernel, sig)
        return AccessPlan(modes=tuple("none" for _ in plan.modes), exact=True)

    monkeypatch.setattr(access, "_analyze_uncached", wrong)
    plan = analyze(k_copy, (F1, F1))
    _all_written(plan, ("read_write", "read_write"))
    assert "self-test failed" in plan.reason
    # The verdict is kept: a later call does not rerun the self-test.
    monkeypatch.setattr(access, "_analyze_uncached", real)
    assert not analyze(k_inplace, (F1,)).exact


def test_fallback_when_the_self_test_raises(monkeypatch):
    def broken():
        raise AttributeError("no such internal")

    monkeypatch.setattr(access, "_self_test_cases", broken)
    plan = analyze(k_copy, (F1, F1))
    _all_written(plan, ("read_write", "read_write"))
    assert "self-test raised AttributeError: no such internal" in plan.reason


def test_fallback_keeps_tuple_structure(monkeypatch):
    monkeypatch.setattr(ct, "__version__", "1.6.2")
    sig = (TupleParam((F1, ScalarParam("int32"))), ListParam("float32", 1))
    plan = analyze(k_list_write, sig)
    _all_written(plan, (("read_write", "scalar"), "read_write"))
    assert plan.mode(0) == "read_write"


def test_unresolved_memory_operation_falls_back(monkeypatch):
    from cuda.tile._passes import dataflow_analysis

    real = dataflow_analysis.DataflowResult.__init__

    def universal(self, predicates):
        real(self, {k: v.replace(alias_set=-1) for k, v in predicates.items()})

    monkeypatch.setattr(dataflow_analysis.DataflowResult, "__init__", universal)
    access._unusable = ""
    plan = analyze(k_copy, (F1, F1))
    _all_written(plan, ("read_write", "read_write"))


def test_self_test_passes_here():
    assert access._check_usable() == ""


# --- arguments --------------------------------------------------------------------------


def test_not_a_kernel():
    def plain(a):
        pass

    with pytest.raises(TypeError, match="kernel: expected a @cuda.tile.kernel"):
        analyze(plain, (F1,))
    with pytest.raises(TypeError, match="kernel: expected a @cuda.tile.kernel"):
        analyze(k_copy._pyfunc, (F1, F1))


def test_signature_length_must_match():
    with pytest.raises(TypeError, match="takes 2 parameters, the signature describes 3"):
        analyze(k_copy, (F1, F1, F1))


def test_signature_must_be_a_sequence_of_descriptions():
    with pytest.raises(TypeError, match="signature: expected a sequence"):
        analyze(k_copy, F1)
    with pytest.raises(TypeError, match=r"signature\[1\]: expected ArrayParam"):
        analyze(k_copy, (F1, "float32"))


def test_unknown_dtype_name():
    with pytest.raises(ValueError, match="'float33'"):
        analyze(k_copy, (F1, ArrayParam("float33", 1)))


def test_descriptions_validate_their_fields():
    with pytest.raises(TypeError, match="ArrayParam.ndim"):
        ArrayParam("float32", -1)
    with pytest.raises(TypeError, match="ArrayParam.ndim"):
        ArrayParam("float32", True)
    with pytest.raises(TypeError, match="ScalarParam.dtype"):
        ScalarParam(4)
    with pytest.raises(TypeError, match="ConstantParam.value"):
        ConstantParam([1, 2])
    with pytest.raises(TypeError, match=r"TupleParam.items\[0\]"):
        TupleParam((1,))
    assert TupleParam([F1]) == TupleParam((F1,))


def test_import_does_not_import_cuda_tile():
    code = (
        "import sys\n"
        "import trio_cuda._tile.access as a\n"
        "assert 'cuda.tile' not in sys.modules, sorted(m for m in sys.modules if 'cuda' in m)\n"
        "p = a.fallback((a.ArrayParam('float32', 1), a.ScalarParam('int32')), 'x')\n"
        "assert p.modes == ('read_write', 'scalar') and not p.exact\n"
        "assert 'cuda.tile' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
