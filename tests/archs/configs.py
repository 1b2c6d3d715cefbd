"""Tiny random configs for every text model module of the installed mlx_lm.models.

configs.json: mlx-lm's own tests/test_models.py configs (AST-extracted, literal values only; source
"mlx-lm test"), shrunk where they were large ("(shrunk)"), and configs written from each module's
ModelArgs for the modules mlx-lm's tests do not cover ("ours"). Windows <= 8 and chunks of 8, so
prompts of 20+ tokens wrap the rings. Modules mlx-lm itself cannot run here are listed with the reason.
"""

from __future__ import annotations

import copy
import json
import pkgutil
from pathlib import Path

_CONFIGS = json.loads((Path(__file__).with_name("configs.json")).read_text())

# Helpers in mlx_lm/models, not architectures.
HELPERS = frozenset(
    {
        "base",
        "cache",
        "__init__",
        "activations",
        "bitlinear_layers",
        "gated_delta",
        "mla",
        "pipeline",
        "rope_utils",
        "ssm",
        "switch_layers",
    }
)

# Architectures plain mlx-lm cannot run on this machine (checked without mlxpaged; design14 section 0).
MLX_LM_CANNOT_RUN = {
    "bitnet": "its BitLinear layers use a Metal-only kernel (no CPU implementation in MLX)",
    "muse_spark": "calls a Metal-only kernel (mx.fast.metal_kernel) in its forward",
    "olmo": "imports the ai2-olmo package (hf_olmo), which mlx-lm does not install; it sys.exit()s without it",
    "prism_hadamard_qwen35": "loads only from a 2-bit Hadamard-quantized pack with its manifest; no float config",
}

# Logit soft-capping saturates with x3 weights and makes argmax ties: keep their random init as is.
SOFT_CAPPED = frozenset(
    {"gemma2", "gemma3n", "gemma4", "gemma4_text", "gear", "laguna", "muse_glimmer", "nanochat", "recurrent_gemma"}
)

# Multimodal checkpoints whose mlx-lm module runs the language model only.
VLM_WRAPPERS = frozenset(
    {
        "gemma3",
        "gemma3n",
        "gemma4",
        "kimi_k25",
        "kimi_vl",
        "lfm2-vl",
        "llama4",
        "minimax_m3_vl",
        "mistral3",
        "muse_spark",
        "pixtral",
        "qwen2_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "kimi_k3",
    }
)


def text_modules() -> list[str]:
    """Every architecture module of the installed mlx_lm.models."""
    import mlx_lm.models

    return sorted(name for _, name, _ in pkgutil.iter_modules(mlx_lm.models.__path__) if name not in HELPERS)


def config_for(module: str) -> dict:
    """A fresh copy of the module's tiny config; KeyError when it has none (see MLX_LM_CANNOT_RUN)."""
    return copy.deepcopy(_CONFIGS[module]["config"])


def config_source(module: str) -> str:
    return _CONFIGS[module]["source"]


def has_config(module: str) -> bool:
    return module in _CONFIGS
