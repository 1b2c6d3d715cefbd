"""The key scales of 4-bit pages' K/V coordinates (cache/kv_transform.py), from one short prefill at load.

The model prefills CALIBRATION_TEXT over full-precision pages; each layer's attention hands its queries and keys
(after RoPE) to a recorder (routing.recording_attention). Per KV head and channel, `s_c = sqrt(rms(q_c) / rms(k_c))`
(queries pooled over the heads that share the KV head), averaged in square over each pair RoPE rotates together,
so the balance is the same at every position, not just at the calibration text's; the centers are the mean K and V
in the stored coordinates. A deterministic function of the weights (and the backend), so pages written by one
process mean the same in the next (the disk tier's fingerprint holds the transform's digest all the same).

Then the centers are moved so that position 0, every sequence's attention sink, is stored on the 4-bit grid
(`sink_shift`): most queries put much of their weight on that row, so its rounding error moves every later
attention row. Past a model's first layers the K/V at position 0 hardly depend on which token is there (a causal
model's position 0 sees only itself): one-token sequences of SINK_PROBE_WORDS' first tokens give each layer's
typical position-0 row, and where they spread by less than SINK_MAX_SPREAD of their own rounding error, the
centers move by that typical row's rounding residual (about half a 4-bit level at most: 0.51 of a min-max level
on SmolLM2). The typical row then quantizes to itself; the other rows' centers barely move. Measured on
SmolLM2-135M (docs/design/issue24-quantized-pages.md): from layer 12 on the spread is ~3% of the rounding error,
and the mean KL to full precision falls by 14-26% on three texts.

Layers it cannot transform exactly are left as they are (None): K and V one array, widths that differ from the
queries' or from each other, a width that is not a power of two (the Hadamard rotation), a layer never seen
attending. Models with window or state layers, a cache list other than one cache per layer, or attention that
does not go through mlx-lm's `scaled_dot_product_attention` are not calibrated (None: pages as before).
"""

from __future__ import annotations

import os

from mlxpaged.cache import group_fit
from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.kv_transform import KVTransform, hadamard
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.runner import cache_tree
from mlxpaged.runner.activation_routing import engine_activations, route_for_backend
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

# What sequences start with: their first tokens are the sink probe's one-token sequences (a tokenizer that adds a
# BOS gives that one token, which is then every sequence's position 0).
SINK_PROBE_WORDS = (
    "The", "In", "A", "When", "It", "Once", "Chapter", "Hello", "Dear", "Question", "Now", "def", "import", "#",
    "<", "{", "Then", "So", "And", "But", "I", "You", "We", "They",
)  # fmt: skip
# A layer's centers move only where the position-0 rows spread (RMS about their mean) by less than this fraction
# of their own rounding error (RMS): elsewhere no one row is typical. Measured on SmolLM2-135M: 0.02-0.04 from
# layer 12 on, 0.65-3 below; moving every layer's centers instead gave a KL up to 5% higher on two of three texts.
SINK_MAX_SPREAD = 0.3
FOUR_BIT_PAGES = KVQuantization(4)  # the pages these coordinates are for (TRANSFORMED_BITS), mlx's groups of 64


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


def calibrate_kv_transform(
    model,
    layout: ModelLayout,
    tokenizer,
    dtype: mx.Dtype,
    block_size: int = 16,
    quantization: KVQuantization | None = FOUR_BIT_PAGES,
):
    """The KVTransform for `model`'s pages (None when the model is not one this calibrates: see the module);
    the centers put position 0 on `quantization`'s grid where that row is typical (None: the plain means)."""
    tokens = _in_vocabulary(model, tokenizer.encode(CALIBRATION_TEXT))
    if layout.state_leaves or not cache_tree.simple(layout) or not all(leaf.routed for leaf in layout.kv_leaves):
        return None  # a cache list of the model's own nesting, or attention of its own: 4-bit pages as before
    kv, recorded = _recorded_forward(model, layout, [tokens], dtype, block_size)
    if kv is None:
        return None
    seen = {layer: (q[0], k[0], v[0], sinks) for layer, (q, k, v, sinks) in recorded.items()}
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
    if quantization is not None:
        layers = _sink_on_grid(model, layout, tokenizer, dtype, block_size, quantization, layers, seen)
    return KVTransform.from_arrays(layers)


def _in_vocabulary(model, tokens: list[int]) -> list[int]:
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:  # a model smaller than its tokenizer (tests' tiny models)
        return [t % vocab for t in tokens]
    return tokens


