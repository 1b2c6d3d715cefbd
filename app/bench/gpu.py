"""`mlxpaged bench gpu`: every target ratio of issue 21 in one run, plain mlx-lm measured beside the
engine in the same process, both sides warmed up on the exact shapes before any timing.

    mlxpaged bench gpu [--model DIR] [--tokens 128] [--runs 3] [--concurrency 16,64] [--sizes 2048,8192]
                       [--parts decode,batch,ttft]

The mlx-lm side is what a user would run instead (app/bench/baseline.py): on a GPU its own untouched
`mlx_lm.load` of the checkpoint; on MLX's CPU backend the engine's float32 model. The measuring is the
other benches' (decode.py, batch.py, prefill.py); this module picks the workloads and the targets.
"""

from __future__ import annotations

import statistics
from argparse import ArgumentTypeError, Namespace

from mlxpaged.config import DEFAULT_CACHE_TOKENS
from mlxpaged.errors import ConfigError
from mlxpaged.loading.checkpoint import KV_DTYPE_NAMES, checkpoint_tensors, kv_dtype
from mlxpaged.loading.loader import chat_prompt
from mlxpaged_app.bench.baseline import mlx_lm_side, weight_dtype
from mlxpaged_app.bench.batch import median_tok_s, random_prompts, run_engine_batch, run_mlx_lm_batch
from mlxpaged_app.bench.decode import DECODE_PROMPT, paired_decode
from mlxpaged_app.bench.gpu_report import SummaryRow, environment_lines, summary_table
from mlxpaged_app.bench.prefill import APPENDED_TOKENS, FOLLOW_UPS, HEADER, format_row, measure_size

PARTS = ("decode", "batch", "ttft")
DEFAULT_CONCURRENCY = (16, 64)
DEFAULT_SIZES = (2048, 8192)
BATCH_PROMPT_TOKENS = (256, 512)  # each request's prompt length, seeded, as in `bench batch`

# Issue 21's targets. Ratios read "mlxpaged against mlx-lm, > 1 is mlxpaged ahead": throughput ours / theirs,
# time to first token theirs / ours. The cached prefix is a percentage of the engine's own cold time.
DECODE_TARGET = 1.0  # batch 1, both shapes (aim for 1.1x: the engine owns the whole step)
BATCH_TARGET = 2.0  # 16 and 64 concurrent requests against mlx-lm's BatchGenerator, aggregate tok/s
COLD_TTFT_TARGET = 1.0  # cold time to first token at 2k and 8k against stream_generate
CACHED_PERCENT_TARGET = 5.0  # at the largest size measured (8k by default)


