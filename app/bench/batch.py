"""`mlxpaged bench batch`: concurrent requests, the paged engine vs mlx-lm's BatchGenerator.

`--lengths uniform` (the default): 16 requests of 256-512 prompt tokens. `--lengths skewed`: prompts log-uniform
over 128 to 8,192 tokens, at 16 and 64 requests (`--concurrency`): what an agent fleet sends. The engine's decode
attention reads each row's own pages; mlx-lm's batch is left-padded to its longest prompt, in memory and in work.
Where that padded batch cannot fit in the memory left, its side is skipped and says so.
"""

from __future__ import annotations

import statistics
import time
from argparse import Namespace
from collections.abc import Callable
from functools import partial

from mlxpaged.platform.blas import blas_status
from mlxpaged.units import format_size
from mlxpaged_app.bench.baseline import mlx_lm_side
from mlxpaged_app.bench.timing import after_warm_up

UNIFORM = (256, 512)  # prompt tokens, uniform
SKEWED = (128, 8192)  # prompt tokens, log-uniform
DEFAULT_CONCURRENCY = {"uniform": (16,), "skewed": (16, 64)}
MLX_LM_HEADROOM = 0.8  # of the memory available, what mlx-lm's padded batch may take before its side is skipped


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def skewed_lengths(count: int, low: int = SKEWED[0], high: int = SKEWED[1], seed: int = 0) -> list[int]:
    """`count` prompt lengths log-uniform over [low, high]: as many 128-256-token prompts as 4k-8k ones."""
    import math
    import random

    rng = random.Random(seed)
    return [min(high, round(math.exp(rng.uniform(math.log(low), math.log(high))))) for _ in range(count)]


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def run_mlx_lm_batch(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """(wall seconds, tokens generated) of mlx-lm's BatchGenerator, greedy, no stop tokens."""
    from mlx_lm.generate import BatchGenerator

    start = time.perf_counter()
    # All requests decode together, as in the engine (mlx-lm's default caps a batch at 32 sequences).
    gen = BatchGenerator(model, stop_tokens=[], max_tokens=new_tokens, completion_batch_size=len(prompts))
    gen.insert(prompts, [new_tokens] * len(prompts))
    generated = 0
    while responses := gen.next_generated():
        generated += len(responses)
    gen.close()
    return time.perf_counter() - start, generated


def run_engine_batch(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """(wall seconds, tokens generated) of the engine, greedy, EOS ignored, prefix cache emptied first
    (a repeated batch would otherwise hit the previous run's blocks, which mlx-lm cannot)."""
    from mlxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.pool.reset_prefix_cache()
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(c.token_ids) for c in done)


def median_tok_s(run: Callable[[], tuple[float, int]], runs: int) -> float:
    """Median aggregate tok/s of `run` ((wall s, tokens) of one batch) over `runs`, after one untimed run."""
    return statistics.median(generated / wall for wall, generated in after_warm_up(run, runs))


def bench_batch(args: Namespace) -> int:
    """Concurrent requests (`--lengths`: uniform 256-512 or skewed 128-8k prompt tokens; 128 new each): mlxpaged
    vs mlx-lm's BatchGenerator, each warmed up on the same batch first."""
    from mlxpaged.engine.engine import Engine
    from mlxpaged.platform.memory import DeviceFacts

    lengths_kind = getattr(args, "lengths", None) or "uniform"
    counts = args.concurrency or DEFAULT_CONCURRENCY[lengths_kind]
    batches = {
        n: skewed_lengths(n) if lengths_kind == "skewed" else [0] * n  # uniform: drawn with the tokens below
        for n in counts
    }
    # Room for the largest batch at once: the engine never preempts, as mlx-lm's batch never does.
    needed = max(sum(lengths) + len(lengths) * args.tokens for lengths in batches.values())
    settings = {"cache_tokens": max(needed, 32768)} if lengths_kind == "skewed" else {}
    engine = Engine.from_pretrained(args.model, enable_prefix_cache=False, max_num_seqs=max(counts), **settings)
    vocab = engine.loaded.config["vocab_size"]
    baseline = mlx_lm_side(engine)
    print(
        f"model {engine.loaded.name}, {lengths_kind} prompt lengths, {args.tokens} new tokens each, "
        f"BLAS {blas_status().name}, one timed run each (+1 warm-up on the same batch)"
    )
    print(baseline.note)
    available = DeviceFacts.detect().limit_bytes
    for n, lengths in batches.items():
        prompts = random_prompts(n, *UNIFORM, vocab) if lengths_kind == "uniform" else prompts_of(lengths, vocab)
        sizes = sorted(map(len, prompts))
        print(
            f"{n} requests, prompts {sizes[0]}-{sizes[-1]} tokens (median {sizes[len(sizes) // 2]}, "
            f"{sum(sizes):,} in all)"
        )
        padded = n * (sizes[-1] + args.tokens) * engine.facts.kv.bytes_per_token  # mlx-lm's left-padded batch
        sides: list[tuple[str, Callable[[], tuple[float, int]]]] = [
            ("mlxpaged", partial(run_engine_batch, engine, prompts, args.tokens))
        ]
        if padded <= MLX_LM_HEADROOM * available:
            sides.insert(0, ("mlx-lm batch", partial(run_mlx_lm_batch, baseline.loaded.model, prompts, args.tokens)))
        else:
            print(
                f"  mlx-lm batch  skipped: its batch left-padded to {sizes[-1]:,} tokens holds "
                f"{format_size(padded)} of K/V, more than {MLX_LM_HEADROOM:.0%} of the {format_size(available)} "
                "available"
            )
        rows = [_timed(name, run) for name, run in sides]
        if len(rows) == 2:
            print(
                f"  ratio (mlxpaged / mlx-lm): throughput {rows[1][2] / rows[0][2]:.2f}x, "
                f"wall {rows[0][1] / rows[1][1]:.2f}x faster, peak memory {rows[1][3] / rows[0][3]:.2f}x"
            )
    engine.close()
    return 0


def _timed(name: str, run: Callable[[], tuple[float, int]]) -> tuple[str, float, float, int]:
    """(name, wall s, aggregate tok/s, peak bytes) of one run after an untimed one (compiles, allocations)."""
    import mlx.core as mx

    run()
    mx.reset_peak_memory()
    wall, generated = run()
    row = (name, wall, generated / wall, mx.get_peak_memory())
    print(f"  {name:<13} {wall:6.1f} s  {generated / wall:6.1f} tok/s aggregate  peak {format_size(row[3])}")
    return row
