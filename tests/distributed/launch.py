"""Running a script in N processes with `mlx.launch` and the ring backend on loopback, for the tests."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

LAUNCH_TIMEOUT_S = 120


def free_port_run(count: int) -> int:
    """A first port with `count` free ports from it (the ring backend listens on port + rank): best effort,
    so tests running side by side do not take each other's ports."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count < 65536 and all(_free(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no run of {count} free ports on loopback")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launcher_path() -> str:
    """MLX's `mlx.launch` console script, from this interpreter's environment first."""
    beside = Path(sys.executable).with_name("mlx.launch")
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        raise RuntimeError("mlx.launch is not installed with mlx")
    return found


def run_script(script: Path, args: list[str], processes: int) -> subprocess.CompletedProcess:
    """`script` alone (processes=1, no launcher) or under `mlx.launch --backend ring -n processes`."""
    command = [sys.executable, str(script), *args]
    if processes > 1:
        launcher = [launcher_path(), "--backend", "ring", "-n", str(processes)]
        command = [*launcher, "--starting-port", str(free_port_run(processes)), "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def result_line(done: subprocess.CompletedProcess) -> dict:
    """The JSON rank 0 printed after 'RESULT ' (exactly one rank prints it)."""
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, done.stdout[-2000:]
    return json.loads(lines[0].removeprefix("RESULT "))
