"""`mlxpaged bench prefill` runs on the real default model at a tiny size; timings are never asserted,
only that each printed ratio comes from the printed times."""

from argparse import ArgumentTypeError, Namespace

import pytest

from mlxpaged.errors import ConfigError
from mlxpaged_app.bench.prefill import APPENDED_TOKENS, bench_prefill, parse_sizes, seeded_tokens
from mlxpaged_app.cli import build_parser


def printed_row(out: str, size: int) -> list[float]:
    line = next(line for line in out.splitlines() if line.split()[:1] == [str(size)])
    return [float(field.rstrip("x")) for field in line.split() if field != "s"]


def test_bench_prints_rows_whose_ratios_come_from_the_times(capsys):
    assert bench_prefill(Namespace(model=None, sizes=(64, 100_000), runs=1)) == 0
    out = capsys.readouterr().out
    size, prompt, mlx_lm, cold, cached, tok_s, cold_vs_mlx_lm, cached_vs_cold = printed_row(out, 64)
    assert (size, prompt) == (64, 64 - 1 - APPENDED_TOKENS)
    assert min(mlx_lm, cold, cached) > 0
    # Times are printed to 1 ms: allow that rounding, nothing more.
    assert tok_s == pytest.approx(prompt / cold, rel=0.01)
    assert cold_vs_mlx_lm == pytest.approx(mlx_lm / cold, rel=0.01, abs=0.006)
    assert cached_vs_cold == pytest.approx(cold / cached, rel=0.02, abs=0.06)
    assert "100000 skipped: above the model's context of 8192 tokens" in out


def test_seeded_prompts_repeat_and_differ_by_seed(default_loaded):
    tokenizer = default_loaded.tokenizer
    first = seeded_tokens(tokenizer, 300, seed=1)
    assert len(first) == 300 and first == seeded_tokens(tokenizer, 300, seed=1)
    assert first != seeded_tokens(tokenizer, 300, seed=2)


def test_sizes_flag_parses_and_refuses_bad_input():
    assert build_parser().parse_args(["bench", "prefill", "--sizes", "1024,4096"]).sizes == (1024, 4096)
    with pytest.raises(ArgumentTypeError, match="got '1k'"):
        parse_sizes("1k")
    with pytest.raises(ArgumentTypeError, match=r"more than 9 tokens .* got \[0\]"):
        parse_sizes("64,0")
    with pytest.raises(ConfigError, match="got 0"):
        bench_prefill(Namespace(model=None, sizes=(64,), runs=0))
