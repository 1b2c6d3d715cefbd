"""One run of `mlxpaged bench distributed`, in every process `mlx.launch` started (or alone): load and split
the model, stream each prompt greedily at batch 1 (`runs` times after a short untimed one), and on rank 0 print
one RESULT line (mlxpaged.distributed.launch.result_from): time to first token, decode tok/s, the tokens.

    python -m mlxpaged_app.bench.distributed_ranks MODEL TOKENS RUNS PROMPTS_JSON
"""

from __future__ import annotations

import json
import sys
import time

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.distributed.launch import result_line
from mlxpaged.distributed.start import start_engine
from mlxpaged.loading.loader import chat_prompt
from mlxpaged.sampling_params import SamplingParams

# The prefix cache off: every run prefills its prompt (a cache hit would time nothing); no disk tier over ranks.
SETTINGS = {"cache_tokens": 4096, "max_num_seqs": 4, "enable_prefix_cache": False, "kv_disk": False}


def stream_once(engine, prompt: list[int], tokens: int) -> dict:
    """Time to first token, decode tok/s after it, and the token ids of one greedy batch-1 stream."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    arrivals, ids = [], []
    for delta in engine.stream(prompt, params):
        if delta.token_id is not None:
            arrivals.append(time.perf_counter())
            ids.append(delta.token_id)
    decode = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0
    return {"ttft": arrivals[0] - start, "decode": decode, "tokens": ids}


def main(argv: list[str]) -> int:
    model, tokens, runs, prompts = argv[0], int(argv[1]), int(argv[2]), json.loads(argv[3])
    started = time.perf_counter()
    engine = start_engine(model, **SETTINGS)
    if engine is None:  # a follower: rank 0's engine has closed
        return 0
    with engine:
        ready = time.perf_counter() - started
        ids = [chat_prompt(engine.loaded.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
        for prompt in ids:  # untimed: each prompt's prefill and a decode step, their first-call costs paid
            stream_once(engine, prompt, 2)
        rounds = [[stream_once(engine, p, tokens) for p in ids] for _ in range(runs)]
    result = {
        "start_s": ready,
        "prompt_tokens": [len(p) for p in ids],
        "ttft": [r["ttft"] for each in rounds for r in each],
        "decode": [r["decode"] for each in rounds for r in each],
        "tokens": [r["tokens"] for r in rounds[0]],
        "same_every_round": all([r["tokens"] for r in each] == [r["tokens"] for r in rounds[0]] for each in rounds),
    }
    print(result_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
