"""`mlxpaged bench fleet`'s own logic on a tiny random model (timings never asserted): the agents' prompts, the
quantiles, and a short fleet against `mlxpaged serve` and mlx_lm.server as live processes, with a long prompt."""

from __future__ import annotations

import os
import re
from argparse import Namespace
from pathlib import Path

from mlxpaged_app.bench import fleet
from mlxpaged_app.cli import build_parser
from tests.tiny_models import write_tiny_llama_dir

import pytest


def test_every_agent_shares_the_system_prompt_and_gets_its_own_task_and_tool_results():
    system = fleet.system_prompt()
    assert 1500 <= len(system.split()) < 1700 and all(name in system for name, _, _ in fleet.TOOLS)
    assert fleet.system_prompt() == system  # one cacheable prefix for every agent and turn
    assert fleet.tool_result(0, 1) != fleet.tool_result(1, 1) != fleet.tool_result(1, 2)
    assert len(fleet.long_prompt(6000).split()) > 3000
    warm, long = fleet.warm_up_prompt(2000), fleet.long_prompt(6000)
    assert warm[:16] != long[:16]  # the warm-up leaves nothing of the long prompt in the prefix cache


def test_quantiles_by_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert (fleet.quantile(values, 0.5), fleet.quantile(values, 0.95), fleet.quantile(values, 0.99)) == (50, 95, 99)
    assert fleet.quantile([3.0], 0.99) == 3.0
    assert fleet.quantile([], 0.5) != fleet.quantile([], 0.5)  # NaN


def test_the_flags():
    args = build_parser().parse_args(
        ["bench", "fleet", "--agents", "3", "--turns", "2", "--long", "--servers", "mlxpaged,mlx_lm.server"]
    )
    assert (args.agents, args.turns, args.long, args.servers) == (3, 2, True, ("mlxpaged", "mlx_lm.server"))
    assert build_parser().parse_args(["bench", "fleet", "--soak", "30m"]).soak == 1800
    for bad in ("1x", "0", "-5m"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "fleet", "--soak", bad])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), dtype="float32")


def files_under(directory: str | None) -> set[Path]:
    return {p for p in Path(directory).rglob("*") if p.is_file()} if directory else set()


@pytest.mark.slow
def test_a_short_fleet_against_mlxpaged_and_mlx_lm_server(model, capsys, monkeypatch):
    # Each server starts with an empty disk tier of its own (the fleet's prompts are the same from run to run): the
    # user's (here the tests') cache directory is not written, and mlxpaged's own directory was.
    tiers: list[str] = []
    held: list[int] = []  # files in each run's disk tier once its server stopped
    cold_disk_tier, stop_server = fleet.cold_disk_tier, fleet.stop_server

    def recorded_tier():
        tier = cold_disk_tier()
        tiers.append(tier.name)
        return tier

    def stop(process):
        stop_server(process)
        held.append(len(files_under(tiers[-1])))

    monkeypatch.setattr(fleet, "cold_disk_tier", recorded_tier)
    monkeypatch.setattr(fleet, "stop_server", stop)
    users = files_under(os.environ.get("MLXPAGED_KV_DISK"))
    args = Namespace(
        model=str(model),
        agents=2,
        turns=2,
        tokens=4,
        long=True,
        servers=("mlxpaged", "mlx_lm.server"),
        system_words=120,
    )
    assert fleet.bench_fleet(args) == 0
    out = capsys.readouterr().out
    assert "2 agents x 2 turns" in out and "a long prompt of ~1536 tokens" in out
    for server in ("mlxpaged", "mlx_lm.server"):
        row = re.search(
            rf"^{re.escape(server)} +(\d+\.\d) +(\d+\.\d\d)s .* +(\d+) +(\d+\.\d+)s +(\d+\.\d)s$", out, re.M
        )
        assert row is not None, out
        assert float(row[1]) > 0 and row[3] == "0"  # wall time; no failed turn (then others' ITL p99, long TTFT)
    assert re.search(r"mlxpaged against the better peer \(mlx_lm.server\): wall \d+\.\d\dx faster", out)
    assert held[0] > 0 and held[1] == 0  # mlxpaged kept its blocks in its own directory; mlx_lm.server has none
    assert files_under(os.environ.get("MLXPAGED_KV_DISK")) == users
    assert not any(Path(tier).exists() for tier in tiers)  # removed after each run


@pytest.mark.slow
def test_a_soak_with_clients_hanging_up_leaves_no_block_owned(model, capsys):
    args = Namespace(model=str(model), agents=3, turns=3, tokens=6, long=False, soak=0.1, system_words=120)
    assert fleet.bench_fleet(args) == 0  # one round at least; no failed turn, no block owned once idle
    out = capsys.readouterr().out
    summary = re.search(r"soak: 1 rounds, (\d+) turns \((\d+) hung up on purpose\), 0 failed, 0 answered 5xx", out)
    assert summary is not None, out
    assert "KV blocks still owned once idle: 0" in out
