"""Every public namespace: its classes are final at runtime unless they are
meant for subclassing (an explicit list, each entry with its reason), and each
public submodule exposes only its ``__all__`` (and modules).

The public namespaces are found, not listed: ``trio_cuda`` and every module
under it whose dotted name has no component starting with ``_``
(``trio_cuda.ray`` where Ray is installed). A new public class or submodule is
checked without any change here.
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil
import re
import types

import attrs
import pytest

import trio_cuda
from trio_cuda._core._final import final

#: the public classes meant to be subclassed; every other public class is final
SUBCLASSABLE = {
    # The error hierarchy. Users catch these, and their own layers may raise refinements
    # of them (a validation layer's KernelArgumentError); Trio keeps its exceptions
    # subclassable the same way (only Cancelled, which only its runtime raises, is final).
    "trio_cuda.TrioCudaError",
    "trio_cuda.CudaError",
    "trio_cuda.OutOfMemoryError",
    "trio_cuda.LaunchError",
    "trio_cuda.KernelArgumentError",
    "trio_cuda.AccessConflictError",
    "trio_cuda.CompletionUnknownError",
    "trio_cuda.GraphCaptureError",
    "trio_cuda.ScopeClosedError",
    "trio_cuda.DeviceUnavailableError",
    "trio_cuda.MissingReferenceError",
    "trio_cuda.TileCompileError",
    "trio_cuda.TileToolchainError",
    "trio_cuda.ray.JobCancelledError",
    # Protocols that users implement (open_scope(policy=...), open_device_pool(policy=...)),
    # which they may also subclass explicitly.
    "trio_cuda.SchedulingPolicy",
    "trio_cuda.DevicePolicy",
    # The base of every op: the library's own ops subclass it (in its private modules),
    # and a subclass that implements _enqueue is accepted as an op
    # (see the TypeError of check_op).
    "trio_cuda.DeviceOp",
}

#: a module that pytest loads by name finds its hooks by their names too
PLUGIN = "trio_cuda.testing.pytest_plugin"


def _public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def _public_modules() -> list[types.ModuleType]:
    mods = [trio_cuda]
    for info in pkgutil.walk_packages(trio_cuda.__path__, "trio_cuda."):
        if not _public(info.name):
            continue
        try:
            mods.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:  # an optional dependency (trio_cuda.ray needs Ray)
            if exc.name is None or exc.name.startswith("trio_cuda"):
                raise
    return mods


MODULES = _public_modules()


def _exported(mod: types.ModuleType) -> list[str]:
    names = getattr(mod, "__all__", None)
    return list(names) if names is not None else [n for n in vars(mod) if not n.startswith("_")]


def _public_classes() -> dict[str, type]:
    """Each public class once, by the name it reports (``trio_cuda.Kernel``)."""
    out = {}
    for mod in MODULES:
        for name in _exported(mod):
            obj = getattr(mod, name)
            if isinstance(obj, type) and obj.__module__.startswith("trio_cuda"):
                out[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return out


CLASSES = _public_classes()


def test_the_namespaces_are_found() -> None:
    names = {mod.__name__ for mod in MODULES}
    expected = {"trio_cuda", "trio_cuda.ops", "trio_cuda.unsafe", "trio_cuda.interop", "trio_cuda.trace"}
    assert expected | {"trio_cuda.testing", PLUGIN} <= names, names
    assert len(CLASSES) > 40, sorted(CLASSES)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_public_class_is_final_unless_meant_for_subclassing(name: str) -> None:
    cls = CLASSES[name]
    if name in SUBCLASSABLE:
        sub = type("UserSubclass", (cls,), {"__slots__": ()} if "__slots__" in vars(cls) else {})
        assert cls in sub.__mro__
        return
    with pytest.raises(TypeError, match=rf"^{re.escape(name)} is final: it cannot be subclassed"):
        type("UserSubclass", (cls,), {})
    assert getattr(cls, "__final__", False), f"{name}: final at runtime but not typing.final"


def test_the_subclassable_list_names_public_classes() -> None:
    loaded = {mod.__name__ for mod in MODULES}  # trio_cuda.ray only where Ray is installed
    stale = sorted(name for name in SUBCLASSABLE - set(CLASSES) if name.rpartition(".")[0] in loaded)
    assert stale == [], f"not public classes: {stale}"


@pytest.mark.parametrize("mod", [m for m in MODULES if m is not trio_cuda], ids=lambda m: m.__name__)
def test_a_public_submodule_exposes_only_its_all(mod: types.ModuleType) -> None:
    assert isinstance(getattr(mod, "__all__", None), list), f"{mod.__name__} has no __all__"
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert missing == [], f"{mod.__name__}.__all__ names what it lacks: {missing}"
    extra = sorted(
        name
        for name, value in vars(mod).items()
        if not name.startswith("_")
        and name not in mod.__all__
        and not isinstance(value, types.ModuleType)
        and not (mod.__name__ == PLUGIN and name.startswith("pytest_") and callable(value))
    )
    assert extra == [], f"{mod.__name__} exposes names outside its __all__: {extra}"


# --------------------------------------------------------------------------- the final decorator


@final
@attrs.frozen
class _Point:
    x: int
    y: int = 0


@final
class _Plain:
    __slots__ = ("v",)

    def __init__(self, v: int) -> None:
        self.v = v

    def __reduce__(self) -> tuple[type[_Plain], tuple[int]]:
        return (_Plain, (self.v,))


def test_final_keeps_attrs_slots_evolve_pickling_and_typing_final() -> None:
    p = _Point(1, 2)
    assert attrs.evolve(p, y=3) == _Point(1, 3)
    assert pickle.loads(pickle.dumps(p)) == p
    assert "__slots__" in vars(_Point)
    assert not hasattr(p, "__dict__")
    assert _Point.__final__ is True  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(_Plain(4))).v == 4
    for cls in (_Point, _Plain):
        with pytest.raises(TypeError, match=rf"^{__name__}\.{cls.__qualname__} is final: .* \(by Sub\)$"):
            type("Sub", (cls,), {})


def test_public_final_classes_still_evolve_and_pickle() -> None:
    s = trio_cuda.Scalar("f4")
    assert attrs.evolve(s) == s
    for obj in (s, trio_cuda.In("f4"), trio_cuda.InOut("f8"), trio_cuda.Slice("i4")):
        assert pickle.loads(pickle.dumps(obj)) == obj
    stats = trio_cuda.testing.SimDevice().statistics()
    assert pickle.loads(pickle.dumps(stats)) == stats
