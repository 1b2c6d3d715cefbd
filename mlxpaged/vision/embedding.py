"""What the runner feeds a vision-language model for a prompt with images: the model's own merged embeddings.

mlx-vlm's generate computes `model.get_input_embeddings(input_ids, pixel_values, **processor_arrays)` once for
the whole prompt (the vision tower, the projector, the image features placed at the image tokens, and for
M-RoPE models the 3-D positions and their delta) and feeds the language model slices of it, chunk by chunk,
with the other outputs and the processor's arrays as keyword arguments (the model slices what it needs by its
cache's offset). The engine does the same: `PromptEmbedding` is that computation, done on the first prefill
chunk that needs it and kept until the request ends (a preempted request prefills again), and `chunk` gives a
pass its slice. Where every image of the prompt was encoded before (encoded_images.py), the embeddings are put
together from the text's and those images' rows instead: the vision tower does not run.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from mlxpaged.engine.request import ImageSpan
from mlxpaged.vision.encoded_images import EncodedImage, EncodedImages
from mlxpaged.vision.positions import prompt_positions, takes_positions
from mlxpaged.vision.prompt import ProcessorArrays

import mlx.core as mx
import mlx.nn as nn

# Processor outputs that are not the model's keyword arguments: the prompt itself and what goes to the tower.
_NOT_ARGUMENTS = ("input_ids", "attention_mask", "pixel_values")
# Each token's kind, from which Gemma 4's language model overlays its own both-ways mask on a whole prompt's (only
# when a pass is the whole prompt): where the model attends both ways the engine's views make that mask for any
# chunk (Request.both_ways), so the model is not given them.
_TOKEN_TYPES = ("mm_token_type_ids", "token_type_ids")
# What get_input_embeddings returns for the whole prompt that a chunk is given as its own slice instead
# (positions.py): the model would keep them as state.
_WHOLE_PROMPT_POSITIONS = ("position_ids", "rope_deltas")
# Qwen3-VL's deepstack: image features added to the hidden states of its first layers, at the visual positions.
_DEEPSTACK = frozenset({"visual_pos_masks", "deepstack_visual_embeds"})
# What get_input_embeddings computes from the token ids alone, the same with the pixels or without (Gemma 4's
# per-layer inputs, which read every image token as the pad token): a prompt put together from kept images takes
# them from its text.
_FROM_TOKENS = frozenset({"per_layer_inputs"})
# Merges that place an image's features by the prompt's positions, not by its image tokens (PaliGemma's: feature i
# at position i, as its processor puts the image first): an image's rows are not the same image's elsewhere.
_MERGED_BY_POSITION = frozenset({"paligemma"})


@cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return ""


def reads_argument(language_model: nn.Module, name: str) -> bool:
    """Whether the language model's forward reads the keyword argument `name`: a parameter of that name, a body that
    names it (`kwargs.pop("attention_mask_4d")`), or one that passes its **kwargs on. Gemma 3's takes **kwargs and
    reads none of them: the 4-D mask its get_input_embeddings returns is dropped there (mlx-vlm's generate passes it
    the same way), so it is no input of the pass, and an image's merged rows are all the language model gets of it.
    Unsure (no source): read."""
    if name in inspect.signature(language_model.__call__).parameters:
        return True
    source = _forward_source(type(language_model))
    return not source or name in source or source.count("**kwargs") > 1


@dataclass(frozen=True)
class ChunkEmbedding:
    """A prefill pass's inputs besides its tokens: `inputs_embeds` [1, n, hidden] and the language model's
    keyword arguments for this prompt."""

    inputs_embeds: mx.array
    arguments: Mapping[str, object]


class PromptEmbedding:
    """The merged embeddings of one prompt with images, computed by the model on first use. A chunk that starts
    after the prompt's last image (its image tokens all came from the prefix cache: an agent's next turn) is
    embedded as text alone: the vision tower does not run for it."""

    def __init__(
        self,
        vlm: nn.Module,
        token_ids: Sequence[int],
        arrays: ProcessorArrays,
        images: Sequence[ImageSpan] = (),
        encoded: EncodedImages | None = None,
        both_ways: bool = False,
    ):
        self._vlm = vlm
        self._token_ids = list(token_ids)
        self._arrays = dict(arrays)  # pixel_values and whatever else the processor returned for the images
        self._images = tuple(images)  # where each image's tokens are, and its digest
        by_position = vlm.config.model_type in _MERGED_BY_POSITION
        self._encoded = None if by_position else encoded  # images encoded before, by digest (None: encode each time)
        self._both_ways = both_ways  # the engine makes the model's both-ways masks (VisionParts.both_ways)
        # Where the prompt's last image token ends (no spans: anywhere, so every chunk takes the merged embeddings).
        self._images_end = max((i.start + i.length for i in self._images), default=len(self._token_ids))
        self._embeds: mx.array | None = None
        self._arguments: dict[str, object] = {}
        self._takes_positions = takes_positions(vlm.language_model)
        self._positions: tuple[mx.array, int] | None = None  # the prompt's M-RoPE positions and delta, once read

    @property
    def computed(self) -> bool:
        return self._embeds is not None

    @property
    def position_delta(self) -> int:
        """How far the prompt's positions end from its length (positions.py); 0 for a model without M-RoPE."""
        return self._prompt_positions()[1] if self._takes_positions else 0

    def _prompt_positions(self) -> tuple[mx.array, int]:
        if self._positions is None:
            self._positions = prompt_positions(self._vlm.language_model, self._token_ids, self._arrays)
            mx.eval(self._positions[0])
        return self._positions

    def compute(self) -> None:
        """Run the vision tower and merge (once), or put the embeddings together from images encoded before."""
        if self._embeds is not None:
            return
        dropped = _NOT_ARGUMENTS + (_TOKEN_TYPES if self._both_ways else ())
        extra: dict[str, object] = {k: v for k, v in self._arrays.items() if k not in dropped}
        kept = None
        if self._encoded is not None and not self._pads_in_text(0, len(self._token_ids)):
            kept = self._encoded.images([i.digest for i in self._images])
        if kept is not None:
            self._embeds, from_tokens = self._with_rows([image.rows for image in kept])
            self._arguments = {**extra, **from_tokens, **self._deepstack_arguments(kept)}
            mx.eval(self._embeds)
            return
        out = self._vlm.get_input_embeddings(
            mx.array([self._token_ids]),
            self._arrays.get("pixel_values"),
            mask=self._arrays.get("attention_mask"),
            **extra,
        )
        fields = out.to_dict() if hasattr(out, "to_dict") else {"inputs_embeds": out}
        self._embeds = fields.pop("inputs_embeds")
        fields = self._read_fields(fields)
        self._arguments = {**extra, **fields}
        mx.eval(self._embeds, *(v for v in self._arguments.values() if isinstance(v, mx.array)))
        if self._encoded is None:
            return
        # Kept when the rows (and Qwen3-VL's deepstack shares) are all the language model reads of an image.
        shares: list[tuple[mx.array, ...]] | None = None
        read = set(fields) - _FROM_TOKENS  # what the language model reads of the images besides their rows
        if not read:
            shares = [()] * len(self._images)
        elif read == _DEEPSTACK:
            shares = self._deepstack_shares(fields)
        if shares is None:  # the language model reads more of the images than their rows and deepstack shares
            return
        for image, share in zip(self._images, shares, strict=True):
            self._encoded.keep(image.digest, self._embeds[0, image.start : image.start + image.length], share)

    def _visual_tokens(self) -> list[int]:
        """Ids of the tokens Qwen3-VL's deepstack adds features at (its image and video tokens)."""
        config = self._vlm.config
        tokens = (getattr(config, "image_token_index", None), getattr(config, "video_token_index", None))
        return [t for t in tokens if isinstance(t, int)]

    def _deepstack_shares(self, fields: Mapping[str, object]) -> list[tuple[mx.array, ...]] | None:
        """Each image's share of the prompt's deepstack features (their rows are the prompt's visual tokens in
        order): None unless every visual token lies in an image's span."""
        visual = set(self._visual_tokens())
        layers = fields["deepstack_visual_embeds"]
        counts = [sum(t in visual for t in self._token_ids[i.start : i.start + i.length]) for i in self._images]
        if not isinstance(layers, list | tuple) or sum(counts) != sum(t in visual for t in self._token_ids):
            return None
        shares, at = [], 0
        for n in counts:
            shares.append(tuple(layer[at : at + n] for layer in layers))
            at += n
        return shares

    def _deepstack_arguments(self, kept: Sequence[EncodedImage]) -> dict[str, object]:
        """The deepstack arguments of a prompt put together from kept images (none for a model without them)."""
        if not kept or not kept[0].deepstack:
            return {}
        ids = mx.array([self._token_ids])
        masks = [ids == token for token in self._visual_tokens()]
        layers = [mx.concatenate([image.deepstack[k] for image in kept]) for k in range(len(kept[0].deepstack))]
        mask = masks[0]
        for other in masks[1:]:
            mask = mask | other
        return {"visual_pos_masks": mask, "deepstack_visual_embeds": layers}

    def _with_rows(self, rows: Sequence[mx.array]) -> tuple[mx.array, dict[str, object]]:
        """The prompt embedded as text, each image's span replaced by its kept rows, and what the model computed from
        its token ids alone (`_FROM_TOKENS`)."""
        text, fields = self._text_embeddings(mx.array([self._token_ids]))
        pieces, at = [], 0
        for image, image_rows in zip(self._images, rows, strict=True):
            pieces += [text[:, at : image.start], image_rows[None]]
            at = image.start + image.length
        from_tokens = {k: v for k, v in fields.items() if k in _FROM_TOKENS}
        return mx.concatenate([*pieces, text[:, at:]], axis=1), from_tokens

    def _text_embeddings(self, ids: mx.array) -> tuple[mx.array, dict[str, object]]:
        """`ids` embedded by the model as the text they are (no pixels, no tower), and what else it returned."""
        out = self._vlm.get_input_embeddings(ids)
        fields = out.to_dict() if hasattr(out, "to_dict") else {"inputs_embeds": out}
        embeds = fields.pop("inputs_embeds")
        return embeds, self._read_fields(fields)

    def _read_fields(self, fields: dict[str, object]) -> dict[str, object]:
        """What get_input_embeddings returned besides the embeddings that a pass gives the language model: not the
        whole prompt's positions (a chunk gets its slice), nor what the language model never reads."""
        language_model = self._vlm.language_model
        return {
            k: v
            for k, v in fields.items()
            if v is not None and k not in _WHOLE_PROMPT_POSITIONS and reads_argument(language_model, k)
        }

    def _pads_in_text(self, start: int, end: int) -> bool:
        """Whether positions [start, end) outside the images hold the pad token, which some merges zero instead of
        embedding it (Gemma 3's, PaliGemma's): the text's embeddings there are not the merge's."""
        pad = getattr(self._vlm.config, "pad_token_id", None)
        if not isinstance(pad, int):
            return False
        inside = {p for i in self._images for p in range(i.start, i.start + i.length)}
        return any(self._token_ids[p] == pad and p not in inside for p in range(start, end))

    def chunk(self, start: int, end: int) -> ChunkEmbedding:
        """The inputs of a prefill pass over prompt positions [start, end)."""
        if self._embeds is None and start >= self._images_end and not self._pads_in_text(start, end):
            return self._text_chunk(start, end)
        self.compute()
        assert self._embeds is not None  # computed just now
        arguments = {**self._arguments, "n_to_process": end - start, **self._positions_of(start, end)}
        return ChunkEmbedding(self._embeds[:, start:end], arguments)

    def _positions_of(self, start: int, end: int) -> dict[str, mx.array]:
        """A chunk's slice of the prompt's positions, for a model that takes them (else nothing)."""
        if not self._takes_positions:
            return {}
        return {"position_ids": self._prompt_positions()[0][..., start:end]}

    def _text_chunk(self, start: int, end: int) -> ChunkEmbedding:
        """A chunk past every image, embedded by the model as the text it is (no pixels, no tower)."""
        embeds, fields = self._text_embeddings(mx.array([self._token_ids[start:end]]))
        return ChunkEmbedding(embeds, {**fields, **self._positions_of(start, end)})


def chunk_embedding(request, start: int, length: int) -> ChunkEmbedding | None:
    """What a prefill chunk of `request` at [start, start + length) is fed besides its tokens: its prompt's
    merged embeddings where the prompt has images (engine/request.py `multimodal`), else None (the scheduler ends
    such a prompt's chunks at the prompt's end: the tokens after it are text)."""
    multimodal = request.multimodal
    if not isinstance(multimodal, PromptEmbedding) or start >= len(request.prompt_token_ids):
        return None
    return multimodal.chunk(start, start + length)


def position_delta(request) -> int:
    """The delta of `request`'s positions (vision/positions.py): its prompt's, 0 for a prompt without images."""
    multimodal = request.multimodal
    return multimodal.position_delta if isinstance(multimodal, PromptEmbedding) else 0
