"""While idle, rank 0 sends a keep-alive every tick telling the followers to sleep before their next collective
(leader.py: waiting in one, MLX's ring thread polls its sockets and a follower burned most of a core); messages
through a fake channel, so the timing is the protocol's alone."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

from mlxpaged.distributed import leader, plan
from mlxpaged.distributed.follower import follow


class FakeChannel:
    """Rank 0's sends recorded; a follower's receives served from `incoming`, with the time each was taken."""

    def __init__(self, incoming: list[list[int]] = ()):
        self.ranks = SimpleNamespace(rank=1, timeout_s=30.0)
        self.sent: list[list[int]] = []
        self.incoming, self.taken_at = list(incoming), []

    def send(self, values) -> None:
        self.sent.append(list(values))

    def receive(self) -> list[int]:
        self.taken_at.append(time.monotonic())
        return self.incoming.pop(0)


class FreeWatchdog:
    def watch(self, what, tell):
        return contextlib.nullcontext()


def test_an_idle_rank_0_sends_a_nap_every_tick_and_nothing_between():
    channel = FakeChannel()
    sender = leader.PlanSender(channel, watchdog=FreeWatchdog())
    sender.idle()
    assert channel.sent == []  # within the first tick
    time.sleep(leader.IDLE_TICK_S)
    sender.idle()
    sender.idle()
    assert channel.sent == [plan.encode_keep_alive(round(leader.NAP_S * 1000))]
    assert sender.idle_tick_s == leader.IDLE_TICK_S and leader.NAP_S < leader.IDLE_TICK_S


def test_a_follower_sleeps_the_nap_before_its_next_collective():
    channel = FakeChannel([plan.encode_keep_alive(60), plan.encode_keep_alive(0), plan.encode_stop()])
    assert follow(runner=None, channel=channel) == 0
    first, second, third = channel.taken_at
    assert second - first >= 0.06  # slept through the nap, not waiting in a collective
    assert third - second < 0.05  # no nap asked: straight back
