"""The compiled launch builder against its reference, the pure-Python builder.

Random programs, bad steps included, run on a compiled builder and on a
reference builder side by side: after each step both hold the same state,
and returned the builder or raised the same error; each finalize makes the
same launch. The choice of builder at import, and what the compiled one
leaks (nothing), are checked too."""

from __future__ import annotations

import gc
import inspect
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_cuda
from tests.core.test_builder_packing import STRUCTS, config_of, dtype_of, scalars, view_key
from tests.helpers import internals
from trio_cuda import In, InOut, Out, Scalar
from trio_cuda._core import _builder

compiled_only = pytest.mark.skipif(
    not _builder.compiled(),
    reason="the compiled builder is not in use (not built at install, or TRIO_CUDA_PURE set)",
)

# the values a hostile program passes to the geometry setters
GEOMETRY = st.one_of(
    st.integers(-2, 70000),
    st.sampled_from([np.int64(3), 2.0, "4", None, True, 2**70]),
)


def state(builder: Any) -> tuple[Any, ...]:
    """A builder's fields: the arguments by identity, the rest by value."""
    return (
        builder._grid,
        builder._block,
        builder._shared,
        builder._cluster,
        builder._cooperative,
        builder._pdl,
        [id(v) for v in builder._values],
        [(id(a), m) for a, m in builder._accesses],
        [id(a) for a in builder._outputs],
        list(builder._layout),
        bytes(builder._arena),
    )


FIELDS = (
    "_kernel",
    "_grid",
    "_block",
    "_shared",
    "_cluster",
    "_cooperative",
    "_pdl",
    "_values",
    "_accesses",
    "_outputs",
    "_layout",
    "_arena",
)


def loose_state(builder: Any) -> list[Any]:
    """A builder's fields whatever they hold (lists by their items' identity)."""
    out: list[Any] = []
    for name in FIELDS:
        value = getattr(builder, name)
        if isinstance(value, list):
            value = [
                (type(v).__name__, id(v[0]), v[1]) if type(v) is tuple and len(v) == 2 else id(v)
                for v in value
            ]
        out.append((type(value).__name__, value))
    return out


def launch_summary(launch: Any) -> tuple[Any, ...]:
    prepared = launch.prepared
    out = internals.output_of(launch)
    return (
        type(launch),
        prepared.kernel,
        config_of(launch),  # (by value: a geometry the cache does not keep makes a new one each time)
        prepared.plan,  # (by value: the shared plans' cache may be cleared between two finalizes)
        prepared.plan is prepared.kernel.plan,
        prepared.arena,
        [view_key(v) for v in prepared.arg_views()],
        prepared.values,
        sorted(prepared.cache or ()),  # (its views: compared above)
        prepared.enqueued,
        prepared.ready,
        [(id(a), m) for a, m in internals.accesses_of(launch)],
        [id(a) for a in out] if isinstance(out, tuple) else id(out),
        internals.lease_plan_of(launch),
    )


def outcome(builder: Any, step: tuple[Any, ...]) -> tuple[Any, ...]:
    """What one step does: ("self",), ("launch", summary) or ("raised", type, text)."""
    name, args, kwargs = step
    try:
        got = getattr(builder, name)(*args, **kwargs)
    except Exception as exc:  # every error, compared by type and text
        return ("raised", type(exc), str(exc).replace("_PyBuilder.", "").replace("LaunchBuilder.", ""))
    if got is builder:
        return ("self",)
    return ("launch", launch_summary(got))


