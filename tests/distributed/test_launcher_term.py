"""A rank told to stop by mlx.launch (SIGTERM) exits 1 after the grace even while its main thread is blocked
and never returns to Python (here: a long sleep in C the no-op handler does not end; in a rank, a collective)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

BLOCKED = """
import sys, time
from mlxpaged_app.server.ranks import exit_on_launcher_term
exit_on_launcher_term("follower rank 7", grace_s=0.3)
print("blocking", flush=True)
time.sleep(60)
print("the sleep ended", flush=True)
"""


def test_sigterm_ends_a_blocked_rank_with_status_1_after_the_grace():
    child = subprocess.Popen([sys.executable, "-c", BLOCKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "blocking\n"
    started = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=20)
    took = time.monotonic() - started
    assert child.returncode == 1 and 0.3 <= took < 10, (child.returncode, took, err)
    assert "the sleep ended" not in out
    assert "mlxpaged serve (follower rank 7): mlx.launch stopped this rank (SIGTERM)" in err
