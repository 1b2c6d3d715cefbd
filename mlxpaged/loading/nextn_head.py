"""The DeepSeek-V3 layout of multi-token-prediction layers ("nextn"): DeepSeek-V3 / Kimi K2, GLM-4.5 / 4.6
(`glm4_moe`) and GLM-4.7-Flash (`glm4_moe_lite`) ship theirs as one more decoder layer after the model's,
`model.layers.<num_hidden_layers>.*`, which mlx-lm's `sanitize` drops. loading/mtp_head.py finds them; this module
builds and loads them.

At position q, with the model's last hidden state there (after its final norm) and the embedding of the token at
q + 1 (as vLLM's `DeepSeekMultiTokenPredictorLayer` computes it):

    x = eh_proj([enorm(embed(token[q + 1])), hnorm(hidden[q])])
    x = block(x)                    # a decoder layer of the model's own kind (MLA, MoE), a KV cache of its own
    logits = head(shared_head.norm(x))      # predicts token[q + 2]; x itself stands in for hidden[q + 1] when
                                            # drafting on (not its norm: vLLM feeds the block's output back)

`embed_tokens` and `shared_head.head` are the layer's own when the checkpoint ships them (DeepSeek-V3's and GLM's
do; they may equal the model's), else the model's. The block's tensors come as Hugging Face stores them (experts one
by one, MLA's fused `kv_b_proj`, fp8 with block scales): mlx-lm's own `sanitize` of the model's module converts them,
fed as if they were layer 0's. vLLM zeroes the embedding at position 0 ("not needed by MTP"); here position 0 is fed
as any other (it only changes what the block's cache holds there, so how many drafts are kept).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

# model type -> (its mlx-lm decoder layer class, whether its attention takes the mask as an array: MLA's does)
NEXTN_BLOCKS = {
    "deepseek_v3": ("DeepseekV3DecoderLayer", True),
    "kimi_k2": ("DeepseekV3DecoderLayer", True),
    "glm4_moe": ("DecoderLayer", False),
    "glm4_moe_lite": ("Glm4MoeLiteDecoderLayer", True),
}
_MODULES = {"kimi_k2": "deepseek_v3"}  # model types served by another type's mlx-lm module
_OWN = {  # the layer's tensors outside its decoder block -> NextnHead's names
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "shared_head_norm.weight",
    "shared_head.head.weight": "lm_head.weight",
    "embed_tokens.weight": "embed_tokens.weight",
}


def module_for(model_type: str):
    """The mlx-lm module of `model_type`'s model (its ModelArgs, decoder layer and sanitize)."""
    return importlib.import_module(f"mlx_lm.models.{_MODULES.get(model_type, model_type)}")


class NextnHead(nn.Module):
    """One nextn layer (see the module docstring). `layers` holds its block alone: one layer of pages."""

    def __init__(self, text_config: dict, own_embedding: bool, own_head: bool):
        super().__init__()
        model_type = text_config["model_type"]
        block_class, self._array_mask = NEXTN_BLOCKS[model_type]
        module = module_for(model_type)
        args = module.ModelArgs.from_dict(text_config)
        width, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(width, eps=eps)
        self.hnorm = nn.RMSNorm(width, eps=eps)
        self.eh_proj = nn.Linear(2 * width, width, bias=False)
        # The layer index the checkpoint gives it: past the last dense layer, so MoE where the model's are.
        self.layers = [getattr(module, block_class)(args, args.num_hidden_layers)]
        self.shared_head_norm = nn.RMSNorm(width, eps=eps)
        if own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, width)
        if own_head:
            self.lm_head = nn.Linear(width, args.vocab_size, bias=False)

    @property
    def paged_layers(self) -> int:
        """Layers with pages of their own: its block."""
        return 1

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """`embeds` [B, L, H] of the tokens at q + 1, `hidden` [B, L, H] the model's at q -> the block's output."""
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0], return_array=self._array_mask)
        return self.layers[0](x, mask, cache[0])

    def logits_input(self, outputs: mx.array) -> mx.array:
        """What the LM head reads of the block's `outputs`."""
        return self.shared_head_norm(outputs)


def nextn_weights(text_config: dict, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """The layer's tensors (names after `model.layers.<N>.`) as NextnHead names them: the block's converted by the
    model module's own sanitize, fed as layer 0's (mlx-lm's sanitize loops over the model's layers only)."""
    model_type = text_config["model_type"]
    module = module_for(model_type)
    args = module.ModelArgs.from_dict(text_config)
    own = {_OWN[name]: tensor for name, tensor in tensors.items() if name in _OWN}
    block = {f"model.layers.0.{name}": t for name, t in tensors.items() if name not in _OWN}
    converted = module.Model.sanitize(SimpleNamespace(args=args), block)
    prefix = "model.layers.0."
    own.update({f"layers.0.{name[len(prefix) :]}": t for name, t in converted.items() if name.startswith(prefix)})
    return own
