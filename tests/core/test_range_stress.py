"""Randomized stress test of byte-range leases (rule 11) against an independent oracle.

Seeded random programs (``random.Random(seed)``) run on the simulator. Each
program opens one scope with 2 to 6 streams, makes a few allocations (1-D and
2-D, C and F order, dtypes of 1, 2, 4 and 8 bytes) and takes random views of
them: slices with positive and negative bounds and steps, integer indices,
``None``, ``...``, row blocks and column blocks, views of views, ``reshape``
(in the array's own order, in C and in F order), ``ravel``, ``.T``,
``.view(dtype)`` and ``as_readonly()``. A view that trio_cuda refuses (any
view that would not be C- or F-contiguous: steps, column blocks of C arrays,
row blocks of F arrays, a dtype of another item size...) is counted and the
program moves on.

**The oracle never uses trio_cuda's extent code.** Every allocation has a
NumPy mirror of the same shape, dtype and order, and every view operation is
applied to the mirror too. The bytes a view touches are computed from the
mirror view alone (its data address relative to the mirror's buffer, its shape
and strides) as an exact byte set (a Python int used as a bit set). Each view
is checked against its mirror: same shape and dtype, same byte offset, same
strides, the same byte set from the device view's public layout, and that byte
set is the single range ``[offset, offset + nbytes)``. Indexing must refuse a
view exactly when the NumPy view is neither C- nor F-contiguous.

Submissions (fills, host-to-device and device-to-host copies, device-to-device
copies, kernels with ``In``/``Out``/``InOut`` arrays on NumPy ``reference=``
functions, among them one with two reads and two writes of views of mostly one
allocation, so that one submission's lease covers several ranges, and
``trio_cuda.zip`` of several of them) go to random streams while the device
is held, so they stay in flight. Before each one the oracle compares every access of the submission
with every access of every accepted in-flight submission (one *uniqueness
check* per pair): they conflict iff the streams differ, the byte sets
intersect and at least one of them writes. Under ``conflicts="error"``:

* a submission the oracle finds conflicting must raise
  ``AccessConflictError`` with nothing enqueued (else: a *false negative*),
  and the error must name an in-flight lease the oracle knows, on the stream
  and bytes it says;
* a refusal the oracle does not explain is a *false positive*. Every view is
  contiguous, so every extent is exact and false positives must be zero.

The device is stepped (``complete_next``) or released now and then; work is in
flight for the oracle until its future is done (``wait_nowait`` observes the
completions). Every read (device-to-host copy, kernel read) is checked against
the mirror, and device memory against the mirrors after each full release.

*Partition attempts* split an allocation that no in-flight work uses into
random pieces (cut points, row or column blocks, nested splits, casts,
transposes), sometimes deliberately aliased (a piece grown into its neighbour,
a piece straddling a cut, a duplicate through another view, the whole array),
and write each piece on a different stream (now and then two pieces in one
kernel launch), followed at times by accesses to random ranges across the
pieces, often on the pieces' streams (writes there cover earlier leases).
Disjoint partitions must be accepted in full; aliased ones are refused exactly
where the oracle says.

A smaller part runs the same programs under the default ``conflicts="order"``
on a timed, free-running simulator, and checks in ``sim.trace`` that for every
conflicting pair the later work started no earlier than the earlier one ended,
while some disjoint pairs on different streams ran at the same time.

After every scope: ``sim.violations == []`` and the scope's statistics show
nothing in flight, leased, retained, quarantined, failed or live.

The slow variant is skipped unless selected with ``-m slow`` or one of the
environment variables below; it prints what it did::

    pytest -m slow tests/core/test_range_stress.py -s
    TRIO_CUDA_RANGE_STRESS_CHECKS=5000000 TRIO_CUDA_RANGE_STRESS_PARTITIONS=300000 \\
        TRIO_CUDA_RANGE_STRESS_FIRST=7 pytest tests/core/test_range_stress.py -k slow -s
"""

from __future__ import annotations

import bisect
import functools
import itertools
import os
import random
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio

import trio_cuda
from tests.helpers.kernels import stub_source
from trio_cuda import AccessConflictError, In, InOut, KernelArgumentError, Out, Scalar, ops
from trio_cuda._core import _leases
from trio_cuda.testing import SimDevice

# --------------------------------------------------------------------------- kernels

ITEM_DTYPES = {
    1: tuple(np.dtype(n) for n in ("i1", "u1")),
    2: tuple(np.dtype(n) for n in ("i2", "u2", "f2")),
    4: tuple(np.dtype(n) for n in ("i4", "u4", "f4")),
    8: tuple(np.dtype(n) for n in ("i8", "u8", "f8")),
}
DTYPES = tuple(dt for group in ITEM_DTYPES.values() for dt in group)
WORK_KINDS = frozenset({"launch", "h2d", "d2h", "d2d", "fill"})
#: what each read kernel saw, by the token passed to it (set by the references)
_READS: dict[int, Any] = {}
_TOKENS = itertools.count(1)


def _write_ref(x, value):
    x[...] = value


def _read_ref(x, token):
    _READS[int(token)] = x.copy()


def _write2_ref(w1, w2, x):
    w1[...] = x
    w2[...] = x


def _multi_ref(r1, r2, w1, w2, x, y, token):
    _READS[int(token)] = (r1.copy(), r2.copy())
    w1[...] = x
    w2[...] = y


def _kernels(dt: np.dtype) -> dict[str, trio_cuda.Kernel]:
    n = dt.name
    return {
        "write": trio_cuda.Kernel.from_source(
            stub_source(f"write_{n}"), f"write_{n}", params=[Out(dt), Scalar(dt)], reference=_write_ref
        ),
        "update": trio_cuda.Kernel.from_source(
            stub_source(f"update_{n}"), f"update_{n}", params=[InOut(dt), Scalar(dt)], reference=_write_ref
        ),
        "read": trio_cuda.Kernel.from_source(
            stub_source(f"read_{n}"), f"read_{n}", params=[In(dt), Scalar("i8")], reference=_read_ref
        ),
        "write2": trio_cuda.Kernel.from_source(
            stub_source(f"write2_{n}"),
            f"write2_{n}",
            params=[Out(dt), Out(dt), Scalar(dt)],
            reference=_write2_ref,
        ),
        "multi": trio_cuda.Kernel.from_source(
            stub_source(f"multi_{n}"),
            f"multi_{n}",
            params=[In(dt), In(dt), Out(dt), InOut(dt), Scalar(dt), Scalar(dt), Scalar("i8")],
            reference=_multi_ref,
        ),
    }


KERNELS = {dt: _kernels(dt) for dt in DTYPES}

# --------------------------------------------------------------------------- the oracle's byte sets


