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
# Language models whose positions come from the prompt's images (M-RoPE: Qwen2-VL and after). Every pass gives
# them their positions (vision/positions.py); the kinds checked against mlx-vlm load with their tower, the others
# load as text models where mlx-lm has them.
POSITIONS_CHECKED = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v"})
POSITIONS_NOT_YET = (
    "its language model takes 3-D (M-RoPE) positions from the prompt's images, which the engine gives only "
    f"{', '.join(sorted(POSITIONS_CHECKED))} so far"
)
MROPE_MODEL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_omni_moe", "glm4v"}
)
# Language models that attend both ways, served by prefilling each span so attended in one chunk under a mask that
# lets its tokens see each other (engine/request.py Request.both_ways). PaliGemma attends both ways over its whole
# prompt (a prefix-LM; mlx-vlm and transformers default to it when the config is silent): a block's keys and values
# depend on every prompt token after it, so its prefix cache is off (engine/build.py). Gemma 4's larger models attend
# both ways within each image only (their text config says "vision"): an image's blocks are cached under its own
# digest, so a hit reuses keys computed with the same whole image. Any other both-ways config is refused.
BOTH_WAYS_DEFAULT = {"paligemma": True}
IMAGES_BOTH_WAYS = "vision"
PROMPT_BOTH_WAYS = frozenset({"paligemma"})  # a true use_bidirectional_attention: the whole prompt, served


def is_vision_checkpoint(config: dict) -> bool:
    return isinstance(config.get("vision_config"), dict)


def vision_installed() -> bool:
    return importlib.util.find_spec("mlx_vlm") is not None


def serves_images(config: dict) -> str | None:
    """Why a vision-language checkpoint loads as a text model here (None: it loads with its vision tower)."""
    if not vision_installed():
        return f"the vision extra is not installed ({INSTALL_HINT})"
    model_type = str(config.get("model_type", ""))
    if model_type in MROPE_MODEL_TYPES - POSITIONS_CHECKED:
        return f"model type {model_type!r}: {POSITIONS_NOT_YET}"
    both_ways = attends_both_ways(config)
    if both_ways and both_ways != IMAGES_BOTH_WAYS and not (both_ways is True and model_type in PROMPT_BOTH_WAYS):
        return (
            f"model type {model_type!r}: its language model attends both ways (use_bidirectional_attention: "
            f"{both_ways!r}), so keys and values in the prompt depend on the tokens after them, which the paged "
            "engine's chunked prefill and prefix cache do not compute"
        )
    return None


def attends_both_ways(config: dict) -> object:
    """The config's `use_bidirectional_attention` as mlx-vlm reads it (text config first, else the top level,
    else the model type's default); falsy when the language model is causal throughout."""
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}
    value = text.get("use_bidirectional_attention", config.get("use_bidirectional_attention"))
    return BOTH_WAYS_DEFAULT.get(str(config.get("model_type", "")), False) if value is None else value


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