def _sink_on_grid(model, layout, tokenizer, dtype, block_size, quantization, layers, seen) -> list:
    """`layers`' (scale, key center, value center) with the centers moved by `sink_shift` (layers with attention
    sinks keep their zero centers: see layer_arrays)."""
    first = sorted({_in_vocabulary(model, tokenizer.encode(word))[0] for word in SINK_PROBE_WORDS})
    rows = first_position_rows(model, layout, first, dtype, block_size)
    out = []
    for layer, arrays in enumerate(layers):
        if arrays is None or seen[layer][3] or layer not in rows:
            out.append(arrays)
            continue
        scale, key_center, value_center = arrays
        k0, v0 = rows[layer]
        rotation = hadamard(scale.shape[-1])
        stored_k = (k0 * scale) @ rotation - key_center  # [N, kv_heads, D], as pages store them
        stored_v = v0 @ rotation - value_center
        out.append(
            (
                scale,
                key_center + sink_shift(stored_k, quantization, dtype),
                value_center + sink_shift(stored_v, quantization, dtype),
            )
        )
    return out


def first_position_rows(
    model, layout: ModelLayout, tokens: list[int], dtype: mx.Dtype, block_size: int
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per layer, the K and V [len(tokens), kv_heads, D] (float64, the model's coordinates) at position 0 of
    one-token sequences of `tokens`, from one batched forward over full-precision pages."""
    _, recorded = _recorded_forward(model, layout, [[t] for t in tokens], dtype, block_size)
    return {
        layer: (np.array(k[:, :, 0], dtype=np.float64), np.array(v[:, :, 0], dtype=np.float64))
        for layer, (_, k, v, _) in recorded.items()
    }


def _recorded_forward(
    model, layout: ModelLayout, rows: list[list[int]], dtype: mx.Dtype, block_size: int
) -> tuple[PagedKVCache | None, dict[int, tuple[mx.array, mx.array, mx.array, bool]]]:
    """One forward of `rows` (token lists of one length, each its own sequence) over fresh full-precision pages:
    per layer, the queries, keys and values its attention was handed (float32, [rows, heads, length, D]) and
    whether it has sinks. (None, {}) for a model of more than one full-attention layer group."""
    blocks = -(-len(rows[0]) // block_size)
    kv = PagedKVCache.for_layout(layout, blocks * len(rows), block_size, dtype)
    if len(kv.groups) != 1 or kv.specs[0].window is not None:
        return None, {}
    route_paged_attention()
    route_for_backend()
    got: dict[int, tuple[mx.array, mx.array, mx.array, bool]] = {}

    def record(layer: int, queries: mx.array, keys: mx.array, values: mx.array, sinks) -> None:
        q, k, v = (a.astype(mx.float32) for a in (queries, keys, values))
        got[layer] = q, k, v, sinks is not None

    tables = [[list(range(i * blocks, (i + 1) * blocks))] for i in range(len(rows))]
    with recording_attention(record), engine_activations():
        model(mx.array(rows), cache=paged_views(kv, tables))
    mx.eval([arrays[:3] for arrays in got.values()])
    return kv, got


def sink_shift(rows: np.ndarray, quantization: KVQuantization, dtype: mx.Dtype) -> np.ndarray:
    """What to add to a layer's center [kv_heads, D] so that the typical (mean) of `rows` [N, kv_heads, D], the
    position-0 rows in the stored coordinates, is stored as itself: the mean's rounding residual `mean - Q(mean)`
    (Q as pages round it, in the pages' dtype); zeros when the rows spread by SINK_MAX_SPREAD of their own
    rounding error or more (no row is typical)."""
    typical = rows.mean(axis=0)

    def rounded(x: np.ndarray) -> np.ndarray:
        return np.array(group_fit.round_trip(mx.array(x, dtype=dtype), quantization).astype(mx.float32), np.float64)

    error = np.sqrt(np.mean((rounded(rows) - rows) ** 2))
    spread = np.sqrt(np.mean((rows - typical) ** 2))
    if not spread < SINK_MAX_SPREAD * error:
        return np.zeros_like(typical)
    stored = np.array(mx.array(typical, dtype=dtype).astype(mx.float32), np.float64)  # as the pages' dtype holds it
    return stored - rounded(typical)


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
    return calibrate_kv_transform(model, layout, tokenizer, dtype, block_size, quantization)
