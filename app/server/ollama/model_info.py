"""Models as Ollama describes them: /api/tags entries (every servable model, read from its files, none loaded),
the /api/show body and /api/ps entries (loaded models: a ServedModel or ServedEmbedder).

What Ollama reads from a GGUF file comes here from the model directory: the architecture, sizes and context from
config.json, the parameter count from the safetensors headers (no weight is read), the size on disk from the
files, the quantization level from config.json's `quantization` or the weights' dtype as this machine loads them.
Ollama's `digest` is its manifest's sha256; here it is one over the model's name, config.json and weight files'
names and sizes (stable while the files are). `<architecture>.context_length` in model_info is the context this
server runs the model with (`--max-model-len`, or the KV cache's capacity if smaller; an embedding model's input
limit), which is what clients budget their prompts by; the model's trained context is
`mlxpaged.trained_context_length`. /api/ps's `size` is the memory the server's budget counts for the model
(weights, KV cache, state, activations), `size_vram` the same unless MLX computes on the CPU, and `expires_at`
when its keep-alive will unload it.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.errors import MlxpagedError
from mlxpaged.loading.checkpoint import as_loaded, checkpoint_tensors, kv_dtype, weight_files
from mlxpaged.platform import backend
from mlxpaged.platform.model_facts import context_length
from mlxpaged_app.server.adapter_catalog import AdapterTarget
from mlxpaged_app.server.model_catalog import CatalogEntry
from mlxpaged_app.server.ollama.models import tagged
from mlxpaged_app.server.server_log import log

FOREVER = dt.timedelta(microseconds=(2**63 - 1) // 1000)  # Ollama's expiry for "never": now + the longest duration
# Ollama's parameter names for the sampling defaults /api/show lists
_PARAMETER_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}


def rfc3339(moment: dt.datetime) -> str:
    """As Go writes a time.Time in JSON (RFC 3339, UTC, fractional seconds)."""
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now() -> str:
    return rfc3339(dt.datetime.now(dt.UTC))


@dataclass(frozen=True)
class ModelFiles:
    """What the model directory says, read once per model (no weight is read)."""

    size: int
    digest: str
    modified_at: str
    parameter_count: int
    config: dict
    dtype: str  # the floating weights' safetensors dtype as this machine loads them: "F32", "BF16", "F16"


@functools.cache  # once per model: /api/tags is polled
def model_files(path: Path, name: str) -> ModelFiles:
    files = weight_files(path)
    digest = hashlib.sha256(name.encode())
    digest.update((path / "config.json").read_bytes())
    for file in files:
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    newest = max(file.stat().st_mtime for file in [*files, path / "config.json"])
    config = json.loads((path / "config.json").read_text())
    return ModelFiles(
        sum(file.stat().st_size for file in files),
        digest.hexdigest(),
        rfc3339(dt.datetime.fromtimestamp(newest, dt.UTC)),
        parameter_count(path, config),
        config,
        kv_dtype(as_loaded(checkpoint_tensors(path), backend.current())),
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


def files_of(entry: CatalogEntry) -> ModelFiles:
    return model_files(Path(entry.path), entry.name)


def human_number(count: int) -> str:
    """Ollama's parameter_size: "135M", "7.6B"."""
    for scale, suffix, decimals in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{suffix}" if value == math.floor(value) else f"{value:.{decimals}f}{suffix}"
    return str(count)


def details(entry: CatalogEntry) -> dict:
    files = files_of(entry)
    family = files.config.get("model_type", "unknown")
    bits = (files.config.get("quantization") or {}).get("bits")
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": human_number(files.parameter_count),
        "quantization_level": f"Q{bits}" if bits else files.dtype,
    }


def tags_entry(entry: CatalogEntry) -> dict:
    files = files_of(entry)
    name = tagged(entry.name)
    return {
        "name": name,
        "model": name,
        "modified_at": files.modified_at,
        "size": files.size,
        "digest": files.digest,
        "details": details(entry),
    }


