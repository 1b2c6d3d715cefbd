"""The attention part of a long prefill, apart from the matmuls, for `mlxpaged bench prefill`.

One layer's shapes of the model: the prompt's queries attend in `max_batch_tokens` chunks the way
the engine's prefill passes do (each chunk gathers its prefix from shuffled pages, then the routed
`eager_sdpa`), against the same chunks over contiguous K/V (what paging costs) and against one
`mx.fast.scaled_dot_product_attention` call over the whole context (contiguous SDPA). mx.fast
materialises the [heads, context, context] scores on the CPU, so sizes above 8192 are not timed.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.kernels.attention import eager_sdpa

import mlx.core as mx

MAX_CONTIGUOUS_CONTEXT = 8192  # 9 heads x 8192^2 float32 scores are 2.4 GB; 16k would be 9.7 GB


@dataclass(frozen=True)
class AttentionRow:
    """Seconds for one layer's attention over a `context`-token prefill."""

    context: int
    chunk: int
    paged_s: float  # chunks over pages (gather + sdpa), as the engine runs them
    contiguous_chunks_s: float  # the same chunks over contiguous K/V
    fast_sdpa_s: float  # one mx.fast SDPA call, causal, contiguous K/V

    def line(self) -> str:
        return (
            f"attention only, one layer, {self.context} tokens in {self.chunk}-token chunks: paged "
            f"{self.paged_s:.3f} s, same chunks contiguous {self.contiguous_chunks_s:.3f} s "
            f"({self.paged_s / self.contiguous_chunks_s:.2f}x), one contiguous mx.fast SDPA "
            f"{self.fast_sdpa_s:.3f} s (paged {self.paged_s / self.fast_sdpa_s:.2f}x of it)"
        )


def _seconds(fn, clock) -> float:
    start = clock()
    mx.eval(fn())
    return clock() - start


@dataclass(frozen=True)
class Inputs:
    """One layer's queries and K/V, contiguous and written to shuffled pages."""

    q: mx.array  # [1, heads, context, head_dim]
    k: mx.array  # [1, kv_heads, context, head_dim]
    v: mx.array
    kv: PagedKVCache  # one layer
    table: list[int]  # block ids in position order

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_inputs(context: int, heads: int, kv_heads: int, head_dim: int, block_size: int) -> Inputs:
    q = mx.random.normal((1, heads, context, head_dim), key=mx.random.key(0))
    k = mx.random.normal((1, kv_heads, context, head_dim), key=mx.random.key(1))
    v = mx.random.normal((1, kv_heads, context, head_dim), key=mx.random.key(2))
    num_blocks = -(-context // block_size)
    table = random.Random(0).sample(range(num_blocks), num_blocks)  # pages out of order, as in a used pool
    kv = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim)
    slots = [table[t // block_size] * block_size + t % block_size for t in range(context)]
    kv.write(0, slots, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))
    mx.eval(q, k, v, kv.keys, kv.values)
    return Inputs(q, k, v, kv, table)


def chunked_attention(x: Inputs, chunk: int, paged: bool) -> mx.array:
    """Causal attention of every query, `chunk` queries at a time over the keys up to the chunk's end:
    gathered from the pages (`paged`, as the cache view does) or sliced from contiguous K/V."""
    context, block_size = x.q.shape[2], x.kv.block_size
    outs = []
    for start in range(0, context, chunk):
        end = min(context, start + chunk)
        if paged:
            keys, values = x.kv.gather_blocks(0, mx.array([x.table[: -(-end // block_size)]], dtype=mx.int32))
            keys, values = keys[..., :end, :], values[..., :end, :]
        else:
            keys, values = x.k[..., :end, :], x.v[..., :end, :]
        outs.append(eager_sdpa(x.q[..., start:end, :], keys, values, x.scale, "causal"))
        mx.eval(outs[-1])  # one chunk at a time, as the engine's passes run
    return mx.concatenate(outs, axis=2)


def contiguous_sdpa(x: Inputs) -> mx.array:
    return mx.fast.scaled_dot_product_attention(x.q, x.k, x.v, scale=x.scale, mask="causal")


def measure_attention(
    context: int, chunk: int, heads: int, kv_heads: int, head_dim: int, block_size: int, clock=time.perf_counter
) -> AttentionRow:
    """Times of the three ways, one run each after one untimed call each (first-call compiles), by
    `clock` (wall or process CPU time)."""
    x = make_inputs(context, heads, kv_heads, head_dim, block_size)
    ways = (
        lambda: chunked_attention(x, chunk, paged=True),
        lambda: chunked_attention(x, chunk, paged=False),
        lambda: contiguous_sdpa(x),
    )
    for way in ways:
        mx.eval(way())
    paged, contiguous, fast = (_seconds(way, clock) for way in ways)
    return AttentionRow(context, chunk, paged, contiguous, fast)