def parse_concurrency(text: str) -> tuple[int, ...]:
    """`--concurrency 16,64`: how many requests run at once, positive and comma-separated."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ArgumentTypeError(
            f"--concurrency takes comma-separated request counts like 16,64, got {text!r}"
        ) from None
    if any(c < 1 for c in counts):
        raise ArgumentTypeError(f"--concurrency counts must each be at least 1, got {list(counts)}")
    return counts


def parse_parts(text: str) -> tuple[str, ...]:
    """`--parts decode,ttft`: run only these (a GPU command has 10 minutes; the summary lists what ran)."""
    parts = tuple(part.strip() for part in text.split(","))
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ArgumentTypeError(f"--parts takes some of {','.join(PARTS)}, got {text!r}")
    return parts


def decode_rows(engine, baseline, tokens: int, runs: int) -> list[SummaryRow]:
    prompt = chat_prompt(engine.tokenizer, [{"role": "user", "content": DECODE_PROMPT}])
    print(
        f"\nbatch-1 decode: prompt {len(prompt)} tokens, {tokens} new tokens, {runs} alternating runs "
        f"(+1 warm-up pair)",
        flush=True,
    )
    ref, ours = paired_decode(baseline, engine, prompt, tokens, runs)
    theirs, mine = statistics.median(ref), statistics.median(ours)
    return [SummaryRow("batch-1 decode, tok/s", f"{theirs:.1f}", f"{mine:.1f}", mine / theirs, "x", DECODE_TARGET)]


def batch_row(engine, baseline, count: int, tokens: int, runs: int) -> SummaryRow:
    prompts = random_prompts(count, *BATCH_PROMPT_TOKENS, engine.loaded.config["vocab_size"])
    print(
        f"\n{count} concurrent requests: prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{tokens} new each, median of {runs} runs per side (+1 warm-up of the same batch)",
        flush=True,
    )
    theirs = median_tok_s(lambda: run_mlx_lm_batch(baseline.model, prompts, tokens), runs)
    mine = median_tok_s(lambda: run_engine_batch(engine, prompts, tokens), runs)
    print(f"  mlx-lm BatchGenerator {theirs:.1f} tok/s aggregate, mlxpaged {mine:.1f} tok/s aggregate", flush=True)
    return SummaryRow(
        f"{count} concurrent, aggregate tok/s", f"{theirs:.1f}", f"{mine:.1f}", mine / theirs, "x", BATCH_TARGET
    )


def ttft_rows(engine, baseline, sizes: tuple[int, ...], runs: int) -> list[SummaryRow]:
    """Cold time to first token per size (mlx-lm stream_generate vs the engine, prefix cache emptied), and a
    cached prefix answering APPENDED_TOKENS new tokens as a percentage of the engine's cold time."""
    fitting = [s for s in sizes if s <= engine.max_model_len]
    print(
        f"\ntime to first token: median of {runs} runs per size (+1 warm-up run of the same size); cached: "
        f"median of {FOLLOW_UPS} follow-ups of {APPENDED_TOKENS} new tokens each\n{HEADER}",
        flush=True,
    )
    cold, cached = [], []
    for size in sizes:
        if size not in fitting:
            print(
                f"{size:>6} skipped: above the model's context of {engine.max_model_len} tokens "
                f"(--max-model-len sets another)"
            )
            continue
        row = measure_size(engine, size, runs, baseline=baseline)
        print(format_row(row), flush=True)
        cold.append(
            SummaryRow(
                f"cold TTFT at {size} ({row.prompt_tokens} tokens), s",
                f"{row.mlx_lm_s:.3f}",
                f"{row.cold_s:.3f}",
                row.cold_vs_mlx_lm,
                "x",
                COLD_TTFT_TARGET,
            )
        )
        goal = CACHED_PERCENT_TARGET if size == max(fitting) else None
        cached.append(
            SummaryRow(
                f"cached prefix at {size} + {APPENDED_TOKENS} new, TTFT s (% of cold)",
                "-",
                f"{row.cached_s:.3f}",
                100 * row.cached_s / row.cold_s,
                "%",
                goal,
                higher_is_better=False,
            )
        )
    return cold + cached


def engine_settings(args: Namespace, concurrency: tuple[int, ...], sizes: tuple[int, ...]) -> dict:
    """Room for every batch's requests at once (none waits for another's blocks) and the longest prompt."""
    batch_tokens = max(concurrency) * (BATCH_PROMPT_TOKENS[1] + args.tokens + 32)  # +32: partial blocks
    settings = {
        "max_num_seqs": max(concurrency),
        "cache_tokens": max(DEFAULT_CACHE_TOKENS, batch_tokens, 2 * max(sizes)),
    }
    if getattr(args, "max_model_len", None):
        settings["max_model_len"] = args.max_model_len
    if getattr(args, "max_batch_tokens", None):
        settings["max_batch_tokens"] = args.max_batch_tokens
    return settings


def bench_gpu(args: Namespace) -> int:
    """Decode, concurrent batches, cold and cached time to first token, then the summary of targets."""
    from mlxpaged.engine.engine import Engine

    if args.runs < 1:
        raise ConfigError(f"--runs must be at least 1 for the gpu bench, got {args.runs}")
    concurrency = getattr(args, "concurrency", None) or DEFAULT_CONCURRENCY
    sizes = args.sizes or DEFAULT_SIZES
    parts = getattr(args, "parts", None) or PARTS
    print("\n".join(environment_lines()))
    with Engine.from_pretrained(args.model, **engine_settings(args, concurrency, sizes)) as engine:
        side = mlx_lm_side(engine)
        checkpoint = KV_DTYPE_NAMES[kv_dtype(checkpoint_tensors(engine.loaded.path))]
        print(
            f"model {engine.loaded.name}: checkpoint {checkpoint}; mlxpaged weights "
            f"{weight_dtype(engine.loaded.model)}; mlx-lm weights {weight_dtype(side.loaded.model)}\n{side.note}\n"
            f"engine: at most {engine.scheduler_config.max_batch_tokens} tokens per step (prefill chunks included)"
        )
        rows = decode_rows(engine, side.loaded, args.tokens, args.runs) if "decode" in parts else []
        if "batch" in parts:
            rows += [batch_row(engine, side.loaded, count, args.tokens, args.runs) for count in concurrency]
        if "ttft" in parts:
            rows += ttft_rows(engine, side.loaded, sizes, args.runs)
    print(
        f"\nsummary (ratio: mlxpaged against mlx-lm, > 1x is mlxpaged ahead; % is of mlxpaged's own cold "
        f"time)\n{summary_table(rows)}"
    )
    return 0
