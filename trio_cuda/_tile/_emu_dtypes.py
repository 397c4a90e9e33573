"""cuTile's dtypes in the NumPy emulation: their NumPy storage and cuTile's
implicit promotion.

Invariants: ``tfloat32`` is stored as float32 and every value computed in it
goes through :func:`_round_tf32`; bfloat16 and the float8 dtypes are stored
as ``ml_dtypes``' types; :meth:`_Dtypes.promote` follows cuTile (restricted
floats, float16 with bfloat16 and mixed signedness refuse). ``cuda.tile`` is
imported on the first call of :func:`_dt` (never at import), and the table is
built once, under a lock.
"""

from __future__ import annotations

import threading
from typing import Any, final

import numpy as np

from ._emu_errors import TileEmulationError, TileNotEmulatedError


def _ct() -> Any:
    import cuda.tile as ct

    return ct


@final
class _Dtypes:
    """The cuTile dtypes and their NumPy storage (tf32 is stored as float32)."""

    def __init__(self) -> None:
        ct = _ct()
        self.ct = ct
        names = ["bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
        names += ["float16", "float32", "float64"]
        self.to_np: dict[Any, np.dtype[Any]] = {getattr(ct, n): np.dtype(n) for n in names}
        self.to_np[ct.tfloat32] = np.dtype(np.float32)
        self.from_np: dict[np.dtype[Any], Any] = {np.dtype(n): getattr(ct, n) for n in names}
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - ml_dtypes comes with the development extra
            pass
        else:
            for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
                self.to_np[getattr(ct, n)] = np.dtype(getattr(ml_dtypes, n))
                self.from_np[np.dtype(getattr(ml_dtypes, n))] = getattr(ct, n)
        ints = [ct.int8, ct.int16, ct.int32, ct.int64]
        uints = [ct.uint8, ct.uint16, ct.uint32, ct.uint64]
        self.signed = {d: i for i, d in enumerate(ints)}
        self.unsigned = {d: i for i, d in enumerate(uints)}
        self.floats = {ct.float16: 0, ct.bfloat16: 0, ct.float32: 1, ct.float64: 2}
        self.restricted = {ct.tfloat32, ct.float8_e4m3fn, ct.float8_e5m2}

    def np_of(self, dtype: Any) -> np.dtype[Any]:
        try:
            return self.to_np[dtype]
        except (KeyError, TypeError):
            if isinstance(dtype, (np.dtype | type, str)):
                return np.dtype(dtype)
            raise TileNotEmulatedError(f"{dtype} (dtype)") from None

    def ct_of(self, dtype: np.dtype[Any]) -> Any:
        try:
            return self.from_np[np.dtype(dtype)]
        except KeyError:
            raise TileEmulationError(f"arrays of NumPy dtype {dtype} have no cuTile dtype") from None

    def as_ct(self, dtype: Any) -> Any:
        """A dtype given by a kernel (cuTile's, or a NumPy one) as cuTile's."""
        if isinstance(dtype, self.ct.DType):
            return dtype
        return self.ct_of(np.dtype(dtype))

    def is_float(self, d: Any) -> bool:
        return d in self.floats or d in self.restricted

    def is_int(self, d: Any) -> bool:
        return d in self.signed or d in self.unsigned

    def promote(self, a: Any, b: Any) -> Any:
        """cuTile's implicit promotion of two typed dtypes."""
        ct = self.ct
        if a == b:
            return a
        if a in self.restricted or b in self.restricted:
            raise TileEmulationError(
                f"implicit promotion of {a} and {b} involves a restricted float dtype; cast explicitly"
            )
        if a == ct.bool_:
            return b
        if b == ct.bool_:
            return a
        af, bf = a in self.floats, b in self.floats
        if af and bf:
            if {a, b} == {ct.float16, ct.bfloat16}:
                raise TileEmulationError("implicit promotion of float16 and bfloat16; cast explicitly")
            return a if self.floats[a] >= self.floats[b] else b
        if af:
            return a
        if bf:
            return b
        for kind in (self.signed, self.unsigned):
            if a in kind and b in kind:
                return a if kind[a] >= kind[b] else b
        raise TileEmulationError(f"implicit promotion of {a} and {b} (mixed signedness); cast explicitly")


_dtypes_lock = threading.Lock()
_dtypes_cache: list[_Dtypes] = []


def _dt() -> _Dtypes:
    if not _dtypes_cache:
        with _dtypes_lock:
            if not _dtypes_cache:
                _dtypes_cache.append(_Dtypes())
    return _dtypes_cache[0]


def _round_tf32(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float32 values rounded (to nearest even) to tf32's 10 mantissa bits."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    finite = np.isfinite(a)
    rounded = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return np.where(finite, rounded, bits).astype(np.uint32).view(np.float32)
