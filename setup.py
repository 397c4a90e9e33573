"""Build hook for the optional compiled parts (Python headers and a C
compiler only): the direct driver calls of the CUDA backend
(``trio_cuda/_backends/cuda/_direct.c``) and the launch builder's hot methods
(``trio_cuda/_core/_claunch.c``). Everything else is in pyproject.toml.

Both extensions are optional: where one cannot be built (no compiler, no
Python headers), the install goes on without it and the pure-Python path, the
reference, is used: the backend calls the driver through cuda.bindings'
wrappers, and the builder is ``_builder._PyBuilder``. ``TRIO_CUDA_PURE=1`` at
install skips the build; at run time it selects the pure-Python paths.
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
            depends=["trio_cuda/_core/_fastattr.h"],
            optional=True,
            extra_compile_args=["-O2", "-fvisibility=hidden"],  # (only PyInit exported: no clash with libc names)
        ),
        Extension(
            "trio_cuda._core._claunch",
            [
                "trio_cuda/_core/_claunch.c",
                "trio_cuda/_core/_claunch_builder.c",
                "trio_cuda/_core/_claunch_typed.c",
                "trio_cuda/_core/_claunch_leases.c",
                "trio_cuda/_core/_claunch_order.c",
                "trio_cuda/_core/_claunch_submit.c",
                "trio_cuda/_core/_claunch_scan.c",
                "trio_cuda/_core/_claunch_step.c",
                "trio_cuda/_core/_claunch_trace.c",
                "trio_cuda/_core/_claunch_method.c",
                "trio_cuda/_core/_claunch_protect.c",
            ],
            depends=["trio_cuda/_core/_claunch.h", "trio_cuda/_core/_fastattr.h"],
            optional=True,
            extra_compile_args=["-O2", "-fvisibility=hidden"],  # (only PyInit exported: no clash with libc names)
        ),
    ]
)
