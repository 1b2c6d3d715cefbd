"""`mlxpaged doctor`'s distributed lines (app/doctor_distributed.py): one line alone; under mlx.launch the
setup and one line per rank, each rank's own facts gathered to rank 0 (the real 2-process run is in
test_launch.py, through `mlxpaged launch -n 2 -- doctor`)."""

from __future__ import annotations

import dataclasses
import socket

from mlxpaged_app.doctor import OK, WARN
from mlxpaged_app.doctor_distributed import RECORD_BYTES, decode, distributed_checks, encode, local_record, report

import pytest


def test_alone_it_is_one_line_saying_how_to_check_several(monkeypatch):
    monkeypatch.delenv("MLX_RANK", raising=False)
    [line] = distributed_checks()
    assert line.status == OK and line.label == "distributed"
    assert (
        line.detail.startswith("one process (run under mlx.launch") and "mlxpaged launch -n 2 -- doctor" in line.detail
    )


def test_a_record_goes_through_its_fixed_size_encoding_unchanged():
    record = local_record(3)
    data = encode(record)
    assert len(data) == RECORD_BYTES
    assert decode(data) == record
    assert record.rank == 3 and record.host == socket.gethostname() and record.total_bytes > 0


def test_a_record_longer_than_its_buffer_is_refused_with_the_sizes():
    record = dataclasses.replace(local_record(0), host="h" * RECORD_BYTES)
    with pytest.raises(ValueError, match=rf"is \d+ bytes, more than the {RECORD_BYTES} sent"):
        encode(record)


def test_the_report_has_the_setup_then_one_line_per_rank():
    one = local_record(0)
    other = dataclasses.replace(one, rank=1, host="mac-b", pid=one.pid + 1, available_bytes=1 << 30)
    lines = report("jaccl", [one, other])
    assert [line.label for line in lines] == ["distributed", "rank 0", "rank 1"]
    assert lines[0].status == OK and lines[0].detail.startswith("jaccl backend (mlx.launch), 2 ranks on 2 hosts; ")
    assert lines[2].detail.startswith(f"mac-b pid {one.pid + 1} (") and "available 1.07 GB" in lines[2].detail


def test_ranks_sharing_a_host_are_named():
    one = local_record(0)
    lines = report("ring", [one, dataclasses.replace(one, rank=1), dataclasses.replace(one, rank=2, host="b")])
    assert lines[0].status == OK
    assert (
        f"3 ranks on 2 hosts; ranks 0, 1 share {one.host} and each plans its KV cache from a 1/2 share"
        in lines[0].detail
    )


def test_ranks_on_different_versions_warn_with_each_ranks_version():
    one = local_record(0)
    lines = report("ring", [one, dataclasses.replace(one, rank=1, host="b", mlx="0.1.0")])
    assert lines[0].status == WARN
    assert f"the ranks differ in mlx: rank 0 {one.mlx}, rank 1 0.1.0" in lines[0].detail


def test_across_hosts_the_rank_with_the_least_room_is_named():
    one = dataclasses.replace(local_record(0), backend="metal", working_set_bytes=48 << 30, available_bytes=60 << 30)
    small = dataclasses.replace(one, rank=1, host="b", working_set_bytes=12 << 30, available_bytes=90 << 30)
    detail = report("ring", [one, small])[0].detail
    # Metal plans from the working set, not from available memory: rank 1 has more free RAM but the smaller set
    assert "the least room is rank 1's (Metal recommended working set 12.88 GB)" in detail
    assert "every rank's KV pool is cut to the smallest rank's plan" in detail
