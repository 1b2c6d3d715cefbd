"""`mlxpaged serve` under `mlx.launch`: every rank runs the same command line; rank 0 binds the port and
serves (launcher.py), the other ranks load their shard and follow rank 0's plan until its engine closes.

    mlx.launch --backend ring -n 2 -- mlxpaged serve --model M --no-kv-disk
"""

from __future__ import annotations

import argparse
import signal
import sys

from mlxpaged.errors import MlxpagedError, user_message
from mlxpaged_app.server.flags import cache_settings


def distributed_settings(args: argparse.Namespace) -> dict:
    """The engine settings from the flags, the same on every rank. The KV disk tier, on by default in `serve`,
    is off over several processes (not built yet): off when not asked for, refused (at load) when asked for."""
    settings = cache_settings(args)
    if args.kv_disk is None:
        settings["kv_disk"] = False
    return settings


def parallel_setting(args: argparse.Namespace) -> str | None:
    """start_engine's `parallel` from the flags: --pipeline forces pipeline parallel; None lets the model decide
    (tensor parallel where it shards, else pipeline)."""
    return "pipeline" if args.pipeline else None


def run_follower_rank(args: argparse.Namespace) -> int:
    """A rank other than 0: load, shard, follow; 0 once rank 0 closed its engine, 1 when it cannot start."""
    from mlxpaged.distributed.follower import LeaderLostError
    from mlxpaged.distributed.start import start_engine

    # Ctrl-C reaches every rank; rank 0 stops the others (its engine's close sends them stop), so a follower
    # interrupted in mid-step would only leave rank 0 waiting on a collective. A dead rank 0: the next slice.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        start_engine(args.model, parallel=parallel_setting(args), **distributed_settings(args))
    except (ValueError, MlxpagedError, LeaderLostError) as exc:
        print(f"mlxpaged serve (follower rank): {user_message(exc, 'cli')}", file=sys.stderr)
        return 1
    return 0
