"""Rank 0's messages to the other ranks over mx.distributed itself: no transport of our own.

Each message is two all_sums over the group, its length then its values, every other rank adding zeros: an
all-reduce is what every backend (ring, JACCL, MPI) has, and int32 sums of zeros are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.distributed.ranks import Ranks

import mlx.core as mx
import numpy as np


class PlanChannel:
    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def _all_sum(self, values: mx.array) -> mx.array:
        out = mx.distributed.all_sum(values, group=self.ranks.group)
        mx.eval(out)
        return out

    def send(self, values: Sequence[int]) -> None:
        """Rank 0: hand `values` to every other rank (they are in `receive`)."""
        if not self.ranks.leads:
            raise RuntimeError(f"rank {self.ranks.rank} sent a plan: only rank 0 sends")
        self._all_sum(mx.array([len(values)], dtype=mx.int32))
        self._all_sum(mx.array(list(values), dtype=mx.int32))

    def receive(self) -> list[int]:
        """Another rank: the values rank 0 sends next (blocks until it does)."""
        length = int(np.array(self._all_sum(mx.zeros((1,), dtype=mx.int32)))[0])
        return np.array(self._all_sum(mx.zeros((length,), dtype=mx.int32))).tolist()
