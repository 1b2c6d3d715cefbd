"""Decode attention over quantized pages without dequantizing them (cache/quantized_pages.py).

Two forms, both over the pages a sequence reads, taken packed (data, scales and biases by page row):
`attend_quantized_pages`, the reference (every backend without the Metal kernel), and
`attend_quantized_unpacked`, the CPU path's decode (kernels/cpu_attention.py), described below it.


As mlx-lm's `quantized_scaled_dot_product_attention` (mlx_lm/models/base.py) does for its QuantizedKVCache:
the packed pages a sequence reads are taken by page row (data, scales and biases alike) and multiplied as
they are, scores by `mx.quantized_matmul(q, K^T)` and outputs by `mx.quantized_matmul(p, V)`, so a step never
materializes the context's K/V in full precision. GQA folds the query heads of a KV head into that head's
rows. Sinks (gpt-oss) join each softmax as one more column with no value. Prefill reads gathered pages
dequantized instead (reference.gather_pages): there the queries outnumber the keys' reuse of a dequantized
copy, and every prefill path (NumPy, MLX's fused SDPA, the CPU path) then takes it as it takes full pages.

Measured (2-core CPU, 9 query / 3 KV heads, D 64, 512 keys, one layer): quantized matmul 0.50 ms (8-bit),
dequantize + SDPA 0.42 ms, full-precision SDPA 0.15 ms; the two quantized forms agree to 1.4e-7.
"""

from __future__ import annotations

from mlxpaged.cache.quantized_pages import QuantizedPages

import mlx.core as mx


def attend_quantized_pages(
    q: mx.array,
    k_pages: QuantizedPages,
    v_pages: QuantizedPages,
    rows: mx.array,
    mask: mx.array | None,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """`reference.attend_pages` over quantized pools: q [B, H, L, Dk], `rows` [B, KVH, nb] page rows,
    `mask` [B, 1, L or 1, nb * BS] bool or None, sinks [H] or None -> [B, H, L, Dv] in q's dtype."""
    batch, heads, length, k_dim = q.shape
    kv_heads = k_pages.shape[1]
    group = heads // kv_heads
    k_data, k_scales, k_biases = k_pages.take_pages(rows)
    v_data, v_scales, v_biases = v_pages.take_pages(rows)
    # [B, KVH, G * L, D] query rows against each KV head's [B, KVH, N, ...] pages: the pages are read once per
    # KV head, and no broadcast axis reaches the quantized matmuls (measured faster on the CPU backend).
    queries = (q * scale).reshape(batch, kv_heads, group * length, k_dim)
    scores = mx.quantized_matmul(
        queries, k_data, k_scales, k_biases, transpose=True, group_size=k_pages.group_size, bits=k_pages.bits
    ).astype(mx.float32)
    weights = _folded_softmax(scores, mask, sinks, group, length)
    out = mx.quantized_matmul(
        weights.astype(q.dtype),
        v_data,
        v_scales,
        v_biases,
        transpose=False,
        group_size=v_pages.group_size,
        bits=v_pages.bits,
    )
    return out.reshape(batch, heads, length, v_pages.shape[-1])


# --- the CPU path: integer levels through BLAS, scales and biases folded around the matmuls -------------------
#
# `mx.quantized_matmul` on the CPU backend is scalar code that unpacks every key once per query row: at 500 keys
# a 4-bit decode pass's attention cost twice full precision's. Here the packed words of the taken pages are
# viewed as bytes (`mx.view`: 8-bit levels are the bytes themselves, 4-bit levels their two nibbles) and
# converted to float32 in one pass, and the affine form is applied around float32 matmuls, per key and
# group g (x: a query row, u: a key's levels, s / b: its scale and bias, p: the softmax weights):
#     score = sum_g s_g (x_g . u_g) + b_g sum(x_g),      out_g = (p * s_g) @ U_g + p @ b_g
# so nothing of size keys x width is scaled elementwise (MLX's broadcast elementwise kernels cost ~1.5 ns an
# element on this CPU). The float32 levels are a transient of one attention call, freed with it: no
# full-precision copy of the context is kept. 4-bit levels come as even and odd elements, so the queries are
# split the same way and the outputs interleaved back: two more matmuls and a stack, which lose to the
# quantized matmuls at short contexts (UNPACKED_4BIT_MIN_KEYS).
#
# Measured: 30 layers of decode attention in one compiled pass, SmolLM2's shapes (9 / 3 heads, D 64, groups of
# 64), batch 1, CPU time (process_time) medians of 37 interleaved passes, the 2-core machine loaded (load 13):
#     keys read (in use)   8-bit: unpacked / quantized matmuls   4-bit: unpacked / quantized matmuls   full
#      128 (40)                     5.4 / 6.0                                                            3.6
#      128 (120)                    6.1 / 6.7                        7.5 / 6.4                           4.0
#      256 (250)                    7.2 / 9.3                        8.2 / 9.3                           5.2
#      512 (500)                                                    10.8 / 15.4                          7.7
UNPACKED_4BIT_MIN_KEYS = 256  # 4-bit pages take the unpacked form from this many keys per pass (batch x keys)


def _folded_softmax(
    scores: mx.array, mask: mx.array | None, sinks: mx.array | None, group: int, length: int
) -> mx.array:
    """Attention weights from float32 scores [B, KVH, G * L, N] (GQA folded: a KV head's G query heads, L
    queries each), `mask` [B, 1, L or 1, N] bool or None (the same for every query head of a KV head), sinks
    [H] or None (one more softmax column with no value)."""
    batch, kv_heads = scores.shape[:2]
    if mask is not None:
        if length > 1:
            mask = mx.broadcast_to(mask[:, :, None], (batch, 1, group, length, mask.shape[-1]))
            mask = mask.reshape(batch, 1, group * length, -1)
        scores = mx.where(mask, scores, mx.array(-mx.inf, mx.float32))
    if sinks is None:
        return mx.softmax(scores, axis=-1)
    sink = sinks.astype(mx.float32).reshape(1, kv_heads, group, 1)
    sink = mx.broadcast_to(sink, (batch, kv_heads, group, length)).reshape(batch, kv_heads, group * length, 1)
    return mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1)[..., 1:]


