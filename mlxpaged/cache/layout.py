"""What a model keeps per sequence, leaf by leaf, as its own mlx-lm caches show it (no MLX here).

`loading/probe.py` builds a ModelLayout by running the model lazily through `make_prompt_cache`;
the memory plan, the pools and the refusal at load all read it instead of config.json spellings.

A *leaf* is one cache object: an entry of the model's cache list, or one cache inside a `CacheList`.
Its `path` is its index path: `(3,)` for entry 3, `(3, 1)` for the second cache of the CacheList at 3.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from mlxpaged.cache.specs import LEAF_KINDS, KVGeometry, LayerKind

Path = tuple[int, ...]
KV_KINDS = tuple(LEAF_KINDS)  # the kinds cache/specs.py has a table spec for
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int32": 4,
    "int64": 8,
    "uint32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "int16": 2,
    "uint16": 2,
    "uint64": 8,
    "complex64": 8,
}


@dataclass(frozen=True)
class KVLeaf:
    """A key/value cache (mlx-lm KVCache, RotatingKVCache, ChunkedKVCache): per token, K is
    `kv_heads x k_dim` and V is `kv_heads x v_dim` of `dtype`.

    kind: "full" keeps every token; "window" the last `span` tokens (RotatingKVCache); "chunked"
    attends within chunks of `span` tokens (ChunkedKVCache). `span` is None for "full".
    k_is_v: the model writes one array as both K and V (`update_and_fetch(k, k)`).
    q_heads: query heads of the SDPA calls that read this leaf (None: no SDPA call saw its K/V).
    sinks: those calls pass attention sinks. consumers: how the decode step used the returned K/V
    (see CONSUMERS); routed: only by the base SDPA with this cache, its own V and no mask."""

    path: Path
    kind: str
    span: int | None
    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: str
    k_is_v: bool = False
    q_heads: int | None = None
    sinks: bool = False
    consumers: tuple[str, ...] = ()
    routed: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"KV leaf {self.path}: kind {self.kind!r} is not one of {KV_KINDS}")
        if (self.span is None) != (self.kind == "full"):
            raise ValueError(f"KV leaf {self.path}: a {self.kind} leaf needs span None only when full, got {self.span}")

    @property
    def geometry(self) -> KVGeometry:
        """What one token of this leaf stores: leaves sharing it can share one pool."""
        return KVGeometry(self.kv_heads, self.k_dim, self.v_dim, self.k_is_v)

    @property
    def layer_kind(self) -> LayerKind:
        """Its kind as the table specs take it (specs.LEAF_KINDS)."""
        return LEAF_KINDS[self.kind](self.span)

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token (one array when `k_is_v`)."""
        width = self.k_dim if self.k_is_v else self.k_dim + self.v_dim
        return self.kv_heads * width * dtype_bytes

    def describe(self) -> str:
        span = "" if self.span is None else f" {self.span}"
        kv = f"K {self.kv_heads}x{self.k_dim}" + ("=V" if self.k_is_v else f", V {self.kv_heads}x{self.v_dim}")
        return f"{self.kind}{span} attention ({kv})"


# How a decode step consumed a KV leaf's returned K/V (KVLeaf.consumers).
CONSUMERS = {
    "sdpa": "mlx-lm's scaled_dot_product_attention with this cache and its own V",
    "sdpa-other-v": "mlx-lm's scaled_dot_product_attention with another V (latent attention)",
    "sdpa-masked": "mlx-lm's scaled_dot_product_attention with a mask the model built itself",
    "sdpa-other-cache": "another layer's attention (shared K/V)",
    "sdpa-other-k": "mlx-lm's scaled_dot_product_attention with this cache but keys it did not return",
    "fast": "mx.fast.scaled_dot_product_attention called directly",
}


@dataclass(frozen=True)
class StateLeaf:
    """A per-sequence state (mlx-lm ArraysCache: conv tails, recurrent states): one entry per array,
    `(shape without the batch axis, dtype)`, or None for an entry the model never set."""

    path: Path
    arrays: tuple[tuple[tuple[int, ...], str] | None, ...]

    def bytes_per_sequence(self) -> int:
        """What one sequence's arrays of this leaf take (unset entries: nothing)."""
        total = 0
        for entry in self.arrays:
            if entry is not None:
                shape, dtype = entry
                total += math.prod(shape) * DTYPE_BYTES[dtype]
        return total

    def describe(self) -> str:
        shapes = ", ".join("unset" if a is None else "x".join(map(str, a[0])) for a in self.arrays)
        return f"state ({shapes})"


