"""DFlash drafters (`speculative="dflash"` with `draft_model=`, `--speculative dflash --draft-model PATH`): a small
block-diffusion model published beside a target (z-lab's `*-DFlash` checkpoints) that drafts a whole block of tokens in
one pass, conditioned on several of the target's layers (read from mlx-vlm 0.7's `speculative/drafters/qwen3_dflash`).

Its layers attend over a context of the target's positions and over the block itself, both ways (not causally):

    context[q] = hidden_norm(fc(concat(target layer outputs at q, for each of target_layer_ids)))
    each layer: K/V of the context (k_proj, v_proj of context[q], k_norm, RoPE at q), kept per position;
                the block [last token, mask, ..., mask] at the positions after the context attends to the context's
                K/V and its own; h = norm(...); the target's LM head over the mask positions gives the drafts.

A drafter's sliding-window layers (`layer_types`, `sliding_window` W, as mlx-vlm reads them) see only the last W - 1
positions of the context before the block (mlx-vlm keeps them in a rotating cache), and the block both ways, or, when
the drafter is causal, each position the W keys up to itself; `attention_sink_bias` gives each head a sink logit. A
draft window (`draft_window_size` D in its dflash_config) bounds every layer's context to the last D positions before
the block. mlx-vlm keeps those in a cache that grows up to 64 keys past D before it drops the older ones (slack for
its own rollbacks, so its block sees between D and D + 64 of them, by when it last compacted); here the bound is
exactly D at every step, whatever the steps were (a prefill in chunks, a prefix hit, a preemption). The drafter's
pages still hold every position's K/V (every window is a mask), so a prefix hit serves every layer alike.

The context's K/V depend on the target's hidden states only, so a position's are the same for every sequence that
shares it (a prefix-cache block). The drafter on the paged cache is runner/dflash_drafter.py; the embedding and the
LM head are the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.errors import ConfigError
from mlxpaged.loading.draft_model import drafter_facts, read_drafter_weights
from mlxpaged.platform.model_facts import KVShape, ModelFacts

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP  # the gated SiLU MLP both drafters' layers use
from mlx_lm.models.rope_utils import initialize_rope


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    causal: bool
    final_logit_softcapping: float | None
    layer_types: tuple[str, ...] = ()  # "full_attention" or "sliding_attention" per layer; (): all full
    sliding_window: int | None = None
    attention_sinks: bool = False  # a sink logit per head in every layer (`attention_sink_bias`)
    draft_window: int | None = None  # every layer sees only the last this many context positions (`draft_window_size`)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full attention)."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def mask_bounds(self, layer: int) -> tuple[int | None, int | None]:
        """(window, context) of layer `layer`'s block mask (PagedCacheView.make_mask): a causal drafter's sliding
        window over the block's own keys (None: none), and the most context positions before the block it sees (None:
        all). Both ways, a sliding layer sees the last W - 1 of the context; a draft window bounds every layer's."""
        window = self.window(layer)
        if self.causal:
            return window, self.draft_window
        bounds = [bound for bound in (window - 1 if window else None, self.draft_window) if bound is not None]
        return None, min(bounds) if bounds else None

    @classmethod
    def read(cls, path: Path, name: str) -> DFlashConfig:
        """The drafter's config.json; ConfigError for a checkpoint that is not a DFlash drafter, or one of a kind not
        built here (layer kinds other than full and sliding attention)."""
        return cls.from_dict(json.loads((path / "config.json").read_text()), name)

    @classmethod
    def from_dict(cls, config: dict, name: str) -> DFlashConfig:
        flash = config.get("dflash_config") or {}
        if "mask_token_id" not in {**config, **flash} or "target_layer_ids" not in {**config, **flash}:
            raise ConfigError(
                f"{name!r} is not a DFlash drafter (its config.json has no dflash_config with mask_token_id and "
                "target_layer_ids): {speculative:'dflash'} needs one published for the model",
                param="draft_model",
            )
        merged = {**config, **flash}
        layer_types = tuple(merged.get("layer_types") or ())
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ConfigError(
                f"the DFlash drafter {name!r} has layers of kind {unknown}: not built", param="draft_model"
            )
        if layer_types and len(layer_types) != merged["num_hidden_layers"]:
            raise ConfigError(
                f"the DFlash drafter {name!r} gives {len(layer_types)} layer_types for {merged['num_hidden_layers']} "
                "layers",
                param="draft_model",
            )
        window = merged.get("sliding_window")
        if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 1):
            raise ConfigError(
                f"the DFlash drafter {name!r} has sliding-window layers but no sliding_window above 1 ({window!r})",
                param="draft_model",
            )
        draft_window = merged.get("draft_window_size")
        if draft_window is not None and not (isinstance(draft_window, int) and draft_window >= 0):
            raise ConfigError(
                f"the DFlash drafter {name!r} has a draft_window_size that is not a count of positions "
                f"({draft_window!r})",
                param="draft_model",
            )
        rope = dict(merged.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", merged.get("rope_theta", 10000.0))
        heads = merged["num_attention_heads"]
        return cls(
            hidden_size=merged["hidden_size"],
            intermediate_size=merged["intermediate_size"],
            num_hidden_layers=merged["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=merged.get("num_key_value_heads", heads),
            head_dim=merged.get("head_dim") or merged["hidden_size"] // heads,
            rms_norm_eps=merged.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or merged.get("rope_scaling"),
            max_position_embeddings=merged.get("max_position_embeddings", 262144),
            block_size=merged.get("block_size", 16),
            mask_token_id=int(merged["mask_token_id"]),
            target_layer_ids=tuple(merged["target_layer_ids"]),
            causal=bool(merged.get("causal", merged.get("dflash_query_causal", False))),
            final_logit_softcapping=merged.get("final_logit_softcapping"),
            layer_types=layer_types,
            sliding_window=window if "sliding_attention" in layer_types else None,
            attention_sinks=bool(merged.get("attention_sink_bias", False)),
            draft_window=draft_window or None,  # 0 or none: the whole context (mlx-vlm's reading)
        )


class _Attention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        width, heads, kv_heads, dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.heads, self.kv_heads, self.scale, self.causal = heads, kv_heads, dim**-0.5, config.causal
        self.q_proj = nn.Linear(width, heads * dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, width, bias=False)
        self.q_norm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            dim, config.rope_theta, False, config.rope_scaling, config.max_position_embeddings
        )  # Qwen's split-half pairing
        if config.attention_sinks:
            self.attention_sink_bias = mx.zeros((heads,))

    def _keys_values(self, x: mx.array, view) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(keys, offset=view.offset), values

    def context(self, h_ctx: mx.array, view) -> None:
        """Write the context's K/V at the view's positions (lazily, into the pools)."""
        view.update_and_fetch(*self._keys_values(h_ctx, view))

    def __call__(self, x: mx.array, view, mask) -> mx.array:
        """The blocks `x` [B, L, H] at the view's positions, each attending over its row's context and itself."""
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=view.offset)
        keys, values = view.update_and_fetch(*self._keys_values(x, view))
        sinks = getattr(self, "attention_sink_bias", None)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask, sinks=sinks)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _Layer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = _Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, view, mask) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), view, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter's layers (see the module docstring); its pages hold each layer's context and block K/V."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [_Layer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def write_context(self, target_hidden: mx.array, views: list) -> None:
        """The context of the target's layer outputs [B, S, n * H] at the views' positions, into every layer's pages."""
        h_ctx = self.hidden_norm(self.fc(target_hidden))
        for layer, view in zip(self.layers, views, strict=True):
            layer.self_attn.context(h_ctx, view)

    def __call__(self, embeds: mx.array, views: list) -> mx.array:
        """The blocks' embeddings [B, L, H] at the views' positions (each after its row's context) -> their hidden
        states, normed. A block attends both ways (or causally, as the drafter's config says), over its own row: all
        of its context, or its last positions as the layer's bounds say (DFlashConfig.mask_bounds)."""
        length, causal = embeds.shape[1], self.config.causal
        bounds = [self.config.mask_bounds(index) for index in range(len(self.layers))]
        masks: dict[tuple[int | None, int | None], mx.array] = {}
        for window, context in bounds:  # all before the first layer writes: a view's mask is for its next write
            if (window, context) not in masks:
                masks[window, context] = views[0].make_mask(
                    length, return_array=True, window_size=window, both_ways=not causal, context=context
                )
        h = embeds
        for layer, view, bound in zip(self.layers, views, bounds, strict=True):
            h = layer(h, view, masks[bound])
        return self.norm(h)

    def logits(self, head, hidden: mx.array) -> mx.array:
        """The target's LM head over the drafter's hidden states (soft-capped as the drafter's config says)."""
        logits = head(hidden)
        cap = self.config.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits


