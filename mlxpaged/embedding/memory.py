"""Does an embedding model fit, before any weight is read: weights as loaded + one pass's activations + the
OS reserve against the device's limit (platform/memory.py's DeviceFacts and reserve, as the engine's plan).

Weights come from the safetensors headers in the dtypes the loader gives them (loading/checkpoint.py), an LM head
excepted (load.py drops it). A pass of `max_batch_tokens` tokens keeps, for the whole pass, its K/V in the model's
cache (layers x 2 x kv heads x head dim per token) and, per layer, a few hidden-sized and MLP-sized temporaries
(counted 4 x hidden + 3 x intermediate floats per token): an estimate, read from config.json; attention scores are
not counted (MLX's fused attention does not hold them on a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxpaged.errors import InsufficientMemoryError
from mlxpaged.loading.checkpoint import as_loaded, checkpoint_tensors, kv_dtype_bytes
from mlxpaged.platform.memory import DeviceFacts, os_reserve_bytes
from mlxpaged.units import format_size

FLOAT_BYTES = 4  # temporaries are counted as float32, the CPU backend's dtype and the worst case


def check_fits(model_dir: Path, backend: str, max_batch_tokens: int, device: DeviceFacts) -> int:
    """The bytes the model needs (weights + activations + reserve); InsufficientMemoryError with every number when
    that exceeds the device's limit."""
    weights, activations = embedding_costs(model_dir, backend, max_batch_tokens)
    costs = [
        ("model weights", weights),
        (f"activations of a {max_batch_tokens:,}-token pass", activations),
        (device.reserve_label[0], os_reserve_bytes(device.total_bytes)),
    ]
    needed = sum(size for _, size in costs)
    if needed > device.limit_bytes:
        listed = " + ".join(f"{name} {format_size(size)}" for name, size in costs)
        raise InsufficientMemoryError(
            f"{listed} = {format_size(needed)} exceed the {device.limit_label} of {format_size(device.limit_bytes)}; "
            "use a smaller or more quantized model, or lower {max_batch_tokens}",
            needed_bytes=needed,
            available_bytes=device.limit_bytes,
            param="max_batch_tokens",
        )
    return needed


def embedding_costs(model_dir: Path, backend: str, max_batch_tokens: int) -> tuple[int, int]:
    """(weights as loaded, activations of one `max_batch_tokens` pass) in bytes: what a loaded Embedder holds
    (the server's memory budget counts it), the OS reserve aside."""
    loaded = as_loaded(checkpoint_tensors(model_dir), backend)
    weights = sum(t.nbytes for t in loaded if not t.name.startswith("lm_head."))
    config = json.loads((model_dir / "config.json").read_text())
    return weights, max_batch_tokens * activation_bytes_per_token(config, kv_dtype_bytes(loaded))


def activation_bytes_per_token(config: dict, kv_bytes: int) -> int:
    config = {**config, **(config.get("text_config") or {})}  # multimodal checkpoints keep the text model's here
    hidden = _int(config, "hidden_size", "d_model", "n_embd") or 0
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers") or 0
    heads = _int(config, "num_attention_heads", "n_head") or 1
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim") or hidden // heads
    intermediate = _int(config, "intermediate_size", "ffn_dim") or 4 * hidden
    kv = layers * 2 * kv_heads * head_dim * kv_bytes
    return kv + (4 * hidden + 3 * intermediate) * FLOAT_BYTES


def _int(config: dict, *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
