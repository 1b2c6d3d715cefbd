"""Test support (test_rank_lost.py): `mlxpaged serve` with one rank made to fail, under mlx.launch:

    mlx.launch ... -- python serve_rank_fails.py quits|hangs|leader-hangs N serve --model M ...

- quits / hangs: the follower rank 1, after receiving its Nth plan and before running that pass, quits quietly
  (exit 0: mlx.launch, which stops the others only on a non-zero exit, sees nothing wrong) or hangs (alive;
  mlx.launch's SIGTERM still ends it); either way rank 0 waits in the pass's collectives.
- leader-hangs: rank 0's engine thread hangs the first time it is idle after sending N messages (outside any
  step: its own watchdog has nothing to bound; its HTTP server still answers).
"""

from __future__ import annotations

import os
import sys
import time

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


def leader_hangs_after(messages: int) -> None:
    send, idle = PlanChannel.send, PlanSender.idle
    sent = [0]

    def counted_send(self: PlanChannel, values) -> None:
        send(self, values)
        sent[0] += 1

    def idle_or_hang(self: PlanSender) -> None:
        if sent[0] >= messages:
            print(f"RANK 0 HANGS after {sent[0]} messages", flush=True)
            hang()
        idle(self)

    PlanChannel.send = counted_send  # type: ignore[method-assign]
    PlanSender.idle = idle_or_hang  # type: ignore[method-assign]


if __name__ == "__main__":
    how, count = sys.argv[1], int(sys.argv[2])
    rank = os.environ.get("MLX_RANK")
    if how in ("quits", "hangs") and rank == "1":
        follower_fails_after(how, count)
    if how == "leader-hangs" and rank == "0":
        leader_hangs_after(count)
    sys.argv = ["mlxpaged", *sys.argv[3:]]
    sys.exit(main())