def byte_set(offset: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, limit: int) -> int:
    """The exact set of bytes (a bit set) that a layout touches, relative to
    its buffer: the union, over every element, of its ``itemsize`` bytes.
    Asserts that they lie in ``[0, limit)``."""
    if 0 in shape:
        return 0
    mask = (1 << itemsize) - 1  # one element, at ``offset``
    for n, st in zip(shape, strides):
        if st < 0:  # element i at offset + i * st: shift the base to the last one
            offset += (n - 1) * st
            st = -st
        grown = mask
        for i in range(1, n):
            grown |= mask << (i * st)
        mask = grown
    assert offset >= 0, (offset, shape, strides)
    assert offset + mask.bit_length() <= limit, (offset, shape, strides, limit)
    return mask << offset


def ranges(mask: int) -> list[tuple[int, int]]:
    """A bit set as sorted half-open byte ranges (for messages)."""
    out: list[tuple[int, int]] = []
    i = 0
    while mask:
        if mask & 1:
            lo = i
            while mask & 1:
                mask >>= 1
                i += 1
            out.append((lo, i))
        else:
            low = (mask & -mask).bit_length() - 1
            mask >>= low
            i += low
    return out


def mask_of_ranges(pairs: list[tuple[int, int]]) -> int:
    m = 0
    for lo, hi in pairs:
        m |= ((1 << (hi - lo)) - 1) << lo
    return m


class Alloc:
    """One allocation and its NumPy mirror (expected contents, same layout)."""

    __slots__ = ("addr", "dev", "host", "index", "nbytes", "raw")

    def __init__(self, index: int, dev: trio_cuda.DeviceArray, shape, dtype, order) -> None:
        self.index = index
        self.dev = dev
        self.nbytes = dev.nbytes
        self.raw = np.zeros(max(self.nbytes, 1), dtype=np.uint8)
        self.host = np.ndarray(shape, dtype=dtype, buffer=self.raw, order=order)
        self.addr = self.raw.__array_interface__["data"][0]


class View:
    """A device view and its mirror view, with the oracle's byte set."""

    __slots__ = ("alloc", "dev", "mask", "np", "path", "readonly")

    def __init__(self, alloc: Alloc, dev, npv: np.ndarray, mask: int, readonly: bool, path: str) -> None:
        self.alloc = alloc
        self.dev = dev
        self.np = npv
        self.mask = mask
        self.readonly = readonly
        self.path = path


class Counts:
    """What the programs did."""

    FIELDS = (
        "programs",
        "order_programs",
        "allocations",
        "views_accepted",
        "views_refused_strided",
        "views_refused_by_numpy_too",
        "views_refused_unsupported",
        "empty_views",
        "readonly_write_refusals",
        "d2d_overlap_refusals",
        "submissions",
        "zips",
        "zips_not_submitted",
        "accepted",
        "refused",
        "uniqueness_checks",
        "conflicting_pairs",
        "false_positives",
        "false_negatives",
        "partition_attempts",
        "partition_pieces",
        "partition_disjoint",
        "partition_disjoint_accepted_in_full",
        "partition_aliased",
        "partition_aliased_with_refusals",
        "partition_refused_strided_splits",
        "partition_follow_ups",
        "partial_releases",
        "full_releases",
        "reads_checked",
        "memory_checks",
        "order_submissions",
        "order_conflicting_pairs",
        "order_cross_stream_conflicting_pairs",
        "order_disjoint_cross_stream_pairs",
        "order_disjoint_pairs_overlapping_in_time",
    )

    def __init__(self) -> None:
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.mismatches: list[str] = []

    def summary(self) -> str:
        return "\n".join(f"  {f:<42} {getattr(self, f):>12,}" for f in self.FIELDS)


STEPS = (None, None, None, None, None, 1, 2, 3, -1, -2)


class Refused(Exception):
    """trio_cuda refused a view (counted)."""


# --------------------------------------------------------------------------- one program


