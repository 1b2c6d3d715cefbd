"""Tiny random mlx-lm models (float32, fixed seed) and a block allocator for paged-cache tests."""

from __future__ import annotations

import random

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import gemma3_text, llama, qwen2, qwen3, qwen3_5

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "head_dim": 16,
    "max_position_embeddings": 512,
}


def _build(module, config: dict, seed: int):
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Random init is small; scale weights up so attention is far from uniform and bugs show.
    model.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_llama(num_layers: int = 3, seed: int = 0, **extra):
    """Llama with GQA (4 heads, 2 kv heads); pass layer_types/sliding_window for a hybrid."""
    config = dict(_COMMON, model_type="llama", num_hidden_layers=num_layers, tie_word_embeddings=True, **extra)
    return _build(llama, config, seed)


def tiny_hybrid_llama(seed: int = 0, window: int = 8):
    """Llama with mixed layer_types: sliding, sliding, full, sliding."""
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return tiny_llama(4, seed, layer_types=types, sliding_window=window)


def tiny_qwen3(num_layers: int = 2, seed: int = 1):
    config = dict(
        _COMMON, model_type="qwen3", num_hidden_layers=num_layers, tie_word_embeddings=False, rope_theta=10000.0
    )
    return _build(qwen3, config, seed)


def tiny_qwen2(num_layers: int = 2, seed: int = 4, **extra):
    """qwen2: mlx-lm both shards it (tensor parallel) and pipelines it (PipelineMixin)."""
    config = dict(
        _COMMON, model_type="qwen2", num_hidden_layers=num_layers, tie_word_embeddings=False, rope_theta=10000.0
    )
    return _build(qwen2, {**config, **extra}, seed)


def tiny_gemma3(num_layers: int = 6, window: int = 8, pattern: int = 3, seed: int = 2):
    """gemma3_text: every `pattern`-th layer full attention, the others sliding `window`."""
    config = dict(
        _COMMON,
        model_type="gemma3_text",
        num_hidden_layers=num_layers,
        sliding_window=window,
        sliding_window_pattern=pattern,
        query_pre_attn_scalar=16,
        rope_local_base_freq=10000.0,
        rope_theta=1000000.0,
    )
    return _build(gemma3_text, config, seed)


def tiny_qwen3_5(num_layers: int = 4, full_attention_interval: int = 2, seed: int = 3):
    """Qwen 3.5-style hybrid: gated-delta linear attention layers (conv + recurrent state, an mlx-lm
    ArraysCache) and every `full_attention_interval`-th layer full attention (KV)."""
    config = {
        "model_type": "qwen3_5",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 3,
        "full_attention_interval": full_attention_interval,
        "partial_rotary_factor": 0.5,
        "rope_theta": 1000.0,
    }
    return _build(qwen3_5, config, seed)


def shuffled_blocks(num_blocks: int, seed: int = 0) -> list[int]:
    """Free block ids in shuffled order, so tables come out non-contiguous."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return ids


def grow_tables(kv_cache, tables: list[list[int]], free: list[int], num_tokens: int) -> None:
    """Append blocks from `free` until each group's table covers `num_tokens` tokens."""
    for spec, table in zip(kv_cache.specs, tables, strict=True):
        while len(table) < spec.blocks_needed(num_tokens):
            table.append(free.pop())


def random_tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def write_tiny_llama_dir(
    out, dtype: str = "bfloat16", context: int = 2048, seed: int = 0, hidden: int = 64, kv_heads: int = 2
):
    """A model directory mlx-lm's load() and Engine.from_pretrained take: a 2-layer random llama with the
    default model's tokenizer and vocabulary (49,152), saved in `dtype` (the GPU kit's models are bf16).
    `kv_heads`: 4 splits over 4 tensor-parallel ranks (tests/distributed/)."""
    return write_tiny_model_dir(
        out, "llama", dtype, context, kv_heads, seed=seed, hidden=hidden, tie_word_embeddings=True
    )


