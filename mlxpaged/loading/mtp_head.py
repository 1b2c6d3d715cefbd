"""Multi-token-prediction (MTP) layers a checkpoint ships beside its model (`speculative="mtp"`, `--speculative mtp`):
Qwen 3.5 / 3.6 store them as `mtp.*` tensors, which mlx-lm's `sanitize` drops from the model, so they are read from
the checkpoint's safetensors here and built as a module of their own. The DeepSeek-V3 family and GLM 4.5+ store
theirs as one more decoder layer (`model.layers.<num_hidden_layers>.*`): found here, built by loading/nextn_head.py;
Nemotron-H's `mtp.*` module of its own block pattern: built by loading/nemotron_mtp_head.py; MiMo's
`model.mtp_layers.*`: by loading/mimo_mtp_head.py.

The MTP block at position q reads the model's last hidden state there (after its final norm) and the embedding of
the token at q + 1, and predicts the token at q + 2 through the model's own LM head:

    x = fc([pre_fc_norm_embedding(embed(token[q + 1])), pre_fc_norm_hidden(hidden[q])])
    x = layers(x)           # decoder layers of the model's own kind, full attention, a KV cache of their own
    h = norm(x)             # lm_head(h) predicts token[q + 2]; h stands in for hidden[q + 1] when drafting on

(read from mlx-vlm 0.7's `speculative/drafters/qwen3_5_mtp`). The drafter that runs it on the paged cache is
runner/chained_drafter.py. Hugging Face checkpoints store Qwen 3.5's RMSNorm weights zero-centred and mlx-lm adds 1.0
to the model's when it converts one (its sanitize, keyed on the unconverted conv1d weights); the MTP's norms follow
the model's checkpoint the same way.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.errors import ConfigError
from mlxpaged.loading.checkpoint import checkpoint_tensors, read_safetensors_header, weight_files
from mlxpaged.loading.mimo_mtp_head import MODEL_TYPE as MIMO
from mlxpaged.loading.mimo_mtp_head import PREFIX as MIMO_PREFIX
from mlxpaged.loading.mimo_mtp_head import MimoMtpHead, mimo_mtp_weights
from mlxpaged.loading.nemotron_mtp_head import BLOCKS, NemotronMtpHead, mtp_pattern, nemotron_mtp_weights
from mlxpaged.loading.nemotron_mtp_head import MODEL_TYPE as NEMOTRON
from mlxpaged.loading.nextn_head import NEXTN_BLOCKS, NextnHead, nextn_weights
from mlxpaged.platform.model_facts import KVShape, ModelFacts

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.base import create_attention_mask

MTP_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # whose MTP layers are built here (the Qwen 3.5 / 3.6 families)
SUPPORTED = (*MTP_MODEL_TYPES, *NEXTN_BLOCKS, NEMOTRON, MIMO)  # the nextn layout's, Nemotron-H's and MiMo's too
_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")  # RMSNorm weights, all of them
_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)")


@dataclass(frozen=True)
class MtpCheckpoint:
    """Where a checkpoint's MTP tensors are: `tensors` maps each name (the prefix through `mtp.` dropped) to its name
    in the files; `nbytes`: their bytes as stored."""

    path: Path
    config: dict
    tensors: dict[str, str]
    num_layers: int
    nbytes: int
    layout: str = "mtp"  # "mtp": Qwen's `mtp.*`; "nextn": the DeepSeek-V3 layout; "nemotron", "mimo": theirs
    pattern: tuple[str, ...] = ()  # Nemotron-H: the module's block kinds

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config") or self.config


def find_mtp(path: Path, name: str) -> MtpCheckpoint:
    """The MTP tensors of the checkpoint in `path` (from the safetensors headers: no weight is read); ConfigError,
    saying why, for a model type whose MTP layers are not built here or a checkpoint that ships none."""
    config = json.loads((path / "config.json").read_text())
    model_type = config.get("model_type")
    text_type = (config.get("text_config") or {}).get("model_type", model_type)
    if text_type in NEXTN_BLOCKS:
        return _find_nextn(path, name, config)
    if text_type == MIMO:
        return _find_mimo(path, name, config)
    if model_type not in (*MTP_MODEL_TYPES, NEMOTRON) and text_type not in (*MTP_MODEL_TYPES, NEMOTRON):
        raise ConfigError(
            f"{{speculative:'mtp'}} drafts with the multi-token-prediction layers of {', '.join(SUPPORTED)} "
            f"checkpoints; {name!r} is a {model_type!r} model",
            param="speculative",
        )
    tensors, nbytes = _tensors_after(path, "mtp.", anywhere=True)  # `mtp.*`, under a language model's prefix too
    if text_type == NEMOTRON or model_type == NEMOTRON:
        return _nemotron(path, name, config, tensors, nbytes)
    if "fc.weight" not in tensors:
        raise ConfigError(
            f"{name!r} ships no multi-token-prediction layers (no mtp.* tensors in its checkpoint; conversions by "
            "mlx-lm drop them): {speculative:'mtp'} needs a checkpoint that keeps them, such as the original "
            "Hugging Face one",
            param="speculative",
        )
    layers = {int(key.split(".")[1]) for key in tensors if key.startswith("layers.")}
    if not layers:
        raise ConfigError(f"{name!r}'s mtp.* tensors hold no decoder layer (mtp.layers.N)", param="speculative")
    return MtpCheckpoint(path, config, tensors, max(layers) + 1, nbytes)


def _nemotron(path: Path, name: str, config: dict, tensors: dict[str, str], nbytes: int) -> MtpCheckpoint:
    """Nemotron-H's module: its `mtp.*` tensors and the block pattern its config gives."""
    text = config.get("text_config") or config
    pattern = mtp_pattern(text)
    if "layers.0.eh_proj.weight" not in tensors or not pattern:
        raise ConfigError(
            f"{name!r} ships no multi-token-prediction module (no mtp.* tensors with an eh_proj, or no "
            "mtp_hybrid_override_pattern in its config; conversions by mlx-lm drop them): {speculative:'mtp'} needs a "
            "checkpoint that keeps it, such as the original Hugging Face one",
            param="speculative",
        )
    if any(kind not in BLOCKS for kind in pattern) or "*" not in pattern:
        raise ConfigError(
            f"{name!r}'s MTP module has blocks {''.join(pattern)!r}: attention ('*') and MoE ('E') blocks, one at "
            "least attending, are built here",
            param="speculative",
        )
    if int(text.get("num_nextn_predict_layers") or 1) != 1:
        raise ConfigError(f"{name!r} has several MTP modules: one is built here", param="speculative")
    return MtpCheckpoint(path, config, tensors, pattern.count("*"), nbytes, layout="nemotron", pattern=tuple(pattern))


