"""Which vision-language checkpoints load with their vision tower, read from config.json alone, and why the others
take no images (vision/checkpoint.py)."""

from __future__ import annotations

from mlxpaged.vision.checkpoint import images_refused, loads_with_images, serves_images, text_load_refused

import pytest

VISION = {"model_type": "siglip_vision_model", "hidden_size": 32}
GEMMA4_VISION_BOTH_WAYS = {"use_bidirectional_attention": "vision"}


@pytest.mark.parametrize(
    "model_type",
    ["idefics3", "smolvlm", "gemma3", "llava", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"],
)
def test_causal_vision_language_models_load_with_their_tower(model_type):
    config = {"model_type": model_type, "vision_config": VISION, "text_config": {}}
    assert serves_images(config) is None and loads_with_images(config)


def test_a_text_model_is_not_a_vision_checkpoint():
    config = {"model_type": "llama", "hidden_size": 64}
    assert not loads_with_images(config) and text_load_refused(config) is None
    assert images_refused("tiny", config) == "model 'tiny' takes no images: it is a text model"


def test_m_rope_models_not_checked_yet_are_refused_naming_their_positions():
    config = {"model_type": "qwen3_omni_moe", "vision_config": VISION}
    reason = serves_images(config)
    assert "3-D (M-RoPE) positions from the prompt's images, which the engine gives only glm4v, qwen2_5_vl" in reason
    assert "qwen3_5, qwen3_5_moe" in reason
    assert not loads_with_images(config)
    assert images_refused("qwen", config).startswith("model 'qwen' was loaded as a text model, so it takes no images")


@pytest.mark.parametrize(
    "config, value",
    [
        (
            {"model_type": "gemma4", "vision_config": VISION, "text_config": {"use_bidirectional_attention": "all"}},
            "'all'",
        ),
        (
            {"model_type": "gemma3", "vision_config": VISION, "text_config": {"use_bidirectional_attention": True}},
            "True",
        ),
    ],
    ids=["gemma4-all", "gemma3-true"],
)
def test_language_models_attending_both_ways_are_refused_with_the_reason(config, value):
    reason = serves_images(config)
    assert reason is not None and f"attends both ways (use_bidirectional_attention: {value})" in reason
    assert "chunked prefill and prefix cache" in reason
    assert not loads_with_images(config)
    assert text_load_refused(config) == f"model type {config['model_type']!r} is a vision-language model: {reason}"


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "paligemma", "vision_config": VISION, "text_config": {}},  # mlx-vlm's default: both ways
        {"model_type": "paligemma", "vision_config": VISION, "use_bidirectional_attention": True},
    ],
    ids=["paligemma-default", "paligemma-top-level"],
)
def test_paligemma_attending_both_ways_over_its_prompt_loads_with_its_tower(config):
    """Each prompt is prefilled in one chunk under a mask that lets every token see every other (engine/request.py
    Request.both_ways), its prefix cache off (tests/vision/test_engine_images.py, paligemma)."""
    assert serves_images(config) is None and loads_with_images(config)


def test_gemma4_attending_both_ways_within_each_image_loads_with_its_tower():
    """The engine prefills each image whole under a mask that lets its tokens see each other (tests/vision/
    test_engine_images.py, gemma4-both-ways)."""
    config = {"model_type": "gemma4", "vision_config": VISION, "text_config": GEMMA4_VISION_BOTH_WAYS}
    assert serves_images(config) is None and loads_with_images(config)


@pytest.mark.parametrize("model_type", ["paligemma", "gemma4"])
def test_a_causal_config_of_those_kinds_loads_with_its_tower(model_type):
    config = {"model_type": model_type, "vision_config": VISION, "text_config": {"use_bidirectional_attention": False}}
    assert serves_images(config) is None
