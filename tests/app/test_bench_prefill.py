"""`mlxpaged bench prefill` runs on the real default model at a tiny size; timings are never asserted,
only that each printed ratio comes from the printed times."""

import re
from argparse import ArgumentTypeError, Namespace

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.errors import ConfigError
from mlxpaged_app.bench.prefill import APPENDED_TOKENS, FOLLOW_UPS, bench_prefill, parse_sizes, seeded_tokens
from mlxpaged_app.bench.prefill_attention import chunked_attention, contiguous_sdpa, make_inputs, measure_attention
from mlxpaged_app.cli import build_parser
from tests.app.printed_ratios import from_rounded

import mlx.core as mx
import pytest


def printed_row(out: str, size: int) -> list[float]:
    line = next(line for line in out.splitlines() if line.split()[:1] == [str(size)])
    return [float(field.rstrip("x")) for field in line.split() if field != "s"]


def test_bench_prints_rows_whose_ratios_come_from_the_times(capsys):
    assert bench_prefill(Namespace(model=None, sizes=(64, 100_000), runs=1)) == 0
    out = capsys.readouterr().out
    size, prompt, mlx_lm, cold, cached, tok_s, cold_vs_mlx_lm, cached_vs_cold = printed_row(out, 64)
    assert (size, prompt) == (64, 64 - 1 - APPENDED_TOKENS * FOLLOW_UPS)
    assert min(mlx_lm, cold, cached) > 0
    # Times are printed to 1 ms and ratios to 2 and 1 decimals: allow exactly that rounding, nothing more.
    assert tok_s == pytest.approx(prompt / cold, rel=0.01)
    assert from_rounded(cold_vs_mlx_lm, mlx_lm, cold, 0.01, 0.0005, 0.0005)
    assert from_rounded(cached_vs_cold, cold, cached, 0.1, 0.0005, 0.0005)
    assert "100000 skipped: above the model's context of 8192 tokens" in out
    assert "attention only, one layer, 64 tokens in 2048-token chunks: paged " in out


def test_cpu_clock_is_named_and_times_the_same_rows(capsys):
    assert build_parser().parse_args(["bench", "prefill", "--clock", "cpu"]).clock == "cpu"
    assert bench_prefill(Namespace(model=None, sizes=(64,), runs=1, clock="cpu")) == 0
    out = capsys.readouterr().out
    assert ", cpu clock" in out
    assert min(printed_row(out, 64)[2:5]) > 0


def test_seeded_prompts_repeat_and_differ_by_seed(default_loaded):
    tokenizer = default_loaded.tokenizer
    first = seeded_tokens(tokenizer, 300, seed=1)
    assert len(first) == 300 and first == seeded_tokens(tokenizer, 300, seed=1)
    assert first != seeded_tokens(tokenizer, 300, seed=2)


def test_sizes_flag_parses_and_refuses_bad_input():
    assert build_parser().parse_args(["bench", "prefill", "--sizes", "1024,4096"]).sizes == (1024, 4096)
    with pytest.raises(ArgumentTypeError, match="got '1k'"):
        parse_sizes("1k")
    with pytest.raises(ArgumentTypeError, match=r"more than 41 tokens .* got \[0\]"):
        parse_sizes("64,0")
    with pytest.raises(ConfigError, match="got 0"):
        bench_prefill(Namespace(model=None, sizes=(64,), runs=0))


@pytest.mark.parametrize("context,chunk,block_size", [(300, 128, 16), (257, 64, 8), (96, 96, 32)])
def test_chunked_prefill_over_pages_equals_the_contiguous_paths(context, chunk, block_size):
    # What the bench times must be the same attention: pages gathered per chunk, contiguous chunks, and
    # one mx.fast SDPA call (queries past 64 per chunk also exercise cpu_attention's causal blocks).
    x = make_inputs(context, heads=6, kv_heads=2, head_dim=32, block_size=block_size)
    want = contiguous_sdpa(x)
    for paged in (True, False):
        got = chunked_attention(x, chunk, paged)
        assert got.shape == want.shape and mx.allclose(got, want, atol=2e-5, rtol=1e-4).item()


def test_attention_line_prints_its_ratios_from_its_times():
    row = measure_attention(200, 64, heads=6, kv_heads=2, head_dim=32, block_size=16)
    numbers = [float(n) for n in re.findall(r"(\d+\.\d+)", row.line())]
    assert numbers == [
        round(row.paged_s, 3),
        round(row.contiguous_chunks_s, 3),
        round(row.paged_s / row.contiguous_chunks_s, 2),
        round(row.fast_sdpa_s, 3),
        round(row.paged_s / row.fast_sdpa_s, 2),
    ]
