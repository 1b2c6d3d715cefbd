"""Prefill attention on MLX's CPU backend, computed by NumPy.

On the CPU backend MLX runs elementwise ops and reductions scalar and on one thread: the softmax's
exp costs ~2.5 ns per score even as the compiled polynomial in cpu_attention.py, its row max and
sum ~0.5 ns. NumPy's are SIMD (AVX2 / AVX-512 / NEON): np.exp takes ~0.5 ns per float32 score here.
So an eager prefill chunk's attention is computed in NumPy: per (sequence, KV head, query block)
the scores through BLAS, the softmax in place, the weighted values through BLAS, on one worker
thread per core with every BLAS single-threaded meanwhile (the workers are the parallelism; two
threads inside each small matmul measured slower). Measured, one SmolLM2 layer, the last 2048-token
chunk of an 8k prompt: cpu_attention.attend 0.72 s, this 0.19 s.

Two entry points, both checked against the NumPy float64 oracle (tests/kernels/test_numpy_attention.py):

- ``attend_numpy``: over contiguous K/V (what a cache view gathered), with cpu_attention.attend's
  contract (mx.fast.scaled_dot_product_attention's): GQA folded, bottom-right causal blocks that read
  only the keys they can see, boolean or additive masks, sinks.
- ``attend_pages_numpy``: one sequence's chunk read from the page pools in place, key tile by key
  tile, the tiles split across the workers when there are few queries (a cache hit's new tokens over
  a long context would otherwise keep one core busy and copy the whole context first).

Both evaluate their inputs (a sync) and return a fresh array, so they cannot run inside
``mx.compile``: only eager passes call them (routing.py), and only above MIN_SCORES, where the sync
is noise next to the arithmetic.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from threadpoolctl import ThreadpoolController

# Below this many scores (batch x query heads x queries x keys) MLX's attention is about as fast and
# needs no sync. Measured, 9 query / 3 KV heads, causal, NumPy vs cpu_attention.attend: 8 x 64 keys
# 0.83x, 16 x 256 1.02x, 32 x 512 1.02x (147k scores), 8 x 2048 1.33x, 128 x 1024 1.52x, 2048 x 8192 3.7x.
MIN_SCORES = 1 << 18

# Query rows per block: the masked triangle a block computes is QUERY_BLOCK^2 / 2 per head.
QUERY_BLOCK = 64

_MASKED = np.float32(-1e30)  # finite, as in cpu_attention: a fully masked row gets garbage, not NaN

_workers: ThreadPoolExecutor | None = None
_blas: ThreadpoolController | None = None


def worker_count() -> int:
    """Cores this process may run on (each worker keeps one busy)."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return max(1, min(len(cores), 16))


def _forget_workers() -> None:
    """A forked child has none of the parent's threads: it starts its own pool on first use."""
    global _workers
    _workers = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _pool() -> tuple[ThreadPoolExecutor, ThreadpoolController]:
    global _workers, _blas
    if _workers is None:
        _workers = ThreadPoolExecutor(worker_count(), thread_name_prefix="mlxpaged-attention")
        _blas = ThreadpoolController()
    return _workers, _blas


_one_at_a_time = threading.Lock()


def _run(job, args: list) -> list:
    """``job`` over ``args`` on the workers, every BLAS single-threaded meanwhile; results in order.
    One call at a time (engines in one process share the cores anyway): overlapping limits would
    restore each other's thread counts out of order and leave BLAS single-threaded for good."""
    with _one_at_a_time:
        workers, blas = _pool()
        with blas.limit(limits=1, user_api="blas"):
            return list(workers.map(job, args))


def numpy_attention_applies(q: mx.array, k: mx.array, mask) -> bool:
    """True when ``attend_numpy`` takes this call: big enough, GQA-shaped, causal only with at least
    as many keys as queries (every query sees a key)."""
    batch, heads, length, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    if heads % kv_heads or batch * heads * length * keys < MIN_SCORES:
        return False
    if isinstance(mask, str):
        return mask == "causal" and keys >= length
    return True


