"""`mlxpaged launch`: an mlxpaged command in several processes, through MLX's own `mlx.launch`.

    mlxpaged launch -n 2 -- serve --model M              # two processes on this machine (ring, loopback)
    mlxpaged launch --hostfile hosts.json -- serve ...   # one per host of an mlx.distributed_config hostfile

A thin wrapper: it puts this interpreter's `mlxpaged` executable after `--` (mlx.launch runs a command as given,
so it needs an executable path, not a bare script) and, with `-n`, the ring backend; then it runs `mlx.launch`
as its child (mlx.launch's own code without its busy wait: distributed/quiet_launch.py) and exits with the
ranks' status (launch_status.py: mlx.launch's own is always 0). On other hosts
the same path must exist: install mlxpaged in the same directory on every machine.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from mlxpaged.distributed.launch import LOOPBACK_BACKEND, launch_command, mlxpaged_command, without_busy_wait
from mlxpaged_app.launch_status import run_launcher


def add_launch_parser(sub, commands: list[str]) -> None:
    """The `launch` subcommand; `commands`: the mlxpaged subcommands it may run."""
    launch = sub.add_parser(
        "launch",
        help="run an mlxpaged command in several processes with mlx.launch (`launch -n 2 -- serve --model M`)",
        description="Run `mlxpaged COMMAND ...` under MLX's mlx.launch: -n N processes on this machine "
        f"({LOOPBACK_BACKEND} backend on loopback), or one per host of --hostfile (written by "
        "mlx.distributed_config; its backend, e.g. jaccl over Thunderbolt, is used).",
    )
    where = launch.add_mutually_exclusive_group(required=True)
    where.add_argument("-n", "--processes", type=int, default=None, metavar="N", help="processes on this machine")
    where.add_argument("--hostfile", default=None, help="mlx.launch's JSON hostfile (mlx.distributed_config)")
    launch.add_argument(
        "--backend",
        default=None,
        help=f"mlx.launch's backend (default: {LOOPBACK_BACKEND} with -n; the hostfile's own with --hostfile)",
    )
    launch.add_argument("--starting-port", type=int, default=None, help="ring backend: the first port (mlx.launch's)")
    launch.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="set in every process (repeatable)"
    )
    launch.add_argument("--print-command", action="store_true", help="print the mlx.launch command and exit")
    launch.add_argument("command", nargs=argparse.REMAINDER, help="-- then the mlxpaged command and its flags")
    launch.set_defaults(func=cmd_launch, launchable=commands)


def launched_command(args: argparse.Namespace) -> list[str]:
    """The mlx.launch command line for `args`; ValueError with the reason when it cannot be built."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("say what to run after --, e.g. `mlxpaged launch -n 2 -- serve --model M`")
    if command[0] not in args.launchable:
        raise ValueError(
            f"launch runs mlxpaged commands ({', '.join(args.launchable)}), not {command[0]!r}; "
            "for another program use mlx.launch itself"
        )
    if args.hostfile is not None and not os.path.isfile(args.hostfile):
        raise ValueError(f"no hostfile at {args.hostfile} (mlx.distributed_config writes one)")
    return launch_command(
        [*mlxpaged_command(), *command],
        processes=args.processes,
        hostfile=args.hostfile,
        backend=args.backend,
        starting_port=args.starting_port,
        env=args.env,
    )


def cmd_launch(args: argparse.Namespace) -> int:
    try:
        line = launched_command(args)
    except (ValueError, RuntimeError) as exc:  # no command, a bad count, mlx.launch missing
        print(f"mlxpaged launch: {exc}", file=sys.stderr)
        return 2
    if args.print_command:
        print(shlex.join(line))
        return 0
    sys.stdout.flush()
    # mlx.launch as a child (its own code, without its busy wait): its output passes through; its ranks' status
    # is returned
    return run_launcher(without_busy_wait(line))
