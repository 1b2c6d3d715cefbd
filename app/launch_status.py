"""Run mlx.launch and exit with its ranks' status, which mlx.launch itself does not.

mlx.launch (mlx 0.32) always exits 0: when a rank fails it only logs `Node with rank R exited with code C` (or
`Node with rank R was killed`) on its stderr, stops the other ranks, and returns. A service manager or a script
running `mlxpaged launch -- serve` needs to see the failure (issue 26: a lost rank ends the server "with a clear
error and exit status"), so the launcher runs as a child here, its stderr passes through unchanged as it comes,
and those lines are read on the way: the exit status is rank 0's when it failed, else the lowest failed rank's,
else mlx.launch's own (a rank mlx.launch itself terminated counts last). Reading a log line is the only
interface mlx.launch offers; if its wording changes, the status falls back to mlx.launch's (0) and nothing
else breaks.

Signals: Ctrl-C in a terminal reaches the whole process group (mlx.launch and the ranks stop themselves), so
SIGINT is ignored here while the child runs; a SIGTERM sent to this process is passed on to mlx.launch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

RANK_ENDED = re.compile(rb"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")


def rank_statuses(stderr_text: bytes) -> dict[int, int]:
    """{rank: exit status} for every rank mlx.launch logged as failed; a killed rank counts as 128 + SIGKILL
    (mlx.launch does not say which signal)."""
    statuses: dict[int, int] = {}
    for match in RANK_ENDED.finditer(stderr_text):
        code = match.group(2)
        status = int(code) if code is not None else 128 + signal.SIGKILL
        statuses[int(match.group(1))] = 128 - status if status < 0 else status  # -9 (killed by 9) -> 137
    return statuses


def exit_status(launcher_status: int, statuses: dict[int, int]) -> int:
    """Rank 0's failure first (the server's own), else the lowest failed rank's, else mlx.launch's status. A rank
    ended by SIGTERM (143) counts only when no rank failed otherwise: mlx.launch terminates the ranks still
    running once one fails, so that is the effect, and the other rank's status the cause."""
    failed = {rank: status for rank, status in statuses.items() if status != 0}
    if not failed:
        return launcher_status
    causes = {rank: status for rank, status in failed.items() if status != 128 + signal.SIGTERM} or failed
    return causes.get(0, causes[min(causes)])


def run_launcher(line: list[str]) -> int:
    """Run mlx.launch's command `line`, its output passed through, and return the status described above."""
    process = subprocess.Popen(line, stderr=subprocess.PIPE)
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda signum, _frame: process.send_signal(signum))
    assert process.stderr is not None
    seen = b""  # the log lines searched so far (a line may come in two reads)
    statuses: dict[int, int] = {}
    try:
        while chunk := os.read(process.stderr.fileno(), 65536):
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()
            seen += chunk
            *complete, seen = seen.split(b"\n")
            statuses.update(rank_statuses(b"\n".join(complete)))
        statuses.update(rank_statuses(seen))
        launcher_status = process.wait()
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)
    return exit_status(launcher_status if launcher_status >= 0 else 128 - launcher_status, statuses)
