"""Positions for language models that take them from the prompt's images (M-RoPE: Qwen2-VL and after).

Such a model rotates each token by three positions (time, height, width): an image's tokens share their time
and count rows and columns, and every token after the image continues from the largest position before it, so
a prompt's positions end `delta` away from its length (negative: an image's tokens take fewer positions than
there are of them). mlx-vlm's language models work those out on their first call and keep them, with `delta`,
as state for the calls that follow (one sequence at a time). The engine's passes mix requests, so every pass
gives the model `position_ids` [3, B, L] itself: a prompt chunk its slice of the prompt's positions, every other
row (decode, text, the tokens after a prompt) its offset plus its request's delta, zero for text requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import mlx.core as mx
import mlx.nn as nn

# The processor's arrays the model's own get_rope_index reads (the grids give each image's rows and columns).
_GRIDS = ("image_grid_thw", "video_grid_thw")


def takes_positions(language_model: nn.Module) -> bool:
    """True for a language model whose positions come from the images (it has mlx-vlm's get_rope_index)."""
    return callable(getattr(language_model, "get_rope_index", None))


def prompt_positions(
    language_model: nn.Module, token_ids: Sequence[int], arrays: Mapping[str, object]
) -> tuple[mx.array, int]:
    """The prompt's positions [3, 1, L] and its delta, from the model's own get_rope_index (token ids and the
    images' grids only: no pixels, no vision tower)."""
    positions, delta = language_model.get_rope_index(
        mx.array([list(token_ids)]), *(arrays.get(name) for name in _GRIDS), arrays.get("attention_mask")
    )
    return positions, int(cast(int, mx.array(delta).reshape(-1)[0].item()))  # delta [1, 1]: an integer


def row_positions(starts: Sequence[int], deltas: Sequence[int], length: int) -> mx.array:
    """Positions [3, B, length] of rows whose tokens start at `starts`, shifted by their requests' `deltas` (the
    same in all three dimensions: text)."""
    first = mx.array([start + delta for start, delta in zip(starts, deltas, strict=True)], dtype=mx.int32)
    rows = first[:, None] + mx.arange(length, dtype=mx.int32)[None, :]
    return mx.broadcast_to(rows[None], (3, *rows.shape))
