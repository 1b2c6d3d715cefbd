"""Running a command in several processes with MLX's `mlx.launch`, and which backend a launched process got.

One place for what `mlxpaged launch`, `mlxpaged bench distributed` and tests/distributed/ need: the launcher
next to this interpreter, `mlx.launch`'s command line (loopback `-n N` on the ring backend, or a hostfile),
free ports for the ring backend on loopback, and the one JSON line a rank-0 script prints as its result.
`mlx.launch` runs each command as given (no interpreter added): give it an executable, not a bare `.py`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

LOOPBACK_BACKEND = "ring"  # the backend that runs on one machine's loopback (MPI needs mpirun installed)
RESULT_PREFIX = "RESULT "  # a rank-0 script's one line of JSON (result_from reads it back)
FIRST_PICKED_PORT = 20000  # free_port_run picks from here to the ephemeral range: above most well-known services


def launcher_path() -> str:
    """MLX's `mlx.launch` console script, from this interpreter's environment first."""
    beside = Path(sys.executable).with_name("mlx.launch")
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        raise RuntimeError("mlx.launch is not installed with mlx (pip install mlx installs it)")
    return found


def mlxpaged_command() -> list[str]:
    """This interpreter's `mlxpaged`: the console script beside it, else `python -m mlxpaged_app.cli`."""
    beside = Path(sys.executable).with_name("mlxpaged")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "mlxpaged_app.cli"]


def launch_command(
    command: list[str],
    processes: int | None = None,
    hostfile: str | None = None,
    backend: str | None = None,
    starting_port: int | None = None,
    env: Sequence[str] = (),
) -> list[str]:
    """`mlx.launch ... -- command`: `processes` copies on loopback (the ring backend unless `backend` says
    otherwise), or one per host of `hostfile` (its own "backend" key wins unless `backend` is given)."""
    if (processes is None) == (hostfile is None):
        raise ValueError("give either a number of processes (on this machine) or a hostfile, not both")
    if processes is not None and processes < 1:
        raise ValueError(f"the number of processes must be at least 1, got {processes}")
    if not command:
        raise ValueError("no command to launch")
    line = [launcher_path()]
    if processes is not None:
        line += ["--backend", backend or LOOPBACK_BACKEND, "-n", str(processes)]
    else:
        line += ["--hostfile", str(hostfile)] + (["--backend", backend] if backend else [])
    if starting_port is not None:
        line += ["--starting-port", str(starting_port)]
    for item in env:
        line += ["--env", item]
    return [*line, "--", *command]


def without_busy_wait(line: list[str]) -> list[str]:
    """An mlx.launch command `line` run by mlx.launch's own code without its busy wait (quiet_launch.py)."""
    if line and line[0] == launcher_path():
        return [sys.executable, "-m", "mlxpaged.distributed.quiet_launch", *line[1:]]
    return list(line)


def loopback_command(command: list[str], processes: int) -> list[str]:
    """`command` alone (1 process: no launcher) or under the ring backend on loopback, on free ports."""
    if processes == 1:
        return list(command)
    return launch_command(command, processes, starting_port=free_port_run(processes))


def free_port_run(count: int) -> int:
    """A first port with `count` free ports from it (the ring backend listens on port + rank): best effort, so
    runs side by side do not take each other's ports. Picked below the system's ephemeral range, so no outgoing
    connection (another rank's, a client's) is handed one of them between this check and the ranks' bind."""
    top = _ephemeral_floor() - count
    if top <= FIRST_PICKED_PORT:  # a system that hands out (nearly) every port: pick anywhere
        top = 65536 - count
    for _ in range(100):
        first = random.randrange(FIRST_PICKED_PORT, top)
        if all(_free(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no run of {count} free ports on loopback between {FIRST_PICKED_PORT} and {top + count}")


def _ephemeral_floor() -> int:
    """The lowest port the system hands out to outgoing connections (Linux's setting; else IANA's 49152, macOS's)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launched_backend() -> str | None:
    """The backend `mlx.launch` set this process up for, read from the environment it exported (None when
    not launched). MLX's group does not say which backend it runs on."""
    if "MLX_RANK" not in os.environ:
        return None
    if "MLX_JACCL_COORDINATOR" in os.environ:
        return "jaccl-ring" if os.environ.get("MLX_JACCL_RING") else "jaccl"
    if "NCCL_HOST_IP" in os.environ:
        return "nccl"
    if "MLX_HOSTFILE" in os.environ:
        return "ring"
    return "unknown"


def launched_alone() -> bool:
    """True under `mlx.launch -n 1` on the ring backend: it writes an empty hostfile (a group of one), which
    MLX's strict init refuses with a JSON parse error instead of giving a group of size 1."""
    if launched_backend() != "ring":
        return False
    try:
        return not Path(os.environ["MLX_HOSTFILE"]).read_text().strip()
    except OSError:
        return False


def result_line(result: dict) -> str:
    """The line a rank-0 script prints for result_from."""
    return RESULT_PREFIX + json.dumps(result)


def result_from(stdout: str) -> dict:
    """The JSON object after RESULT_PREFIX in `stdout` (exactly one rank prints it)."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if len(lines) != 1:
        raise ValueError(f"expected one {RESULT_PREFIX.strip()} line, found {len(lines)}: {stdout[-2000:]}")
    return json.loads(lines[0].removeprefix(RESULT_PREFIX))