def _find_mimo(path: Path, name: str, config: dict) -> MtpCheckpoint:
    """MiMo's first MTP layer: `model.mtp_layers.0.*`."""
    tensors, nbytes = _tensors_after(path, MIMO_PREFIX)
    _check_shipped(tensors, name, MIMO_PREFIX, "input_proj.weight")
    return MtpCheckpoint(path, config, tensors, 1, nbytes, layout="mimo")


def _find_nextn(path: Path, name: str, config: dict) -> MtpCheckpoint:
    """The DeepSeek-V3 layout: the layer after the model's, `model.layers.<num_hidden_layers>.*`."""
    text = config.get("text_config") or config
    depth = int(text.get("num_nextn_predict_layers") or 0)
    if depth > 1:
        raise ConfigError(
            f"{name!r} has {depth} nextn layers; {{speculative:'mtp'}} drafts with checkpoints of one (DeepSeek-V3's, "
            "GLM's): each of several would draft its own depth",
            param="speculative",
        )
    prefix = f"model.layers.{text['num_hidden_layers']}."
    tensors, nbytes = _tensors_after(path, prefix)
    _check_shipped(tensors, name, prefix, "eh_proj.weight")
    return MtpCheckpoint(path, config, tensors, 1, nbytes, layout="nextn")


def _tensors_after(path: Path, marker: str, anywhere: bool = False) -> tuple[dict[str, str], int]:
    """({name after `marker`: its name in the files}, their bytes as stored), from the safetensors headers: the
    tensors whose name starts with `marker` (`anywhere`: holds it; the name after its first)."""
    tensors, nbytes = {}, 0
    for tensor in checkpoint_tensors(path):
        head, found, rest = tensor.name.partition(marker)
        if found and (anywhere or not head):
            tensors[rest] = tensor.name
            nbytes += tensor.nbytes
    return tensors, nbytes


