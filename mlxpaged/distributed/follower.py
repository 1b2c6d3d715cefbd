"""The other ranks' loop: run each pass rank 0 plans on this rank's shard and pools, until it says stop.

A follower's logits are evaluated (the model's all_sums are in them, and rank 0 waits on those) and dropped:
rank 0 samples, and the tokens it samples come back as the next step's token ids.
"""

from __future__ import annotations

from mlxpaged.distributed import plan
from mlxpaged.distributed.channel import PlanChannel
from mlxpaged.runner.model_runner import Runner

import mlx.core as mx


def follow(runner: Runner, channel: PlanChannel) -> int:
    """Run rank 0's plan until it stops; returns the number of steps run."""
    steps = 0
    while True:
        message = plan.decode(channel.receive())
        if message.kind == plan.STOP:
            return steps
        if message.kind == plan.COPY:
            runner.kv.copy_blocks(list(message.copies))
            mx.eval(runner.kv.pools)
            continue
        logits = runner.step(list(message.inputs))
        mx.eval(*([] if logits is None else [logits]), runner.kv.pools)
        steps += 1
