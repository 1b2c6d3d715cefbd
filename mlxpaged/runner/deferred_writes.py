"""Decode passes queued ahead on a GPU: their K/V stay off the page pools until nothing in flight reads them.

mlx-lm queues step N+1 (`mx.async_eval`) before it reads step N's token, so the GPU never waits for the
host to build and launch a step. A paged pass cannot simply do the same: MLX writes into a pool in place
only when no queued work still holds it (else it copies the whole buffer), and step N reads the pools until
it is done, so queuing N+1's writes while N runs would copy every pool on every step (reproduced on the CPU
backend: 23 -> 69 ms a step and peak memory +512 MiB for a 512 MiB pool, whenever N had not finished).

So a pass queued ahead writes nothing. Each layer attends its pages up to the last write and, after them, the
K/V of the tokens computed since (`PendingKV`, a few small arrays the runner holds) and its own new K/V, which
join the pending ones. The Metal kernel reads the pages in place and merges that tail as one more partition of
its two-pass reduce (kernels/attention.py `kernel_attention_with_tail`). Other paths keep each layer's K/V in one
buffer per run (decode_buffers.py, mlx-lm's KVCache and BatchKVCache layout): gathered from the pages once, then
each pass writes its tokens into the next column and attends the filled columns with MLX's fused attention (no
mask at batch 1). Where the buffers would not fit the memory the plan left spare, each pass gathers its pages and
puts the tail into the gathered copy instead. Pending K/V go into
their slots (`flush`) when nothing is in flight: when the pipeline stops (a step the look-ahead does not cover)
and every MAX_PENDING tokens (MAX_PENDING_BUFFERED when buffered), where the runner reads a step before queuing
the next (one wait per so many steps).
Rows that leave the run (finished, aborted, preempted) keep their pending K/V in the runner's queue until
then: their full blocks may be in the prefix cache, and they are written before any other pass reads them.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from mlxpaged.cache.kv_cache import PagedKVCache, Pool
from mlxpaged.kernels.attention import resolved_backend
from mlxpaged.runner import decode_buffers
from mlxpaged.runner.decode_buffers import Alignment

import mlx.core as mx

# Tokens a row may run ahead of the pools; every so many steps the pipeline waits once (a step's host time with
# the GPU idle) to write them. Gathered passes copy their pending tail into the gathered pages each step, so it
# stays short there; a buffer holds the tail already (it costs nothing per step), so the wait comes 8x rarer.
MAX_PENDING = 32
MAX_PENDING_BUFFERED = 256


@dataclass(frozen=True)
class PendingKV:
    """The K/V of each row's newest tokens not yet in the pools, and each row's slots for them (every row of a
    pipelined run advances together, so each row has `length` of them): per layer either the tail itself
    [B, KVH, R, D] (`tails`), or a buffer holding every key of the rows so far (`buffers`, decode_buffers.py),
    the tail being the `length` columns up to `alignment.column`."""

    request_ids: tuple[str, ...]
    slots: tuple[tuple[int, ...], ...]
    tails: tuple[tuple[mx.array, mx.array], ...] = ()
    buffers: tuple[tuple[mx.array, mx.array], ...] = ()
    alignment: Alignment | None = None

    @property
    def length(self) -> int:
        return len(self.slots[0]) if self.slots else 0

    def tail(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's pending K and V, [B, KVH, length, D]."""
        if self.buffers:
            assert self.alignment is not None  # set with the buffers
            k, v = self.buffers[layer]
            end = self.alignment.column + 1
            return k[..., end - self.length : end, :], v[..., end - self.length : end, :]
        return self.tails[layer]

    def select(self, request_ids: Sequence[str]) -> PendingKV | None:
        """The rows of these requests (in that order), or None when none of them has pending K/V."""
        index = {rid: i for i, rid in enumerate(self.request_ids)}
        rows = [index[rid] for rid in request_ids if rid in index]
        if not rows:
            return None
        if rows == list(range(len(self.request_ids))):
            return self  # the same rows: the buffers stay valid
        take = mx.array(rows, dtype=mx.int32)
        ids, slots = tuple(self.request_ids[i] for i in rows), tuple(self.slots[i] for i in rows)
        if self.buffers:  # the rows' buffers, without the leading columns none of them uses any more
            assert self.alignment is not None
            alignment, trim = self.alignment.select(rows)
            buffers = tuple((k[take][..., trim:, :], v[take][..., trim:, :]) for k, v in self.buffers)
            return PendingKV(ids, slots, buffers=buffers, alignment=alignment)
        return PendingKV(ids, slots, tails=tuple((k[take], v[take]) for k, v in self.tails))

    def without(self, request_ids: Collection[str]) -> PendingKV | None:
        """The rows of every other request."""
        gone = set(request_ids)
        return self.select([rid for rid in self.request_ids if rid not in gone])

    @property
    def num_layers(self) -> int:
        return len(self.buffers or self.tails)

    def flush(self, kv: PagedKVCache) -> None:
        """Write every pending token into its slot (lazily: the next pass evaluates the writes in place)."""
        slots = mx.array([s for row in self.slots for s in row], dtype=mx.int32)
        for layer in range(self.num_layers):
            k, v = self.tail(layer)
            kv.write(layer, slots, _token_major(k), _token_major(v))


