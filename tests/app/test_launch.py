"""`mlxpaged launch`: mlx.launch's command line with this interpreter's mlxpaged (-n: the ring backend on
loopback; --hostfile: the hostfile's own backend), and a real run: `mlxpaged launch -n 2 -- doctor --json`,
rank 0's report of both ranks (rank 1 prints nothing, so stdout is one JSON document)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from mlxpaged.distributed.launch import free_port_run, launcher_path
from mlxpaged_app.cli import main
from mlxpaged_app.launch_status import exit_status, rank_statuses

MLXPAGED = str(Path(sys.executable).with_name("mlxpaged"))


def printed_command(capsys, *argv: str) -> list[str]:
    assert main(["launch", *argv]) == 0
    return shlex.split(capsys.readouterr().out)


def test_n_processes_run_this_interpreters_mlxpaged_on_the_ring_backend(capsys):
    line = printed_command(capsys, "-n", "2", "--print-command", "--", "serve", "--model", "M")
    assert line == [launcher_path(), "--backend", "ring", "-n", "2", "--", MLXPAGED, "serve", "--model", "M"]


def test_a_hostfile_keeps_its_own_backend_unless_one_is_given(capsys, tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"backend": "jaccl", "hosts": [{"ssh": "a"}, {"ssh": "b"}]}))
    line = printed_command(capsys, "--hostfile", str(hosts), "--env", "A=1", "--print-command", "--", "doctor")
    assert line == [launcher_path(), "--hostfile", str(hosts), "--env", "A=1", "--", MLXPAGED, "doctor"]
    line = printed_command(capsys, "--hostfile", str(hosts), "--backend", "ring", "--print-command", "--", "doctor")
    assert line[1:5] == ["--hostfile", str(hosts), "--backend", "ring"]


def test_what_cannot_be_launched_is_refused_with_the_reason(capsys, tmp_path):
    assert main(["launch", "-n", "2", "--", "python", "x.py"]) == 2
    assert "launch runs mlxpaged commands (bench, chat, doctor, models, pull, serve), not 'python'" in (
        capsys.readouterr().err
    )
    assert main(["launch", "-n", "2", "--"]) == 2
    assert "say what to run after --" in capsys.readouterr().err
    assert main(["launch", "--hostfile", str(tmp_path / "none.json"), "--", "doctor"]) == 2
    assert f"no hostfile at {tmp_path / 'none.json'}" in capsys.readouterr().err
    assert main(["launch", "-n", "0", "--", "doctor"]) == 2
    assert "the number of processes must be at least 1, got 0" in capsys.readouterr().err


def test_doctor_in_one_launched_process_is_alone():
    done = subprocess.run([MLXPAGED, "launch", "-n", "1", "--", "doctor", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    last = json.loads(done.stdout)["checks"][-1]
    assert last == {"status": "OK", "label": "distributed", "detail": "one process under mlx.launch (-n 1)"}


def test_doctor_in_two_processes_reports_both_ranks_from_rank_0():
    command = [MLXPAGED, "launch", "-n", "2", "--starting-port", str(free_port_run(2)), "--", "doctor", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)  # one document: only rank 0 printed
    lines = {c["label"]: c for c in report["checks"]}
    assert [c["label"] for c in report["checks"]][-3:] == ["distributed", "rank 0", "rank 1"]
    assert lines["distributed"]["detail"].startswith("ring backend (mlx.launch), 2 ranks on 1 host; ranks 0, 1 share")
    pids = [int(lines[f"rank {r}"]["detail"].split(" pid ")[1].split()[0]) for r in (0, 1)]
    assert len(set(pids)) == 2 and os.getpid() not in pids  # each rank sent its own record
    assert all(" available " in lines[f"rank {r}"]["detail"] for r in (0, 1))
    assert "FAIL" not in {c["status"] for c in report["checks"]}, report


def test_the_exit_status_is_rank_0s_when_it_failed_else_the_first_failed_ranks():
    log = (
        b"\x1b[33m[WARN] Node with rank 1 exited with code -9 \x1b[0m\n"
        b"\x1b[33m[WARN] Node with rank 0 exited with code 1 \x1b[0m\n"
    )
    assert rank_statuses(log) == {1: 137, 0: 1}
    assert exit_status(0, rank_statuses(log)) == 1  # rank 0's (the server's own), not mlx.launch's 0
    assert exit_status(0, rank_statuses(b"[WARN] Node with rank 2 was killed\n")) == 137
    assert exit_status(0, {}) == 0 and exit_status(3, {}) == 3  # no rank logged as failed: mlx.launch's status
    # rank 1 failed first and mlx.launch terminated rank 0 (-15): the cause, rank 1's status, not the SIGTERM
    assert (
        exit_status(0, rank_statuses(b"Node with rank 1 exited with code 2\nNode with rank 0 exited with code -15"))
        == 2
    )
    assert exit_status(0, {0: 143, 1: 143}) == 143


def test_a_rank_that_fails_fails_the_launch():
    """mlx.launch itself exits 0 here; `mlxpaged launch` exits with the failing rank's status (1: an unknown
    model; whichever rank fails first, mlx.launch terminates the other) and passes the reasons through."""
    command = [MLXPAGED, "launch", "-n", "2", "--starting-port", str(free_port_run(2)), "--", "pull", "no-such-model"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "unknown model 'no-such-model'" in done.stderr, done.stderr[-3000:]
    assert re.search(r"Node with rank [01] exited with code 1\b", done.stderr), done.stderr[-3000:]
