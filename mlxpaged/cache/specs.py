"""Layer groups and KV cache specs: which layers share a block table, and how each kind of table
grows, shares and frees blocks. Plain Python (no MLX), so the memory planner, the block pool and the
cache manager can read them without loading MLX.

Layer groups. Layers are grouped as the transformers continuous-batching cache did (transformers
4.5x `group_layers_by_attn_type`): layers of one attention type (full, or sliding with a given
window) are cut, in order, into groups of `gcd(count per type)` layers. All groups have the same
size G, so one block id means "G pages, one per layer of a group" whatever the group's type. Groups that
share a pool draw from one block-id space; groups whose pools are disjoint get a space each (`block_spaces`).
Each request has one block table per group.

Specs. A `KVCacheSpec` says what one group's table needs for N tokens, what it can share (prefix
cache, n > 1 forks) and which of its blocks no query reads any more as the window slides. Full
attention grows one block per `block_size` tokens and shares every computed full block. A sliding
window of W tokens keeps a ring of ceil(W / block_size) + 1 blocks (logical block b lives in
`table[b % len(table)]`, cache_view.py and kv_cache.py rely on it): a ring block is overwritten
as the window slides, so it is never shared, and nothing is freed, the oldest block is reused.
Chunked-local attention (llama4: a query attends only within its fixed chunk of C tokens) is stored
as a window of C + 1 tokens (`Chunked`, `ChunkedLocalSpec`): what mlx-lm's ChunkedKVCache keeps. A model
with no KV layers at all (state layers only) has one layerless group (`NoKV`, `NoKVSpec`): its table
numbers tokens as full attention's does, in blocks of zero bytes.

A new layer kind is a spec class here (what its table needs, shares and frees, which keys a query
reads) with its entry in `LEAF_KINDS`, plus the mlx-lm cache class that makes it (loading/probe.py).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Union

from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.errors import ConfigError
from mlxpaged.validation import is_int_at_least

# ---- layer kinds: what one KV layer keeps, as `layer_windows` entries --------------------------------

LayerKind = Union[None, int, "Chunked", "NoKV"]  # None: full attention; an int: a sliding window of that many tokens


@dataclass(frozen=True)
class Chunked:
    """A `layer_windows` entry for chunked-local attention in chunks of `chunk` tokens (llama4).
    mlx-lm's ChunkedKVCache keeps positions [offset - chunk, offset) before a pass (its
    `start_position` after `maybe_trim_front`), so the layer is stored as a window of chunk + 1
    tokens: the query at `offset` reads `chunk + 1` keys, the model's own mask keeps its chunk."""

    chunk: int

    def __post_init__(self) -> None:
        _check_positive(chunk=self.chunk)

    @property
    def window(self) -> int:
        return self.chunk + 1

    def spec(self, block_size: int) -> KVCacheSpec:
        return ChunkedLocalSpec(block_size, self.chunk)


@dataclass(frozen=True)
class NoKV:
    """The kind of the one layerless group of a model that keeps no K/V (state layers only): its table
    numbers tokens in blocks of zero bytes (`NoKVSpec`)."""

    window = None

    def spec(self, block_size: int) -> KVCacheSpec:
        return NoKVSpec(block_size)


# The layout's name of each KV kind (cache/layout.KVLeaf.kind) -> the layer kind of a leaf of that span.
LEAF_KINDS: dict[str, Callable[[int | None], LayerKind]] = {
    "full": lambda span: None,
    "window": lambda span: span,
    "chunked": lambda span: Chunked(_span(span)),
}


def _span(span: int | None) -> int:
    if span is None:
        raise ValueError("a chunked leaf needs its chunk size as span")
    return span


def window_of(kind: LayerKind) -> int | None:
    """The tokens a layer kind stores: None (every token), a window, or a chunk's window."""
    return kind if kind is None or isinstance(kind, int) else kind.window


