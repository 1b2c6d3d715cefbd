"""Rank 0's messages to the other ranks over mx.distributed itself: no transport of our own.

A message is an all_sum over the group, every other rank adding zeros (an all-reduce is what every backend
has: ring, JACCL, MPI; int32 sums of zeros are exact). A collective costs a round trip (about 7 ms on this
loaded 2-core box's loopback, tens of microseconds over Thunderbolt), so a message is one all_sum of a fixed
FIRST_INTS buffer (its length first, then the values that fit), and a second one only for what does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.distributed.ranks import Ranks

import mlx.core as mx
import numpy as np

# The first buffer: a step of 32 decoding sequences with 8 blocks each is ~450 ints; a long prefill chunk
# (its token ids) overflows into the second all_sum.
FIRST_INTS = 1024


def split_message(values: Sequence[int]) -> tuple[list[int], list[int]]:
    """The first all_sum's buffer (the length, then as many values as fit, zero-padded) and the rest."""
    head = [len(values), *values[: FIRST_INTS - 1]]
    return head + [0] * (FIRST_INTS - len(head)), list(values[FIRST_INTS - 1 :])


def rest_length(first: Sequence[int]) -> int:
    """How many values the second all_sum carries after `first` (0: none is sent)."""
    return max(0, first[0] - (FIRST_INTS - 1))


def join_message(first: Sequence[int], rest: Sequence[int]) -> list[int]:
    """The values `split_message` split."""
    return [*first[1 : 1 + min(first[0], FIRST_INTS - 1)], *rest]


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
        self._all_sum(mx.array(first, dtype=mx.int32))
        if rest:
            self._all_sum(mx.array(rest, dtype=mx.int32))

    def receive(self) -> list[int]:
        """Another rank: the values rank 0 sends next (blocks until it does)."""
        first = self._all_sum(mx.zeros((FIRST_INTS,), dtype=mx.int32))
        length = rest_length(first)
        return join_message(first, self._all_sum(mx.zeros((length,), dtype=mx.int32)) if length else [])
