"""Progress of long loading steps (downloads, conversion): one callback type, one printer."""

from __future__ import annotations

import sys
from collections.abc import Callable

# progress(done, total, what): called as a step advances; `what` names the step ("downloading", ...).
Progress = Callable[[int, int, str], None]

_WIDTH = 30


def print_progress(done: int, total: int, what: str) -> None:
    """A one-line bar on stderr that redraws in place on a terminal; elsewhere (logs, CI) only the
    finished line, so a log does not fill with carriage returns."""
    if done < total and not sys.stderr.isatty():
        return
    filled = _WIDTH * done // max(total, 1)
    end = "\n" if done >= total else ""
    sys.stderr.write(f"\r  {what:<20} [{'#' * filled}{'.' * (_WIDTH - filled)}] {100 * done // max(total, 1):3d}%{end}")
    sys.stderr.flush()