@st.composite
def steps(draw: Any, arrays: list[Any]) -> tuple[Any, ...]:
    kind = draw(
        st.sampled_from(
            [
                "arg",
                "arg",
                "arg",
                "scalar",
                "scalar",
                "struct",
                "boxed",
                "dims",
                "shared",
                "flag",
                "finalize",
                "misuse",
            ]
        )
    )
    if kind == "arg":
        value = draw(st.sampled_from(arrays))
        kwargs = draw(
            st.sampled_from(
                [
                    {},
                    {"access": None},
                    {"access": "read"},
                    {"access": "readwrite"},
                    {"access": "write"},
                    {"access": "bogus"},
                ]
            )
        )
        return ("arg", (value,), kwargs)
    if kind == "scalar":
        name = draw(st.sampled_from(["i1", "u1", "i2", "u4", "i8", "u8", "f2", "f4", "f8", "?", "c8", "c16"]))
        return ("arg", (draw(scalars(dtype_of(name))),), {})
    if kind == "struct":
        return ("arg", (draw(scalars(draw(st.sampled_from(STRUCTS)))),), {})
    if kind == "boxed":
        raw = draw(st.binary(min_size=0, max_size=20))
        return ("arg_boxed", (raw,), {"align": draw(st.sampled_from([1, 2, 3, 4, 8, 0]))})
    if kind == "dims":
        name = draw(st.sampled_from(["grid", "block", "cluster"]))
        return (name, tuple(draw(st.lists(GEOMETRY, min_size=0, max_size=4))), {})
    if kind == "shared":
        return ("shared_mem", (draw(GEOMETRY),), {})
    if kind == "flag":
        name = draw(st.sampled_from(["cooperative", "pdl"]))
        args = draw(st.sampled_from([(), (True,), (False,), (1,), (None,)]))
        return (name, args, {})
    if kind == "finalize":
        return ("finalize_unchecked", (), {})
    # calls that do not match the signatures: keywords, too many arguments
    return draw(
        st.sampled_from(
            [
                ("grid", (1,), {"x": 2}),
                ("shared_mem", (), {"nbytes": 64}),
                ("shared_mem", (1, 2), {}),
                ("cooperative", (), {"enabled": False}),
                ("pdl", (True, True), {}),
                ("arg", (), {}),
                ("arg", (1, 2), {}),
                ("arg", (np.int32(1),), {"mode": "read"}),
                ("arg", (None,), {}),
                ("arg", (3,), {}),
                ("arg", (np.arange(3),), {}),
                ("finalize_unchecked", (1,), {}),
            ]
        )
    )


KERNELS = [
    [],
    [In("f4"), Scalar("i4")],
    [Out("f4"), InOut("i2"), Scalar("f8")],
    [In("f4")] * 4 + [Scalar("i4")],
]


@compiled_only
@settings(max_examples=300, deadline=None)
@given(data=st.data())
async def test_compiled_builder_does_what_the_reference_does(data):
    """Step for step, the compiled builder and the reference hold the same
    fields, return the builder or raise the same error, and finalize into
    the same launch (the same configuration and plan objects, bytes, views,
    accesses and output)."""
    k = trio_cuda.Kernel.from_source("", "k", params=data.draw(st.sampled_from(KERNELS)))
    async with trio_cuda.open_scope(device="sim") as late:
        gone = late.zeros(8, "f4")  # an array of a closed scope
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(32, "f4")
        y = gpu.zeros(16, "i2")
        closed = gpu.zeros(4, "f4")
        closed.close()
        arrays = [
            x,
            x[:8],
            x[8:],
            y,
            y.as_readonly(),
            x.as_readonly(),
            x.reshape(4, 8, order="F"),
            closed,
            gone,
        ]
        compiled = k.builder()
        reference = _builder._PyBuilder._create(k)
        assert type(compiled) is trio_cuda.LaunchBuilder
        assert type(reference) is _builder._PyBuilder
        for step in data.draw(st.lists(steps(arrays), max_size=12)):
            assert outcome(compiled, step) == outcome(reference, step), step
            assert state(compiled) == state(reference), step
        assert outcome(compiled, ("finalize_unchecked", (), {})) == outcome(
            reference, ("finalize_unchecked", (), {})
        )


@compiled_only
async def test_fields_set_by_hand_go_to_the_reference():
    """A field replaced or deleted by hand takes the reference's path: what
    happens is what happens to the reference builder, never a crash."""
    k = trio_cuda.Kernel.from_source("", "k", params=[In("f4")])
    async with trio_cuda.open_scope(device="sim") as gpu:
        x = gpu.zeros(4, "f4")
        tampered = [
            ("_values", ()),
            ("_arena", b""),
            ("_arena", bytearray(3)),
            ("_layout", None),
            ("_kernel", None),
            ("_accesses", [1]),
            ("_grid", (1.5,)),
            ("_outputs", ()),
        ]
        for field, value in tampered:
            builders = (k.builder(), _builder._PyBuilder._create(k))
            for builder in builders:
                setattr(builder, field, value)
            for step in [("arg", (x,), {}), ("arg", (np.int32(2),), {}), ("finalize_unchecked", (), {})]:
                got, want = (outcome(b, step) for b in builders)
                assert got == want, (field, step)
                assert loose_state(builders[0]) == loose_state(builders[1]), (field, step)
        for field in ("_values", "_arena", "_kernel", "_grid"):
            compiled = k.builder()
            delattr(compiled, field)
            with pytest.raises(AttributeError, match=field):
                compiled.arg(x).finalize_unchecked()


