"""Commands for the work the suite runs beside its own tests, at the lowest CPU priority there is.

On Linux that is the SCHED_IDLE policy (`chrt --idle 0`, inherited by every process the command starts): it
runs only on a core nothing else wants, and a test's process that wakes takes the core back at once. `nice -n
19` is weaker: beside the background runs (the architecture sweep, mypy, the kernel-family runs), on this 2-core
machine, tests/app/server/test_anthropic.py took 75 s under nice 19, 62 s under SCHED_IDLE and 49 s alone.
Elsewhere (macOS has no SCHED_IDLE) `nice -n 19`.
"""

from __future__ import annotations

import os
import shutil
import sys

import psutil


def _sched_idle() -> bool:
    return sys.platform.startswith("linux") and shutil.which("chrt") is not None


def at_lowest_priority(argv: list[str]) -> list[str]:
    """`argv` prefixed to run at the lowest CPU priority this platform offers."""
    if _sched_idle():
        return ["chrt", "--idle", "0", *argv]
    if sys.platform != "win32":
        return ["nice", "-n", "19", *argv]
    return list(argv)


def runs_at_lowest_priority(pid: int) -> bool:
    """Whether process `pid` runs as `at_lowest_priority` starts a command."""
    return os.sched_getscheduler(pid) == os.SCHED_IDLE if _sched_idle() else psutil.Process(pid).nice() == 19
