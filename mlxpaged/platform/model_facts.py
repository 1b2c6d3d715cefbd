"""What a model costs the KV cache planner: its KV shape per token, its weights, its context.

Built from the loaded model (Engine) or, before loading, from its files (checkpoint.py); both
read config.json through `ModelFacts.from_config`, so the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mlxpaged.validation import require_int


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the KV cache. `sliding_windows` has one entry per layer:
    None for full attention, else the window in tokens (such a layer keeps only recent blocks);
    None for all: no layer slides."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            require_int(name, getattr(self, name), low=1)
        if self.sliding_windows is None:
            return
        windows = tuple(self.sliding_windows)
        object.__setattr__(self, "sliding_windows", windows)
        if len(windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(windows)} entries for {self.num_layers} layers")
        for window in windows:
            if window is not None:
                require_int("a sliding window", window, low=1)

    @property
    def layer_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return self.num_layers * self.layer_bytes_per_token

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.sliding_windows or (None,) * self.num_layers


@dataclass(frozen=True)
class ModelFacts:
    """The model as the planner needs it."""

    kv: KVShape
    weight_bytes: int
    hidden_size: int
    vocab_size: int
    context_length: int | None = None  # max_position_embeddings

    def __post_init__(self) -> None:
        require_int("weight_bytes", self.weight_bytes)
        require_int("hidden_size", self.hidden_size, low=1)
        require_int("vocab_size", self.vocab_size, low=1)
        if self.context_length is not None:
            require_int("context_length", self.context_length, low=1)

    @classmethod
    def from_config(cls, config: dict, weight_bytes: int, kv_dtype_bytes: int,
                    sliding_windows: Sequence[int | None] | None = None) -> ModelFacts:
        """From a Hugging Face style config.json dict; the per-layer windows come from mlx-lm's model
        (`cache_view.layer_windows`, loaded or unweighted), since configs spell them several ways."""
        heads = _config_value(config, "num_attention_heads")
        hidden = _config_value(config, "hidden_size")
        layers = _config_value(config, "num_hidden_layers")
        kv = KVShape(layers, config.get("num_key_value_heads") or heads,
                     config.get("head_dim") or hidden // heads, kv_dtype_bytes, sliding_windows)
        return cls(kv, weight_bytes, hidden, _config_value(config, "vocab_size"),
                   config.get("max_position_embeddings"))


def _config_value(config: dict, key: str) -> int:
    if key not in config:
        raise ValueError(f"model config has no {key!r}; cannot size the KV cache")
    return config[key]


def model_weight_bytes(model) -> int:
    """Bytes of every parameter of an mlx.nn.Module (quantization scales included)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
