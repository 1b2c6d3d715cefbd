"""Test support: `mlxpaged serve` whose follower rank quits quietly (exit 0) after receiving its Nth plan,
before running that pass; so rank 0 waits in the pass's collectives and mlx.launch sees nothing wrong (it
stops the others only on a non-zero exit). Usage, under mlx.launch: python serve_follower_quits.py N serve ..."""

from __future__ import annotations

import os
import sys

from mlxpaged.distributed.channel import PlanChannel
from mlxpaged_app.cli import main


def quit_after(plans: int) -> None:
    receive = PlanChannel.receive
    seen = [0]

    def receive_then_maybe_quit(self: PlanChannel) -> list[int]:
        values = receive(self)
        seen[0] += 1
        if seen[0] == plans:
            print(f"FOLLOWER QUITS after plan {plans}", flush=True)
            os._exit(0)
        return values

    PlanChannel.receive = receive_then_maybe_quit  # type: ignore[method-assign]


if __name__ == "__main__":
    if os.environ.get("MLX_RANK") == "1":
        quit_after(int(sys.argv[1]))
    sys.argv = ["mlxpaged", *sys.argv[2:]]
    sys.exit(main())
