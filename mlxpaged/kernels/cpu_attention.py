"""Attention for MLX's CPU backend, where ``mx.fast.scaled_dot_product_attention`` is not a fused
kernel but matmul + softmax, and the softmax's ``exp`` dominates.

``attend`` is attention over contiguous K/V (prefill, over what the cache view gathered);
``paged_attention_cpu`` is decode attention read from the page pools in place.

Measured on the 2-core CPU backend (MLX 0.32): ``mx.exp`` runs at ~12 ns per element (scalar),
while the matmuls of attention run through BLAS. For a 450-token causal prefill of one
SmolLM2 layer (9 query / 3 KV heads, D 64) the scores matmul takes 1.4 ms and the softmax 22 ms.
Three changes, each checked against a NumPy float64 reference in tests/kernels/test_cpu_attention.py:

- ``exp`` of the shifted scores is computed as 2^n * p(f) (n = round(x log2 e), |f| <= 1/2,
  p a degree-7 Taylor polynomial of 2^f, 2^n built from exponent bits): a compiled elementwise
  pass and one multiply, ~4x faster than ``mx.exp``, relative error a few float32 ulps.
- Normalisation is applied to the [rows, D] output instead of the [rows, keys] probabilities.
- Causal queries are processed in blocks that each read only the keys they can see, so the
  masked upper triangle is neither multiplied nor exponentiated (about half the work).

GQA is folded: the G query heads of a KV head are G times more query rows against the same
keys, so K and V are read once per KV head and the batched matmuls are larger. Sinks (gpt-oss,
one logit per query head) join the row maximum and the denominator (formula in reference.py).

Decode does not gather pages: ``mx.gather_mm`` multiplies each (sequence, KV head) query rows
with each of its pages where the page lies in the pool, for scores and again for the weighted
values. Gathering B=16 sequences x 512 tokens copies 12 MB per layer first; without the copy
decode attention takes 2.3 ms per layer instead of 4.1 (measured, block size 16).

Quantized pages (of float32 scales) are taken packed and attended by ``attend_quantized_unpacked``
(kernels/quantized_attention.py: integer levels through float32 matmuls, scales and biases folded around
them) where it is faster than the reference's quantized matmuls (``unpacked_applies``), else by those.
"""

from __future__ import annotations

import math
from functools import partial

from mlxpaged.cache.quantized_pages import Pool, QuantizedPages
from mlxpaged.kernels.quantized_attention import attend_quantized_unpacked, unpacked_applies
from mlxpaged.kernels.reference import (
    attend_pages,
    check_pools,
    decode_plan,
    output_shape,
    paged_attention_reference,
    zero_empty,
)

import mlx.core as mx

# Decode calls over fewer (sequence x key) pairs than this take the reference path (gathered pages
# + mx.fast SDPA): the copy is small there and its graph has fewer nodes to build and run. Batch-1
# engine decode at ~130 keys, 8 alternating runs: reference 18.98 tok/s, gather_mm 17.85, mlx-lm 18.93.
GATHER_MM_MIN_KEYS = 1024

# Query rows per causal block: small enough to skip most of the masked triangle, large enough
# that each block's matmuls stay efficient (measured: 64 beat 128 and 256 at 450 tokens).
QUERY_BLOCK = 64

LOG2E = 1.4426950408889634
_TAYLOR_2F = [math.log(2) ** k / math.factorial(k) for k in range(8)]  # 2^f = sum (f ln 2)^k / k!
_MASKED = -1e30  # finite: a fully masked (padding) row gets finite garbage, not NaN


def exp2_parts(t: mx.array) -> tuple[mx.array, mx.array]:
    """2^t as (p, bits) for float32 t in [-127, 127]: p = 2^f as a polynomial (n = round(t), f = t - n) and bits =
    the float32 bit pattern of 2^n (t = -127 gives the pattern of 0.0). Traced inside the compiled callers: ``mx.view``
    cannot be compiled shapeless, so they return both and their caller multiplies."""
    n = mx.round(t)
    f = t - n
    p = _TAYLOR_2F[7] * f + _TAYLOR_2F[6]
    for c in reversed(_TAYLOR_2F[:6]):
        p = p * f + c
    return p, (n.astype(mx.int32) + 127) << 23


@partial(mx.compile, shapeless=True)
def _exp_parts(scores: mx.array, row_max: mx.array) -> tuple[mx.array, mx.array]:
    """exp(scores - row_max) as ``exp2_parts``; clamped at 2^-127, so masked keys add exactly 0."""
    return exp2_parts(mx.maximum((scores - row_max) * LOG2E, -127.0))