@functools.lru_cache(maxsize=None, typed=True)  # typed: a window of True is refused, not taken as 1
def spec_for(kind: LayerKind, block_size: int) -> KVCacheSpec:
    """The table spec of a layer kind (cached: views ask every pass)."""
    if kind is None:
        return FullAttentionSpec(block_size)
    if isinstance(kind, int):
        return SlidingWindowSpec(block_size, kind)
    return kind.spec(block_size)


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one block table per request: same kind (`LayerKind`), fixed size. A model with no
    KV layers has one group of no layers (`NoKV`): its table still numbers each sequence's tokens."""

    index: int
    layers: tuple[int, ...]
    kind: LayerKind

    def spec(self, block_size: int) -> KVCacheSpec:
        """How this group's table grows, shares and frees (everything else asks the spec)."""
        return spec_for(self.kind, block_size)

    @property
    def window(self) -> int | None:
        """Tokens a layer of the group stores (None: every token); a chunked group's is chunk + 1."""
        return window_of(self.kind)

    @property
    def chunk(self) -> int | None:
        return self.kind.chunk if isinstance(self.kind, Chunked) else None


def group_layers(layer_windows: Sequence[LayerKind]) -> tuple[LayerGroup, ...]:
    """Cut layers into equal-size groups of one kind (window or chunk), in layer order; no layers: the
    one layerless `NoKV` group."""
    by_kind: dict[LayerKind, list[int]] = {}
    for layer, kind in enumerate(layer_windows):
        by_kind.setdefault(kind, []).append(layer)
    if not by_kind:
        return (LayerGroup(0, (), NoKV()),)
    size = math.gcd(*(len(layers) for layers in by_kind.values()))
    groups: list[LayerGroup] = []
    for kind, layers in by_kind.items():
        for i in range(0, len(layers), size):
            groups.append(LayerGroup(len(groups), tuple(layers[i : i + size]), kind))
    return tuple(groups)