def _token_major(x: mx.array) -> mx.array:
    """[B, KVH, R, D] -> [B * R, KVH, D], the pools' write layout."""
    batch, heads, length, dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch * length, heads, dim)


def defers_writes(kv: PagedKVCache) -> bool:
    """Pools this module can pipeline: one full-attention layer group of one geometry (K and V apart), stored
    in full precision, in the model's coordinates (no kv_transform). Not quantized pages: the pending tail and the
    batch-1 buffers would be full-precision K/V kept beside them, attended unlike what the pages will hold."""
    return kv.plain_full_attention and not kv.quantized and kv.transform is None


class DeferredPass:
    """What every layer of one queued-ahead decode pass shares, derived once per pass. `buffer_columns`: the row
    columns (one token of one row, every layer) its buffers may hold (decode_buffers.py; None: no limit); a pass
    whose buffers would not fit gathers its pages."""

    def __init__(
        self,
        kv: PagedKVCache,
        request_ids: Sequence[str],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        pending: PendingKV | None,
        buffer_columns: int | None = None,
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
        self._tables = [list(t[:n]) + [t[n - 1]] * (width - n) for t, n in zip(tables, needed, strict=True)]
        positions = [[start - held + i for i in range(held + 1)] for start in starts]  # the tail: pending + new
        self.slots = tuple(
            tuple(t[p // size] * size + p % size for p in row) for t, row in zip(tables, positions, strict=True)
        )
        self.offset: int | mx.array = starts[0] if self.batch == 1 else mx.array(list(starts))
        self.new_keys: list[mx.array | None] = [None] * kv.num_layers
        self.new_values: list[mx.array | None] = [None] * kv.num_layers
        self.buffers: list[tuple[mx.array, mx.array] | None] = [None] * kv.num_layers
        # Resolved once per pass, not per layer (an environment read each): the attention every layer takes.
        self.backend = resolved_backend()
        # The Metal kernel reads the pages in place: its layers get only their tail (no gather is built on the hot
        # path; routing.py gathers if the kernel declines a call), and no buffer is kept to pin the pools.
        self.on_kernel_path = self.backend == "kernel"
        # Buffers: the last pass's when these rows continue in them, else new ones right-aligned.
        carried = pending.alignment if pending is not None and pending.buffers else None
        self.alignment = carried.next() if carried is not None else Alignment.right_aligned(starts)
        if not self.alignment.holds(starts):
            raise RuntimeError(f"buffered rows at {list(starts)} are not where their buffers put them")
        self.capacity = decode_buffers.capacity_for(self.alignment.column)
        if pending is not None and pending.buffers:
            self.capacity = max(self.capacity, pending.buffers[0][0].shape[2])
        fits = buffer_columns is None or self.batch * self.capacity <= buffer_columns
        self.buffered = not self.on_kernel_path and fits
        if self.buffered:
            self.tail_index: mx.array | None = None
            self.mask = self.alignment.mask()
        elif self.batch == 1:  # gathered: exact keys, no mask
            self.tail_index, self.mask = None, None
        else:
            self.tail_index = mx.array(positions, dtype=mx.int32)[:, None, :, None]  # [B, 1, R + 1, 1]
            keys = mx.arange(width * size)[None, :]
            self.mask = (keys < mx.array(self.ends)[:, None])[:, None, None, :]  # [B, 1, 1, keys]

    @functools.cached_property
    def blocks(self) -> mx.array:
        """[B, blocks] each row's blocks, padded: built only when pages are read (a run's first buffered pass, the
        gathered passes, the kernel)."""
        return mx.array(self._tables, dtype=mx.int32)

    def attend_keys(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The layer's K/V to attend: buffered, the filled columns of its buffer with the new K/V written in;
        gathered, its pages with the pending and new K/V put in their places; on the kernel path only the tail
        (pending and new), which the kernel attends after the pages."""
        if self.buffered:
            return self._buffered(layer, keys, values)
        if self.pending is not None:
            pending_k, pending_v = self.pending.tail(layer)
            keys = mx.concatenate([pending_k, keys], axis=2)
            values = mx.concatenate([pending_v, values], axis=2)
        self.new_keys[layer], self.new_values[layer] = keys, values
        if self.on_kernel_path:
            return keys, values
        return self.gathered(layer)

    def gathered(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's pages gathered with the tail put in its places (the kernel's fallback, and passes whose
        buffers would not fit)."""
        keys, values = self.new_keys[layer], self.new_values[layer]
        if keys is None or values is None:
            raise RuntimeError("gathered() before this layer's update_and_fetch")
        k_pages, v_pages = self.kv.gather_blocks(layer, self.blocks)
        if self.tail_index is None:  # batch 1: exact keys, no mask
            lo, hi = self.written[0], self.ends[0]
            k_pages[..., lo:hi, :] = keys
            v_pages[..., lo:hi, :] = values
            return k_pages[..., :hi, :], v_pages[..., :hi, :]
        return (
            mx.put_along_axis(k_pages, self.tail_index, keys, axis=2),
            mx.put_along_axis(v_pages, self.tail_index, values, axis=2),
        )

    def _buffered(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new K/V [B, KVH, 1, D] into the layer's buffers at the run's column and attend every column up
        to it (under the alignment's mask, none when no row is padded)."""
        column = self.alignment.column
        k_buffer, v_buffer = self._buffer(layer)
        # Written through the very array object, as mlx-lm's caches do (MLX updates in place when nothing else
        # holds the buffer; a copy to a fresh object, `mx.array(k_buffer)`, would copy the whole buffer every pass).
        # The last pass's pending K/V hold the same object: they only ever read its columns before `column`.
        k_buffer[..., column : column + 1, :] = keys
        v_buffer[..., column : column + 1, :] = values
        self.buffers[layer] = (k_buffer, v_buffer)
        return k_buffer[..., : column + 1, :], v_buffer[..., : column + 1, :]

    def _buffer(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's buffers with room at the run's column: the last pass's (grown when full), or made from the
        pages and the pending tail at the start of a run."""
        pending = self.pending
        if pending is not None and pending.buffers:
            k, v = pending.buffers[layer]
            if k.shape[2] < self.capacity:
                k, v = decode_buffers.grown(k, self.capacity), decode_buffers.grown(v, self.capacity)
            return k, v
        k_pages, v_pages = self.kv.gather_blocks(layer, self.blocks)
        tail_k, tail_v = pending.tail(layer) if pending is not None else (None, None)
        return (
            decode_buffers.from_pages(k_pages, self.alignment, tail_k, self.capacity),
            decode_buffers.from_pages(v_pages, self.alignment, tail_v, self.capacity),
        )

    def pending_after(self) -> PendingKV:
        """The pending K/V once this pass is adopted: the old ones and this pass's new token."""
        if self.buffered:
            buffers = tuple(b for b in self.buffers if b is not None)
            if len(buffers) < len(self.buffers):
                raise RuntimeError("a deferred pass was read before every layer attended")
            return PendingKV(self.request_ids, self.slots, buffers=buffers, alignment=self.alignment)
        keys = tuple(k for k in self.new_keys if k is not None)
        values = tuple(v for v in self.new_values if v is not None)
        if len(keys) < len(self.new_keys) or len(values) < len(self.new_values):
            raise RuntimeError("a deferred pass was read before every layer attended")
        return PendingKV(self.request_ids, self.slots, tails=tuple(zip(keys, values, strict=True)))


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

    @property
    def backend(self) -> str:
        """The attention backend of the whole pass (kernels/attention.py `resolved_backend`, read once)."""
        return self._shared.backend

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
    buffer_columns: int | None = None,
) -> tuple[list[DeferredView], DeferredPass]:
    """Views for every layer of a pass of one new token per row at `starts`, over `tables` (group 0's),
    with `pending` K/V for the same rows in the same order; and the pass, whose `pending_after` is read
    once the model has run."""
    if pending is not None and pending.request_ids != tuple(request_ids):
        raise ValueError(f"pending K/V of rows {pending.request_ids} for a pass of rows {tuple(request_ids)}")
    shared = DeferredPass(kv, request_ids, starts, tables, pending, buffer_columns)
    return [DeferredView(shared, layer) for layer in range(kv.num_layers)], shared
