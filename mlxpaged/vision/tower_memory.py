"""What images cost the vision tower in memory, so the plan sets it aside before the KV cache takes it
(platform/memory.py), and before any weight is read.

An image of at most N pixels is measured as the model's own processor resizes a square image of N pixels (Qwen's max
pixels, Gemma 4's soft-token budget, SmolVLM's tiles of its longest edge: no rule per family is written here; other
shapes keep about as many pixels). Its patches are read from what the processor gives the tower: Qwen's grid
(t x h x w patches), or the pixel arrays' shapes over the tower's patch size ([images or tiles, channels, H, W];
Gemma 4's list of them). The plan chooses among N = 50 MP, 25 MP, ... (CANDIDATES) or the one asked for.

The tower's peak over those patches, per layer (MLX frees a layer's intermediates once the next one has read its
output): the residual stream, Q, K, V and the attention's output (4 x hidden) and the MLP's two intermediate arrays
(2 x intermediate) per patch, doubled (a layer's input is alive while its output is built, and the merge writes the
features into the prompt's embeddings); a float copy of the pixels (the patch embedding's input); a dense mask where
the tower makes one (MASKED_TOWERS: (patches attended together)^2 x 4 bytes); and the attention scores where MLX's
attention materializes them: heads x (patches attended together)^2 x 4 bytes (a batch of tiles attends in one
call), twice where a mask is added into a copy of them. MLX's fused attention does not materialize them: on Metal
for head dims 64, 80 and 128 over more than 8 queries (`sdpa_full_supported_head_dim` in MLX 0.32's
scaled_dot_product_attention.cpp), on CUDA (cuDNN) for float16 / bfloat16; the CPU backend always does. Checked on
the CPU against MLX's peak memory over tiny towers (tests/vision/test_tower_memory.py: the terms 1.0-1.4x what they
take, the figure with PLAN_MARGIN 1.3-1.7x).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.config import DEFAULT_MAX_IMAGE_PIXELS
from mlxpaged.platform.model_facts import TowerRung

import mlx.core as mx
import numpy as np

CANDIDATES = 8  # 50 MP, 25 MP, ... 0.4 MP (memory.py takes the largest that fits)
FUSED_HEAD_DIMS_METAL = (64, 80, 128)
# Towers whose attention takes a dense mask over the patches (read from mlx-vlm 0.7.10's vision.py files): Pixtral's
# block mask between images (Mistral 3), Gemma 4's padding mask. The others attend without one (Qwen's split per
# image, SigLIP, CLIP).
MASKED_TOWERS = frozenset({"pixtral", "gemma4_vision"})
LAYER_SAFETY_FACTOR = 2
# A quarter more than the terms add up to: MLX's evaluation of a lazy graph may hold a little more at once (the CPU
# check came within 3% of the terms for an unmasked tower).
PLAN_MARGIN = 1.25
SCORE_BYTES = 4  # float32 scores: the unfused path's softmax


@dataclass(frozen=True)
class LargestImage:
    """The largest image as the processor gives it to the tower, from a square of `pixels`: `patches` in all (every
    tile's), and `scores`, the attention scores per head of the tower's largest attention call (patches x patches
    of each view the call attends: the tiles of one batch together, Qwen's images one by one)."""

    pixels: int
    patches: int
    scores: int
    values: int  # elements of the pixel arrays the processor gives the tower


@dataclass(frozen=True)
class Tower:
    """The vision tower's widths, from the model's vision config (mlx-vlm's, its defaults filled in)."""

    hidden: int
    intermediate: int
    heads: int
    patch_size: int
    masked: bool = False  # its attention takes a dense [patches, patches] mask (MASKED_TOWERS)

    @classmethod
    def from_config(cls, config) -> Tower:
        """From mlx-vlm's VisionConfig (its defaults filled in). Qwen2-VL names its width
        `embed_dim` (its `hidden_size` is the language model's) and its MLP by `mlp_ratio`."""
        hidden = int(_first(config, ("embed_dim", "hidden_size", "width")))
        intermediate = _first(config, ("intermediate_size",), None)
        if intermediate is None:
            intermediate = hidden * float(_first(config, ("mlp_ratio",), 4))
        heads = int(_first(config, ("num_attention_heads", "num_heads")))
        patch = _first(config, ("patch_size",))
        patch = int(patch[0] if isinstance(patch, list | tuple) else patch)
        return cls(hidden, int(intermediate), heads, patch, _first(config, ("model_type",), "") in MASKED_TOWERS)

    def activation_bytes(self, largest: LargestImage, dtype_bytes: int, backend: str) -> int:
        """The tower's peak over `largest` (module docstring) with activations of `dtype_bytes` on `backend`."""
        per_patch = (4 * self.hidden + 2 * self.intermediate) * dtype_bytes
        pixels = largest.values * SCORE_BYTES  # the patch embedding's float copy of the pixels
        mask = largest.scores * SCORE_BYTES if self.masked else 0  # an additive mask over the views attended together
        scores = 0
        if not self.attention_fused(dtype_bytes, backend):  # the scores, and the copy a mask is added into
            scores = (2 if self.masked else 1) * self.heads * largest.scores * SCORE_BYTES
        return int(PLAN_MARGIN * (LAYER_SAFETY_FACTOR * largest.patches * per_patch + pixels + mask + scores))

    def attention_fused(self, dtype_bytes: int, backend: str) -> bool:
        """Whether MLX's attention on `backend` keeps the scores out of memory for this tower."""
        if backend == "metal":
            return self.hidden // self.heads in FUSED_HEAD_DIMS_METAL
        if backend == "cuda":
            return dtype_bytes == 2
        return False


def _first(config, names: tuple[str, ...], default=...):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is ...:
        raise ValueError(f"the vision config names none of {', '.join(names)}")
    return default


def largest_image(processor, model_config, image_token_id: int, max_pixels: int, patch_size: int) -> LargestImage:
    """What the model's `processor` makes of a square image of `max_pixels` (see the module docstring)."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens
    from PIL import Image

    side = max(1, math.isqrt(max_pixels))
    text = apply_chat_template(
        processor, model_config, [{"role": "user", "content": [{"type": "image"}]}], num_images=1
    )
    inputs = prepare_inputs(
        processor,
        images=[Image.new("RGB", (side, side))],
        prompts=text,
        image_token_index=image_token_id,
        add_special_tokens=should_add_special_tokens(model_config.model_type, processor),
    )
    patches, scores = _patches(inputs, patch_size)
    values = inputs["pixel_values"]
    values = sum(int(np.prod(v.shape)) for v in (values if isinstance(values, list | tuple) else [values]))
    return LargestImage(side * side, patches, scores, values)


def _patches(inputs, patch_size: int) -> tuple[int, int]:
    """(patches in all, attention scores per head of the largest call) of one processed image."""
    grid = inputs.get("image_grid_thw")
    if grid is not None:  # Qwen and GLM: [images, (t, h, w)] in patches, attended image by image (full layers)
        sizes = [int(np.prod(row)) for row in np.array(grid).reshape(-1, 3)]
        return sum(sizes), max(size * size for size in sizes)
    pixels = inputs["pixel_values"]
    arrays = pixels if isinstance(pixels, list | tuple) else [pixels]  # a list: images of other shapes, one by one
    total, scores = 0, 0
    for array in arrays:
        shape = tuple(array.shape if isinstance(array, mx.array) else np.array(array).shape)
        height, width = shape[-2:]
        per_view = (height // patch_size) * (width // patch_size)
        views = int(np.prod(shape[:-3])) if len(shape) > 3 else 1  # [images or tiles, ..., channels, H, W]: a batch
        total += per_view * views
        scores = max(scores, views * per_view * per_view)
    return total, scores


def tower_rungs(
    processor, model_config, image_token_id: int, dtype_bytes: int, backend: str, pixels: Sequence[int]
) -> tuple[TowerRung, ...]:
    """For the memory plan, largest first: the tower of mlx-vlm's `model_config` over the most any image of at most
    each of `pixels` costs, as its `processor` resizes a square image of that size and of each smaller one (a
    processor's output need not grow with the image: Gemma 4's rounds to its pooling). Sizes that cost alike keep
    the largest, so no image is scaled down for nothing."""
    tower = Tower.from_config(model_config.vision_config)
    costs: list[tuple[int, tuple[int, int]]] = []  # (pixels, (bytes, patches)), the most up to each size
    for size in sorted(pixels):
        largest = largest_image(processor, model_config, image_token_id, size, tower.patch_size)
        cost = (tower.activation_bytes(largest, dtype_bytes, backend), largest.patches)
        costs.append((size, max(cost, costs[-1][1]) if costs else cost))
    rungs: list[TowerRung] = []
    for size, (nbytes, patches) in reversed(costs):
        if not rungs or rungs[-1].bytes != nbytes:
            rungs.append(TowerRung(size, patches, nbytes))
        # an equal cost at a smaller size: the larger size's rung holds it
    return tuple(rungs)


def candidate_pixels(asked: int | None) -> tuple[int, ...]:
    """The image sizes the plan chooses among: the one asked for (CacheConfig.image_memory_pixels), else the
    largest a request may send halved down to CANDIDATES sizes."""
    if asked is not None:
        return (asked,)
    return tuple(DEFAULT_MAX_IMAGE_PIXELS >> k for k in range(CANDIDATES))
