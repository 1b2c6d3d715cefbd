"""Session 28: what the split LM head (runner/passes.py split_head) saves a model without `make_cache` (68 mlx-lm text
architectures, Qwen3 among them), which took none before: a prefill chunk's logits at every position.

    MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 PYTHONPATH=. \
        python docs/design/scripts/issue39_split_head_prefill.py [--tokens 2048] [--runs 2]

A Qwen3-0.6B-shaped random model (float32 on the CPU: 28 layers, hidden 1024, 16 / 8 heads of 128, vocabulary
151,936), one prompt of --tokens token ids alone (one chunk), time to first token and MLX's peak memory, the split head
against none (split_head patched to None, as before), alternating, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlxpaged  # noqa: F401
from mlxpaged.engine.engine import Engine
from mlxpaged.runner import model_runner, passes
from mlxpaged.sampling_params import SamplingParams
from tests.tiny_models import _build, random_tokens

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3

CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def write_model(out: str) -> str:
    """The random Qwen3-0.6B-shaped checkpoint, with the default model's tokenizer files (its ids are in range)."""
    import json
    import shutil
    from pathlib import Path

    from mlxpaged.loading.loader import locate_model

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    model = _build(qwen3, CONFIG, seed=0)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(locate_model(None)[1] / name, path / name)
    return str(path)


def ttft(path: str, prompt: list[int], split: bool) -> tuple[float, float]:
    original = passes.split_head
    assert model_runner.split_head is original
    if not split:
        model_runner.split_head = lambda model: None
    try:
        with Engine.from_pretrained(path, cache_tokens=len(prompt) + 64, max_batch_tokens=len(prompt)) as engine:
            mx.reset_peak_memory()
            start = time.perf_counter()
            for _ in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=1)):
                break
            return time.perf_counter() - start, mx.get_peak_memory() / 2**30
    finally:
        model_runner.split_head = original


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/qwen3-0.6b-shape")
    args = parser.parse_args()
    path = write_model(args.dir)
    prompt = random_tokens(args.tokens, seed=1, vocab=49152)
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.runs):
        for split in (True, False):
            results[split].append(ttft(path, prompt, split))
            print(f"split={split}: {results[split][-1][0]:.2f} s, peak {results[split][-1][1]:.2f} GiB", flush=True)
    for split in (True, False):
        t = statistics.median(r[0] for r in results[split])
        m = statistics.median(r[1] for r in results[split])
        print(f"{'split head' if split else 'full logits'}: time to first token {t:.2f} s, peak {m:.2f} GiB")


if __name__ == "__main__":
    main()
