"""A prompt with images as the engine takes it: token ids with each image's placeholder expanded, where each
image's tokens are, and the processor's arrays for the model.

The processor expands an image's placeholder into the model's image tokens (one id repeated, sometimes with row
or tile markers between runs of it). The engine needs where each image starts (the prefix cache hashes the
image's digest into the block it starts in) and the model needs the arrays (pixel_values, grids, masks). The
spans are read from the token ids: one run of image tokens per image in the common case (Qwen, Gemma, LLaVA);
where an image takes several runs (tiles, row breaks) the caller gives each image's count of image tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mlxpaged.engine.request import ImageSpan
from mlxpaged.errors import ImageInputError

import mlx.core as mx

# A processor's outputs by name: arrays, or a list of arrays where the images' shapes differ (Gemma 4's pixels).
ProcessorArrays = Mapping[str, mx.array | list[mx.array]]


@dataclass(frozen=True)
class ImagePrompt:
    """`token_ids` with every image expanded; `images` where each one's tokens are (in order, with its content
    digest); `arrays`, the processor's outputs for the model (pixel_values, ...; a list of arrays where the images'
    shapes differ: Gemma 4's)."""

    token_ids: list[int]
    images: tuple[ImageSpan, ...]
    arrays: ProcessorArrays = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Evaluated here, on the thread that made them: MLX's streams are per thread, so a lazy array built on a
        # request's thread fails on the engine's ("There is no Stream(cpu, 0) in current thread").
        mx.eval(*self.arrays.values())


def image_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of `image_token_id`, in order."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(token_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


def image_spans(
    token_ids: Sequence[int], image_token_id: int, digests: Sequence[str], counts: Sequence[int] | None = None
) -> tuple[ImageSpan, ...]:
    """Each image's span (from its first image token to its last) and digest. Without `counts` each image must be
    one run of image tokens; with them, image i owns the next `counts[i]` image tokens. ValueError when the
    prompt's image tokens do not add up to the images."""
    runs = image_runs(token_ids, image_token_id)
    if counts is None:
        if len(runs) != len(digests):
            raise ValueError(
                f"{len(digests)} images but {len(runs)} runs of image token {image_token_id}: give each image's count"
            )
        return tuple(ImageSpan(start, length, d) for (start, length), d in zip(runs, digests, strict=True))
    positions = [p for start, length in runs for p in range(start, start + length)]
    if len(counts) != len(digests) or sum(counts) != len(positions):
        raise ValueError(
            f"{len(positions)} image tokens in the prompt for {len(digests)} images of {list(counts)} tokens"
        )
    spans, taken = [], 0
    for count, digest in zip(counts, digests, strict=True):
        first, last = positions[taken], positions[taken + count - 1]
        spans.append(ImageSpan(first, last - first + 1, digest))
        taken += count
    return tuple(spans)


def with_prefix(prompt: ImagePrompt, prefix: Sequence[int]) -> ImagePrompt:
    """`prefix` token ids before the prompt (Ollama's `context`: an earlier exchange's tokens), spans shifted.
    ValueError when the prefix holds image tokens: their images are not in this request."""
    image_tokens = {prompt.token_ids[image.start] for image in prompt.images}
    if image_tokens & set(prefix):
        raise ImageInputError(
            "an earlier context that holds images cannot be continued with new images", param="images"
        )
    shift = len(prefix)
    images = tuple(ImageSpan(i.start + shift, i.length, i.digest) for i in prompt.images)
    arrays = dict(prompt.arrays)
    # The processor's arrays over its own tokens cover the prefix too: attended (the mask), text (each token's kind).
    for name, fill in (("attention_mask", 1), ("mm_token_type_ids", 0), ("token_type_ids", 0)):
        if name in arrays:
            array = arrays[name]
            assert isinstance(array, mx.array)  # one row per token, never a list
            arrays[name] = mx.concatenate([mx.full((array.shape[0], shift), fill, dtype=array.dtype), array], axis=1)
    return ImagePrompt([*prefix, *prompt.token_ids], images, arrays)
