"""`mlxpaged bench restart` end to end on a tiny model directory: two real worker processes, figures printed."""

from __future__ import annotations

from argparse import Namespace

from mlxpaged_app.bench.restart import bench_restart
from tests.tiny_models import write_tiny_llama_dir


def test_bench_restart_prints_cold_ram_and_disk_times_and_their_ratios(tmp_path, capsys):
    model_dir = write_tiny_llama_dir(tmp_path / "model", dtype="float32")
    assert bench_restart(Namespace(model=str(model_dir), prompt_tokens=300)) == 0
    out = capsys.readouterr().out
    for label in (
        "cold",
        "RAM hit (same process)",
        "disk hit (after restart)",
        "disk hit / RAM hit",
        "cold / disk hit",
    ):
        assert label in out
    assert "288 of 300 tokens from disk" in out  # 18 full blocks of 16 (the last token is never cached)
    assert "299 of 300 tokens cached" in out  # RAM: the full blocks and the partial one, all but the last token
