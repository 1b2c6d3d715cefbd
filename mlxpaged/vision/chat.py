"""A chat with images as the engine takes it: the checkpoint's own chat template with each image where the user
put it, expanded by the model's own processor, as mlx-vlm's server builds it (so `usage.prompt_tokens` counts
an image's tokens as mlx-vlm does).

Messages are the Python API's: `content` a string or a list of parts, `{"type": "text", "text": ...}` and
`{"type": "image", "image": <a path, bytes, a data URL or a PIL image>}` (front ends turn their APIs' image
parts into these). Images are numbered across the whole conversation, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.vision.images import (
    DEFAULT_LIMITS,
    ImageLimits,
    check_count,
    decode_image,
    image_parts,
    placeholders,
    scaled_to,
)
from mlxpaged.vision.loading import VisionParts
from mlxpaged.vision.prompt import ImagePrompt, image_runs, image_spans

import mlx.core as mx
import numpy as np


def chat_image_prompt(
    vision: VisionParts,
    messages: Sequence[dict],
    limits: ImageLimits = DEFAULT_LIMITS,
    planned_pixels: int | None = None,
    **template_options,
) -> ImagePrompt:
    """The conversation as an ImagePrompt: rendered with the checkpoint's template (images as placeholders where
    they are), then the processor expands each one and computes the model's arrays. An image larger than
    `planned_pixels` (what the vision tower's memory is planned for) is scaled down to it first; its digest is the
    image's as sent."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    sources = image_parts(messages)
    check_count(len(sources), limits)
    decoded = [decode_image(source, i, limits) for i, source in enumerate(sources)]
    config = vision.model.config
    template_messages = [placeholders(message) for message in messages]
    text = apply_chat_template(vision.processor, config, template_messages, num_images=len(decoded), **template_options)
    inputs = prepare_inputs(
        vision.processor,
        images=[scaled_to(d.image, planned_pixels) for d in decoded] or None,
        prompts=text,
        image_token_index=vision.image_token_id,
        add_special_tokens=should_add_special_tokens(config.model_type, vision.processor),
    )
    token_ids = [int(t) for t in np.array(inputs["input_ids"]).reshape(-1)]
    arrays = {k: _as_mlx(v) for k, v in inputs.items() if _is_array(v) or _is_arrays(v)}
    arrays.pop("input_ids", None)
    digests = [d.digest for d in decoded]
    counts = None
    if len(image_runs(token_ids, vision.image_token_id)) != len(decoded):  # several runs an image: count each one
        counts = [
            _image_token_count(vision, scaled_to(d.image, planned_pixels), config, should_add_special_tokens)
            for d in decoded
        ]
    return ImagePrompt(token_ids, image_spans(token_ids, vision.image_token_id, digests, counts), arrays)


def _image_token_count(vision: VisionParts, image, config, should_add_special_tokens) -> int:
    """How many image tokens the processor expands one image into (for processors that split an image into
    several runs: tiles, rows)."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    text = apply_chat_template(
        vision.processor, config, [{"role": "user", "content": [{"type": "image"}]}], num_images=1
    )
    inputs = prepare_inputs(
        vision.processor,
        images=[image],
        prompts=text,
        image_token_index=vision.image_token_id,
        add_special_tokens=should_add_special_tokens(config.model_type, vision.processor),
    )
    return int((np.array(inputs["input_ids"]) == vision.image_token_id).sum())


def _is_array(value: object) -> bool:
    return isinstance(value, mx.array | np.ndarray)


def _is_arrays(value: object) -> bool:
    """A list of arrays: Gemma 4's processor gives images of different shapes as a list of pixel arrays."""
    return isinstance(value, list | tuple) and bool(value) and all(_is_array(v) for v in value)


def _as_mlx(value):
    if isinstance(value, list | tuple):
        return [_as_mlx(v) for v in value]
    return value if isinstance(value, mx.array) else mx.array(value)
