"""Test support (test_rank_lost.py): `mlxpaged serve` with one rank made to fail, under mlx.launch:

    mlx.launch ... -- python serve_rank_fails.py quits|hangs FLAG N serve --model M ...
    mlx.launch ... -- python serve_rank_fails.py leader-hangs FLAG serve --model M ...

- quits / hangs: the follower rank 1, on the Nth step plan it receives once the file FLAG exists (the test makes it
  just before its request) and before running that pass, quits quietly (exit 0: mlx.launch, which stops the others
  only on a non-zero exit, sees nothing wrong) or hangs (alive; mlx.launch's SIGTERM still ends it); either way
  rank 0 waits in the pass's collectives. Counting step plans after FLAG, not every message, puts the failure
  inside the request on any machine: a busy one sends more idle keep-alives, and start-up steps of its own,
  before the request comes (issue 41: the follower quit before it, and the client found the server gone).
- leader-hangs: rank 0's engine thread hangs the first time it is idle once the file FLAG exists (outside any
  step: its own watchdog has nothing to bound; its HTTP server still answers).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mlxpaged.distributed.channel import PlanChannel
from mlxpaged.distributed.leader import PlanSender
from mlxpaged.distributed.plan import STEP, decode
from mlxpaged_app.cli import main


def hang() -> None:
    while True:
        time.sleep(60)


def follower_fails_after(how: str, flag: Path, plans: int) -> None:
    receive = PlanChannel.receive
    seen = [0]

    def receive_then_fail(self: PlanChannel) -> list[int]:
        values = receive(self)
        if not flag.exists() or decode(values).kind != STEP:
            return values
        seen[0] += 1
        if seen[0] == plans:
            print(f"FOLLOWER {how.upper()} after step plan {plans} of the request", flush=True)
            if how == "quits":
                os._exit(0)
            hang()
        return values

    PlanChannel.receive = receive_then_fail  # type: ignore[method-assign]


def leader_hangs_once(flag: Path) -> None:
    """The test makes `flag` once its request has completed: waiting on that, not on a count of messages, keeps
    rank 0 from hanging before the request on a slow machine (idle keep-alives come every 0.1 s, and start-up
    sends steps of its own)."""
    idle = PlanSender.idle

    def idle_or_hang(self: PlanSender) -> None:
        if flag.exists():
            print("RANK 0 HANGS while idle", flush=True)
            hang()
        idle(self)

    PlanSender.idle = idle_or_hang  # type: ignore[method-assign]


if __name__ == "__main__":
    how, when = sys.argv[1], sys.argv[2]
    rank = os.environ.get("MLX_RANK")
    if how in ("quits", "hangs"):
        flag, plans = Path(when), int(sys.argv[3])
        if rank == "1":
            follower_fails_after(how, flag, plans)
        sys.argv = ["mlxpaged", *sys.argv[4:]]
    else:
        if how == "leader-hangs" and rank == "0":
            leader_hangs_once(Path(when))
        sys.argv = ["mlxpaged", *sys.argv[3:]]
    sys.exit(main())
