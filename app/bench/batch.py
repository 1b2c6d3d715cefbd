"""`mlxpaged bench batch`: 16 concurrent requests, the paged engine vs mlx-lm's BatchGenerator."""

from __future__ import annotations

import statistics
import time
from argparse import Namespace
from collections.abc import Callable

from mlxpaged.platform.blas import blas_status
from mlxpaged.units import format_size
from mlxpaged_app.bench.baseline import mlx_lm_side
from mlxpaged_app.bench.timing import after_warm_up


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


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
    """16 concurrent requests (prompts 256-512 tokens, 128 new each): mlxpaged vs mlx-lm batch_generate."""
    from mlxpaged.engine.engine import Engine

    import mlx.core as mx

    engine = Engine.from_pretrained(args.model, enable_prefix_cache=False, max_num_seqs=16)
    prompts = random_prompts(16, 256, 512, engine.loaded.config["vocab_size"])
    print(
        f"model {engine.loaded.name}, 16 requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens, {args.tokens} new tokens each, BLAS {blas_status().name}, one timed run each (+1 warm-up)"
    )
    baseline = mlx_lm_side(engine)
    print(baseline.note)
    rows = []
    for name, run in (
        ("mlx-lm batch", lambda: run_mlx_lm_batch(baseline.loaded.model, prompts, args.tokens)),
        ("mlxpaged", lambda: run_engine_batch(engine, prompts, args.tokens)),
    ):
        run()  # warm-up: the same batch, untimed (first-call compiles and allocations)
        mx.reset_peak_memory()
        wall, generated = run()
        rows.append((name, wall, generated / wall, mx.get_peak_memory()))
        print(f"  {name:<13} {wall:6.1f} s  {generated / wall:6.1f} tok/s aggregate  peak {format_size(rows[-1][3])}")
    engine.close()
    print(
        f"ratio (mlxpaged / mlx-lm): throughput {rows[1][2] / rows[0][2]:.2f}x, "
        f"wall {rows[0][1] / rows[1][1]:.2f}x faster, peak memory {rows[1][3] / rows[0][3]:.2f}x"
    )
    return 0