def unpacked_applies(bits: int, keys: int) -> bool:
    """True when `attend_quantized_unpacked` beats the quantized matmuls on the CPU backend for a decode pass
    over `keys` (batch x keys each sequence reads) at `bits` (table above)."""
    return bits == 8 or keys >= UNPACKED_4BIT_MIN_KEYS


def attend_quantized_unpacked(
    q: mx.array,
    k_pages: QuantizedPages,
    v_pages: QuantizedPages,
    rows: mx.array,
    mask: mx.array | None,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """`attend_quantized_pages` for one decode query per sequence, on float32 pages: q [B, H, 1, Dk], `rows`
    [B, KVH, nb] page rows, `mask` [B, 1, 1, nb * BS] bool or None, sinks [H] or None -> [B, H, 1, Dv]."""
    batch, heads, length, k_dim = q.shape
    if length != 1:
        raise ValueError(f"one decode query per sequence: q is {tuple(q.shape)}")
    kv_heads = k_pages.shape[1]
    group = heads // kv_heads
    k_data, k_scales, k_biases = k_pages.take_pages(rows)
    v_data, v_scales, v_biases = v_pages.take_pages(rows)
    queries = (q * scale).reshape(batch, kv_heads, group, k_dim)  # GQA: R = G query rows
    scores = _scores(queries, k_data, k_scales, k_biases, k_pages.bits, k_pages.group_size)  # [B, KVH, G, N]
    weights = _folded_softmax(scores, mask, sinks, group, 1)
    out = _weighted_values(weights, v_data, v_scales, v_biases, v_pages.bits, v_pages.group_size)
    return out.reshape(batch, heads, 1, v_pages.shape[-1]).astype(q.dtype)


def _levels(data: mx.array, bits: int, group_size: int) -> list[mx.array]:
    """Packed words [B, KVH, N, W] as float32 levels per group, [B, KVH, groups, N, c]: one array of the groups'
    elements (8 bits, c = group_size) or two, their even and odd elements (4 bits, c = group_size / 2). One
    group per row (the common width == group size): [B, KVH, N, c], no group axis (fewer ops)."""
    batch, kv_heads, keys, _ = data.shape
    codes = mx.view(data, mx.uint8)  # little-endian: byte i holds element i (8 bits), elements 2i, 2i+1 (4 bits)
    per_group = group_size * bits // 8
    if codes.shape[-1] != per_group:
        codes = codes.reshape(batch, kv_heads, keys, -1, per_group).transpose(0, 1, 3, 2, 4)
    if bits == 8:
        return [codes.astype(mx.float32)]
    return [(codes & 15).astype(mx.float32), (codes >> 4).astype(mx.float32)]


def _split_rows(x: mx.array, bits: int, group_size: int) -> list[mx.array]:
    """Rows [B, KVH, R, D] as `_levels` lays out the keys: [B, KVH, groups, R, c] (or [B, KVH, R, c], one group)."""
    batch, kv_heads, count, dim = x.shape
    if dim != group_size:
        x = x.reshape(batch, kv_heads, count, -1, group_size).transpose(0, 1, 3, 2, 4)
    return [x] if bits == 8 else [x[..., 0::2], x[..., 1::2]]


def _per_group(a: mx.array) -> mx.array:
    """Scales or biases [B, KVH, N, groups] as [B, KVH, groups, 1, N] (one group: [B, KVH, 1, N])."""
    a = a.swapaxes(-1, -2)
    return a if a.shape[-2] == 1 else a[..., None, :]


def _scores(x: mx.array, data: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """x [B, KVH, R, D] against the taken keys -> [B, KVH, R, N]: sum_g s_g (x_g . u_g) + b_g sum(x_g).
    The products as levels @ x^T, x^T made contiguous: OpenBLAS multiplies a few rows by a transposed
    [N, c] operand ~3x slower (8-bit, 4,096 keys, one layer: 0.75 against 0.23 ms; the whole decode step
    of SmolLM2 there, CPU time: 136 -> 121 ms at 8 bits, 177 -> 156 ms at 4, full precision 114 and 136 ms
    beside them in those two runs)."""
    parts = [
        (levels @ mx.contiguous(rows.swapaxes(-1, -2))).swapaxes(-1, -2)
        for rows, levels in zip(_split_rows(x, bits, group_size), _levels(data, bits, group_size), strict=True)
    ]
    raw = parts[0] if len(parts) == 1 else parts[0] + parts[1]  # [B, KVH, (groups,) R, N]
    batch, kv_heads, count, dim = x.shape
    if dim == group_size:
        return raw * _per_group(scales) + _per_group(biases) * x.sum(axis=-1, keepdims=True)
    sums = x.reshape(batch, kv_heads, count, -1, group_size).sum(axis=-1).swapaxes(-1, -2)[..., None]
    return mx.sum(raw * _per_group(scales) + _per_group(biases) * sums, axis=2)


def _weighted_values(
    weights: mx.array, data: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int
) -> mx.array:
    """weights [B, KVH, R, N] over the taken values -> [B, KVH, R, D]: per group (p * s_g) @ U_g + p @ b_g."""
    one_group = scales.shape[-1] == 1
    scaled = (weights if one_group else weights[:, :, None]) * _per_group(scales)  # [B, KVH, (groups,) R, N]
    parts = [scaled @ levels for levels in _levels(data, bits, group_size)]  # each [B, KVH, (groups,) R, c]
    out = parts[0] if bits == 8 else mx.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)  # even, odd
    offsets = weights @ biases  # [B, KVH, R, groups]
    if one_group:
        return out + offsets
    out = out + offsets.swapaxes(-1, -2)[..., None]  # [B, KVH, groups, R, group_size]
    out = out.transpose(0, 1, 3, 2, 4)
    return out.reshape(*out.shape[:3], -1)
