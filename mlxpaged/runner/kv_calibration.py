"""The key scales of 4-bit pages' K/V coordinates (cache/kv_transform.py), from one short prefill at load.

The model prefills CALIBRATION_TEXT over full-precision pages; each layer's attention hands its queries and keys
(after RoPE) to a recorder (routing.recording_attention). Per KV head and channel, `s_c = sqrt(rms(q_c) / rms(k_c))`
(queries pooled over the heads that share the KV head), averaged in square over each pair RoPE rotates together,
so the balance is the same at every position, not just at the calibration text's; the centers are the mean K and V
in the stored coordinates. A deterministic function of the weights (and the backend), so pages written by one
process mean the same in the next (the disk tier's fingerprint holds the transform's digest all the same).

Layers it cannot transform exactly are left as they are (None): K and V one array, widths that differ from the
queries' or from each other, a width that is not a power of two (the Hadamard rotation), a layer never seen
attending. Models with window or state layers, a cache list other than one cache per layer, or attention that
does not go through mlx-lm's `scaled_dot_product_attention` are not calibrated (None: pages as before).
"""

from __future__ import annotations

import os

from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.kv_transform import KVTransform, hadamard
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.runner import cache_tree
from mlxpaged.runner.routing import recording_attention, route_paged_attention

import mlx.core as mx
import numpy as np

# Plain English of several registers, some code and numbers; none of the held-out text (tests/data/ruth_kjv.txt).
CALIBRATION_TEXT = (
    "The museum opens at nine in the morning and closes at six, except on public holidays. Visitors can buy "
    "tickets at the door or online; children under twelve enter for free. The new wing, finished in 2019, holds "
    "paintings from the early twentieth century, most of them donated by a single family.\n\n"
    "Q: How do I reverse a list in Python?\n"
    "A: Use slicing, `items[::-1]`, which returns a new list, or `items.reverse()`, which reverses it in place.\n\n"
    "def mean(values):\n"
    "    if not values:\n"
    "        raise ValueError('mean of an empty list')\n"
    "    return sum(values) / len(values)\n\n"
    "Water boils at 100 degrees Celsius at sea level, but at lower temperatures on a mountain, because the air "
    "pressure is lower there. Cooking pasta at altitude therefore takes a few minutes longer. In a letter to her "
    "brother, she wrote that the winter had been long and hard, that the river froze in December, and that the "
    "village had run short of flour before the spring. The committee will meet again on Tuesday to review the "
    "budget; members are asked to send their comments by Friday."
)
MIN_SCALE, MAX_SCALE = 1e-3, 1e3  # a channel the text never excites keeps a bounded scale


def rope_traditional(model) -> bool:
    """Whether the model's RoPE rotates adjacent channels (2i, 2i+1) rather than (i, i + D/2): the first module
    that says so (mlx's nn.RoPE and mlx-lm's variants keep `traditional`); False when none does."""
    for _, module in model.named_modules():
        flag = getattr(module, "traditional", None)
        if isinstance(flag, bool):
            return flag
    return False


