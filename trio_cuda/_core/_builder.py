"""The inert launch builder, ``Kernel.builder()``.

Invariants:

* A :class:`LaunchBuilder` is not a DeviceOp: it cannot be scheduled until
  ``finalize_unchecked()`` turns it into an immutable :class:`KernelLaunch`.
* It checks nothing against the kernel's parameter list. Each argument is
  checked on its own when it is added (a closed array, a write to a read-only
  array, a scalar dtype, raw bytes and their alignment), and the geometry at
  ``finalize_unchecked()``, as ``Kernel.launch`` checks it (types, and the
  limits that need no device: "unchecked" is about the arguments, and a
  geometry no GPU runs is cheap to refuse); the device's own limits are
  checked at submission.
* A builder whose layout matches its kernel's uses the kernel's own
  :class:`ParamPlan`; other layouts share one plan each (bounded cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._arena import _POINTER, ParamPlan, _pack, _scalar_bytes
from ._array import DeviceArray
from ._config import cached_config
from ._errors import KernelArgumentError
from ._final import NoPublicConstructor, final
from ._launch import ArgView, KernelLaunch, PreparedLaunch, _merge_accesses
from ._ops import Access
from ._params import AccessName, _access_from_name, _align_up, _param_dtype_problem, dtype_alignment

if TYPE_CHECKING:
    from ._kernel import Kernel


_PLAN_CACHE: dict[tuple[tuple[int, int], ...], ParamPlan] = {}


def _plan_for(kernel: Kernel, layout: Sequence[tuple[int, int]]) -> ParamPlan:
    """The arena plan of a builder's ``(size, alignment)`` layout: the kernel's
    own plan when they agree (backends cache per plan), else one shared by
    every builder of that layout."""
    key = tuple(layout)
    own = kernel._plan
    slots = own.slots
    if len(slots) == len(key) and all(
        s.size == size and s.align == align for s, (size, align) in zip(slots, key, strict=True)
    ):
        return own
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        plan = ParamPlan.from_layout(key)
        if len(_PLAN_CACHE) >= 1024:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = plan
    return plan


@final
class LaunchBuilder(metaclass=NoPublicConstructor):
    """Inert launch builder: collects geometry, modes and raw arguments, checks
    nothing against the kernel's parameter list, and cannot be scheduled.
    ``finalize_unchecked()`` returns an immutable :class:`KernelLaunch`.

    ``arg(array, access=...)`` takes the access mode from the kernel's matching
    parameter when it declares one, else ``"readwrite"``.
    """

    __slots__ = (
        "_args",
        "_block",
        "_cluster",
        "_cooperative",
        "_grid",
        "_kernel",
        "_layout",
        "_pdl",
        "_shared",
    )

    _obtain = "use Kernel.builder()"

    _kernel: Kernel
    _grid: object
    _block: object
    _shared: int
    _cluster: object
    _cooperative: object
    _pdl: object
    _args: list[tuple[bytes, ArgView, DeviceArray | None]]
    _layout: list[tuple[int, int]]

    @classmethod
    def _create(cls, kernel: Kernel) -> LaunchBuilder:
        self = object.__new__(cls)
        self._kernel = kernel
        self._grid = 1
        self._block = 1
        self._shared = 0
        self._cluster = None
        self._cooperative = False
        self._pdl = False
        self._args = []
        self._layout = []
        return self

    def grid(self, *dims: int) -> LaunchBuilder:
        """Set the grid dimensions (1 to 3 ints)."""
        self._grid = dims
        return self

    def block(self, *dims: int) -> LaunchBuilder:
        """Set the block dimensions (1 to 3 ints)."""
        self._block = dims
        return self

    def shared_mem(self, nbytes: int) -> LaunchBuilder:
        """Set the dynamic shared memory in bytes."""
        self._shared = nbytes
        return self

    def cluster(self, *dims: int) -> LaunchBuilder:
        """Set the thread-block cluster dimensions."""
        self._cluster = dims
        return self

    def cooperative(self, enabled: bool = True) -> LaunchBuilder:
        """Make it a cooperative launch (checked at finalize: a bool)."""
        self._cooperative = enabled
        return self

    def pdl(self, enabled: bool = True) -> LaunchBuilder:
        """Allow programmatic dependent launch (checked at finalize: a bool)."""
        self._pdl = enabled
        return self

    def arg(self, value: object, *, access: AccessName | None = None) -> LaunchBuilder:
        """Append a DeviceArray (passed as its pointer) or a NumPy scalar."""
        index = len(self._args)
        if isinstance(value, DeviceArray):
            if value.closed:
                raise KernelArgumentError(f"argument {index}: the array is closed")
            if access is not None:
                mode = _access_from_name(access)
            else:
                declared = self._kernel.params[index].access if index < len(self._kernel.params) else None
                mode = declared if declared is not None else Access.WRITE
            if mode is Access.WRITE and value.readonly:
                raise KernelArgumentError(f"argument {index}: write access to a read-only array")
            raw = _POINTER.type(value.ptr).tobytes()
            self._args.append(
                (
                    raw,
                    ArgView("array", value.ptr, value.shape, value.dtype, access=mode, order=value.order),
                    value,
                )
            )
            self._layout.append((8, 8))
        elif isinstance(value, np.generic):
            problem = _param_dtype_problem(value.dtype)
            if problem is not None:
                raise KernelArgumentError(
                    f"argument {index}: expected a numeric, bool, complex or C-layout struct scalar, "
                    f"got {value.dtype}: {problem}"
                )
            raw = _scalar_bytes(value.dtype, value)
            align = dtype_alignment(value.dtype)
            self._args.append((raw, ArgView("scalar", dtype=value.dtype, value=value), None))
            self._layout.append((_align_up(value.dtype.itemsize, align), align))
        else:
            raise KernelArgumentError(
                f"argument {index}: expected a DeviceArray or a NumPy scalar "
                f"(use arg_boxed for raw bytes), got {type(value).__name__}"
            )
        return self

    def arg_boxed(self, raw: bytes | bytearray | memoryview, *, align: int) -> LaunchBuilder:
        """Append an opaque parameter of ``len(raw)`` bytes at alignment ``align``."""
        index = len(self._args)
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise KernelArgumentError(
                f"argument {index}: expected bytes, bytearray or memoryview, got {type(raw).__name__}"
            )
        data = raw.tobytes() if isinstance(raw, memoryview) else bytes(raw)
        if not data:
            raise KernelArgumentError(f"argument {index}: raw bytes must not be empty")
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise KernelArgumentError(f"argument {index}: align must be a power of two, got {align}")
        self._args.append((data, ArgView("raw", value=data), None))
        self._layout.append((len(data), align))
        return self

    def finalize_unchecked(self) -> KernelLaunch:
        """Freeze into an immutable KernelLaunch. The arguments are not checked
        against the kernel's parameters; the geometry is, as ``Kernel.launch``
        checks it (a block of at most 1024 threads, grid and block dimensions,
        dynamic shared memory and cluster size within what some GPU allows, a
        cluster dividing the grid), raising :class:`KernelArgumentError`."""
        config = cached_config(
            self._grid,
            self._block,
            self._shared,
            self._cluster,
            self._cooperative,
            self._pdl,
        )
        plan = _plan_for(self._kernel, self._layout)
        raws = [a[0] for a in self._args]
        views = tuple(a[1] for a in self._args)
        accesses = []
        outputs = []
        for raw_view_arr in self._args:
            arr = raw_view_arr[2]
            if arr is not None:
                mode = raw_view_arr[1].access
                assert mode is not None
                accesses.append((arr, mode))
                if mode is Access.WRITE:
                    outputs.append(arr)
        prepared = PreparedLaunch(self._kernel, config, plan, _pack(plan, raws), views)
        return KernelLaunch._create(prepared, _merge_accesses(accesses), outputs)

    def __repr__(self) -> str:
        return f"<LaunchBuilder {self._kernel.name} ({len(self._args)} args, not finalized)>"
