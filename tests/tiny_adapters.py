"""mlx-lm adapters for tiny random models, written as `mlx_lm.lora` writes them: its own LoRA / DoRA layers on a copy
of the model (`linear_to_lora_layers`), their trainable parameters randomized (a trained adapter's are not zero),
saved with `adapter_config.json`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters


def write_adapter(
    make_model: Callable[[], nn.Module],
    directory: Path,
    kind: str = "lora",
    *,
    seed: int = 0,
    rank: int = 4,
    scale: float = 2.0,
    num_layers: int = 2,
    keys: list[str] | None = None,
    base: str = "tiny",
) -> Path:
    """An adapter of `kind` ("lora" or "dora") for the model `make_model` builds, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    model = make_model()
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0, **({"keys": keys} if keys else {})}
    mx.random.seed(seed)  # lora_a is drawn here: the same adapter from the same seed
    linear_to_lora_layers(model, num_layers, params, use_dora=kind == "dora")
    weights = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        if name.endswith("lora_b"):  # mlx-lm starts it at zero: an untrained adapter changes nothing
            value = mx.random.normal(value.shape) * 0.3
        elif name.endswith(".m"):
            value = value * (1 + 0.2 * mx.random.normal(value.shape))
        weights[name] = value
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {"fine_tune_type": kind, "num_layers": num_layers, "lora_parameters": params, "model": base}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def adapted_reference(make_model: Callable[[], nn.Module], directory: Path) -> nn.Module:
    """The model with the adapter loaded by mlx-lm itself (what `load(base, adapter_path=...)` does)."""
    model = make_model()
    load_adapters(model, str(directory))
    model.eval()
    return model


def reference_tokens(model: nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy decode."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]
