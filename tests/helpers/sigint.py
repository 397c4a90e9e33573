"""Ctrl-C in the child processes of the tests that send SIGINT.

A process started with SIGINT ignored (a suite started in the background by a
non-interactive shell) passes ``SIG_IGN`` on to the processes it starts, and
Python leaves it ignored there: SIGINT raises no ``KeyboardInterrupt``, and
Trio installs no handler of its own (it does so only over
``signal.default_int_handler``). A child started through :func:`python`
first makes SIGINT raise ``KeyboardInterrupt`` again, as Python's start-up
does where SIGINT is not ignored, whatever the child inherited; that is sound
for a child that exists to be interrupted. :func:`ignoring_sigint` starts a
command the way such a shell does, to test exactly that.

A test that needs Ctrl-C in the test process itself cannot be helped this
way: it must skip where ``signal.getsignal(signal.SIGINT) is signal.SIG_IGN``
(no test here does: every SIGINT goes to a child).
"""

from __future__ import annotations

import sys

#: Python source that makes SIGINT raise KeyboardInterrupt (Python's own default)
RESTORE = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"


def python(*args: str) -> list[str]:
    """The command line of ``python -c CODE ...`` or ``python -m MODULE ...``
    (``sys.executable``) that restores SIGINT's default before anything else
    runs. ``CODE`` may not start with a ``from __future__`` import."""
    if len(args) >= 2 and args[0] == "-c":
        return [sys.executable, "-c", f"{RESTORE}\n{args[1]}", *args[2:]]
    if len(args) >= 2 and args[0] == "-m":
        run = f"import runpy; runpy.run_module({args[1]!r}, run_name='__main__', alter_sys=True)"
        return [sys.executable, "-c", f"{RESTORE}\n{run}", *args[2:]]
    raise ValueError(f"args: expected '-c', CODE, ... or '-m', MODULE, ..., got {args!r}")


def ignoring_sigint(command: list[str]) -> list[str]:
    """``command`` (a program and its arguments) started with SIGINT ignored,
    as a background job of a non-interactive shell starts it."""
    launcher = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    launcher += "os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", launcher, *command]
