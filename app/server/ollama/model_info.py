"""The served model as Ollama describes a model: its /api/tags entry, its /api/show body and its /api/ps entry.

What Ollama reads from a GGUF file comes here from the model directory: the architecture, sizes and context from
config.json, the parameter count from the safetensors headers (no weight is read), the size on disk from the
files. Ollama's `digest` is its manifest's sha256; here it is one over the model's name, config.json and weight
files' names and sizes (stable while the files are). `<architecture>.context_length` in model_info is the context
this server runs the model with (`--max-model-len`, or the KV cache's capacity if smaller), which is what clients
budget their prompts by; the model's trained context is `mlxpaged.trained_context_length`.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.loading.checkpoint import checkpoint_tensors, weight_files
from mlxpaged.platform.model_facts import context_length
from mlxpaged_app.server.ollama.models import tagged
from mlxpaged_app.server.state import ServerState

FOREVER = dt.timedelta(microseconds=(2**63 - 1) // 1000)  # Ollama's expiry for "never": now + the longest duration
_FLOAT_LEVELS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# Ollama's parameter names for the sampling defaults /api/show lists
_PARAMETER_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}


def rfc3339(moment: dt.datetime) -> str:
    """As Go writes a time.Time in JSON (RFC 3339, UTC, fractional seconds)."""
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now() -> str:
    return rfc3339(dt.datetime.now(dt.UTC))


@dataclass(frozen=True)
class ModelFiles:
    """What the model directory says, read once per served model."""

    size: int
    digest: str
    modified_at: str
    parameter_count: int


@functools.cache  # once per served model: /api/tags is polled
def model_files(path: Path, name: str) -> ModelFiles:
    files = weight_files(path)
    digest = hashlib.sha256(name.encode())
    digest.update((path / "config.json").read_bytes())
    for file in files:
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    newest = max(file.stat().st_mtime for file in [*files, path / "config.json"])
    return ModelFiles(
        sum(file.stat().st_size for file in files),
        digest.hexdigest(),
        rfc3339(dt.datetime.fromtimestamp(newest, dt.UTC)),
        parameter_count(path, json.loads((path / "config.json").read_text())),
    )


def parameter_count(path: Path, config: dict) -> int:
    """Weights, counted as the model has them: an MLX quantized checkpoint packs `bits`-wide weights into uint32
    elements (32 / bits to each), and its per-group scales and biases are not parameters."""
    bits = (config.get("quantization") or {}).get("bits")
    total = 0
    for tensor in checkpoint_tensors(path):
        if bits and tensor.name.endswith((".scales", ".biases")):
            continue
        packed = bits and tensor.dtype == "U32"
        total += tensor.num_elements * 32 // bits if packed else tensor.num_elements
    return total


def files_of(state: ServerState) -> ModelFiles:
    return model_files(Path(state.engine.loaded.path), state.engine.loaded.name)


def human_number(count: int) -> str:
    """Ollama's parameter_size: "135M", "7.6B"."""
    for scale, suffix, decimals in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{suffix}" if value == math.floor(value) else f"{value:.{decimals}f}{suffix}"
    return str(count)


def details(state: ServerState) -> dict:
    loaded = state.engine.loaded
    family = loaded.config.get("model_type", "unknown")
    bits = (loaded.config.get("quantization") or {}).get("bits")
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": human_number(files_of(state).parameter_count),
        "quantization_level": f"Q{bits}" if bits else _FLOAT_LEVELS.get(loaded.dtype, loaded.dtype.upper()),
    }


def tags_entry(state: ServerState) -> dict:
    files = files_of(state)
    name = tagged(state.model_id)
    return {
        "name": name,
        "model": name,
        "modified_at": files.modified_at,
        "size": files.size,
        "digest": files.digest,
        "details": details(state),
    }


def capabilities(state: ServerState) -> list[str]:
    """Every model here can call tools (a template without tool support gets the generic fallback)."""
    thinks = bool(getattr(state.engine.tokenizer, "has_thinking", False))
    return ["completion", "tools", *(["thinking"] if thinks else [])]


def model_info(state: ServerState) -> dict:
    loaded = state.engine.loaded
    config = {**loaded.config, **(loaded.config.get("text_config") or {})}
    arch = config.get("model_type", "unknown")
    info = {
        "general.architecture": arch,
        "general.basename": state.model_id,
        "general.parameter_count": files_of(state).parameter_count,
        f"{arch}.context_length": state.context_limit,
        "mlxpaged.trained_context_length": context_length(loaded.config),
    }
    for key, config_key in (
        ("embedding_length", "hidden_size"),
        ("block_count", "num_hidden_layers"),
        ("feed_forward_length", "intermediate_size"),
        ("attention.head_count", "num_attention_heads"),
        ("attention.head_count_kv", "num_key_value_heads"),
        ("vocab_size", "vocab_size"),
    ):
        if isinstance(config.get(config_key), int):
            info[f"{arch}.{key}"] = config[config_key]
    return info


def parameters_text(state: ServerState) -> str:
    """The model's sampling defaults as Ollama lists a Modelfile's parameters ("name   value" lines)."""
    values = state.config.sampling_defaults.values
    return "\n".join(f"{_PARAMETER_NAMES.get(name, name):<30} {value}" for name, value in values.items())


def show_body(state: ServerState) -> dict:
    loaded = state.engine.loaded
    parameters = parameters_text(state)
    modelfile = f"# Modelfile generated by mlxpaged\nFROM {loaded.path}\n" + "".join(
        f"PARAMETER {line.split()[0]} {line.split()[1]}\n" for line in parameters.splitlines()
    )
    template = getattr(state.engine.tokenizer, "chat_template", None)
    return {
        "license": "",
        "modelfile": modelfile,
        "parameters": parameters,
        "template": template if isinstance(template, str) else "",
        "details": details(state),
        "model_info": model_info(state),
        "capabilities": capabilities(state),
        "modified_at": files_of(state).modified_at,
    }


def ps_entry(state: ServerState) -> dict:
    """Memory as Ollama counts a loaded model's: weights and KV cache; in GPU memory unless MLX runs on the CPU."""
    engine = state.engine
    size = engine.facts.weight_bytes + engine.plan.kv_bytes + engine.plan.state_bytes
    entry = tags_entry(state)
    del entry["modified_at"]
    return {
        **entry,
        "expires_at": rfc3339(dt.datetime.now(dt.UTC) + FOREVER),  # held for the server's lifetime
        "size": size,
        "size_vram": 0 if engine.plan.backend == "cpu" else size,
        "context_length": state.context_limit,
    }
