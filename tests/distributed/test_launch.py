"""mlxpaged/distributed/launch.py: mlx.launch's command lines, which backend a launched process got (from the
environment mlx.launch exports), `-n 1`'s empty ring hostfile read as one process, and the RESULT line."""

from __future__ import annotations

import socket
import sys

from mlxpaged.distributed import launch
from mlxpaged.distributed.launch import (
    free_port_run,
    launch_command,
    launched_alone,
    launched_backend,
    launcher_path,
    loopback_command,
    result_from,
    result_line,
    without_busy_wait,
)
from mlxpaged.distributed.ranks import JoinError, join, join_group

import pytest

LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_JACCL_RING", "NCCL_HOST_IP")


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_backend_is_read_from_what_mlx_launch_exported(env, tmp_path):
    assert launched_backend() is None
    env.setenv("MLX_RANK", "1")
    assert launched_backend() == "unknown"
    env.setenv("MLX_HOSTFILE", str(tmp_path / "hosts"))
    assert launched_backend() == "ring"
    env.setenv("MLX_JACCL_COORDINATOR", "10.0.0.1:5000")
    assert launched_backend() == "jaccl"
    env.setenv("MLX_JACCL_RING", "1")
    assert launched_backend() == "jaccl-ring"


def test_one_ring_process_is_alone_and_joins_no_group(env, tmp_path):
    hostfile = tmp_path / "hosts"
    env.setenv("MLX_RANK", "0")
    env.setenv("MLX_HOSTFILE", str(hostfile))
    hostfile.write_text("\n")  # what mlx.launch -n 1 writes
    assert launched_alone() and join() is None
    hostfile.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"]]\n')
    assert not launched_alone()


def test_command_lines():
    assert loopback_command(["x", "y"], 1) == ["x", "y"]  # one process: no launcher
    line = loopback_command(["x"], 4)
    assert line[:5] == [launcher_path(), "--backend", "ring", "-n", "4"] and line[5] == "--starting-port"
    assert line[-2:] == ["--", "x"]
    assert launch_command(["x"], hostfile="h.json") == [launcher_path(), "--hostfile", "h.json", "--", "x"]
    with pytest.raises(ValueError, match="either a number of processes"):
        launch_command(["x"], 2, hostfile="h.json")
    with pytest.raises(ValueError, match="no command"):
        launch_command([], 2)


def test_the_result_line_round_trips_and_must_be_alone():
    line = result_line({"a": [1, 2]})
    assert result_from(f"noise\n{line}\nmore\n") == {"a": [1, 2]}
    with pytest.raises(ValueError, match="expected one RESULT line, found 2"):
        result_from(f"{line}\n{line}\n")


def test_a_group_that_cannot_be_joined_says_which_rank_and_why(env, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text('[["127.0.0.1:notaport"], ["127.0.0.1:5001"]]\n')
    env.setenv("MLX_RANK", "0")
    env.setenv("MLX_HOSTFILE", str(hostfile))
    with pytest.raises(JoinError, match=r"rank 0 could not join the processes mlx.launch started \(.*notaport"):
        join_group()


def test_free_ports_are_picked_below_the_ephemeral_range_and_skip_taken_ones(monkeypatch):
    """Below the range the system hands outgoing connections, so none of them takes a rank's port before it binds."""
    floor = launch._ephemeral_floor()
    first = free_port_run(4)
    assert first >= launch.FIRST_PICKED_PORT and first + 4 <= floor
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first + 2))
        picks = iter([first, *range(first + 4, first + 400, 4)])
        monkeypatch.setattr(launch.random, "randrange", lambda low, high: next(picks))
        assert free_port_run(4) >= first + 4  # first's run holds a taken port


def test_mlxpaged_launch_runs_mlx_launchs_code_without_its_busy_wait():
    line = launch_command(["x"], 2, starting_port=30000)
    quiet = without_busy_wait(line)
    assert quiet[:3] == [sys.executable, "-m", "mlxpaged.distributed.quiet_launch"] and quiet[3:] == line[1:]
    assert without_busy_wait(["other-launcher", "x"]) == ["other-launcher", "x"]
