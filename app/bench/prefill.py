"""`mlxpaged bench prefill`: time to first token of long prompts, cold and cached, against mlx-lm."""

from __future__ import annotations

import random
import statistics
import time
from argparse import ArgumentTypeError, Namespace
from dataclasses import dataclass

from mlxpaged.errors import ConfigError
from mlxpaged.loading.loader import baseline_stream
from mlxpaged.platform.blas import blas_status
from mlxpaged_app.bench.baseline import mlx_lm_side
from mlxpaged_app.bench.prefill_attention import MAX_CONTIGUOUS_CONTEXT, measure_attention

DEFAULT_SIZES = (1024, 4096, 8192, 16384)
APPENDED_TOKENS = 8  # each cached prompt is the previous one plus these next tokens of the same text
FOLLOW_UPS = 5  # cached prompts per run (follow-up turns): their median is the run's cached time
PROMPT_SEED = 16
WORDS = [
    "the",
    "harbour",
    "lighthouse",
    "keeper",
    "boat",
    "market",
    "morning",
    "river",
    "stone",
    "bridge",
    "window",
    "garden",
    "letter",
    "night",
    "station",
    "clock",
    "winter",
    "bread",
    "lamp",
    "road",
    "hill",
    "village",
    "school",
    "engine",
    "paper",
    "silver",
    "music",
    "old",
    "quiet",
    "bright",
    "small",
    "long",
    "green",
    "north",
    "wind",
    "rain",
    "table",
    "door",
    "story",
    "friend",
]


def parse_sizes(text: str) -> tuple[int, ...]:
    """`--sizes 1024,4096`: positive token counts, comma-separated."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ArgumentTypeError(f"--sizes takes comma-separated token counts like 1024,4096, got {text!r}") from None
    least = APPENDED_TOKENS * FOLLOW_UPS + 1
    bad = [s for s in sizes if s <= least]
    if bad:
        raise ArgumentTypeError(
            f"--sizes must each be more than {least} tokens ({FOLLOW_UPS} cached prompts "
            f"append {APPENDED_TOKENS} each); got {bad}"
        )
    return sizes


def seeded_tokens(tokenizer, count: int, seed: int) -> list[int]:
    """`count` token ids of seeded random English words: the same seed gives the same prompt in every run."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < count:  # sentences of 256 words: no encode call exceeds the tokenizer's max length
        words = " ".join(rng.choice(WORDS) for _ in range(256))
        ids += tokenizer.encode((" " if ids else "") + words.capitalize() + ".")
    return ids[:count]


@dataclass(frozen=True)
class PrefillRow:
    """Medians, in seconds, for one prompt size; ratios > 1 mean the second-named side is slower."""

    size: int
    prompt_tokens: int  # the cold prompt; the cached ones are APPENDED_TOKENS, 2x, ... longer
    mlx_lm_s: float
    cold_s: float
    cached_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.cold_s

    @property
    def cold_vs_mlx_lm(self) -> float:
        return self.mlx_lm_s / self.cold_s

    @property
    def cached_vs_cold(self) -> float:
        return self.cold_s / self.cached_s


HEADER = (
    f"{'size':>6} {'prompt':>6} {'mlx-lm cold':>12} {'mlxpaged cold':>14} {'cached':>9} "
    f"{'prefill tok/s':>14} {'cold vs mlx-lm':>15} {'cached vs cold':>15}"
)


def format_row(row: PrefillRow) -> str:
    return (
        f"{row.size:>6} {row.prompt_tokens:>6} {row.mlx_lm_s:>10.3f} s {row.cold_s:>12.3f} s "
        f"{row.cached_s:>7.3f} s {row.prefill_tok_s:>14.1f} {row.cold_vs_mlx_lm:>14.2f}x "
        f"{row.cached_vs_cold:>14.1f}x"
    )


# --clock: wall time is what a user waits; CPU time of this process (all its threads, mlx-lm's and the
# engine's alike) is steadier when other work shares the machine.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def mlx_lm_ttft(loaded, prompt: list[int], clock=time.perf_counter) -> float:
    """Seconds to the first token of mlx-lm's stream_generate (its own contiguous cache, built fresh)."""
    start = clock()
    next(iter(baseline_stream(loaded, prompt, max_tokens=1)))
    return clock() - start


