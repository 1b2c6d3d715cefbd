"""Load an embedding model with mlx-lm's own model classes, as checkpoints of embedding models are saved.

Two things differ from a generative checkpoint, and mlx-lm's `load` refuses both (strict weight loading):
- Flat backbone keys. sentence-transformers saves the transformers *base* model (`AutoModel`), so Qwen's own
  Qwen3-Embedding files hold `embed_tokens.weight`, `layers.0...`, `norm.weight` where mlx-lm's `Model` nests the
  backbone under `model.`. When no key carries the backbone's prefix, every key gets it.
- No LM head. The embedder never computes logits, so an untied `lm_head` is dropped from the weights and from the
  module: Qwen3-Embedding-8B says `tie_word_embeddings: false` and ships no `lm_head.weight`, and for a model that
  does ship one, its vocab x hidden matrix is memory nothing reads.
Both happen in the model class's `sanitize` (mlx-lm's hook for checkpoint keys), through `get_model_classes`, so
quantized checkpoints, config remapping and everything else mlx-lm's `load_model` does still apply.
"""

from __future__ import annotations

from pathlib import Path

from mlxpaged.loading.loader import LoadedModel, dtype_name, fit_dtypes, weights_dtype
from mlxpaged.loading.model_store import ModelRef

import mlx.nn as nn
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

BACKBONE_NAMES = ("model", "transformer", "backbone")  # where mlx-lm's Model classes keep the transformer body
HEAD = "lm_head"


def load_embedding_model(ref: ModelRef, path: Path, backend: str | None = None) -> LoadedModel:
    """Load `path` for embeddings (no LM head), in the dtypes `backend` computes in (as loader.load_local)."""
    model, config = load_model(path, get_model_classes=headless_classes)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    fit_dtypes(model, backend)
    return LoadedModel(model, tokenizer, ref, path, dtype_name(weights_dtype(model)), config)


def headless_classes(config: dict) -> tuple[type[nn.Module], type]:
    """mlx-lm's (Model, ModelArgs) for `config`, the Model subclassed to sanitize embedding checkpoints."""
    model_class, args_class = _get_classes(config)
    base_sanitize = getattr(model_class, "sanitize", None)

    def sanitize(self, weights: dict) -> dict:
        weights = prefix_backbone(weights, backbone_name(self))
        if base_sanitize is not None:
            weights = base_sanitize(self, weights)
        return drop_head(self, weights)

    return type(f"Headless{model_class.__name__}", (model_class,), {"sanitize": sanitize}), args_class


def backbone_name(model: nn.Module) -> str | None:
    return next((name for name in BACKBONE_NAMES if name in model), None)


def prefix_backbone(weights: dict, backbone: str | None) -> dict:
    """`weights` with `<backbone>.` before every key when none has it (a base model's checkpoint)."""
    if backbone is None or any(key.startswith(backbone + ".") for key in weights):
        return weights
    return {key if key.startswith(HEAD + ".") else f"{backbone}.{key}": value for key, value in weights.items()}


def drop_head(model: nn.Module, weights: dict) -> dict:
    """`weights` without the LM head's, and `model` without its head module (it is never called)."""
    if HEAD in model:
        del model[HEAD]
    return {key: value for key, value in weights.items() if not key.startswith(HEAD + ".")}
