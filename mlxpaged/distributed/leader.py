"""Rank 0's side: the runner's StepMirror, sending each pass's inputs and each block copy before queuing them."""

from __future__ import annotations

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
        """Once: the engine closes, the followers return."""
        if not self.stopped:
            self.stopped = True
            self.channel.send(plan.encode_stop())
