"""``Kernel.launch`` compiled (``_claunch.launch_method``) against the reference.

On the class, ``Kernel.launch`` is the reference function; on a kernel it is
the compiled method, which makes the common call's launch through the typed
fast path and hands every other call to the reference. Random calls (every
keyword at ordinary and hostile values, missing or unknown keywords, wrong
arguments) must give the same launch or the same error both ways."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import trio_cuda
from tests.core.test_launch_fast import _same_launch
from tests.helpers.internals import compiled_only
from tests.helpers.kernels import stub_source
from trio_cuda import In, Kernel, Out, Scalar
from trio_cuda._core import _kernel

K = Kernel.from_source(stub_source("k"), "k", params=[In("f4"), Out("f4"), Scalar("i4")])
ABSENT = object()
GEOMETRY = [1, 2, 32, 0, -1, 2**31, 1.0, True, np.int64(2), (1, 2), (1, 1, 1), None, "x", float("nan")]


def _kw() -> st.SearchStrategy[dict[str, Any]]:
    def pick(values: list[Any]) -> st.SearchStrategy[Any]:
        return st.sampled_from([ABSENT] * (2 * len(values)) + values)

    return st.fixed_dictionaries(
        {
            "grid": st.sampled_from([1] * 10 + [4] * 10 + [*GEOMETRY, ABSENT]),
            "block": st.sampled_from([32] * 10 + [1] * 10 + [*GEOMETRY, ABSENT]),
            "shared_mem": pick([None, 0, 16, -1, 1.5, 2**20, True, np.int32(8)]),
            "cluster": pick([None, 1, (1, 1, 1), 0]),
            "cooperative": pick([None, False, True, 0]),
            "pdl": pick([False, True, 0, None]),
            "colour": st.sampled_from([ABSENT] * 30 + ["red"]),
        }
    ).map(lambda d: {k: v for k, v in d.items() if v is not ABSENT})


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        return (type(exc), str(exc))


@compiled_only
@settings(max_examples=400, deadline=None)
@given(kw=_kw(), wrong=st.sampled_from([None] * 12 + ["arity", "dtype", "scalar"]))
async def test_compiled_launch_is_the_reference(kw: dict[str, Any], wrong: str | None) -> None:
    assert type(Kernel.__dict__["launch"]).__name__ == "LaunchMethod"
    reference = Kernel.launch
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        args: list[Any] = [x, y, 8]
        if wrong == "arity":
            args.pop()
        elif wrong == "dtype":
            args[0] = gpu.zeros(8, "i4")
        elif wrong == "scalar":
            args[2] = 2**40
        compiled = _outcome(lambda: K.launch(*args, **kw))
        ref = _outcome(lambda: reference(K, *args, **kw))
        if isinstance(ref, tuple):
            assert compiled == ref
            event("refused")
        elif compiled.prepared.config is not ref.prepared.config:
            # a geometry the configuration cache does not take (an np.int64...):
            # the reference made both, each its own configuration
            assert attrs.astuple(compiled.prepared.config) == attrs.astuple(ref.prepared.config)
            assert compiled.prepared.arena == ref.prepared.arena
            event("launched, configuration made per call")
        else:
            _same_launch(compiled, ref)
            event("launched")


@compiled_only
async def test_the_common_call_skips_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference computes the configuration (``cached_config``); the
    compiled call finds it, once the reference made it."""
    calls: list[tuple[Any, ...]] = []
    real = _kernel.cached_config

    def counting(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_kernel, "cached_config", counting)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        K.launch(x, y, 8, grid=3, block=7, shared_mem=8)  # (the reference makes each configuration once)
        K.launch(x, y, 8, grid=3, block=7)
        assert len(calls) == 2
        K.launch(x, y, 8, grid=3, block=7)
        K.launch(x, y, 8, grid=3, block=7, shared_mem=None)
        K.launch(x, y, 8, grid=3, block=7, cluster=None, cooperative=False, pdl=False)
        K.launch(x, y, 8, grid=3, block=7, shared_mem=8)
        m = K.launch  # a bound method calls the same way
        m(x, y, 8, grid=3, block=7, shared_mem=8)
        assert len(calls) == 2
        K.launch(x, y, 8, grid=3, block=7, cooperative=True)  # not the common case
        K.launch(x, y, 8, grid=3, block=np.int64(7))
        assert len(calls) == 4


def test_the_class_shows_the_reference() -> None:
    ref = Kernel.launch
    assert inspect.isfunction(ref)
    assert ref.__doc__ is not None
    assert ref.__doc__.startswith("Check ``args``")
    sig = inspect.signature(ref)
    assert list(sig.parameters)[:2] == ["self", "args"]
    assert inspect.signature(K.launch) == sig.replace(parameters=list(sig.parameters.values())[1:])
    assert K.launch.__doc__ == ref.__doc__
    assert pickle.loads(pickle.dumps(K)).launch.__doc__ == ref.__doc__


@compiled_only
def test_a_first_argument_not_a_kernel_goes_to_the_reference() -> None:
    method = Kernel.__dict__["launch"]
    with pytest.raises(AttributeError):
        method(object(), grid=1, block=1)
    with pytest.raises(TypeError):
        method()


