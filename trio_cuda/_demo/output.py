"""What the batch job (``python -m trio_cuda demo``) prints while it runs.

Invariants:

* Result lines (the header, the per-input lines of ``-v``, the summary) go to
  the output stream; the progress bar and log records go to the error stream.
  While a bar is shown, every line is written through the bar, so that a line
  never lands in the middle of the bar on a terminal that shows both streams.
* The bar is used only when asked for (``progress="bar"``, which the command
  line picks when stderr is a terminal): tqdm's where tqdm can be imported,
  else :class:`PlainBar`, one line redrawn in place. Otherwise progress is a
  plain line every so often: no carriage returns in logs and CI output.
* The bar is closed before the summary is printed, and on every way out of
  the run (an error, Ctrl-C), so the summary is never drawn over.
* A stream whose reader went away (``demo | head``) is written no more; the
  job itself goes on to its end.
* Verbosity 1 adds a line per input and the ``trio_cuda`` logger at INFO;
  verbosity 2 adds a line per step of each input and the logger at DEBUG. The
  logger's level and handlers are restored when the run ends.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Output", "PlainBar", "to_devnull"]

#: seconds between two plain progress lines when completions are slow
LINE_INTERVAL = 5.0
#: seconds between two refreshes of the bar's statistics
POSTFIX_INTERVAL = 0.2

log = logging.getLogger("trio_cuda")


def _size(stream: TextIO) -> bool:
    """Whether the terminal ``stream`` writes to reports its size."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):  # not a file, closed, or not a terminal
        return False
    return size.columns > 0 and size.lines > 0


def to_devnull(stream: TextIO) -> None:
    """Point the file descriptor under ``stream`` at /dev/null, so that the
    interpreter's last flush at exit does not fail on the broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (AttributeError, ValueError, OSError):  # not a file
        pass


class _Handler(logging.Handler):
    """Writes the ``trio_cuda`` logger's records through :class:`Output`."""

    def __init__(self, output: Output) -> None:
        super().__init__()
        self._output = output
        self.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self._output.log_line(line)


