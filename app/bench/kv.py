"""`mlxpaged bench kv`: what quantized KV pages (kv_bits 8 and 4) buy and cost against full precision, in one run.

- capacity: tokens the memory plan fits in one KV budget per kv_bits (the pools' real bytes: packed data,
  scales and biases), and the ratio to full precision in the model's KV dtype here, and to float16 pages (a
  Mac's dtype, the issue's baseline);
- perplexity on a held-out English text (tests/data/ruth_kjv.txt: the Book of Ruth, KJV, public domain),
  prefilled through paged passes whose pages are quantized as they are written (runner/prompt_scoring.py),
  and the mean KL of each quantized setting's next-token distributions from full precision's over the same
  passes: one text's perplexity ratio moves by a few tenths of a point with float rounding alone, the KL less;
- greedy agreement on a fixed prompt set: tokens equal to full precision's, and replies equal in full;
- batch-1 decode tok/s per kv_bits, every engine warmed up, runs alternating so each ratio is measured in
  the same stretch of the machine's load (`--parts decode`: this part alone): after a short chat prompt, and
  after a long prompt (`--prompt-tokens`, default 2,048 tokens of the held-out text), since what quantized
  pages cost a decode step grows with the keys it reads on the paths that unpack them.
"""

from __future__ import annotations

import dataclasses
import statistics
from argparse import Namespace
from pathlib import Path

from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.errors import ConfigError
from mlxpaged.loading.loader import chat_prompt
from mlxpaged.platform.blas import blas_status
from mlxpaged.platform.memory import DeviceFacts, plan_memory
from mlxpaged.units import format_size
from mlxpaged_app.bench.decode import DECODE_PROMPT, time_engine
from mlxpaged_app.bench.timing import after_warm_up

BITS = (None, 8, 4)  # full precision first: every ratio is against it
TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "ruth_kjv.txt"
CAPACITY_BUDGET = "1GB"
AGREEMENT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
)
AGREEMENT_TOKENS = 32
LONG_PROMPT_TOKENS = 2048  # the long-prompt decode line's default (an agent's prompt is longer still)


def name(bits: int | None) -> str:
    return "full" if bits is None else f"{bits}-bit"


