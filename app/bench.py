"""`mlxpaged bench`: measured, never asserted. Prints medians and ratios."""

from __future__ import annotations

import statistics
import time
from argparse import Namespace

from mlxpaged.blas import blas_status
from mlxpaged.model import baseline_stream, chat_prompt, load_model

DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def bench_decode(args: Namespace) -> int:
    """Batch-1 prompt and decode tok/s of the baseline path (mlx-lm stream_generate)."""
    loaded = load_model(args.model)
    prompt = chat_prompt(loaded.tokenizer, [{"role": "user", "content": DECODE_PROMPT}])
    print(f"model {loaded.name} ({loaded.dtype}), BLAS {blas_status().name}, "
          f"prompt {len(prompt)} tokens, {args.tokens} new tokens, {args.runs} runs (+1 warm-up)")
    prompt_tps, decode_tps = [], []
    for run in range(args.runs + 1):
        start = time.perf_counter()
        for last in baseline_stream(loaded, prompt, max_tokens=args.tokens):
            pass
        if run:  # the first run warms up allocations and kernels
            prompt_tps.append(last.prompt_tps)
            decode_tps.append(last.generation_tps)
            print(f"  run {run}: prompt {last.prompt_tps:7.1f} tok/s  decode {last.generation_tps:6.1f} tok/s "
                  f"({last.generation_tokens} tokens, {time.perf_counter() - start:.1f} s)")
    print(f"median: prompt {statistics.median(prompt_tps):.1f} tok/s, decode {statistics.median(decode_tps):.1f} tok/s")
    return 0


BENCHES = {"decode": bench_decode}


def run_bench(args: Namespace) -> int:
    return BENCHES[args.what](args)
