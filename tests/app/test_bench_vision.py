"""`mlxpaged bench vision` end to end on a tiny SmolVLM checkpoint: every line it prints, beside mlx-vlm's own
generate and batch_generate on the same directory (the figures of a random tiny model are not looked at)."""

from __future__ import annotations

from argparse import Namespace

from mlxpaged_app.bench.vision import bench_vision
from tests.vision.tiny_vlm_dirs import write_tiny_smolvlm_dir

import pytest


@pytest.mark.slow
def test_bench_vision_prints_cold_next_turn_and_concurrent_lines_beside_mlx_vlm(tmp_path, capsys):
    model = write_tiny_smolvlm_dir(tmp_path / "smolvlm")
    assert bench_vision(Namespace(model=str(model), runs=1, tokens=4)) == 0
    out = capsys.readouterr().out
    for label in (
        "cold time to first token      mlxpaged",
        "next turn, same image         mlxpaged",
        "next turn / its cold time",
        "next turn / its prefill alone",
        "8 concurrent, 4 tokens  mlxpaged",
        "mlx-vlm batch_generate",
    ):
        assert label in out, out


def test_bench_vision_asks_for_a_model(capsys):
    assert bench_vision(Namespace(model=None, runs=1, tokens=4)) == 2
    assert "give a vision-language model with --model" in capsys.readouterr().out
