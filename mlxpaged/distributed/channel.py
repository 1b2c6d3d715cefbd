"""Rank 0's messages to the other ranks over mx.distributed itself: no transport of our own.

A message is an all_sum over the group, every other rank adding zeros (an all-reduce is what every backend
has: ring, JACCL, MPI; int32 sums of zeros are exact). A collective costs a round trip (about 7 ms on this
loaded 2-core box's loopback, tens of microseconds over Thunderbolt), so a message is one all_sum of a fixed
FIRST_INTS buffer (its length, a count of the ranks present, then the values that fit), and a second one only
for what does not fit.

The count: every other rank adds 1. The ring backend was seen to complete a collective with a dead peer
(zeros where the peer's share was), so a short count is how rank 0 learns a rank is gone before it runs a pass
whose sums would be missing that rank's share.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.distributed.ranks import Ranks

import mlx.core as mx
import numpy as np

# The first buffer: a step of 32 decoding sequences with 8 blocks each is ~450 ints; a long prefill chunk
# (its token ids) overflows into the second all_sum.
FIRST_INTS = 1024


HEADER_INTS = 2  # the length, the count of other ranks present
ROOM = FIRST_INTS - HEADER_INTS


class RankLostError(RuntimeError):
    """A rank of the group is gone: its share of a collective is missing."""


def split_message(values: Sequence[int]) -> tuple[list[int], list[int]]:
    """Rank 0's first all_sum buffer (the length, a count of 0, as many values as fit, zero-padded) and the rest."""
    head = [len(values), 0, *values[:ROOM]]
    return head + [0] * (FIRST_INTS - len(head)), list(values[ROOM:])


def rest_length(first: Sequence[int]) -> int:
    """How many values the second all_sum carries after `first` (0: none is sent)."""
    return max(0, first[0] - ROOM)


def join_message(first: Sequence[int], rest: Sequence[int]) -> list[int]:
    """The values `split_message` split."""
    return [*first[HEADER_INTS : HEADER_INTS + min(first[0], ROOM)], *rest]


def check_present(first: Sequence[int], num_ranks: int) -> None:
    """RankLostError unless every rank but rank 0 added its 1 to the count."""
    if first[1] != num_ranks - 1:
        raise RankLostError(
            f"{first[1]} of the {num_ranks - 1} other ranks took part in rank 0's plan message: a rank is gone"
        )


class PlanChannel:
    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def _all_sum(self, values: mx.array) -> list[int]:
        out = mx.distributed.all_sum(values, group=self.ranks.group)
        return np.array(out).tolist()

    def send(self, values: Sequence[int]) -> None:
        """Rank 0: hand `values` to every other rank (they are in `receive`)."""
        if not self.ranks.leads:
            raise RuntimeError(f"rank {self.ranks.rank} sent a plan: only rank 0 sends")
        first, rest = split_message(values)
        check_present(self._all_sum(mx.array(first, dtype=mx.int32)), self.ranks.size)
        if rest:
            self._all_sum(mx.array(rest, dtype=mx.int32))

    def receive(self) -> list[int]:
        """Another rank: the values rank 0 sends next (blocks until it does)."""
        mine = [0] * FIRST_INTS
        mine[1] = 1  # present
        first = self._all_sum(mx.array(mine, dtype=mx.int32))
        if first[0] == 0:  # rank 0 never sends an empty message: its share is missing
            raise RankLostError("rank 0's plan message came back empty: rank 0 is gone")
        check_present(first, self.ranks.size)
        length = rest_length(first)
        return join_message(first, self._all_sum(mx.zeros((length,), dtype=mx.int32)) if length else [])
