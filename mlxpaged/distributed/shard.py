"""Splitting the model over the ranks with mlx-lm's own code, refused at load where it cannot work:

- tensor parallel (`model.shard(group)`): every rank keeps 1/N of every layer's heads and MLP columns;
- pipeline parallel (`pipeline(group)` of mlx-lm's PipelineMixin): every rank keeps a run of whole layers, the
  last rank the first layers, rank 0 the last ones; the hidden state goes rank to rank by send/recv inside the
  model's forward and every rank ends with rank 0's (an all_gather), so every rank computes the same logits.

Chosen: the one asked for (`parallel="tensor"|"pipeline"`), else tensor parallel where it works, else pipeline.
"""

from __future__ import annotations

import dataclasses

from mlxpaged.distributed.ranks import Ranks
from mlxpaged.errors import ConfigError

import mlx.core as mx
from mlx_lm.models.pipeline import PipelineMixin

TENSOR, PIPELINE = "tensor", "pipeline"
PARALLEL_KINDS = (TENSOR, PIPELINE)


def tensor_parallel_reason(model, config: dict, size: int) -> str | None:
    """Why `model` cannot be split over `size` ranks by its heads (None: it can)."""
    if not callable(getattr(model, "shard", None)):
        return f"mlx-lm has no tensor-parallel sharding (a shard() method) for model type {_kind(model, config)!r}"
    text = config.get("text_config", config)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = text.get(key)
        if isinstance(heads, int) and heads % size:
            return f"its {key} ({heads}) is not divisible by the {size} ranks"
    return None


def pipeline_reason(model, config: dict, size: int) -> str | None:
    """Why `model` cannot be split over `size` ranks by its layers (None: it can)."""
    stack = pipeline_stack(model)
    if stack is None:
        return f"mlx-lm has no pipeline parallelism (a pipeline() method) for model type {_kind(model, config)!r}"
    if len(stack.layers) < size:
        return f"its {len(stack.layers)} layers cannot be split over {size} ranks (each needs at least one)"
    return None


def pipeline_stack(model) -> PipelineMixin | None:
    """The module holding the layers that mlx-lm's pipeline() splits (model.model for most, a language model's
    text model for some), or None when mlx-lm cannot pipeline this model."""
    found = [module for _, module in model.named_modules() if isinstance(module, PipelineMixin)]
    return found[0] if len(found) == 1 else None


def shard_model(model, config: dict, ranks: Ranks, parallel: str | None = None) -> Ranks:
    """Keep this rank's part of `model` (tensor parallel: its heads, which the layout probe then sees; pipeline
    parallel: its layers, the only ones whose caches and pools exist) and evaluate it. Returns `ranks` with the
    kind chosen. ConfigError naming every reason when the model cannot be split as asked."""
    kind = choose_parallel(model, config, ranks.size, parallel)
    if kind == TENSOR:
        model.shard(ranks.group)
    else:
        stack = pipeline_stack(model)
        assert stack is not None  # choose_parallel checked
        stack.pipeline(ranks.group)
        layers = getattr(model, "layers", None)
        if layers is None or any(layer is None for layer in layers):  # make_prompt_cache must see local layers only
            raise ConfigError(
                f"model type {_kind(model, config)!r}: its `layers` do not follow mlx-lm's pipeline split, so "
                "its caches cannot be this rank's layers only",
                param="parallel",
            )
    mx.eval(model.parameters())  # the weights of this rank's part only: the rest were never read (lazy load)
    return dataclasses.replace(ranks, parallel=kind)


def choose_parallel(model, config: dict, size: int, parallel: str | None = None) -> str:
    """TENSOR or PIPELINE: `parallel` when given and possible, else tensor parallel where it works, else pipeline.
    ConfigError with the reasons when neither (or the one asked for) works."""
    if parallel is not None and parallel not in PARALLEL_KINDS:
        raise ConfigError(f"parallel must be one of {', '.join(PARALLEL_KINDS)}, got {parallel!r}", param="parallel")
    reasons = {TENSOR: tensor_parallel_reason(model, config, size), PIPELINE: pipeline_reason(model, config, size)}
    for kind in (parallel,) if parallel is not None else PARALLEL_KINDS:
        if reasons[kind] is None:
            return kind
    head = f"cannot run this model over {size} processes"
    if parallel is not None:
        raise ConfigError(f"{head} with {parallel} parallelism: {reasons[parallel]}", param="parallel")
    raise ConfigError(f"{head}: tensor parallel: {reasons[TENSOR]}; pipeline parallel: {reasons[PIPELINE]}")


def _kind(model, config: dict) -> str:
    return config.get("model_type", type(model).__module__)
