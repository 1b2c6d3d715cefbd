"""Rank 0's side: the runner's StepMirror, sending each pass's inputs and each block copy before queuing them."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from mlxpaged.distributed import plan
from mlxpaged.distributed.channel import PlanChannel
from mlxpaged.runner.passes import StepInput


class PlanSender:
    """Installed as `Runner.mirror` on rank 0 (engine/build.py); `close` ends the followers' loops."""

    def __init__(self, channel: PlanChannel):
        self.channel = channel
        self.stopped = False

    def before_step(self, inputs: Sequence[StepInput]) -> None:
        self.channel.send(plan.encode_step(inputs))

    def before_copy(self, copies: list[tuple[int, int]]) -> None:
        self.channel.send(plan.encode_copies(copies))

    def close(self) -> None:
        """Once: the engine closes, the followers return. A follower already gone (the collective fails) has
        nothing left to stop: the close goes on."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.channel.send(plan.encode_stop())
        except RuntimeError as exc:  # what MLX raises for a failed collective
            warnings.warn(f"could not tell the other ranks to stop ({exc})", RuntimeWarning, stacklevel=2)
