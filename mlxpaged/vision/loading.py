"""Loading a vision-language checkpoint through mlx-vlm: the whole model, its processor, and the language model
wrapped as the engine runs every model (language.py). Which checkpoints load here: checkpoint.py."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.errors import UnsupportedModelError
from mlxpaged.platform.model_facts import TowerRung
from mlxpaged.vision.checkpoint import IMAGES_BOTH_WAYS, POSITIONS_CHECKED, POSITIONS_NOT_YET, PROMPT_BOTH_WAYS
from mlxpaged.vision.language import VisionLanguageModel
from mlxpaged.vision.positions import takes_positions
from mlxpaged.vision.tower_memory import candidate_pixels, tower_rungs

import mlx.nn as nn


@dataclass
class VisionParts:
    """What a prompt's images go through: `model`, mlx-vlm's whole model (`get_input_embeddings`: the tower,
    the projector, the merge), and `processor`, the checkpoint's own (None for a model built in code)."""

    model: nn.Module
    processor: object | None
    image_token_id: int
    # Each image's tokens attend each other both ways (Gemma 4's larger models), or every prompt token every other
    # (PaliGemma, a prefix-LM): checkpoint.py BOTH_WAYS_DEFAULT, IMAGES_BOTH_WAYS.
    images_both_ways: bool = False
    prompt_both_ways: bool = False

    @property
    def both_ways(self) -> bool:
        """The engine makes the model's both-ways masks (Request.both_ways), for its images or its whole prompt."""
        return self.images_both_ways or self.prompt_both_ways


def image_token_id(vlm: nn.Module) -> int:
    """The id the processor expands each image into (mlx-vlm's configs name it one of two ways)."""
    return config_image_token_id(vlm.config)


def config_image_token_id(config) -> int:
    """image_token_id of mlx-vlm's model config."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"model type {config.model_type!r}: no image token id in its config")


def vision_parts(vlm: nn.Module, processor: object | None) -> tuple[VisionLanguageModel, VisionParts]:
    """The engine's model and the vision parts of an mlx-vlm model (built or loaded)."""
    text_config = getattr(vlm.config, "text_config", None)
    both_ways = getattr(text_config, "use_bidirectional_attention", None)
    prompt = bool(both_ways) and vlm.config.model_type in PROMPT_BOTH_WAYS
    language = VisionLanguageModel(vlm.language_model, vlm.config.model_type, masks_given=prompt)
    return language, VisionParts(vlm, processor, image_token_id(vlm), both_ways == IMAGES_BOTH_WAYS, prompt)


def unweighted_vision_model(model_dir: Path) -> VisionLanguageModel:
    """The language model as the engine runs it, built from config.json and never given weights (lazy random
    parameters): for reading shapes and caches before any weight is read (loading/checkpoint.py)."""
    model_class, model_config = _model_config(model_dir)
    return vision_parts(model_class.Model(model_config), None)[0]


def _model_config(model_dir: Path):
    """mlx-vlm's model module and model config (its defaults filled in) for the checkpoint in `model_dir`."""
    from mlx_vlm.utils import get_model_and_args, load_config, update_module_configs

    config = load_config(model_dir)
    model_class, _ = get_model_and_args(config=config, model_path=model_dir)
    config.setdefault("text_config", config.pop("llm_config", {}))
    config.setdefault("vision_config", {})
    config.setdefault("audio_config", {})
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(
        model_config, model_class, config, ["text", "vision", "perceiver", "projector", "audio"]
    )
    return model_class, model_config


@functools.cache
def tower_before_load(model_dir: Path, dtype_bytes: int, backend: str, asked: int | None) -> tuple[TowerRung, ...]:
    """tower_memory.tower_rungs for a checkpoint's config and processor (no weight is read); kept, so the plan made
    once the model is loaded does not resize the same images again. A kind whose tower or processor the estimate
    cannot read (an architecture not checked here) loads with a warning and no tower line in its plan."""
    from mlx_vlm.utils import load_processor

    _, model_config = _model_config(model_dir)
    try:
        processor = load_processor(model_dir, add_detokenizer=False)
        token = config_image_token_id(model_config)
        return tower_rungs(processor, model_config, token, dtype_bytes, backend, candidate_pixels(asked))
    except Exception as exc:  # any failure of another library's code on a blank image: plan without it, say so
        warnings.warn(
            f"model type {model_config.model_type!r}: the vision tower's memory for images is not planned ({exc!r})",
            RuntimeWarning,
            stacklevel=2,
        )
        return ()


def load_vision_model(path: Path) -> tuple[nn.Module, object]:
    """mlx-vlm's model and processor from a local directory (no network). UnsupportedModelError when the model
    takes its positions from its images and is not of a kind checked so (one MROPE_MODEL_TYPES should name)."""
    from mlx_vlm.utils import load_model, load_processor

    vlm = load_model(path)
    model_type = vlm.config.model_type
    if takes_positions(vlm.language_model) and model_type not in POSITIONS_CHECKED:
        raise UnsupportedModelError(f"model type {model_type!r}: {POSITIONS_NOT_YET}; images are not served yet")
    processor = load_processor(path, add_detokenizer=False)
    return vlm, processor
