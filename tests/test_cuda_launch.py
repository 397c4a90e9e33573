"""The kernel launch layer on a real GPU: the argument arena against the
kernel's own view (kernels write back sizeof, alignof, offsetof and the
values they received; the driver's parameter layout), Slice and boxed
arguments, and every launch mode taking effect: clusters (%cluster_ctarank),
cooperative launches (a grid-wide barrier; the occupancy limit checked up
front), programmatic dependent launch (the dependent kernel starts before
its primary ends), and dynamic shared memory beyond 48 KiB. Refused launches
enqueue nothing.

Every test is marked ``gpu`` and skips cleanly without a CUDA device. Under
compute-sanitizer (detected by ``tests/_sanitizer.py``, no variable needed)
the test that ends in a failing driver call and the overlap of a programmatic
dependent launch (the tool serialises kernels) are skipped.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from _sanitizer import skip_under_sanitizer

import trio_cuda
from trio_cuda import In, InOut, Kernel, KernelArgumentError, Out, Scalar, Slice, ops, unsafe
from trio_cuda._backends import probe_cuda

_PROBE = probe_cuda()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _PROBE.available, reason=f"no CUDA device: {_PROBE.reason}"),
]

U8 = np.uint64
PAD = np.dtype([("a", "u1"), ("b", "f8"), ("c", "i2")], align=True)
OVER = np.dtype({"names": ["x", "v"], "formats": ["f4", ("f4", 4)], "offsets": [0, 16], "itemsize": 32})


def struct_value(dtype: np.dtype[Any], value: tuple[Any, ...]) -> np.void:
    buf = np.zeros(1, dtype)
    buf[0] = value
    return buf[0]


def bits(value: Any) -> int:
    """The value's bytes as an unsigned little-endian integer (as the kernels write them)."""
    raw = np.asarray(value).tobytes()
    return int.from_bytes(raw, "little")


def stats(gpu: trio_cuda.ResourceScope) -> tuple[int, ...]:
    s = gpu.statistics()
    return (s.submitted, s.in_flight, s.leases_held, s.retained_bytes, s.live_allocations, s.failed)


# --------------------------------------------------------------------------- layout

LAYOUT_SRC = r"""
struct Pad { unsigned char a; double b; short c; };
struct __align__(16) Over { float x; float4 v; };
typedef unsigned long long u64;

template <typename T> __device__ u64 b64(T v) {
    u64 r = 0;
    const unsigned char* p = (const unsigned char*)&v;
    for (int i = 0; i < (int)sizeof(T) && i < 8; ++i) r |= (u64)p[i] << (8 * i);
    return r;
}

extern "C" __global__ void layout(unsigned char tag, Pad p, unsigned char tag2, Over o,
                                  float2 c64, double2 c128, unsigned short h, u64* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    out[0] = sizeof(Pad); out[1] = alignof(Pad);
    const char* pb = (const char*)&p;
    const char* ob = (const char*)&o;
    out[2] = (u64)((const char*)&p.b - pb); out[3] = (u64)((const char*)&p.c - pb);
    out[4] = sizeof(Over); out[5] = alignof(Over); out[6] = (u64)((const char*)&o.v - ob);
    out[7] = tag; out[8] = p.a; out[9] = b64(p.b); out[10] = (u64)(long long)p.c;
    out[11] = tag2; out[12] = b64(o.x);
    out[13] = b64(o.v.x); out[14] = b64(o.v.y); out[15] = b64(o.v.z); out[16] = b64(o.v.w);
    out[17] = b64(c64); out[18] = b64(c128.x); out[19] = b64(c128.y); out[20] = h;
    out[21] = alignof(float2); out[22] = alignof(double2);
}

extern "C" __global__ void scalars(signed char i1, unsigned char u1, short i2, unsigned short u2,
                                   int i4, unsigned int u4, long long i8, u64 u8_, float f4,
                                   double f8, bool b, unsigned short f2, u64* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    out[0] = (u64)(long long)i1; out[1] = u1; out[2] = (u64)(long long)i2; out[3] = u2;
    out[4] = (u64)(long long)i4; out[5] = u4; out[6] = (u64)i8; out[7] = u8_;
    out[8] = b64(f4); out[9] = b64(f8); out[10] = b ? 1 : 0; out[11] = f2;
}

extern "C" __global__ void bf16_bits(unsigned char tag, unsigned short bf, u64* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) { out[0] = tag; out[1] = bf; }
}

extern "C" __global__ void slice_sum(const float* x, u64 n, unsigned int tag, const float* y,
                                     unsigned int m, float* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    float s = 0.0f;
    for (u64 i = 0; i < n; ++i) s += x[i];
    float t = 0.0f;
    for (unsigned int i = 0; i < m; ++i) t += y[i];
    out[0] = s; out[1] = (float)n; out[2] = (float)tag; out[3] = t; out[4] = (float)m;
}

extern "C" __global__ void takes_double(double d, float* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = (float)d;
}
"""

