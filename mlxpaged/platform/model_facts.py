"""What a model costs the KV cache planner: its KV shape per token, its weights, its context.

Built from the model's cache layout (loading/probe.py: what its own mlx-lm caches hold), for the
loaded model (Engine) and, before loading, for the model built without weights (checkpoint.py);
both go through `ModelFacts.from_layout`, so the two agree. config.json is read for the context
length only: no other config key decides a shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.cache.specs import (
    KVCacheSpec,
    KVGeometry,
    LayerKind,
    block_spaces,
    group_layers,
    pool_block_bytes,
    space_block_bytes,
)
from mlxpaged.validation import require_int


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the KV cache. `sliding_windows` has one entry per layer (specs.LayerKind):
    None for full attention, else the window in tokens (such a layer keeps only recent blocks) or
    `Chunked(chunk)` for chunked-local attention; None for all: no layer slides. No layers (a model of
    state layers only): blocks of zero bytes that number tokens (specs.NoKV), and no heads or widths."""

    num_layers: int
    num_kv_heads: int | None  # the first layer's; None only without layers
    head_dim: int | None
    dtype_bytes: int
    sliding_windows: tuple[LayerKind, ...] | None = None
    # One KVGeometry per layer (KV leaf) when they differ from `num_kv_heads x head_dim` for K and V
    # (latent MLA, V narrower than K, per-layer heads, K-is-V); None: every layer is that.
    geometries: tuple[KVGeometry, ...] | None = None
    quantization: KVQuantization | None = None  # pages stored quantized (CacheConfig.kv_bits)

    def __post_init__(self) -> None:
        require_int("num_layers", self.num_layers)
        require_int("dtype_bytes", self.dtype_bytes, low=1)
        for name in ("num_kv_heads", "head_dim"):
            if self.num_layers or getattr(self, name) is not None:
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
            if isinstance(window, int):  # a Chunked checks itself
                require_int("a sliding window", window, low=1)

    @property
    def layer_geometries(self) -> tuple[KVGeometry, ...]:
        if self.geometries is not None or not self.num_layers:
            return self.geometries or ()
        heads, dim = self.num_kv_heads, self.head_dim
        if heads is None or dim is None:  # __post_init__ refuses it
            raise ValueError("a model with layers needs num_kv_heads and head_dim")
        return (KVGeometry(heads, dim, dim),) * self.num_layers

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V of one token, in its own widths (a K-is-V layer once), quantized or not."""
        return sum(g.page_bytes(1, self.dtype_bytes, self.quantization) for g in self.layer_geometries)

    @property
    def layer_windows(self) -> tuple[LayerKind, ...]:
        return self.sliding_windows or (None,) * self.num_layers

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block id: a page in every pool (kv_cache.py), each in its own widths (0: no pools)."""
        return pool_block_bytes(
            self.layer_windows, self.layer_geometries, block_size, self.dtype_bytes, self.quantization
        )

    def space_block_bytes(self, block_size: int) -> tuple[int, ...]:
        """Bytes of one block id of each block space (specs.block_spaces; one space: `block_bytes`)."""
        return space_block_bytes(
            self.layer_windows, self.layer_geometries, block_size, self.dtype_bytes, self.quantization
        )

    @property
    def block_spaces(self) -> tuple[tuple[int, ...], ...]:
        """The layer groups (indices) of each block space, as the pools and the cache manager take them."""
        return block_spaces(group_layers(self.layer_windows), self.layer_geometries)

    def quantized(self, quantization: KVQuantization | None) -> KVShape:
        """This shape with its pages stored as `quantization` says (ConfigError: a width it cannot split)."""
        if quantization is not None:
            quantization.check_widths([w for g in self.layer_geometries for w in (g.k_dim, g.v_dim)])
        return dataclasses.replace(self, quantization=quantization)

    def table_specs(self, block_size: int) -> tuple[KVCacheSpec, ...]:
        """The spec of each layer group's table, as the pools group the layers (kv_cache.PagedKVCache.specs)."""
        return tuple(group.spec(block_size) for group in group_layers(self.layer_windows))

    @classmethod
    def from_layout(cls, layout: ModelLayout, dtype_bytes: int) -> KVShape:
        """One entry per KV leaf (a layer reusing another's K/V has none: counted once); a model of state
        layers only has none at all. Raises ValueError for a model that keeps neither."""
        if layout.keeps_no_cache:
            raise ValueError(f"model type {layout.model_type!r} keeps no key/value cache")
        geometries, kinds = layout.kv_geometries, layout.layer_kinds
        first = geometries[0] if geometries else None
        uniform = first is not None and set(geometries) == {KVGeometry(first.kv_heads, first.k_dim, first.k_dim)}
        heads, width = (first.kv_heads, first.k_dim) if first is not None else (None, None)
        return cls(
            len(geometries),
            heads,
            width,
            dtype_bytes,
            kinds if any(k is not None for k in kinds) else None,
            None if uniform or first is None else geometries,
        )


@dataclass(frozen=True)
class TowerRung:
    """A vision tower's activations (`bytes`) for the largest image of at most `pixels` (before the processor's
    resize), which the processor makes `patches` patches."""

    pixels: int
    patches: int
    bytes: int


@dataclass(frozen=True)
class ModelFacts:
    """The model as the planner needs it."""

    kv: KVShape
    weight_bytes: int
    hidden_size: int
    vocab_size: int
    context_length: int | None = None  # max_position_embeddings
    state_bytes_per_sequence: int = 0  # state-space layers' state of one sequence (state slots)
    takes_images: bool = False  # a vision-language model loaded with its tower (it keeps encoded images)
    # Its vision tower's activations for images of up to each candidate size, largest first (vision/tower_memory.py):
    # the plan takes the largest that fits (memory.py), larger images are scaled down to it.
    tower_rungs: tuple[TowerRung, ...] = ()

    def __post_init__(self) -> None:
        require_int("weight_bytes", self.weight_bytes)
        require_int("state_bytes_per_sequence", self.state_bytes_per_sequence)
        require_int("hidden_size", self.hidden_size, low=1)
        require_int("vocab_size", self.vocab_size, low=1)
        if self.context_length is not None:
            require_int("context_length", self.context_length, low=1)

    @classmethod
    def from_layout(
        cls,
        layout: ModelLayout,
        weight_bytes: int,
        kv_dtype_bytes: int,
        context_length: int | None = None,
        takes_images: bool = False,
    ) -> ModelFacts:
        """From a layout the pools can hold (paged_support.unsupported_reasons is empty)."""
        return cls(
            KVShape.from_layout(layout, kv_dtype_bytes),
            weight_bytes,
            layout.hidden_size,
            layout.vocab_size,
            context_length,
            layout.state_bytes_per_sequence,
            takes_images,
        )


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
    from mlx.utils import tree_reduce

    return tree_reduce(lambda total, value: total + value.nbytes, model.parameters(), 0)
