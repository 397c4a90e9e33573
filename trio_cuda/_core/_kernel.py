"""Kernels and their typed launch.

Invariants:

* A :class:`Kernel` is device-independent; each scope loads it at most once.
  Its arena plan and fast packer are built once, when it is made.
* ``Kernel.launch`` checks everything (arity, dtypes, scalar ranges, access
  modes, closed or read-only arrays, launch configuration) before it returns a
  :class:`KernelLaunch`; a launch that fails these checks never reaches a stream.
* The fast path (:func:`_launch_fast`) either returns the launch the checked
  path would build, or None; then the checked path runs, and raises the
  precise error.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal, final

import attrs
import numpy as np

from ._arena import (
    _K_ARRAY,
    _K_FLOAT,
    _K_INT,
    _K_SLICE,
    _POINTER,
    ParamPlan,
    _fast_packer,
    _pack,
    _scalar_bytes,
    _slots_for,
)
from ._array import AllocState, DeviceArray
from ._builder import LaunchBuilder
from ._config import (
    LaunchConfig,
    cached_config,
)
from ._errors import KernelArgumentError
from ._launch import ArgView, KernelLaunch, PreparedLaunch, _merge_accesses
from ._ops import Access
from ._params import In, InOut, Out, Param, Scalar, Slice, _check_array, _convert_scalar, _param_label

__all__ = ["Kernel"]


def _check_params(params: Sequence[object]) -> tuple[Param, ...]:
    out = []
    for i, p in enumerate(params):
        if not isinstance(p, Scalar | In | Out | InOut | Slice):
            raise TypeError(f"params[{i}]: expected Scalar, In, Out, InOut or Slice, got {p!r}")
        out.append(p)
    return tuple(out)


@final
@attrs.define(eq=False)
class Kernel:
    """A GPU kernel with a typed parameter list.

    Use :meth:`from_source` (CUDA C++, compiled with NVRTC), :meth:`from_ptx`
    or :meth:`from_cubin`. ``reference`` is the kernel's behaviour on the CPU:
    the simulator runs it on NumPy views, and tests use it as an oracle.
    """

    name: str
    params: tuple[Param, ...]
    source: str | None = None
    image: bytes | None = None
    image_kind: Literal["source", "ptx", "cubin"] = "source"
    options: tuple[str, ...] = ()
    reference: Callable[..., object] | None = None
    _plan: ParamPlan = attrs.field(init=False, repr=False)
    _fast: tuple[tuple[Any, ...], ...] | None = attrs.field(init=False, repr=False)
    _struct: struct.Struct | None = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        layout: list[tuple[int, int]] = []
        for p in self.params:
            layout.extend(_slots_for(p))
        self._plan = ParamPlan.from_layout(layout)
        self._fast, self._struct = _fast_packer(self.params, self._plan)

    @classmethod
    def from_source(
        cls,
        source: str,
        name: str,
        *,
        params: Sequence[Param],
        reference: Callable[..., object] | None = None,
        options: Sequence[str] = (),
    ) -> Kernel:
        """A kernel in CUDA C++ source. ``name`` is the (``extern "C"``)
        function name; ``options`` are extra NVRTC options."""
        if not isinstance(source, str):
            raise TypeError(f"source: expected str, got {type(source).__name__}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name: expected a non-empty str, got {name!r}")
        return cls(
            name=name,
            params=_check_params(params),
            source=source,
            image_kind="source",
            options=tuple(options),
            reference=reference,
        )

    @classmethod
    def from_ptx(
        cls,
        ptx: str | bytes,
        name: str,
        *,
        params: Sequence[Param],
        reference: Callable[..., object] | None = None,
    ) -> Kernel:
        """A kernel in PTX, loaded (JIT-compiled) by the driver."""
        image = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
        return cls(
            name=name, params=_check_params(params), image=image, image_kind="ptx", reference=reference
        )

    @classmethod
    def from_cubin(
        cls,
        cubin: bytes,
        name: str,
        *,
        params: Sequence[Param],
        reference: Callable[..., object] | None = None,
    ) -> Kernel:
        """A kernel in a compiled cubin (or fatbin) image."""
        return cls(
            name=name,
            params=_check_params(params),
            image=bytes(cubin),
            image_kind="cubin",
            reference=reference,
        )

    @property
    def plan(self) -> ParamPlan:
        """The arena layout of this kernel's parameters."""
        return self._plan

    def launch(
        self,
        *args: object,
        grid: object,
        block: object,
        shared_mem: int = 0,
        cluster: object = None,
        cooperative: bool = False,
        pdl: bool = False,
    ) -> KernelLaunch:
        """Check ``args`` against the parameter list and return an immutable,
        schedulable :class:`KernelLaunch`. Raises :class:`KernelArgumentError`
        naming the offending argument; nothing is enqueued."""
        config = cached_config(grid, block, shared_mem, cluster, cooperative, pdl)
        fast = self._fast
        if fast is not None and len(args) == len(fast):
            made = _launch_fast(self, fast, args, config)
            if made is not None:
                return made
        return self._launch_checked(args, config)

    def _launch_checked(self, args: tuple[object, ...], config: LaunchConfig) -> KernelLaunch:
        """The reference path: checks every argument with a precise error."""
        if len(args) != len(self.params):
            raise KernelArgumentError(
                f"{self.name}: expected {len(self.params)} arguments "
                f"({', '.join(_param_label(i, p) for i, p in enumerate(self.params))}), "
                f"got {len(args)}"
            )
        raws: list[bytes] = []
        views: list[ArgView] = []
        accesses: list[tuple[DeviceArray, Access]] = []
        outputs: list[DeviceArray] = []
        for i, (param, value) in enumerate(zip(self.params, args, strict=True)):
            label = f"{self.name}: {_param_label(i, param)}"
            if isinstance(param, Scalar):
                scalar = _convert_scalar(label, param.dtype, value)
                raws.append(_scalar_bytes(param.dtype, scalar))
                views.append(ArgView("scalar", dtype=param.dtype, value=scalar))
                continue
            access = param.access
            assert access is not None
            arr = _check_array(label, param, value, access)
            accesses.append((arr, access))
            if access is Access.WRITE:
                outputs.append(arr)
            raws.append(_POINTER.type(arr.ptr).tobytes())
            if isinstance(param, Slice):
                length = arr.size
                info = np.iinfo(param.len_dtype)
                if length > info.max:
                    raise KernelArgumentError(f"{label}: length {length} does not fit {param.len_dtype.name}")
                raws.append(np.asarray(length, dtype=param.len_dtype).tobytes())
                views.append(
                    ArgView(
                        "slice",
                        arr.ptr,
                        arr.shape,
                        arr.dtype,
                        length=length,
                        access=access,
                        len_dtype=param.len_dtype,
                        order=arr.order,
                    )
                )
            else:
                views.append(ArgView("array", arr.ptr, arr.shape, arr.dtype, access=access, order=arr.order))
        prepared = PreparedLaunch(self, config, self._plan, _pack(self._plan, raws), tuple(views))
        return KernelLaunch._create(prepared, _merge_accesses(accesses), outputs)

    def builder(self) -> LaunchBuilder:
        """An inert, unchecked launch builder; see :class:`LaunchBuilder`."""
        return LaunchBuilder._create(self)