def pair_mean_square(x: np.ndarray, traditional: bool) -> np.ndarray:
    """[..., D] mean squares averaged over each RoPE pair, laid back on both channels of the pair."""
    d = x.shape[-1]
    if traditional:
        m = (x[..., 0::2] + x[..., 1::2]) / 2
        return np.repeat(m, 2, axis=-1)
    m = (x[..., : d // 2] + x[..., d // 2 :]) / 2
    return np.concatenate([m, m], axis=-1)


def key_scales(queries: np.ndarray, keys: np.ndarray, traditional: bool) -> np.ndarray:
    """`s` [kv_heads, D] from one layer's queries [heads, L, D] and keys [kv_heads, L, D] (float64)."""
    kv_heads, _, d = keys.shape
    q_ms = (queries.reshape(kv_heads, -1, d) ** 2).mean(axis=1)  # query head i reads KV head i // group
    k_ms = (keys**2).mean(axis=1)
    q_ms, k_ms = pair_mean_square(q_ms, traditional), pair_mean_square(k_ms, traditional)
    tiny = np.finfo(np.float32).tiny
    scale = (np.maximum(q_ms, tiny) / np.maximum(k_ms, tiny)) ** 0.25  # sqrt of the rms ratio
    return np.clip(scale, MIN_SCALE, MAX_SCALE)


def calibrate_kv_transform(model, layout: ModelLayout, tokenizer, dtype: mx.Dtype, block_size: int = 16):
    """The KVTransform for `model`'s pages (None when the model is not one this calibrates: see the module)."""
    tokens = tokenizer.encode(CALIBRATION_TEXT)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:  # a model smaller than its tokenizer (tests' tiny models)
        tokens = [t % vocab for t in tokens]
    blocks = -(-len(tokens) // block_size)
    kv = PagedKVCache.for_layout(layout, blocks, block_size, dtype)
    if layout.state_leaves or len(kv.groups) != 1 or kv.specs[0].window is not None:
        return None
    if not cache_tree.simple(layout) or not all(leaf.routed for leaf in layout.kv_leaves):
        return None  # a cache list of the model's own nesting, or attention of its own: 4-bit pages as before
    route_paged_attention()
    seen: dict[int, tuple[mx.array, mx.array, mx.array, bool]] = {}

    def record(layer: int, queries: mx.array, keys: mx.array, values: mx.array, sinks) -> None:
        q, k, v = (a[0].astype(mx.float32) for a in (queries, keys, values))
        seen[layer] = q, k, v, sinks is not None

    with recording_attention(record):
        model(mx.array([tokens]), cache=paged_views(kv, [[list(range(blocks))]]))
    mx.eval([got[:3] for got in seen.values()])
    traditional = rope_traditional(model)
    layers: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = []
    for layer, geo in enumerate(kv.geometries):
        got = seen.get(layer)
        d = geo.k_dim
        if got is None or geo.k_is_v or geo.v_dim != d or d & (d - 1):
            layers.append(None)
            continue
        q, k, v = (np.array(a, dtype=np.float64) for a in got[:3])
        if q.shape[-1] != d or k.shape[0] != geo.kv_heads or v.shape != k.shape or q.shape[0] % geo.kv_heads:
            layers.append(None)
            continue
        layers.append(layer_arrays(q, k, v, traditional, sinks=got[3]))
    if all(a is None for a in layers):
        return None
    return KVTransform.from_arrays(layers)


def layer_arrays(q: np.ndarray, k: np.ndarray, v: np.ndarray, traditional: bool, sinks: bool):
    """(key scale, key center, value center) of one layer from its calibration queries [heads, L, D] and keys,
    values [kv_heads, L, D]: the centers are the mean K and V in the stored coordinates (zero with sinks)."""
    scale = key_scales(q, k, traditional)
    rotation = hadamard(k.shape[-1])
    if sinks:
        return scale, np.zeros_like(scale), np.zeros_like(scale)
    key_center = (k.mean(axis=1) * scale) @ rotation
    value_center = v.mean(axis=1) @ rotation
    return scale, key_center, value_center


ENV_VAR = "MLXPAGED_KV_TRANSFORM"  # "0": 4-bit pages hold K/V as the model gives them (A/B runs)
TRANSFORMED_BITS = (4,)  # 8-bit pages are within 0.1% of full precision as they are: left untouched


def transform_for(model, layout: ModelLayout, tokenizer, dtype: mx.Dtype, quantization, block_size: int = 16):
    """The pages' K/V transform for `quantization` (kv_quant.KVQuantization or None): calibrated for 4-bit
    pages, None otherwise (or with MLXPAGED_KV_TRANSFORM=0)."""
    if quantization is None or quantization.bits not in TRANSFORMED_BITS:
        return None
    if os.environ.get(ENV_VAR, "1").strip() == "0":
        return None
    return calibrate_kv_transform(model, layout, tokenizer, dtype, block_size)
