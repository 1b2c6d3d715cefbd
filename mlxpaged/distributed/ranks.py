"""This process's place among the ranks `mlx.launch` started: the group, and agreeing on one number."""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass

from mlxpaged.distributed import DEFAULT_RANK_TIMEOUT_S
from mlxpaged.distributed.launch import launched_alone
from mlxpaged.errors import ConfigError, MlxpagedError

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


class JoinError(MlxpagedError):
    """This process could not connect to the others `mlx.launch` started."""


def join_group(backend: str = "any") -> mx.distributed.Group | None:
    """Connect to the other processes `mlx.launch` started, now (None alone). Call it first, before any slow
    work: MLX's ring backend gives a rank about 15 s (5 tries, 1 + 2 + 4 + 8 s apart) to find its neighbour
    listening, so a rank still importing, provisioning a model or starved of CPU fails the others' join. Later
    calls return the same group (MLX keeps it per backend), so `join` may follow at any point."""
    if not launched() or launched_alone():
        return None
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        hint = ""
        if "connect" in str(exc).lower():  # the ring backend's connect window ran out
            hint = (
                "; MLX's ring backend waits about 15 s for each neighbour to listen, so a rank that starts much "
                "later than the others, or a port another program holds, fails the join"
            )
        rank = os.environ.get("MLX_RANK", "?")
        raise JoinError(f"rank {rank} could not join the processes mlx.launch started ({exc}){hint}") from exc


def join(backend: str = "any", timeout_s: float = DEFAULT_RANK_TIMEOUT_S) -> Ranks | None:
    """The group `mlx.launch` set up (None when this process runs alone: a group of one, `mlx.launch -n 1` too)."""
    group = join_group(backend)
    if group is None or group.size() == 1:
        return None
    return Ranks(group, timeout_s=timeout_s, on_host=ranks_on_this_host(group))


def ranks_on_this_host(group: mx.distributed.Group) -> int:
    """How many of the group's ranks run on this host (one all_gather of each rank's hostname checksum, at join:
    every rank joins at the same point, so the collective lines up)."""
    mine = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    every = np.array(mx.distributed.all_gather(mx.array([mine], dtype=mx.int32), group=group))
    return int((every == mine).sum())
