"""Issue 21: the host's part of a decode step, engine vs mlx-lm, on a model whose compute is negligible.

On a GPU a step costs max(GPU time, host time) when the next step is queued before the last is read, and
their sum when not. This measures the host part with a 24-layer, 64-wide llama (SmolLM2-1.7B's depth; the
matmuls cost next to nothing), so the step time is the Python and MLX graph work per step: mlx-lm's
generate_step against the engine on the path a GPU takes (platform/backend.py simulating CUDA: eager
passes queued before the read, deferred page writes) and on the CPU backend's path.

    python docs/design/scripts/issue21_host_step.py [--layers 24] [--tokens 200] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlxpaged  # noqa: F401,E402  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from mlxpaged.loading.loader import load_model  # noqa: E402
from mlxpaged.platform import backend  # noqa: E402
from mlxpaged.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_engine import tiny_engine  # noqa: E402
from tests.tiny_models import random_tokens, tiny_llama  # noqa: E402


def mlx_lm_ms(model, prompt, tokens: int) -> float:
    start = None
    for n, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=tokens)):
        if n == 0:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (tokens - 1) * 1000


def engine_ms(engine, prompts, tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    sinks = [engine.stream(p, params) for p in prompts]
    firsts = [next(s) for s in sinks]
    assert all(f.token_id is not None for f in firsts)
    start = time.perf_counter()
    for s in sinks:
        for _ in s:
            pass
    return (time.perf_counter() - start) / (tokens - 1) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    model = tiny_llama(num_layers=args.layers)
    tokenizer = load_model().tokenizer
    prompts = [random_tokens(20 + i, seed=i) for i in range(args.batch)]
    rows = {"mlx-lm generate_step (batch 1)": [], "engine, GPU path (simulated cuda)": [], "engine, CPU path": []}
    with backend.simulate("cuda"):  # the simulation must hold while the GPU engine runs, not only when built
        gpu = tiny_engine(model, tokenizer, max_num_seqs=max(8, args.batch))
    cpu = tiny_engine(model, tokenizer, max_num_seqs=max(8, args.batch))
    for run in range(args.runs + 1):  # run 0 warms up every shape
        with backend.simulate("cuda"):
            on_gpu_path = engine_ms(gpu, prompts, args.tokens)
        times = (mlx_lm_ms(model, prompts[0], args.tokens), on_gpu_path, engine_ms(cpu, prompts, args.tokens))
        if run:
            for key, value in zip(rows, times):
                rows[key].append(value)
    gpu.close()
    cpu.close()
    print(f"{args.layers}-layer 64-wide llama, batch {args.batch}, {args.tokens} tokens, median of {args.runs} runs:")
    for key, values in rows.items():
        print(f"  {key:<36} {statistics.median(values):6.2f} ms/step   ({', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
