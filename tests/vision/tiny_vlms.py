"""Tiny random vision-language models of mlx-vlm's architectures, built in code (float32, seeded), and prompts
for them: the image tokens expanded as each model's processor would, and random pixels."""

from __future__ import annotations

import hashlib

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.vision.loading import image_token_id
from mlxpaged.vision.prompt import ImagePrompt, image_spans

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

VOCAB = 256
IMAGE_SIZE, PATCH = 56, 14  # 16 patches; idefics3's pixel shuffle (scale 2) makes 4 image tokens of them


def tiny_idefics3():
    from mlx_vlm.models import idefics3

    config = idefics3.ModelConfig(
        text_config=idefics3.TextConfig(
            model_type="idefics3",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            vocab_size=VOCAB,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
        ),
        vision_config=idefics3.VisionConfig(
            model_type="idefics3",
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            num_channels=3,
        ),
        model_type="idefics3",
        image_token_id=VOCAB - 1,
    )
    mx.random.seed(0)
    return _scaled(idefics3.Model(config))


def _scaled(model, scale: float = 3.0):
    """float32, matrices x3 so attention is far from uniform (as tests/archs does for text models)."""
    model.update(tree_map(lambda p: p.astype(mx.float32) * (scale if p.ndim == 2 else 1.0), model.parameters()))
    mx.eval(model.parameters())
    return model


def pixels(seed: int) -> mx.array:
    """One image's pixel_values [1, 1, 3, H, W] (idefics3's layout: batch, images, channels, height, width)."""
    rng = np.random.default_rng(seed)
    return mx.array(rng.uniform(-1, 1, (1, 1, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32))


def image_prompt(vlm, before: list[int], after: list[int], seed: int, tokens_per_image: int = 4) -> ImagePrompt:
    """`before` + one image's tokens + `after`, the image random pixels of `seed` (its digest names the seed)."""
    image = image_token_id(vlm)
    token_ids = before + [image] * tokens_per_image + after
    digest = hashlib.sha256(f"pixels-{seed}".encode()).hexdigest()
    return ImagePrompt(token_ids, image_spans(token_ids, image, [digest]), {"pixel_values": pixels(seed)})