class Program:
    """One scope's random program and its oracle."""

    def __init__(self, seed: int, gpu, sim: SimDevice, counts: Counts, mode: str) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.gpu = gpu
        self.sim = sim
        self.c = counts
        self.mode = mode
        self.streams = gpu.streams
        self.allocs: list[Alloc] = []
        self.pool: list[View] = []
        #: accepted submissions in flight: (stream, accesses, future, check)
        self.inflight: list[tuple[int, list[tuple[Alloc, int, bool]], Any, Any]] = []
        #: every accepted access in flight: (stream, alloc, bytes, write)
        self.flat: list[tuple[int, Alloc, int, bool]] = []
        #: order mode: (stream, accesses, t_before, t_after, future, check, kind)
        self.log: list[tuple[int, list[tuple[Alloc, int, bool]], float, float, Any, Any, str]] = []
        self.step = 0
        _READS.clear()  # nothing left over from a program that failed

    # ------------------------------------------------------------------ setup
    async def setup(self, n_allocs: int) -> None:
        rng = self.rng
        for i in range(n_allocs):
            dt = rng.choice(DTYPES)
            order = rng.choice("CF")
            if rng.random() < 0.35:
                shape: tuple[int, ...] = (rng.randint(1, 48),)
            else:
                shape = (rng.randint(1, 10), rng.randint(1, 10))
            dev = self.gpu.zeros(shape, dt, order=order, stream=rng.choice(self.streams))
            self.allocs.append(Alloc(i, dev, shape, dt, order))
            self.c.allocations += 1
        for s in self.streams:
            await self.gpu.run(ops.value(None), stream=s)
        st = self.gpu.statistics()
        assert (st.in_flight, st.leases_held) == (0, 0), st

    # ------------------------------------------------------------------ views
    def base(self, a: Alloc) -> View:
        return View(a, a.dev, a.host, (1 << a.nbytes) - 1 if a.nbytes else 0, False, f"a{a.index}")

    def attempt(
        self,
        v: View,
        kind: str,
        label: str,
        dev_fn: Callable[[Any], Any],
        np_fn: Callable[[Any], Any],
        readonly: bool = False,
    ) -> View:
        """Apply one view operation to the device view and to its mirror, and
        check that they agree; raise Refused if trio_cuda refused it."""
        path = f"{v.path}{label}"
        try:
            npv = np_fn(v.np)
        except (ValueError, TypeError, IndexError):
            npv = None
        try:
            dv = dev_fn(v.dev)
        except (ValueError, TypeError, IndexError) as exc:
            if npv is None:
                self.c.views_refused_by_numpy_too += 1
            elif not (npv.flags.c_contiguous or npv.flags.f_contiguous):
                self.c.views_refused_strided += 1
            elif kind == "index":
                raise AssertionError(
                    f"seed {self.seed}: {path}: a contiguous view was refused ({exc}); NumPy gives "
                    f"shape {npv.shape} strides {npv.strides}"
                ) from exc
            else:
                self.c.views_refused_unsupported += 1  # e.g. another item size, reshape in the other order
            raise Refused(path) from None
        assert npv is not None, f"seed {self.seed}: {path}: trio_cuda made a view NumPy cannot ({dv!r})"
        return self.check_view(v, dv, npv, path, readonly or v.readonly)

    def check_view(self, parent: View, dv, npv: np.ndarray, path: str, readonly: bool) -> View:
        a = parent.alloc
        where = f"seed {self.seed}: {path}"
        assert dv.shape == npv.shape, (where, dv.shape, npv.shape)
        assert dv.dtype == npv.dtype, (where, dv.dtype, npv.dtype)
        assert dv.readonly == readonly, where
        np_off = npv.__array_interface__["data"][0] - a.addr
        dev_off = dv.ptr - a.dev.ptr
        size = npv.size
        if size:
            assert np.may_share_memory(npv, a.raw), where
            assert dev_off == np_off, (where, dev_off, np_off)
        else:
            self.c.empty_views += 1
        assert dv.c_contiguous == bool(npv.flags.c_contiguous), (where, dv.order, npv.flags)
        assert dv.f_contiguous == bool(npv.flags.f_contiguous), (where, dv.order, npv.flags)
        for n, ds, ns in zip(npv.shape, dv.strides, npv.strides):
            assert n <= 1 or not size or ds == ns, (where, dv.strides, npv.strides)
        mask = byte_set(np_off, npv.shape, npv.strides, npv.itemsize, a.nbytes)
        if size:
            dev_mask = byte_set(dev_off, dv.shape, dv.strides, dv.itemsize, a.nbytes)
            assert dev_mask == mask, (where, ranges(dev_mask), ranges(mask))
            # contiguous: exactly one range, of the view's size
            assert mask == ((1 << dv.nbytes) - 1) << np_off, (where, ranges(mask), dv.nbytes)
        self.c.views_accepted += 1
        return View(a, dv, npv, mask, readonly, path)

    def index(self, v: View, key: object) -> View:
        items = key if isinstance(key, tuple) else (key,)
        np_key = items if any(k is Ellipsis for k in items) else (*items, Ellipsis)
        return self.attempt(v, "index", f"[{_key_text(key)}]", lambda d: d[key], lambda n: n[np_key])

    def ravel(self, v: View) -> View:
        return self.attempt(v, "ravel", ".ravel()", lambda d: d.ravel(), _np_ravel)

    def transpose(self, v: View) -> View:
        return self.attempt(v, "T", ".T", lambda d: d.T, lambda n: n.T)

    def cast(self, v: View, dt: np.dtype) -> View:
        return self.attempt(v, "view", f".view({dt.name})", lambda d: d.view(dt), lambda n: n.view(dt))

    def reshape(self, v: View, new: tuple[int, ...], order: str = "A", spelling: int = 0) -> View:
        """``reshape`` in ``order``; ``spelling`` 1 and 2 pass the shape as
        separate ints or as a tuple with the default order."""
        if spelling == 1:
            dev_fn: Callable[[Any], Any] = lambda d: d.reshape(*new)  # noqa: E731
        elif spelling == 2:
            dev_fn = lambda d: d.reshape(new)  # noqa: E731
        else:
            dev_fn = lambda d: d.reshape(new, order=order)  # noqa: E731
        return self.attempt(
            v,
            "reshape",
            f".reshape({new}, {order})",
            dev_fn,
            lambda n: n.reshape(new, order=order, copy=False),
        )

    def derive(self, v: View) -> View:
        """One random view operation on ``v`` (may raise Refused)."""
        rng = self.rng
        r = rng.random()
        shape = v.np.shape
        if r < 0.40:
            return self.index(v, _rand_key(rng, shape))
        if r < 0.50 and len(shape) == 2:  # a row block or a column block
            axis = rng.randrange(2)
            lo = rng.randrange(shape[axis] or 1)
            hi = rng.randint(lo + 1, max(shape[axis], lo + 1))
            s = _signed_slice(rng, lo, hi, shape[axis])
            if axis == 0:
                key: object = s if rng.random() < 0.5 else (s, slice(None))
            else:
                key = (slice(None), s) if rng.random() < 0.5 else (Ellipsis, s)
            return self.index(v, key)
        if r < 0.65:
            order = rng.choice(("A", "A", "C", "F"))
            return self.reshape(
                v, _rand_shape(rng, v.np.size), order, rng.randrange(3) if order == "A" else 0
            )
        if r < 0.73:
            return self.transpose(v)
        if r < 0.85:  # mostly the same item size; another one is refused
            return self.cast(v, rng.choice(ITEM_DTYPES[v.np.itemsize] if rng.random() < 0.85 else DTYPES))
        if r < 0.95:
            return self.ravel(v)
        return self.attempt(v, "readonly", ".as_readonly()", lambda d: d.as_readonly(), lambda n: n, True)

    def random_view(self) -> View:
        rng = self.rng
        if self.pool and rng.random() < 0.3:
            return rng.choice(self.pool)
        v = rng.choice(self.pool) if self.pool and rng.random() < 0.3 else self.base(rng.choice(self.allocs))
        for _ in range(rng.randint(1, 4)):
            for _try in range(4):
                try:
                    v = self.derive(v)
                    break
                except Refused:
                    pass
            if not v.np.size and rng.random() < 0.7:  # an empty view touches nothing: start again
                v = self.base(rng.choice(self.allocs))
        if len(self.pool) < 48:
            self.pool.append(v)
        else:
            self.pool[rng.randrange(48)] = v
        return v

    def matching_view(self, v: View) -> View | None:
        """Another view of the same shape, dtype and order (any allocation,
        the same one included), for device-to-device copies."""
        rng = self.rng
        key = (v.np.shape, v.np.dtype, v.dev.order)
        pool = [p for p in self.pool if p is not v and (p.np.shape, p.np.dtype, p.dev.order) == key]
        if pool and rng.random() < 0.5:
            return rng.choice(pool)
        size, dt = v.np.size, v.np.dtype
        cands = [a for a in self.allocs if a.host.itemsize == dt.itemsize and a.host.size >= size]
        if not cands:
            return None
        a = rng.choice(cands)
        try:
            w = self.ravel(self.base(a))
            if w.np.dtype != dt:
                w = self.cast(w, dt)
            lo = rng.randint(0, a.host.size - size)
            w = self.index(w, _signed_slice(rng, lo, lo + size, a.host.size))
            return self.reshape(w, v.np.shape, v.dev.order)
        except Refused:
            return None

    # ------------------------------------------------------------------ accesses
    def next_token(self) -> int:
        return next(_TOKENS)

    def host_like(self, npv: np.ndarray) -> np.ndarray:
        """A host array of ``npv``'s shape and dtype in a random layout."""
        rng = self.rng
        r = rng.random()
        if r < 0.5 or npv.ndim == 0:
            return np.empty(npv.shape, npv.dtype)
        if r < 0.75:
            return np.empty(npv.shape, npv.dtype, order="F")
        big = np.empty((*npv.shape[:-1], 2 * npv.shape[-1] + 1), npv.dtype)
        return big[..., 1::2]

    def value(self, dt: np.dtype) -> Any:
        return dt.type(self.rng.randint(0, 99))

    def build_write(self, v: View, how: str):
        """(op, effect) for a write of ``v``; effect applies it to the mirror."""
        dt = v.np.dtype
        if how == "fill":
            x = self.value(dt)
            return ops.fill(v.dev, x), lambda: v.np.__setitem__(Ellipsis, x), "fill"
        if how == "h2d":
            data = np.frombuffer(self.rng.randbytes(v.np.nbytes), dtype=dt).reshape(v.np.shape)
            host = self.host_like(v.np)
            host[...] = data
            return ops.copy(v.dev, host), lambda: v.np.__setitem__(Ellipsis, data), "h2d"
        x = self.value(dt)
        k = KERNELS[dt][how]
        return k.launch(v.dev, x, grid=1, block=1), lambda: v.np.__setitem__(Ellipsis, x), "launch"

    def random_access(self):
        """A random submission: (op, accesses, effect, kind) or None. The
        effect applies the op to the mirrors when it is accepted, and returns
        the check of what it reads (called once it completed), or None."""
        rng = self.rng
        r = rng.random()
        if r < 0.70:
            return self.simple_access(self.random_view())
        if r < 0.85:
            return self.multi_access()
        v = self.random_view()
        w = self.matching_view(v)
        if w is None:
            return None
        if w.readonly:
            self.readonly_write(w, "d2d")
            return None
        overlap = w.alloc is v.alloc and bool(w.mask & v.mask) and w.dev.ptr != v.dev.ptr
        if overlap:  # refused before anything is built: partly overlapping views
            with pytest.raises(ValueError, match="overlap"):
                ops.copy(w.dev, v.dev)
            self.c.d2d_overlap_refusals += 1
            return None
        op = ops.copy(w.dev, v.dev)  # a device-to-device copy of v into w

        def d2d(v=v, w=w):
            w.np[...] = v.np.copy()

        return op, [(v.alloc, v.mask, False), (w.alloc, w.mask, True)], d2d, "d2d"

    def simple_access(self, v: View):
        """One write or read of ``v``: (op, accesses, effect, kind) or None."""
        rng = self.rng
        r = rng.random()
        if r < 0.5:  # a write
            how = rng.choice(("fill", "fill", "h2d", "write", "update"))
            if v.readonly:
                self.readonly_write(v, how)
                return None
            op, effect, kind = self.build_write(v, how)
            return op, [(v.alloc, v.mask, True)], effect, kind
        if r < 0.75:  # a device-to-host copy
            out = self.host_like(v.np)

            def read_host(v=v, out=out):
                expected = v.np.copy()
                return lambda: self.check_read(out, expected, v)

            return ops.copy(out, v.dev), [(v.alloc, v.mask, False)], read_host, "d2h"
        token = self.next_token()  # a kernel that reads
        op = KERNELS[v.np.dtype]["read"].launch(v.dev, np.int64(token), grid=1, block=1)

        def read_kernel(v=v, token=token):
            expected = v.np.copy()
            return lambda: self.check_read(_READS.pop(token), expected, v)

        return op, [(v.alloc, v.mask, False)], read_kernel, "launch"

    def view_of_dtype(self, dt: np.dtype, a: Alloc | None) -> View | None:
        """A random view of ``a`` (or of an allocation of ``dt``'s item size) as ``dt``."""
        rng = self.rng
        if a is None:
            a = rng.choice([b for b in self.allocs if b.host.itemsize == dt.itemsize])
        v = self.base(a)
        try:
            for _ in range(rng.randint(0, 3)):
                try:
                    v = self.derive(v)
                except Refused:
                    pass
            return v if v.np.dtype == dt else self.cast(v, dt)
        except Refused:
            return None

    def multi_access(self):
        """A kernel that reads two views and writes two, all of one dtype and
        mostly of one allocation: its leases on an allocation cover several
        ranges (the union of its views' extents)."""
        rng = self.rng
        v = self.random_view()
        dt = v.np.dtype
        views = [v]
        for _ in range(3):
            w = self.view_of_dtype(dt, v.alloc if rng.random() < 0.7 else None)
            if w is None:
                return None
            views.append(w)
        rng.shuffle(views)
        r1, r2, w1, w2 = views
        x, y = self.value(dt), self.value(dt)
        token = self.next_token()
        if w1.readonly or w2.readonly:
            with pytest.raises(KernelArgumentError, match="read-only"):
                KERNELS[dt]["multi"].launch(
                    r1.dev, r2.dev, w1.dev, w2.dev, x, y, np.int64(token), grid=1, block=1
                )
            self.c.readonly_write_refusals += 1
            return None
        op = KERNELS[dt]["multi"].launch(
            r1.dev, r2.dev, w1.dev, w2.dev, x, y, np.int64(token), grid=1, block=1
        )

        def multi():
            expected = (r1.np.copy(), r2.np.copy())
            w1.np[...] = x
            w2.np[...] = y

            def check():
                got = _READS.pop(token)
                self.check_read(got[0], expected[0], r1)
                self.check_read(got[1], expected[1], r2)

            return check

        accesses = [(r1.alloc, r1.mask, False), (r2.alloc, r2.mask, False)]
        accesses += [(w1.alloc, w1.mask, True), (w2.alloc, w2.mask, True)]
        return op, accesses, multi, "launch"

    def zipped_access(self, stream: int) -> None:
        """Two or three simple accesses in one submission (``trio_cuda.zip``):
        one submission takes leases several times. A conflict in a later part
        would leave the earlier parts enqueued (a partial error, not what this
        test is about): such a zip is not submitted."""
        parts = [self.simple_access(self.random_view()) for _ in range(self.rng.randint(2, 3))]
        parts = [p for p in parts if p is not None]
        if len(parts) < 2:
            return
        for i, (_op, accesses, _effect, _kind) in enumerate(parts):
            if i and self.conflicts(stream, accesses):
                self.c.zips_not_submitted += 1
                return

        def effect():
            checks = [e() for _, _, e, _ in parts]
            checks = [c for c in checks if c is not None]
            return (lambda: [c() for c in checks]) if checks else None

        accesses = [a for p in parts for a in p[1]]
        self.c.zips += 1
        self.submit(trio_cuda.zip(*(p[0] for p in parts)), stream, accesses, effect, "zip")

    def readonly_write(self, v: View, how: str) -> None:
        """A write through a read-only view is refused before anything is built."""
        with pytest.raises((ValueError, KernelArgumentError)):
            if how in ("fill", "h2d", "write", "update"):
                self.build_write(v, how)
            else:
                ops.copy(v.dev, v.dev)
        self.c.readonly_write_refusals += 1

    def check_read(self, got: np.ndarray, expected: np.ndarray, v: View) -> None:
        assert got.shape == expected.shape, (self.seed, v.path)
        assert got.dtype == expected.dtype, (self.seed, v.path)
        assert got.tobytes() == expected.tobytes(), (
            f"seed {self.seed}: read of {v.path}: {got!r}, not {expected!r}"
        )
        self.c.reads_checked += 1

    # ------------------------------------------------------------------ submission and the oracle
    def conflicts(
        self, stream: int, accesses: list[tuple[Alloc, int, bool]]
    ) -> list[tuple[int, Alloc, int, bool]]:
        """The oracle: every in-flight access that conflicts with one of
        ``accesses`` on ``stream`` (another stream, a shared byte, a write)."""
        out = []
        for alloc, mask, write in accesses:
            for entry in self.flat:
                s2, a2, m2, w2 = entry
                if s2 != stream and a2 is alloc and (w2 or write) and m2 & mask:
                    out.append(entry)
        return out

    def submit(self, op, stream: int, accesses: list[tuple[Alloc, int, bool]], effect, kind: str) -> bool:
        """Submit ``op`` on stream ``stream``; compare the outcome with the oracle.
        Returns True if it was accepted."""
        c = self.c
        c.submissions += 1
        self.step += 1
        if self.mode == "order":
            t0 = time.perf_counter()
            fut = self.gpu.submit(op, stream=self.streams[stream])
            t1 = time.perf_counter()
            check = effect()
            c.order_submissions += 1
            self.log.append((stream, accesses, t0, t1, fut, check, kind))
            return True
        conflicts = self.conflicts(stream, accesses)
        c.uniqueness_checks += len(accesses) * len(self.flat)
        c.conflicting_pairs += len(conflicts)
        pending = self.sim.pending
        try:
            fut = self.gpu.submit(op, stream=self.streams[stream])
        except AccessConflictError as exc:
            c.refused += 1
            assert self.sim.pending == pending, f"seed {self.seed}: a refused submission enqueued work"
            if not conflicts:
                c.false_positives += 1
                self.mismatch("false positive", exc, stream, accesses)
            else:
                self.check_message(str(exc), stream, accesses)
            return False
        c.accepted += 1
        if conflicts:
            c.false_negatives += 1
            held = [(s2, a2.index, ranges(m2), "write" if w2 else "read") for s2, a2, m2, w2 in conflicts]
            self.mismatch("false negative", f"accepted despite in-flight {held}", stream, accesses)
        check = effect()
        self.inflight.append((stream, accesses, fut, check))
        for alloc, mask, write in accesses:
            self.flat.append((stream, alloc, mask, write))
        return True

    def mismatch(self, what: str, detail: object, stream: int, accesses) -> None:
        if len(self.c.mismatches) < 20:
            acc = [(a.index, ranges(m), "write" if w else "read") for a, m, w in accesses]
            self.c.mismatches.append(
                f"{what}: seed {self.seed} step {self.step}: stream {stream}, accesses {acc}: {detail}"
            )

    def check_message(self, text: str, stream: int, accesses) -> None:
        """The refusal names an in-flight lease that the oracle knows: on
        another stream, of the kind and bytes it says, overlapping one of the
        submission's accesses."""
        m = _CONFLICT_TEXT.search(text)
        assert m is not None, text
        other, kind, held, this = int(m[1]), m[2], _parse_ranges(m[3]), _parse_ranges(m[4])
        assert other != stream, text
        assert held & this, text
        assert any(mask == this for _, mask, _ in accesses), (text, [ranges(x[1]) for x in accesses])
        for s2, accs, _, _ in self.inflight:
            if s2 != other:
                continue
            for a in {x[0] for x in accs}:
                union = 0
                for a2, m2, w2 in accs:
                    if a2 is a and w2 == (kind == "write"):
                        union |= m2
                if union == held and any(
                    x[0] is a and x[1] & held and (x[2] or kind == "write") for x in accesses
                ):
                    return
        raise AssertionError(f"seed {self.seed}: the refusal names a lease the oracle does not know: {text}")

    # ------------------------------------------------------------------ releases
    def settle_some(self) -> None:
        """Step the held device a few commands; keep the oracle in step."""
        self.c.partial_releases += 1
        for _ in range(self.rng.randint(1, 2 * len(self.inflight) + 1)):
            if not self.sim.complete_next():
                break
        still = []
        for entry in self.inflight:
            fut = entry[2]
            if not fut.done():
                try:
                    fut.wait_nowait()
                except trio.WouldBlock:
                    pass
            if fut.done():
                if entry[3] is not None:
                    entry[3]()
            else:
                still.append(entry)
        self.inflight = still
        self.flat = [(s, a, m, w) for s, accs, _, _ in still for a, m, w in accs]

    async def settle_all(self) -> None:
        """Release the device, await everything, check memory, hold again."""
        self.c.full_releases += 1
        self.sim.release()
        for entry in self.inflight:
            await entry[2].wait()
            if entry[3] is not None:
                entry[3]()
        self.inflight = []
        self.flat = []
        st = self.gpu.statistics()
        assert (st.in_flight, st.leases_held, st.retained_bytes) == (0, 0, 0), (self.seed, st)
        self.check_memory()
        if self.pool:  # a read through to_host, with the device free-running
            v = self.rng.choice(self.pool)
            self.check_read(await self.gpu.to_host(v.dev), v.np.copy(), v)
        self.sim.hold()

    def check_memory(self) -> None:
        for a in self.allocs:
            if a.nbytes:
                got = self.sim.peek(a.dev.ptr, a.nbytes)
                assert got == a.raw.tobytes(), f"seed {self.seed}: a{a.index} differs from its mirror"
        self.c.memory_checks += 1

    # ------------------------------------------------------------------ partitions
    def split(self, v: View, k: int) -> list[View]:
        """``v`` cut into up to ``k`` disjoint pieces along one axis."""
        rng = self.rng
        if v.np.ndim > 2:
            v = self.ravel(v)
        shape = v.np.shape
        if not shape:
            return [v]
        axes = [rng.randrange(len(shape))]
        if len(shape) == 2:
            axes.append(1 - axes[0])
        for axis in axes:
            n = shape[axis]
            if n < 2:
                continue
            cuts = sorted(rng.sample(range(1, n), min(k, n) - 1))
            bounds = [0, *cuts, n]
            pieces = []
            try:
                for lo, hi in itertools.pairwise(bounds):
                    s = _signed_slice(rng, lo, hi, n)
                    if len(shape) == 1:
                        key: object = s
                    elif axis == 0:
                        key = s if rng.random() < 0.5 else (s, slice(None))
                    else:
                        key = (slice(None), s) if rng.random() < 0.5 else (Ellipsis, s)
                    pieces.append(self.index(v, key))
            except Refused:
                self.c.partition_refused_strided_splits += 1
                continue
            return pieces
        return [v]

    def cosmetic(self, v: View) -> View:
        """The same bytes through another view: a cast, a transpose, a reshape."""
        rng = self.rng
        r = rng.random()
        try:
            if r < 0.3:
                return self.cast(v, rng.choice(ITEM_DTYPES[v.np.itemsize]))
            if r < 0.5:
                return self.transpose(v)
            if r < 0.7:
                return self.ravel(v)
            return self.reshape(v, _rand_shape(rng, v.np.size))
        except Refused:
            return v

    def partition_pieces(self, a: Alloc) -> list[View]:
        rng = self.rng
        v = self.base(a)
        r = rng.random()
        try:
            if r < 0.2:
                v = self.ravel(v)
            elif r < 0.35:
                v = self.transpose(v)
            elif r < 0.5:
                new = _rand_shape(rng, a.host.size)[:2]
                v = self.reshape(v, (*new[:-1], -1) if rng.random() < 0.3 else new)
        except Refused:
            v = self.base(a)
        k = rng.randint(2, len(self.streams))
        top = self.split(v, k)
        pieces: list[View] = []
        for p in top:
            if rng.random() < 0.2 and p.np.size > 1:
                pieces.extend(self.cosmetic(q) if rng.random() < 0.3 else q for q in self.split(p, 2))
            else:
                pieces.append(self.cosmetic(p) if rng.random() < 0.3 else p)
        if rng.random() < 0.35:  # deliberately aliased
            r = rng.random()
            try:
                if r < 0.35 and len(pieces) > 1:  # a piece grown into its neighbour (or a straddling one)
                    flat = self.ravel(v)
                    n = flat.np.size
                    lo = rng.randrange(n)
                    hi = rng.randint(lo + 1, n)
                    pieces.append(self.index(flat, _signed_slice(rng, lo, hi, n)))
                elif r < 0.7:  # a duplicate through another view
                    pieces.append(self.cosmetic(rng.choice(pieces)))
                elif r < 0.85:  # the whole array
                    pieces.append(self.base(a))
                else:  # one element of a piece, through an integer index
                    p = rng.choice(pieces)
                    if p.np.ndim:
                        pieces.append(self.index(p, rng.randrange(-p.np.shape[0], p.np.shape[0] or 1)))
            except (Refused, ValueError):
                pass
        rng.shuffle(pieces)
        return pieces

    def idle_allocs(self) -> list[Alloc]:
        busy = {id(x[1]) for x in self.flat}
        return [a for a in self.allocs if id(a) not in busy]

    async def partition_attempt(self) -> None:
        rng = self.rng
        idle = self.idle_allocs()
        if not idle and self.mode == "error":
            self.settle_some()
            idle = self.idle_allocs()
            if not idle:
                await self.settle_all()
                idle = self.allocs
        a = rng.choice(idle or self.allocs)
        pieces = self.partition_pieces(a)
        c = self.c
        c.partition_attempts += 1
        c.partition_pieces += len(pieces)
        aliased = any(p.mask & q.mask for i, p in enumerate(pieces) for q in pieces[i + 1 :])
        order = list(range(len(self.streams)))
        rng.shuffle(order)
        refused = 0
        todo = list(pieces)
        used: list[int] = []
        while todo:
            p = todo.pop()
            stream = order[len(used) % len(order)]
            used.append(stream)
            q = todo.pop() if todo and rng.random() < 0.25 else None
            if q is not None:  # two pieces in one submission: a lease of several ranges
                if q.np.dtype != p.np.dtype:
                    q = self.cast(q, p.np.dtype)
                x = self.value(p.np.dtype)
                op = KERNELS[p.np.dtype]["write2"].launch(p.dev, q.dev, x, grid=1, block=1)

                def effect(p=p, q=q, x=x):
                    p.np[...] = x
                    q.np[...] = x

                accesses = [(a, p.mask, True), (a, q.mask, True)]
                ok = self.submit(op, stream, accesses, effect, "launch")
            else:
                op, effect, kind = self.build_write(p, rng.choice(("fill", "h2d", "write", "update")))
                ok = self.submit(op, stream, [(a, p.mask, True)], effect, kind)
            refused += not ok
        if rng.random() < 0.6:  # follow-ups: ranges across the pieces, often on their streams
            flat = self.ravel(self.base(a))
            n = flat.np.size
            for _ in range(rng.randint(1, 3)):
                lo = rng.randrange(n)
                v = self.index(flat, _signed_slice(rng, lo, rng.randint(lo + 1, n), n))
                made = self.simple_access(self.cosmetic(v) if rng.random() < 0.3 else v)
                if made is not None:
                    stream = rng.choice(used) if rng.random() < 0.6 else rng.randrange(len(self.streams))
                    self.submit(made[0], stream, made[1], made[2], made[3])
                    c.partition_follow_ups += 1
        if aliased:
            c.partition_aliased += 1
            c.partition_aliased_with_refusals += refused > 0
        else:
            c.partition_disjoint += 1
            c.partition_disjoint_accepted_in_full += refused == 0
            if self.mode == "error" and refused:
                self.mismatch("disjoint partition refused", [p.path for p in pieces], -1, [])


