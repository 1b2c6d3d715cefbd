"""What a model costs the KV cache planner: its KV shape per token, its weights, its context.

Built from the model's cache layout (loading/probe.py: what its own mlx-lm caches hold), for the
loaded model (Engine) and, before loading, for the model built without weights (checkpoint.py);
both go through `ModelFacts.from_layout`, so the two agree. config.json is read for the context
length only: no other config key decides a shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxpaged.cache.layout import ModelLayout
from mlxpaged.cache.specs import Chunked, KVGeometry, pool_block_bytes

from mlxpaged.validation import require_int


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the KV cache. `sliding_windows` has one entry per layer:
    None for full attention, else the window in tokens (such a layer keeps only recent blocks) or
    `Chunked(chunk)` for chunked-local attention; None for all: no layer slides."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_windows: tuple[int | Chunked | None, ...] | None = None
    # One KVGeometry per layer (KV leaf) when they differ from `num_kv_heads x head_dim` for K and V
    # (latent MLA, V narrower than K, per-layer heads, K-is-V); None: every layer is that.
    geometries: tuple[KVGeometry, ...] | None = None
    stand_in: bool = False  # a model of state layers only: the 1 x 1 page that numbers tokens, read by nothing

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            require_int(name, getattr(self, name), low=1)
        if self.geometries is not None:
            object.__setattr__(self, "geometries", tuple(self.geometries))
            if len(self.geometries) != self.num_layers:
                raise ValueError(f"geometries has {len(self.geometries)} entries for {self.num_layers} layers")
        if self.sliding_windows is None:
            return
        windows = tuple(self.sliding_windows)
        object.__setattr__(self, "sliding_windows", windows)
        if len(windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(windows)} entries for {self.num_layers} layers")
        for window in windows:
            if window is not None and not isinstance(window, Chunked):  # a Chunked checks itself
                require_int("a sliding window", window, low=1)

    @property
    def layer_geometries(self) -> tuple[KVGeometry, ...]:
        return self.geometries or (KVGeometry(self.num_kv_heads, self.head_dim, self.head_dim),) * self.num_layers

    @property
    def layer_bytes_per_token(self) -> int:
        """K and V of one token in one layer (the first layer's, when they differ)."""
        return self.layer_geometries[0].page_elements(1) * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V of one token, in its own widths (a K-is-V layer once)."""
        return sum(g.page_elements(1) for g in self.layer_geometries) * self.dtype_bytes

    @property
    def layer_windows(self) -> tuple[int | Chunked | None, ...]:
        return self.sliding_windows or (None,) * self.num_layers

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block id: a page in every pool (kv_cache.py), each in its own widths."""
        return pool_block_bytes(self.layer_windows, self.layer_geometries, block_size, self.dtype_bytes)

    @classmethod
    def from_layout(cls, layout: ModelLayout, dtype_bytes: int) -> KVShape:
        """One entry per KV leaf (a layer reusing another's K/V has none: counted once); raises
        ValueError naming the first leaf of a kind the pools cannot hold."""
        leaves = layout.kv_leaves
        if not leaves and layout.state_leaves:
            # Only state layers: blocks still number each sequence's tokens (prefix hashes, capacity,
            # checkpoints), so they get the smallest page there is, 1 head x 1 value, which nothing reads.
            return cls(1, 1, 1, dtype_bytes, stand_in=True)
        if not leaves:
            raise ValueError(f"model type {layout.model_type!r} keeps no key/value cache")
        for leaf in leaves:
            if leaf.kind not in ("full", "window", "chunked"):
                raise ValueError(f"{layout.where(leaf.path)} ({leaf.describe()}) has no paged pools")
        first = leaves[0]
        geometries = tuple(KVGeometry(leaf.kv_heads, leaf.k_dim, leaf.v_dim, leaf.k_is_v) for leaf in leaves)
        uniform = set(geometries) == {KVGeometry(first.kv_heads, first.k_dim, first.k_dim)}
        windows = tuple(Chunked(leaf.span) if leaf.kind == "chunked" else leaf.span for leaf in leaves)
        return cls(len(leaves), first.kv_heads, first.k_dim, dtype_bytes,
                   windows if any(w is not None for w in windows) else None, None if uniform else geometries)


@dataclass(frozen=True)
class ModelFacts:
    """The model as the planner needs it."""

    kv: KVShape
    weight_bytes: int
    hidden_size: int
    vocab_size: int
    context_length: int | None = None  # max_position_embeddings
    state_bytes_per_sequence: int = 0  # state-space layers' state of one sequence (state slots)

    def __post_init__(self) -> None:
        require_int("weight_bytes", self.weight_bytes)
        require_int("state_bytes_per_sequence", self.state_bytes_per_sequence)
        require_int("hidden_size", self.hidden_size, low=1)
        require_int("vocab_size", self.vocab_size, low=1)
        if self.context_length is not None:
            require_int("context_length", self.context_length, low=1)

    @classmethod
    def from_layout(cls, layout: ModelLayout, weight_bytes: int, kv_dtype_bytes: int,
                    context_length: int | None = None) -> ModelFacts:
        """From a layout the pools can hold (paged_support.unsupported_reasons is empty)."""
        return cls(KVShape.from_layout(layout, kv_dtype_bytes), weight_bytes, layout.hidden_size,
                   layout.vocab_size, context_length, layout.state_bytes_per_sequence)


# Where configs keep the context length, in the order tried (GPT-2 style n_positions / n_ctx too).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def context_length(config: dict) -> int | None:
    """The model's context length from config.json (its text_config first, for multimodal
    checkpoints); None when no key says, and the cache's capacity bounds requests instead."""
    for source in (config.get("text_config") or {}, config):
        for key in CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def model_weight_bytes(model) -> int:
    """Bytes of every parameter of an mlx.nn.Module (quantization scales included)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
