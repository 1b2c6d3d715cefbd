"""The per-layer cache an unmodified mlx-lm model attends through, backed by page pools.

mlx-lm attention layers do `rope(x, offset=cache.offset)`, then
`keys, values = cache.update_and_fetch(keys, values)`, then SDPA with a mask the
model got once per attention type from `cache.make_mask(N, window_size=...)`
(`mlx_lm.models.base.create_attention_mask`). `PagedCacheView` implements those
with the same semantics as mlx-lm's `KVCache` / `RotatingKVCache` (offsets advance
inside `update_and_fetch`), so `model(tokens, cache=views)` runs on paged memory
with the reference attention path: new K/V go into pages through the slot mapping,
and the K/V returned for attention are gathered back from the pages.

Batches. Batch 1: `offset` is an int and masks are mlx-lm's own (None, "causal" or
an array). Ragged batch B > 1: feed tokens right-padded to `[B, L]`, with
`offsets[b]` tokens already cached and `num_new[b] <= L` real tokens per row;
`offset` is then an `mx.array` of shape [B] (mlx-lm's batched RoPE), padding tokens
are neither written nor attended, and `make_mask` returns a boolean
`[B, 1, L, K]` array. Logits of sequence b are at row `num_new[b] - 1`; padding
rows hold finite garbage.

Sliding-window layers read the positions [offset - window + 1, end) from their
ring of ceil(window / block_size) + 1 blocks. A chunk too long for the ring to
hold both the old window and the new tokens (more than about block_size + 1 new
tokens) takes the transformers route: the old window is read from pages first
(and evaluated, so the write stays in place), the new keys are attended as given,
and only the tail that stays in the window is written.

Block tables are plain lists, one per sequence per layer group
(`block_tables[b][group.index]`), fully allocated for this pass before the model
runs; the views keep references, so an engine may append blocks between passes.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.cache.kv_cache import KVCacheSpec, LayerGroup, PagedKVCache, Pool
from mlxpaged.cache.kv_transform import KVTransform
from mlxpaged.cache.quantized_pages import pool_arrays

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask


def _routable(plan: _Plan, spec: KVCacheSpec) -> bool:
    """One new token per sequence on a layer that reads every key: the paged decode kernel's case."""
    return plan.length == 1 and not plan.split and spec.window is None