def _np_ravel(n: np.ndarray) -> np.ndarray:
    out = n.ravel(order="A")
    assert out.size == 0 or np.may_share_memory(out, n), "NumPy copied in ravel"
    return out


def _key_text(key: object) -> str:
    items = key if isinstance(key, tuple) else (key,)
    parts = []
    for k in items:
        if isinstance(k, slice):
            parts.append(
                ("" if k.start is None else str(k.start))
                + ":"
                + ("" if k.stop is None else str(k.stop))
                + ("" if k.step is None else f":{k.step}")
            )
        elif k is Ellipsis:
            parts.append("...")
        else:
            parts.append(repr(k))
    return ", ".join(parts) + ("," if isinstance(key, tuple) and len(items) == 1 else "")


def _bound(rng: random.Random, n: int) -> int | None:
    r = rng.random()
    if r < 0.15:
        return None
    i = rng.randint(0, n)
    if r < 0.5:
        return i - n - (rng.random() < 0.1)  # negative (sometimes out of range)
    return i + (rng.random() < 0.05)


def _signed_slice(rng: random.Random, lo: int, hi: int, n: int) -> slice:
    """``lo:hi`` on an axis of length ``n``, spelled with random signs."""
    start: int | None = lo
    stop: int | None = hi
    if lo == 0 and rng.random() < 0.4:
        start = None
    elif lo < n and rng.random() < 0.5:
        start = lo - n
    if hi == n and rng.random() < 0.4:
        stop = None
    elif 0 < hi < n and rng.random() < 0.5:
        stop = hi - n
    return slice(start, stop, 1 if rng.random() < 0.1 else None)


