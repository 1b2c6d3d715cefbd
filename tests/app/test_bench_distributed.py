"""`mlxpaged bench distributed`: a real run in 1 and 2 processes (mlx.launch, ring backend on loopback) prints
its table and agrees on the tokens; the verdict with fake runs whose tokens differ; --processes parsing."""

from __future__ import annotations

import re
from argparse import ArgumentTypeError

from mlxpaged_app.bench import distributed
from mlxpaged_app.bench.distributed import NOTE, parse_processes
from mlxpaged_app.cli import main

import pytest

ROW = re.compile(r"^\s+(\d+)\s+([\d.]+)s\s+([\d.]+)s\s+([\d.]+)\s+([\d.]+)x\s+(.+)$")


def table_rows(out: str) -> dict[int, tuple[float, float, str]]:
    """processes -> (first token s, decode tok/s, same tokens) from the printed table."""
    rows = {}
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            rows[int(match[1])] = (float(match[3]), float(match[4]), match[6])
    return rows


@pytest.mark.slow  # three model loads in 1 + 2 processes on a shared 2-core box: ~20-40 s
def test_one_and_two_processes_print_the_table_and_agree(capsys):
    assert main(["bench", "distributed", "--processes", "2", "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert list(rows) == [1, 2]
    assert rows[1][2] == "(reference)" and rows[2][2] == "yes"
    assert all(ttft > 0 and decode > 0 for ttft, decode, _ in rows.values())
    assert "every process count gave the same tokens: yes" in out
    assert NOTE in out and "On one machine's CPU more processes are slower" in out


def fake_result(tokens: list[list[int]], decode: float) -> dict:
    return {"start_s": 1.0, "ttft": [0.1], "decode": [decode], "tokens": tokens, "same_every_round": True}


def test_tokens_that_differ_from_one_process_are_a_failure(monkeypatch, capsys):
    runs = {1: fake_result([[5, 6], [7]], 40.0), 2: fake_result([[5, 6], [7]], 20.0), 4: fake_result([[5, 9], [7]], 5)}
    monkeypatch.setattr(distributed, "run_processes", lambda model, n, tokens, rounds: runs[n])
    assert main(["bench", "distributed", "--model", "unused"]) == 1
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows[2] == (0.1, 20.0, "yes") and rows[4] == (0.1, 5.0, "NO")
    assert "0.50x" in out and "0.12x" in out
    assert "every process count gave the same tokens: NO" in out


def test_process_counts_always_start_with_one():
    assert parse_processes("4,2") == (1, 2, 4)
    assert parse_processes("1") == (1,)
    for bad in ("0,2", "two", ""):
        with pytest.raises(ArgumentTypeError, match=f"got {bad!r}"):
            parse_processes(bad)
