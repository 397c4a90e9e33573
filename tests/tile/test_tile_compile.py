"""Tile kernel specialisation, ahead-of-time compilation and the cubin cache
(trio_cuda._tile.compile). Compiles a few small kernels for sm_90 with the
installed cuTile toolchain; no GPU is needed."""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ct = pytest.importorskip("cuda.tile", reason="cuda-tile is not installed: pip install 'trio_cuda[tile]'")
comp = importlib.import_module("cuda.tile.compilation")

from tests.helpers import internals  # noqa: E402
from trio_cuda import KernelArgumentError, TileCompileError, TileToolchainError, TrioCudaError  # noqa: E402
from trio_cuda._tile import compile as tc  # noqa: E402
from trio_cuda._tile.compile import (  # noqa: E402
    ArraySpec,
    ConstantSpec,
    ListSpec,
    ScalarSpec,
    TileCache,
    TileSignature,
    TupleSpec,
    address_alignment,
    compile_tile,
    param_layout,
    spec_of_array,
)

# --------------------------------------------------------------------------- kernels


@ct.kernel
def vadd(a, b, out, n: ct.Constant[int]):  # type: ignore[no-untyped-def]
    i = ct.bid(0)
    ct.store(out, index=(i,), tile=ct.load(a, index=(i,), shape=(n,)) + ct.load(b, index=(i,), shape=(n,)))


@ct.kernel
def matmul(a, b, c, alpha, tm: ct.Constant[int], tn: ct.Constant[int], tk: ct.Constant[int]):  # type: ignore[no-untyped-def]
    bx = ct.bid(0)
    by = ct.bid(1)
    acc = ct.full((tm, tn), 0, dtype=ct.float32)
    for k in range(ct.num_tiles(a, axis=1, shape=(tm, tk))):
        x = ct.load(a, index=(bx, k), shape=(tm, tk))
        y = ct.load(b, index=(k, by), shape=(tk, tn))
        acc = ct.mma(x, y, acc)
    ct.store(c, index=(bx, by), tile=(acc * alpha).astype(c.dtype))


BAD_LINE = 0


@ct.kernel
def bad(a, out):  # type: ignore[no-untyped-def]
    i = ct.bid(0)
    t = ct.load(a, index=(i, i), shape=(16,))  # BAD
    ct.store(out, index=(i,), tile=t)


BAD_LINE = next(
    n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith("# BAD")
)

F32 = spec_of_array("float32", (1024,), alignment=256)
VADD = TileSignature([F32, F32, F32, ConstantSpec(16)])


def _matmul_signature() -> TileSignature:
    a = spec_of_array("float16", (64, 64), alignment=256)  # int32 index
    b = spec_of_array("float16", (64, 64), alignment=256, index_dtype="int64")
    c = spec_of_array("float32", (64, 64), alignment=256)
    return TileSignature(
        [a, b, c, ScalarSpec("float32"), ConstantSpec(32), ConstantSpec(32), ConstantSpec(16)]
    )


# --------------------------------------------------------------------------- ELF helpers


def _sections(cubin: bytes) -> dict[str, bytes]:
    assert cubin[:4] == b"\x7fELF"
    assert cubin[4] == 2
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for h in headers:
        end = cubin.index(b"\0", names_at + h[0])
        out[cubin[names_at + h[0] : end].decode()] = cubin[h[4] : h[4] + h[5]]
    return out


def _symbols(cubin: bytes) -> set[str]:
    secs = _sections(cubin)
    symtab, strtab = secs[".symtab"], secs[".strtab"]
    names = set()
    for i in range(0, len(symtab), 24):
        (name,) = struct.unpack_from("<I", symtab, i)
        names.add(strtab[name : strtab.index(b"\0", name)].decode())
    return names


def _kernel_params(cubin: bytes, symbol: str) -> list[tuple[int, int]]:
    """(offset, size) of each kernel parameter, by ordinal, from the cubin's
    EIATTR_KPARAM_INFO records."""
    info = _sections(cubin)[f".nv.info.{symbol}"]
    params: dict[int, tuple[int, int]] = {}
    i = 0
    while i < len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == 4:  # EIFMT_SVAL: u16 size, payload
            (size,) = struct.unpack_from("<H", info, i + 2)
            payload = info[i + 4 : i + 4 + size]
            i += 4 + size
            if attr in (0x17, 0x45):  # EIATTR_KPARAM_INFO and its second form
                _, ordinal, offset, flags = struct.unpack("<IHHI", payload)
                params[ordinal] = (offset, (flags >> 18) & 0x3FFF if attr == 0x17 else flags & 0xFFFF)
        else:
            i += 4
    assert sorted(params) == list(range(len(params)))
    return [params[k] for k in sorted(params)]


