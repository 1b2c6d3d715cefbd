"""Layer groups and KV cache specs: which layers share a block table, and how each kind of table
grows, shares and frees blocks. Plain Python (no MLX), so the memory planner, the block pool and the
cache manager can read them without loading MLX.

Layer groups. Layers are grouped as the transformers continuous-batching cache did (transformers
4.5x `group_layers_by_attn_type`): layers of one attention type (full, or sliding with a given
window) are cut, in order, into groups of `gcd(count per type)` layers. All groups have the same
size G, so one block id means "G pages, one per layer of a group" whatever the group's type, and all
groups draw from one block-id space. Each request has one block table per group.

Specs. A `KVCacheSpec` says what one group's table needs for N tokens, what it can share (prefix
cache, n > 1 forks) and which of its blocks no query reads any more as the window slides. Full
attention grows one block per `block_size` tokens and shares every computed full block. A sliding
window of W tokens keeps a ring of ceil(W / block_size) + 1 blocks (logical block b lives in
`table[b % len(table)]`, cache_view.py and kv_cache.py rely on it): a ring block is overwritten
as the window slides, so it is never shared, and nothing is freed, the oldest block is reused.
Chunked-local attention (llama4: a query attends only within its fixed chunk of C tokens) is stored
as a window of C + 1 tokens (`Chunked`, `ChunkedLocalSpec`): what mlx-lm's ChunkedKVCache keeps.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from mlxpaged.errors import ConfigError
from mlxpaged.validation import is_int_at_least


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


def window_of(entry: "int | Chunked | None") -> int | None:
    """The tokens a `layer_windows` entry stores: None (full), a window, or a chunk's window."""
    return entry.window if isinstance(entry, Chunked) else entry


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one block table per request: same attention type, fixed size."""

    index: int
    layers: tuple[int, ...]
    window: int | None  # None: full attention; for chunked groups the stored window, chunk + 1
    chunk: int | None = None  # chunked-local attention in chunks of this many tokens

    def spec(self, block_size: int) -> "KVCacheSpec":
        if self.chunk is not None:
            return ChunkedLocalSpec(block_size, self.chunk)
        if self.window is None:
            return FullAttentionSpec(block_size)
        return SlidingWindowSpec(block_size, self.window)

    def max_blocks(self, block_size: int) -> int | None:
        """Blocks a request's table holds at most (None: unbounded, full attention)."""
        if self.window is None:
            return None
        return -(-self.window // block_size) + 1

    def ring_tokens(self, block_size: int) -> int | None:
        """Tokens a window ring holds (None for full attention)."""
        blocks = self.max_blocks(block_size)
        return None if blocks is None else blocks * block_size

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Table length needed once `num_tokens` tokens have been written."""
        blocks = -(-num_tokens // block_size)
        limit = self.max_blocks(block_size)
        return blocks if limit is None else min(blocks, limit)

    def key_start(self, offset: int) -> int:
        """First position a query at `offset` attends to."""
        return 0 if self.window is None else max(0, offset - self.window + 1)

    def stored_start(self, start: int, end: int, block_size: int) -> int:
        """First of the new positions [start, end) that must be written to pages."""
        ring = self.ring_tokens(block_size)
        return start if ring is None else max(start, end - ring)

    def physical_block(self, table: Sequence[int], logical: int, block_size: int) -> int:
        limit = self.max_blocks(block_size)
        return table[logical if limit is None else logical % limit]

    def slots(self, table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
        """Physical slots of positions [start, end)."""
        return [
            self.physical_block(table, p // block_size, block_size) * block_size + p % block_size
            for p in range(start, end)
        ]

    def check_table(self, table: Sequence[int], num_tokens: int, block_size: int) -> None:
        need = self.blocks_needed(num_tokens, block_size)
        if len(table) < need:
            raise ValueError(
                f"group {self.index}: block table has {len(table)} blocks, "
                f"{num_tokens} tokens need {need} (block_size {block_size})"
            )
        limit = self.max_blocks(block_size)
        if limit is not None and len(table) > limit:
            raise ValueError(
                f"group {self.index}: sliding window {self.window} uses at most {limit} "
                f"blocks per request, the table has {len(table)}"
            )


def group_layers(layer_windows: Sequence[int | Chunked | None]) -> tuple[LayerGroup, ...]:
    """Cut layers into equal-size groups of one attention type (window or chunk), in layer order."""
    by_type: dict[int | Chunked | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_type.setdefault(window, []).append(layer)
    if not by_type:
        raise ValueError("a model needs at least one layer")
    size = math.gcd(*(len(layers) for layers in by_type.values()))
    groups = []
    for entry, layers in by_type.items():
        chunk = entry.chunk if isinstance(entry, Chunked) else None
        for i in range(0, len(layers), size):
            groups.append(LayerGroup(len(groups), tuple(layers[i : i + size]), window_of(entry), chunk))
    return tuple(groups)


def block_bytes(
    layer_windows: Sequence[int | Chunked | None], block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
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


def pool_block_bytes(layer_windows: Sequence[int | None], geometries: Sequence[KVGeometry], block_size: int,
                     dtype_bytes: int) -> int:
    """Bytes one block id stands for: one page in every pool (`assign_pools`), each of its own widths."""
    _, pools = assign_pools(group_layers(layer_windows), geometries)
    return sum(pool.page_elements(block_size) for pool in pools) * dtype_bytes


# ---- what a table of each kind needs, shares and frees --------------------------------------------


class KVCacheSpec(ABC):
    """How one layer group's per-request block table behaves (vLLM v1's KVCacheSpec)."""

    block_size: int

    @property
    @abstractmethod
    def max_blocks(self) -> int | None:
        """Most blocks a table ever holds (None: it grows with the sequence)."""

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


def _check_positive(**sizes: object) -> None:
    bad = {k: v for k, v in sizes.items() if not is_int_at_least(v, 1)}
    if bad:
        raise ConfigError(f"KV cache spec sizes must be positive integers, got {bad}")


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    block_size: int

    def __post_init__(self) -> None:
        _check_positive(block_size=self.block_size)

    @property
    def max_blocks(self) -> None:
        return None

    def shareable_blocks(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.block_size

    def skipped_blocks(self, num_tokens: int) -> int:
        return 0


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    block_size: int
    window: int

    def __post_init__(self) -> None:
        _check_positive(block_size=self.block_size, window=self.window)

    @property
    def max_blocks(self) -> int:
        # One block beyond the window: the block being written may still hold the window's start.
        return -(-self.window // self.block_size) + 1

    def shareable_blocks(self, num_computed_tokens: int) -> int:
        return 0  # ring blocks are overwritten as the window slides

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

    def __post_init__(self) -> None:
        _check_positive(block_size=self.block_size, chunk=self.chunk)

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
        return 0  # ring blocks are overwritten as the chunks pass

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

    if None not in group_max_blocks and fits(max(group_max_blocks)):
        return None
    low, high = 0, num_blocks  # what fits is <= num_blocks: some table takes a block per n
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * block_size
