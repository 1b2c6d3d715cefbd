"""Nemotron-H's multi-token-prediction module (NVIDIA's Nemotron-H / Nemotron 3 checkpoints that ship `mtp.*`
tensors, which mlx-lm's nemotron_h `sanitize` drops); found by loading/mtp_head.py, built here.

Its layers follow their own small pattern (`mtp_hybrid_override_pattern`, or `mtp_layers_block_type`: attention
"*" and MoE "E" blocks, the model's own `NemotronHBlock`s); the first holds `enorm`, `hnorm` and `eh_proj`, the last
`final_layernorm` (read from mlx-vlm 0.7's `speculative/drafters/nemotron_h_mtp`):

    x = eh_proj([enorm(embed(token[q + 1])), hnorm(hidden[q])])
    x = blocks(x)            # attention blocks with a KV cache of their own (pages here), MoE blocks without
    h = final_layernorm(x)   # the model's LM head over h predicts token[q + 2]; h stands in for hidden[q + 1]

The experts come as Hugging Face stores them, converted by the model module's own sanitize over the module's pattern.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import nemotron_h
from mlx_lm.models.base import create_attention_mask

MODEL_TYPE = "nemotron_h"
BLOCKS = ("*", "E")  # the kinds of block an MTP module holds (mlx-vlm's rule)
_FIRST = ("enorm.weight", "hnorm.weight", "eh_proj.weight")  # on its first layer in the checkpoint
_LAST = "final_layernorm.weight"  # on its last


def mtp_pattern(text_config: dict) -> list[str] | None:
    """The module's block kinds ("*" / "E"), from the config's own spelling; None when it names none."""
    pattern = text_config.get("mtp_hybrid_override_pattern")
    if pattern is None and text_config.get("mtp_layers_block_type") is not None:
        names = nemotron_h.ModelArgs._block_type_to_char
        pattern = [names.get(name, "?") for name in text_config["mtp_layers_block_type"]]
    return list(pattern) if pattern else None


def _args(text_config: dict, pattern: list[str]) -> nemotron_h.ModelArgs:
    fields = {**text_config, "hybrid_override_pattern": pattern, "layers_block_type": None, "layer_types": None}
    return nemotron_h.ModelArgs.from_dict(fields)


class NemotronMtpHead(nn.Module):
    """Nemotron-H's MTP module (see the module docstring); the embedding and the LM head are the model's."""

    def __init__(self, text_config: dict, pattern: list[str]):
        super().__init__()
        args = _args(text_config, pattern)
        width, eps = args.hidden_size, args.layer_norm_epsilon
        self.enorm = nn.RMSNorm(width, eps=eps)
        self.hnorm = nn.RMSNorm(width, eps=eps)
        self.eh_proj = nn.Linear(2 * width, width, bias=False)
        self.layers = [nemotron_h.NemotronHBlock(args, kind) for kind in pattern]
        self.final_layernorm = nn.RMSNorm(width, eps=eps)

    @property
    def paged_layers(self) -> int:
        """The blocks that attend, each with pages of its own."""
        return sum(layer.block_type == "*" for layer in self.layers)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """`embeds` [B, L, H] of the tokens at q + 1, `hidden` [B, L, H] the model's at q -> [B, L, H], normed;
        `cache`: one view per attention block, in order."""
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0])
        views = iter(cache)
        for layer in self.layers:
            x = layer(x, mask=mask, cache=next(views) if layer.block_type == "*" else None)
        return self.final_layernorm(x)


def nemotron_mtp_weights(text_config: dict, pattern: list[str], tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """The module's tensors (names after `mtp.`) as NemotronMtpHead names them: the first layer's projections and the
    last's norm at the top, the experts stacked by the model module's own sanitize (run over the module's pattern)."""
    last = len(pattern) - 1
    out: dict[str, mx.array] = {}
    blocks: dict[str, mx.array] = {}
    for name, tensor in tensors.items():
        if name.endswith((".k_scale", ".v_scale")):
            continue  # fp8 attention scales, unused here (as mlx-vlm drops them)
        short = next((own for own in _FIRST if name == f"layers.0.{own}"), None)
        if short is None and name == f"layers.{last}.{_LAST}":
            short = _LAST
        if short is not None:
            out[short] = tensor
        else:
            blocks[f"backbone.{name}"] = tensor
    # sanitize reads only `self.args` (as mlx-vlm calls it too)
    converted = nemotron_h.Model.sanitize(SimpleNamespace(args=_args(text_config, pattern)), blocks)  # type: ignore[arg-type]
    out.update({name.removeprefix("backbone."): tensor for name, tensor in converted.items()})
    return out