def attend_numpy(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None, sinks: mx.array | None = None
) -> mx.array:
    """What ``cpu_attention.attend(q, k, v, scale, mask, sinks)`` returns, computed by NumPy.

    q [B, H, L, Dk]; k [B, KVH, K, Dk], v [B, KVH, K, Dv]; mask None, "causal" (bottom-right) or an
    array (boolean, True = attend, or additive) broadcastable to [B, H, L, K]; sinks [H] or None.
    """
    f32 = mx.float32
    q32, k32, v32 = (x if x.dtype == f32 else x.astype(f32) for x in (q, k, v))
    if isinstance(mask, mx.array) and mask.dtype not in (mx.bool_, f32):
        mask = mask.astype(f32)  # NumPy has no bfloat16 (deepseek-style models add scores in the model's dtype)
    arrays = [q32, k32, v32] + ([mask] if isinstance(mask, mx.array) else []) + ([sinks] if sinks is not None else [])
    mx.eval(*arrays)
    qn, kn, vn = np.asarray(q32), np.asarray(k32), np.asarray(v32)  # views of MLX's buffers, no copy
    causal = isinstance(mask, str)
    additive = None if causal or mask is None else _additive_mask(np.asarray(mask))
    sink = None if sinks is None else np.asarray(sinks.astype(f32) if sinks.dtype != f32 else sinks)
    batch, heads, length, _ = qn.shape
    kv_heads = kn.shape[1]
    out = np.empty((batch, heads, length, vn.shape[-1]), np.float32)
    block = _Block(qn, kn, vn, out, np.float32(scale), causal, additive, sink)
    jobs = [(b, h, i) for i in reversed(range(0, length, QUERY_BLOCK)) for b in range(batch) for h in range(kv_heads)]
    _run(block.run, jobs)
    result = mx.array(out)
    return result if q.dtype == f32 else result.astype(q.dtype)


def _additive_mask(mask: np.ndarray) -> np.ndarray:
    """A 4-D float32 additive mask (0 = attend) from a boolean or additive one."""
    mask = np.where(mask, np.float32(0), _MASKED) if mask.dtype == np.bool_ else mask.astype(np.float32, copy=False)
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


class _Block:
    """One job: a KV head's G query heads x one block of queries, written into ``out``."""

    def __init__(self, q, k, v, out, scale, causal, additive, sinks):
        self.q, self.k, self.v, self.out, self.scale = q, k, v, out, scale
        self.causal, self.additive, self.sinks = causal, additive, sinks
        self.group = q.shape[1] // k.shape[1]

    def run(self, job: tuple[int, int, int]) -> None:
        b, h, i = job
        q, k, g = self.q, self.k, self.group
        length, keys, dim = q.shape[2], k.shape[2], q.shape[3]
        j = min(length, i + QUERY_BLOCK)
        n, heads = j - i, slice(h * g, (h + 1) * g)
        end = keys - length + j if self.causal else keys  # the last key query j - 1 sees, plus one
        rows = (q[b, heads, i:j] * self.scale).reshape(g * n, dim)
        scores = rows @ k[b, h, :end].T  # [G * n, end]
        folded = scores.reshape(g, n, end)
        if self.causal and n > 1:  # the diagonal block: query i + r sees keys up to end - n + r
            folded[:, :, end - n :] += _upper_triangle(n)
        elif self.additive is not None:
            folded += self._mask_rows(b, heads, i, j)
        row_max = folded.max(axis=2, keepdims=True)
        sink = None if self.sinks is None else self.sinks[heads].reshape(g, 1, 1)
        if sink is not None:
            np.maximum(row_max, sink, out=row_max)
        np.subtract(folded, row_max, out=folded)
        np.exp(scores, out=scores)
        total = folded.sum(axis=2, keepdims=True)
        if sink is not None:
            total += np.exp(sink - row_max)
        weighted = (scores @ self.v[b, h, :end]).reshape(g, n, -1)
        np.divide(weighted, total, out=self.out[b, heads, i:j])

    def _mask_rows(self, b: int, heads: slice, i: int, j: int) -> np.ndarray:
        mask = self.additive
        mask = mask[b if mask.shape[0] > 1 else 0]
        mask = mask[heads] if mask.shape[0] > 1 else mask
        return mask[:, i:j] if mask.shape[1] > 1 else mask