LAYOUT = Kernel.from_source(
    LAYOUT_SRC,
    "layout",
    params=[
        Scalar("u1"),
        Scalar(PAD),
        Scalar("u1"),
        Scalar(OVER, align=16),
        Scalar("c8"),
        Scalar("c16"),
        Scalar("f2"),
        Out("u8"),
    ],
)
SCALARS = Kernel.from_source(
    LAYOUT_SRC,
    "scalars",
    params=[Scalar(c) for c in ("i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f4", "f8", "?", "f2")]
    + [Out("u8")],
)
SLICE_SUM = Kernel.from_source(
    LAYOUT_SRC,
    "slice_sum",
    params=[Slice("f4", access="read"), Scalar("u4"), Slice("f4", access="read", len_dtype="u4"), Out("f4")],
)


async def test_struct_layout_matches_the_kernels_own_view() -> None:
    pad = struct_value(PAD, (200, -2.5, -7))
    over = struct_value(OVER, (1.5, (1.0, -2.0, 3.25, 4.5)))
    c64, c128, h = np.complex64(1.5 - 2.5j), np.complex128(-3.25 + 4.5j), np.float16(-0.333)
    async with trio_cuda.open_scope(device="cuda") as gpu:
        out = gpu.zeros(23, U8)
        launch = LAYOUT.launch(np.uint8(7), pad, np.uint8(9), over, c64, c128, h, out, grid=1, block=32)
        await gpu.run(launch)
        got = [int(v) for v in await gpu.to_host(out)]
        # the C layout the kernel sees, against the dtypes and the arena plan
        assert got[0:4] == [PAD.itemsize, 8, PAD.fields["b"][1], PAD.fields["c"][1]]
        assert got[4:7] == [
            Scalar(OVER, align=16).size,
            Scalar(OVER, align=16).alignment,
            OVER.fields["v"][1],
        ]
        assert got[21:23] == [LAYOUT.params[4].alignment, LAYOUT.params[5].alignment]  # float2 / double2
        # the values the kernel received
        assert got[7] == 7
        assert got[8] == 200
        assert got[9] == bits(np.float64(-2.5))
        assert got[10] == (-7) & 0xFFFFFFFFFFFFFFFF
        assert got[11] == 9
        assert got[12] == bits(np.float32(1.5))
        assert got[13:17] == [bits(np.float32(v)) for v in (1.0, -2.0, 3.25, 4.5)]
        assert got[17] == bits(c64)
        assert got[18:20] == [bits(np.float64(-3.25)), bits(np.float64(4.5))]
        assert got[20] == bits(h)
        # and the driver's own parameter layout equals the arena's slots
        fn = gpu._functions[LAYOUT]
        layout = gpu._driver.param_layout(fn, len(LAYOUT.plan.slots))  # type: ignore[attr-defined]
        assert layout == tuple((s.offset, s.size) for s in LAYOUT.plan.slots)