def _check_shipped(tensors: dict[str, str], name: str, prefix: str, marker: str) -> None:
    """ConfigError unless the layer's `marker` tensor is among `tensors` (a conversion by mlx-lm drops the layer)."""
    if marker not in tensors:
        raise ConfigError(
            f"{name!r} ships no multi-token-prediction layer (no {prefix}{marker.removesuffix('.weight')} tensor in "
            "its checkpoint; conversions by mlx-lm drop it): {speculative:'mtp'} needs a checkpoint that keeps it, "
            "such as the original Hugging Face one",
            param="speculative",
        )


def mtp_facts(checkpoint: MtpCheckpoint, target: ModelFacts, weight_bytes: int) -> ModelFacts:
    """What the MTP layers cost the memory plan beside the model (loading/draft_model.with_draft adds them): their
    weights and, per token, K/V of the model's full-attention width in each of their layers."""
    kv = target.kv
    geometries = kv.layer_geometries
    if not geometries:
        raise ConfigError("the MTP layers attend as the model's attention layers do; this model has none")
    shape = KVShape(checkpoint.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype_bytes)
    shape = dataclasses.replace(shape, geometries=(geometries[-1],) * checkpoint.num_layers)
    return dataclasses.replace(target, kv=shape, weight_bytes=weight_bytes, state_bytes_per_sequence=0)


def mtp_facts_before_load(facts: ModelFacts, path: Path, name: str) -> ModelFacts:
    """The model's `facts` (checkpoint.read_before_load) with its MTP layers' pages, as the memory plan counts the pair
    before the model is read: their weights are counted already (every tensor of the checkpoint is). ConfigError for
    a checkpoint without them."""
    from mlxpaged.loading.draft_model import with_draft

    return with_draft(facts, mtp_facts(find_mtp(path, name), facts, 0))


