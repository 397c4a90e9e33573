"""The compiled extensions' attribute reads (``_fastattr.h``) against getattr.

``fast_getattr(obj, name)`` reads a slot where it is stored, remembered per
(type, name) while the type is unchanged; ``class_holds(cls, name, value)``
checks a class attribute without getattr's work. Both must answer exactly
as getattr does, whatever is done to the classes between two reads."""

from __future__ import annotations

import gc
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_cuda._core import _compiled

pytestmark = pytest.mark.skipif(
    _compiled.ext is None,
    reason="the compiled paths are not in use (not built at install, or TRIO_CUDA_PURE set)",
)


def _read(obj: object, name: str) -> Any:
    assert _compiled.ext is not None
    return _compiled.ext.fast_getattr(obj, name)


def _outcome(fn: Any) -> Any:
    try:
        return ("value", fn())
    except AttributeError as exc:
        return ("AttributeError", str(exc))


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a: object) -> None:
        self.a = a


@attrs.define
class Record:
    x: object
    y: object = None


def test_a_slot_is_read_where_it_is_stored() -> None:
    obj = Slotted([1])
    for _ in range(3):  # learnt, then read from the table
        assert _read(obj, "a") is obj.a
    with pytest.raises(AttributeError):
        _read(obj, "b")  # an empty slot: getattr's error
    rec = Record(x=7)
    assert _read(rec, "x") == 7
    assert _read(rec, "y") is None


def test_a_changed_class_is_read_anew() -> None:
    class C:
        __slots__ = ("v",)

    obj = C()
    obj.v = "slot"
    assert _read(obj, "v") == "slot"
    assert _read(obj, "v") == "slot"
    descriptor = C.__dict__["v"]
    C.v = property(lambda self: "property")  # type: ignore[assignment,method-assign]
    assert _read(obj, "v") == "property"
    C.v = descriptor  # type: ignore[method-assign]
    assert _read(obj, "v") == "slot"
    del C.v
    with pytest.raises(AttributeError):
        _read(obj, "v")


def test_what_is_not_a_plain_slot_goes_to_getattr() -> None:
    class Hooked:
        __slots__ = ("v",)

        def __getattribute__(self, name: str) -> object:
            return f"hooked {name}"

    class Plain:
        def __init__(self) -> None:
            self.v = "dict"

    class Sub(Slotted):
        __slots__ = ()

        @property
        def a(self) -> object:  # (overrides the base's slot)
            return "sub's property"

    h = Hooked()
    assert _read(h, "v") == "hooked v"
    assert _read(Plain(), "v") == "dict"
    base, sub = Slotted("base"), Sub.__new__(Sub)
    for _ in range(2):
        assert _read(base, "a") == "base"
        assert _read(sub, "a") == "sub's property"
    assert _read(Slotted, "__slots__") == ("a", "b")  # a class itself
    with pytest.raises(TypeError):
        _compiled.ext.fast_getattr(base, 3)  # type: ignore[union-attr]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 39), st.sampled_from(["a", "b", "c", "missing"])), max_size=200))
def test_many_classes_through_one_table(reads: list[tuple[int, str]]) -> None:
    """More (type, name) pairs than the table has entries, read in a random
    order, with classes made and dropped between: always getattr's answer."""
    classes = [type(f"K{i}", (), {"__slots__": ("a", "b", "c")}) for i in range(40)]
    objs = []
    for i, cls in enumerate(classes):
        obj = cls()
        obj.a, obj.c = i, str(i)  # (b stays empty)
        objs.append(obj)
    for i, name in reads:
        obj = objs[i]
        assert _outcome(lambda: _read(obj, name)) == _outcome(lambda: getattr(obj, name))  # noqa: B023
    del classes, objs, obj
    gc.collect()
    # new classes where the old ones were: entries of freed types never match
    again = [type(f"K{i}", (), {"__slots__": ("c", "a")}) for i in range(40)]
    for i, cls in enumerate(again):
        obj = cls()
        obj.a = -i
        assert _read(obj, "a") == -i
        with pytest.raises(AttributeError):
            _read(obj, "c")


def test_class_holds_follows_the_class() -> None:
    assert _compiled.ext is not None
    holds = _compiled.ext.class_holds

    def f(self: object) -> None: ...

    def g(self: object) -> None: ...

    class Base:
        method = f

    class Child(Base):
        pass

    assert holds(Child, "method", f)
    Child.method = g  # type: ignore[method-assign]
    assert not holds(Child, "method", f)
    assert holds(Child, "method", g)
    del Child.method
    assert holds(Child, "method", f)
    Base.method = g  # type: ignore[method-assign]
    assert holds(Child, "method", g)
    assert not holds(Child, "absent", None)


def _write(obj: object, name: str, value: object) -> Any:
    assert _compiled.ext is not None
    try:
        _compiled.ext.fast_setattr(obj, name, value)
        return ("stored", None)
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _setattr(obj: object, name: str, value: object) -> Any:
    try:
        setattr(obj, name, value)
        return ("stored", None)
    except Exception as exc:
        return (type(exc).__name__, str(exc))


@attrs.define
class Checked:
    x: int = attrs.field(validator=attrs.validators.instance_of(int))


@attrs.frozen
class Frozen:
    x: object


def test_a_slot_is_stored_where_setattr_stores_it() -> None:
    obj = Slotted([1])
    for i in range(3):  # learnt, then stored through the table
        assert _write(obj, "a", i) == ("stored", None)
        assert obj.a == i
        assert _write(obj, "b", [i]) == ("stored", None)
        assert obj.b == [i]
    rec = Record(x=1)
    value = object()
    assert _write(rec, "y", value) == ("stored", None)
    assert rec.y is value
    # the old value is released, the new one kept
    import sys

    held = object()
    before = sys.getrefcount(held)
    _write(rec, "y", held)
    assert sys.getrefcount(held) == before + 1
    _write(rec, "y", None)
    assert sys.getrefcount(held) == before


def test_what_is_not_a_plain_writable_slot_goes_to_setattr() -> None:
    """A class with its own ``__setattr__`` (attrs' validators, frozen
    classes), a name with no slot, a read-only member and a property all
    answer exactly as setattr does."""
    cases: list[tuple[object, str, object]] = [
        (Checked(1), "x", 2),
        (Checked(1), "x", "not an int"),
        (Frozen(1), "x", 2),
        (Slotted(1), "c", 2),
        (1j, "real", 2.0),
        (slice(1, 2), "start", 3),
    ]
    for obj, name, value in cases:
        for _ in range(2):
            assert _write(obj, name, value) == _setattr(obj, name, value), (obj, name)


def test_a_changed_class_is_stored_anew() -> None:
    class Box:
        __slots__ = ("v",)

    box = Box()
    assert _write(box, "v", 1) == ("stored", None)
    seen: list[object] = []
    slot = Box.v  # type: ignore[attr-defined]
    Box.v = property(lambda self: 0, lambda self, value: seen.append(value))  # type: ignore[attr-defined]
    assert _write(box, "v", 2) == ("stored", None)
    assert seen == [2]  # the property's setter, not the slot
    Box.v = slot  # type: ignore[attr-defined]
    assert _write(box, "v", 3) == ("stored", None)
    assert box.v == 3
