"""`mlxpaged serve` under `mlx.launch`: every rank runs the same command line; rank 0 binds the port and
serves (launcher.py), the other ranks load their shard and follow rank 0's plan until its engine closes.

    mlx.launch --backend ring -n 2 -- mlxpaged serve --model M --no-kv-disk

When a rank fails (mlxpaged/distributed/watchdog.py): rank 0 fails the requests in flight and exits non-zero
when a step across the ranks fails or outlasts --rank-timeout, and when mlx.launch sends it SIGTERM, which
mlx.launch does (to every rank still running) once a rank has exited non-zero or was killed; a user stops the
server with Ctrl-C (SIGINT), which rank 0 answers by stopping every rank, exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from mlxpaged.distributed.watchdog import say_on_stderr
from mlxpaged.errors import MlxpagedError, user_message
from mlxpaged_app.server.flags import cache_settings

# How long a rank told to stop by mlx.launch (SIGTERM) has to end on its own before it exits 1 anyway.
TERM_GRACE_S = 5.0
_wakeup: list[socket.socket] = []


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
    """A rank other than 0: load, shard, follow; 0 once rank 0 closed its engine, 1 when it cannot start or
    rank 0 is gone."""
    # Ctrl-C reaches every rank; rank 0 stops the others (its engine's close sends them stop), so a follower
    # interrupted in mid-step would only leave rank 0 waiting on a collective. SIGTERM comes from mlx.launch
    # once a rank has failed, or to the whole launch from a service manager.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = os.environ.get("MLX_RANK", "?")
    print(f"mlxpaged serve (follower rank {rank}): process {os.getpid()}, following rank 0", flush=True)
    try:
        join_group_then_watch_for_term(f"follower rank {rank}")  # first: the ranks must join together
    except MlxpagedError as exc:
        print(f"mlxpaged serve (follower rank {rank}): {user_message(exc, 'cli')}", file=sys.stderr)
        return 1
    from mlxpaged.distributed.follower import LeaderLostError
    from mlxpaged.distributed.start import start_engine

    try:
        start_engine(
            args.model,
            parallel=parallel_setting(args),
            rank_timeout_s=args.rank_timeout,
            **distributed_settings(args),
        )
    except (ValueError, MlxpagedError, LeaderLostError) as exc:
        print(f"mlxpaged serve (follower rank {rank}): {user_message(exc, 'cli')}", file=sys.stderr)
        return 1
    return 0


def join_group_then_watch_for_term(who: str) -> None:
    """Join the ranks, then `exit_on_launcher_term`. Not before: MLX's join holds the GIL while it waits for the
    other ranks (for ever when rank 0 is gone), so the thread that ends the process could not run, and a SIGTERM
    to the whole launch while the ranks joined left a follower waiting on its own (seen: still there 30 s later,
    its parent gone). Until the join returns SIGTERM keeps its default: it ends the process at once, and there is
    nothing to say yet. Raises JoinError (a MlxpagedError) when the ranks cannot join."""
    from mlxpaged.distributed.ranks import join_group

    join_group()
    exit_on_launcher_term(who)


def exit_on_launcher_term(who: str, grace_s: float = TERM_GRACE_S) -> None:
    """On SIGTERM (mlx.launch: another rank failed), exit 1 `grace_s` later, even while the main thread waits in
    a collective in C++, where a Python handler would never run: the C-level handler writes the signal's number
    to a wakeup fd that a thread reads. The grace lets a rank about to fail on its own (a model refused at load
    on every rank) say why first. Main thread only (signal.set_wakeup_fd)."""
    read, write = socket.socketpair()
    write.setblocking(False)
    _wakeup.append(write)  # held for the process's life: collected, its fd would close and be reused
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a Python handler, so the wakeup fd is written
    signal.set_wakeup_fd(write.fileno())

    def wait_for_term() -> None:
        while read.recv(1) != bytes([signal.SIGTERM]):  # other signals with handlers (SIGINT on rank 0) pass
            pass
        time.sleep(grace_s)
        try:  # mlx.launch may be gone with its pipes (SIGTERM to the whole group): the exit must not depend on them
            say_on_stderr(
                f"mlxpaged serve ({who}): mlx.launch stopped this rank (SIGTERM), as it does when another rank exits"
                f" with an error or is killed; exiting with status 1"
            )
        finally:
            os._exit(1)

    threading.Thread(target=wait_for_term, name="mlxpaged-launcher-term", daemon=True).start()


def stopped_by_launcher(signum: int) -> bool:
    """Rank 0 serving across ranks got SIGTERM: mlx.launch stops the group because another rank exited
    non-zero or was killed. Fail the requests in flight and exit non-zero (on a thread, so the event loop writes
    the errors meanwhile); True when that is under way. False alone or for another signal: a normal stop."""
    from mlxpaged.distributed.watchdog import give_up_everywhere, over_ranks

    if signum != signal.SIGTERM or not over_ranks():
        return False
    message = "mlx.launch stopped rank 0 (SIGTERM), as it does when another rank exits with an error or is killed"
    threading.Thread(target=give_up_everywhere, args=(message,), name="mlxpaged-rank-lost", daemon=True).start()
    return True
