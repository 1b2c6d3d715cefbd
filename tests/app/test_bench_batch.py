"""`mlxpaged bench batch` on a tiny random model (timings never asserted): uniform and skewed prompt lengths, one
line per concurrency, mlx-lm's side skipped with the reason where its left-padded batch would not fit."""

from __future__ import annotations

import math
import re
from argparse import Namespace

from mlxpaged_app.bench import batch
from mlxpaged_app.cli import build_parser
from tests.tiny_models import write_tiny_llama_dir

import pytest


def test_skewed_lengths_are_log_uniform_over_128_to_8k():
    lengths = batch.skewed_lengths(4000)
    assert min(lengths) >= 128 and max(lengths) <= 8192
    logs = [math.log2(n) for n in lengths]  # 7 to 13: each octave about as often
    per_octave = [sum(7 + k <= x < 8 + k for x in logs) for k in range(6)]
    assert all(550 < n < 800 for n in per_octave), per_octave
    assert batch.skewed_lengths(16) == batch.skewed_lengths(16)  # seeded: both sides and every run get the same


def test_the_flags():
    args = build_parser().parse_args(["bench", "batch", "--lengths", "skewed", "--concurrency", "16,64"])
    assert (args.lengths, args.concurrency) == ("skewed", (16, 64))
    assert build_parser().parse_args(["bench", "batch"]).lengths == "uniform"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), dtype="float32")


def test_skewed_batches_print_both_sides_and_the_ratio_per_concurrency(model_dir, capsys, monkeypatch):
    short = batch.skewed_lengths
    monkeypatch.setattr(batch, "skewed_lengths", lambda n: short(n, 8, 64))  # 8-64 tokens: a short run
    args = Namespace(model=str(model_dir), tokens=4, runs=1, concurrency=(3, 5), lengths="skewed")
    assert batch.bench_batch(args) == 0
    out = capsys.readouterr().out
    assert "skewed prompt lengths, 4 new tokens each" in out
    for n in (3, 5):
        section = out.split(f"\n{n} requests, prompts ")[1].split(" requests, prompts ")[0]
        assert re.search(r"mlx-lm batch +\d+\.\d s +\d+\.\d tok/s aggregate", section)
        assert re.search(r"mlxpaged +\d+\.\d s +\d+\.\d tok/s aggregate", section)
        assert re.search(r"ratio \(mlxpaged / mlx-lm\): throughput \d+\.\d\dx", section)


def test_a_padded_batch_that_cannot_fit_skips_mlx_lms_side_saying_why(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(batch, "MLX_LM_HEADROOM", 0.0)
    args = Namespace(model=str(model_dir), tokens=4, runs=1, concurrency=(2,), lengths="uniform")
    assert batch.bench_batch(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"mlx-lm batch +skipped: its batch left-padded to \d+ tokens holds .+ of K/V, more than 0%", out)
    assert "mlxpaged " in out and "ratio" not in out