async def test_every_numeric_scalar_reaches_the_kernel() -> None:
    values = (
        np.int8(-128),
        np.uint8(255),
        np.int16(-32768),
        np.uint16(65535),
        np.int32(-(2**31)),
        np.uint32(2**32 - 1),
        np.int64(-(2**63)),
        np.uint64(2**64 - 1),
        np.float32(-1.25),
        np.float64(6.5e300),
        np.bool_(True),
        np.float16(65504.0),
    )
    async with trio_cuda.open_scope(device="cuda") as gpu:
        out = gpu.zeros(12, U8)
        await gpu.run(SCALARS.launch(*values, out, grid=1, block=1))
        got = [int(v) for v in await gpu.to_host(out)]
    m = 0xFFFFFFFFFFFFFFFF
    expected = [int(v) & m for v in values[:8]] + [bits(values[8]), bits(values[9]), 1, bits(values[11])]
    assert got == expected


async def test_bfloat16_reaches_the_kernel() -> None:
    ml_dtypes = pytest.importorskip(
        "ml_dtypes",
        reason="ml_dtypes is not installed (pip install ml_dtypes): bfloat16 and float8 scalars need it",
    )
    k = Kernel.from_source(
        LAYOUT_SRC, "bf16_bits", params=[Scalar("u1"), Scalar(ml_dtypes.bfloat16), Out("u8")]
    )
    async with trio_cuda.open_scope(device="cuda") as gpu:
        out = gpu.zeros(2, U8)
        await gpu.run(k.launch(np.uint8(3), -1.5, out, grid=1, block=1))
        got = [int(v) for v in await gpu.to_host(out)]
    assert got == [3, bits(ml_dtypes.bfloat16(-1.5))]


async def test_slices_pass_pointer_and_length() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        x = await gpu.to_device(np.arange(10, dtype=np.float32).reshape(2, 5))
        y = await gpu.to_device(np.full(3, 2.0, np.float32))
        out = gpu.zeros(5, np.float32)
        await gpu.run(SLICE_SUM.launch(x, np.uint32(77), y, out, grid=1, block=1))
        np.testing.assert_array_equal(await gpu.to_host(out), [45.0, 10.0, 77.0, 6.0, 3.0])


async def test_boxed_struct_and_misaligned_blob() -> None:
    over = struct_value(OVER, (1.5, (1.0, -2.0, 3.25, 4.5)))
    pad = struct_value(PAD, (1, 2.0, 3))
    async with trio_cuda.open_scope(device="cuda") as gpu:
        out = gpu.zeros(23, U8)

        def built(over_align: int) -> trio_cuda.KernelLaunch:
            return (
                LAYOUT.builder()
                .grid(1)
                .block(1)
                .arg(np.uint8(5))
                .arg_boxed(pad.tobytes(), align=8)
                .arg(np.uint8(6))
                .arg_boxed(over.tobytes(), align=over_align)
                .arg(np.complex64(0))
                .arg(np.complex128(0))
                .arg(np.float16(0))
                .arg(out)
                .finalize_unchecked()
            )

        await gpu.run(built(16))
        got = [int(v) for v in await gpu.to_host(out)]
        assert got[11:17] == [6, bits(np.float32(1.5))] + [
            bits(np.float32(v)) for v in (1.0, -2.0, 3.25, 4.5)
        ]
        before = stats(gpu)
        wrong = built(4)  # an Over blob at alignment 4 lands at offset 36, the kernel expects 48
        with pytest.raises(
            KernelArgumentError,
            match=r"^layout: argument 3 \(boxed bytes\): the compiled kernel's parameter 3 takes 32 bytes "
            r"at offset 48, the argument packs 32 bytes at offset 36",
        ):
            gpu.submit(wrong)
        with pytest.raises(KernelArgumentError, match=r"argument 3 \(boxed bytes\)"):
            unsafe.async_on(wrong, gpu.streams[0])
        assert stats(gpu) == before


