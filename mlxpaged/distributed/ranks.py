"""This process's place among the ranks `mlx.launch` started: the group, and agreeing on one number."""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass

from mlxpaged.distributed import DEFAULT_RANK_TIMEOUT_S
from mlxpaged.distributed.launch import launched_alone
from mlxpaged.errors import ConfigError

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Ranks:
    """The group of processes running one engine; rank 0 serves and schedules, the others follow."""

    group: mx.distributed.Group
    parallel: str = "tensor"  # how the model is split over the ranks: "tensor" or "pipeline" (shard.py)
    timeout_s: float = DEFAULT_RANK_TIMEOUT_S  # rank 0's bound on one step across the ranks (watchdog.py)
    on_host: int = 1  # ranks on this rank's host, itself included (their memory plans share it: memory.py)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"the rank timeout must be > 0 seconds, got {self.timeout_s}", param="rank_timeout")

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank's memory plan sizes its own pools: they must agree)."""
        return int(np.array(mx.distributed.all_min(mx.array([value], dtype=mx.int32), group=self.group))[0])

    def all_true(self, ok: bool) -> bool:
        """True when every rank's `ok` is (a choice every rank must make alike, as falling back to eager decoding)."""
        return self.agree_min(int(ok)) == 1


def launched() -> bool:
    """True under `mlx.launch` (it sets MLX_RANK for every backend it starts)."""
    return "MLX_RANK" in os.environ


def follows() -> bool:
    """True in a process `mlx.launch` started as a rank other than 0 (known before the group is joined)."""
    return launched() and os.environ["MLX_RANK"] != "0"


def join(backend: str = "any", timeout_s: float = DEFAULT_RANK_TIMEOUT_S) -> Ranks | None:
    """The group `mlx.launch` set up (None when this process runs alone: a group of one, `mlx.launch -n 1` too)."""
    if not launched() or launched_alone():
        return None
    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() == 1:
        return None
    return Ranks(group, timeout_s=timeout_s, on_host=ranks_on_this_host(group))


def ranks_on_this_host(group: mx.distributed.Group) -> int:
    """How many of the group's ranks run on this host (one all_gather of each rank's hostname checksum, at join:
    every rank joins at the same point, so the collective lines up)."""
    mine = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    every = np.array(mx.distributed.all_gather(mx.array([mine], dtype=mx.int32), group=group))
    return int((every == mine).sum())
