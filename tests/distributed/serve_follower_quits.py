"""Test support (test_rank_lost.py): `mlxpaged serve` whose follower rank, after receiving its Nth plan and
before running that pass, either quits quietly (exit 0: mlx.launch, which stops the others only on a non-zero
exit, sees nothing wrong) or hangs; either way rank 0 waits in the pass's collectives.

    mlx.launch ... -- python serve_follower_quits.py quits|hangs N serve --model M ...
"""

from __future__ import annotations

import os
import sys
import time

from mlxpaged.distributed.channel import PlanChannel
from mlxpaged_app.cli import main


def fail_after(how: str, plans: int) -> None:
    receive = PlanChannel.receive
    seen = [0]

    def receive_then_fail(self: PlanChannel) -> list[int]:
        values = receive(self)
        seen[0] += 1
        if seen[0] == plans:
            print(f"FOLLOWER {how.upper()} after plan {plans}", flush=True)
            if how == "quits":
                os._exit(0)
            while True:  # hung, but alive: mlx.launch's SIGTERM still ends it
                time.sleep(60)
        return values

    PlanChannel.receive = receive_then_fail  # type: ignore[method-assign]


if __name__ == "__main__":
    if os.environ.get("MLX_RANK") == "1":
        fail_after(sys.argv[1], int(sys.argv[2]))
    sys.argv = ["mlxpaged", *sys.argv[3:]]
    sys.exit(main())