# --------------------------------------------------------------------------- fast path

_LIVE = AllocState.LIVE


def _launch_fast(
    kernel: Kernel, table: tuple[tuple[Any, ...], ...], args: tuple[object, ...], config: LaunchConfig
) -> KernelLaunch | None:
    """Validate and pack the common case; None sends the caller to the
    checked path, which raises the precise error (or handles the rest)."""
    flat: list[object] = []
    accesses: list[tuple[DeviceArray, Access]] = []
    outputs: list[DeviceArray] = []
    write = Access.WRITE
    for (kind, dt, lo, hi, access), v in zip(table, args):
        t = type(v)
        if kind in (_K_ARRAY, _K_SLICE):
            if t is not DeviceArray:
                return None
            arr: DeviceArray = v  # type: ignore[assignment]
            if arr._closed or arr._alloc.state is not _LIVE or not (arr._dtype is dt or arr._dtype == dt):
                return None
            if access is write:
                if arr._readonly:
                    return None
                outputs.append(arr)
            accesses.append((arr, access))
            flat.append(arr._alloc.ptr + arr._offset)
            if kind == _K_SLICE:
                n = arr.size
                if n > hi:
                    return None
                flat.append(n)
        elif kind == _K_INT:
            if t is int:
                if not lo <= v <= hi:
                    return None
            elif t is not dt:
                return None
            flat.append(v)
        elif kind == _K_FLOAT:
            if t is not float and t is not dt and t is not int:
                return None
            flat.append(v)
        else:
            if t is not bool and t is not dt:
                return None
            flat.append(v)
    st = kernel._struct
    assert st is not None
    try:
        arena = st.pack(*flat)
    except (struct.error, OverflowError):
        return None
    prepared = PreparedLaunch(kernel, config, kernel._plan, arena, None, args)
    n = len(accesses)
    if n > 1 and (
        accesses[0][0]._alloc is accesses[1][0]._alloc
        if n == 2
        else len({id(a._alloc) for a, _ in accesses}) < n
    ):
        merged = _merge_accesses(accesses)
    else:
        merged = tuple(accesses)
    return KernelLaunch._create(prepared, merged, outputs)