def dflash_facts(config: DFlashConfig, path: Path, target: ModelFacts, backend: str) -> ModelFacts:
    """What the drafter costs the memory plan beside the model: its weights and per token K/V of each of its layers,
    in the model's K/V dtype."""
    shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, target.kv.dtype_bytes)
    return drafter_facts(path, "DFlash drafter", _used, shape, target, backend)


def dflash_facts_before_load(facts: ModelFacts, layout, name: str, path: Path, draft: str) -> ModelFacts:
    """The model's `facts` and `layout` (checkpoint.read_before_load) with the DFlash drafter in `path`, as the memory
    plan counts the pair before either is read; ConfigError for a drafter or a model that cannot draft so."""
    from mlxpaged.loading.draft_model import check_draft_layout, with_draft
    from mlxpaged.platform import backend

    check_draft_layout(layout, "model", name)
    config = DFlashConfig.read(path, draft)
    if layout.num_layers is not None:
        check_dflash_target(config, draft, facts.hidden_size, layout.num_layers, layout.vocab_size)
    return with_draft(facts, dflash_facts(config, path, facts, backend.current()))


def _used(name: str) -> bool:
    """Not the embedding and LM head some drafters ship: the target's are used."""
    return name.removeprefix("model.") not in ("embed_tokens.weight", "lm_head.weight")