_TRIANGLES: dict[int, np.ndarray] = {}


def _upper_triangle(n: int) -> np.ndarray:
    """[n, n] additive mask hiding key c > query r (cached: one per block length)."""
    tri = _TRIANGLES.get(n)
    if tri is None:
        tri = np.where(np.arange(n)[:, None] >= np.arange(n)[None, :], np.float32(0), _MASKED)
        _TRIANGLES[n] = tri
    return tri


# --- pages read in place ------------------------------------------------------------------------

# Keys per tile: a tile's K and V pages are copied next to each other (np.take of whole pages, from
# wherever they lie in the pool) into small buffers that are read back while still cached, instead of
# a gathered copy of the whole context (25 MB per layer at 16k) written and read again. Measured,
# 8 queries over 16k keys: tiles of 512 keys 6.0 ms, 1024 4.1, 2048 3.5, 4096 3.4 (fewer Python steps).
KEY_TILE = 4096


def pages_in_place_apply(q: mx.array, context: int) -> bool:
    """True when a batch-1 chunk is faster read from the pages in place than over gathered K/V: at most
    one query block (a cache hit's or a short turn's new tokens; measured, 8 queries over 16k keys:
    4.1 ms against 5.6 gathered; from 128 queries on the gathered path is as fast or faster), and enough
    scores to pay for the sync."""
    heads, length = q.shape[1], q.shape[2]
    return length <= QUERY_BLOCK and heads * length * context >= MIN_SCORES


