"""`mlxpaged bench kv` on the real default model, cut short (timings never asserted), and the `--kv-bits` flags."""

from __future__ import annotations

import re
from argparse import Namespace

from mlxpaged.errors import ConfigError
from mlxpaged_app.bench import kv as bench
from mlxpaged_app.cli import build_parser
from mlxpaged_app.server.flags import cache_settings

import pytest


def test_kv_bits_flags_reach_the_engine_settings():
    serve = build_parser().parse_args(["serve", "--kv-bits", "4", "--kv-group-size", "32"])
    assert cache_settings(serve)["kv_bits"] == 4 and cache_settings(serve)["kv_group_size"] == 32
    assert "kv_bits" not in cache_settings(build_parser().parse_args(["serve"]))
    eight = cache_settings(build_parser().parse_args(["serve", "--kv-bits", "8"]))
    assert eight["kv_group_size"] is None  # the engine takes each kv_bits' default (cache/kv_quant.py)
    assert build_parser().parse_args(["chat", "--kv-bits", "8"]).kv_bits == 8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--kv-bits", "3"])


def test_the_held_out_text_is_a_few_thousand_words_without_its_source_line():
    text = bench.held_out_text()
    assert text.startswith("Now it came to pass in the days when the judges ruled")
    assert 2000 < len(text.split()) < 4000 and "public domain" not in text


@pytest.mark.slow
def test_bench_prints_capacity_perplexity_agreement_and_speed(capsys, monkeypatch):
    short = " ".join(bench.held_out_text().split()[:150])
    monkeypatch.setattr(bench, "held_out_text", lambda: short)
    monkeypatch.setattr(bench, "AGREEMENT_PROMPTS", bench.AGREEMENT_PROMPTS[:2])
    monkeypatch.setattr(bench, "AGREEMENT_TOKENS", 6)
    assert bench.bench_kv(Namespace(model=None, tokens=6, runs=1, kv_group_size=None, prompt_tokens=0)) == 0
    out = capsys.readouterr().out
    assert "8-bit: cpu path" in out and "groups of 32" in out and "groups of 64" in out  # each kv_bits' default
    float16 = next(line for line in out.splitlines() if "float16 pages" in line)
    ratios = [float(r) for r in re.findall(r"\((\d+\.\d+)x\)", float16)]
    assert ratios[0] == 1.0 and ratios[1] >= 1.77 and ratios[2] >= 3.5  # full, 8-bit (groups of 32), 4-bit
    ppl = {m[0]: float(m[1]) for m in re.findall(r"(full|8-bit|4-bit) (\d+\.\d+) \(", out)}
    assert set(ppl) == {"full", "8-bit", "4-bit"} and all(p > 1 for p in ppl.values())
    kl = re.search(r"mean KL\(full \|\| quantized\) per token, nats: 8-bit (\d+\.\d+), 4-bit (\d+\.\d+)", out)
    assert kl is not None and 0 < float(kl[1]) < float(kl[2])  # 4-bit pages are further from full precision
    assert re.search(r"8-bit: \d/2 replies identical, \d+/12 tokens before the first divergence", out)
    assert out.count("median paired ratio") == 2 and "after a prompt of the held-out text" not in out  # 8, 4 bits


def test_parts_decode_is_the_only_part_bench_kv_takes():
    assert build_parser().parse_args(["bench", "kv", "--parts", "decode"]).parts == ("decode",)
    with pytest.raises(ConfigError, match="--parts decode"):
        bench.bench_kv(Namespace(model=None, tokens=6, runs=1, kv_group_size=64, parts=("decode", "batch")))


@pytest.mark.slow
def test_parts_decode_prints_the_decode_speed_alone(capsys):
    args = Namespace(model=None, tokens=4, runs=1, kv_group_size=64, parts=("decode",), prompt_tokens=40)
    assert bench.bench_kv(args) == 0
    out = capsys.readouterr().out
    assert "8-bit: cpu path" in out
    short, long = out.split("batch-1 decode, 4 tokens after ")[1:]  # the chat prompt's line, then the long one's
    assert short.startswith("the chat prompt (") and short.count("median paired ratio") == 2
    assert long.startswith("a prompt of the held-out text (40 tokens)") and long.count("median paired ratio") == 2
    assert "perplexity" not in out and "capacity" not in out and "agreement" not in out


def test_the_long_prompt_leaves_room_for_the_decoded_tokens_in_the_models_context(monkeypatch):
    class Tokenizer:
        def encode(self, text: str) -> list[int]:
            return list(range(len(text.split())))

    class Engine:
        tokenizer = Tokenizer()
        max_model_len = 100

    monkeypatch.setattr(bench, "chat_prompt", lambda tokenizer, messages: [7, 8, 9])
    prompts = bench.decode_prompts(Engine(), 2048, tokens=10)
    assert list(prompts) == ["the chat prompt", "a prompt of the held-out text"]
    assert len(prompts["a prompt of the held-out text"]) == 90
    assert len(bench.decode_prompts(Engine(), 40, tokens=10)["a prompt of the held-out text"]) == 40
    Engine.max_model_len = 10
    assert list(bench.decode_prompts(Engine(), 2048, tokens=10)) == ["the chat prompt"]  # no room: no long line
    assert list(bench.decode_prompts(Engine(), 0, tokens=10)) == ["the chat prompt"]