def held_out_text(path: Path = TEXT) -> str:
    """The text after its first paragraph (which names the source)."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: the held-out text ships with the tests (a source checkout)")
    return path.read_text().split("\n\n", 1)[1].strip()


def capacity(facts, group_size: int | None) -> None:
    """Tokens that fit in CAPACITY_BUDGET per kv_bits, in this dtype and in float16."""
    device = DeviceFacts.detect()
    scheduler = SchedulerConfig()
    for label, shape in (("this dtype", facts), ("float16 pages", _as_float16(facts))):
        tokens = {}
        for bits in BITS:
            cache = CacheConfig(kv_memory=CAPACITY_BUDGET, cache_tokens=10**9, kv_bits=bits, kv_group_size=group_size)
            tokens[bits] = plan_memory(device, shape, cache, scheduler, weights_resident=True).token_capacity
        line = ", ".join(
            f"{name(b)} {tokens[b]:,} ({tokens[b] / tokens[None]:.2f}x)" for b in BITS if tokens[b] is not None
        )
        bytes_per_token = shape.kv.bytes_per_token
        print(f"  {label} ({bytes_per_token:,} B/token full): {line}")


def _as_float16(facts):
    return dataclasses.replace(facts, kv=dataclasses.replace(facts.kv, dtype_bytes=2))


def perplexities(engine, text: str, group_size: int | None, transforms: dict | None = None) -> dict:
    """Perplexity per kv_bits, and the mean KL of each quantized setting's next-token distributions from full
    precision's; `transforms[bits]`: the K/V coordinates that kv_bits' engine stores its pages in (its
    `kv.transform`: 4-bit pages are calibrated at load, runner/kv_calibration.py)."""
    from mlxpaged.runner.prompt_scoring import PageSetting, compare_scores, perplexity

    tokens = engine.tokenizer.encode(text)
    settings = [
        PageSetting(CacheConfig(kv_bits=bits, kv_group_size=group_size).quantization, (transforms or {}).get(bits))
        for bits in BITS
    ]
    scores = dict(
        zip(BITS, compare_scores(engine.model, engine.layout, tokens, engine.kv.dtype, settings), strict=True)
    )
    out = {bits: perplexity(s.logprobs) for bits, s in scores.items()}
    base = out[None]
    print(
        f"  {len(tokens):,} tokens: "
        + ", ".join(f"{name(b)} {p:.4f} ({(p / base - 1) * 100:+.2f}%)" for b, p in out.items())
    )
    print(
        "  mean KL(full || quantized) per token, nats: "
        + ", ".join(f"{name(b)} {scores[b].kl.mean():.5f}" for b in BITS[1:])
    )
    return out


def agreement(engines: dict) -> None:
    from mlxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    replies = {}
    for bits, engine in engines.items():
        prompts = [chat_prompt(engine.tokenizer, [{"role": "user", "content": p}]) for p in AGREEMENT_PROMPTS]
        replies[bits] = [c.token_ids for c in engine.generate(prompts, params)]
    for bits in BITS[1:]:
        prefix = [_common_prefix(a, b) for a, b in zip(replies[bits], replies[None], strict=True)]
        same = sum(
            a == b for r, f in zip(replies[bits], replies[None], strict=True) for a, b in zip(r, f, strict=False)
        )  # a reply may stop early
        total = len(AGREEMENT_PROMPTS) * AGREEMENT_TOKENS
        print(
            f"  {name(bits)}: {sum(p == AGREEMENT_TOKENS for p in prefix)}/{len(prefix)} replies identical, "
            f"{sum(prefix)}/{total} tokens before the first divergence, {same}/{total} tokens equal by position"
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def decode_speed(engines: dict, runs: int, tokens: int, prompt: list[int]) -> None:
    rounds = after_warm_up(lambda: {b: time_engine(e, prompt, tokens)[1] for b, e in engines.items()}, runs)
    for i, r in enumerate(rounds, 1):
        print(f"  run {i}: " + ", ".join(f"{name(b)} {r[b]:.1f} tok/s" for b in BITS))
    for bits in BITS[1:]:
        paired = [r[bits] / r[None] for r in rounds]
        print(
            f"  {name(bits)}: median {statistics.median(r[bits] for r in rounds):.1f} tok/s vs full "
            f"{statistics.median(r[None] for r in rounds):.1f}; median paired ratio {statistics.median(paired):.2f}x"
        )


def decode_prompts(engine, long_tokens: int, tokens: int) -> dict[str, list[int]]:
    """The decode lines' prompts by their description: the short chat prompt, then (unless `long_tokens` is 0)
    the held-out text's first `long_tokens` tokens, as many as it has and the model's context leaves room for
    with `tokens` decoded after them."""
    prompts = {"the chat prompt": chat_prompt(engine.tokenizer, [{"role": "user", "content": DECODE_PROMPT}])}
    long_tokens = min(long_tokens, engine.max_model_len - tokens)
    if long_tokens > 0:
        prompts["a prompt of the held-out text"] = engine.tokenizer.encode(held_out_text())[:long_tokens]
    return prompts


def bench_kv(args: Namespace) -> int:
    from mlxpaged.engine.engine import Engine

    group_size = getattr(args, "kv_group_size", None)  # None: each kv_bits' default (cache/kv_quant.py)
    parts = getattr(args, "parts", None)
    if parts is not None and set(parts) != {"decode"}:
        raise ConfigError(f"bench kv takes --parts decode (the decode-speed part alone), got {','.join(parts)}")
    only_decode = parts is not None
    engines = {
        bits: Engine.from_pretrained(args.model, enable_prefix_cache=False, kv_bits=bits, kv_group_size=group_size)
        for bits in BITS
    }
    try:
        full = engines[None]
        print(
            f"model {full.loaded.name} ({full.loaded.dtype}, KV {full.kv.dtype}), BLAS {blas_status().name}; "
            "a shared 2-core machine: timings are noisy"
        )
        for bits, engine in engines.items():
            path = engine.built.attention.status()["path"]
            groups = "" if engine.kv.quantization is None else f", groups of {engine.kv.quantization.group_size}"
            coordinates = "" if engine.kv.transform is None else ", K/V in calibrated coordinates (kv_transform.py)"
            print(f"  {name(bits)}: {path} path, {format_size(engine.kv.bytes_per_block)}/block{groups}{coordinates}")
        if not only_decode:
            print(f"capacity in {CAPACITY_BUDGET} of KV memory (tokens, ratio to full precision):")
            capacity(full.facts, group_size)
            print(f"perplexity on {TEXT.name} (Book of Ruth, KJV), prefilled through quantized pages:")
            perplexities(full, held_out_text(), group_size, {b: e.kv.transform for b, e in engines.items()})
            print(
                f"greedy agreement with full precision, {len(AGREEMENT_PROMPTS)} prompts x {AGREEMENT_TOKENS} tokens:"
            )
            agreement(engines)
        long_tokens = getattr(args, "prompt_tokens", None)
        prompts = decode_prompts(full, LONG_PROMPT_TOKENS if long_tokens is None else long_tokens, args.tokens)
        for label, prompt in prompts.items():
            print(
                f"batch-1 decode, {args.tokens} tokens after {label} ({len(prompt):,} tokens), {args.runs} "
                "alternating runs (+1 warm-up):"
            )
            decode_speed(engines, args.runs, args.tokens, prompt)
    finally:
        for engine in engines.values():
            engine.close()
    return 0
