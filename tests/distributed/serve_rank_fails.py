"""Test support (test_rank_lost.py): `mlxpaged serve` with one rank made to fail, under mlx.launch:

    mlx.launch ... -- python serve_rank_fails.py quits|hangs N serve --model M ...
    mlx.launch ... -- python serve_rank_fails.py leader-hangs FLAG serve --model M ...

- quits / hangs: the follower rank 1, after receiving its Nth plan and before running that pass, quits quietly
  (exit 0: mlx.launch, which stops the others only on a non-zero exit, sees nothing wrong) or hangs (alive;
  mlx.launch's SIGTERM still ends it); either way rank 0 waits in the pass's collectives.
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
from mlxpaged_app.cli import main


def hang() -> None:
    while True:
        time.sleep(60)


def follower_fails_after(how: str, plans: int) -> None:
    receive = PlanChannel.receive
    seen = [0]

    def receive_then_fail(self: PlanChannel) -> list[int]:
        values = receive(self)
        seen[0] += 1
        if seen[0] == plans:
            print(f"FOLLOWER {how.upper()} after plan {plans}", flush=True)
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
    if how in ("quits", "hangs") and rank == "1":
        follower_fails_after(how, int(when))
    if how == "leader-hangs" and rank == "0":
        leader_hangs_once(Path(when))
    sys.argv = ["mlxpaged", *sys.argv[3:]]
    sys.exit(main())
