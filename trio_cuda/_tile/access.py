"""Which arrays a ``@ct.kernel`` function reads and writes: the leases of a tile kernel.

``analyze(kernel, signature)`` runs cuTile's own front end for one specialisation
(parse, type check, its dataflow/alias analysis; no ``tileiras``) and maps every
memory operation of the resulting IR (load, store, gather, scatter, atomics) back to
the parameter it touches, through the functions it calls, local aliases, tuples, lists,
slices, tiled views and runtime branches that pick one array or another.

Invariants:

* Importing this module never imports ``cuda.tile``; ``analyze`` imports it on first use.
* The answer is never an under-report. Where the analysis cannot answer (``cuda.tile``
  missing or not 1.7.x, the built-in self-test failed, the front end raised, or a memory
  operation could not be attributed to exactly the parameters it may touch), every array
  is ``"read_write"`` and the plan says ``exact=False`` with the reason.
* A memory operation whose target may be one of several parameters (a runtime ``if``
  choosing the array) counts for each of them.
* Atomics are ``"read_write"``; gathers read; scatters write; an array only stored to is
  ``"write"``; an array the compiled kernel never touches is ``"none"`` (a load whose
  result is unused is removed by cuTile's dead-code elimination and does not count).
* Plans are cached per (kernel, signature) in a lock-guarded cache that holds kernels
  weakly; the self-test runs once per process.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Literal, TypeAlias, final

import attrs

__all__ = [
    "Access",
    "AccessPlan",
    "ArrayParam",
    "ConstantParam",
    "ListParam",
    "ParamAccess",
    "ParamSpec",
    "ScalarParam",
    "TupleParam",
    "analyze",
    "warm_up",
]

Access: TypeAlias = Literal["read", "write", "read_write", "none", "scalar", "constant"]
#: A leaf parameter's access, or a tuple parameter's accesses item by item (nested).
ParamAccess: TypeAlias = "Access | tuple[ParamAccess, ...]"

#: The cuda.tile minor version whose internals this module relies on.
SUPPORTED_VERSION = (1, 7)


def _check_dtype(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name}: expected a cuda.tile dtype name "
            f"such as 'float32', got {value!r}"
        )


def _check_ndim(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name}: expected a non-negative int, got {value!r}"
        )


@final
@attrs.frozen
class ArrayParam:
    """An array parameter: its element dtype (a ``cuda.tile`` dtype name) and rank."""

    dtype: str = attrs.field(validator=_check_dtype)
    ndim: int = attrs.field(validator=_check_ndim)


@final
@attrs.frozen
class ListParam:
    """A list-of-arrays parameter: the dtype and rank shared by its elements."""

    dtype: str = attrs.field(validator=_check_dtype)
    ndim: int = attrs.field(validator=_check_ndim)


@final
@attrs.frozen
class ScalarParam:
    """A scalar parameter passed at launch (not a ``ct.Constant``)."""

    dtype: str = attrs.field(validator=_check_dtype)


def _check_constant(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"ConstantParam.value: expected a hashable constant (bool, int, float, or a "
            f"tuple of them), got {type(value).__name__}"
        ) from None


@final
@attrs.frozen
class ConstantParam:
    """A compile-time constant parameter (``ct.Constant[...]``) and its value."""

    value: object = attrs.field(validator=_check_constant)


def _to_items(value: object) -> tuple[ParamSpec, ...]:
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"TupleParam.items: expected a sequence of parameter descriptions, got {value!r}")
    items = tuple(value)
    for i, item in enumerate(items):
        if not isinstance(item, _PARAM_TYPES):
            raise TypeError(
                f"TupleParam.items[{i}]: expected ArrayParam, ListParam, ScalarParam, "
                f"ConstantParam or TupleParam, got {item!r}"
            )
    return items


@final
@attrs.frozen
class TupleParam:
    """A tuple parameter, item by item."""

    items: tuple[ParamSpec, ...] = attrs.field(converter=_to_items)


ParamSpec: TypeAlias = ArrayParam | ListParam | ScalarParam | ConstantParam | TupleParam
_PARAM_TYPES = (ArrayParam, ListParam, ScalarParam, ConstantParam, TupleParam)


def _leaves(modes: Sequence[ParamAccess]) -> Iterator[Access]:
    for m in modes:
        if isinstance(m, tuple):
            yield from _leaves(m)
        else:
            yield m


@final
@attrs.frozen
class AccessPlan:
    """What a kernel does to each parameter for one signature.

    ``modes[i]`` describes parameter ``i``: ``"read"``, ``"write"``, ``"read_write"`` or
    ``"none"`` for an array or a list of arrays (one mode for all of a list's elements),
    ``"scalar"`` or ``"constant"`` otherwise, and a tuple of these (nested) for a tuple
    parameter. ``exact`` is False where the analysis could not answer and every array is
    ``"read_write"``; ``reason`` then says why.
    """

    modes: tuple[ParamAccess, ...]
    exact: bool
    reason: str | None = None

    def leaves(self) -> tuple[Access, ...]:
        """The modes with tuple parameters flattened, in the kernel's argument order."""
        return tuple(_leaves(self.modes))

    def mode(self, index: int) -> Access:
        """Parameter ``index``'s mode; for a tuple, the union over its arrays.

        A tuple with arrays gives ``"none"`` if none is touched, and one with no arrays
        ``"scalar"`` (``"constant"`` if all its items are constants).
        """
        m = self.modes[index]
        if not isinstance(m, tuple):
            return m
        leaves = tuple(_leaves((m,)))
        arrays = [x for x in leaves if x not in ("scalar", "constant")]
        if not arrays:
            return "constant" if leaves and all(x == "constant" for x in leaves) else "scalar"
        reads = any(x in ("read", "read_write") for x in arrays)
        writes = any(x in ("write", "read_write") for x in arrays)
        return _combine(reads, writes)


def _combine(reads: bool, writes: bool) -> Access:
    if reads and writes:
        return "read_write"
    if writes:
        return "write"
    if reads:
        return "read"
    return "none"


def _fallback_modes(signature: Sequence[ParamSpec]) -> tuple[ParamAccess, ...]:
    def one(spec: ParamSpec) -> ParamAccess:
        if isinstance(spec, (ArrayParam, ListParam)):
            return "read_write"
        if isinstance(spec, ScalarParam):
            return "scalar"
        if isinstance(spec, ConstantParam):
            return "constant"
        return tuple(one(item) for item in spec.items)

    return tuple(one(spec) for spec in signature)


def fallback(signature: Sequence[ParamSpec], reason: str) -> AccessPlan:
    """The plan used where the analysis cannot answer: every array ``"read_write"``."""
    return AccessPlan(modes=_fallback_modes(signature), exact=False, reason=reason)


def _check_signature(signature: object) -> tuple[ParamSpec, ...]:
    if not isinstance(signature, (tuple, list)):
        raise TypeError(
            f"signature: expected a sequence of parameter descriptions, got {type(signature).__name__}"
        )
    sig = tuple(signature)
    for i, spec in enumerate(sig):
        if not isinstance(spec, _PARAM_TYPES):
            raise TypeError(
                f"signature[{i}]: expected ArrayParam, ListParam, ScalarParam, ConstantParam "
                f"or TupleParam, got {spec!r}"
            )
    return sig


# --- the cache and the one-time checks ---------------------------------------------

_lock = threading.Lock()
# kernel -> {signature: plan}; kernels are held weakly where they allow it.
# kernel (held weakly) -> {signature key: plan}. Only cuda.tile kernels are stored.
_plans: weakref.WeakKeyDictionary[Any, dict[tuple[object, ...], AccessPlan]] = weakref.WeakKeyDictionary()
# None: not run yet; "": passed; otherwise why the analysis is unusable here.
_unusable: str | None = None


def _clear_caches() -> None:
    """Forget cached plans and the self-test's result (for tests)."""
    global _unusable
    with _lock:
        _plans.clear()
        _unusable = None


def _key(specs: Sequence[ParamSpec]) -> tuple[object, ...]:
    """A cache key that tells apart constants that compare equal (1, True, 1.0; 0.0, -0.0)."""
    return tuple(
        ("c", type(spec.value).__name__, repr(spec.value))
        if isinstance(spec, ConstantParam)
        else ("t", _key(spec.items))
        if isinstance(spec, TupleParam)
        else spec
        for spec in specs
    )


def _cached(kernel: object, sig: tuple[ParamSpec, ...]) -> AccessPlan | None:
    try:
        return _plans.get(kernel, {}).get(_key(sig))
    except TypeError:  # not weakly referenceable: not a cuda.tile kernel
        return None


def _version_problem() -> str | None:
    try:
        import cuda.tile as ct
    except ImportError as exc:
        return f"cuda.tile could not be imported ({exc}); install trio_cuda[tile]"
    version = str(getattr(ct, "__version__", ""))
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return f"cuda.tile reports an unrecognised version {version!r}"
    if (major, minor) != SUPPORTED_VERSION:
        want = ".".join(map(str, SUPPORTED_VERSION))
        return f"cuda.tile {version} is installed; the access analysis relies on cuda.tile {want}.x internals"
    return None


def _check_usable() -> str:
    """'' when the analysis may be used here, otherwise the reason (computed once)."""
    global _unusable
    with _lock:
        if _unusable is not None:
            return _unusable
    problem = _version_problem()
    if problem is None:
        problem = _self_test()
    with _lock:
        _unusable = problem or ""
        return _unusable


def warm_up() -> None:
    """Import what :func:`analyze` needs and run the self-test now (once per
    process; never raises): ``Kernel.from_tile`` calls it, so that the first
    launch does not pay for it."""
    try:
        _check_usable()
    except Exception:  # pragma: no cover - analyze() falls back and says why
        pass


def analyze(kernel: object, signature: Sequence[ParamSpec]) -> AccessPlan:
    """What ``kernel`` (a ``@ct.kernel``) does to each parameter of ``signature``.

    Never raises for a kernel the analysis cannot handle: that gives the fallback plan
    (every array ``"read_write"``, ``exact=False``). Raises ``TypeError`` for a
    ``signature`` that is not a sequence of parameter descriptions, for a ``kernel`` that
    is not a ``cuda.tile`` kernel (where ``cuda.tile`` imports), and, where the analysis
    is usable, for a signature whose length differs from the kernel's parameter count;
    ``ValueError`` for a dtype name ``cuda.tile`` does not know. Takes 2-30 ms the first
    time per (kernel, signature); cached after that. Thread-safe.
    """
    sig = _check_signature(signature)
    with _lock:
        plan = _cached(kernel, sig)
    if plan is not None:
        return plan
    problem = _check_usable()
    _check_kernel_type(kernel)
    if problem:
        return fallback(sig, problem)
    _check_kernel(kernel, sig)
    _check_dtypes(sig)
    try:
        plan = _analyze_uncached(kernel, sig)
    except Exception as exc:
        plan = fallback(sig, f"the access analysis failed: {type(exc).__name__}: {exc}")
    with _lock:
        plan = _plans.setdefault(kernel, {}).setdefault(_key(sig), plan)
    return plan


def _check_kernel_type(kernel: object) -> None:
    try:
        import cuda.tile as ct
    except ImportError:
        return  # nothing to check against; the fallback plan follows
    if not isinstance(kernel, ct.kernel):
        raise TypeError(f"kernel: expected a @cuda.tile.kernel function, got {kernel!r}")


def _check_kernel(kernel: Any, sig: tuple[ParamSpec, ...]) -> None:
    import inspect

    pyfunc = kernel._annotated_function.pyfunc
    n = len(inspect.signature(pyfunc).parameters)
    if n != len(sig):
        raise TypeError(
            f"signature: kernel {pyfunc.__name__!r} takes {n} parameters, the signature describes {len(sig)}"
        )


def _check_dtypes(specs: Sequence[ParamSpec]) -> None:
    for spec in specs:
        if isinstance(spec, TupleParam):
            _check_dtypes(spec.items)
        elif not isinstance(spec, ConstantParam):
            _dtype(spec.dtype)


# --- the analysis proper (cuda.tile 1.7 internals) ------------------------------------


class _Unresolved(Exception):
    """A memory operation could not be attributed to parameters."""


def _analyze_uncached(kernel: Any, sig: tuple[ParamSpec, ...]) -> AccessPlan:
    from cuda.tile import _compile
    from cuda.tile._bytecode.version import BytecodeVersion
    from cuda.tile._ir import ops as ir_ops
    from cuda.tile._ir.core_ops import TilePrintf
    from cuda.tile._ir.ir import MemoryEffect
    from cuda.tile._passes.ast2hir import HirMode, get_function_hir
    from cuda.tile._passes.dataflow_analysis import ALIAS_UNIVERSE
    from cuda.tile._passes.token_order import _get_input_var
    from cuda.tile.compilation import CallingConvention, KernelSignature

    # Each array (and each list's elements) gets its own alias set; cuTile numbers them
    # bit by bit in parameter order (a list: its own storage first, then its elements).
    owner: list[tuple[int, tuple[int, ...]] | None] = []  # bit -> (param, tuple path)
    constraints = [_constraint(spec, (i, ()), owner) for i, spec in enumerate(sig)]
    ksig = KernelSignature(constraints, CallingConvention.cutile_python_v2()).with_mangled_symbol(
        kernel._annotated_function.pyfunc.__name__
    )

    with _compile._compiler_lock:
        func_hir = get_function_hir(kernel._annotated_function.pyfunc, mode=HirMode.ENTRY_POINT)
        keeper = _compile._IrKeeper(
            ann_func=kernel._annotated_function,
            func_hir=func_hir,
            signatures=[ksig],
            bytecode_version=max(_compile._SUPPORTED_VERSIONS, default=BytecodeVersion.V_13_4),
            sm_arch=None,
            log_cutile_ir=False,
            keep_all=False,
        )
        body = keeper.get_final_ir(0)
        dataflow = keeper.get_dataflow_result(0)

    # The array parameters' base pointers must carry the alias sets computed above.
    for flat_var, expected_bit in _param_base_vars(body, sig):
        pred = dataflow.predicates.get(flat_var.name)
        if pred is None or pred.alias_set != 1 << expected_bit:
            raise _Unresolved(f"parameter variable {flat_var.name!r} does not carry the expected alias set")

    ignored = (
        ir_ops.TileAssert,
        TilePrintf,
        ir_ops.GridDependencyControlWait,
        ir_ops.GridDependencyControlLaunchDependents,
    )
    loads = (ir_ops.TileLoad, ir_ops.LoadPointer)
    stores = (ir_ops.TileStore, ir_ops.StorePointer)
    atomics = (ir_ops.TileAtomicCAS, ir_ops.TileAtomicRMW, ir_ops.TileAtomicRedView)
    reads: set[tuple[int, tuple[int, ...]]] = set()
    writes: set[tuple[int, tuple[int, ...]]] = set()
    for op in _walk(body):
        if op.memory_effect == MemoryEffect.NONE or isinstance(op, ignored):
            continue
        if isinstance(op, loads):
            targets: tuple[set[tuple[int, tuple[int, ...]]], ...] = (reads,)
        elif isinstance(op, stores):
            targets = (writes,)
        elif isinstance(op, atomics):
            targets = (reads, writes)
        else:
            raise _Unresolved(f"unknown memory operation {type(op).__name__}")
        var = _get_input_var(op)
        pred = dataflow.predicates.get(var.name)
        if pred is None:
            raise _Unresolved(f"{type(op).__name__} on {var.name!r} has no alias information")
        alias_set = pred.alias_set
        if alias_set == ALIAS_UNIVERSE or alias_set <= 0 or alias_set >> len(owner):
            raise _Unresolved(f"{type(op).__name__} on {var.name!r} may touch any array")
        for bit in range(len(owner)):
            if alias_set >> bit & 1:
                who = owner[bit]
                if who is None:  # a list's own storage: not accessed by tile code
                    raise _Unresolved(f"{type(op).__name__} accesses a list's storage")
                for t in targets:
                    t.add(who)

    def mode(spec: ParamSpec, key: tuple[int, tuple[int, ...]]) -> ParamAccess:
        if isinstance(spec, (ArrayParam, ListParam)):
            return _combine(key in reads, key in writes)
        if isinstance(spec, ScalarParam):
            return "scalar"
        if isinstance(spec, ConstantParam):
            return "constant"
        return tuple(mode(item, (key[0], key[1] + (j,))) for j, item in enumerate(spec.items))

    return AccessPlan(modes=tuple(mode(s, (i, ())) for i, s in enumerate(sig)), exact=True)


def _dtype(name: str) -> Any:
    import cuda.tile as ct
    from cuda.tile._datatype import DType

    value = getattr(ct, "bool_" if name == "bool" else name, None)
    if not isinstance(value, DType):
        raise ValueError(  # noqa: TRY004 (a wrong name, not a wrong type)
            f"dtype: expected a cuda.tile dtype name such as 'float32', got {name!r}"
        )
    return value


def _array_constraint(spec: ArrayParam | ListParam) -> Any:
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint

    return ArrayConstraint(
        _dtype(spec.dtype),
        spec.ndim,
        index_dtype=ct.int32,
        stride_lower_bound_incl=0,
        alias_groups=(),
        may_alias_internally=False,
    )


def _constraint(
    spec: ParamSpec,
    key: tuple[int, tuple[int, ...]],
    owner: list[tuple[int, tuple[int, ...]] | None],
) -> Any:
    from cuda.tile.compilation import (
        ConstantConstraint,
        ListConstraint,
        ScalarConstraint,
        TupleConstraint,
    )

    if isinstance(spec, ArrayParam):
        owner.append(key)
        return _array_constraint(spec)
    if isinstance(spec, ListParam):
        owner.append(None)  # the list's own storage
        owner.append(key)  # its elements
        return ListConstraint(_array_constraint(spec), alias_groups=(), elements_may_alias=False)
    if isinstance(spec, ScalarParam):
        return ScalarConstraint(_dtype(spec.dtype))
    if isinstance(spec, ConstantParam):
        return ConstantConstraint(spec.value)
    return TupleConstraint(
        [_constraint(item, (key[0], key[1] + (j,)), owner) for j, item in enumerate(spec.items)]
    )


def _param_base_vars(body: Any, sig: tuple[ParamSpec, ...]) -> Iterator[tuple[Any, int]]:
    """(base-pointer variable, alias bit) of every array and list in the flat parameters."""
    params = list(body.params)
    pos = 0
    bit = 0

    def walk(spec: ParamSpec) -> Iterator[tuple[Any, int]]:
        nonlocal pos, bit
        if isinstance(spec, ArrayParam):
            yield params[pos], bit
            pos += 1 + 2 * spec.ndim
            bit += 1
        elif isinstance(spec, ListParam):
            yield params[pos], bit
            pos += 2
            bit += 2
        elif isinstance(spec, ScalarParam):
            pos += 1
        elif isinstance(spec, TupleParam):
            for item in spec.items:
                yield from walk(item)

    for spec in sig:
        yield from walk(spec)
    if pos != len(params):
        raise _Unresolved(f"expected {pos} flat kernel parameters, found {len(params)}")


def _walk(block: Any) -> Iterator[Any]:
    for op in block.operations:
        yield op
        for nested in op.nested_blocks:
            yield from _walk(nested)


# --- self-test ------------------------------------------------------------------------


def _self_test() -> str | None:
    """Check the analysis on built-in kernels with known accesses; None when it passes."""
    try:
        cases = _self_test_cases()
        for kernel, sig, expected in cases:
            got = _analyze_uncached(kernel, sig)
            if got.modes != expected:
                name = kernel._annotated_function.pyfunc.__name__
                return (
                    f"the access analysis self-test failed on {name!r}: expected {expected}, got {got.modes}"
                )
    except Exception as exc:
        return f"the access analysis self-test raised {type(exc).__name__}: {exc}"
    return None


def _self_test_cases() -> list[tuple[Any, tuple[ParamSpec, ...], tuple[ParamAccess, ...]]]:
    import cuda.tile as ct

    def _st_load(x, i):  # type: ignore[no-untyped-def]
        return ct.load(x, index=(i,), shape=(16,))

    @ct.kernel
    def _st_copy(a, b, c, flag, n):  # type: ignore[no-untyped-def]
        i = ct.bid(0)
        t = _st_load(a, i)  # type: ignore[no-untyped-call]
        ct.store(b, index=(i,), tile=t)

    @ct.kernel
    def _st_branch(a, b, c, flag):  # type: ignore[no-untyped-def]
        i = ct.bid(0)
        dst = b if flag > 0 else c
        ct.store(dst, index=(i,), tile=ct.load(a, index=(i,), shape=(16,)))
        ct.atomic_add(a, ct.arange(16, dtype=ct.int32), 1.0)

    @ct.kernel
    def _st_aggregates(pair, xs, out):  # type: ignore[no-untyped-def]
        src, dst = pair
        idx = ct.arange(16, dtype=ct.int32)
        ct.scatter(dst, idx, ct.gather(xs[0], idx))
        ct.store(out.slice(0, 0, 16), index=(0,), tile=ct.load(src, index=(0,), shape=(16,)))

    f32 = ArrayParam("float32", 1)
    return [
        (
            _st_copy,
            (f32, f32, f32, ScalarParam("int32"), ConstantParam(16)),
            ("read", "write", "none", "scalar", "constant"),
        ),
        (
            _st_branch,
            (f32, f32, f32, ScalarParam("int32")),
            ("read_write", "write", "write", "scalar"),
        ),
        (
            _st_aggregates,
            (TupleParam((f32, f32)), ListParam("float32", 1), f32),
            (("read", "write"), "read", "write"),
        ),
    ]