def attend_pages_numpy(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, table, context: int, scale: float, sinks: mx.array | None = None
) -> mx.array:
    """Causal attention of one sequence's last ``L`` positions of ``context`` over its pages.

    q [1, H, L, Dk] (positions context - L .. context - 1); k_pool [NB, KVH, BS, Dk], v_pool [NB, KVH, BS, Dv]
    float32 with the chunk's own K/V already written; ``table`` the sequence's block ids in position
    order (at least ceil(context / BS)); sinks [H] or None. Returns [1, H, L, Dv] in q's dtype.
    """
    f32 = mx.float32
    q32 = q if q.dtype == f32 else q.astype(f32)
    mx.eval(q32, k_pool, v_pool, *([sinks] if sinks is not None else []))
    qn, kp, vp = np.asarray(q32), np.asarray(k_pool), np.asarray(v_pool)
    block_size = kp.shape[2]
    pages = np.asarray(table if isinstance(table, (list, tuple)) else np.asarray(table), dtype=np.intp)
    pages = pages.reshape(-1)[: -(-context // block_size)]
    if pages.size * block_size < context or not 1 <= qn.shape[2] <= context:
        raise ValueError(
            f"{qn.shape[2]} queries ending at position {context} need {-(-context // block_size)} "
            f"blocks of {block_size}; the table has {pages.size}"
        )
    sink = None if sinks is None else np.asarray(sinks.astype(f32) if sinks.dtype != f32 else sinks)
    heads, length = qn.shape[1], qn.shape[2]
    kv_heads = kp.shape[1]
    out = np.empty((1, heads, length, vp.shape[-1]), np.float32)
    job = _PagedBlock(qn[0], kp, vp, pages, context, np.float32(scale))
    blocks = [(h, i) for i in reversed(range(0, length, QUERY_BLOCK)) for h in range(kv_heads)]
    # Few query blocks (a cache hit's handful of new tokens): split their keys so every worker is busy.
    splits = max(1, min(-(-2 * worker_count() // len(blocks)), -(-context // KEY_TILE)))
    parts = _run(job.run, [(h, i, s, splits) for h, i in blocks for s in range(splits)])
    group = heads // kv_heads
    for n, (h, i) in enumerate(blocks):
        j = min(length, i + QUERY_BLOCK)
        merged = _merge(
            parts[n * splits : (n + 1) * splits], None if sink is None else sink[h * group : (h + 1) * group]
        )
        out[0, h * group : (h + 1) * group, i:j] = merged.reshape(group, j - i, -1)
    result = mx.array(out)
    return result if q.dtype == f32 else result.astype(q.dtype)


def _merge(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], sinks: np.ndarray | None) -> np.ndarray:
    """Normalised output of a query block from its key splits' (max, sum, weighted values)."""
    top = np.max([m for m, _, _ in parts], axis=0)  # [G * n, 1]
    if sinks is not None:  # one sink logit per query head: rows are [G, n] folded
        sink = np.repeat(sinks, top.shape[0] // sinks.shape[0]).reshape(-1, 1)
        top = np.maximum(top, sink)
    total = np.zeros_like(top)
    values = np.zeros_like(parts[0][2])
    for m, s, o in parts:
        weight = np.exp(m - top)
        total += s * weight
        values += o * weight
    if sinks is not None:
        total += np.exp(sink - top)
    return values / total


class _PagedBlock:
    """One job: a KV head's G query heads x one query block x one split of its visible keys, tile by
    tile with a running max (online softmax); returns (max, sum, unnormalised values) per row."""

    def __init__(self, q, k_pool, v_pool, pages, context, scale):
        self.q, self.k_pool, self.v_pool, self.pages = q, k_pool, v_pool, pages
        self.context, self.scale = context, scale
        self.group = q.shape[0] // k_pool.shape[1]

    def run(self, job: tuple[int, int, int, int]):
        h, i, split, splits = job
        q, g, block_size = self.q, self.group, self.k_pool.shape[2]
        length, dim = q.shape[1], q.shape[2]
        j = min(length, i + QUERY_BLOCK)
        n, first = j - i, self.context - length + i  # rows, position of the block's first query
        end = first + n  # keys the block's last query sees
        tiles = -(-end // KEY_TILE)
        lo, hi = tiles * split // splits, tiles * (split + 1) // splits
        rows = (q[h * g : (h + 1) * g, i:j] * self.scale).reshape(g * n, dim)
        top = np.full((g * n, 1), -np.inf, np.float32)
        total = np.zeros((g * n, 1), np.float32)
        values = np.zeros((g * n, self.v_pool.shape[-1]), np.float32)
        for t in range(lo, hi):
            start, stop = t * KEY_TILE, min(end, (t + 1) * KEY_TILE)
            ids = self.pages[start // block_size : -(-stop // block_size)]
            skip = start - start // block_size * block_size
            keys = self._tile(self.k_pool, ids, h)[skip : skip + stop - start]
            vals = self._tile(self.v_pool, ids, h)[skip : skip + stop - start]
            scores = rows @ keys.T  # [G * n, tile]
            if stop > first + 1:  # keys past the block's first query: hide each row's future
                scores.reshape(g, n, -1)[:] += _future_mask(first, n, start, stop)
            tile_top = np.maximum(top, scores.max(axis=1, keepdims=True))
            rescale = np.exp(top - tile_top)
            np.subtract(scores, tile_top, out=scores)
            np.exp(scores, out=scores)
            total = total * rescale + scores.sum(axis=1, keepdims=True)
            values = values * rescale + scores @ vals
            top = tile_top
        return top, total, values

    @staticmethod
    def _tile(pool: np.ndarray, ids: np.ndarray, head: int) -> np.ndarray:
        """Head ``head``'s pages ``ids`` end to end, [len(ids) * BS, D]. The pool is taken as its
        contiguous [NB * KVH, BS, D] view (np.take would copy a strided ``pool[:, head]`` whole)."""
        blocks, kv_heads, block_size, dim = pool.shape
        return np.take(pool.reshape(blocks * kv_heads, block_size, dim), ids * kv_heads + head, axis=0).reshape(-1, dim)


def _future_mask(first: int, n: int, start: int, stop: int) -> np.ndarray:
    """[n, stop - start] additive: row r (position first + r) hides keys at positions > first + r."""
    return np.where(np.arange(start, stop)[None, :] > np.arange(first, first + n)[:, None], _MASKED, np.float32(0))
