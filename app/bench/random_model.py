"""A small random llama saved as a model directory (config.json, safetensors, the default model's tokenizer),
for benches that need a model every process can load and split: the default smollm2-135m's 3 KV heads do not
divide over 2 or 4 tensor-parallel processes. Its tokens mean nothing; its timings and agreement do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.loader import locate_model

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama

# 8 query and 4 KV heads: they split over 1, 2 and 4 processes. ~14 M parameters, most in the embedding.
RANDOM_LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "num_hidden_layers": 2,  # each layer adds two all-reduces per step
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,  # the default model's tokenizer
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def describe(config: dict = RANDOM_LLAMA) -> str:
    return (
        f"random llama (hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} KV heads, float32)"
    )


def write_random_llama(out: Path, seed: int = 0) -> Path:
    """RANDOM_LLAMA with seeded random weights at `out`; returns `out`."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(RANDOM_LLAMA))
    # MLX's init is small: scaled up, attention is far from uniform and greedy tokens vary (a real check)
    model.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(RANDOM_LLAMA, indent=2) + "\n")
    tokenizer_dir = locate_model(None)[1]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out
