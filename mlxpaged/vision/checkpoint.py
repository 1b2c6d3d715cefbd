"""Is a model directory a vision-language checkpoint, and does it load here with its vision tower. Plain Python:
nothing of mlx-vlm is imported to answer.

A checkpoint is a vision-language one when its config.json has a `vision_config`. With the vision extra
installed it loads through mlx-vlm (vision/loading.py: images work); without it, or for a kind not served with
images yet, it loads through mlx-lm where mlx-lm knows it (text only: an image then gets an error naming why).
"""

from __future__ import annotations

import importlib.util

EXTRA = "mlxpaged[vision]"
INSTALL_HINT = f"install the vision extra: pip install '{EXTRA}' (in a checkout: pip install -e '.[vision]')"
# Language models whose positions come from the prompt's images (M-RoPE: Qwen2-VL and after): every pass would
# pass them, which the engine does not do yet. They load as text models where mlx-lm has them.
POSITIONS_NOT_YET = "its language model takes 3-D (M-RoPE) positions from the prompt's images"
MROPE_MODEL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_omni_moe", "glm4v"}
)


def is_vision_checkpoint(config: dict) -> bool:
    return isinstance(config.get("vision_config"), dict)


def vision_installed() -> bool:
    return importlib.util.find_spec("mlx_vlm") is not None


def serves_images(config: dict) -> str | None:
    """Why a vision-language checkpoint loads as a text model here (None: it loads with its vision tower)."""
    if not vision_installed():
        return f"the vision extra is not installed ({INSTALL_HINT})"
    model_type = str(config.get("model_type", ""))
    if model_type in MROPE_MODEL_TYPES:
        return f"model type {model_type!r}: {POSITIONS_NOT_YET}, which the engine does not pass yet"
    return None


def loads_with_images(config: dict) -> bool:
    """True when the checkpoint of `config` loads with its vision tower (else through mlx-lm, text only)."""
    return is_vision_checkpoint(config) and serves_images(config) is None


def images_refused(name: str, config: dict) -> str:
    """Why model `name` (its config.json `config`), loaded without a vision tower, takes no images."""
    if not is_vision_checkpoint(config):
        return f"model {name!r} takes no images: it is a text model"
    return f"model {name!r} was loaded as a text model, so it takes no images: {serves_images(config)}"


def text_load_refused(config: dict) -> str | None:
    """For a checkpoint mlx-lm cannot load: why, when it is a vision-language one that would load here with its
    vision tower but for `serves_images` (None: it is not such a checkpoint)."""
    if not is_vision_checkpoint(config):
        return None
    return f"model type {config.get('model_type')!r} is a vision-language model: {serves_images(config)}"
