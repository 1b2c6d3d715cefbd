"""The language half of a vision-language model, as the engine runs every model: mlx-lm's calling convention.

mlx-vlm's language models (`Model.language_model`) take `inputs_embeds`, return a LanguageModelOutput and make
mlx-vlm's own cache classes. The engine calls `model(tokens, cache=views)` for logits and reads the cache layout
from mlx-lm's caches (loading/probe.py), so this wraps the language model: logits out; `make_cache()` gives
mlx-lm's class for each cache mlx-vlm's would be (the same kinds: the probe records what each is written and
read, not its class); a prefill pass's image embeddings and the model's own per-prompt arguments (M-RoPE
positions, ...) are passed through. The paged views stand in for mlx-vlm's caches as they do for mlx-lm's
(`offset`, `update_and_fetch`, `make_mask`), and its attention is routed the same way (runner/routing.py).
"""

from __future__ import annotations

from types import SimpleNamespace

from mlxpaged.cache.state_updates import StateUpdates
from mlxpaged.vision import compile_fixes
from mlxpaged.vision.positions import takes_positions

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache


class VisionLanguageModel(nn.Module):
    """mlx-vlm's `vlm.language_model` with mlx-lm's interface; `vlm` itself (the vision tower, the projector)
    is not a child: the engine's passes, probes and GPU rewrites (fused projections) see the language model
    only."""

    def __init__(self, language_model: nn.Module, model_type: str, masks_given: bool = False):
        super().__init__()
        compile_fixes.install()  # before any pass is traced
        self.language_model = language_model
        self.args = SimpleNamespace(model_type=model_type)  # what loading/probe.py names the model by
        self.takes_positions = takes_positions(language_model)  # M-RoPE: every pass passes position_ids
        # PaliGemma's language model attends both ways over the prompt by making no mask at all, which over a ragged
        # pass's gathered pages would admit other rows' padding: every pass is given its views' mask instead.
        self.masks_given = masks_given
        # PaliGemma 2's (Gemma 2's) attention adds the mask to its soft-capped scores itself: it takes arrays only.
        text_config = getattr(language_model, "config", None)
        self._array_masks = getattr(text_config, "model_type", None) == "gemma2"

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        inputs_embeds: mx.array | None = None,
        hidden_out: list | None = None,
        **kwargs,
    ) -> mx.array:
        """Logits; with `hidden_out` (a model that `returns_hidden`), its last hidden states [B, L, H] (after the
        final norm: the LM head's input) are appended to it."""
        if hidden_out is not None:
            kwargs["return_hidden"] = True
        if self.masks_given and cache:
            length = (inputs_embeds if inputs_embeds is not None else inputs).shape[1]
            kwargs["mask"] = cache[0].make_mask(
                length, return_array=self._array_masks, window_size=None
            )  # or both ways
        try:
            out = self.language_model(inputs, inputs_embeds=inputs_embeds, cache=cache, **kwargs)
        finally:  # also when a pass stops early (runner/embedding_scale.py's probe stops at the first layer)
            if self.takes_positions:
                forget_sequence_positions(self.language_model)
        if hidden_out is not None:
            hidden_out.append(out.hidden_states[-1])
        return out.logits if hasattr(out, "logits") else out

    @property
    def returns_hidden(self) -> bool:
        """mlx-vlm's Qwen 3.5 language models hand back their last hidden states (`return_hidden`) on every path."""
        return self.args.model_type in HIDDEN_STATES_MODEL_TYPES

    @property
    def embed_tokens(self) -> nn.Module:
        return self.language_model.model.embed_tokens

    def logits_from_hidden(self, hidden: mx.array) -> mx.array:
        """The LM head over hidden states (tied to the embedding or not)."""
        return self.language_model.speculative_logits_from_hidden(hidden)

    @property
    def layers(self) -> list:
        inner = getattr(self.language_model, "model", None)
        layers = getattr(inner, "layers", None) if inner is not None else None
        return layers if layers is not None else self.language_model.layers

    def make_cache(self) -> list:
        from mlx_vlm.models.cache import make_prompt_cache

        return [as_mlx_lm_cache(c) for c in make_prompt_cache(self.language_model)]


# mlx-vlm's language models whose `__call__` returns the last hidden states on every path it takes for the engine
# (read from mlx-vlm 0.7.10's models/qwen3_5/language.py: its general path and its verifier for image prompts).
HIDDEN_STATES_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe"})

# mlx-vlm's M-RoPE language models keep the last sequence's positions and delta for the calls after it that pass none.
_SEQUENCE_POSITIONS = ("_position_ids", "_rope_deltas")


def forget_sequence_positions(language_model: nn.Module) -> None:
    """Drop the positions an M-RoPE language model kept of its last call: the engine gives every pass its positions
    (positions.py), and arrays kept from a pass built on another thread (an engine's probe: GLM-4V keeps a lazy
    `arange` there) or inside a compiled trace cannot be evaluated by the next one."""
    for name in _SEQUENCE_POSITIONS:
        if getattr(language_model, name, None) is not None:
            setattr(language_model, name, None)


class ArraysCacheWithUpdates(StateUpdates, mlx_cache.ArraysCache):
    """mlx-lm's ArraysCache that also takes mlx-vlm's state updates (Qwen3.5's gated-delta layers write so)."""


def as_mlx_lm_cache(cache):
    """mlx-lm's cache of the same kind as mlx-vlm's `cache` (by class name and settings); a kind mlx-lm has not
    is kept as it is, and the probe refuses it by its class name (no paged equivalent)."""
    if cache is None:
        return None
    kind = type(cache).__name__
    if kind == "KVCache":
        return mlx_cache.KVCache()
    if kind == "RotatingKVCache":
        return mlx_cache.RotatingKVCache(cache.max_size, keep=cache.keep)
    if kind == "ChunkedKVCache":
        return mlx_cache.ChunkedKVCache(cache.chunk_size)
    if kind == "ArraysCache":
        return ArraysCacheWithUpdates(len(cache.cache))
    if kind == "CacheList":
        return mlx_cache.CacheList(*(as_mlx_lm_cache(c) for c in cache.caches))
    return cache