@skip_under_sanitizer("finding the kernel's parameter count ends in a failing driver call")
async def test_declared_parameters_that_do_not_match_the_kernel_are_refused() -> None:
    wrong = Kernel.from_source(LAYOUT_SRC, "takes_double", params=[Scalar("f4"), Out("f4")])
    extra = Kernel.from_source(LAYOUT_SRC, "takes_double", params=[Scalar("f8"), Out("f4"), Scalar("i4")])
    right = Kernel.from_source(LAYOUT_SRC, "takes_double", params=[Scalar("f8"), Out("f4")])
    async with trio_cuda.open_scope(device="cuda") as gpu:
        out = gpu.zeros(1, np.float32)
        await gpu.load(wrong, extra, right)
        with trio.fail_after(10):
            while gpu.statistics().in_flight:  # noqa: ASYNC110 - until the zeros retired
                await trio.sleep(0.001)
        before = stats(gpu)
        with pytest.raises(
            KernelArgumentError,
            match=r"^takes_double: argument 0 \(Scalar\('<f4'\)\): the compiled kernel's parameter 0 takes 8 "
            r"bytes at offset 0, the argument packs 4 bytes at offset 0",
        ):
            await gpu.run(wrong.launch(1.0, out, grid=1, block=1))
        with pytest.raises(
            KernelArgumentError,
            match=r"^takes_double: params: expected 2 kernel parameters \(as compiled\), the launch packs 3$",
        ):
            gpu.submit(extra.launch(1.0, out, 3, grid=1, block=1))
        assert stats(gpu) == before
        await gpu.run(right.launch(2.5, out, grid=1, block=1))
        assert (await gpu.to_host(out))[0] == 2.5


async def test_too_few_declared_parameters_are_refused_where_the_driver_counts_them() -> None:
    from trio_cuda._backends.cuda.launch import _param_count

    short = Kernel.from_source(LAYOUT_SRC, "takes_double", params=[Scalar("f8")])
    async with trio_cuda.open_scope(device="cuda") as gpu:
        await gpu.load(short)
        if _param_count(gpu._functions[short].fn) is None:  # type: ignore[attr-defined]
            pytest.skip("this driver has no cuFuncGetParamCount: extra kernel parameters go unnoticed")
        before = stats(gpu)
        with pytest.raises(
            KernelArgumentError,
            match=r"^takes_double: params: expected 2 kernel parameters \(as compiled\), the launch packs 1$",
        ):
            gpu.submit(short.launch(1.0, grid=1, block=1))
        assert stats(gpu) == before


# --------------------------------------------------------------------------- modes

MODES_SRC = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void cluster_info(unsigned int* out) {
    unsigned int rank, size, cid;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cid));
    if (threadIdx.x == 0) {
        out[3 * blockIdx.x] = rank; out[3 * blockIdx.x + 1] = size; out[3 * blockIdx.x + 2] = cid;
    }
}

// A grid-wide barrier by atomics: correct only when every block is resident
// at once, which a cooperative launch guarantees.
extern "C" __global__ void coop_barrier(unsigned int* counter, int* a, int* b) {
    unsigned int nb = gridDim.x;
    if (threadIdx.x == 0) a[blockIdx.x] = (int)blockIdx.x + 1;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        while (atomicAdd(counter, 0u) < nb) { }
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0) b[blockIdx.x] = ((volatile int*)a)[(blockIdx.x + 1) % nb];
}

// PDL: the primary lets its dependent start at once, then spins and stamps its end.
extern "C" __global__ void primary(u64 ns, u64* t) {
    asm volatile("griddepcontrol.launch_dependents;");
    u64 t0 = now_ns();
    while (now_ns() - t0 < ns) { }
    __threadfence();
    t[0] = now_ns();
}
// The dependent stamps its start, waits for the primary's memory, then reads it.
extern "C" __global__ void secondary(const u64* t, u64* out) {
    out[0] = now_ns();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    out[1] = ((volatile const u64*)t)[0];
}

extern "C" __global__ void big_smem(float* out, unsigned int n) {
    extern __shared__ float buf[];
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = (float)i;
    __syncthreads();
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) out[i] = buf[n - 1 - i];
}

