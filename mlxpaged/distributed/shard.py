"""Tensor parallel with mlx-lm's own sharding (`model.shard(group)`), refused at load where it cannot work."""

from __future__ import annotations

from mlxpaged.distributed.ranks import Ranks
from mlxpaged.errors import ConfigError

import mlx.core as mx


def tensor_parallel_reason(model, config: dict, size: int) -> str | None:
    """Why `model` cannot be split over `size` ranks by its heads (None: it can)."""
    if not callable(getattr(model, "shard", None)):
        kind = config.get("model_type", type(model).__module__)
        return f"mlx-lm has no tensor-parallel sharding (a shard() method) for model type {kind!r}"
    text = config.get("text_config", config)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = text.get(key)
        if isinstance(heads, int) and heads % size:
            return f"its {key} ({heads}) is not divisible by the {size} ranks"
    return None


def shard_tensor_parallel(model, config: dict, ranks: Ranks) -> None:
    """Keep this rank's share of every sharded layer (heads, MLP columns): its KV heads are size-th of them,
    which the layout probe then sees. Pipeline parallel (mlx-lm's pipeline()) is not built yet."""
    reason = tensor_parallel_reason(model, config, ranks.size)
    if reason is not None:
        raise ConfigError(
            f"cannot run this model over {ranks.size} processes: {reason} (pipeline parallel is not built yet)"
        )
    model.shard(ranks.group)
    mx.eval(model.parameters())
