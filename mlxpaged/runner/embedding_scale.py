"""What a model multiplies its token embeddings by before its first layer, for the drafters that embed tokens with
the model's embedding (MTP layers, DFlash, EAGLE-3: runner/chained_drafter.py, runner/dflash_drafter.py).

Hugging Face's Gemma models scale the embedding inside the embedding module (`Gemma3TextScaledWordEmbedding`: x
sqrt(hidden)), so a drafter trained on `model.get_input_embeddings()(ids)` saw scaled embeddings; mlx-lm's Gemma
models scale them inline in their forward instead (`h = embed_tokens(x) * sqrt(hidden)`), which a drafter calling
`embed_tokens` misses. mlx-vlm's DFlash drafter multiplies by the target's `embed_scale` where the target keeps one
(its Gemma 4). Rather than a list of families, the scale is read off the model once: its first layer's input on a
short probe over the raw embedding of the same tokens (Gemma: sqrt(hidden); Granite: its embedding multiplier;
most: 1). A model whose first layer sees more than a scaled embedding (absolute positions added: GPT-2) gets 1.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

PROBE = [[1, 2, 3, 4]]


class _Reached(Exception):
    """Raised by the first layer on the probe: nothing after it needs to run."""


def embedding_scale(model: nn.Module, embed: nn.Module) -> float:
    """The factor between `embed(tokens)` and what the model's first decoder layer receives for those tokens."""
    explicit = getattr(getattr(model, "model", model), "embed_scale", None)  # mlx-vlm's Gemma 4 keeps its own
    if explicit is not None:
        return float(explicit)
    layers = getattr(model, "layers", None)
    if not layers:
        return 1.0
    first = layers[0]
    cls = type(first)
    seen: list[mx.array] = []

    def reached(self, *args, **kwargs):
        seen.append(args[0] if args else next(iter(kwargs.values())))
        raise _Reached

    first.__class__ = type(cls.__name__, (cls,), {"__call__": reached})
    try:
        model(mx.array(PROBE), cache=make_prompt_cache(model))
    except _Reached:
        pass
    except Exception:  # an unusual signature: the drafters keep the raw embedding, as before
        return 1.0
    finally:
        first.__class__ = cls
    if not seen:
        return 1.0
    got, raw = seen[0].astype(mx.float32), embed(mx.array(PROBE)).astype(mx.float32)
    if got.shape != raw.shape:
        return 1.0
    ratio = mx.sum(got * raw) / mx.maximum(mx.sum(raw * raw), 1e-30)
    scale = ratio.astype(mx.float32).tolist()
    assert isinstance(scale, float)
    return scale if mx.allclose(got, raw * scale, rtol=1e-2, atol=1e-4).item() else 1.0


def scaled(embed: nn.Module, scale: float) -> Callable[[mx.array], mx.array]:
    """`embed`, times `scale` unless that is 1 (the embedding as the model's first layer sees it)."""
    if scale == 1.0:
        return embed

    def embedded(tokens: mx.array) -> mx.array:
        out = embed(tokens)
        return out * mx.array(scale, dtype=out.dtype)  # in the embedding's dtype, as the model multiplies

    return embedded
