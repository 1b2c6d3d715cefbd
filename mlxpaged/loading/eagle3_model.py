"""EAGLE-3 draft heads (`speculative="eagle3"` with `draft_model=`, `--speculative eagle3 --draft-model PATH`): the
checkpoints SpecForge / Speculators / SGLang publish beside a target (one decoder layer, a head over a draft vocabulary
and its map to the target's ids), read from mlx-vlm 0.7's `speculative/drafters/eagle3`.

Position q of the head reads three of the target's layers at q and the token at q + 1, and predicts the token at
q + 2, as MTP layers do one position behind the model (runner/chained_drafter.py runs both):

    hidden = fc(concat(target layer outputs at q))                 # [3 H] -> [H]; a chained step feeds h instead
    x = first layer(input_layernorm(embed(token[q + 1])), hidden_norm(hidden))   # attention over [2 H], RoPE at q + 1
    h = more layers(x); logits = lm_head(norm(h)) over the draft vocabulary, id d -> d + d2t[d] in the target's

The head's pages hold each layer's K/V at the positions it took (slot q for position q, RoPE at q + 1, as mlx-vlm's
cache does: its first entry is the pair of position 0).
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
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3 import MLP  # the gated SiLU MLP EAGLE-3's layers use


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_traditional: bool
    attention_bias: bool
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: tuple[int, ...]  # the target's layers whose outputs it reads (mlx-vlm's capture_layer_ids)
    norm_before_residual: bool
    norm_before_fc: bool

    @classmethod
    def read(cls, path: Path, name: str) -> Eagle3Config:
        return cls.from_dict(json.loads((path / "config.json").read_text()), name)

    @classmethod
    def from_dict(cls, config: dict, name: str) -> Eagle3Config:
        """ConfigError for a checkpoint that is not an EAGLE-3 head."""
        text = config.get("transformer_layer_config")
        kind = config.get("speculators_model_type", config.get("model_type"))
        if not isinstance(text, dict) or kind != "eagle3":
            raise ConfigError(
                f"{name!r} is not an EAGLE-3 head (its config.json has no transformer_layer_config of an eagle3 "
                "model): {speculative:'eagle3'} needs one published for the model",
                param="draft_model",
            )
        heads = int(text.get("num_attention_heads") or 32)
        width = int(text.get("hidden_size") or 4096)
        layers = int(text.get("num_hidden_layers", 1))
        ids = config.get("target_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
        ids = list(ids) if ids else [2, layers // 2, max(layers - 3, 0)]  # mlx-vlm's default (of its own layers)
        rope = text.get("rope_parameters") or {}
        return cls(
            hidden_size=width,
            intermediate_size=text.get("intermediate_size", 11008),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=text.get("head_dim") or width // heads,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or text.get("rope_theta") or 10000.0),
            rope_traditional=bool(text.get("rope_traditional", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            vocab_size=text.get("vocab_size", 32000),
            draft_vocab_size=config.get("draft_vocab_size", 32000),
            target_hidden_size=config.get("target_hidden_size") or width,
            layer_ids=tuple(max(int(i) - 1, 0) for i in ids),  # hidden state i is layer i - 1's output
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            norm_before_fc=bool(config.get("norm_before_fc", False)),
        )


class _Attention(nn.Module):
    def __init__(self, config: Eagle3Config, input_size: int):
        super().__init__()
        heads, kv_heads, dim, bias = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.attention_bias,
        )
        self.heads, self.kv_heads, self.scale = heads, kv_heads, dim**-0.5
        self.q_proj = nn.Linear(input_size, heads * dim, bias=bias)
        self.k_proj = nn.Linear(input_size, kv_heads * dim, bias=bias)
        self.v_proj = nn.Linear(input_size, kv_heads * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, config.hidden_size, bias=bias)
        self.rope = nn.RoPE(dim, traditional=config.rope_traditional, base=config.rope_theta)

    def __call__(self, x: mx.array, mask, view) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        position = view.offset + 1  # the pair of position q sits in slot q; its token, and RoPE, at q + 1
        queries, keys = self.rope(queries, offset=position), self.rope(keys, offset=position)
        keys, values = view.update_and_fetch(keys, values)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _FirstLayer(nn.Module):
    """Attention over the token's embedding and the hidden state side by side."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = nn.RMSNorm(width, eps=eps)
        self.hidden_norm = nn.RMSNorm(width, eps=eps)
        self.self_attn = _Attention(config, 2 * width)
        self.post_attention_layernorm = nn.RMSNorm(width, eps=eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def __call__(self, embeds: mx.array, hidden: mx.array, mask, view) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        h = residual + self.self_attn(mx.concatenate([self.input_layernorm(embeds), normed], axis=-1), mask, view)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Layer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = _Attention(config, config.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def __call__(self, x: mx.array, mask, view) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, view)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The head (see the module docstring): `embed_tokens` its own (None: the model's), `draft_ids` its drafts."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.embed_tokens: nn.Module | None = nn.Embedding(config.vocab_size, width)  # None: the model's (loaded)
        self.fc = nn.Linear(3 * config.target_hidden_size, width, bias=False)
        if config.norm_before_fc:
            self.input_norm = nn.RMSNorm(3 * config.target_hidden_size, eps=config.rms_norm_eps)
        self.layers = [_FirstLayer(config), *[_Layer(config) for _ in range(1, config.num_hidden_layers)]]
        self.norm = nn.RMSNorm(width, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(width, config.draft_vocab_size, bias=False)
        self.d2t = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)  # draft id d -> d + d2t[d] (loaded)

    def __call__(self, embeds: mx.array, hidden: mx.array, views: list) -> mx.array:
        """`embeds` [B, L, H] of the tokens at q + 1, `hidden` [B, L, 3 H'] the target's layers at q (or [B, L, H]:
        the head's own output, chained) -> [B, L, H], not normed."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(self.input_norm(hidden) if self.config.norm_before_fc else hidden)
        mask = create_attention_mask(hidden, views[0])
        h = self.layers[0](embeds, hidden, mask, views[0])
        for layer, view in zip(self.layers[1:], views[1:], strict=True):
            h = layer(h, mask, view)
        return h

    def draft_ids(self, outputs: mx.array) -> mx.array:
        """The greedy drafts of outputs [B, H], in the target's token ids."""
        draft = mx.argmax(self.lm_head(self.norm(outputs)).astype(mx.float32), axis=-1).astype(mx.int32)
        return draft + self.d2t[draft]


def _kept(name: str) -> bool:
    """Tensors some checkpoints carry that the head does not use."""
    return not (name == "t2d" or name.startswith("verifier_") or "rotary_emb.inv_freq" in name)


def eagle3_facts(config: Eagle3Config, path: Path, target: ModelFacts, backend: str) -> ModelFacts:
    """What the head costs the memory plan beside the model: its weights (an embedding it does not ship is the
    model's) and per token K/V of each of its layers."""
    shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, target.kv.dtype_bytes)
    return drafter_facts(path, "EAGLE-3 head", _kept, shape, target, backend)


def eagle3_facts_before_load(facts: ModelFacts, layout, name: str, path: Path, draft: str) -> ModelFacts:
    """The model's `facts` and `layout` with the EAGLE-3 head in `path`, as the memory plan counts the pair before
    either is read; ConfigError for a head that was not made for the model."""
    from mlxpaged.loading.draft_model import check_draft_layout, with_draft
    from mlxpaged.platform import backend

    check_draft_layout(layout, "model", name)
    config = Eagle3Config.read(path, draft)
    check_eagle3_target(config, draft, facts.hidden_size, layout.num_layers, layout.vocab_size)
    return with_draft(facts, eagle3_facts(config, path, facts, backend.current()))


def check_eagle3_target(config: Eagle3Config, name: str, hidden: int, layers: int | None, vocab: int) -> None:
    """The head reads three of the target's layers and proposes the target's ids: their widths and counts must fit."""
    reason = None
    if config.target_hidden_size != hidden:
        reason = f"it reads layers {config.target_hidden_size} wide, the model's are {hidden}"
    elif layers is not None and max(config.layer_ids) >= layers:
        reason = f"it reads layers {list(config.layer_ids)}, the model has {layers}"
    elif config.vocab_size != vocab:
        reason = f"its vocabulary has {config.vocab_size} ids, the model's {vocab}"
    if reason is not None:
        raise ConfigError(f"the EAGLE-3 head {name!r} was not made for this model: {reason}", param="draft_model")


def load_eagle3(path: Path, name: str, dtype: mx.Dtype) -> Eagle3Head:
    """The EAGLE-3 head in `path`, floating weights in `dtype`. Without an embedding of its own, `embed_tokens` is
    None: the chained drafter uses the model's (shared, and not counted twice in the plan)."""
    head = Eagle3Head(Eagle3Config.read(path, name))
    weights = read_drafter_weights(path, "EAGLE-3 head", _kept)
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int32)
    elif head.config.draft_vocab_size != head.config.vocab_size:
        raise ConfigError(f"the EAGLE-3 head {name!r} has a draft vocabulary but no d2t map", param="draft_model")
    else:
        weights["d2t"] = head.d2t  # one vocabulary: ids map to themselves
    if "embed_tokens.weight" not in weights:
        head.embed_tokens = None
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ConfigError(f"the EAGLE-3 head {name!r} does not fit its config: {exc}", param="draft_model") from exc
    head.set_dtype(dtype)  # floating weights only: d2t stays an id map
    mx.eval(head.parameters())
    return head