def _flat(image: tc.TileImage) -> list[tuple[int, int]]:
    return [(s.offset, s.size) for p in image.layout for s in p.slots]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    tc.clear_memory_cache()
    yield
    tc.clear_memory_cache()


@pytest.fixture
def count_exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = comp.export_kernel

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(comp, "export_kernel", counting)
    return calls


def _refuse_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("compiled although the cache holds the entry")

    monkeypatch.setattr(comp, "export_kernel", refuse)
    monkeypatch.setattr(tc, "_preflight", refuse)
    monkeypatch.setattr(tc, "_tileiras_version", refuse)


# --------------------------------------------------------------------------- compile and layout


def test_vadd_cubin_symbol_and_layout(tmp_path: Path) -> None:
    image = compile_tile(vadd, VADD, cache=TileCache(tmp_path))
    assert image.origin == "compiled"
    assert image.arch == "sm_90"
    assert image.symbol in _symbols(image.cubin)
    # three rank-1 int32 arrays: pointer, shape, stride; the constant has no slot
    kinds = [[(s.kind, s.dtype.name) for s in p.slots] for p in image.layout]
    assert kinds[:3] == [[("pointer", "uint64"), ("shape", "int32"), ("stride", "int32")]] * 3
    assert kinds[3] == []
    assert _flat(image) == _kernel_params(image.cubin, image.symbol)
    assert image.param_size == 48
    assert image.cutile_version == ct.__version__
    assert image.compiler_version
    assert "release" in image.compiler_version


def test_matmul_layout_rank2_int32_int64_scalar(tmp_path: Path) -> None:
    image = compile_tile(matmul, _matmul_signature(), cache=TileCache(tmp_path))
    assert image.symbol in _symbols(image.cubin)
    a, b, _c, alpha, *consts = image.layout
    assert [(s.kind, s.dim, s.size) for s in a.slots] == [
        ("pointer", None, 8),
        ("shape", 0, 4),
        ("shape", 1, 4),
        ("stride", 0, 4),
        ("stride", 1, 4),
    ]
    assert [(s.kind, s.size) for s in b.slots] == [("pointer", 8)] + [("shape", 8)] * 2 + [("stride", 8)] * 2
    assert b.slots[0].offset == 24  # after a's 24 bytes, 8-aligned
    assert [(s.kind, s.dtype.name) for s in alpha.slots] == [("scalar", "float32")]
    assert all(p.slots == () for p in consts)
    assert _flat(image) == _kernel_params(image.cubin, image.symbol)


def test_layout_tuples_and_lists() -> None:
    arr = ArraySpec("float32", 2, index_dtype="int64")
    sig = TileSignature(
        [ScalarSpec("int8"), TupleSpec([arr, ScalarSpec("float64"), ConstantSpec(3)]), ListSpec(arr)]
    )
    layout, size = param_layout(sig)
    flat = [(s.kind, s.offset, s.size, s.path) for p in layout for s in p.slots]
    assert flat[0] == ("scalar", 0, 1, ())
    assert flat[1] == ("pointer", 8, 8, (0,))
    assert [f[0] for f in flat[2:6]] == ["shape", "shape", "stride", "stride"]
    assert flat[6] == ("scalar", 48, 8, (1,))
    assert flat[7:] == [("list_pointer", 56, 8, ()), ("list_length", 64, 4, ())]
    assert size == 68


def test_one_compile_per_signature_under_threads(tmp_path: Path, count_exports: list[int]) -> None:
    cache = TileCache(tmp_path)
    sig = TileSignature([F32, F32, F32, ConstantSpec(32)])
    results: list[tc.TileImage] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        try:
            results.append(compile_tile(vadd, sig, cache=cache))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(count_exports) == 1
    assert len(results) == 8
    assert all(r is results[0] for r in results)
    # and again: from memory, no compile
    assert compile_tile(vadd, sig, cache=cache) is results[0]
    assert len(count_exports) == 1


# --------------------------------------------------------------------------- the disk cache


def test_cache_hit_needs_no_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = compile_tile(vadd, VADD, cache=TileCache(tmp_path))
    tc.clear_memory_cache()
    _refuse_compile(monkeypatch)
    hit = compile_tile(vadd, VADD, cache=TileCache(tmp_path))
    assert hit.origin == "disk"
    assert (hit.cubin, hit.symbol, hit.layout, hit.param_size) == (
        first.cubin,
        first.symbol,
        first.layout,
        first.param_size,
    )
    assert hit.compiler_version == first.compiler_version  # recorded in the entry
    # without a cache, the same call needs the compiler
    tc.clear_memory_cache()
    with pytest.raises(AssertionError, match="compiled although"):
        compile_tile(vadd, VADD)


