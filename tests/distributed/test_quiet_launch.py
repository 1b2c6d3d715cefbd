"""mlx.launch without its busy wait (mlxpaged/distributed/quiet_launch.py, what `mlxpaged launch` runs): while
its ranks sleep the launcher sleeps too, their output and its input still pass through, and a module laid out
otherwise is left as it is."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import types

from mlxpaged.distributed.launch import free_port_run
from mlxpaged.distributed.quiet_launch import quiet

SLEEP_S = 3.0


def launch(script: str, stdin: bytes | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """2 ranks of `python -c script` under the quiet launcher: the result and the launcher's CPU seconds (its
    own and its reaped children's: the ranks', small, included)."""
    command = [sys.executable, "-m", "mlxpaged.distributed.quiet_launch", "--backend", "ring", "-n", "2"]
    command += ["--starting-port", str(free_port_run(2)), "--", sys.executable, "-c", script]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(stdin, timeout=120)
    _, _, usage = os.wait4(process.pid, os.WNOHANG) if process.returncode is None else (0, 0, None)
    seconds = _cpu_seconds(process.pid) if usage is None else usage.ru_utime + usage.ru_stime
    return subprocess.CompletedProcess(command, process.returncode, out.decode(), err.decode()), seconds


_children_before: dict[int, float] = {}


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of the reaped children of this process since the last call (one child ran in between)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    spent = total - _children_before.get(0, 0.0)
    _children_before[0] = total
    return spent


def test_the_launcher_sleeps_while_its_ranks_sleep():
    _cpu_seconds(0)  # start counting from here
    done, cpu = launch(f"import time; time.sleep({SLEEP_S}); print('rank done', flush=True)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("rank done") == 2  # both ranks' output passed through
    # mlx.launch's own watcher spins: 1.3 cores while ranks sleep (about 4 s of CPU here); asleep, the launcher
    # and the two ranks' interpreters take well under a second
    assert cpu < 0.5 * SLEEP_S, f"{cpu:.2f} s of CPU over {SLEEP_S} s of sleeping ranks"


def test_input_still_reaches_the_ranks():
    done, _ = launch("import sys; print(sys.stdin.readline().strip().upper(), flush=True)", stdin=b"hello\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("HELLO") == 2


def test_a_launch_module_laid_out_otherwise_is_left_as_it_is():
    module = types.SimpleNamespace(select=select.select, main=lambda: None)
    assert quiet(module) and module.select is not select.select
    other = types.SimpleNamespace(select=lambda *a: None, main=lambda: None)
    before = other.select
    assert not quiet(other) and other.select is before
    assert not quiet(types.SimpleNamespace(select=select.select))  # no main
