"""mlxpaged/distributed/launch.py: mlx.launch's command lines, which backend a launched process got (from the
environment mlx.launch exports), `-n 1`'s empty ring hostfile read as one process, and the RESULT line."""

from __future__ import annotations

from mlxpaged.distributed.launch import (
    launch_command,
    launched_alone,
    launched_backend,
    launcher_path,
    loopback_command,
    result_from,
    result_line,
)
from mlxpaged.distributed.ranks import join

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
