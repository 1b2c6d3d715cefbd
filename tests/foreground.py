"""Start a child as a terminal starts its foreground job: with SIGINT at its default disposition.

A test run started in the background of a non-interactive shell (`pytest &`, `cmd &` in a script) ignores SIGINT:
POSIX shells without job control start asynchronous commands so, an ignored signal stays ignored across fork and
exec, and Python installs its KeyboardInterrupt handler only where SIGINT was at its default. A child that tests
Ctrl-C then ignores it and the test hangs (issue 41: "the process hung (killed after 120 s)" with an empty
stderr, on a suite started in the background). Wrapping the command resets SIGINT before exec (not Popen's
preexec_fn, which can deadlock in a child forked beside threads).
"""

from __future__ import annotations

import sys

_RESET_THEN_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"
)


def as_foreground(command: list[str]) -> list[str]:
    """`command` run with SIGINT at its default (the same process: the wrapper execs it)."""
    return [sys.executable, "-c", _RESET_THEN_EXEC, *command]
