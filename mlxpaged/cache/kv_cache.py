"""Paged KV memory: page pools, slot writes, block gathers.

Layout. Every pool is one MLX array `[num_blocks, kv_heads, block_size, k_dim]` for keys
and one `[num_blocks, kv_heads, block_size, v_dim]` for values, in the model's KV dtype. A
(block, head) page is a contiguous `[block_size, dim]` tile, so a kernel thread group reading
one head of one block reads one contiguous run, and a write of one token is `kv_heads` rows
of `dim` contiguous elements. A physical slot is `block * block_size + offset`.

Geometry classes. Layers (here: the model's KV cache leaves, in layout order) need not agree on
heads or widths (latent MLA caches 1 "head" of the latent rank as K and the RoPE key as V, V may be
narrower than K, head counts vary per layer, an indexer writes one array as K and V). Each layer
has a `KVGeometry`; pools are per (geometry, position in the group) (`specs.assign_pools`), so a
one-geometry model keeps exactly the G pools below.

Block spaces (`specs.block_spaces`). Groups that share a pool draw their block ids from one space; groups whose
pools are disjoint (gemma4: window layers 1x256, full layers 1x512) get a space each, and each space's pools have
that space's block count (`space_blocks`, sized by the memory plan: platform/space_plan.py). A block id of one
space is a page in that space's pools only, so no id leaves another layer kind's page unused (one shared space
left 56% of gemma4's pool bytes idle at 1k tokens, 34% at 128k). Most models have one geometry: one space, as
before. Copies (`copy_blocks`) go per space; the whole-block exports serve the prefix cache, which runs with one
group, so with one space (decision and numbers: docs/design/issue14-architectures.md, "D2 as built").

Writes are in-place indexed assignment with index arrays only
(`pool[(blocks[:, None], heads[None, :], offsets[:, None])] = rows`; MLX 0.32
raises when index arrays are mixed with `:`). MLX updates the pool in place only
while no other reference to the pool's buffer is alive: this module keeps no slice
or view of a pool; it reads pools only through `mx.take` (whose result is a fresh
buffer) and the reshaped view feeding a take lives only until the take is
evaluated. Callers must evaluate a step's outputs before the next step's writes
(an unevaluated read of a pool pins it), or each write copies the whole pool.

Layer groups (specs.py, plain Python): layers of one attention type are cut into
groups of equal size G, so one block id means "G pages, one per layer of a group"
whatever the group's type: the groups of one block space share its ids, and a
one-geometry cache holds only G key pools and G value pools (pool j serves the j-th
layer of every group). Each request has one block table per group, its ids from the
group's space. A full-attention model is one group of all layers, i.e. one pool per layer.

Sliding-window groups. A request's table for a window-W group holds at most
ceil(W / block_size) + 1 blocks used as a ring: logical block b lives in
`table[b % len_max]`, so once the table is full the next block reuses the
oldest one, whose tokens have left the window. See `LayerGroup`. The cache manager
(kv_cache_manager.py) keeps every group's table, sized by the group's spec.

Prefix cache. Only full-attention groups can share blocks: their pages are
append-only and a block's content is a pure function of the token prefix. Ring
blocks are overwritten as the window slides, so they can never be shared or
cached. Decision (as transformers does; vLLM's hybrid allocator instead keeps
the last window's blocks cached per group, which we do not): the prefix cache is
on only when every group's spec shares its blocks (`PagedKVCache.supports_prefix_cache`);
hybrid models run with it off and prefill every prompt in full. Paging,
copy-on-write and preemption stay correct for them.

Quantized pages (`quantization`, CacheConfig.kv_bits): each pool is a `QuantizedPages` (quantized_pages.py)
in the same place, with the same block ids, holding three arrays (packed data, scales, biases) instead of
one. Writes quantize as they store; gathers dequantize only the pages they take; `pools` lists every array.

A model with no KV layers (state layers only) gets no pools at all: its one layerless group
(specs.NoKV) numbers tokens in blocks of zero bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.cache import group_fit
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.kv_transform import KVTransform
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.cache.quantized_pages import Pool, QuantizedPages, pool_arrays, store, store_pair
from mlxpaged.cache.specs import (  # noqa: F401  (block_bytes is re-exported: the facts live in specs.py)
    KVCacheSpec,
    KVGeometry,
    LayerGroup,
    LayerKind,
    assign_pools,
    block_bytes,
    block_spaces,
    group_layers,
    pool_block_bytes,
)
from mlxpaged.platform import backend

import mlx.core as mx
import numpy as np


class PagedKVCache:
    """Key and value page pools for every layer of a model, indexed by block id.

    `layer_windows`: each layer's kind (specs.LayerKind; None: every layer full attention). `geometries`: one
    KVGeometry per layer (None: every layer `num_kv_heads x head_dim` for K and V, which then must be given).
    `quantization`: pages stored quantized (kv_quant.py; None: in `dtype`). No layers: no pools, one layerless
    group whose blocks only number tokens (specs.NoKV). `num_blocks`: the blocks of each block space
    (specs.block_spaces; one int: that many in every space)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int | Sequence[int],
        block_size: int,
        num_kv_heads: int | None,
        head_dim: int | None,
        dtype: mx.Dtype = mx.float32,
        layer_windows: Sequence[LayerKind] | None = None,
        geometries: Sequence[KVGeometry] | None = None,
        quantization: KVQuantization | None = None,
        transform: KVTransform | None = None,
    ):
        windows = tuple(layer_windows) if layer_windows is not None else (None,) * num_layers
        if geometries is None:
            heads, dim = _check_sizes(num_kv_heads=num_kv_heads, head_dim=head_dim)
            geometries = (KVGeometry(heads, dim, dim),) * num_layers
        geometries = tuple(geometries)
        self.groups = group_layers(windows) if len(windows) == num_layers else ()
        self.spaces = block_spaces(self.groups, geometries) if len(geometries) == num_layers else ()
        per_space = [num_blocks] * len(self.spaces) if isinstance(num_blocks, int) else list(num_blocks)
        _check_layers(num_layers, per_space, len(self.spaces), block_size, windows, geometries)
        self.space_blocks: tuple[int, ...] = tuple(per_space)  # blocks of each space
        self.num_layers, self.block_size = num_layers, block_size
        first = geometries[0] if geometries else None
        self.num_kv_heads = first.kv_heads if first else None  # the first layer's (the only ones when uniform)
        self.head_dim, self.dtype = (first.k_dim if first else None), dtype
        self.layer_windows, self.geometries = windows, geometries
        self.quantization = quantization
        # Stored K/V coordinates (kv_transform.py; None: as the model gives them). Reads map back.
        self.transform = transform
        if transform is not None and len(transform.layers) != num_layers:
            raise ValueError(f"a K/V transform of {len(transform.layers)} layers for {num_layers} layers")
        if transform is not None and any(g.k_is_v and transform.applies(i) for i, g in enumerate(geometries)):
            raise ValueError("a K/V transform cannot apply to a layer whose K and V are one array")
        if quantization is not None:
            quantization.check_widths([w for g in geometries for w in (g.k_dim, g.v_dim)])
        self.specs: tuple[KVCacheSpec, ...] = tuple(g.spec(block_size) for g in self.groups)  # one per group
        self.group_size = len(self.groups[0].layers)
        self._group = {layer: g for g in self.groups for layer in g.layers}
        self._pool, self.pool_geometries = assign_pools(self.groups, geometries)
        # The space of each group, layer and pool: a pool has its space's blocks, a layer's ids are its space's.
        self.group_spaces = tuple(next(i for i, sp in enumerate(self.spaces) if g.index in sp) for g in self.groups)
        self._layer_space = {layer: self.group_spaces[g.index] for g in self.groups for layer in g.layers}
        pool_space = {self._pool[layer]: space for layer, space in self._layer_space.items()}
        self.pool_spaces = tuple(pool_space[j] for j in range(len(self.pool_geometries)))
        self._heads = {h: mx.arange(h) for h in {g.kv_heads for g in geometries}}
        self.keys: list[Pool] = [
            self._new_pool(self.space_blocks[s], g.kv_heads, g.k_dim)
            for g, s in zip(self.pool_geometries, self.pool_spaces, strict=True)
        ]
        self.values: list[Pool] = [
            k if g.k_is_v else self._new_pool(self.space_blocks[s], g.kv_heads, g.v_dim)
            for k, g, s in zip(self.keys, self.pool_geometries, self.pool_spaces, strict=True)
        ]
        self._last_slots: tuple | None = None  # (slot mapping, slots, blocks, offsets)
        mx.eval(list(self._heads.values()), self.pools)  # lazy arrays would bind to this thread's stream

    @property
    def num_blocks(self) -> int:
        """The blocks of every block space when they have the same count (one space: its count); else ask
        `space_blocks`."""
        if len(set(self.space_blocks)) != 1:
            raise ValueError(f"block spaces of {self.space_blocks} blocks: ask space_blocks")
        return self.space_blocks[0]

    def _new_pool(self, num_blocks: int, heads: int, dim: int) -> Pool:
        shape = (num_blocks, heads, self.block_size, dim)
        if self.quantization is None:
            return mx.zeros(shape, self.dtype)
        return QuantizedPages.zeros(shape, self.dtype, self.quantization)

    @classmethod
    def for_layout(
        cls,
        layout: ModelLayout,
        num_blocks: int | Sequence[int],
        block_size: int,
        dtype: mx.Dtype,
        quantization: KVQuantization | None = None,
        transform: KVTransform | None = None,
    ) -> PagedKVCache:
        """Pools for a layout's KV leaves, in leaf order (none for a model of state layers only)."""
        return cls(
            len(layout.kv_leaves),
            num_blocks,
            block_size,
            None,
            None,
            dtype,
            layout.layer_kinds,
            layout.kv_geometries,
            quantization,
            transform,
        )

    @property
    def pools(self) -> list[mx.array]:
        """Every distinct array of every pool (a K-is-V pool once; a quantized pool's data, scales and biases):
        what to evaluate to land pending writes, and what one block's pages are spread over (`export_block`)."""
        return pool_arrays(self.keys + [v for k, v in zip(self.keys, self.values, strict=True) if v is not k])

    @property
    def quantized(self) -> bool:
        return self.quantization is not None

    @property
    def single_geometry(self) -> bool:
        """Every layer has the same heads and K/V widths, K and V apart (today's one-class pools)."""
        return len(set(self.geometries)) == 1 and not self.geometries[0].k_is_v

    @property
    def plain_full_attention(self) -> bool:
        """One full-attention group of one geometry, K and V apart: the pools the compiled decode pass
        (runner/decode_pass.py) and the deferred writes (runner/deferred_writes.py) take."""
        return len(self.specs) == 1 and self.specs[0].window is None and self.single_geometry

    @property
    def supports_prefix_cache(self) -> bool:
        """Blocks may be shared or cached by prefix only if every group's spec shares them (no ring)."""
        return all(spec.shares_prefix for spec in self.specs)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id in every space together (one space: one id's)."""
        return pool_block_bytes(
            self.layer_windows, self.geometries, self.block_size, self.dtype.size, self.quantization
        )

    def space_of(self, layer: int) -> int:
        """The block space whose ids `layer`'s pages are indexed by."""
        return self._layer_space[layer]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def bytes_by_class(self) -> dict[KVGeometry, int]:
        """Pool bytes per geometry class (the stats' KV memory per class)."""
        out: dict[KVGeometry, int] = {}
        for k, v, g in zip(self.keys, self.values, self.pool_geometries, strict=True):
            out[g] = out.get(g, 0) + k.nbytes + (0 if v is k else v.nbytes)  # a quantized pool: its 3 arrays
        return out

    def group_of(self, layer: int) -> LayerGroup:
        return self._group[layer]

    def geometry(self, layer: int) -> KVGeometry:
        return self.geometries[layer]

    def key_pool(self, layer: int) -> Pool:
        return self.keys[self._pool[layer]]

    def value_pool(self, layer: int) -> Pool:
        return self.values[self._pool[layer]]

    def write(self, layer: int, slot_mapping: Sequence[int] | mx.array, k: mx.array, v: mx.array) -> None:
        """Write k `[num_tokens, kv_heads, k_dim]`, v `[num_tokens, kv_heads, v_dim]` into their slots, in
        place (v is not written for a K-is-V layer). Slots given as an `mx.array` are not range-checked
        (hot path); repeated slots in one call leave an unspecified winner."""
        slots, blocks, offsets = self._indices(slot_mapping, self.space_blocks[self._layer_space[layer]])
        geo = self.geometries[layer]
        for name, x, dim in (("k", k, geo.k_dim), ("v", v, geo.v_dim)):
            expected = (slots.size, geo.kv_heads, dim)
            if tuple(x.shape) != expected:
                raise ValueError(f"layer {layer}: {name} has shape {tuple(x.shape)}, expected {expected}")
            if x.dtype != self.dtype:
                raise ValueError(f"layer {layer}: {name} has dtype {x.dtype}, the pools hold {self.dtype}")
        index = (blocks, self._heads[geo.kv_heads][None, :], offsets)
        j = self._pool[layer]
        k, v = self._stored_coordinates(layer, k, v, head_axis=-2)
        if geo.k_is_v:
            store(self.keys[j], index, k)
        else:
            store_pair(self.keys[j], self.values[j], index, k, v)

    def write_run(self, layer: int, block: int, offset: int, k: mx.array, v: mx.array) -> None:
        """Write k, v `[1, kv_heads, n, dim]` to slots offset..offset + n - 1 of `block`, in place
        (a slice update: fewer graph nodes than the indexed write, for the common single-run case)."""
        n = k.shape[2]
        if not (
            0 <= block < self.space_blocks[self._layer_space[layer]] and offset >= 0 and offset + n <= self.block_size
        ):
            raise ValueError(f"run of {n} tokens at block {block}, offset {offset} is outside the pool")
        j = self._pool[layer]
        index = (slice(block, block + 1), slice(None), slice(offset, offset + n))
        k, v = self._stored_coordinates(layer, k, v, head_axis=-3)
        if self.geometries[layer].k_is_v:
            store(self.keys[j], index, k)
        else:
            store_pair(self.keys[j], self.values[j], index, k, v)

    def _indices(self, slot_mapping: Sequence[int] | mx.array, num_blocks: int) -> tuple[mx.array, mx.array, mx.array]:
        """(slots, block column, offset column). Every layer of a pass writes the same slot-mapping
        array, so the last one's indices are reused: matched by identity of that (immutable, held)
        mx.array; lists are converted every time, as they may change in place."""
        last = self._last_slots
        if last is not None and last[0] is slot_mapping:
            return last[1:]
        slots = self._slot_array(slot_mapping, num_blocks)
        indices = (slots, (slots // self.block_size)[:, None], (slots % self.block_size)[:, None])
        if isinstance(slot_mapping, mx.array):
            self._last_slots = (slot_mapping, *indices)
        return indices

    def gather_blocks(self, layer: int, block_ids: mx.array) -> tuple[mx.array, mx.array]:
        """Pages of `block_ids` `[B, n]` laid end to end: k `[B, kv_heads, n * block_size, k_dim]` and v
        likewise with `v_dim` (the very same array for a K-is-V layer), in the pools' dtype (quantized pages
        dequantized: only the pages taken)."""
        geo, j = self.geometries[layer], self._pool[layer]
        k = self._take_pages(self.keys[j], block_ids, geo.kv_heads, geo.k_dim)
        if geo.k_is_v:
            return k, k
        v = self._take_pages(self.values[j], block_ids, geo.kv_heads, geo.v_dim)
        t = self.transform
        if t is None or not t.applies(layer):
            return k, v
        return t.keys_out(layer, k), t.values_out(layer, v)

    def _stored_coordinates(self, layer: int, k: mx.array, v: mx.array, head_axis: int) -> tuple[mx.array, mx.array]:
        """K/V as the pages hold them (kv_transform.py); unchanged without a transform for `layer`."""
        t = self.transform
        if t is None or not t.applies(layer):
            return k, v
        return t.keys_in(layer, k, head_axis), t.values_in(layer, v, head_axis)

    def _take_pages(self, pool: Pool, block_ids: mx.array, heads: int, dim: int) -> mx.array:
        # One take of whole (block, head) pages lands as [B, heads, n, size * dim]: no transpose copy.
        # The reshaped pool is a view, alive only until the take is evaluated.
        batch, n = block_ids.shape
        size = self.block_size
        rows = block_ids[:, None, :] * heads + self._heads[heads][None, :, None]
        if isinstance(pool, QuantizedPages):
            return pool.dequantize(pool.take_pages(rows))
        return mx.take(pool.reshape(-1, size * dim), rows, axis=0).reshape(batch, heads, n * size, dim)

    def gather(self, layer: int, block_table: Sequence[int], length: int) -> tuple[mx.array, mx.array]:
        """First `length` tokens of a linear block table: k, v `[kv_heads, length, dim]`."""
        need = -(-length // self.block_size)
        if length < 1 or need > len(block_table):
            raise ValueError(f"{length} tokens need {need} blocks, the table has {len(block_table)}")
        k, v = self.gather_blocks(layer, mx.array([list(block_table[:need])], dtype=mx.int32))
        return k[0, :, :length], v[0, :, :length]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]], space: int = 0) -> None:
        """Copy the pages of block `src` onto block `dst` in every pool of block space `space` (copy-on-write)."""
        if not pairs:
            return
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        self._check_blocks(src + dst, space)
        if len(set(dst)) != len(dst) or set(src) & set(dst):
            raise ValueError(f"copy_blocks targets must be distinct and not sources: {list(pairs)}")
        src_ids, dst_ids = mx.array(src, dtype=mx.int32), mx.array(dst, dtype=mx.int32)
        pools = self._space_pools(space)
        rows = [mx.take(p, src_ids, axis=0) for p in pools]
        # Materialize the copies first: a pending take would pin the pools and the
        # writes below would copy whole pools instead of updating them in place.
        mx.eval(rows)
        for pool, r in zip(pools, rows, strict=True):
            pool[dst_ids] = r

    def copy_on_write(self, copies: Sequence) -> None:
        """A fork's copy-on-write copies (`CopyOnWrite`s: src_block, dst_block, space), every block space's, landed."""
        for space in sorted({c.space for c in copies}):  # ids of one block space per call
            self.copy_blocks([(c.src_block, c.dst_block) for c in copies if c.space == space], space)
        if copies:
            mx.eval(self.pools)

    def _space_pools(self, space: int) -> list[mx.array]:
        """Every array of the pools of block space `space` (`pools` order)."""
        keys = [j for j, s in enumerate(self.pool_spaces) if s == space]
        return pool_arrays(
            [self.keys[j] for j in keys] + [self.values[j] for j in keys if self.values[j] is not self.keys[j]]
        )

    # ---- whole blocks in and out (the disk tier, cache/disk_tier.py) --------------------------------
    # Generic over `self.pools`, so pools added for quantized pages (scales, biases) travel too. The disk tier
    # keeps the prefix cache's blocks, and the prefix cache runs with one group, so with one block space.

    def export_block(self, block_id: int) -> list[np.ndarray]:
        """Block `block_id`'s pages, one host array per pool (in `pools` order)."""
        return self.export_blocks([block_id])[0]

    def export_blocks(self, block_ids: Sequence[int]) -> list[list[np.ndarray]]:
        """Per block, its pages as host arrays, one per pool: one take per pool, evaluated here, so the copy
        pins no pool (a pending read would make the next in-place write copy the whole pool). bfloat16 pages,
        which numpy lacks, come out as their uint16 bits; `import_blocks` views them back."""
        self._check_blocks(block_ids)
        ids = mx.array(list(block_ids), dtype=mx.int32)
        rows = [mx.take(p, ids, axis=0) for p in self.pools]
        rows = [r.view(mx.uint16) if r.dtype == mx.bfloat16 else r for r in rows]
        mx.eval(rows)
        host = [np.asarray(r) for r in rows]  # views of the fresh takes, not of the pools
        return [[h[i] for h in host] for i in range(len(block_ids))]

    def import_block(self, block_id: int, arrays: Sequence[np.ndarray]) -> None:
        """Write `export_block`'s arrays back as block `block_id`'s pages."""
        self.import_blocks([block_id], [arrays])

    def import_blocks(self, block_ids: Sequence[int], blocks: Sequence[Sequence[np.ndarray]]) -> None:
        """Write each block's exported pages into its id, in place, and land the writes. Raises ValueError when
        the arrays do not fit the pools (other pools, shapes or widths). The caller makes sure nothing in flight
        reads the pools (the runner settled)."""
        self._check_blocks(block_ids)
        pools = self.pools
        if len(blocks) != len(block_ids) or any(len(arrays) != len(pools) for arrays in blocks):
            raise ValueError(f"{len(blocks)} blocks of pages for {len(block_ids)} ids; each needs {len(pools)} arrays")
        for j, pool in enumerate(pools):
            for arrays in blocks:
                page = arrays[j]
                if tuple(page.shape) != tuple(pool.shape[1:]) or page.dtype.itemsize != pool.dtype.size:
                    raise ValueError(
                        f"pool {j}: a page of {page.dtype} {tuple(page.shape)} does not fit a pool of "
                        f"{pool.dtype} {tuple(pool.shape[1:])}"
                    )
        mx.eval(pools)
        host_writes = backend.current() != "cuda"
        for j, pool in enumerate(pools):
            pages = [arrays[j] for arrays in blocks]
            if not host_writes or pool.dtype == mx.bfloat16:
                self._import_scatter(pool, block_ids, pages)
                continue
            # Host-addressable memory (the CPU backend, Metal's unified memory): copy straight into the pool's
            # buffer, one memcpy per page; MLX's scatter of the same pages costs several times more on the CPU
            # backend. In place as MLX's own writes are: the pool is evaluated, and no view of it is alive.
            host = np.asarray(pool)
            for block_id, page in zip(block_ids, pages, strict=True):
                host[block_id] = page.view(host.dtype)
            del host
        mx.eval(self.pools)

    def _import_scatter(self, pool: mx.array, block_ids: Sequence[int], pages: list[np.ndarray]) -> None:
        """Pages into `pool` by MLX's indexed assignment (memory the host cannot write, or a dtype numpy lacks)."""
        stacked = mx.array(np.stack(pages))
        pool[mx.array(list(block_ids), dtype=mx.int32)] = (
            stacked if stacked.dtype == pool.dtype else stacked.view(pool.dtype)
        )

    def as_stored(self, x: mx.array) -> mx.array:
        """K or V `[..., dim]` as the pages hold them once written: quantized and dequantized for quantized
        pages (what a chunk attends when its new keys are not read back from the pages), else `x` itself.
        In the pages' own coordinates: see `as_read` for the K/V a read hands back."""
        if self.quantization is None:
            return x
        return group_fit.round_trip(x, self.quantization)

    def as_read(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """New K/V `[B, kv_heads, L, dim]` of `layer` as a read of the pages would return them once written:
        into the stored coordinates, rounded as stored (`as_stored`), and back."""
        t = self.transform
        if self.geometries[layer].k_is_v or t is None or not t.applies(layer):
            return self.as_stored(k), (k if v is k else self.as_stored(v))
        k, v = self._stored_coordinates(layer, k, v, head_axis=-3)
        return t.keys_out(layer, self.as_stored(k)), t.values_out(layer, self.as_stored(v))

    def _slot_array(self, slot_mapping: Sequence[int] | mx.array, num_blocks: int) -> mx.array:
        if isinstance(slot_mapping, mx.array):
            return slot_mapping.astype(mx.int32).reshape(-1)
        slots = list(slot_mapping)
        limit = num_blocks * self.block_size
        bad = [s for s in slots if not 0 <= s < limit]
        if bad:
            raise ValueError(f"slots {bad[:5]} out of range [0, {limit})")
        return mx.array(slots, dtype=mx.int32)

    def _check_blocks(self, blocks: Sequence[int], space: int | None = None) -> None:
        """Ids of block space `space` (None: every space has as many; the whole-block exports take one space)."""
        limit = self.num_blocks if space is None else self.space_blocks[space]
        bad = [b for b in blocks if not 0 <= b < limit]
        if bad:
            raise ValueError(f"block ids {bad[:5]} out of range [0, {limit})")


def _check_sizes(**sizes: object) -> list[int]:
    """The sizes, in order, once each is a positive integer."""
    bad = {name: value for name, value in sizes.items() if not isinstance(value, int) or value < 1}
    if bad:
        raise ValueError(f"sizes must be positive integers: {bad}")
    return [value for value in sizes.values() if isinstance(value, int)]


def _check_layers(
    num_layers: int, space_blocks: list, num_spaces: int, block_size: int, windows: tuple, geometries: tuple
) -> None:
    if not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be an integer >= 0, got {num_layers!r}")
    _check_sizes(block_size=block_size, **{f"num_blocks[{i}]": n for i, n in enumerate(space_blocks)})
    if len(geometries) != num_layers:
        raise ValueError(f"geometries has {len(geometries)} entries for {num_layers} layers")
    if len(windows) != num_layers:
        raise ValueError(f"layer_windows has {len(windows)} entries for {num_layers} layers")
    if len(space_blocks) != num_spaces:
        raise ValueError(f"num_blocks gives {len(space_blocks)} block spaces' counts, the layers make {num_spaces}")
    bad_windows = [
        w
        for w in windows
        if (isinstance(w, int) and (isinstance(w, bool) or w < 1))
        or not (w is None or isinstance(w, int) or hasattr(w, "spec"))
    ]
    if bad_windows:
        raise ValueError(f"sliding windows must be positive integers or None: {bad_windows}")