def engine_ttft(engine, prompt: list[int], clock=time.perf_counter) -> float:
    """Seconds to the first streamed token of the paged engine, greedy."""
    from mlxpaged.sampling_params import SamplingParams

    start = clock()
    for _ in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)):
        return clock() - start
    raise RuntimeError(f"the engine streamed nothing for a {len(prompt)}-token prompt")


def one_run(engine, baseline, size: int, seed: int, clock=time.perf_counter) -> tuple[int, float, float, float]:
    """(cold prompt tokens, mlx-lm cold s, mlxpaged cold s, median cached s) for one seeded prompt:
    mlx-lm cold on `baseline`, mlxpaged cold (empty prefix cache), then FOLLOW_UPS prefix-cache hits,
    each the previous prompt plus APPENDED_TOKENS of the same text (a chat's next turns; each computes
    exactly its new tokens). The last one is `size - 1` tokens: the +1 leaves room for the generated token."""
    text = seeded_tokens(engine.tokenizer, size - 1, seed)
    prompt = text[: -APPENDED_TOKENS * FOLLOW_UPS]
    mlx_lm = mlx_lm_ttft(baseline, prompt, clock)
    engine.pool.reset_prefix_cache()
    cold = engine_ttft(engine, prompt, clock)
    turns = [text[: len(prompt) + APPENDED_TOKENS * i] for i in range(1, FOLLOW_UPS + 1)]
    return len(prompt), mlx_lm, cold, statistics.median(engine_ttft(engine, turn, clock) for turn in turns)


def measure_size(engine, size: int, runs: int, clock=time.perf_counter, baseline=None) -> PrefillRow:
    """Medians over `runs` fresh seeded prompts (`one_run`), after one untimed run of the same size with a
    prompt no timed run uses: the first call of each shape compiles kernels on a GPU. `baseline`: the
    mlx-lm side's LoadedModel (default: the engine's)."""
    baseline = baseline or engine.loaded
    seed = PROMPT_SEED * 1000 + size
    one_run(engine, baseline, size, seed - 1, clock)  # the warm-up, untimed
    timed = [one_run(engine, baseline, size, seed + run, clock) for run in range(runs)]
    prompt_tokens, mlx_lm, cold, cached = zip(*timed, strict=True)
    return PrefillRow(
        size, prompt_tokens[0], statistics.median(mlx_lm), statistics.median(cold), statistics.median(cached)
    )


def bench_prefill(args: Namespace) -> int:
    """Cold and cached time to first token per prompt size, mlx-lm's stream_generate side by side."""
    from mlxpaged.engine.engine import Engine

    if args.runs < 1:
        raise ConfigError(f"--runs must be at least 1 for the prefill bench, got {args.runs}")
    sizes = args.sizes or DEFAULT_SIZES
    clock = getattr(args, "clock", "wall")
    context = getattr(args, "max_model_len", None)
    engine = Engine.from_pretrained(args.model, **({"max_model_len": context} if context else {}))
    trained = engine.facts.context_length
    note = f" (set by --max-model-len; the model's own is {trained})" if context and trained != context else ""
    print(
        f"model {engine.loaded.name} ({engine.loaded.dtype}), context {engine.max_model_len} tokens{note}, "
        f"BLAS {blas_status().name}, {args.runs} runs per size (medians), prompts seeded ({PROMPT_SEED}), "
        f"{clock} clock, each size warmed up by one untimed run"
    )
    baseline = mlx_lm_side(engine)
    print(baseline.note)
    print(HEADER)
    for size in sizes:
        if size > engine.max_model_len:
            print(f"{size:>6} skipped: above the model's context of {engine.max_model_len} tokens")
            continue
        print(format_row(measure_size(engine, size, args.runs, CLOCKS[clock], baseline.loaded)), flush=True)
    timed = [s for s in sizes if s <= min(engine.max_model_len, MAX_CONTIGUOUS_CONTEXT)]
    if timed:
        print(attention_row(engine, max(timed), CLOCKS[clock]).line())
    engine.close()
    return 0


def attention_row(engine, context: int, clock=time.perf_counter):
    """The attention part of a `context`-token prefill for one layer of the engine's model."""
    from mlxpaged.cache.paged_support import query_heads

    return measure_attention(
        context,
        engine.scheduler_config.max_batch_tokens,
        query_heads(engine.layout),
        engine.facts.kv.num_kv_heads,
        engine.facts.kv.head_dim,
        engine.cache_config.block_size,
        clock,
    )
