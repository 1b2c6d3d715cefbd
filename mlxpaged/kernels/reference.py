"""Pure-MLX paged attention: the path on the CPU backend and the oracle for the Metal kernel.

Pool layout (per layer): K ``[num_blocks, num_kv_heads, block_size, k_dim]`` and V
``[num_blocks, num_kv_heads, block_size, v_dim]`` (widths may differ: MLA latent caches); token ``t`` of a
sequence lives at ``pool[table[t // block_size], :, t % block_size, :]``. Outputs have V's width.

``sinks`` (gpt-oss): one float32 logit per query head that joins every softmax as a key with no value:
``out = sum_i e^(s_i - m) v_i / (e^(sink - m) + sum_i e^(s_i - m))``, ``m = max(sink, max_i s_i)``.

Pages are gathered whole: the pool is viewed as ``[num_blocks * num_kv_heads, block_size * head_dim]``
rows and one ``mx.take`` by ``table * num_kv_heads + head`` yields ``[B, num_kv_heads, tokens, D]``
directly, with no transpose copy. Only the blocks that some query can see are gathered.

Quantized pools (cache/quantized_pages.py) are taken the same way, array by array: decode attends the packed
pages (kernels/quantized_attention.py), prefill dequantizes the pages it gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxpaged.cache.quantized_pages import Pool, QuantizedPages
from mlxpaged.kernels.quantized_attention import attend_quantized_pages

import mlx.core as mx
import numpy as np

# Measured on the 2-core CPU backend: folding GQA heads into query rows makes SDPA 0.45-0.8x as
# long from 2k keys on, but 5-30% slower below 1k.
FOLD_GQA_MIN_KEYS = 2048


def host_ints(values) -> list[int]:
    """A host list of ints from an mx.array, numpy array or sequence (a leaf array costs no compute)."""
    if isinstance(values, mx.array):
        return [int(v) for v in host_list(values)]
    return [int(v) for v in np.asarray(values).reshape(-1)]


def host_list(array: mx.array) -> list[Any]:
    """`array.tolist()` of an array of one or more dimensions (its elements: numbers, or lists for 2-D on)."""
    values = array.tolist()
    if not isinstance(values, list):
        raise ValueError(f"a 0-d array has no list: {values!r}")
    return values


def as_table(block_tables) -> mx.array:
    if isinstance(block_tables, mx.array):
        return block_tables.astype(mx.int32) if block_tables.dtype != mx.int32 else block_tables
    return mx.array(np.asarray(block_tables, dtype=np.int32))


def page_rows(tables: mx.array, pool_shape, clip: bool = True) -> mx.array:
    """Row ids [B, KVH, nb] into the pool viewed as [NB * KVH, BS * D] rows (one row per page and head).

    ``clip`` keeps padding entries (past a sequence's length, masked out later) inside the pool.
    """
    num_blocks, kv_heads = pool_shape[0], pool_shape[1]
    if clip:
        tables = mx.clip(tables, 0, num_blocks - 1)
    return tables[:, None, :] * kv_heads + mx.arange(kv_heads, dtype=mx.int32)[None, :, None]


def gather_pages(pool: mx.array | QuantizedPages, rows: mx.array) -> mx.array:
    """``pool`` [NB, KVH, BS, D], ``rows`` [B, KVH, nb] from ``page_rows`` -> [B, KVH, nb * BS, D]
    (a quantized pool's pages dequantized to its dtype)."""
    if isinstance(pool, QuantizedPages):
        return pool.dequantize(pool.take_pages(rows))
    num_blocks, kv_heads, block_size, head_dim = pool.shape
    batch, _, nb = rows.shape
    flat = pool.reshape(num_blocks * kv_heads, block_size * head_dim)
    return mx.take(flat, rows, axis=0).reshape(batch, kv_heads, nb * block_size, head_dim)


def window_start(length: int, window: int | None) -> int:
    """First key position a query at position ``length - 1`` may see."""
    return max(0, length - window) if window else 0


def _check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens or None, got {window}")


def paged_attention_reference(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables,
    context_lens,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Decode attention, one query token per sequence.

    q [B, H, 1, Dk]; pools K [NB, KVH, BS, Dk], V [NB, KVH, BS, Dv]; block_tables [B, max_blocks] int32;
    context_lens [B] (tokens in the pool, the current token's K/V included); sinks [H] or None.
    Returns [B, H, 1, Dv]; a sequence with context length 0 gets zeros.
    """
    _check_window(window)
    batch, _, qlen, _ = q.shape
    if qlen != 1:
        raise ValueError(f"decode takes one query token per sequence: q is {tuple(q.shape)}")
    check_pools(q, k_pool, v_pool, sinks)
    plan = decode_plan(block_tables, context_lens, window, k_pool.shape, batch)
    if plan is None:
        return mx.zeros(output_shape(q, v_pool), dtype=q.dtype)
    return zero_empty(attend_pages(q, k_pool, v_pool, plan.rows, plan.mask, scale, sinks), plan.lens)


def output_shape(q: mx.array, v_pool: Pool) -> tuple[int, ...]:
    """Attention outputs have the queries' shape with V's width."""
    return (*q.shape[:-1], v_pool.shape[-1])


def check_pools(q: mx.array, k_pool: Pool, v_pool: Pool, sinks: mx.array | None) -> None:
    """K and V pools must share blocks, heads and block size, K must have the queries' width and
    sinks must hold one logit per query head: anything else would attend the wrong numbers."""
    if k_pool.shape[:3] != v_pool.shape[:3] or k_pool.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"pools K {tuple(k_pool.shape)} / V {tuple(v_pool.shape)} do not fit queries "
            f"{tuple(q.shape)}: K and V need the same [blocks, kv_heads, block_size] and K "
            f"the queries' width {q.shape[-1]}"
        )
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks {tuple(sinks.shape)} must hold one logit per query head ({q.shape[1]},)")


def fast_sinks(sinks: mx.array | None, dtype: mx.Dtype) -> mx.array | None:
    """Sinks as ``mx.fast.scaled_dot_product_attention`` takes them: in the queries' dtype (float32
    sinks with float16 queries raise there; the other way round the cast is exact)."""
    if sinks is None or sinks.dtype == dtype:
        return sinks
    return sinks.astype(dtype)


def attend_pages(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    rows: mx.array,
    mask: mx.array | None,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """Decode attention over gathered pages: ``rows`` [B, KVH, nb] from ``page_rows``, ``mask``
    [B, 1, 1, nb * BS] bool or None, ``sinks`` [H] or None. Array inputs only, so compiled passes use it too."""
    if isinstance(k_pool, QuantizedPages) and isinstance(v_pool, QuantizedPages):
        return attend_quantized_pages(q, k_pool, v_pool, rows, mask, scale, sinks)
    batch, heads, _, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    keys, values = gather_pages(k_pool, rows), gather_pages(v_pool, rows)
    if keys.shape[2] >= FOLD_GQA_MIN_KEYS and sinks is None:
        # One decode query per sequence: the G query heads of a KV head are G query rows under the
        # same mask, so attend without GQA and K/V are read once per KV head, not once per query head.
        # (Not with sinks: mx.fast takes one sink per head, the folded rows would need one per row.)
        folded = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
        out = mx.fast.scaled_dot_product_attention(folded, keys, values, scale=scale, mask=mask)
        return out.reshape(batch, heads, 1, values.shape[-1])
    return mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=mask, sinks=fast_sinks(sinks, q.dtype)
    )


def zero_empty(out: mx.array, lens: list[int]) -> mx.array:
    """Zero the output of sequences with an empty context (their softmax saw only masked keys)."""
    if min(lens) > 0:
        return out
    return mx.where(mx.array(np.asarray(lens) > 0)[:, None, None, None], out, mx.zeros((), out.dtype))


@dataclass
class DecodePlan:
    """What every layer of one decode pass shares: the gathered span of each table, its page rows,
    the length/window mask (None when every sequence sees the whole span) and the lengths."""

    span: mx.array  # [B, nb] block ids
    rows: mx.array  # [B, KVH, nb] rows of the pool viewed as [NB * KVH, BS * D]
    mask: mx.array | None  # [B, 1, 1, nb * BS] bool
    lens: list[int]
    _extras: dict = field(default_factory=dict)  # per-consumer derived arrays, built once per pass

    def derived(self, name: str, build):
        """`build(self)` computed once per plan (so once per pass, not once per layer)."""
        if name not in self._extras:
            self._extras[name] = build(self)
        return self._extras[name]


_last_plan: tuple | None = None


def decode_plan(block_tables, context_lens, window, pool_shape, batch) -> DecodePlan | None:
    """The plan of a decode call, or None when every context is empty.
    A model calls this once per layer with the same table and lengths arrays, so the last plan
    is reused: matched by identity of the (immutable) mx.arrays, which the memo holds so their
    ids cannot be recycled. Lists are never memoized (they can change in place); lengths may be a
    tuple of ints, which needs no device round trip."""
    global _last_plan
    rest = (window, tuple(pool_shape), batch)
    if (
        _last_plan is not None
        and _last_plan[0] is block_tables
        and _last_plan[1] is context_lens
        and _last_plan[2] == rest
    ):
        return _last_plan[3]
    plan = _build_decode_plan(block_tables, context_lens, window, pool_shape, batch)
    if isinstance(block_tables, mx.array) and isinstance(context_lens, (mx.array, tuple)):
        _last_plan = (block_tables, context_lens, rest, plan)
    return plan


def _build_decode_plan(block_tables, context_lens, window, pool_shape, batch):
    block_size = pool_shape[2]
    tables = as_table(block_tables)
    lens = host_ints(context_lens)
    if len(lens) != batch or tables.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: q has {batch} sequences, block_tables {tables.shape[0]}, context_lens {len(lens)}"
        )
    capacity = tables.shape[1] * block_size
    if lens and max(lens) > capacity:
        raise ValueError(
            f"context length {max(lens)} exceeds the block table capacity {capacity} "
            f"({tables.shape[1]} blocks of {block_size})"
        )
    max_len = max(lens, default=0)
    if max_len == 0:
        return None
    starts = [window_start(n, window) if n else max_len for n in lens]
    first_block = min(starts) // block_size
    last_block = -(-max_len // block_size)
    span = tables[:, first_block:last_block]
    # Table entries are only guaranteed valid below each sequence's own block count.
    padded = any(
        -(-n // block_size) < last_block or s // block_size > first_block for n, s in zip(lens, starts, strict=True)
    )
    rows = page_rows(span, pool_shape, clip=padded)
    mask = _decode_mask(lens, starts, first_block * block_size, last_block * block_size)
    return DecodePlan(span, rows, mask, lens)


def _decode_mask(lens: list[int], starts: list[int], lo: int, hi: int) -> mx.array | None:
    """[B, 1, 1, hi - lo] bool, or None when every sequence sees exactly the gathered span."""
    if all(n == hi and s == lo for n, s in zip(lens, starts, strict=True)):
        return None
    pos = np.arange(lo, hi)[None, :]
    keep = (pos < np.asarray(lens)[:, None]) & (pos >= np.asarray(starts)[:, None])
    return mx.array(keep[:, None, None, :])


def paged_prefill_attention_reference(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_table,
    prefix_len: int,
    chunk_len: int,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention for a chunk of ``chunk_len`` new tokens after ``prefix_len`` cached ones.

    q [1, H, chunk_len, D]. The chunk's own K/V must already be written to the pool at positions
    ``prefix_len .. prefix_len + chunk_len - 1`` of ``block_table`` ([n_blocks] int32). Query ``i``
    (position ``prefix_len + i``) sees keys ``j <= prefix_len + i`` (and ``j > prefix_len + i - window``).
    Returns [1, H, chunk_len, Dv]; ``sinks`` [H] or None as in the decode path.
    """
    # A Metal varlen prefill kernel (queries of several requests packed, pages read in place
    # instead of gathered) would replace this on Apple GPUs; pure MLX is fast enough for now.
    _check_window(window)
    if q.shape[0] != 1 or q.shape[2] != chunk_len:
        raise ValueError(f"q must be [1, heads, chunk_len={chunk_len}, D], got {tuple(q.shape)}")
    if prefix_len < 0 or chunk_len < 0:
        raise ValueError(f"prefix_len and chunk_len must be >= 0, got {prefix_len}, {chunk_len}")
    check_pools(q, k_pool, v_pool, sinks)
    if chunk_len == 0:
        return mx.zeros(output_shape(q, v_pool), dtype=q.dtype)
    block_size = k_pool.shape[2]
    sinks = fast_sinks(sinks, q.dtype)
    table = as_table(block_table).reshape(1, -1)
    total = prefix_len + chunk_len
    if total > table.shape[1] * block_size:
        raise ValueError(
            f"prefix {prefix_len} + chunk {chunk_len} tokens exceed the block table "
            f"capacity {table.shape[1] * block_size}"
        )
    first_key = max(0, prefix_len - window + 1) if window else 0
    first_block, last_block = first_key // block_size, -(-total // block_size)
    span = table[:, first_block:last_block]
    rows = page_rows(span, k_pool.shape, clip=False)  # every entry below ceil(total / BS) is valid
    keys, values = gather_pages(k_pool, rows), gather_pages(v_pool, rows)
    lo = first_block * block_size
    if window is None and lo == 0:
        # Bottom-right aligned causal mask: exact when the keys end at the chunk's last token.
        num_keys = total - lo
        if keys.shape[2] != num_keys:
            keys, values = keys[:, :, :num_keys], values[:, :, :num_keys]
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask="causal", sinks=sinks)
    qpos = np.arange(prefix_len, total)[:, None]
    kpos = np.arange(lo, last_block * block_size)[None, :]
    keep = (kpos <= qpos) & (kpos > qpos - window if window else True)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mx.array(keep), sinks=sinks)
