"""How K/V rows become quantized pages: `mx.quantize`'s groups, or (4-bit pages) groups fitted by least squares.

Both give the layout `mx.quantize` gives and `mx.dequantize` reads (per group of `group_size` elements, levels
`q` in [0, 2^bits - 1] packed little-endian into uint32 words, and a scale and bias in the rows' dtype; an
element reads back as `q * scale + bias`), so every attention path reads them alike.

`mx.quantize` stretches a group's 16 levels (4 bits) from its minimum to its maximum. For 4-bit pages a group is
fitted instead: the levels of that min-max grid, then the scale and bias that fit the group to those levels by
least squares (the pair that minimises the group's squared error for them), then the levels again for that scale
and bias. One fitting round; the group's extremes are no longer exact, its bulk is closer. Measured on the
embedded model (SmolLM2-135M, 4-bit pages in the calibrated coordinates of kv_transform.py;
docs/design/issue24-quantized-pages.md): `bench kv`'s perplexity on the Book of Ruth +4.60% -> +3.87% over full
precision, the mean KL to full precision 24% lower on three texts; the embedded model's answer to "What is the
capital of France?" back to "Paris" (min-max groups: "La femme de France, ..."). 8-bit pages keep `mx.quantize`
(within 0.1% of full precision already, and checked against mlx-lm's own QuantizedKVCache).
"""

from __future__ import annotations

from mlxpaged.cache.kv_quant import KVQuantization

import mlx.core as mx

FITTED_BITS = (4,)  # pages whose groups are fitted by least squares; others are mx.quantize's
_TINY = 1e-8  # the smallest scale: a group of equal elements reads back as its bias, exactly


def fitted(quantization: KVQuantization) -> bool:
    return quantization.bits in FITTED_BITS


def quantize(rows: mx.array, quantization: KVQuantization) -> tuple[mx.array, mx.array, mx.array]:
    """`rows` [..., dim] as pages store them: (data uint32 [..., dim * bits / 32], scales, biases [..., groups])."""
    bits, size = quantization.bits, quantization.group_size
    if not fitted(quantization):
        data, scales, biases = mx.quantize(rows, group_size=size, bits=bits)
        return data, scales, biases
    top = (1 << bits) - 1
    *lead, dim = rows.shape
    x = rows.astype(mx.float32).reshape(*lead, dim // size, size)
    low = x.min(axis=-1, keepdims=True)
    scale = mx.maximum((x.max(axis=-1, keepdims=True) - low) / top, _TINY)
    levels = mx.clip(mx.round((x - low) / scale), 0, top)  # the levels of the min-max grid, as mx.quantize's
    # Least squares for x ~ scale * levels + bias over the group: scale = cov(levels, x) / var(levels).
    mean_level, mean_x = levels.mean(axis=-1, keepdims=True), x.mean(axis=-1, keepdims=True)
    centered = levels - mean_level
    spread = (centered * centered).mean(axis=-1, keepdims=True)
    cov = (centered * (x - mean_x)).mean(axis=-1, keepdims=True)
    scale = mx.maximum(mx.where(spread > 0, cov / mx.maximum(spread, _TINY), scale), _TINY)
    bias = mean_x - scale * mean_level
    scales, biases = scale.astype(rows.dtype), bias.astype(rows.dtype)  # as stored: the levels are picked for these
    levels = mx.clip(mx.round((x - biases.astype(mx.float32)) / scales.astype(mx.float32)), 0, top)
    return _pack(levels.astype(mx.uint32).reshape(*lead, dim), bits), scales[..., 0], biases[..., 0]


def round_trip(x: mx.array, quantization: KVQuantization) -> mx.array:
    """`x` [..., dim] as pages give it back once written: quantized as stored, dequantized, in x's dtype."""
    data, scales, biases = quantize(x, quantization)
    return mx.dequantize(data, scales, biases, group_size=quantization.group_size, bits=quantization.bits)


def _pack(levels: mx.array, bits: int) -> mx.array:
    """Levels uint32 [..., dim] into words [..., dim * bits / 32]: element i at bit `bits * (i % per_word)` of word
    `i // per_word` (mx.quantize's layout for 4 and 8 bits). Fields do not overlap, so their sum is their OR."""
    per_word = 32 // bits
    *lead, dim = levels.shape
    shifts = mx.arange(per_word, dtype=mx.uint32) * bits
    return mx.sum(levels.reshape(*lead, dim // per_word, per_word) << shifts, axis=-1).astype(mx.uint32)
