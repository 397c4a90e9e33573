"""The layers' seams, measured: which modules use other modules' private state.

A *foreign private reach* is ``obj._name`` where ``obj`` is not ``self`` or
``cls`` and no code of the same module defines ``_name`` (assigns it, or
defines a function, class or slot of that name). The core's public classes
declare, in ``trio_cuda._core._interface``, the few members other modules may
use; every other reach counts against a budget, and public modules make none.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import trio_cuda
from trio_cuda._core._interface import declared_names

PACKAGE = Path(trio_cuda.__file__).parent
#: modules users import: they use the core only through its functions
PUBLIC = ("__init__.py", "ops.py", "unsafe.py", "interop.py", "trace.py", "ray.py", "testing")
#: undeclared foreign private reaches allowed in the whole package
BUDGET = 60


def reaches(path: Path) -> Counter[str]:
    """``obj._name`` reaches into another module's private state, by name."""
    tree = ast.parse(path.read_text())
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
            defined.add(node.value)  # __slots__ entries
    found: Counter[str] = Counter()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in defined:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found[name] += 1
    return found


def package_reaches() -> dict[str, Counter[str]]:
    return {str(p.relative_to(PACKAGE)): reaches(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_declared_interface_exists_on_the_classes() -> None:
    from trio_cuda import DeviceArray, KernelLaunch, ResourceScope, Stream

    members = set()
    for cls in (ResourceScope, DeviceArray, Stream, KernelLaunch):
        for klass in cls.__mro__:
            members.update(vars(klass))
            members.update(getattr(klass, "__annotations__", {}))
    missing = sorted(n for n in declared_names() if n not in members)
    assert missing == []


def test_undeclared_private_reaches_stay_under_budget() -> None:
    declared = declared_names()
    undeclared = {
        module: n
        for module, found in package_reaches().items()
        if (n := sum(c for name, c in found.items() if name not in declared))
    }
    total = sum(undeclared.values())
    assert total <= BUDGET, f"{total} undeclared private reaches (budget {BUDGET}): {undeclared}"


def test_public_modules_reach_into_no_private_state() -> None:
    offenders = {
        module: dict(found)
        for module, found in package_reaches().items()
        if found and (module.split("/")[0] in PUBLIC)
    }
    assert offenders == {}


def test_the_counter_sees_a_reach(tmp_path: Path) -> None:
    # a guard against a counter that counts nothing: what a module defines
    # itself, and self/cls, do not count; the rest does
    path = tmp_path / "sample.py"
    path.write_text(
        "class A:\n    __slots__ = ('_own',)\n"
        "def f(scope, a):\n    a._own = 1\n    return scope._driver, other._x, self._y, a._own\n"
    )
    assert reaches(path) == Counter({"_driver": 1, "_x": 1})