extern "C" __global__ void static_smem(float* out, unsigned int n) {
    __shared__ float fixed[8192];  // 32 KiB of static shared memory
    extern __shared__ float dyn[];
    fixed[threadIdx.x] = 1.0f;
    if (n) dyn[0] = 2.0f;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = fixed[0] + (n ? dyn[0] : 0.0f);
}

extern "C" __global__ void __launch_bounds__(128) bounded(float* out) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}
"""

CLUSTER_INFO = Kernel.from_source(MODES_SRC, "cluster_info", params=[Out("u4")])
COOP = Kernel.from_source(MODES_SRC, "coop_barrier", params=[InOut("u4"), InOut("i4"), Out("i4")])
PRIMARY = Kernel.from_source(MODES_SRC, "primary", params=[Scalar("u8"), Out("u8")])
SECONDARY = Kernel.from_source(MODES_SRC, "secondary", params=[In("u8"), Out("u8")])
BIG_SMEM = Kernel.from_source(MODES_SRC, "big_smem", params=[Out("f4"), Scalar("u4")])
STATIC_SMEM = Kernel.from_source(MODES_SRC, "static_smem", params=[Out("f4"), Scalar("u4")])
BOUNDED = Kernel.from_source(MODES_SRC, "bounded", params=[Out("f4")])


async def need_sm90(gpu: trio_cuda.ResourceScope) -> None:
    if gpu.device.compute_capability < (9, 0):
        pytest.skip("clusters and programmatic dependent launch need sm_90")


async def test_clusters_take_effect() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        await need_sm90(gpu)
        out = gpu.zeros(3 * 8, np.uint32)
        await gpu.run(CLUSTER_INFO.launch(out, grid=8, block=32))  # control: no cluster
        got = (await gpu.to_host(out)).reshape(8, 3)
        assert list(got[:, 1]) == [1] * 8
        for size in (2, 4, 8):
            await gpu.run(CLUSTER_INFO.launch(out, grid=8, block=32, cluster=size))
            got = (await gpu.to_host(out)).reshape(8, 3)
            assert list(got[:, 0]) == [i % size for i in range(8)]
            assert list(got[:, 1]) == [size] * 8
            assert list(got[:, 2]) == [i // size for i in range(8)]
        built = CLUSTER_INFO.builder().grid(8).block(32).cluster(2).arg(out).finalize_unchecked()
        out2 = gpu.zeros(3 * 8, np.uint32)
        assert await gpu.run(built) is out
        got = (await gpu.to_host(out)).reshape(8, 3)
        assert list(got[:, 0]) == [0, 1] * 4
        before = stats(gpu)
        with pytest.raises(KernelArgumentError, match=r"must divide grid dimension 8"):
            CLUSTER_INFO.launch(out2, grid=8, block=32, cluster=3)
        with pytest.raises(KernelArgumentError, match=r"expected at most 8 blocks per cluster, got 16"):
            gpu.submit(CLUSTER_INFO.launch(out2, grid=16, block=32, cluster=16))
        assert stats(gpu) == before


async def test_cooperative_launch_with_a_grid_barrier() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        sms = gpu.device.multiprocessor_count
        c0 = gpu.zeros(1, np.uint32)
        a0 = gpu.zeros(1, np.int32)
        b0 = gpu.zeros(1, np.int32)
        before = stats(gpu)
        with pytest.raises(KernelArgumentError, match=rf"co-resident limit (\d+) \({sms} SMs\)$") as info:
            gpu.submit(COOP.launch(c0, a0, b0, grid=100_000, block=1024, cooperative=True))
        found = re.search(r"limit (\d+)", str(info.value))
        assert found is not None
        limit = int(found.group(1))
        assert limit % sms == 0
        assert limit >= sms
        with pytest.raises(
            KernelArgumentError, match=rf"^coop_barrier: cooperative launch of {limit + 1} blocks"
        ):
            unsafe.async_on(
                COOP.launch(c0, a0, b0, grid=limit + 1, block=1024, cooperative=True), gpu.streams[0]
            )
        assert stats(gpu) == before  # nothing submitted, leased or retained
        # grids that fit, the largest included: every block must pass the barrier
        for grid, block in ((2 * sms, 128), (limit, 1024)):
            counter = gpu.zeros(1, np.uint32)
            a = gpu.zeros(grid, np.int32)
            b = gpu.zeros(grid, np.int32)
            await gpu.run(COOP.launch(counter, a, b, grid=grid, block=block, cooperative=True))
            expected = np.roll(np.arange(1, grid + 1, dtype=np.int32), -1)
            np.testing.assert_array_equal(await gpu.to_host(b), expected)
            assert (await gpu.to_host(counter))[0] == grid


def _cg_include() -> list[str] | None:
    """The include directories NVRTC needs for cooperative_groups.h (the
    toolkit's, and its CCCL directory for <nv/target>), or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    dirs = [os.path.join(c, "include") for c in candidates if c]
    try:
        import nvidia

        for base in nvidia.__path__:
            dirs += glob.glob(os.path.join(base, "*", "include"))
    except ImportError:
        pass
    for d in dirs:
        if os.path.exists(os.path.join(d, "cooperative_groups.h")):
            return [d] + [c for c in (os.path.join(d, "cccl"),) if os.path.isdir(c)]
    return None


async def test_cooperative_groups_grid_sync() -> None:
    include = _cg_include()
    if include is None:
        pytest.skip("no cooperative_groups.h for NVRTC on this machine")
    src = r"""
    #include <cooperative_groups.h>
    namespace cg = cooperative_groups;
    extern "C" __global__ void cg_sync(int* a, int* b) {
        cg::grid_group grid = cg::this_grid();
        unsigned int nb = gridDim.x;
        if (threadIdx.x == 0) a[blockIdx.x] = (int)blockIdx.x * 3;
        grid.sync();
        if (threadIdx.x == 0) b[blockIdx.x] = a[(blockIdx.x + 1) % nb];
    }
    """
    k = Kernel.from_source(
        src, "cg_sync", params=[InOut("i4"), Out("i4")], options=[f"-I{d}" for d in include]
    )
    async with trio_cuda.open_scope(device="cuda") as gpu:
        try:
            await gpu.load(k)
        except trio_cuda.CudaError as exc:
            if "cannot open source file" not in str(exc):
                raise
            pytest.skip(f"the toolkit headers here are incomplete for NVRTC: {str(exc)[-200:]}")
        grid = 2 * gpu.device.multiprocessor_count
        a = gpu.zeros(grid, np.int32)
        b = gpu.zeros(grid, np.int32)
        await gpu.run(k.launch(a, b, grid=grid, block=256, cooperative=True))
        np.testing.assert_array_equal(await gpu.to_host(b), np.roll(np.arange(grid, dtype=np.int32) * 3, -1))


@skip_under_sanitizer("compute-sanitizer serialises kernels: no overlap to observe")
@pytest.mark.parametrize("path", ["submit", "async_on", "builder"])
async def test_programmatic_dependent_launch_takes_effect(path: str) -> None:
    spin = 5_000_000  # the primary runs for 5 ms after releasing its dependent
    async with trio_cuda.open_scope(device="cuda") as gpu:
        await need_sm90(gpu)
        s = gpu.streams[0]
        results = {}
        for pdl in (False, True):
            # allocated and zeroed on the same stream, and settled: nothing (no
            # cross-stream wait) may sit between the two kernels
            t = gpu.zeros(1, U8, stream=s)
            out = gpu.zeros(2, U8, stream=s)
            await gpu.run(ops.value(None), stream=s)
            first = PRIMARY.launch(np.uint64(spin), t, grid=1, block=1)
            if path == "builder":
                second = SECONDARY.builder().grid(1).block(1).pdl(pdl).arg(t).arg(out).finalize_unchecked()
            else:
                second = SECONDARY.launch(t, out, grid=1, block=1, pdl=pdl)
            assert second.config.pdl is pdl
            if path == "async_on":
                unsafe.async_on(first, s)
                unsafe.async_on(second, s)
                await gpu.run(ops.value(None), stream=s)
            else:
                gpu.submit(first, stream=s)
                await gpu.submit(second, stream=s).wait()
            end = int((await gpu.to_host(t))[0])
            start, seen = (int(v) for v in await gpu.to_host(out))
            assert seen == end != 0  # griddepcontrol.wait: the primary's write is visible
            results[pdl] = start - end
        assert results[False] >= 0  # serialized: the dependent starts after the primary ended
        assert results[True] < -spin // 2  # overlapped: it started while the primary still spun


async def test_dynamic_shared_memory_beyond_48_kib() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        optin = gpu.device.max_shared_memory_per_block_optin
        n = min(200 * 1024, optin) // 4
        out = gpu.zeros(n, np.float32)
        await gpu.run(BIG_SMEM.launch(out, n, grid=1, block=256, shared_mem=n * 4))
        np.testing.assert_array_equal(await gpu.to_host(out), np.arange(n, dtype=np.float32)[::-1])
        # static + dynamic must fit the opt-in limit; the error says how much is left
        r = gpu.zeros(1, np.float32)
        await gpu.load(STATIC_SMEM)
        static = gpu._driver._kernels.function_limits(gpu._functions[STATIC_SMEM])[1]  # type: ignore[attr-defined]
        assert static >= 32768
        fits = optin - static
        await gpu.run(STATIC_SMEM.launch(r, 1, grid=1, block=256, shared_mem=fits))
        assert (await gpu.to_host(r))[0] == 3.0
        before = stats(gpu)
        with pytest.raises(
            KernelArgumentError,
            match=rf"^static_smem: shared_mem: expected at most {fits} bytes \(the kernel has {static} "
            rf"bytes of static shared memory, the device {optin} per block\), got {fits + 1}$",
        ):
            gpu.submit(STATIC_SMEM.launch(r, 1, grid=1, block=256, shared_mem=fits + 1))
        # (at the launch where no GPU allows more, at the submission otherwise)
        with pytest.raises(KernelArgumentError, match=rf"expected at most {optin} bytes.*, got {optin + 1}$"):
            gpu.submit(BIG_SMEM.launch(out, 1, grid=1, block=256, shared_mem=optin + 1))
        assert stats(gpu) == before


async def test_block_too_large_for_the_kernel() -> None:
    async with trio_cuda.open_scope(device="cuda") as gpu:
        out = gpu.zeros(256, np.float32)
        await gpu.run(BOUNDED.launch(out, grid=2, block=128))
        before = stats(gpu)
        with pytest.raises(
            KernelArgumentError,
            match=r"^bounded: block: the kernel allows at most 128 threads per block \(its register use or "
            r"__launch_bounds__\), got \(256, 1, 1\) = 256$",
        ):
            gpu.submit(BOUNDED.launch(out, grid=1, block=256))
        with pytest.raises(KernelArgumentError, match=r"^block: expected at most 1024"):  # (at the launch)
            gpu.submit(BOUNDED.launch(out, grid=1, block=2048))
        assert stats(gpu) == before
        np.testing.assert_array_equal(await gpu.to_host(out), np.ones(256, np.float32))


def _load_example() -> Any:
    path = Path(__file__).resolve().parent.parent / "examples" / "inplace_update.py"
    spec = importlib.util.spec_from_file_location("inplace_update", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("inplace_update", module)
    spec.loader.exec_module(module)
    return module


async def test_inplace_update_example_on_the_gpu() -> None:
    module = _load_example()
    facts = await module.run("cuda", 1 << 20)
    assert facts["backend"] == "cuda"
    assert facts["same_array"]
    assert facts["same_pointer"]
    assert facts["no_new_allocation"]
    assert facts["values_ok"], facts