def shifted_exp(scores: mx.array, row_max: mx.array) -> mx.array:
    """exp(scores - row_max) for float32 scores <= row_max (the softmax case)."""
    p, bits = _exp_parts(scores, row_max)
    return p * mx.view(bits, mx.float32)


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None, sinks: mx.array | None = None) -> mx.array:
    """What ``mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)`` returns.

    q [B, H, L, Dk]; k [B, KVH, K, Dk], v [B, KVH, K, Dv] with H a multiple of KVH; mask None, "causal"
    (bottom-right aligned: query i sees keys <= K - L + i), a boolean array (True = attend)
    or an additive array, broadcastable to [B, H, L, K]; sinks [H] or None. Computed in float32,
    returned in q's dtype, [B, H, L, Dv].
    """
    length, keys = q.shape[2], k.shape[2]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        if length > QUERY_BLOCK:
            blocks = []
            for i in range(0, length, QUERY_BLOCK):
                j = min(length, i + QUERY_BLOCK)
                end = keys - length + j  # the last key query j - 1 sees, plus one
                blocks.append(_attend(q[:, :, i:j], k[:, :, :end], v[:, :, :end], scale, "causal", sinks))
            return mx.concatenate(blocks, axis=2)
    return _attend(q, k, v, scale, mask, sinks)


def _sink_rows(sinks: mx.array, kv_heads: int, ndim: int) -> mx.array:
    """sinks [H] as float32 [1, KVH, G, 1, ...] (``ndim`` dims), the folded layout of the scores."""
    shape = (1, kv_heads, sinks.shape[0] // kv_heads) + (1,) * (ndim - 3)
    return sinks.astype(mx.float32).reshape(shape)


def _softmax_parts(scores: mx.array, sinks: mx.array | None, kv_heads: int) -> tuple[mx.array, mx.array]:
    """(unnormalised probabilities, denominator) over the last axis, a sink logit joining both."""
    row_max = mx.max(scores, axis=-1, keepdims=True)
    if sinks is None:
        probs = shifted_exp(scores, row_max)
        return probs, mx.sum(probs, axis=-1, keepdims=True)
    sink = _sink_rows(sinks, kv_heads, scores.ndim)
    row_max = mx.maximum(row_max, sink)
    probs = shifted_exp(scores, row_max)
    return probs, mx.sum(probs, axis=-1, keepdims=True) + shifted_exp(sink, row_max)


def _attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask, sinks: mx.array | None = None) -> mx.array:
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    f32 = mx.float32
    rows = (q.astype(f32) * scale).reshape(batch, kv_heads, group * length, dim)
    scores = (rows @ k.astype(f32).swapaxes(-1, -2)).reshape(batch, kv_heads, group, length, keys)
    if mask is not None:
        scores = _apply_mask(scores, mask, heads, length, keys)
    probs, total = _softmax_parts(scores, sinks, kv_heads)
    out = probs.reshape(batch, kv_heads, group * length, keys) @ v.astype(f32)
    out = out / total.reshape(batch, kv_heads, group * length, 1)
    return out.reshape(batch, heads, length, v.shape[-1]).astype(q.dtype)


def _apply_mask(scores: mx.array, mask, heads: int, length: int, keys: int) -> mx.array:
    """scores [B, KVH, G, L, K] with the mask added. A boolean mask becomes additive before it is
    broadcast over the heads: `mx.where` on the CPU is ~10x slower per element than an add."""
    kv_heads, group = scores.shape[1], scores.shape[2]
    if isinstance(mask, str):  # "causal", one block: query i sees keys <= keys - length + i
        mask = mx.arange(length)[:, None] + (keys - length) >= mx.arange(keys)[None, :]
    if mask.dtype == mx.bool_:
        mask = mx.where(mask, mx.array(0.0, scores.dtype), mx.array(_MASKED, scores.dtype))
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == heads and heads != 1:  # per-head masks follow the folded layout
        mask = mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])
    else:
        mask = mask[:, :, None]
    return scores + mask.astype(scores.dtype)


