"""`mlxpaged bench lora` on the real default model, cut short (timings never asserted)."""

from __future__ import annotations

import re
from argparse import Namespace

from mlxpaged.errors import ConfigError
from mlxpaged_app.bench import lora as bench
from mlxpaged_app.cli import build_parser

import pytest


def test_parts_are_batch_or_decode():
    assert build_parser().parse_args(["bench", "lora", "--parts", "decode"]).parts == ("decode",)
    with pytest.raises(ConfigError, match="--parts batch, decode or both"):
        bench.bench_lora(Namespace(model=None, tokens=4, runs=1, parts=("ttft",)))


@pytest.mark.slow
def test_bench_prints_each_spread_against_the_base_and_the_paired_batch_one_ratio(capsys, monkeypatch):
    short = bench.random_prompts
    monkeypatch.setattr(bench, "random_prompts", lambda n, low, high, vocab: short(n, 16, 24, vocab))
    monkeypatch.setattr(bench, "CONCURRENT", 2)
    monkeypatch.setattr(bench, "SPREADS", (2,))
    assert bench.bench_lora(Namespace(model=None, tokens=4, runs=1, parts=None)) == 0
    out = capsys.readouterr().out
    assert re.search(r"base model alone\s+\d+\.\d tok/s", out)
    assert re.search(r"over 2 adapters\s+\d+\.\d tok/s\s+\d\.\d\dx base", out)
    assert len(re.findall(r"run \d: mlxpaged +\d+\.\d tok/s +mlx-lm +\d+\.\d tok/s", out)) == 1
    assert re.search(r"\(\d\.\d\dx\); median paired ratio \d\.\d\dx", out)