@dataclass(frozen=True)
class UnusedLeaf:
    """A cache the model creates but never writes (e.g. a layer replaced by a linear map)."""

    path: Path
    cache_class: str

    def describe(self) -> str:
        return f"unused {self.cache_class}"


@dataclass(frozen=True)
class UnknownLeaf:
    """A cache class the layout does not know (e.g. deepseek_v41's own LayerCache): never paged."""

    path: Path
    cache_class: str

    def describe(self) -> str:
        return f"own cache class {self.cache_class}"


Leaf = KVLeaf | StateLeaf | UnusedLeaf | UnknownLeaf


@dataclass(frozen=True)
class CacheListNode:
    """An mlx-lm CacheList: several caches for one layer; `entries` mirror its `caches`."""

    entries: tuple[Entry, ...]


# One entry of the structure: a leaf's path, a CacheList, or None (the model's cache list holds None).
Entry = Path | CacheListNode | None


@dataclass(frozen=True)
class ModelLayout:
    """Every leaf of the model's cache, the nesting of `make_prompt_cache`'s list, and what the
    logits and embeddings showed. `refuse`: reasons no paged cache can hold this model at all
    (e.g. a cache class of its own), whatever the pools support. `batch_error`: a batched forward
    (per-sequence offsets, as mlx-lm's BatchKVCache gives them) failed, e.g. positions read as one int."""

    model_type: str
    leaves: tuple[Leaf, ...]
    structure: tuple[Entry, ...]
    vocab_size: int
    hidden_size: int
    num_layers: int | None = None  # len(model.layers), to name layers when caches map one to one
    refuse: tuple[str, ...] = field(default=())
    batch_error: str | None = None  # why a batch of sequences at different offsets fails; None: it ran or untried

    @property
    def kv_leaves(self) -> tuple[KVLeaf, ...]:
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, KVLeaf))

    @property
    def kv_geometries(self) -> tuple[KVGeometry, ...]:
        """Each KV leaf's geometry, in leaf order: what the pools and the memory plan hold per layer."""
        return tuple(leaf.geometry for leaf in self.kv_leaves)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each KV leaf's kind, in leaf order (no leaves: the pools' one layerless NoKV group)."""
        return tuple(leaf.layer_kind for leaf in self.kv_leaves)

    @property
    def state_leaves(self) -> tuple[StateLeaf, ...]:
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, StateLeaf))

    @property
    def state_only(self) -> bool:
        """State layers and no K/V at all (mamba, rwkv): tables of zero-byte blocks only number tokens."""
        return not self.kv_leaves and bool(self.state_leaves)

    @property
    def keeps_no_cache(self) -> bool:
        """Neither K/V nor state: nothing for the engine to page (refused at load)."""
        return not self.kv_leaves and not self.state_leaves

    @property
    def state_bytes_per_sequence(self) -> int:
        """Bytes of one sequence's state over every state leaf."""
        return sum(leaf.bytes_per_sequence() for leaf in self.state_leaves)

    @property
    def unused_leaves(self) -> tuple[UnusedLeaf, ...]:
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, UnusedLeaf))

    def leaf(self, path: Path) -> Leaf:
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        raise KeyError(f"no cache leaf at {path}")

    def where(self, path: Path) -> str:
        """A leaf's place in words: "layer 3" when the cache list maps one entry per layer."""
        head = f"layer {path[0]}" if self.num_layers == len(self.structure) else f"cache entry {path[0]}"
        return head + "".join(f" cache {i}" for i in path[1:])

    def kinds(self) -> list[str]:
        """Each leaf's kind in a word (full, window W, chunked C, state, unused, own class), leaf order."""
        return [_kind_word(leaf) for leaf in self.leaves]


def walk(structure: tuple[Entry, ...]) -> Iterator[Path]:
    """Leaf paths in structure order (depth first)."""
    for entry in structure:
        if isinstance(entry, CacheListNode):
            yield from walk(entry.entries)
        elif entry is not None:
            yield entry


def _kind_word(leaf: Leaf) -> str:
    if isinstance(leaf, KVLeaf):
        return leaf.kind if leaf.span is None else f"{leaf.kind} {leaf.span}"
    return {StateLeaf: "state", UnusedLeaf: "unused"}.get(type(leaf), leaf.describe())