class MtpHead(nn.Module):
    """The MTP layers (see the module docstring); the embedding and the LM head are the model's."""

    def __init__(self, text_config: dict, num_layers: int):
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

        args = TextModelArgs.from_dict({**text_config, "full_attention_interval": 1})  # every MTP layer attends
        width, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * width, width, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(width, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(width, eps=eps)
        self.layers = [DecoderLayer(args, layer_idx=0) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(width, eps=eps)

    @property
    def paged_layers(self) -> int:
        """Layers with pages of their own: all of them."""
        return len(self.layers)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """`embeds` [B, L, H] of the tokens at q + 1, `hidden` [B, L, H] the model's at q -> [B, L, H], normed."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        mask = create_attention_mask(x, cache[0])
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer(x, mask=mask, cache=layer_cache)
        return self.norm(x)


def load_mtp_head(checkpoint: MtpCheckpoint, dtype: mx.Dtype) -> MtpHead | NextnHead | NemotronMtpHead | MimoMtpHead:
    """The MTP layers of `checkpoint` with their weights, floating ones in `dtype` (the model's activations')."""
    head: MtpHead | NextnHead | NemotronMtpHead | MimoMtpHead
    if checkpoint.layout == "mimo":
        weights = mimo_mtp_weights(_stored(checkpoint))
        head = MimoMtpHead(checkpoint.text_config)
    elif checkpoint.layout == "nemotron":
        pattern = list(checkpoint.pattern)
        weights = nemotron_mtp_weights(checkpoint.text_config, pattern, _stored(checkpoint))
        head = NemotronMtpHead(checkpoint.text_config, pattern)
    elif checkpoint.layout == "nextn":
        weights = nextn_weights(checkpoint.text_config, _stored(checkpoint))
        head = NextnHead(checkpoint.text_config, "embed_tokens.weight" in weights, "lm_head.weight" in weights)
    else:
        head = MtpHead(checkpoint.text_config, checkpoint.num_layers)
        weights = _read(checkpoint)
    if any(key.endswith(".scales") for key in weights):  # an MLX conversion that quantized them with the model
        _quantize(head, checkpoint.config, weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ConfigError(
            f"the MTP tensors of {checkpoint.path} do not fit the MTP layers of its config: {exc}",
            param="speculative",
        ) from exc
    _cast(head, dtype)
    mx.eval(head.parameters())
    return head


def _cast(head: nn.Module, dtype: mx.Dtype) -> None:
    """Floating parameters in `dtype`, but a MoE router's correction bias, which stays as stored (mlx-lm's
    `cast_predicate` for DeepSeek-V3 and GLM: cast, it breaks the routing)."""
    flat = tree_flatten(head.parameters(), destination={})  # name -> array
    assert isinstance(flat, dict)
    cast = [
        (name, w.astype(dtype))
        for name, w in flat.items()
        if mx.issubdtype(w.dtype, mx.floating) and "e_score_correction_bias" not in name
    ]
    head.update(tree_unflatten(cast))


def _stored(checkpoint: MtpCheckpoint) -> dict[str, mx.array]:
    """The MTP tensors by their short names, read lazily from the checkpoint's files."""
    wanted = set(checkpoint.tensors.values())
    stored: dict[str, mx.array] = {}
    for file in weight_files(checkpoint.path):
        names = {t.name for t in read_safetensors_header(file)} & wanted
        if names:
            arrays = mx.load(str(file))  # lazy: only what is used is read
            assert isinstance(arrays, dict)  # a .safetensors file
            stored.update({n: arrays[n] for n in names})
    return {key: stored[name] for key, name in checkpoint.tensors.items()}


def _read(checkpoint: MtpCheckpoint) -> dict[str, mx.array]:
    """The MTP tensors as MtpHead names them: norms shifted as the model's were, experts stacked."""
    wanted = set(checkpoint.tensors.values())
    stored: dict[str, mx.array] = {}
    zero_centred = False
    for file in weight_files(checkpoint.path):
        names = {t.name for t in read_safetensors_header(file)}
        conv = [n for n in names if "conv1d.weight" in n and "mtp." not in n]
        if not (wanted & names) and not conv:
            continue
        arrays = mx.load(str(file))  # lazy: only what is used is read
        assert isinstance(arrays, dict)  # a .safetensors file
        # mlx-lm's own test for an unconverted Hugging Face checkpoint (qwen3_5.sanitize): its norms are zero-centred
        zero_centred = zero_centred or any(arrays[n].shape[-1] != 1 for n in conv)
        stored.update({n: arrays[n] for n in wanted & names})
    by_key = {key: stored[name] for key, name in checkpoint.tensors.items()}
    if zero_centred:
        by_key = {k: v + 1.0 if k.endswith(_NORMS) and v.ndim == 1 else v for k, v in by_key.items()}
    return _stack_experts(by_key)


def _stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face MoE layouts -> mlx-lm's SwitchGLU (`switch_mlp`): one tensor per expert stacked, or the fused
    `experts.gate_up_proj` split (as mlx-lm's qwen3_5_moe.sanitize does for the model's layers)."""
    out = dict(weights)
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        gate_up = out.pop(key)
        mid = gate_up.shape[-2] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    for key in out:
        match = _EXPERT.fullmatch(key)
        if match:
            prefix, expert, projection, kind = match.groups()
            groups.setdefault((prefix, projection, kind), {})[int(expert)] = key
    for (prefix, projection, kind), keys in groups.items():
        if sorted(keys) != list(range(len(keys))):
            raise ConfigError(f"the MTP experts of {prefix} are not numbered 0..{len(keys) - 1}", param="speculative")
        out[f"{prefix}.switch_mlp.{projection}.{kind}"] = mx.stack([out.pop(keys[e]) for e in range(len(keys))])
    return out


def _quantize(head: nn.Module, config: dict, weights: dict[str, mx.array]) -> None:
    """Quantize the layers the checkpoint stores quantized, with its quantization settings (a layer's own entry,
    under its checkpoint name, wins)."""
    settings = config.get("quantization") or config.get("quantization_config") or {}
    if "bits" not in settings:
        raise ConfigError("the mtp.* tensors are quantized but config.json gives no quantization", param="speculative")

    def predicate(path: str, module: nn.Module):
        if f"{path}.scales" not in weights:
            return False
        own = settings.get(f"mtp.{path}")
        return own if isinstance(own, dict) else True

    nn.quantize(head, group_size=settings.get("group_size", 64), bits=settings["bits"], class_predicate=predicate)
