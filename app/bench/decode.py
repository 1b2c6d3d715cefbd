"""`mlxpaged bench decode`: batch-1 decode tok/s, mlx-lm's stream_generate vs the paged engine."""

from __future__ import annotations

import statistics
import time
from argparse import Namespace

from mlxpaged.loading.loader import baseline_stream, chat_prompt
from mlxpaged.platform.blas import blas_status
from mlxpaged_app.bench.baseline import mlx_lm_side
from mlxpaged_app.bench.timing import after_warm_up

DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def time_mlx_lm(loaded, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(time to first token, decode tok/s) of mlx-lm's stream_generate, greedy, EOS ignored."""
    start = time.perf_counter()
    first, produced = None, 0
    for _ in baseline_stream(loaded, prompt, max_tokens=tokens, ignore_eos=True):
        produced += 1
        if first is None:
            first = time.perf_counter()
    return first - start, (produced - 1) / (time.perf_counter() - first)


def time_engine(engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(time to first token, decode tok/s) of the paged engine, batch 1, greedy, EOS ignored."""
    from mlxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    first, n = None, 0
    for delta in engine.stream(prompt, params):
        n += delta.token_id is not None
        if first is None:
            first = time.perf_counter()
    return first - start, (n - 1) / (time.perf_counter() - first)


def paired_decode(baseline, engine, prompt: list[int], tokens: int, runs: int) -> tuple[list[float], list[float]]:
    """Decode tok/s of mlx-lm on `baseline` and of the engine, alternating, after one untimed pair
    (the exact prompt and length: first-call compiles and allocations on both sides); prints each run."""
    ref, ours = [], []
    for run, (r, o) in enumerate(
        after_warm_up(lambda: (time_mlx_lm(baseline, prompt, tokens), time_engine(engine, prompt, tokens)), runs), 1
    ):
        ref.append(r[1])
        ours.append(o[1])
        print(f"  run {run}: mlx-lm {r[1]:6.1f} tok/s   mlxpaged {o[1]:6.1f} tok/s", flush=True)
    return ref, ours


def bench_decode(args: Namespace) -> int:
    """Batch-1 decode tok/s: mlx-lm stream_generate vs the paged engine, alternating runs."""
    from mlxpaged.engine.engine import Engine

    engine = Engine.from_pretrained(args.model, enable_prefix_cache=False)
    loaded = engine.loaded
    baseline = mlx_lm_side(engine)
    prompt = chat_prompt(loaded.tokenizer, [{"role": "user", "content": DECODE_PROMPT}])
    print(
        f"model {loaded.name} ({loaded.dtype}), BLAS {blas_status().name}, "
        f"prompt {len(prompt)} tokens, {args.tokens} new tokens, {args.runs} runs each (+1 warm-up)"
    )
    print(baseline.note)
    ref, ours = paired_decode(baseline.loaded, engine, prompt, args.tokens, args.runs)
    engine.close()
    mr, mo = statistics.median(ref), statistics.median(ours)
    print(f"median decode: mlx-lm {mr:.1f} tok/s, mlxpaged {mo:.1f} tok/s, ratio {mo / mr:.2f}x")
    paired = [o / r for o, r in zip(ours, ref, strict=True)]  # back-to-back runs share the machine's load
    print(
        f"paired runs: mlxpaged faster in {sum(p > 1 for p in paired)} of {len(paired)}, "
        f"median per-run ratio {statistics.median(paired):.2f}x"
    )
    return 0