def _write_module(path: Path, name: str, text: str) -> Any:
    file = path / f"{name}.py"
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


KERNEL_SRC = """
import cuda.tile as ct
SIZE = {size}

def helper(t):
    return t {op} t

@ct.kernel
def k(a, out):
    i = ct.bid(0)
    ct.store(out, index=(i,), tile=helper(ct.load(a, index=(i,), shape=(SIZE,))))
"""


def test_key_covers_source_helpers_globals_signature_arch_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def key_of(
        size: int = 16, op: str = "+", sig: TileSignature | None = None, tag: str | None = None
    ) -> str:
        name = f"tile_key_mod_{size}_{'p' if op == '+' else 'm'}"
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        try:
            module = _write_module(directory, name, KERNEL_SRC.format(size=size, op=op))
            return internals.tile_cache_key(module.k, sig or TileSignature([F32, F32]), tag)
        finally:
            sys.modules.pop(name, None)

    base = key_of()
    assert key_of() == base  # same text elsewhere: same key (no paths in it)
    keys = {
        base,
        key_of(op="*"),  # a helper's source
        key_of(size=32),  # a module constant
        key_of(sig=TileSignature([F32, spec_of_array("float32", (1024,), alignment=16)])),
        key_of(sig=TileSignature([F32, F32], arch="sm_100")),
        key_of(tag="tileiras 13.5"),
    }
    assert len(keys) == 6
    monkeypatch.setattr(tc, "_cutile_version", lambda: "1.7.1")
    assert key_of() != base


def test_cache_key_ignores_compiler_tag_of_other_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_tile(vadd, VADD, cache=TileCache(tmp_path))
    tc.clear_memory_cache()
    _refuse_compile(monkeypatch)
    with pytest.raises(AssertionError, match="compiled although"):
        compile_tile(vadd, VADD, cache=TileCache(tmp_path, compiler_version="13.5"))


def test_corrupt_entry_is_recompiled(tmp_path: Path, count_exports: list[int]) -> None:
    cache = TileCache(tmp_path)
    image = compile_tile(vadd, VADD, cache=cache)
    entry = cache.entry_path(image.key)
    good = entry.read_bytes()
    for damaged in (b"", b"garbage", good[:-7], good[:-1] + bytes([good[-1] ^ 1])):
        entry.write_bytes(damaged)
        tc.clear_memory_cache()
        before = tc.compile_statistics()["disk_errors"]
        again = compile_tile(vadd, VADD, cache=cache)
        assert again.origin == "compiled"
        assert again.cubin[:4] == b"\x7fELF"
        assert tc.compile_statistics()["disk_errors"] >= before + (1 if damaged else 0)
        assert cache.load(image.key) is not None  # rewritten whole
    assert len(count_exports) == 5


def test_cache_writes_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = TileCache(tmp_path / "new" / "dir")  # created on first write
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace

    def failing_replace(src: Any, dst: Any) -> None:
        replaced.append((str(src), str(dst)))
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    before = tc.compile_statistics()["disk_errors"]
    image = compile_tile(vadd, VADD, cache=cache)  # a failed write is not an error
    assert image.origin == "compiled"
    assert tc.compile_statistics()["disk_errors"] == before + 1
    (src, dst) = replaced[0]
    assert Path(src).parent == Path(dst).parent == cache.path
    assert dst == str(cache.entry_path(image.key))
    assert list(cache.path.iterdir()) == []  # neither the entry nor a temporary file

    monkeypatch.setattr(os, "replace", real_replace)
    tc.clear_memory_cache()
    compile_tile(vadd, VADD, cache=cache)
    assert [p.name for p in cache.path.iterdir()] == [f"{image.key}.cubin"]


