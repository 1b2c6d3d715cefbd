"""Decode passes queued ahead on a GPU: their K/V stay off the page pools until nothing in flight reads them.

mlx-lm queues step N+1 (`mx.async_eval`) before it reads step N's token, so the GPU never waits for the
host to build and launch a step. A paged pass cannot simply do the same: MLX writes into a pool in place
only when no queued work still holds it (else it copies the whole buffer), and step N reads the pools until
it is done, so queuing N+1's writes while N runs would copy every pool on every step (reproduced on the CPU
backend: 23 -> 69 ms a step and peak memory +512 MiB for a 512 MiB pool, whenever N had not finished).

So a pass queued ahead writes nothing. Each layer attends its pages up to the last write and, after them, the
K/V of the tokens computed since (`PendingKV`, a few small arrays the runner holds) and its own new K/V, which
join the pending ones. The Metal kernel reads the pages in place and merges that tail as one more partition of
its two-pass reduce (kernels/attention.py `kernel_attention_with_tail`); other paths gather the pages, put the
tail into the gathered copy and attend it with MLX's fused attention (no mask at batch 1). Pending K/V go into
their slots (`flush`) when nothing is in flight: when the pipeline stops (a step the look-ahead does not cover)
and every MAX_PENDING tokens, where the runner reads a step before queuing the next (one wait per MAX_PENDING steps).
Rows that leave the run (finished, aborted, preempted) keep their pending K/V in the runner's queue until
then: their full blocks may be in the prefix cache, and they are written before any other pass reads them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from mlxpaged.cache.kv_cache import PagedKVCache, Pool
from mlxpaged.kernels.attention import resolved_backend

import mlx.core as mx

# Tokens a row may run ahead of the pools. Each step puts them into the gathered pages (small next to the
# gather), and every MAX_PENDING steps the pipeline waits once to write them. Not measured on a GPU yet.
MAX_PENDING = 32


@dataclass(frozen=True)
class PendingKV:
    """The K/V of each row's newest tokens not yet in the pools: per layer [B, KVH, R, D], R tokens per row
    (every row of a pipelined run advances together), and each row's R slots."""

    request_ids: tuple[str, ...]
    keys: tuple[mx.array, ...]
    values: tuple[mx.array, ...]
    slots: tuple[tuple[int, ...], ...]
    # Batch 1: each layer's K and V already in the pools, gathered once per run of queued passes (the next
    # pass reuses them instead of gathering its pages again: as many ops per layer as mlx-lm's step).
    prefix: tuple[tuple[mx.array, mx.array], ...] | None = None

    @property
    def length(self) -> int:
        return len(self.slots[0]) if self.slots else 0

    def select(self, request_ids: Sequence[str]) -> PendingKV | None:
        """The rows of these requests (in that order), or None when none of them has pending K/V."""
        index = {rid: i for i, rid in enumerate(self.request_ids)}
        rows = [index[rid] for rid in request_ids if rid in index]
        if not rows:
            return None
        if rows == list(range(len(self.request_ids))):
            return self  # the same rows: the gathered prefix stays valid
        take = mx.array(rows, dtype=mx.int32)
        return PendingKV(
            tuple(self.request_ids[i] for i in rows),
            tuple(k[take] for k in self.keys),
            tuple(v[take] for v in self.values),
            tuple(self.slots[i] for i in rows),
        )

    def without(self, request_ids: Collection[str]) -> PendingKV | None:
        """The rows of every other request."""
        gone = set(request_ids)
        return self.select([rid for rid in self.request_ids if rid not in gone])

    def flush(self, kv: PagedKVCache) -> None:
        """Write every pending token into its slot (lazily: the next pass evaluates the writes in place)."""
        slots = mx.array([s for row in self.slots for s in row], dtype=mx.int32)
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            kv.write(layer, slots, _token_major(k), _token_major(v))


def _token_major(x: mx.array) -> mx.array:
    """[B, KVH, R, D] -> [B * R, KVH, D], the pools' write layout."""
    batch, heads, length, dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch * length, heads, dim)