def _rand_key(rng: random.Random, shape: tuple[int, ...]) -> object:
    if not shape:
        return rng.choice(((), None, Ellipsis, (None, Ellipsis)))
    parts: list[object] = []
    for n in shape:
        r = rng.random()
        if r < 0.15 and n > 0:
            i = rng.randrange(n)
            parts.append(i - n if rng.random() < 0.5 else i)
        elif r < 0.25:
            parts.append(slice(None))
        elif r < 0.75 and n > 0:  # a non-empty slice, spelled with random signs and steps
            lo = rng.randrange(n)
            hi = rng.randint(lo + 1, n)
            step = rng.choice(STEPS)
            if step is not None and step < 0:  # hi - 1 down to lo
                start = hi - 1 - (n if rng.random() < 0.5 else 0)
                stop = None if lo == 0 else lo - 1 - (n if rng.random() < 0.5 else 0)
                parts.append(slice(start, stop, step))
            else:
                s = _signed_slice(rng, lo, hi, n)
                parts.append(slice(s.start, s.stop, step))
        else:
            parts.append(slice(_bound(rng, n), _bound(rng, n), rng.choice(STEPS)))
    r = rng.random()
    if r < 0.25 and len(parts) > 1:
        parts = parts[:1]
    elif r < 0.4 and len(parts) > 1:
        parts = [Ellipsis, *parts[1:]]
    elif r < 0.5:
        parts.insert(rng.randint(0, len(parts)), None)
    if len(parts) == 1 and rng.random() < 0.5:
        return parts[0]
    return tuple(parts)


