"""Running a script in N processes on loopback for the tests, set up as `mlx.launch --backend ring` sets its ranks
up (mlxpaged/distributed/launch.py builds mlx.launch's command lines; `mlxpaged bench distributed` uses it).

`run_script` starts the ranks itself, without mlx.launch's watcher: that watcher selects on each rank's stdin
pipe, which is always writable, so its loop never sleeps and it holds 1.3 cores while its ranks run (seen in
`top` beside two sleeping ranks). On this 2-core machine greedy_ranks.py over 2 ranks took 9.8-11.9 s under
mlx.launch and 4.2-4.7 s started here (three runs each). The tests of the launcher itself and of `serve` under
it (test_launch, test_rank_lost, test_distributed_serve, the doctor's and the bench's) still run mlx.launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlxpaged.distributed.launch import free_port_run, launcher_path, result_from

__all__ = ["free_port_run", "launcher_path", "result_line", "run_script"]

LAUNCH_TIMEOUT_S = 120
POLL_S = 0.05


def run_script(script: Path, args: list[str], processes: int) -> subprocess.CompletedProcess:
    """`script` alone (processes=1) or over `processes` ranks: every rank's stdout, then every rank's stderr, in
    rank order, and the first non-zero exit status of a rank (0 when all ended well)."""
    command = [sys.executable, str(script), *args]
    if processes == 1:
        return subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    with tempfile.TemporaryDirectory() as folder:
        hostfile = Path(folder, "hosts.json")  # mlx.launch's ring hostfile on loopback: one address per rank
        first = free_port_run(processes)
        hostfile.write_text(json.dumps([[f"127.0.0.1:{first + rank}"] for rank in range(processes)]))
        outputs = [(Path(folder, f"{rank}.out"), Path(folder, f"{rank}.err")) for rank in range(processes)]
        ranks = []
        for rank, (out, err) in enumerate(outputs):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            with out.open("w") as stdout, err.open("w") as stderr:
                ranks.append(subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr))
        try:
            _wait_as_mlx_launch_does(ranks, command)
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        codes = [process.returncode for process in ranks]
        return subprocess.CompletedProcess(
            command,
            next((code for code in codes if code != 0), 0),
            "".join(out.read_text() for out, _ in outputs),
            "".join(err.read_text() for _, err in outputs),
        )


def _wait_as_mlx_launch_does(ranks: list[subprocess.Popen], command: list[str]) -> None:
    """Until every rank has ended; once one fails the others get SIGTERM (mlx.launch stops them so too)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while any(process.poll() is None for process in ranks):
        if any(process.returncode not in (None, 0) for process in ranks):
            for process in ranks:
                if process.poll() is None:
                    process.terminate()
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(command, LAUNCH_TIMEOUT_S)
        time.sleep(POLL_S)


def result_line(done: subprocess.CompletedProcess) -> dict:
    """The JSON rank 0 printed after 'RESULT ' (exactly one rank prints it)."""
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return result_from(done.stdout)