def paged_views(
    kv_cache: PagedKVCache,
    block_tables: Sequence[Sequence[list[int]]],
    offsets: Sequence[int] | None = None,
    num_new: Sequence[int] | None = None,
    both_ways: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> list[PagedCacheView]:
    """Views for every layer; `block_tables[b][g]` is sequence b's table for group g.

    `offsets[b]`: tokens already cached (default 0). `num_new[b]`: real tokens of row b
    in the next pass only (default: every row is full); later passes treat rows as full.
    `both_ways[b]`: spans [start, end) of positions of row b whose tokens attend each other both ways in the
    next pass (an image of Gemma 4's larger models, PaliGemma's prompt: engine/request.py Request.both_ways; each
    span's new tokens all in this pass), on top of the causal (or windowed) mask.
    """
    batch = len(block_tables)
    offsets = list(offsets) if offsets is not None else [0] * batch
    if batch < 1 or len(offsets) != batch or any(o < 0 for o in offsets):
        raise ValueError(f"{batch} block tables need as many non-negative offsets, got {offsets}")
    if any(len(tables) != len(kv_cache.groups) for tables in block_tables):
        raise ValueError(f"each sequence needs {len(kv_cache.groups)} block tables, one per layer group")
    if num_new is not None and (len(num_new) != batch or any(n < 1 for n in num_new)):
        raise ValueError(f"num_new {list(num_new)} must hold {batch} counts of at least 1")
    if both_ways is not None and len(both_ways) != batch:
        raise ValueError(f"both_ways needs one list of spans per sequence ({batch}), got {len(both_ways)}")
    spans = tuple(tuple(row) for row in both_ways) if both_ways is not None and any(both_ways) else None
    planners = [
        _GroupPlanner(kv_cache, g, [tables[g.index] for tables in block_tables], spans) for g in kv_cache.groups
    ]
    return [
        PagedCacheView(kv_cache, layer, planners[kv_cache.group_of(layer).index], offsets, num_new)
        for layer in range(kv_cache.num_layers)
    ]


@dataclass(frozen=True)
class _Plan:
    """Where one group's layers write and read in one pass; shared by the group's views."""

    exact: bool  # batch 1, full rows: keys are returned as exactly positions [key_start, end)
    split: bool  # old window read before the write, new keys attended as given
    write_slots: mx.array  # [T]
    write_rows: mx.array | None  # [T] rows of the flattened [B * L] new tokens; None: all, in order
    write_run: tuple[int, int] | None  # (block, offset): one sequence's new tokens fill one run of one block
    read_blocks: mx.array | None  # [B, n] blocks in position order; None: nothing to read
    offsets: tuple[int, ...]
    num_new: tuple[int, ...]
    key_starts: tuple[int, ...]
    read_ends: tuple[int, ...]  # one tuple per pass: per-layer consumers memoize on it
    bases: tuple[int, ...]  # position of the first gathered key per sequence
    length: int  # L, new tokens per row including padding
    page_tokens: int  # keys gathered from pages per sequence (n * block_size)


def _build_plan(
    group: LayerGroup,
    spec: KVCacheSpec,
    tables: list[list[int]],
    offsets: Sequence[int],
    num_new: Sequence[int],
    length: int,
) -> _Plan:
    block_size = spec.block_size
    ends = [o + n for o, n in zip(offsets, num_new, strict=True)]
    for table, end in zip(tables, ends, strict=True):
        try:
            spec.check_table(table, end)
        except ValueError as exc:
            raise ValueError(f"group {group.index}: {exc}") from None
    starts = [spec.key_start(o) for o in offsets]
    ring = spec.ring_tokens
    split = ring is not None and any(e - s > ring for s, e in zip(starts, ends, strict=True))
    read_ends = list(offsets) if split else ends
    slots, rows = _write_slots(spec, tables, offsets, ends, length)
    blocks, bases = _read_blocks(spec, tables, starts, read_ends)
    return _Plan(
        exact=len(tables) == 1 and num_new[0] == length,
        split=split,
        write_slots=mx.array(slots, dtype=mx.int32),
        write_rows=None if rows == list(range(len(tables) * length)) else mx.array(rows, dtype=mx.int32),
        write_run=_single_run(slots, len(tables) * length, block_size) if len(tables) == 1 else None,
        read_blocks=blocks,
        offsets=tuple(offsets),
        num_new=tuple(num_new),
        key_starts=tuple(starts),
        read_ends=tuple(read_ends),
        bases=tuple(bases),
        length=length,
        page_tokens=0 if blocks is None else blocks.shape[1] * block_size,
    )


def _single_run(slots: list[int], num_new: int, block_size: int) -> tuple[int, int] | None:
    """(block, offset) when all `num_new` new tokens go, in order, to consecutive slots of one block."""
    if (
        len(slots) != num_new
        or slots != list(range(slots[0], slots[0] + num_new))
        or slots[0] // block_size != slots[-1] // block_size
    ):
        return None
    return slots[0] // block_size, slots[0] % block_size


def _write_slots(spec: KVCacheSpec, tables, offsets, ends, length) -> tuple[list[int], list[int]]:
    """Slots of the new tokens that must be stored, and their rows in the flattened batch."""
    slots: list[int] = []
    rows: list[int] = []
    for b, (table, start, end) in enumerate(zip(tables, offsets, ends, strict=True)):
        first = spec.stored_start(start, end)
        slots += spec.slots(table, first, end)
        rows += range(b * length + first - start, b * length + end - start)
    return slots, rows


def _read_blocks(spec: KVCacheSpec, tables, starts, ends) -> tuple[mx.array | None, list[int]]:
    """Blocks covering positions [start, end) per sequence, padded to one width."""
    block_size = spec.block_size
    firsts = [s // block_size for s in starts]
    counts = [-(-e // block_size) - f if e > s else 0 for s, e, f in zip(starts, ends, firsts, strict=True)]
    bases = [f * block_size for f in firsts]
    width = max(counts)
    if width == 0:
        return None, bases
    matrix = []
    for table, first, count in zip(tables, firsts, counts, strict=True):
        row = spec.physical_blocks(table, first, count)
        # Padding entries are masked out; any valid block keeps the gather in range.
        matrix.append(row + [row[-1] if row else table[0]] * (width - count))
    return mx.array(matrix, dtype=mx.int32), bases


class _GroupPlanner:
    """Builds each pass's plan once for all views of a layer group."""

    def __init__(
        self,
        kv_cache: PagedKVCache,
        group: LayerGroup,
        tables: list[list[int]],
        both_ways: tuple[tuple[tuple[int, int], ...], ...] | None = None,
    ):
        self.kv_cache, self.group, self.tables = kv_cache, group, tables
        self.both_ways = both_ways  # the first pass's spans attended both ways, per row (paged_views)
        self.spec = kv_cache.specs[group.index]  # which positions the group's layers store and read
        self._key: tuple | None = None
        self._plan: _Plan | None = None
        self.full_masks: list = []  # masks the group's views made without a window this pass (routing.py)
        self._offsets: tuple[tuple[int, ...], mx.array] | None = None

    def offset_array(self, offsets: Sequence[int]) -> mx.array:
        """`offsets` as an mx.array, built once per pass for every layer of the group (the RoPE offsets)."""
        key = tuple(offsets)
        if self._offsets is None or self._offsets[0] != key:
            self._offsets = key, mx.array(key)
        return self._offsets[1]

    def plan(self, offsets: Sequence[int], num_new: Sequence[int], length: int) -> _Plan:
        key = (tuple(offsets), tuple(num_new), length, tuple(len(t) for t in self.tables))
        if key != self._key or self._plan is None:
            self._plan = _build_plan(self.group, self.spec, self.tables, offsets, num_new, length)
            self._key = key
            self.full_masks = []  # a new pass: the last pass's masks say nothing about this one
        return self._plan


class PagedCacheView:
    """One layer's cache for a batch of sequences, as an mlx-lm attention layer uses it."""

    def __init__(
        self,
        kv_cache: PagedKVCache,
        layer: int,
        planner: _GroupPlanner,
        offsets: Sequence[int],
        num_new: Sequence[int] | None = None,
    ):
        self._kv, self._layer, self._planner = kv_cache, layer, planner
        self._fetched: tuple | None = None  # weak references: a held lazy gather would pin the pool
        self._offsets = list(offsets)
        self._first_offsets = tuple(offsets)  # the pass the both-ways spans are for (paged_views)
        self._num_new = list(num_new) if num_new is not None else None
        self._last_plan: _Plan | None = None
        self._split_out: tuple | None = None

    @property
    def offset(self) -> int | mx.array:
        """Tokens cached so far: an int for batch 1, else an `mx.array` [B]."""
        if len(self._offsets) == 1:
            return self._offsets[0]
        return self._planner.offset_array(self._offsets)

    @property
    def offsets(self) -> list[int]:
        return list(self._offsets)

    @property
    def layer(self) -> int:
        """The KV layer (leaf) this view reads and writes."""
        return self._layer

    def page_coordinates(self) -> KVTransform | None:
        """The transform the pages hold this layer's K/V in (cache/kv_transform.py), None when they hold them
        as the model gives them: attention that reads the pools in place must take it into account."""
        t = self._kv.transform
        return t if t is not None and t.applies(self._layer) else None

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The layer's pool arrays, so `mx.eval(view.state)` lands pending writes (mlx-lm's generate does this)."""
        return tuple(pool_arrays([self._kv.key_pool(self._layer), self._kv.value_pool(self._layer)]))

    # mlx-lm's storage attributes. Models read and assign them only to chain graph dependencies
    # (deepseek_v32: `cache.keys = mx.depends(cache.keys, ...)`, `cache.values = zeros_like(cache.keys)`);
    # the pools are evaluated with every pass anyway, so reads give the pool (a quantized pool's packed data)
    # and assignments are dropped.
    @property
    def keys(self) -> mx.array:
        return pool_arrays([self._kv.key_pool(self._layer)])[0]

    @keys.setter
    def keys(self, value) -> None:
        pass

    @property
    def values(self) -> mx.array:
        return pool_arrays([self._kv.value_pool(self._layer)])[0]

    @values.setter
    def values(self, value) -> None:
        pass

    def is_trimmable(self) -> bool:
        return False

    @property
    def start_position(self) -> int:
        """Position of the first key the next pass returns: mlx-lm ChunkedKVCache's start_position,
        which llama4 reads to build its chunk mask. One sequence only (such models run serially)."""
        if len(self._offsets) != 1:
            raise ValueError(
                f"start_position is one sequence's, this view holds {len(self._offsets)}; "
                "a model that reads it runs one sequence per pass (paged_support.serial_reason)"
            )
        return self._planner.spec.key_start(self._offsets[0])

    def maybe_trim_front(self) -> None:
        """mlx-lm's ChunkedKVCache drops keys before the chunk here; the pages' ring turns instead."""

    def make_mask(
        self,
        N: int,
        return_array: bool = False,
        window_size: int | None = None,
        both_ways: bool = False,
        context: int | None = None,
    ):
        """Mask for the next pass of N tokens per row, matching the keys `update_and_fetch` will return. `both_ways`:
        each new token also sees the new tokens after it in its row (a DFlash block; full attention only); `context`:
        with it, only the last `context` keys before the row's new tokens (a DFlash drafter's sliding layer or draft
        window)."""
        plan = self._planner.plan(self._offsets, self._num_rows(len(self._offsets), N), N)
        window = window_size if window_size is not None else self._planner.spec.window
        if both_ways and window is not None:
            raise ValueError("a both-ways mask is made for full attention only")
        if context is not None:
            return _ragged_mask(plan, window, both_ways, context)
        spans = self._planner.both_ways
        if spans is not None and N > 1 and plan.offsets == self._first_offsets:
            return _mask_with_spans(plan, window, spans)
        if plan.exact:
            mask = None if both_ways else _exact_mask(N, plan.offsets[0] - plan.key_starts[0], window, return_array)
        else:
            mask = _ragged_mask(plan, window, both_ways)
        if window is None and mask is not None and not both_ways:  # a causal full-attention mask (routing.py)
            self._planner.full_masks.append(mask)
        return mask

    def made_mask(self, mask) -> bool:
        """True when `mask` is one this pass's views of this layer group returned from `make_mask`
        without a window: the keys it admits are exactly the sequence's cached ones."""
        return any(mask is made for made in self._planner.full_masks)

    def widened(self, mask, keys: mx.array, values: mx.array):
        """`mask` as wide as the K/V this view returned when the model cut it short of padding only: mlx-vlm's
        Qwen3.5 keeps max(offset) + L + 1 columns of its mask, while a ragged pass gathers every row's keys in
        whole blocks. The columns cut off lie past every row's last key, so they come back admitting nothing.
        Any other mask is returned as it is (attention then fails on its shape, loudly)."""
        plan = self._last_plan
        if (
            not isinstance(mask, mx.array)
            or mask.ndim < 2
            or plan is None
            or plan.split  # the new keys follow the pages: a cut would have dropped them
            or not self.returned(keys, values)
        ):
            return mask
        width, wanted = mask.shape[-1], keys.shape[-2]
        last_key = max(end - base for end, base in zip(plan.read_ends, plan.bases, strict=True))
        if not last_key <= width < wanted:
            return mask
        nothing = False if mask.dtype == mx.bool_ else mx.finfo(mask.dtype).min
        padding = mx.full((*mask.shape[:-1], wanted - width), nothing, dtype=mask.dtype)
        return mx.concatenate([mask, padding], axis=-1)

    def returned(self, keys: mx.array, values: mx.array) -> bool:
        """True when `keys` and `values` are the very arrays the last `update_and_fetch` returned."""
        if self._fetched is None:
            return False
        return keys is self._fetched[0]() and values is self._fetched[1]()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new K/V `[B, kv_heads, L, head_dim]` into pages; return the K/V to attend."""
        batch, _, length, _ = keys.shape
        plan = self._planner.plan(self._offsets, self._num_rows(batch, length), length)
        if plan.split:
            old = self._read(plan)
            if old is not None:
                mx.eval(old)  # a pending read would pin the pool and make the write copy it
            self._write(plan, keys, values)
            # The new keys are attended as given: as the pages store them (quantized pages: rounded alike).
            keys, values = self._kv.as_read(self._layer, keys, values)
            if old is None:
                out = keys, values
            else:
                out = mx.concatenate([old[0], keys], axis=2), mx.concatenate([old[1], values], axis=2)
        else:
            # Always the gathered K/V, lazily: when attention reads the pages itself (routing.py)
            # the gather is never evaluated; any other consumer gets the right keys.
            self._write(plan, keys, values)
            out = self._read_written(plan)
        self._fetched = (weakref.ref(out[0]), weakref.ref(out[1]))
        # A split pass's K/V are the model's new keys and an evaluated read: holding them pins no pool.
        self._split_out = out if plan.split else None
        self._offsets = [o + n for o, n in zip(plan.offsets, plan.num_new, strict=True)]
        self._num_new = None
        self._last_plan = plan
        return out

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The K/V the last `update_and_fetch` returned, for layers that attend another layer's cache
        (gemma3n's shared layers, afm7's KV-reuse layers), as mlx-lm's caches give them. Gathered again
        from the last plan: keeping the lazy gather would pin the pool and make later writes copy it."""
        if self._last_plan is None:
            raise RuntimeError("keys_and_values() before any update_and_fetch: this cache holds no keys yet")
        if self._split_out is not None:
            return self._split_out
        return self._read_written(self._last_plan)

    def decode_inputs(self) -> tuple[Pool, Pool, mx.array, tuple[int, ...]] | None:
        """(k_pool, v_pool, block_tables, context_lens) for `mlxpaged.kernels.attention.paged_attention`
        after a pass of one new token per sequence on a full-attention layer; else None
        (prefill, mixed batches and window layers attend through the gathered K/V)."""
        plan = self._last_plan
        if plan is None or plan.read_blocks is None or not _routable(plan, self._planner.spec):
            return None
        return self._kv.key_pool(self._layer), self._kv.value_pool(self._layer), plan.read_blocks, plan.read_ends

    def prefill_pages(self) -> tuple[Pool, Pool, list[int], int] | None:
        """(k_pool, v_pool, block table, context) after a batch-1 pass on a full-attention layer: the
        pass's queries are the last positions of [0, context), whose K/V lie in those pages (routing.py
        may read them in place instead of the gathered copy); else None."""
        plan = self._last_plan
        if (
            plan is None
            or len(plan.offsets) != 1
            or plan.split
            or not plan.exact
            or self._planner.spec.window is not None
        ):
            return None
        return (
            self._kv.key_pool(self._layer),
            self._kv.value_pool(self._layer),
            self._planner.tables[0],
            plan.read_ends[0],
        )

    def _num_rows(self, batch: int, length: int) -> list[int]:
        if batch != len(self._offsets):
            raise ValueError(f"batch of {batch} rows for a view of {len(self._offsets)} sequences")
        if self._num_new is None:
            return [length] * batch
        if len(self._num_new) != batch or not all(1 <= n <= length for n in self._num_new):
            raise ValueError(f"num_new {self._num_new} must hold {batch} counts in [1, {length}]")
        return self._num_new

    def _write(self, plan: _Plan, keys: mx.array, values: mx.array) -> None:
        if plan.write_run is not None:  # e.g. batch-1 decode: a slice update, as mlx-lm's KVCache does
            self._kv.write_run(self._layer, *plan.write_run, keys, values)
            return
        batch, heads, length, dim = keys.shape
        k = keys.transpose(0, 2, 1, 3).reshape(batch * length, heads, dim)
        v = values.transpose(0, 2, 1, 3).reshape(batch * length, heads, values.shape[-1])
        if plan.write_rows is not None:
            k = mx.take(k, plan.write_rows, axis=0)
            v = mx.take(v, plan.write_rows, axis=0)
        self._kv.write(self._layer, plan.write_slots, k, v)

    def _read_written(self, plan: _Plan) -> tuple[mx.array, mx.array]:
        """The K/V of a pass that wrote keys: there are always some to read."""
        out = self._read(plan)
        if out is None:
            raise RuntimeError("a pass that wrote keys has none to read")
        return out

    def _read(self, plan: _Plan) -> tuple[mx.array, mx.array] | None:
        if plan.read_blocks is None:
            return None
        k, v = self._kv.gather_blocks(self._layer, plan.read_blocks)
        if plan.exact:
            lo, hi = plan.key_starts[0] - plan.bases[0], plan.read_ends[0] - plan.bases[0]
            k, v = k[..., lo:hi, :], v[..., lo:hi, :]
        return k, v


def _exact_mask(N: int, old: int, window: int | None, return_array: bool):
    """mlx-lm's mask for N queries after `old` cached keys (KVCache / RotatingKVCache semantics)."""
    if window is not None and old + N > window:
        return create_causal_mask(N, old, window_size=window)
    if N == 1:
        return None
    return create_causal_mask(N, old) if return_array else "causal"


def _key_positions(plan: _Plan) -> tuple[mx.array, mx.array]:
    """(positions [B, K], valid [B, K]) of the keys `update_and_fetch` returns for `plan`, per row."""
    if plan.exact:  # positions [key_start, end), the old ones read from pages and (split) the new ones after them
        kpos = mx.arange(plan.key_starts[0], plan.offsets[0] + plan.num_new[0])[None]
        return kpos, mx.ones(kpos.shape, dtype=mx.bool_)
    offsets, num_new = mx.array(plan.offsets), mx.array(plan.num_new)
    kpos = mx.array(plan.bases)[:, None] + mx.arange(plan.page_tokens)[None]
    valid = (kpos >= mx.array(plan.key_starts)[:, None]) & (kpos < mx.array(plan.read_ends)[:, None])
    if plan.split:
        rows = mx.arange(plan.length)[None]
        kpos = mx.concatenate([kpos, offsets[:, None] + rows], axis=1)
        valid = mx.concatenate([valid, rows < num_new[:, None]], axis=1)
    return kpos, valid


def _query_positions(plan: _Plan, both_ways: bool = False) -> mx.array:
    """[B, L] the position each row's new tokens mask as. Padding rows copy the last real row's mask, so they never
    see an empty row (NaN); `both_ways`: every token masks as the row's last (a DFlash block)."""
    offsets, num_new = mx.array(plan.offsets), mx.array(plan.num_new)
    rows = mx.arange(plan.length)[None]
    return offsets[:, None] + (num_new[:, None] - 1 if both_ways else mx.minimum(rows, num_new[:, None] - 1))


def _ragged_mask(plan: _Plan, window: int | None, both_ways: bool = False, context: int | None = None) -> mx.array:
    """Boolean [B, 1, L, K]: key valid, not after the query (`both_ways`: not after the row's last new token), inside
    the window; `context`: not more than `context` positions before the row's first new token."""
    kpos, valid = _key_positions(plan)
    qpos = _query_positions(plan, both_ways)
    mask = valid[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])
    if window is not None:
        mask = mask & (kpos[:, None, :] > qpos[:, :, None] - window)
    if context is not None:
        mask = mask & (kpos >= mx.array(plan.offsets)[:, None] - context)[:, None, :]
    return mask[:, None]


def _mask_with_spans(plan: _Plan, window: int | None, spans: Sequence[Sequence[tuple[int, int]]]) -> mx.array:
    """Boolean [B, 1, L, K]: the causal (windowed) mask, and each token inside one of its row's `spans` also sees
    every key of that span, after it or out of the window (transformers' Gemma 4 `create_masks_for_vision_model`:
    the causal mask or the same image)."""
    kpos, valid = _key_positions(plan)
    qpos = _query_positions(plan)
    width = max(len(row) for row in spans)
    padded = [list(row) + [(0, 0)] * (width - len(row)) for row in spans]  # (0, 0) holds no position
    starts = mx.array([[s for s, _ in row] for row in padded])[:, None, :]  # [B, 1, S]
    ends = mx.array([[e for _, e in row] for row in padded])[:, None, :]
    q_in = (qpos[:, :, None] >= starts) & (qpos[:, :, None] < ends)  # [B, L, S]
    k_in = (kpos[:, :, None] >= starts) & (kpos[:, :, None] < ends)  # [B, K, S]
    same = (q_in[:, :, None, :] & k_in[:, None, :, :]).any(axis=-1)  # [B, L, K]
    mask = kpos[:, None, :] <= qpos[:, :, None]
    if window is not None:
        mask = mask & (kpos[:, None, :] > qpos[:, :, None] - window)
    return ((mask | same) & valid[:, None, :])[:, None]