def adapter_tags_entry(adapter: AdapterTarget) -> dict:
    """An adapter as Ollama lists a model made FROM a base with an ADAPTER: its own name and files, the base model's
    details with `parent_model` naming the base."""
    name, base, directory = adapter.name, adapter.base, Path(adapter.path)
    files = [directory / "adapters.safetensors", directory / "adapter_config.json"]
    digest = hashlib.sha256(name.encode())
    for file in files:
        digest.update(file.read_bytes())
    newest = max(file.stat().st_mtime for file in files)
    return {
        "name": tagged(name),
        "model": tagged(name),
        "modified_at": rfc3339(dt.datetime.fromtimestamp(newest, dt.UTC)),
        "size": sum(file.stat().st_size for file in files),
        "digest": digest.hexdigest(),
        "details": {**details(base), "parent_model": tagged(base.name)},
    }


def tags_entries(entries: list[CatalogEntry], adapters: Sequence[AdapterTarget] = ()) -> list[dict]:
    """/api/tags' list, models then adapters; one whose files cannot be read is left out (and logged), not the whole
    list."""
    jobs = [(e.name, tags_entry, (e,)) for e in entries] + [(a.name, adapter_tags_entry, (a,)) for a in adapters]
    listed = []
    for name, make, args in jobs:
        try:
            listed.append(make(*args))
        except (OSError, ValueError, MlxpagedError) as exc:
            log.info("ollama: /api/tags leaves out %s: %s", name, exc)
    return listed


def capabilities(served) -> list[str]:
    """An embedding model embeds; every generative model here can call tools (a template without tool support
    gets the generic fallback), and thinks if its tokenizer has thinking tags."""
    if served.kind == "embed":
        return ["embedding"]
    thinks = bool(getattr(served.engine.tokenizer, "has_thinking", False))
    return ["completion", "tools", *(["thinking"] if thinks else [])]


def model_info(served) -> dict:
    files = files_of(served.entry)
    config = {**files.config, **(files.config.get("text_config") or {})}
    arch = config.get("model_type", "unknown")
    info = {
        "general.architecture": arch,
        "general.basename": served.model_id,
        "general.parameter_count": files.parameter_count,
        f"{arch}.context_length": served.context_limit or context_length(files.config),
        "mlxpaged.trained_context_length": context_length(files.config),
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


def parameters_text(served) -> str:
    """The model's sampling defaults as Ollama lists a Modelfile's parameters ("name   value" lines)."""
    values = served.config.sampling_defaults.values
    return "\n".join(f"{_PARAMETER_NAMES.get(name, name):<30} {value}" for name, value in values.items())


def show_body(served) -> dict:
    parameters = parameters_text(served)
    modelfile = f"# Modelfile generated by mlxpaged\nFROM {served.entry.path}\n" + "".join(
        f"PARAMETER {line.split()[0]} {line.split()[1]}\n" for line in parameters.splitlines()
    )
    template = getattr(served.engine.tokenizer, "chat_template", None) if served.kind == "generate" else None
    return {
        "license": "",
        "modelfile": modelfile,
        "parameters": parameters,
        "template": template if isinstance(template, str) else "",
        "details": details(served.entry),
        "model_info": model_info(served),
        "capabilities": capabilities(served),
        "modified_at": files_of(served.entry).modified_at,
    }


def ps_entry(served) -> dict:
    """A loaded model's memory as the server's budget counts it, in GPU memory unless MLX runs on the CPU, and
    when its keep-alive unloads it."""
    size = served.cost.total
    entry = tags_entry(served.entry)
    del entry["modified_at"]
    seconds = served.expires_in()
    expires = FOREVER if seconds is None else dt.timedelta(seconds=seconds)
    return {
        **entry,
        "expires_at": rfc3339(dt.datetime.now(dt.UTC) + expires),
        "size": size,
        "size_vram": 0 if backend.current() == "cpu" else size,
        "context_length": served.context_limit or 0,
    }


def ps_entries(loaded: list) -> list[dict]:
    return [ps_entry(served) for served in loaded]