def _rand_shape(rng: random.Random, size: int) -> tuple[int, ...]:
    if size == 0:
        return rng.choice(((0,), (0, 3), (2, 0), (-1,), (-1, 2)))
    dims: list[int] = []
    rest = size
    for _ in range(rng.randint(0, 2)):
        d = rng.choice([d for d in range(1, rest + 1) if rest % d == 0])
        dims.append(d)
        rest //= d
    dims.append(rest)
    rng.shuffle(dims)
    if rng.random() < 0.3:
        dims[rng.randrange(len(dims))] = -1
    return tuple(dims)


_CONFLICT_TEXT = re.compile(
    r"on stream (\d+) holds a (write|read) lease on bytes (\[.*?\)) of its allocation, "
    r"which overlaps this access \(bytes (\[.*?\))\)"
)


def _parse_ranges(text: str) -> int:
    return mask_of_ranges([(int(lo), int(hi)) for lo, hi in re.findall(r"\[(\d+), (\d+)\)", text)])


# --------------------------------------------------------------------------- drivers


def check_exit(gpu, sim: SimDevice, seed: int) -> None:
    """After the scope's exit: nothing leaked, nothing failed, memcheck clean,
    and every kernel read was checked."""
    assert not _READS, (seed, sorted(_READS)[:5])
    st = gpu.statistics()
    assert (st.in_flight, st.completed) == (0, st.submitted), (seed, st)
    assert (st.leases_held, st.quarantined_leases, st.retained_bytes) == (0, 0, 0), (seed, st)
    assert (st.quarantined, st.quarantined_bytes, st.failed) == (0, 0, 0), (seed, st)
    assert (st.live_allocations, st.live_bytes, st.pending_errors) == (0, 0, 0), (seed, st)
    assert (st.host_closures_pending, st.foreign_leases) == (0, 0), (seed, st)
    assert sim.violations == [], (seed, sim.violations)
    assert sim.live_allocations == [], (seed, sim.live_allocations)


