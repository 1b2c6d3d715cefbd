"""Batch-1 decode tok/s of a random Qwen 3.5-style hybrid (gated-delta state layers + full attention)
on the paged engine (state slots + paged KV) against mlx-lm's generate_step, in one process, alternating.

    mlxpaged bench hybrid [--tokens 128] [--runs 3]
    python -m mlxpaged_app.bench.hybrid [--hidden 1024] [--layers 12] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5


def build(hidden: int, layers: int, vocab: int = 32000):
    """Random float32 weights; 3 of every 4 layers gated-delta (state), every 4th full attention."""
    heads = hidden // 128
    config = {
        "model_type": "qwen3_5",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 128,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": heads,
        "linear_num_key_heads": max(1, heads // 2),
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
    }
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config


def mlx_lm_decode(model, prompt: list[int], tokens: int) -> float:
    """Decode tok/s of generate_step after its first token."""
    steps = generate_step(mx.array(prompt), model, max_tokens=tokens)
    next(steps)
    start = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - start)


def engine_decode(engine, prompt: list[int], tokens: int) -> float:
    from mlxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stream = engine.stream(prompt, params)
    next(stream)
    start = time.perf_counter()
    n = sum(1 for d in stream if d.token_id is not None)
    return n / (time.perf_counter() - start)


def make_engine(model, config: dict):
    from mlxpaged.config import split_settings
    from mlxpaged.engine.engine import Engine
    from mlxpaged.loading.loader import LoadedModel, locate_model
    from mlxpaged.loading.model_store import ModelRef

    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(locate_model(None)[1])  # ids are fed directly; it only detokenizes
    loaded = LoadedModel(model, tokenizer, ModelRef("hybrid", "path"), Path("hybrid"), "float32", config)
    return Engine(loaded, *split_settings({"cache_tokens": 2048, "max_num_seqs": 4}))


def run(hidden: int, layers: int, tokens: int, prompt_tokens: int, rounds: int) -> tuple[float, float]:
    """Print each round and the medians; returns (paged, mlx-lm) median decode tok/s."""
    model, config = build(hidden, layers)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    prompt = [(17 * i + 5) % 30000 + 1 for i in range(prompt_tokens)]
    ours, theirs = [], []
    with make_engine(model, config) as engine:
        plan = engine.stats()["memory_plan"]
        print(
            f"qwen3_5 random: hidden {hidden}, {layers} layers, {params / 1e6:.0f} M params float32; "
            f"state {engine.layout.state_bytes_per_sequence / 2**20:.1f} MiB/sequence, plan: "
            f"{plan.num_state_slots} slots + {plan.num_checkpoints} checkpoints, KV {plan.kv_bytes / 2**20:.0f} MiB"
        )
        mlx_lm_decode(model, prompt, tokens)  # untimed warm-up round: first-call compiles, both sides
        engine_decode(engine, prompt, tokens)
        for _ in range(rounds):
            theirs.append(mlx_lm_decode(model, prompt, tokens))
            ours.append(engine_decode(engine, prompt, tokens))
            print(f"  mlx-lm generate_step {theirs[-1]:6.1f} tok/s   paged engine {ours[-1]:6.1f} tok/s", flush=True)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"median decode: paged {a:.1f} tok/s, mlx-lm {b:.1f} tok/s, ratio {a / b:.2f}")
    return a, b


def bench_hybrid(args) -> int:
    """`mlxpaged bench hybrid`: the default 228 M-parameter hybrid, `--tokens` per round, `--runs` rounds."""
    run(1024, 12, args.tokens, 64, args.runs)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run(args.hidden, args.layers, args.tokens, args.prompt, args.rounds)


if __name__ == "__main__":
    main()