def block_bytes(
    layer_windows: Sequence[LayerKind], block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Bytes one block id stands for: keys and values of one page per layer of a group."""
    group_size = len(group_layers(layer_windows)[0].layers)
    return 2 * group_size * num_kv_heads * block_size * head_dim * dtype_bytes


# ---- geometry classes: what one layer (cache leaf) stores per token -------------------------------


@dataclass(frozen=True)
class KVGeometry:
    """Per token, K is `kv_heads x k_dim` and V `kv_heads x v_dim`; `k_is_v`: the model writes one
    array as both (`update_and_fetch(k, k)`), so one pool holds it and `v_dim` equals `k_dim`."""

    kv_heads: int
    k_dim: int
    v_dim: int
    k_is_v: bool = False

    def __post_init__(self) -> None:
        _check_positive(kv_heads=self.kv_heads, k_dim=self.k_dim, v_dim=self.v_dim)
        if self.k_is_v and self.v_dim != self.k_dim:
            raise ConfigError(f"a K-is-V geometry needs v_dim == k_dim, got {self.k_dim} and {self.v_dim}")

    def describe(self) -> str:
        """e.g. "K 1x512 = V" (latent, K is V), "K 16x192, V 16x128"."""
        return f"K {self.kv_heads}x{self.k_dim}" + (" = V" if self.k_is_v else f", V {self.kv_heads}x{self.v_dim}")

    def page_elements(self, block_size: int) -> int:
        """Elements of one page (one block of one layer): K and, unless K is V, V."""
        return self.kv_heads * block_size * (self.k_dim if self.k_is_v else self.k_dim + self.v_dim)

    def page_bytes(self, block_size: int, dtype_bytes: int, quantization: KVQuantization | None = None) -> int:
        """Bytes of one page: `page_elements` in the dtype, or quantized rows (packed data, scales, biases)."""
        if quantization is None:
            return self.page_elements(block_size) * dtype_bytes
        widths = (self.k_dim,) if self.k_is_v else (self.k_dim, self.v_dim)
        return self.kv_heads * block_size * sum(quantization.row_bytes(w, dtype_bytes) for w in widths)


def assign_pools(groups: Sequence[LayerGroup], geometries: Sequence[KVGeometry]) -> tuple[list[int], list[KVGeometry]]:
    """(pool index of each layer, geometry of each pool). A block id is held by one group's table at a
    time, so the j-th layers of all groups share a pool when their geometry is the same (one geometry:
    exactly G pools, pool j for the j-th layer of every group); another geometry at j gets its own pool."""
    index: dict[tuple[int, KVGeometry], int] = {}
    pool_of = [0] * len(geometries)
    pools: list[KVGeometry] = []
    for group in groups:
        for j, layer in enumerate(group.layers):
            key = (j, geometries[layer])
            if key not in index:
                index[key] = len(pools)
                pools.append(geometries[layer])
            pool_of[layer] = index[key]
    return pool_of, pools


def block_spaces(groups: Sequence[LayerGroup], geometries: Sequence[KVGeometry]) -> tuple[tuple[int, ...], ...]:
    """The groups (by index) of each block-id space, in group order: groups that share a pool (`assign_pools`)
    draw their block ids from one space; groups whose pools are disjoint (gemma4's window layers and its full
    layers of another head_dim) get a space each, so a block id of one never leaves the other's pages unused.
    One geometry (most models), or a layerless model: one space of every group."""
    pool_of, _ = assign_pools(groups, geometries)
    space_of_pool: dict[int, int] = {}
    spaces: list[set[int]] = []
    for group in groups:
        found = {space_of_pool[pool_of[layer]] for layer in group.layers if pool_of[layer] in space_of_pool}
        merged = {group.index}.union(*(spaces[i] for i in found))
        for i in found:
            spaces[i] = set()
        spaces.append(merged)
        for member in merged:
            for layer in groups[member].layers:
                space_of_pool[pool_of[layer]] = len(spaces) - 1
    return tuple(sorted(tuple(sorted(s)) for s in spaces if s))


def space_block_bytes(
    layer_windows: Sequence[LayerKind],
    geometries: Sequence[KVGeometry],
    block_size: int,
    dtype_bytes: int,
    quantization: KVQuantization | None = None,
) -> tuple[int, ...]:
    """Bytes one block id of each space (`block_spaces`) stands for: one page in every pool of its groups."""
    groups = group_layers(layer_windows)
    pool_of, pools = assign_pools(groups, geometries)
    out = []
    for space in block_spaces(groups, geometries):
        used = {pool_of[layer] for g in space for layer in groups[g].layers}
        out.append(sum(pools[j].page_bytes(block_size, dtype_bytes, quantization) for j in sorted(used)))
    return tuple(out)


def pool_block_bytes(
    layer_windows: Sequence[LayerKind],
    geometries: Sequence[KVGeometry],
    block_size: int,
    dtype_bytes: int,
    quantization: KVQuantization | None = None,
) -> int:
    """Bytes of one block id in every space together: one page in every pool (`assign_pools`), each of its own
    widths (quantized pages: their packed data, scales and biases, kv_quant.py). One space: one id's bytes."""
    _, pools = assign_pools(group_layers(layer_windows), geometries)
    return sum(pool.page_bytes(block_size, dtype_bytes, quantization) for pool in pools)


# ---- what a table of each kind needs, shares and frees --------------------------------------------


class KVCacheSpec(ABC):
    """How one layer group's per-request block table behaves (vLLM v1's KVCacheSpec): the blocks it needs
    for N tokens, what it shares through the prefix cache and forks, what it frees, and where each
    position's K/V lives. The cache manager, the pools, the views and the memory plan ask it."""

    block_size: int
    if TYPE_CHECKING:  # a field of SlidingWindowSpec's, a property of the others' (read-only to callers)

        @property
        def window(self) -> int | None:
            """Tokens of the sequence a layer stores and a query may read (None: every earlier one)."""

    shares_prefix: ClassVar[bool]  # computed full blocks are never rewritten: shared by prefix and forks
    stores_kv: ClassVar[bool] = True  # False: zero-byte blocks that only number tokens
    # How a refusal names tables that reuse slots (`size` tokens each); None: the table only grows.
    ring_label: ClassVar[str | None] = None

    @property
    @abstractmethod
    def max_blocks(self) -> int | None:
        """Most blocks a table ever holds (None: it grows with the sequence)."""

    @property
    def size(self) -> int | None:
        """The kind's own size in tokens, as `ring_label` names it (a window, a chunk)."""
        return self.window

    @property
    def rolls_back(self) -> bool:
        """Slots past a sequence's end can be given back (rejected drafts): only a table that never wraps."""
        return self.max_blocks is None

    @property
    def ring_tokens(self) -> int | None:
        """Tokens a ring holds (None: the table grows instead)."""
        return None if self.max_blocks is None else self.max_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Table length once `num_tokens` tokens have slots."""
        blocks = -(-num_tokens // self.block_size)
        return blocks if self.max_blocks is None else min(blocks, self.max_blocks)

    @abstractmethod
    def shareable_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks whose KV is computed and never rewritten: what a prefix-cache hit or a
        fork may share instead of copying."""

    @abstractmethod
    def skipped_blocks(self, num_tokens: int) -> int:
        """Leading logical blocks that no query from position `num_tokens` on reads any more: a
        table may free or reuse them as the window slides."""

    def table_index(self, logical_block: int, table_length: int) -> int:
        """Where logical block `logical_block` lives in a table of `table_length` blocks."""
        return logical_block if self.max_blocks is None else logical_block % table_length

    def key_start(self, offset: int) -> int:
        """First position a query at `offset` reads."""
        return 0 if self.window is None else max(0, offset - self.window + 1)

    def stored_start(self, start: int, end: int) -> int:
        """First of the new positions [start, end) that must be written to pages (a ring keeps its last)."""
        ring = self.ring_tokens
        return start if ring is None else max(start, end - ring)

    def physical_block(self, table: Sequence[int], logical: int) -> int:
        return table[logical if self.max_blocks is None else logical % self.max_blocks]

    def physical_blocks(self, table: Sequence[int], first: int, count: int) -> list[int]:
        """`physical_block` of logical blocks first .. first + count - 1; a growing table's are a slice of it
        (each pass reads every block of its context: 509 Python calls at 8k otherwise)."""
        if self.max_blocks is None:
            return list(table[first : first + count])
        return [table[(first + i) % self.max_blocks] for i in range(count)]

    def slots(self, table: Sequence[int], start: int, end: int) -> list[int]:
        """Physical slots of positions [start, end)."""
        bs = self.block_size
        return [self.physical_block(table, p // bs) * bs + p % bs for p in range(start, end)]

    def check_table(self, table: Sequence[int], num_tokens: int) -> None:
        """Raise ValueError unless `table` holds the blocks `num_tokens` tokens need, and no more than a ring's."""
        need = self.blocks_needed(num_tokens)
        if len(table) < need:
            raise ValueError(
                f"block table has {len(table)} blocks, {num_tokens} tokens need {need} (block_size {self.block_size})"
            )
        if self.max_blocks is not None and len(table) > self.max_blocks:
            raise ValueError(
                f"a ring of {self.size} tokens uses at most {self.max_blocks} blocks per request, "
                f"the table has {len(table)}"
            )


def _check_positive(**sizes: object) -> None:
    bad = {k: v for k, v in sizes.items() if not is_int_at_least(v, 1)}
    if bad:
        raise ConfigError(f"KV cache spec sizes must be positive integers, got {bad}")


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    block_size: int
    shares_prefix: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_positive(block_size=self.block_size)

    @property
    def window(self) -> None:
        return None

    @property
    def max_blocks(self) -> None:
        return None

    def shareable_blocks(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.block_size

    def skipped_blocks(self, num_tokens: int) -> int:
        return 0


@dataclass(frozen=True)
class NoKVSpec(FullAttentionSpec):
    """The table of a model that keeps no K/V (state layers only): it grows and shares as full attention's,
    so blocks still number each sequence's tokens (prefix hashes, capacity, state checkpoints), but a
    block is zero bytes: there are no pages to write or read."""

    stores_kv: ClassVar[bool] = False


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    block_size: int
    window: int
    shares_prefix: ClassVar[bool] = False  # ring blocks are overwritten as the window slides
    ring_label: ClassVar[str] = "sliding windows of {sizes} tokens"

    def __post_init__(self) -> None:
        _check_positive(block_size=self.block_size, window=self.window)

    @property
    def max_blocks(self) -> int:
        # One block beyond the window: the block being written may still hold the window's start.
        return -(-self.window // self.block_size) + 1

    def shareable_blocks(self, num_computed_tokens: int) -> int:
        return 0

    def skipped_blocks(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window + 1) // self.block_size  # a query at p reads from p - W + 1


@dataclass(frozen=True)
class ChunkedLocalSpec(KVCacheSpec):
    """Chunked-local attention (llama4): a query at p attends to [p - p % chunk, p]. Stored as a
    ring of a window of chunk + 1 tokens (`Chunked`), so a table never holds more than
    ceil((chunk + 1) / block_size) + 1 blocks: blocks of finished chunks are recycled as the ring
    turns. Never shared (ring blocks are overwritten)."""

    block_size: int
    chunk: int
    shares_prefix: ClassVar[bool] = False
    ring_label: ClassVar[str] = "chunked-local attention in chunks of {sizes} tokens"

    def __post_init__(self) -> None:
        _check_positive(block_size=self.block_size, chunk=self.chunk)

    @property
    def window(self) -> int:
        return self.chunk + 1

    @property
    def size(self) -> int:
        return self.chunk

    @property
    def max_blocks(self) -> int:
        return -(-(self.chunk + 1) // self.block_size) + 1

    def key_start(self, offset: int) -> int:
        """First key handed to a pass that starts at `offset`: mlx-lm's ChunkedKVCache.start_position
        after maybe_trim_front (it trims to the last `chunk` tokens)."""
        return max(0, offset - self.chunk)

    def chunk_start(self, position: int) -> int:
        """First position the query at `position` attends to."""
        return position - position % self.chunk

    def shareable_blocks(self, num_computed_tokens: int) -> int:
        return 0

    def skipped_blocks(self, num_tokens: int) -> int:
        return self.key_start(num_tokens) // self.block_size


def table_lengths(num_tokens: int, block_size: int, group_max_blocks: Sequence[int | None]) -> list[int]:
    """Per layer group, the blocks a sequence of `num_tokens` tokens holds: one per block_size
    tokens, at most `max_blocks` for a sliding-window ring (None: full attention, no limit)."""
    n = -(-num_tokens // block_size)
    return [n if cap is None else min(n, cap) for cap in group_max_blocks]


def sequence_capacity(num_blocks: int, block_size: int, group_max_blocks: Sequence[int | None]) -> int | None:
    """Tokens (whole blocks) of the longest sequence `num_blocks` blocks can hold; None when
    any length fits (only rings, and they fit)."""

    def fits(n: int) -> bool:
        return sum(table_lengths(n * block_size, block_size, group_max_blocks)) <= num_blocks

    caps = [cap for cap in group_max_blocks if cap is not None]
    if len(caps) == len(group_max_blocks) and fits(max(caps)):
        return None
    low, high = 0, num_blocks  # what fits is <= num_blocks: some table takes a block per n
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * block_size


def spaces_capacity(
    space_blocks: Sequence[int], block_size: int, space_max_blocks: Sequence[Sequence[int | None]]
) -> int | None:
    """Tokens of the longest sequence block spaces of `space_blocks` blocks hold (each space's groups'
    `max_blocks` in `space_max_blocks`): the least of each space's `sequence_capacity`; None: any length."""
    caps = [sequence_capacity(n, block_size, maxes) for n, maxes in zip(space_blocks, space_max_blocks, strict=True)]
    known = [c for c in caps if c is not None]
    return min(known) if known else None
