"""The terminal between `mlxpaged chat` starting and the app taking the terminal over (2-3 s of imports).

In line mode the terminal turns Enter into a line feed, which the app reads as Ctrl+J (a new line), so
a question typed and sent at launch would sit in the box unsent. Reading Enter as a carriage return
from the start, as the app will, keeps it an Enter; the text typed stays echoed and editable meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import IO

# TERMINAL_IFLAG_ENV: the input flags bootstrap.py found, where it cleared the translations before this process began.
from mlxpaged_app.bootstrap import CR_TRANSLATIONS, TERMINAL_IFLAG_ENV

try:
    import termios
except ImportError:  # no POSIX terminal here: nothing to adjust
    termios = None

# What reading the settings raises where there is no terminal: piped, captured by a test, or no termios here.
NOT_A_TERMINAL: tuple[type[Exception], ...] = (AttributeError, OSError, ValueError) + (
    (termios.error,) if termios else ()
)


@contextlib.contextmanager
def enter_stays_enter(stream: IO | None = None) -> Iterator[None]:
    """Clear the CR/LF input translations now; restore the terminal's own settings on the way out
    (the app restores the ones it found, i.e. ours), with the input flags app/bootstrap.py found where it
    cleared them first."""
    stream = sys.stdin if stream is None else stream
    found = os.environ.pop(TERMINAL_IFLAG_ENV, "")  # popped: not for the processes the app starts
    try:
        fd = stream.fileno()
        before = termios.tcgetattr(fd)
    except NOT_A_TERMINAL:
        yield  # not a terminal: piped, captured by a test, or no termios on this platform
        return
    if found.isdigit():
        before[0] = int(found)
    attrs = list(before)
    for name in CR_TRANSLATIONS:
        attrs[0] &= ~getattr(termios, name)
    termios.tcsetattr(fd, termios.TCSANOW, attrs)
    try:
        yield
    finally:
        with contextlib.suppress(termios.error, OSError):
            termios.tcsetattr(fd, termios.TCSANOW, before)
