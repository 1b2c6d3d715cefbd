"""The other ranks' loop: run each pass rank 0 plans on this rank's shard and pools, until it says stop.

A follower's logits are evaluated (the model's all_sums are in them, and rank 0 waits on those) and dropped:
rank 0 samples, and the tokens it samples come back as the next step's token ids.
"""

from __future__ import annotations

import time

from mlxpaged.distributed import plan
from mlxpaged.distributed.channel import PlanChannel, RankLostError
from mlxpaged.distributed.watchdog import LeaderWatch
from mlxpaged.runner.model_runner import Runner

import mlx.core as mx


class LeaderLostError(RankLostError):
    """Rank 0 is gone (its process died, or the network to it): this rank has nobody to follow."""


def follow(runner: Runner, channel: PlanChannel) -> int:
    """Run rank 0's plan until it stops; returns the number of steps run. LeaderLostError when rank 0 is gone:
    the ring backend either fails the collective ("connection to a peer was lost") or, as seen here, completes
    it with zeros, which the channel tells from a message (channel.py). Another follower gone: the same. A rank 0
    that hangs, silent past the bound, ends this process (watchdog.LeaderWatch)."""
    watch = LeaderWatch(channel.ranks)
    try:
        return _follow(runner, channel, watch)
    finally:
        watch.close()


def _follow(runner: Runner, channel: PlanChannel, watch: LeaderWatch) -> int:
    steps = 0
    while True:
        try:
            values = channel.receive()
        except RuntimeError as exc:  # MLX's failed collective, or the channel's RankLostError
            raise LeaderLostError(f"rank 0 stopped answering after {steps} steps ({exc})") from exc
        watch.heard_from_leader()
        try:
            message = plan.decode(values)
        except (ValueError, StopIteration) as exc:  # an unknown kind, or values cut short
            raise LeaderLostError(f"rank 0's message after {steps} steps cannot be read ({exc!r})") from exc
        if message.kind == plan.STOP:
            return steps
        if message.kind == plan.KEEP_ALIVE:
            time.sleep(message.nap_ms / 1000)  # rank 0 idles: sleep, not poll in the next collective (leader.py)
            continue
        if message.kind == plan.COPY:
            runner.kv.copy_blocks(list(message.copies))
            mx.eval(runner.kv.pools)
            continue
        logits = runner.step(list(message.inputs))
        mx.eval(*([] if logits is None else [logits]), runner.kv.pools)
        steps += 1
