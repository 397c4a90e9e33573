"""Kernels shared by the tests: CUDA C++ for the GPU, NumPy references for the simulator."""

from typing import Any

import numpy as np

import trio_cuda
from trio_cuda import In, InOut, Out, Scalar

SAXPY_SRC = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def saxpy_ref(a, x, y, n):
    y[:n] = a * x[:n] + y[:n]


SAXPY = trio_cuda.Kernel.from_source(
    SAXPY_SRC, "saxpy", params=[Scalar("f4"), In("f4"), InOut("f4"), Scalar("i4")], reference=saxpy_ref
)

COPY_SRC = r"""
extern "C" __global__ void copy_f4(const float* src, float* dst, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
"""


def copy_ref(src, dst, n):
    dst[:n] = src[:n]


COPY = trio_cuda.Kernel.from_source(
    COPY_SRC, "copy_f4", params=[In("f4"), Out("f4"), Scalar("i4")], reference=copy_ref
)

ADD_SRC = r"""
extern "C" __global__ void add_f4(float* x, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}
"""


def add_ref(x, v, n):
    x[:n] += v


ADD = trio_cuda.Kernel.from_source(
    ADD_SRC, "add_f4", params=[InOut("f4"), Scalar("f4"), Scalar("i4")], reference=add_ref
)


def saxpy(a, x, y, n=None):
    n = x.size if n is None else n
    return SAXPY.launch(np.float32(a), x, y, n, grid=(n + 127) // 128, block=128)


def copy(src, dst):
    return COPY.launch(src, dst, src.size, grid=(src.size + 127) // 128, block=128)


def add(x, v):
    return ADD.launch(x, np.float32(v), x.size, grid=(x.size + 127) // 128, block=128)


def stub_source(name):
    """CUDA C++ that defines an empty kernel ``name``: for tests of the
    simulator, which runs a kernel's ``reference=`` and only checks that its
    code compiles and defines the kernel."""
    return f'extern "C" __global__ void {name}() {{}}'


def stub_kernel(*params: Any) -> trio_cuda.Kernel:
    """An empty kernel ``k`` with ``params`` and no reference: for tests of
    what a launch leases and keeps, on the simulator."""
    return trio_cuda.Kernel.from_source(
        stub_source("k"), "k", params=list(params), reference=trio_cuda.NO_REFERENCE
    )


def _add_reference(x: Any, v: Any) -> None:
    x += v


#: ``x += v`` on the simulator: the kernel of the compiled paths' comparison tests
ADD_ONE = trio_cuda.Kernel.from_source(
    stub_source("add"), "add", params=[InOut("f4"), Scalar("f4")], reference=_add_reference
)


def add_one(x: Any) -> Any:
    """A launch of :data:`ADD_ONE` adding 1 to the four floats of ``x``."""
    return ADD_ONE.launch(x, np.float32(1), grid=1, block=4)