async def error_program(seed: int, counts: Counts, *, accesses: int, partitions: int) -> None:
    """One scope under ``conflicts="error"`` on a held device."""
    rng = random.Random(seed ^ 0x5EED)
    sim = SimDevice(trace_limit=0)
    counts.programs += 1
    async with trio_cuda.open_scope(device=sim, streams=rng.randint(2, 6), conflicts="error") as gpu:
        prog = Program(seed, gpu, sim, counts, "error")
        await prog.setup(rng.randint(2, 6))
        cap = rng.randint(6, 60)
        sim.hold()
        try:
            todo_a, todo_p = accesses, partitions
            while todo_a or todo_p:
                if todo_p and (not todo_a or rng.random() < todo_p / (todo_a + todo_p)):
                    todo_p -= 1
                    await prog.partition_attempt()
                elif rng.random() < 0.1:
                    todo_a -= 1
                    prog.zipped_access(rng.randrange(len(gpu.streams)))
                else:
                    todo_a -= 1
                    made = prog.random_access()
                    if made is not None:
                        op, accs, effect, kind = made
                        prog.submit(op, rng.randrange(len(gpu.streams)), accs, effect, kind)
                r = rng.random()
                if len(prog.flat) > cap or r < 0.02:
                    if rng.random() < 0.8:
                        prog.settle_some()
                    else:
                        await prog.settle_all()
                elif r < 0.05:
                    await trio.lowlevel.checkpoint()  # the handoff task may run: nothing completes while held
            await prog.settle_all()
        finally:
            sim.release()
    check_exit(gpu, sim, seed)


async def order_program(seed: int, counts: Counts, *, accesses: int, partitions: int) -> None:
    """One scope under ``conflicts="order"`` on a timed, free-running device:
    every conflicting pair runs in submission order, disjoint work overlaps."""
    rng = random.Random(seed ^ 0x0DE5)
    duration = rng.choice((0.001, 0.002, 0.003))
    sim = SimDevice(kernel_time=duration, copy_time=duration, trace_limit=None)
    counts.order_programs += 1
    async with trio_cuda.open_scope(device=sim, streams=rng.randint(2, 5)) as gpu:
        prog = Program(seed, gpu, sim, counts, "order")
        await prog.setup(rng.randint(2, 5))
        sim.clear_trace()
        todo_a, todo_p = accesses, partitions
        while todo_a or todo_p:
            if todo_p and (not todo_a or rng.random() < todo_p / (todo_a + todo_p)):
                todo_p -= 1
                await prog.partition_attempt()
            else:
                todo_a -= 1
                made = prog.random_access()
                if made is not None:
                    op, accs, effect, kind = made
                    prog.submit(op, rng.randrange(len(gpu.streams)), accs, effect, kind)
            if rng.random() < 0.05:
                await trio.lowlevel.checkpoint()
        for _s, _accs, _t0, _t1, fut, check, _kind in prog.log:
            await fut.wait()
            if check is not None:
                check()
        prog.check_memory()
        trace = [e for e in sim.trace if e.kind in WORK_KINDS]
    check_exit(gpu, sim, seed)
    check_order(prog, trace, counts)


