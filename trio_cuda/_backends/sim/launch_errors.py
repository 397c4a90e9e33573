"""The errors of a simulated launch's CPU behaviour: how an argument is named
(``arg_label``), a reference that raised (``reference_failed``), a tile
kernel's NumPy execution that raised (``tile_failed``), an access out of
bounds (``illegal_address``), and the fault every one of them is
(``CUDA_ERROR_LAUNCH_FAILED`` or ``CUDA_ERROR_ILLEGAL_ADDRESS``).

Invariants: the errors say what a GPU would (a launch failure, an illegal
address), never sticky here; the exception that caused one is its
``__cause__``; messages name the kernel and the argument as the kernel
declares it where it does.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._core._errors import LaunchError
from ..._core._ops import Access
from ..._core._params import In, InOut, Out, Param, Scalar, Slice
from .views import Describe, LaunchCheck, OutOfBounds

if TYPE_CHECKING:
    from ..._core._kernel import Kernel
    from ..._core._launch import ArgView

__all__ = [
    "arg_label",
    "describer",
    "illegal_address",
    "launch_failed",
    "read_only_mode",
    "reference_failed",
    "tile_failed",
]


def launch_failed(text: str, call: str) -> LaunchError:
    """A kernel fault, attached to the stream's next marker."""
    return LaunchError(719, "CUDA_ERROR_LAUNCH_FAILED", text, call=call)


# --------------------------------------------------------------------------- reference errors


def _param_of(kernel: Kernel, i: int, av: ArgView, count: int) -> Param | None:
    """The declared parameter behind argument ``i``, where the launch's
    arguments follow the declaration (a typed launch, or a builder's that
    matches it)."""
    params = kernel.params
    if len(params) != count:
        return None
    p = params[i]
    expected = {"scalar": Scalar, "slice": Slice}.get(av.kind, (In, Out, InOut))
    return p if isinstance(p, expected) else None


def arg_label(kernel: Kernel, i: int, av: ArgView, count: int) -> str:
    """``argument 2 (y: InOut(float32))``: argument ``i`` as errors name it."""
    p = _param_of(kernel, i, av, count)
    if p is not None:
        dt = p.dtype
        kind = f"struct of {dt.itemsize} B" if dt.fields else dt.name
        name = f"{p.name}: " if p.name else ""
        return f"argument {i} ({name}{type(p).__name__}({kind}))"
    if av.kind == "raw":
        return f"argument {i} (raw bytes)"
    dtype = av.dtype.name if av.dtype is not None else "?"
    what = "scalar" if av.kind == "scalar" else "array"
    return f"argument {i} ({dtype} {what})"


def read_only_mode(kernel: Kernel, i: int, av: ArgView, count: int) -> str:
    """How argument ``i``, read-only, was declared so: ``In``, ``Slice, access="read"``..."""
    p = _param_of(kernel, i, av, count)
    if isinstance(p, In):
        return "In"
    if isinstance(p, Slice):
        return 'Slice, access="read"'
    return 'access="read"'


def describer(kernel: Kernel, i: int, av: ArgView, count: int) -> Describe:
    return lambda: (arg_label(kernel, i, av, count), read_only_mode(kernel, i, av, count))


def _expected_args(kernel: Kernel, views: Sequence[ArgView]) -> str:
    """What a reference of this launch receives, one item per argument."""
    items = []
    for i, av in enumerate(views):
        label = arg_label(kernel, i, av, len(views))
        if av.kind == "scalar":
            items.append(f"{label} as a NumPy scalar")
        elif av.kind == "raw":
            items.append(f"{label} as bytes")
        elif av.kind == "slice":
            len_dtype = av.len_dtype.name if av.len_dtype is not None else "uint64"
            items.append(f"{label} as a view, then its length ({len_dtype})")
        else:
            items.append(f"{label} as a view")
    return "; ".join(items)


def _binds(fn: Any, args: Sequence[object]) -> bool | None:
    """Whether ``fn`` accepts ``args`` (None: it has no signature to ask)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args)
    except TypeError:
        return False
    return True


def reference_failed(
    kernel: Kernel, reference: Any, views: Sequence[ArgView], args: Sequence[object], exc: Exception
) -> LaunchError:
    """The error of a launch whose reference raised ``exc`` (its ``__cause__``),
    as a GPU reports a faulting kernel: CUDA_ERROR_LAUNCH_FAILED."""
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = f"kernel {kernel.name}: its reference raised {what}"
    if isinstance(exc, TypeError) and _binds(reference, args) is False:
        text += (
            f"; a reference takes one argument per kernel parameter, here {len(args)}: "
            f"{_expected_args(kernel, views)}"
        )
    elif isinstance(exc, ValueError) and "read-only" in str(exc) and "is read-only (" not in str(exc):
        # NumPy's own message: name the read-only arguments
        labels = [
            f"{arg_label(kernel, i, av, len(views))}, {read_only_mode(kernel, i, av, len(views))}"
            for i, av in enumerate(views)
            if av.kind in ("array", "slice") and av.access is Access.READ
        ]
        if labels:
            text += f"; the kernel only reads {'; '.join(labels)}"
    error = launch_failed(text, "")
    error.__cause__ = exc
    return error


def tile_failed(kernel: Kernel, exc: Exception) -> LaunchError:
    """The error of a tile launch whose execution on NumPy tiles raised ``exc``
    (its ``__cause__``): CUDA_ERROR_LAUNCH_FAILED, as a faulting kernel."""
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    error = launch_failed(f"tile kernel {kernel.name}: the simulator's execution of it raised {what}", "")
    error.__cause__ = exc
    return error


def illegal_address(check: LaunchCheck, fault: OutOfBounds | None, *, tile: bool = False) -> LaunchError:
    """The error of a launch whose reference (``tile``: the tile kernel's own
    execution on NumPy tiles) accessed an argument out of bounds, as a GPU
    reports an illegal address (not sticky here)."""
    more = f" ({check.more} more out-of-bounds access(es) after it)" if check.more else ""
    who, it = ("tile kernel", "its execution on NumPy tiles") if tile else ("kernel", "its reference")
    text = (
        f"{who} {check.kernel}: {it} accessed memory out of bounds: {check.first}{more}; "
        f"the simulator stopped {it} there and recorded an out_of_bounds violation "
        f"(SimDevice.violations)"
    )
    error = LaunchError(700, "CUDA_ERROR_ILLEGAL_ADDRESS", text, call="")
    if fault is not None:  # where the reference made the access
        error.__cause__ = IndexError(str(check.first)).with_traceback(fault.__traceback__)
    return error