def test_default_cache_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_CUDA_TILE_CACHE", str(tmp_path / "t"))
    assert TileCache.default() == TileCache(tmp_path / "t")
    monkeypatch.setenv("TRIO_CUDA_TILE_CACHE", "")
    assert TileCache.default() is None
    monkeypatch.delenv("TRIO_CUDA_TILE_CACHE")
    monkeypatch.setenv("TRIO_CUDA_CACHE_DIR", str(tmp_path / "c"))
    assert TileCache.default() == TileCache(tmp_path / "c" / "tile")
    monkeypatch.delenv("TRIO_CUDA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert TileCache.default() == TileCache(tmp_path / "x" / "trio_cuda" / "tile")


# --------------------------------------------------------------------------- errors


def test_compile_error_carries_cutile_message_and_location() -> None:
    with pytest.raises(TileCompileError) as info:
        compile_tile(bad, TileSignature([F32, F32]))
    err = info.value
    assert isinstance(err, TrioCudaError)
    assert err.kernel == "bad"
    assert err.filename == __file__
    assert err.line == BAD_LINE
    assert err.message
    assert err.message in str(err)
    assert f"{__file__}:{BAD_LINE}:" in str(err)
    clone = pickle.loads(pickle.dumps(err))
    assert (type(clone), str(clone), clone.line) == (TileCompileError, str(err), err.line)


def test_bad_signatures_are_kernel_argument_errors() -> None:
    with pytest.raises(KernelArgumentError, match=r"takes 4 parameters \(a, b, out, n\), got 3"):
        compile_tile(vadd, TileSignature([F32, F32, F32]))
    with pytest.raises(KernelArgumentError, match="Constant"):
        compile_tile(vadd, TileSignature([F32, F32, F32, F32]))
    with pytest.raises(KernelArgumentError, match="dtype"):
        compile_tile(vadd, TileSignature([ArraySpec(">f4", 1), F32, F32, ConstantSpec(16)]))
    with pytest.raises(TypeError, match="kernel"):
        compile_tile(lambda: None, VADD)
    with pytest.raises(TypeError, match="signature"):
        compile_tile(vadd, [F32])  # type: ignore[arg-type]


def test_missing_cuda_tile_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.tile", None)
    with pytest.raises(TileToolchainError) as info:
        compile_tile(vadd, VADD)
    text = str(info.value)
    assert "pip install 'trio_cuda[tile]'" in text
    assert "\n" not in text
    assert "cuda.tile is not importable" in info.value.reason


def test_missing_or_broken_tileiras_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    internals = importlib.import_module("cuda.tile._compile")
    monkeypatch.setattr(tc, "_preflight_ok", set())

    def missing() -> Any:
        raise FileNotFoundError("'tileiras' compiler not found")

    monkeypatch.setattr(internals, "_find_compiler_bin", missing)
    with pytest.raises(
        TileToolchainError, match=r"tileiras compiler is not installed\): pip install 'trio_cuda\[tile\]'"
    ):
        compile_tile(vadd, VADD)

    class Broken:
        path = "/opt/tileiras"

        def run(self, args: Any, flags: Any, timeout_sec: Any = None) -> None:
            raise ct.TileCompilerExecutionError(5, "failed to compile Tile IR program", None, "", None)

    monkeypatch.setattr(internals, "_find_compiler_bin", lambda: Broken())
    with pytest.raises(TileToolchainError) as info:
        compile_tile(vadd, VADD)
    assert "ptxas or libnvvm" in str(info.value)
    assert "failed to compile Tile IR program" in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- specs


def test_spec_of_array_claims_only_what_is_guaranteed() -> None:
    c = spec_of_array("float16", (64, 48), alignment=256)
    assert (c.ndim, c.index_dtype, c.strides, c.base_align) == (2, "int32", (None, 1), 256)
    assert c.shape_divisible_by == (16, 16)
    assert c.stride_divisible_by == (16, 1)
    assert not c.may_alias_internally
    t = spec_of_array("float32", (48, 64), (1, 48), alignment=4)  # transposed
    assert t.strides == (1, None)
    assert t.stride_divisible_by == (1, 16)
    odd = spec_of_array("float32", (6, 3), (3, 1))
    assert odd.shape_divisible_by == (2, 1)
    assert odd.stride_divisible_by == (1, 1)
    assert spec_of_array("int8", (4, 5), (0, 1)).may_alias_internally  # broadcast
    assert spec_of_array("int8", (4, 5), (2, 1)).may_alias_internally  # rows overlap
    assert not spec_of_array("int8", (1, 5), (0, 1)).may_alias_internally
    assert spec_of_array("float32", (2**31,)).index_dtype == "int64"
    assert spec_of_array("float32", (2, 2**30), (2**30, 1)).index_dtype == "int32"  # offsets fit
    assert spec_of_array("float32", (3, 2**30), (2**30, 1)).index_dtype == "int64"  # offsets
    with pytest.raises(KernelArgumentError, match="needs 'int64'"):
        spec_of_array("float32", (2**31,), index_dtype="int32")
    with pytest.raises(KernelArgumentError, match="negative strides"):
        spec_of_array("float32", (4,), (-1,))
    assert address_alignment(0x1000) == 256
    assert address_alignment(0x1008) == 8
    assert address_alignment(0x1000, guaranteed=16) == 16


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="base_align"):
        ArraySpec("float32", 1, base_align=3)
    with pytest.raises(ValueError, match="strides: expected 2 values"):
        ArraySpec("float32", 2, strides=(1,))
    with pytest.raises(ValueError, match="divisible"):
        ArraySpec("float32", 1, strides=(3,), stride_divisible_by=(2,))
    with pytest.raises(ValueError, match="index_dtype"):
        ArraySpec("float32", 1, index_dtype="int16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="value"):
        ConstantSpec("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="params"):
        TileSignature([np.float32])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="arch"):
        TileSignature([], arch="90")
    # 1, True and 1.0 are different constants; equal signatures have equal keys
    keys = {TileSignature([ConstantSpec(v)]).key() for v in (1, True, 1.0)}
    assert len(keys) == 3
    assert (
        TileSignature([F32]).key() == TileSignature([spec_of_array("float32", (1024,), alignment=256)]).key()
    )


@ct.kernel
def mixed(flag, xs, i16, out, d, h, q):  # type: ignore[no-untyped-def]
    i = ct.bid(0)
    v = ct.load(xs[1], index=(i,), shape=(16,)) + d + h + q + i16
    if flag:
        ct.store(out, index=(i,), tile=v.astype(out.dtype))


def test_layout_scalars_and_list_match_the_cubin() -> None:
    element = ArraySpec("float32", 1, strides=(1,), base_align=16)
    sig = TileSignature(
        [
            ScalarSpec("bool"),
            ListSpec(element),
            ScalarSpec("int16"),
            F32,
            ScalarSpec("float64"),
            ScalarSpec("float16"),
            ScalarSpec("int64"),
        ]
    )
    image = compile_tile(mixed, sig)
    assert [s.kind for s in image.layout[1].slots] == ["list_pointer", "list_length"]
    assert [s.size for p in image.layout for s in p.slots if s.kind == "scalar"] == [1, 2, 8, 2, 8]
    assert _flat(image) == _kernel_params(image.cubin, image.symbol)


def test_memory_hit_fills_another_cache_without_compiling(tmp_path: Path, count_exports: list[int]) -> None:
    first = compile_tile(vadd, VADD)
    other = TileCache(tmp_path)
    assert compile_tile(vadd, VADD, cache=other) is first
    assert len(count_exports) == 1
    entry = other.load(first.key)
    assert entry is not None
    assert entry["cubin"] == first.cubin
    assert entry["symbol"] == first.symbol


def test_numpy_constants_are_python_values() -> None:
    assert ConstantSpec(np.int64(16)) == ConstantSpec(16)
    assert type(ConstantSpec(np.float32(0.5)).value) is float
    assert ConstantSpec(np.bool_(True)).value is True
    assert TileSignature([ConstantSpec(np.int32(3))]).key() == TileSignature([ConstantSpec(3)]).key()


HELPER_SRC = """
import cuda.tile as ct
import functools

@ct.function
def scale(t):
    return t * {factor}

@ct.kernel
def k(a, out):
    i = ct.bid(0)
    ct.store(out, index=(i,), tile=scale(ct.load(a, index=(i,), shape=(16,))))
"""


def test_digest_follows_decorated_helpers(tmp_path: Path) -> None:
    digests = []
    for factor in (2, 3):
        name = f"tile_helper_mod_{factor}"
        try:
            module = _write_module(tmp_path, name, HELPER_SRC.format(factor=factor))
            digests.append(tc.kernel_digest(module.k))
        finally:
            sys.modules.pop(name, None)
    assert digests[0] != digests[1]


def test_other_cutile_versions_use_only_the_public_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tc, "_cutile_version", lambda: "1.8.0")
    checked: set[str] = set()
    monkeypatch.setattr(tc, "_preflight_ok", checked)
    image = compile_tile(vadd, VADD)  # no preflight, no compiler version
    assert checked == set()
    assert image.compiler_version is None
    assert image.cutile_version == "1.8.0"
    assert image.symbol in _symbols(image.cubin)


def test_key_does_not_name_the_kernels_own_module(tmp_path: Path) -> None:
    """A program run as ``__main__`` and the same file imported by name (a
    test, a service) share cache entries; another module's helper stays named."""
    text = KERNEL_SRC.format(size=16, op="+")
    keys = []
    for name in ("__tile_main_like__", "tile_imported_by_name"):
        directory = tmp_path / name
        directory.mkdir()
        try:
            module = _write_module(directory, name, text)
            keys.append(internals.tile_cache_key(module.k, TileSignature([F32, F32]), None))
        finally:
            sys.modules.pop(name, None)
    assert keys[0] == keys[1]