def paged_attention_cpu(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables,
    context_lens,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Decode attention, one query per sequence, read from float32 pools in place (quantized pages of float32
    scales: taken packed, see the module docstring). Same contract as ``reference.paged_attention_reference``."""
    batch, _, qlen, _ = q.shape
    if qlen != 1:
        raise ValueError(f"decode takes one query token per sequence: q is {tuple(q.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens or None, got {window}")
    check_pools(q, k_pool, v_pool, sinks)
    plan = decode_plan(block_tables, context_lens, window, k_pool.shape, batch)
    if plan is None:
        return mx.zeros(output_shape(q, v_pool), dtype=q.dtype)
    if isinstance(k_pool, QuantizedPages) and isinstance(v_pool, QuantizedPages):
        out = _quantized_decode(q, k_pool, v_pool, plan.rows, plan.mask, scale, sinks)
        return zero_empty(out, plan.lens)
    if batch * plan.rows.shape[2] * k_pool.shape[2] < GATHER_MM_MIN_KEYS:
        return paged_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale, window, sinks)
    page_ids, query_ids, page_mask = plan.derived("cpu", lambda p: _page_arrays(p.rows, p.mask))
    out = _gather_mm_attention(q, k_pool, v_pool, page_ids, query_ids, page_mask, scale, sinks)
    return zero_empty(out, plan.lens)


def decode_attention_cpu(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    rows: mx.array,
    mask: mx.array,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """Decode attention from array inputs only (compiled passes): ``rows`` [B, KVH, nb] page rows,
    ``mask`` [B, 1, 1, nb * BS] bool, at least one key per sequence; sinks [H] or None. Float32 pools, or
    quantized pages of float32 scales."""
    if isinstance(k_pool, QuantizedPages) and isinstance(v_pool, QuantizedPages):
        return _quantized_decode(q, k_pool, v_pool, rows, mask, scale, sinks)
    batch, _, pages = rows.shape
    if batch * pages * k_pool.shape[2] < GATHER_MM_MIN_KEYS:
        return attend_pages(q, k_pool, v_pool, rows, mask, scale, sinks)
    page_ids, query_ids, page_mask = _page_arrays(rows, mask)
    return _gather_mm_attention(q, k_pool, v_pool, page_ids, query_ids, page_mask, scale, sinks)


def _quantized_decode(
    q: mx.array,
    k_pages: QuantizedPages,
    v_pages: QuantizedPages,
    rows: mx.array,
    mask: mx.array | None,
    scale: float,
    sinks: mx.array | None,
) -> mx.array:
    """Decode over quantized pages: the unpacked form where it is the faster, else the reference's quantized
    matmuls (its twin; both read the same packed pages)."""
    keys = rows.shape[0] * rows.shape[2] * k_pages.shape[2]
    if unpacked_applies(k_pages.bits, keys) and unpacked_applies(v_pages.bits, keys):
        return attend_quantized_unpacked(q, k_pages, v_pages, rows, mask, scale, sinks)
    return attend_pages(q, k_pages, v_pages, rows, mask, scale, sinks)


def _gather_mm_attention(q, k_pool, v_pool, page_ids, query_ids, page_mask, scale, sinks=None) -> mx.array:
    """Scores and weighted values page by page with ``mx.gather_mm``, reading the pools in place."""
    batch, heads, _, dim = q.shape
    kv_heads, block_size, v_dim = k_pool.shape[1], k_pool.shape[2], v_pool.shape[-1]
    group, pages = heads // kv_heads, page_ids.shape[0] // (batch * kv_heads)
    rows = (q.astype(mx.float32) if q.dtype != mx.float32 else q) * scale
    rows = rows.reshape(batch * kv_heads, group, dim)
    key_pages = k_pool.reshape(-1, block_size, dim).swapaxes(1, 2)  # a view: [NB * KVH, D, BS]
    scores = mx.gather_mm(rows, key_pages, lhs_indices=query_ids, rhs_indices=page_ids)
    scores = scores.reshape(batch, kv_heads, pages, group, block_size)
    if page_mask is not None:
        scores = scores + page_mask
    row_max = mx.max(mx.max(scores, axis=-1, keepdims=True), axis=2, keepdims=True)  # [B, KVH, 1, G, 1]
    if sinks is not None:
        sink = _sink_rows(sinks, kv_heads, 4)[:, :, None]  # [1, KVH, 1, G, 1], the scores' layout
        row_max = mx.maximum(row_max, sink)
    probs = shifted_exp(scores, row_max)
    total = mx.sum(mx.sum(probs, axis=-1), axis=2)  # [B, KVH, G]
    if sinks is not None:
        total = total + shifted_exp(sink, row_max).reshape(total.shape[0], kv_heads, group)
    out = mx.gather_mm(
        probs.reshape(-1, group, block_size), v_pool.reshape(-1, block_size, v_dim), rhs_indices=page_ids
    )
    out = mx.sum(out.reshape(batch, kv_heads, pages, group, v_dim), axis=2) / total[..., None]
    out = out.reshape(batch, heads, 1, v_dim)
    return out if q.dtype == mx.float32 else out.astype(q.dtype)


def _page_arrays(rows: mx.array, mask: mx.array | None) -> tuple[mx.array, mx.array, mx.array | None]:
    """(page row per (sequence, head, page), its query row, additive mask [B, 1, nb, 1, BS] or None)."""
    batch, kv_heads, pages = rows.shape
    query_ids = mx.repeat(mx.arange(batch * kv_heads, dtype=mx.int32), pages)
    if mask is not None:
        mask = mx.where(mask, mx.array(0.0), mx.array(_MASKED)).reshape(batch, 1, pages, 1, -1)
    return rows.reshape(-1), query_ids, mask
