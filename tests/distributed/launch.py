"""Running a script in N processes with `mlx.launch` and the ring backend on loopback, for the tests
(mlxpaged/distributed/launch.py builds the command lines; `mlxpaged bench distributed` uses it too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlxpaged.distributed.launch import free_port_run, launcher_path, loopback_command, result_from

__all__ = ["free_port_run", "launcher_path", "result_line", "run_script"]

LAUNCH_TIMEOUT_S = 120


def run_script(script: Path, args: list[str], processes: int) -> subprocess.CompletedProcess:
    """`script` alone (processes=1, no launcher) or under `mlx.launch --backend ring -n processes`."""
    command = loopback_command([sys.executable, str(script), *args], processes)
    return subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def result_line(done: subprocess.CompletedProcess) -> dict:
    """The JSON rank 0 printed after 'RESULT ' (exactly one rank prints it)."""
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return result_from(done.stdout)
