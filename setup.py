"""Build hook for the optional compiled part: the direct driver calls of the
CUDA backend (``trio_cuda/_backends/cuda/_direct.c``, Python headers and a C
compiler only). Everything else is in pyproject.toml.

The extension is optional: where it cannot be built (no compiler, no Python
headers), the install goes on without it and the backend calls the driver
through cuda.bindings' wrappers, the reference path. ``TRIO_CUDA_PURE=1`` at
install skips the build; at run time it selects the wrappers.
"""

import os

from setuptools import Extension, setup

_pure = os.environ.get("TRIO_CUDA_PURE", "").strip() not in ("", "0")

setup(
    ext_modules=[]
    if _pure
    else [
        Extension(
            "trio_cuda._backends.cuda._direct",
            ["trio_cuda/_backends/cuda/_direct.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