@compiled_only
@pytest.mark.parametrize(
    "kw",
    [
        {"grid": 16},
        {"grid": 16, "block": None, "shared_mem": None, "cluster": None, "cooperative": None, "pdl": False},
        {"grid": 16, "cooperative": False},
        {"grid": 16, "block": 1},
        {"grid": 16, "shared_mem": 0},
        {"grid": 16, "pdl": True},
        {"grid": 16.0},
        {"grid": np.int64(16)},
        {"grid": (16, 1)},
        {"grid": 0},
        {},
        {"grid": 16, "colour": "red"},
    ],
    ids=str,
)
@pytest.mark.parametrize("args", ["fit", "another shape", "wrong count"])
async def test_a_tile_kernel_launches_as_the_reference_does(kw: dict[str, Any], args: str) -> None:
    pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")
    from tests.tile.test_tile_kernels import vadd

    k = trio_cuda.Kernel.from_tile(vadd, cache=None)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y, z = (gpu.zeros(256, np.float32) for _ in range(3))
        given: tuple[Any, ...] = {
            "fit": (x, y, z),
            "another shape": (x[:128], y[:128], z[:128]),
            "wrong count": (x, y),
        }[args]
        for _ in range(2):  # (the second time, a recipe's fast path is there)
            compiled = _outcome(lambda: k.launch(*given, **kw))
            ref = _outcome(lambda: Kernel.launch(k, *given, **kw))
            if isinstance(ref, tuple):
                assert compiled == ref
            else:
                assert compiled.prepared.kernel is ref.prepared.kernel  # (the recipe)
                assert attrs.astuple(compiled.prepared.config) == attrs.astuple(ref.prepared.config)
                assert compiled.prepared.arena == ref.prepared.arena
                assert [(id(a), m) for a, m in compiled._accesses] == [(id(a), m) for a, m in ref._accesses]


@compiled_only
async def test_a_tile_launch_of_a_known_recipe_skips_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")
    from tests.tile.test_tile_kernels import vadd
    from trio_cuda._tile import launching

    calls: list[object] = []
    real = launching.cached_config
    monkeypatch.setattr(launching, "cached_config", lambda *a: calls.append(a) or real(*a))
    k = trio_cuda.Kernel.from_tile(vadd, cache=None)
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y, z = (gpu.zeros(256, np.float32) for _ in range(3))
        first = k.launch(x, y, z, grid=16)
        assert len(calls) == 1
        again = k.launch(x, y, z, grid=16, block=None)
        assert len(calls) == 1
        assert again.prepared.kernel is first.prepared.kernel
        k.launch(x[:128], y[:128], z[:128], grid=16)  # another recipe: the reference makes it
        assert len(calls) == 2


@compiled_only
async def test_the_bound_method() -> None:
    """``kernel.launch`` read as an attribute (a ``*args`` call reads it so)
    is bound to the kernel: it shows and behaves as the bound reference,
    and its common call keeps the arguments' tuple as given."""
    bound = K.launch
    assert type(bound).__name__ == "BoundLaunch"
    assert bound.__self__ is K
    assert bound.__func__ is Kernel.__dict__["launch"]
    assert bound == K.launch
    assert hash(bound) == hash(K.launch)
    other = Kernel.from_source(stub_source("k"), "k", params=[In("f4"), Out("f4"), Scalar("i4")])
    assert bound != other.launch
    assert bound != Kernel.launch.__get__(K)  # (a plain bound method is another kind of object)
    assert repr(bound) == f"<bound method Kernel.launch of {K!r}>"
    assert bound.__name__ == "launch"
    assert bound.__qualname__ == "Kernel.launch"
    assert bound.__wrapped__.__func__ is Kernel.launch
    assert bound.__wrapped__.__self__ is K
    assert pickle.loads(pickle.dumps(bound)).__func__ is Kernel.__dict__["launch"]
    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        args = (x, y, 8)
        K.launch(*args, grid=2, block=4)  # (the reference makes the configuration once)
        made = K.launch(*args, grid=2, block=4)
        assert made.prepared.values is args  # (the tuple given, not a copy)
        _same_launch(made, Kernel.launch(K, *args, grid=2, block=4))
        # keywords the common call does not take, by any spelling, go to the reference
        name = "".join(["gr", "id"])  # (not interned)
        _same_launch(K.launch(*args, **{name: 2, "block": 4}), made)
        with pytest.raises(TypeError, match="colour"):
            K.launch(*args, grid=2, block=4, colour="red")
        with pytest.raises(trio_cuda.KernelArgumentError):
            K.launch(*args[:2], grid=2, block=4)
        # a first argument that is not a kernel: the reference decides
        with pytest.raises(AttributeError):
            Kernel.__dict__["launch"].__get__(object())(*args, grid=2, block=4)


@compiled_only
async def test_recent_configurations_are_values() -> None:
    """The compiled call remembers the last configurations it found in the
    reference's cache; once that cache is cleared, a remembered one is still
    the value the reference makes, and a new geometry goes to the reference."""
    from trio_cuda._core import _config

    async with trio_cuda.open_scope(device="sim") as gpu:
        x, y = gpu.zeros(8, "f4"), gpu.zeros(8, "f4")
        for g in (5, 6, 5, 7, 5):
            K.launch(x, y, 8, grid=g, block=3)  # (the reference makes each once; then found)
        before = K.launch(x, y, 8, grid=5, block=3).prepared.config
        saved = dict(_config._SIMPLE_CONFIGS)
        try:
            _config._SIMPLE_CONFIGS.clear()
            again = K.launch(x, y, 8, grid=5, block=3)
            ref = Kernel.launch(K, x, y, 8, grid=5, block=3)
            assert attrs.astuple(again.prepared.config) == attrs.astuple(ref.prepared.config)
            assert again.prepared.config is before or again.prepared.config is ref.prepared.config
            assert again.prepared.arena == ref.prepared.arena
            fresh = K.launch(x, y, 8, grid=11, block=13)  # never seen: the reference's, cached there
            assert _config._SIMPLE_CONFIGS[(11, 13, 0)] is fresh.prepared.config
        finally:
            _config._SIMPLE_CONFIGS.update(saved)