def defers_writes(kv: PagedKVCache) -> bool:
    """Pools this module can pipeline: one full-attention layer group of one geometry (K and V apart), stored
    in full precision, in the model's coordinates (no kv_transform). Not quantized pages: the pending tail and the
    batch-1 gathered prefix would be full-precision K/V kept beside them, attended unlike what the pages will hold."""
    return kv.plain_full_attention and not kv.quantized and kv.transform is None


class DeferredPass:
    """What every layer of one queued-ahead decode pass shares, derived once per pass."""

    def __init__(
        self,
        kv: PagedKVCache,
        request_ids: Sequence[str],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        pending: PendingKV | None,
    ):
        size = kv.block_size
        held = pending.length if pending is not None else 0
        self.kv, self.pending, self.request_ids = kv, pending, tuple(request_ids)
        self.batch = len(starts)
        self.ends = [start + 1 for start in starts]  # keys per row, the new token's included
        self.written = tuple(start - held for start in starts)  # keys per row already in the pools
        needed = [-(-end // size) for end in self.ends]
        for table, n in zip(tables, needed, strict=True):
            if len(table) < n:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {n * size} tokens")
        width = max(needed)
        # Padding repeats a valid block so the gather stays inside the pool; those keys are masked out.
        self.blocks = mx.array(
            [list(t[:n]) + [t[n - 1]] * (width - n) for t, n in zip(tables, needed, strict=True)], dtype=mx.int32
        )
        positions = [[start - held + i for i in range(held + 1)] for start in starts]  # the tail: pending + new
        self.slots = tuple(
            tuple(t[p // size] * size + p % size for p in row) for t, row in zip(tables, positions, strict=True)
        )
        if self.batch == 1:
            self.offset: int | mx.array = starts[0]
            self.tail_start: int | None = starts[0] - held
            self.tail_index: mx.array | None = None
            self.mask: mx.array | None = None
        else:
            self.offset = mx.array(list(starts))
            self.tail_start = None
            self.tail_index = mx.array(positions, dtype=mx.int32)[:, None, :, None]  # [B, 1, R + 1, 1]
            keys = mx.arange(width * size)[None, :]
            self.mask = (keys < mx.array(self.ends)[:, None])[:, None, None, :]  # [B, 1, 1, keys]
        self.new_keys: list[mx.array | None] = [None] * kv.num_layers
        self.new_values: list[mx.array | None] = [None] * kv.num_layers
        self.prefix: list[tuple[mx.array, mx.array] | None] = [None] * kv.num_layers
        # The Metal kernel reads the pages in place: its layers get only their tail (no gather is built on the hot
        # path; routing.py gathers if the kernel declines a call), and no gathered prefix is kept to pin the pools.
        self.on_kernel_path = resolved_backend() == "kernel"
        self.keeps_prefix = self.batch == 1 and not self.on_kernel_path

    def attend_keys(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The layer's K/V to attend: its pages with the pending and new K/V put in their places; on the kernel
        path only the tail (pending and new), which the kernel attends after the pages."""
        if self.pending is not None:
            keys = mx.concatenate([self.pending.keys[layer], keys], axis=2)
            values = mx.concatenate([self.pending.values[layer], values], axis=2)
        self.new_keys[layer], self.new_values[layer] = keys, values
        if self.on_kernel_path:
            return keys, values
        if self.keeps_prefix:  # exact keys, no mask: MLX's fused decode attention takes this
            prefix = self._prefix(layer)
            return mx.concatenate([prefix[0], keys], axis=2), mx.concatenate([prefix[1], values], axis=2)
        return self.gathered(layer)

    def gathered(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's pages gathered with the tail put in its places (the kernel's fallback, and batch > 1)."""
        keys, values = self.new_keys[layer], self.new_values[layer]
        if keys is None or values is None:
            raise RuntimeError("gathered() before this layer's update_and_fetch")
        k_pages, v_pages = self.kv.gather_blocks(layer, self.blocks)
        if self.tail_index is None:  # batch 1: exact keys, no mask
            lo, hi = self.tail_start, self.ends[0]
            k_pages[..., lo:hi, :] = keys
            v_pages[..., lo:hi, :] = values
            return k_pages[..., :hi, :], v_pages[..., :hi, :]
        return (
            mx.put_along_axis(k_pages, self.tail_index, keys, axis=2),
            mx.put_along_axis(v_pages, self.tail_index, values, axis=2),
        )

    def _prefix(self, layer: int) -> tuple[mx.array, mx.array]:
        """Batch 1: the layer's keys and values already in the pools, from the last pass or gathered now."""
        if self.pending is not None and self.pending.prefix is not None:
            prefix = self.pending.prefix[layer]
        else:
            k_pages, v_pages = self.kv.gather_blocks(layer, self.blocks)
            prefix = k_pages[..., : self.tail_start, :], v_pages[..., : self.tail_start, :]
        self.prefix[layer] = prefix
        return prefix

    def pending_after(self) -> PendingKV:
        """The pending K/V once this pass is adopted: the old ones and this pass's new token."""
        keys = tuple(k for k in self.new_keys if k is not None)
        values = tuple(v for v in self.new_values if v is not None)
        if len(keys) < len(self.new_keys) or len(values) < len(self.new_values):
            raise RuntimeError("a deferred pass was read before every layer attended")
        prefixes = tuple(p for p in self.prefix if p is not None)
        prefix = prefixes if self.keeps_prefix and len(prefixes) == len(self.prefix) else None
        return PendingKV(self.request_ids, keys, values, self.slots, prefix)


class DeferredView:
    """The cache an mlx-lm attention layer sees in a decode pass queued ahead (one token per row)."""

    def __init__(self, shared: DeferredPass, layer: int):
        self._shared, self._layer = shared, layer
        self._returned: tuple[mx.array, mx.array] | None = None

    def returned(self, keys: mx.array, values: mx.array) -> bool:
        """True when `keys` and `values` are what `update_and_fetch` returned (routing.py)."""
        return self._returned is not None and keys is self._returned[0] and values is self._returned[1]

    def made_mask(self, mask) -> bool:
        return mask is self._shared.mask

    @property
    def on_kernel_path(self) -> bool:
        """True when `update_and_fetch` returned only the tail, for the Metal kernel (routing.py)."""
        return self._shared.on_kernel_path

    def gathered(self) -> tuple[mx.array, mx.array]:
        """This layer's keys and values gathered from the pages, the tail included (the kernel declined)."""
        return self._shared.gathered(self._layer)

    def kernel_inputs(self) -> tuple[Pool, Pool, mx.array, tuple[int, ...], mx.array, mx.array]:
        """(k_pool, v_pool, block tables, keys already in the pools per row, tail K, tail V) for
        kernels/attention.py `kernel_attention_with_tail`, after `update_and_fetch`."""
        s, j = self._shared, self._layer
        tail_k, tail_v = s.new_keys[j], s.new_values[j]
        if tail_k is None or tail_v is None:
            raise RuntimeError("kernel_inputs() before this layer's update_and_fetch")
        return (s.kv.key_pool(j), s.kv.value_pool(j), s.blocks, s.written, tail_k, tail_v)

    @property
    def offset(self) -> int | mx.array:
        return self._shared.offset

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != 1 or window_size is not None:
            raise ValueError(
                f"a deferred decode pass takes one token per row on full attention, got N={N}, window {window_size}"
            )
        return self._shared.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = self._shared.attend_keys(self._layer, keys, values)
        self._returned = out
        return out


def deferred_views(
    kv: PagedKVCache,
    request_ids: Sequence[str],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
    pending: PendingKV | None,
) -> tuple[list[DeferredView], DeferredPass]:
    """Views for every layer of a pass of one new token per row at `starts`, over `tables` (group 0's),
    with `pending` K/V for the same rows in the same order; and the pass, whose `pending_after` is read
    once the model has run."""
    if pending is not None and pending.request_ids != tuple(request_ids):
        raise ValueError(f"pending K/V of rows {pending.request_ids} for a pass of rows {tuple(request_ids)}")
    shared = DeferredPass(kv, request_ids, starts, tables, pending)
    return [DeferredView(shared, layer) for layer in range(kv.num_layers)], shared