# What each written architecture needs beyond _COMMON (write_tiny_model_dir).
_DIR_EXTRAS: dict[str, dict] = {
    "llama": {},
    "qwen3": {"rope_theta": 10000.0, "tie_word_embeddings": False},
    "qwen2": {"rope_theta": 10000.0, "tie_word_embeddings": False},  # mlx-lm pipelines it (PipelineMixin)
    "qwen3_moe": {
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
    "qwen3_5": {  # a hybrid: gated-delta layers, every second layer full attention
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 3,
        "full_attention_interval": 2,
        "partial_rotary_factor": 0.5,
        "rope_theta": 1000.0,
        "tie_word_embeddings": True,
    },
}


def write_tiny_model_dir(
    out,
    model_type: str = "llama",
    dtype: str = "bfloat16",
    context: int = 2048,
    kv_heads: int = 2,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    **extra,
):
    """write_tiny_llama_dir for `model_type` ("llama", "qwen2", "qwen3", "qwen3_moe"): a random model of
    `layers` layers."""
    import importlib

    from mlx.utils import tree_flatten

    config = dict(
        _COMMON,
        model_type=model_type,
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_key_value_heads=kv_heads,
        vocab_size=49152,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
        **{**_DIR_EXTRAS[model_type], **extra},
    )
    model = _build(importlib.import_module(f"mlx_lm.models.{model_type}"), config, seed=seed)
    model.set_dtype(getattr(mx, dtype))
    return write_checkpoint(out, dict(tree_flatten(model.parameters())), config)


def write_checkpoint(out, weights: dict, config: dict):
    """A model directory in `out`: `weights` as model.safetensors, `config` as config.json, and the default model's
    tokenizer files."""
    import json
    import shutil
    from pathlib import Path

    from mlxpaged.loading.loader import locate_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(locate_model(None)[1] / name, out / name)
    return out


def add_mtp_layers(model_dir, num_layers: int = 1, seed: int = 7):
    """Give the Qwen 3.5 checkpoint in `model_dir` (write_tiny_model_dir) random multi-token-prediction layers,
    stored as a checkpoint ships them: `mtp.*` tensors beside the model's (which mlx-lm's sanitize drops)."""
    import json
    from pathlib import Path

    from mlxpaged.loading.mtp_head import MtpHead

    from mlx.utils import tree_flatten

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    mx.random.seed(seed)
    head = MtpHead(config.get("text_config") or config, num_layers)
    head.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, head.parameters()))
    weights = dict(mx.load(str(model_dir / "model.safetensors")))
    dtype = next(iter(weights.values())).dtype
    weights.update({f"mtp.{name}": w.astype(dtype) for name, w in tree_flatten(head.parameters())})
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = num_layers
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


def write_tiny_nextn_dir(out, model_type: str = "deepseek_v3", seed: int = 5, nextn_seed: int = 7, depth: int = 1):
    """A tiny random `model_type` checkpoint (tests/archs/configs.json's config, the default model's tokenizer and
    vocabulary) with, unless `depth` is 0, one random nextn (MTP) layer as Hugging Face checkpoints of the
    DeepSeek-V3 layout store it: `model.layers.<num_hidden_layers>.*`, experts one by one, MLA's `kv_b_proj` fused,
    its own embedding and shared head (loading/nextn_head.py)."""
    import importlib

    from mlxpaged.loading.nextn_head import NextnHead
    from tests.archs.configs import config_for

    from mlx.utils import tree_flatten

    config = {**config_for(model_type), "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}
    config["num_nextn_predict_layers"] = depth
    model = _build(importlib.import_module(f"mlx_lm.models.{model_type}"), config, seed=seed)
    weights = dict(tree_flatten(model.parameters()))
    if depth:
        mx.random.seed(nextn_seed)
        head = NextnHead(config, own_embedding=True, own_head=True)
        head.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, head.parameters()))
        prefix = f"model.layers.{config['num_hidden_layers']}."
        weights.update({prefix + name: w for name, w in hugging_face_nextn(config, head).items()})
    return write_checkpoint(out, weights, config)


def hugging_face_nextn(config: dict, head) -> dict:
    """A NextnHead's parameters named and laid out as a Hugging Face checkpoint stores its nextn layer (the inverse
    of mlx-lm's sanitize: experts one by one, MLA's embed_q / unembed_out fused back into kv_b_proj)."""
    from mlx.utils import tree_flatten

    names = {"shared_head_norm.weight": "shared_head.norm.weight", "lm_head.weight": "shared_head.head.weight"}
    out = {}
    for name, w in tree_flatten(head.parameters()):
        if not name.startswith("layers.0."):
            out[names.get(name, name)] = w
            continue
        name = name[len("layers.0.") :]
        if ".switch_mlp." in name:
            for e in range(w.shape[0]):
                out[name.replace(".switch_mlp.", f".experts.{e}.")] = w[e]
        elif name.endswith("embed_q.weight"):  # [H, kv_lora, nope] beside unembed_out [H, v, kv_lora]
            unembed = dict(tree_flatten(head.parameters()))["layers.0." + name.replace("embed_q", "unembed_out")]
            fused = mx.concatenate([w.swapaxes(-1, -2), unembed], axis=1)  # [H, nope + v, kv_lora]
            out[name.replace("embed_q", "kv_b_proj")] = fused.reshape(-1, fused.shape[-1])
        elif not name.endswith("unembed_out.weight"):
            out[name] = w
    return out


