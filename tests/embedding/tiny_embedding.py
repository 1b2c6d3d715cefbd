"""Tiny random embedding models on disk: a 2-layer qwen3 (mlx-lm's save utilities), the default model's
tokenizer, and the sentence-transformers files that make it an embedding model.

`layout="flat"` writes the weights as Qwen ships Qwen3-Embedding: backbone keys without the `model.` prefix, an
untied config with no lm_head.weight (mlx-lm's own load refuses that checkpoint).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.loader import locate_model
from tests.tiny_models import _COMMON, _build

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from mlx_lm.utils import save_config, save_model

ST_POOLING_KEYS = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}
PROMPTS = {"query": "Instruct: find the passage\nQuery: ", "document": ""}


def tiny_embedding_config(context: int = 512) -> dict:
    return dict(
        _COMMON,
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        num_hidden_layers=2,
        vocab_size=49152,  # the default model's tokenizer
        max_position_embeddings=context,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )


def write_tiny_embedding_dir(
    out: Path,
    pooling: str = "last",
    normalize: bool = True,
    layout: str = "mlx",
    context: int = 512,
    seed: int = 5,
    sentence_transformers: bool = True,
    dtype: str = "float32",
) -> Path:
    """A model directory Embedder.from_pretrained loads; `sentence_transformers=False` leaves the
    sentence-transformers files out (a generative model, to be refused)."""
    out = Path(out)
    config = tiny_embedding_config(context)
    model = _build(qwen3, config, seed)
    model.set_dtype(getattr(mx, dtype))
    if layout == "flat":
        out.mkdir(parents=True, exist_ok=True)
        weights = {k.removeprefix("model."): v for k, v in tree_flatten(model.parameters()) if not k.startswith("lm_")}
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    else:
        save_model(out, model)
    save_config(config, out / "config.json")
    tokenizer_dir = locate_model(None)[1]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    if sentence_transformers:
        write_sentence_transformers_files(out, pooling, normalize)
    return out


def write_sentence_transformers_files(out: Path, pooling: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    flags = {key: key == ST_POOLING_KEYS[pooling] for key in ST_POOLING_KEYS.values()}
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": config_width(), **flags, "include_prompt": True}, indent=2)
    )
    (out / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2)
    )


def config_width() -> int:
    return _COMMON["hidden_size"]