def check_order(prog: Program, trace, counts: Counts) -> None:
    """Match each submission with its one work command (by enqueue time),
    then check every pair."""
    log = prog.log
    events: list[Any] = [None] * len(log)
    starts = [entry[2] for entry in log]
    for e in trace:
        i = bisect.bisect_right(starts, e.t_enqueue) - 1
        assert i >= 0, (prog.seed, e)
        assert log[i][2] <= e.t_enqueue <= log[i][3], (prog.seed, e)
        assert events[i] is None, (prog.seed, "two work commands for one submission", e, events[i])
        events[i] = e
    for i, (s, accs, _t0, _t1, _f, _c, kind) in enumerate(log):
        e = events[i]
        if e is None:  # only work on no bytes may enqueue nothing
            assert not any(m for _, m, _ in accs), (prog.seed, i, kind)
            continue
        assert (e.stream, e.kind) == (s, kind), (prog.seed, i, e, s, kind)
    tol = 1e-9
    for j in range(len(log)):
        sj, accj = log[j][0], log[j][1]
        ej = events[j]
        if ej is None:
            continue
        for i in range(j):
            si, acci = log[i][0], log[i][1]
            ei = events[i]
            if ei is None:
                continue
            conflict = any(a is b and (w or x) and m & n for a, m, w in acci for b, n, x in accj)
            if conflict:
                counts.order_conflicting_pairs += 1
                counts.order_cross_stream_conflicting_pairs += si != sj
                assert ej.t_start >= ei.t_end - tol, (
                    f"seed {prog.seed}: submission {j} (stream {sj}, {ej.label}) started at {ej.t_start} "
                    f"before conflicting submission {i} (stream {si}, {ei.label}) ended at {ei.t_end}"
                )
            elif si != sj:
                counts.order_disjoint_cross_stream_pairs += 1
                if ej.t_start < ei.t_end - tol and ei.t_start < ej.t_end - tol:
                    counts.order_disjoint_pairs_overlapping_in_time += 1


async def run_programs(
    counts: Counts,
    *,
    first: int,
    checks: int,
    partitions: int,
    accesses_per_program: int,
    partitions_per_program: int,
    order_programs: int,
    max_programs: int,
) -> None:
    seed = first
    while counts.uniqueness_checks < checks or counts.partition_attempts < partitions:
        assert counts.programs < max_programs, "the programs make too few checks"
        await error_program(seed, counts, accesses=accesses_per_program, partitions=partitions_per_program)
        seed += 1
    for k in range(order_programs):
        await order_program(first + k, counts, accesses=24, partitions=3)


def check_counts(counts: Counts) -> None:
    assert counts.mismatches == [], "\n".join(counts.mismatches)
    assert (counts.false_positives, counts.false_negatives) == (0, 0)
    assert counts.partition_disjoint_accepted_in_full == counts.partition_disjoint
    assert counts.refused > 0
    assert counts.conflicting_pairs > 0
    assert counts.views_refused_strided > 0
    assert counts.partition_aliased_with_refusals > 0
    if counts.order_programs:
        assert counts.order_cross_stream_conflicting_pairs > 0
        assert counts.order_disjoint_pairs_overlapping_in_time > 0


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("index_at", ["default", "always"])
async def test_range_leases_against_the_oracle(index_at, monkeypatch):
    """About 20,000 uniqueness checks and 2,000 partition attempts, fixed seeds;
    with lease tables scanned while small (the default) and with every table
    indexed from its first entry (``_leases.INDEX_AT = 0``)."""
    if index_at == "always":
        monkeypatch.setattr(_leases, "INDEX_AT", 0)
    counts = Counts()
    await run_programs(
        counts,
        first=1,
        checks=20_000,
        partitions=2_000,
        accesses_per_program=80,
        partitions_per_program=60,
        order_programs=4,
        max_programs=200,
    )
    check_counts(counts)


def _slow_selected(config: pytest.Config) -> bool:
    if os.environ.get("TRIO_CUDA_RANGE_STRESS_CHECKS") or os.environ.get("TRIO_CUDA_RANGE_STRESS_PARTITIONS"):
        return True
    markexpr = str(config.getoption("-m", default="") or "")
    return "slow" in markexpr and "not slow" not in markexpr


@pytest.mark.slow
def test_range_leases_against_the_oracle_slow(request: pytest.FixtureRequest, capsys, monkeypatch) -> None:
    """At least ``TRIO_CUDA_RANGE_STRESS_CHECKS`` uniqueness checks (1,000,000)
    and ``TRIO_CUDA_RANGE_STRESS_PARTITIONS`` partition attempts (100,000),
    from seed ``TRIO_CUDA_RANGE_STRESS_FIRST`` (1,000,000) on; prints the counts."""
    if not _slow_selected(request.config):
        pytest.skip("slow: select it with -m slow or TRIO_CUDA_RANGE_STRESS_CHECKS=N")
    checks = int(os.environ.get("TRIO_CUDA_RANGE_STRESS_CHECKS", "1000000"))
    partitions = int(os.environ.get("TRIO_CUDA_RANGE_STRESS_PARTITIONS", "100000"))
    first = int(os.environ.get("TRIO_CUDA_RANGE_STRESS_FIRST", "1000000"))
    if "TRIO_CUDA_RANGE_STRESS_INDEX_AT" in os.environ:  # 0: every lease table indexed
        monkeypatch.setattr(_leases, "INDEX_AT", int(os.environ["TRIO_CUDA_RANGE_STRESS_INDEX_AT"]))
    counts = Counts()
    t0 = time.perf_counter()
    try:
        trio.run(
            functools.partial(
                run_programs,
                counts,
                first=first,
                checks=checks,
                partitions=partitions,
                accesses_per_program=300,
                partitions_per_program=250,
                order_programs=150,
                max_programs=10**9,
            )
        )
    finally:
        elapsed = time.perf_counter() - t0
        with capsys.disabled():
            print(f"\n--- range lease stress (seeds from {first}, {elapsed:.0f} s) ---\n{counts.summary()}")
    check_counts(counts)
