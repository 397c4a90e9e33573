"""The code blocks of README.md and docs/ run as tests (Sybil), on the simulator.

How a page's blocks run:

* Every ``python`` block runs, in order, in one namespace per page.
* A block that calls ``trio.run(...)`` at its top level is a complete program
  and runs as it is.
* Any other block runs inside the page's own Trio run (a thread started for
  the page), as if typed into ``python -m trio``: top-level ``await``,
  ``async with`` and ``async for`` work, and all such blocks of a page run in
  one task. ``exit_stack`` is a ``contextlib.AsyncExitStack`` closed in that
  task after the page's last block, so a page opens its ``gpu`` once, usually
  in an ``invisible-code-block``::

      gpu = await exit_stack.enter_async_context(trio_cuda.open_scope(device=sim))

* A ``pycon`` block is such a session with its output: each ``>>>`` statement
  runs in the page's Trio run and what it prints (or the exception it raises,
  after ``Traceback (most recent call last):``) must match, as in doctest.
* ``:class: fragment`` marks a block that is deliberately incomplete: it is
  compiled, not run. ``:class: gpu`` marks a block that needs a real GPU: it is
  marked ``gpu`` (``pytest -m gpu``), and skipped without a CUDA device or
  without the libraries it imports (CuPy, PyTorch, ...). A gpu block must not
  rely on the page's other blocks: under ``-m gpu`` it runs alone.
* Sybil's ``.. skip: start if(CONDITION, reason="...")`` ... ``.. skip: end``
  comments skip the blocks between them (in ``.rst`` pages), e.g. where an
  optional dependency is not installed.
* After a page, its scopes are closed and every ``SimDevice`` and ``SimHost``
  left in its namespace must show no memcheck violation and no live
  allocation.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import doctest
import importlib.util
import inspect
import io
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import trio
from sybil import Document, Example, Region, Sybil
from sybil.integration.pytest import SybilItem
from sybil.parsers.markdown.codeblock import CodeBlockParser as MarkdownCodeBlockParser
from sybil.parsers.rest.codeblock import CodeBlockParser as RestCodeBlockParser
from sybil.parsers.rest.skip import SkipParser as RestSkipParser

#: seconds one block may take before it is cancelled and fails
BLOCK_TIMEOUT = 60.0

_PAGE = "_doc_page"


class _Page:
    """One Trio run in a thread, whose one task runs a page's blocks in turn."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace
        self.exit_stack = contextlib.AsyncExitStack()
        self._token: trio.lowlevel.TrioToken | None = None
        self._jobs: trio.MemorySendChannel[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]
        self._cancel_scope = trio.CancelScope()
        self._thread: threading.Thread | None = None
        self._ended: concurrent.futures.Future[None] = concurrent.futures.Future()

    def _start(self) -> None:
        started: concurrent.futures.Future[None] = concurrent.futures.Future()

        def main() -> None:
            try:
                trio.run(self._main, started)
            except BaseException as exc:
                if not started.done():
                    started.set_exception(exc)
                self._ended.set_exception(exc)
            else:
                self._ended.set_result(None)

        self._thread = threading.Thread(target=main, name="doc-page", daemon=True)
        self._thread.start()
        started.result(timeout=BLOCK_TIMEOUT)

    async def _main(self, started: concurrent.futures.Future[None]) -> None:
        send, receive = trio.open_memory_channel[Any](1)
        self._jobs = send
        self._token = trio.lowlevel.current_trio_token()
        # No cancel scope per block: a block may enter a scope (a nursery) into exit_stack,
        # which must stay open past the block. A block that hangs cancels the whole page.
        with trio.CancelScope() as self._cancel_scope:
            started.set_result(None)
            async with self.exit_stack:
                async for job in receive:
                    if job is None:
                        break
                    fn, result = job
                    try:
                        value = fn()
                        if inspect.iscoroutine(value):
                            value = await value
                    except BaseException as exc:
                        result.set_exception(exc)
                    else:
                        result.set_result(value)

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` (awaiting what it returns) in the page's task; its result or exception."""
        if self._thread is None:
            self._start()
        if self._ended.done():
            raise RuntimeError("the page's Trio run has ended (an earlier block hung or broke it)")
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        trio.from_thread.run_sync(self._jobs.send_nowait, (fn, result), trio_token=self._token)
        try:
            return result.result(timeout=BLOCK_TIMEOUT)
        except concurrent.futures.TimeoutError:
            trio.from_thread.run_sync(self._cancel_scope.cancel, trio_token=self._token)
            raise TimeoutError(f"the block did not finish within {BLOCK_TIMEOUT} s; page cancelled") from None

    def close(self) -> None:
        """Close ``exit_stack`` (the page's scopes exit) and end the page's Trio run."""
        if self._thread is None:
            return
        if not self._ended.done():
            trio.from_thread.run_sync(self._jobs.send_nowait, None, trio_token=self._token)
        self._thread.join(timeout=BLOCK_TIMEOUT)
        if self._thread.is_alive():
            raise TimeoutError(f"the page's scopes did not exit within {BLOCK_TIMEOUT} s")
        self._ended.result()


def _setup(namespace: dict[str, Any]) -> None:
    # A page may configure logging (logging.basicConfig); the root logger is restored after it.
    namespace["_doc_logging"] = (logging.root.level, logging.root.handlers[:])
    # ... and runs in a temporary directory, where the files it writes (traces) go.
    namespace["_doc_cwd"] = os.getcwd()
    namespace["_doc_tmp"] = tempfile.mkdtemp(prefix="doc-page-")
    os.chdir(namespace["_doc_tmp"])
    page = _Page(namespace)
    namespace[_PAGE] = page
    namespace["__name__"] = "__main__"
    namespace["exit_stack"] = page.exit_stack


def _teardown(namespace: dict[str, Any]) -> None:
    from trio_cuda.testing import SimDevice, SimHost

    try:
        namespace[_PAGE].close()
    finally:
        logging.root.setLevel(namespace["_doc_logging"][0])
        logging.root.handlers[:] = namespace["_doc_logging"][1]
        os.chdir(namespace["_doc_cwd"])
        shutil.rmtree(namespace["_doc_tmp"], ignore_errors=True)
    for name, value in namespace.items():
        if isinstance(value, SimDevice | SimHost):
            assert value.violations == [], f"{name}: memcheck violations {value.violations}"
            devices = list(value) if isinstance(value, SimHost) else [value]
            for device in devices:
                assert device.live_allocations == [], f"{name}: never freed {device.live_allocations}"


# -- blocks ------------------------------------------------------------------------------------------------


def _classes(region: Region) -> set[str]:
    options = region.lexemes.get("options") or {}
    return set(options.get("class", "").split())


def _is_program(tree: ast.Module) -> bool:
    """Whether a block calls trio.run() at its top level (or under ``if __name__ == ...``)."""
    body = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.If):
            body.extend(node.body)
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "run"
                and isinstance(func.value, ast.Name)
                and func.value.id == "trio"
            ):
                return True
    return False


def _missing_imports(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return sorted({n.split(".")[0] for n in names if importlib.util.find_spec(n.split(".")[0]) is None})


def _skip_unless_gpu(tree: ast.Module | None) -> None:
    from trio_cuda._backends import probe_cuda

    probe = probe_cuda()
    if not probe.available:
        pytest.skip(f"needs a CUDA device: {probe.reason}")
    if tree is not None and (missing := _missing_imports(tree)):
        pytest.skip(f"needs {', '.join(missing)}")


def _compile(source: str, path: str, mode: str = "exec") -> Any:
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    return compile(source, path, mode, flags=flags, dont_inherit=True)


def _pad(example: Example) -> str:
    """The block's source, moved down to its line in the page (for tracebacks)."""
    return "\n" * (example.line + example.parsed.line_offset) + example.parsed


def evaluate_python(example: Example) -> None:
    __tracebackhide__ = True
    classes = _classes(example.region)
    source = _pad(example)
    code = _compile(source, example.path)
    if "fragment" in classes:
        return  # compiled: it is valid Python; deliberately not run
    tree = ast.parse(source, example.path)
    if "gpu" in classes:
        _skip_unless_gpu(tree)
    namespace = example.namespace
    if _is_program(tree):
        exec(code, namespace)
    else:
        namespace[_PAGE].run(lambda: eval(code, namespace))


def evaluate_pycon(example: Example) -> str | None:
    """A ``python -m trio`` session: each statement runs in the page's Trio run; output compared."""
    __tracebackhide__ = True
    classes = _classes(example.region)
    parser = doctest.DocTestParser()
    examples = parser.get_examples(str(example.parsed))
    if not examples:
        return f"no '>>>' statement in the pycon block at line {example.line}"
    for ex in examples:
        _compile(ex.source, example.path, "single")
    if "fragment" in classes:
        return None
    if "gpu" in classes:
        _skip_unless_gpu(None)
    namespace = example.namespace
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for ex in examples:
        pad = example.line + example.parsed.line_offset + ex.lineno
        line = pad + 1  # of the '>>>'
        code = _compile("\n" * pad + ex.source, example.path, "single")
        out = io.StringIO()

        def run(code: Any = code, out: io.StringIO = out) -> Any:
            async def body() -> None:
                with contextlib.redirect_stdout(out):
                    value = eval(code, namespace)
                    if inspect.iscoroutine(value):
                        await value

            return body()

        try:
            namespace[_PAGE].run(run)
        except Exception as exc:
            if ex.exc_msg is None:
                raise
            got = f"{_public_name(type(exc))}: {exc}\n"
            if not checker.check_output(ex.exc_msg, got, flags):
                return f"line {line}: {ex.source.strip()}\nexpected:\n{ex.exc_msg}got:\n{got}"
            continue
        if ex.exc_msg is not None:
            return f"line {line}: {ex.source.strip()}\nexpected {ex.exc_msg.strip()}, but nothing was raised"
        if not checker.check_output(ex.want, out.getvalue(), flags):
            return f"line {line}: {ex.source.strip()}\nexpected:\n{ex.want}got:\n{out.getvalue()}"
    return None


def _public_name(cls: type) -> str:
    """``trio_cuda.X`` for an exported class, else its module and name (``builtins`` left out)."""
    module = cls.__module__
    if module.startswith("trio_cuda"):
        import trio_cuda

        if getattr(trio_cuda, cls.__name__, None) is cls:
            return f"trio_cuda.{cls.__name__}"
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


class _Blocks:
    """Yield the regions of ``language`` found by a Sybil code-block parser, with our evaluator."""

    def __init__(self, parser: Any, evaluator: Callable[[Example], str | None]) -> None:
        self.parser = parser
        self.evaluator = evaluator

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.parser(document):
            region.evaluator = self.evaluator
            yield region


def pytest_itemcollected(item: pytest.Item) -> None:
    if isinstance(item, SybilItem) and "gpu" in _classes(item.example.region):
        item.add_marker(pytest.mark.gpu)


_sybil = Sybil(
    parsers=[
        _Blocks(RestCodeBlockParser("python"), evaluate_python),
        _Blocks(RestCodeBlockParser("pycon"), evaluate_pycon),
        RestSkipParser(),
    ],
    patterns=["docs/*.rst", "docs/*/*.rst"],
    setup=_setup,
    teardown=_teardown,
    name="rst",
) + Sybil(
    parsers=[
        _Blocks(MarkdownCodeBlockParser("python"), evaluate_python),
        _Blocks(MarkdownCodeBlockParser("pycon"), evaluate_pycon),
    ],
    patterns=["README.md", "docs/design/*.md"],
    setup=_setup,
    teardown=_teardown,
    name="md",
)

pytest_collect_file = _sybil.pytest()
