"""The log-probability a model gives each token of a text, through paged prefill passes: what `bench kv` measures
perplexity with, full precision against quantized pages, and how far each page setting's next-token
distributions are from full precision's (KL per position, a steadier figure than one text's perplexity ratio).

The engine samples only a chunk's last position, so it gives no per-token scores. This runs the same prefill
the engine runs (the model's own attention layers routed to the pages, `cache_view.paged_views`, chunks of
`max_batch_tokens` whose K/V are written to the pages, quantized when the pools are, before each chunk
attends them) and keeps every position's log-softmax instead of sampling one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.kv_transform import KVTransform
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.runner.activation_routing import engine_activations, route_for_backend
from mlxpaged.runner.routing import route_paged_attention

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class PageSetting:
    """How one scoring pass stores K/V: `quantization` (None: full precision) and the coordinates its pages hold
    (`transform`, as the engine's `kv.transform`)."""

    quantization: KVQuantization | None = None
    transform: KVTransform | None = None


@dataclass(frozen=True)
class Scores:
    """Per position i of a text: log p(tokens[i + 1] | tokens[: i + 1]) and KL(reference || this) of the two
    next-token distributions (nats), both float64 [len(tokens) - 1]."""

    logprobs: np.ndarray
    kl: np.ndarray


def token_logprobs(
    model,
    layout: ModelLayout,
    tokens: Sequence[int],
    dtype: mx.Dtype,
    quantization: KVQuantization | None = None,
    block_size: int = 16,
    chunk: int = 2048,
    transform: KVTransform | None = None,
) -> np.ndarray:
    """log p(tokens[i + 1] | tokens[: i + 1]) for every i, float64 [len(tokens) - 1], the text prefilled in
    `chunk`-token passes over fresh pools (`quantization`: quantized pages; `transform`: the K/V coordinates the
    pages hold, as the engine's `kv.transform`). Full-attention models of KV layers
    only (one layer group, no state): ValueError otherwise."""
    setting = PageSetting(quantization, transform)
    return compare_scores(model, layout, tokens, dtype, [setting], block_size, chunk)[0].logprobs


def compare_scores(
    model,
    layout: ModelLayout,
    tokens: Sequence[int],
    dtype: mx.Dtype,
    settings: Sequence[PageSetting],
    block_size: int = 16,
    chunk: int = 2048,
) -> list[Scores]:
    """`token_logprobs` for each of `settings`, the passes run side by side chunk by chunk, with each position's
    KL from the first setting's next-token distribution (the reference; its own KL is zero)."""
    if len(tokens) < 2:
        raise ValueError(f"scoring needs at least 2 tokens, got {len(tokens)}")
    if not settings:
        raise ValueError("scoring needs at least one page setting")
    blocks = -(-len(tokens) // block_size)
    caches = [PagedKVCache.for_layout(layout, blocks, block_size, dtype, s.quantization, s.transform) for s in settings]
    kv = caches[0]
    if layout.state_leaves or len(kv.groups) != 1 or kv.specs[0].window is not None:
        raise ValueError(f"scoring takes full-attention models without state layers, not {layout.model_type!r}")
    route_paged_attention()
    route_for_backend()
    table = list(range(blocks))
    picked: list[list[np.ndarray]] = [[] for _ in settings]
    kls: list[list[np.ndarray]] = [[] for _ in settings]
    for start in range(0, len(tokens) - 1, chunk):
        piece = list(tokens[start : start + chunk])
        targets = mx.array(list(tokens[start + 1 : start + len(piece) + 1]))
        reference = None
        for i, cache in enumerate(caches):
            with engine_activations():
                logits = model(mx.array([piece]), cache=paged_views(cache, [[table]], offsets=[start]))[0]
            rows = logits[: targets.size].astype(mx.float32)
            rows = rows - mx.logsumexp(rows, axis=1, keepdims=True)
            chosen = mx.take_along_axis(rows, targets[:, None], axis=1)[:, 0]
            if reference is None:
                reference, kl = rows, mx.zeros(chosen.shape)
            else:
                kl = mx.sum(mx.exp(reference) * (reference - rows), axis=1)
            mx.eval(chosen, kl, cache.pools)  # the writes land before the next chunk reads the pages
            picked[i].append(np.array(chosen, dtype=np.float64))
            kls[i].append(np.array(kl, dtype=np.float64))
    return [Scores(np.concatenate(p), np.concatenate(k)) for p, k in zip(picked, kls, strict=True)]


def perplexity(logprobs: np.ndarray) -> float:
    return float(np.exp(-np.mean(logprobs)))