# A tiny Nemotron-H: attention, Mamba 2 and MoE blocks (tests/archs/configs.json's, with experts), and the pattern of
# its MTP module (attention then MoE, as NVIDIA's checkpoints that ship one).
NEMOTRON_H = {
    "model_type": "nemotron_h",
    "hidden_size": 64,
    "intermediate_size": 128,
    "hybrid_override_pattern": ["*", "M", "*", "E"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_head_dim": 16,
    "mamba_num_heads": 8,
    "n_groups": 4,
    "ssm_state_size": 16,
    "conv_kernel": 3,
    "mamba_proj_bias": False,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "attention_bias": False,
    "layer_norm_epsilon": 1e-5,
    "rms_norm_eps": 1e-5,
    "time_step_limit": [0.0, 1e9],
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
}


def write_tiny_nemotron_dir(out, seed: int = 5, mtp_seed: int = 7, with_mtp: bool = True):
    """A tiny random Nemotron-H checkpoint (the default model's tokenizer) with, unless `with_mtp` is off, a random MTP
    module stored as NVIDIA's checkpoints store it: `mtp.layers.<i>.*`, experts one by one, the projections on its
    first layer and the final norm on its last (loading/nemotron_mtp_head.py)."""

    from mlxpaged.loading.nemotron_mtp_head import NemotronMtpHead, mtp_pattern

    from mlx.utils import tree_flatten
    from mlx_lm.models import nemotron_h

    model = _build(nemotron_h, NEMOTRON_H, seed=seed)
    weights = dict(tree_flatten(model.parameters()))
    if with_mtp:
        mx.random.seed(mtp_seed)
        pattern = mtp_pattern(NEMOTRON_H)
        head = NemotronMtpHead(NEMOTRON_H, pattern)
        head.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, head.parameters()))
        weights.update({f"mtp.{name}": w for name, w in hugging_face_nemotron_mtp(head, len(pattern)).items()})
    config = dict(NEMOTRON_H) if with_mtp else {k: v for k, v in NEMOTRON_H.items() if not k.startswith("mtp_")}
    return write_checkpoint(out, weights, config)


def hugging_face_nemotron_mtp(head, length: int) -> dict:
    """A NemotronMtpHead's parameters as the checkpoint names them after `mtp.`: the projections on layer 0, the final
    norm on the last layer, each expert's up / down projection on its own."""
    from mlx.utils import tree_flatten

    out = {}
    for name, w in tree_flatten(head.parameters()):
        if name.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            out[f"layers.0.{name}"] = w
        elif name.startswith("final_layernorm."):
            out[f"layers.{length - 1}.{name}"] = w
        elif ".switch_mlp." in name:
            hf = name.replace(".switch_mlp.fc1.", ".experts.{}.up_proj.").replace(
                ".switch_mlp.fc2.", ".experts.{}.down_proj."
            )
            for e in range(w.shape[0]):
                out[hf.format(e)] = w[e]
        else:
            out[name] = w
    return out


def write_tiny_mimo_dir(out, seed: int = 5, mtp_seed: int = 7, depth: int = 2):
    """A tiny random MiMo checkpoint (tests/archs/configs.json's config, the default model's tokenizer) with `depth`
    random MTP layers stored as Xiaomi's checkpoints store them: `model.mtp_layers.<i>.*`, each a decoder layer's
    tensors beside its own norms and projection (loading/mimo_mtp_head.py; only the first drafts)."""

    from mlxpaged.loading.mimo_mtp_head import MimoMtpHead
    from tests.archs.configs import config_for

    from mlx.utils import tree_flatten
    from mlx_lm.models import mimo

    config = {**config_for("mimo"), "vocab_size": 49152, "num_nextn_predict_layers": depth}
    weights = dict(tree_flatten(_build(mimo, config, seed=seed).parameters()))
    for index in range(depth):
        mx.random.seed(mtp_seed + index)
        head = MimoMtpHead(config)
        head.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, head.parameters()))
        for name, w in tree_flatten(head.parameters()):
            weights[f"model.mtp_layers.{index}.{name.removeprefix('layers.0.')}"] = w
    return write_checkpoint(out, weights, config)