def load_dflash(path: Path, name: str, dtype: mx.Dtype) -> DFlashModel:
    """The DFlash drafter in `path`, floating weights in `dtype` (the target's activations')."""
    config = DFlashConfig.read(path, name)
    model = DFlashModel(config)
    weights = read_drafter_weights(path, "DFlash drafter", _used)
    if any(key.endswith(".scales") for key in weights):
        settings = json.loads((path / "config.json").read_text()).get("quantization") or {}
        nn.quantize(
            model,
            group_size=settings.get("group_size", 64),
            bits=settings.get("bits", 4),
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ConfigError(f"the DFlash drafter {name!r} does not fit its config: {exc}", param="draft_model") from exc
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def check_dflash_target(config: DFlashConfig, name: str, hidden_size: int, num_layers: int, vocab_size: int) -> None:
    """The drafter reads the target's layers and writes through its head: their widths and count must fit."""
    reason = None
    if config.hidden_size != hidden_size:
        reason = f"its width is {config.hidden_size}, the model's {hidden_size}"
    elif max(config.target_layer_ids) >= num_layers:
        reason = f"it reads layers {list(config.target_layer_ids)}, the model has {num_layers}"
    elif config.mask_token_id >= vocab_size:
        reason = f"its mask token {config.mask_token_id} is past the model's vocabulary ({vocab_size})"
    if reason is not None:
        raise ConfigError(f"the DFlash drafter {name!r} was not made for this model: {reason}", param="draft_model")
