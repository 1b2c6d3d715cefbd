"""Prefill attention of a short chunk over cached pages with the key length rounded up to a bucket.

MLX's fused attention on CUDA (cuDNN) builds and caches an execution plan per shape. A chunk attending its
cached prefix gathers exactly `prefix + chunk` keys, so every follow-up turn of a conversation, each one a new
length, pays for a new plan. Here the gathered pages are rounded up to `page_bucket` pages (four shapes per
doubling, padding masked out), so a growing conversation reuses a handful of plans. Only short chunks take it
(`Tuning.bucketed_chunk_keys` tokens at most): a long chunk's own compute dwarfs a plan, and the explicit mask
stops the fused kernel from skipping the causal triangle's tiles. Same result as
`reference.paged_prefill_attention_reference` (full attention, no window).
"""

from __future__ import annotations

from mlxpaged.cache.quantized_pages import Pool
from mlxpaged.kernels.reference import as_table, check_pools, fast_sinks, gather_pages, page_rows

import mlx.core as mx
import numpy as np

MIN_PAGES = 8  # contexts up to 128 tokens (block size 16) share one shape


def page_bucket(pages: int) -> int:
    """Pages a pass reads, rounded up: exact up to MIN_PAGES, then in steps of an eighth to a
    quarter of the count (4 shapes per doubling, at most ~25% padding)."""
    if pages <= MIN_PAGES:
        return MIN_PAGES
    step = 1 << (pages.bit_length() - 3)
    return -(-pages // step) * step


def bucketed_prefill_attention(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_table,
    prefix_len: int,
    chunk_len: int,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """q [1, H, chunk_len, D] at positions `prefix_len`..; the chunk's K/V already in the pools. Returns
    [1, H, chunk_len, Dv]."""
    check_pools(q, k_pool, v_pool, sinks)
    block_size = k_pool.shape[2]
    total = prefix_len + chunk_len
    table = np.asarray(block_table if not isinstance(block_table, mx.array) else as_table(block_table), np.int32)
    table = table.reshape(-1)
    needed = -(-total // block_size)
    if needed > table.size:
        raise ValueError(
            f"prefix {prefix_len} + chunk {chunk_len} tokens exceed the block table capacity {table.size * block_size}"
        )
    width = page_bucket(needed)
    # Padding pages repeat the last one (inside the pool); their keys are masked out.
    padded = np.concatenate([table[:needed], np.full(width - needed, table[needed - 1], dtype=np.int32)])
    rows = page_rows(mx.array(padded[None]), k_pool.shape, clip=False)
    keys, values = gather_pages(k_pool, rows), gather_pages(v_pool, rows)
    keep = np.arange(width * block_size)[None, :] <= np.arange(prefix_len, total)[:, None]
    return mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=mx.array(keep), sinks=fast_sinks(sinks, q.dtype)
    )
