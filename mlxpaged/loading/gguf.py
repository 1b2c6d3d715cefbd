"""Convert a llama-architecture GGUF file into a directory mlx-lm can load.

MLX reads GGUF itself (`mx.load(..., return_metadata=True)`), returning Q4_0/Q4_1/Q8_0
tensors as MLX quantized triplets (weight, scales, biases) and the tokenizer as
metadata. We dequantize to a dense dtype (float32 is the fast dtype on MLX's CPU
backend; float16 on Metal), undo llama.cpp's q/k row permutation, and rebuild the
GPT-2 byte-level BPE tokenizer with the `tokenizers` library.

The output is written to a temporary sibling directory and renamed at the end, so
a failed or interrupted conversion never leaves a half model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from mlxpaged.errors import ConversionError
from mlxpaged.loading.progress import Progress

import mlx.core as mx
import numpy as np

GGUF_GROUP_SIZE = 32
TOKEN_TYPE_CONTROL = 3  # llama.cpp's gguf.TokenType.CONTROL

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _scalar(meta: dict, key: str):
    if key not in meta:
        raise ConversionError(f"GGUF metadata has no '{key}'")
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def read_gguf(path: Path) -> tuple[dict, dict]:
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises bare RuntimeError/ValueError for bad files
        raise ConversionError(f"cannot read GGUF file {path}: {exc}") from exc
    if not isinstance(loaded, tuple):  # return_metadata gives (weights, metadata)
        raise ConversionError(f"cannot read GGUF file {path}: no metadata")
    weights, meta = loaded
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    return weights, meta


def llama_config(meta: dict) -> dict:
    """mlx-lm/transformers config.json for a llama GGUF."""
    get = lambda key: _scalar(meta, f"llama.{key}")  # noqa: E731
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }


def _dense(weights: dict, name: str, dtype: mx.Dtype) -> mx.array:
    w = weights.get(f"{name}.weight")
    if w is None:
        raise ConversionError(f"GGUF has no tensor '{name}.weight'")
    scales = weights.get(f"{name}.scales")
    if scales is not None:
        # Q4_x packs 8 values per uint32, Q8_0 packs 4: infer bits from the shapes.
        bits = w.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)
        w = mx.dequantize(w, scales, weights[f"{name}.biases"], group_size=GGUF_GROUP_SIZE, bits=bits)
    return w.astype(dtype)


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's `permute` of q/k rows (it interleaves the two RoPE halves per head)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def convert_weights(weights: dict, config: dict, dtype: mx.Dtype, progress: Progress) -> dict:
    out = {
        "model.embed_tokens.weight": _dense(weights, "token_embd", dtype),
        "model.norm.weight": _dense(weights, "output_norm", dtype),
    }
    if "output.weight" in weights:
        out["lm_head.weight"] = _dense(weights, "output", dtype)
    layers = config["num_hidden_layers"]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for i in range(layers):
        for gguf_name, mlx_name in _LAYER_NAMES.items():
            w = _dense(weights, f"blk.{i}.{gguf_name}", dtype)
            if gguf_name in heads:
                w = unpermute_rows(w, heads[gguf_name])
            out[f"model.layers.{i}.{mlx_name}.weight"] = w
        mx.eval(*[v for k, v in out.items() if k.startswith(f"model.layers.{i}.")])
        progress(i + 1, layers, "converting layers")
    return out


def build_tokenizer(meta: dict):
    """GPT-2 byte-level BPE with SmolLM's pre-tokenizer: digits split one by one, then the GPT-2 regex."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ConversionError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported (only 'gpt2')")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    types = np.array(meta["tokenizer.ggml.token_type"])
    specials = [tokens[i] for i in np.flatnonzero(types == TOKEN_TYPE_CONTROL)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    token = lambda key: tokens[int(_scalar(meta, key))]  # noqa: E731
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
    }
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token"] = token("tokenizer.ggml.padding_token_id")
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _write_model_dir(
    path: Path, weights: dict, meta: dict, dtype: mx.Dtype, progress: Progress, generation: Mapping[str, object]
) -> None:
    config = llama_config(meta)
    config["tie_word_embeddings"] = "output.weight" not in weights
    config["torch_dtype"] = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[dtype]
    dense = convert_weights(weights, config, dtype, progress)
    progress(0, 1, "writing weights")
    mx.save_safetensors(str(path / "model.safetensors"), dense, metadata={"format": "mlx"})
    build_tokenizer(meta).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    # A GGUF carries no sampling advice: the preset brings the model card's (read by generation_defaults).
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], **generation}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    progress(1, 1, "writing weights")


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: mx.Dtype = mx.float32,
    progress: Progress | None = None,
    generation: Mapping[str, object] | None = None,
) -> Path:
    """Convert `gguf_path` into `out_dir` atomically; raise ConversionError on a bad file.
    `generation`: sampling defaults (generation_config.json keys, e.g. the preset's) to write with bos/eos."""
    progress = progress or (lambda done, total, what: None)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ConversionError(f"{out_dir} already exists")
    weights, meta = read_gguf(Path(gguf_path))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        _write_model_dir(tmp, weights, meta, dtype, progress, generation or {})
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / "config.json").exists():
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # Another process (a second `mlxpaged` started at once) finished the same conversion first: keep its copy.
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (KeyError, ValueError, RuntimeError)):
            raise ConversionError(f"cannot convert {gguf_path}: {exc}") from exc
        raise
    return out_dir