class PlainBar:
    """The progress bar where tqdm is not installed: one line on ``file``
    (``batch:  50% [############............] 8/16 inputs, 0.2 s, 3 in flight``),
    redrawn in place at most every ``mininterval`` seconds and at the end. It
    has the part of tqdm's interface that :class:`Output` uses."""

    WIDTH = 24

    def __init__(self, total: int, file: TextIO, *, desc: str = "batch", mininterval: float = 0.1) -> None:
        self.total = total
        self.n = 0
        self.file = file
        self.desc = desc
        self.mininterval = mininterval
        self.postfix = ""
        self._started = time.perf_counter()
        self._drawn = 0.0
        self._width = 0  # of the line on screen, to blank it out
        self._closed = False
        self._gone = False  # writing to ``file`` failed: the bar is drawn no more
        self._draw()

    def _line(self) -> str:
        frac = min(1.0, self.n / self.total) if self.total > 0 else 1.0
        filled = int(frac * self.WIDTH)
        line = (
            f"{self.desc}: {frac * 100:3.0f}% [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
            f"{self.n}/{self.total} inputs, {time.perf_counter() - self._started:.1f} s"
        )
        return f"{line}, {self.postfix}" if self.postfix else line

    def _put(self, text: str) -> None:
        if self._gone:
            return
        try:
            self.file.write(text)
            self.file.flush()
        except (OSError, ValueError):  # the terminal went away, or the stream was closed
            self._gone = True

    def _draw(self) -> None:
        self._drawn = time.perf_counter()
        line = self._line()
        self._put("\r" + line + " " * max(0, self._width - len(line)))
        self._width = len(line)

    def _clear(self) -> None:
        if self._width:
            self._put("\r" + " " * self._width + "\r")
            self._width = 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.total or time.perf_counter() - self._drawn >= self.mininterval:
            self._draw()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        if refresh:
            self._draw()

    def write(self, line: str, file: TextIO | None = None) -> None:
        """Print ``line`` to ``file`` (the bar's by default) above the bar."""
        if self._closed:
            print(line, file=self.file if file is None else file)
            return
        self._clear()
        target = self.file if file is None else file
        print(line, file=target)
        target.flush()
        self._draw()

    def close(self) -> None:
        """Draw the last state and end the line; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._draw()
        self._put("\n")


class Output:
    """The job's printer: lines, verbose lines, progress (bar or lines) and logging."""

    def __init__(
        self,
        out: TextIO,
        err: TextIO,
        *,
        verbose: int = 0,
        progress: str = "lines",
        progress_every: int = 0,
    ) -> None:
        if progress not in ("bar", "lines", "none"):
            raise ValueError(f"progress: expected 'bar', 'lines' or 'none', got {progress!r}")
        self.out = out
        self.err = err
        self.verbose = verbose
        self.progress = progress
        self.progress_every = progress_every
        self._bar: Any = None  # a tqdm bar or a PlainBar while one is shown
        self._total = 0
        self._every = 0
        self._started = 0.0
        self._last_line = 0.0
        self._last_postfix = 0.0
        self._handler: _Handler | None = None
        self._saved_level = logging.NOTSET
        self._gone: set[TextIO] = set()  # streams whose reader went away

    # ------------------------------------------------------------------ lines
    def _write(self, stream: TextIO, line: str) -> None:
        if stream in self._gone:
            return
        try:
            if self._bar is not None:
                self._bar.write(line, file=stream)
            else:
                print(line, file=stream)
            stream.flush()
        except BrokenPipeError:
            # The reader went away (``demo | head``): the job goes on, and
            # finishes its checks and its drain, without writing there.
            self._gone.add(stream)
            to_devnull(stream)

    def say(self, line: str) -> None:
        """A line of the job's output."""
        self._write(self.out, line)

    def detail(self, line: str) -> None:
        """A line shown with ``-v``."""
        if self.verbose >= 1:
            self.say(line)

    def debug(self, line: str) -> None:
        """A line shown with ``-vv``."""
        if self.verbose >= 2:
            self.say(line)

    def log_line(self, line: str) -> None:
        """A log record, on the error stream."""
        self._write(self.err, line)

    # ------------------------------------------------------------------ logging
    def __enter__(self) -> Output:
        if self.verbose >= 1:
            self._handler = _Handler(self)
            self._saved_level = log.level
            log.addHandler(self._handler)
            log.setLevel(logging.DEBUG if self.verbose >= 2 else logging.INFO)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_progress()
        if self._handler is not None:
            log.removeHandler(self._handler)
            log.setLevel(self._saved_level)
            self._handler = None

    # ------------------------------------------------------------------ progress
    def start_progress(self, total: int) -> None:
        """Progress of ``total`` inputs starts now."""
        self._total = total
        self._started = self._last_line = time.perf_counter()
        self._every = self.progress_every or max(1, -(-total // 8))
        if self.progress != "bar":
            return
        try:
            tqdm = importlib.import_module("tqdm").tqdm  # typed as Any: tqdm ships no stubs
        except ImportError:  # tqdm is optional: the built-in bar
            self._bar = PlainBar(total, self.err, desc="batch", mininterval=0.1)
            return
        self._bar = tqdm(
            total=total,
            # A terminal that reports no size (some CI runners, a fresh pty)
            # would get no bar at all from tqdm's own guess.
            ncols=None if _size(self.err) else 80,
            nrows=None if _size(self.err) else 24,
            desc="batch",
            unit="input",
            file=self.err,
            leave=True,
            mininterval=0.1,
            smoothing=0.1,
        )

    def completed(self, done: int, in_flight: int) -> None:
        """One more input completed: ``done`` so far, ``in_flight`` still going."""
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(1)
            if now - self._last_postfix >= POSTFIX_INTERVAL or done == self._total:
                self._last_postfix = now
                self._bar.set_postfix_str(f"{in_flight} in flight", refresh=False)
            return
        if self.progress != "lines":
            return
        if done % self._every == 0 or done == self._total or now - self._last_line >= LINE_INTERVAL:
            self._last_line = now
            self.say(
                f"progress: {done:3d}/{self._total} done, {in_flight} in flight, {now - self._started:6.3f} s"
            )

    def stop_progress(self) -> None:
        """Close the bar (it stays on screen at its last state); idempotent."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
