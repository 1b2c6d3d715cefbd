"""The log-probability a model gives each token of a text, through paged prefill passes: what `bench kv` measures
perplexity with, full precision against quantized pages.

The engine samples only a chunk's last position, so it gives no per-token scores. This runs the same prefill
the engine runs (the model's own attention layers routed to the pages, `cache_view.paged_views`, chunks of
`max_batch_tokens` whose K/V are written to the pages, quantized when the pools are, before each chunk
attends them) and keeps every position's log-softmax instead of sampling one.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.kv_transform import KVTransform
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.runner.routing import route_paged_attention

import mlx.core as mx
import numpy as np


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
    if len(tokens) < 2:
        raise ValueError(f"scoring needs at least 2 tokens, got {len(tokens)}")
    blocks = -(-len(tokens) // block_size)
    kv = PagedKVCache.for_layout(layout, blocks, block_size, dtype, quantization, transform)
    if layout.state_leaves or len(kv.groups) != 1 or kv.specs[0].window is not None:
        raise ValueError(f"scoring takes full-attention models without state layers, not {layout.model_type!r}")
    route_paged_attention()
    table = list(range(blocks))
    scores: list[np.ndarray] = []
    for start in range(0, len(tokens) - 1, chunk):
        piece = list(tokens[start : start + chunk])
        views = paged_views(kv, [[table]], offsets=[start])
        logits = model(mx.array([piece]), cache=views)[0].astype(mx.float32)
        targets = mx.array(list(tokens[start + 1 : start + len(piece) + 1]))
        rows = logits[: targets.size]
        picked = mx.take_along_axis(rows, targets[:, None], axis=1)[:, 0] - mx.logsumexp(rows, axis=1)
        mx.eval(picked, kv.pools)  # the writes land before the next chunk reads the pages
        scores.append(np.array(picked, dtype=np.float64))
    return np.concatenate(scores)


def perplexity(logprobs: np.ndarray) -> float:
    return float(np.exp(-np.mean(logprobs)))
