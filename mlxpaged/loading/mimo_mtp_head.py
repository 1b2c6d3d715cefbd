"""MiMo's multi-token-prediction layers (Xiaomi's MiMo-7B checkpoints keep them as `model.mtp_layers.<i>.*`, which
mlx-lm's mimo `sanitize` drops); found by loading/mtp_head.py, built here.

Each MTP layer is a decoder layer of the model's own kind (mlx-lm's mimo `TransformerBlock`) with its own norms and
projection around it (vLLM's `MiMoMultiTokenPredictorLayer`; note the hidden state comes first, unlike DeepSeek's):

    x = input_proj([hidden_layernorm(hidden[q]), token_layernorm(embed(token[q + 1]))])
    x = block(x)             # a KV cache of its own (pages here)
    h = final_layernorm(x)   # the model's LM head over h predicts token[q + 2]; h stands in for hidden[q + 1]

The checkpoints ship several (`num_nextn_predict_layers`, one per depth); vLLM drafts one token with the first. Here
the first drafts every token of a chain, fed its own output as Qwen 3.5's MTP layers are: the model's verify pass
keeps what it would have written, so the output is the same, only the later drafts are kept less often.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import mimo
from mlx_lm.models.base import create_attention_mask

MODEL_TYPE = "mimo"
PREFIX = "model.mtp_layers.0."
_OWN = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight")


class MimoMtpHead(nn.Module):
    """MiMo's first MTP layer (see the module docstring); the embedding and the LM head are the model's."""

    def __init__(self, text_config: dict):
        super().__init__()
        args = mimo.ModelArgs.from_dict(text_config)
        width, eps = args.hidden_size, args.rms_norm_eps
        self.token_layernorm = nn.RMSNorm(width, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(width, eps=eps)
        self.input_proj = nn.Linear(2 * width, width, bias=False)
        self.layers = [mimo.TransformerBlock(args)]
        self.final_layernorm = nn.RMSNorm(width, eps=eps)

    @property
    def paged_layers(self) -> int:
        """Layers with pages of their own: its block."""
        return 1

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """`embeds` [B, L, H] of the tokens at q + 1, `hidden` [B, L, H] the model's at q -> [B, L, H], normed."""
        x = self.input_proj(mx.concatenate([self.hidden_layernorm(hidden), self.token_layernorm(embeds)], axis=-1))
        x = self.layers[0](x, create_attention_mask(x, cache[0]), cache[0])
        return self.final_layernorm(x)


def mimo_mtp_weights(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """The first MTP layer's tensors (names after `model.mtp_layers.0.`) as MimoMtpHead names them."""
    return {name if name in _OWN else f"layers.0.{name}": tensor for name, tensor in tensors.items()}
