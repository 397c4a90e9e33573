"""Public classes and functions report the module users import them from: tracebacks
print ``trio_cuda.KernelArgumentError``, not the private module that defines it, and
the objects pickle by their public name."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys

import pytest

import trio_cuda
from trio_cuda._public import ORIGINS

PUBLIC_MODULES = (
    "trio_cuda",
    "trio_cuda.ops",
    "trio_cuda.unsafe",
    "trio_cuda.testing",
    "trio_cuda.interop",
    "trio_cuda.trace",
)


def _public_objects() -> list[tuple[str, str, object]]:
    out = []
    for modname in PUBLIC_MODULES:
        mod = sys.modules[modname]
        names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
        for name in names:
            obj = getattr(mod, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__.startswith("trio_cuda"):
                out.append((modname, name, obj))
    return out


@pytest.mark.parametrize(("modname", "name", "obj"), _public_objects(), ids=lambda v: str(v)[:40])
def test_public_object_names_a_public_module(modname: str, name: str, obj: object) -> None:
    module = obj.__module__  # type: ignore[attr-defined]
    assert not any(part.startswith("_") for part in module.split(".")), (
        f"{modname}.{name} reports the private module {module}"
    )
    # the module it reports really has it under that name
    assert getattr(sys.modules[module], obj.__qualname__.split(".")[0]) is obj  # type: ignore[attr-defined]


def test_origins_keep_the_defining_module() -> None:
    assert ORIGINS["trio_cuda.KernelArgumentError"] == "trio_cuda._core._errors"
    assert ORIGINS["trio_cuda.ops.copy"].startswith("trio_cuda._core.")
    assert ORIGINS["trio_cuda.testing.SimDevice"] == "trio_cuda._backends.sim.device"


def test_errors_pickle_by_their_public_name() -> None:
    err = trio_cuda.KernelArgumentError("k: expected 4 arguments, got 3")
    data = pickle.dumps(err)
    assert b"trio_cuda._core" not in data
    back = pickle.loads(data)
    assert type(back) is trio_cuda.KernelArgumentError
    assert str(back) == str(err)


def test_a_traceback_prints_the_public_name() -> None:
    code = "import trio_cuda\nraise trio_cuda.KernelArgumentError('x: expected 1, got 2')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "trio_cuda.KernelArgumentError: x: expected 1, got 2", proc.stderr