@compiled_only
async def test_compiled_builder_leaks_nothing():
    """Building and dropping launches returns every reference it took: the
    arrays', the kernel's and the types' (the compiled types count their
    instances)."""
    k = trio_cuda.Kernel.from_source("", "k", params=[In("f4")] * 4 + [Scalar("i4")])
    async with trio_cuda.open_scope(device="sim") as gpu:
        a, b, c, d = (gpu.zeros(8, "f4") for _ in range(4))
        part = a[:2]  # (made once: a view dropped queues its release for the loop's next look)
        n = np.int32(8)

        def build() -> Any:
            launch = k.builder().grid(1).block(1).arg(a).arg(b).arg(c, access="readwrite").arg(d).arg(n)
            built = launch.finalize_unchecked()
            built.prepared.arg_views()
            k.builder().arg(a).arg(part).arg(None)  # (an error on the reference's path)

        def counts() -> list[int]:
            gc.collect()
            lazy = type(k.builder().finalize_unchecked().prepared.args)
            held = (
                a,
                b,
                c,
                d,
                a._alloc,
                a._alloc.table,
                n,
                k,
                type(k.builder()),
                _builder._BuilderBase,
                lazy,
            )
            return [sys.getrefcount(o) for o in held]

        for _ in range(50):  # caches filled
            try:
                build()
            except trio_cuda.KernelArgumentError:
                pass
        before = counts()
        for _ in range(500):
            try:
                build()
            except trio_cuda.KernelArgumentError:
                pass
        assert counts() == before


@compiled_only
def test_compiled_methods_carry_the_reference_docs():
    for name in _builder._COMPILED_METHODS:
        method = getattr(trio_cuda.LaunchBuilder, name)
        assert method.__doc__ == inspect.getdoc(getattr(_builder._PyBuilder, name)), name
    assert str(inspect.signature(trio_cuda.LaunchBuilder.arg)) == "(self, /, value, *, access=None)"


@pytest.mark.parametrize(
    ("env", "blocked", "want"),
    [
        ({"TRIO_CUDA_PURE": "1"}, False, "_PyBuilder"),
        ({"TRIO_CUDA_PURE": "0"}, True, "_PyBuilder"),
        ({"TRIO_CUDA_PURE": "0"}, False, "compiled"),
    ],
)
def test_the_builder_is_chosen_at_import(env, blocked, want):
    """``TRIO_CUDA_PURE`` or a missing extension give the reference builder,
    which builds as the compiled one does."""
    if want == "compiled" and not _builder.compiled() and os.environ.get("TRIO_CUDA_PURE", "0") in ("", "0"):
        pytest.skip("the compiled builder was not built at install")
    if want == "compiled" and not _builder.compiled():
        pytest.skip("TRIO_CUDA_PURE is set for this run")
    code = textwrap.dedent(
        f"""
        import sys
        if {blocked!r}:
            class Block:
                def find_spec(self, name, path=None, target=None):
                    if name == "trio_cuda._core._claunch":
                        raise ImportError("blocked")
            sys.meta_path.insert(0, Block())
        import trio, numpy as np, trio_cuda
        from trio_cuda._core import _builder
        base = trio_cuda.LaunchBuilder.__mro__[1]
        print("compiled" if _builder.compiled() else base.__name__)
        assert (base is _builder._PyBuilder) != _builder.compiled()
        def fill(x, n):
            x[:] = n
        async def main():
            k = trio_cuda.Kernel.from_source(
                'extern "C" __global__ void k(float* x, int n) {{}}', "k",
                params=[trio_cuda.Out("f4"), trio_cuda.Scalar("i4")], reference=fill,
            )
            async with trio_cuda.open_scope(device="sim") as gpu:
                x = gpu.zeros(4, "f4")
                out = await gpu.run(k.builder().grid(1).arg(x).arg(np.int32(7)).finalize_unchecked())
                assert out is x and (await gpu.to_host(x) == 7).all()
        trio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == want
