"""Which inputs of a step share a model pass, and which positions of a pass reach the LM head.

A step's decode tokens run as one batched pass of one token per sequence; prefill chunks
run in passes of their own. Padding a 512-token chunk and 15 one-token decode rows into
one [16, 512] batch would compute 8,192 positions for 527 real ones, so the runner
alternates within the step instead (measured choice, see the engine notes). Short prefill
chunks of similar length share a right-padded pass (32 chat prompts of 30-50 tokens: one
pass 3.3-3.8 s, one pass each 4.8-5.1 s); long ones run alone, where causal attention
skips its masked half.

Only the positions that sample go through the LM head: on a 49k vocabulary the head
of a 512-token chunk would otherwise cost as much as several layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxpaged.runner.embedding_scale import embedding_scale, scaled
from mlxpaged.vision.embedding import ChunkEmbedding

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache


@dataclass(frozen=True)
class StepInput:
    """One sequence's part of a step: `token_ids` fed at positions start.. (block tables per layer group)."""

    token_ids: Sequence[int]
    start: int
    block_tables: Sequence[list[int]]
    samples: bool
    state_slot: int | None = None  # models with state layers: the sequence's state slot
    num_logits: int = 1  # logits of this many last positions (a chunk with speculative drafts: all)
    # A prompt chunk with images: the model's merged embeddings and arguments for it (vision/embedding.py);
    # such a chunk runs in a pass of its own.
    embedding: ChunkEmbedding | None = None
    # A model whose positions come from the images (vision/positions.py): the request's delta, added to the
    # positions of its rows that are not prompt chunks with images.
    position_delta: int = 0
    adapter: str | None = None  # the id of the adapter the sequence runs with (adapters/), None: the base model
    # Spans of its positions whose tokens attend each other both ways in this pass (engine/request.py
    # Request.both_ways): the pass's mask lets them.
    both_ways: tuple[tuple[int, int], ...] = ()


BODY_NAMES = ("model", "backbone")  # mlx-lm's models name their decoder stack `model`; Nemotron-H's, `backbone`


def body_of(model: nn.Module) -> nn.Module | None:
    """The model's decoder stack (embedding, layers, final norm: its last hidden states), or None."""
    for name in BODY_NAMES:
        inner = getattr(model, name, None)
        if isinstance(inner, nn.Module):
            return inner
    return None


def token_embedding(body: nn.Module) -> nn.Module:
    """The body's token embedding (`embed_tokens`; Nemotron-H's `embeddings`)."""
    embed = getattr(body, "embed_tokens", None)
    return embed if embed is not None else body.embeddings


def split_head(model: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """`hidden -> logits` when the model is its body (`body_of`) followed by a plain LM head, else None.

    Checked numerically once on a short probe, so models that post-process logits
    (soft-capping, scaling) fall back to the full forward pass instead of being wrong.
    """
    inner = body_of(model)
    if inner is None or not (hasattr(model, "make_cache") or hasattr(model, "layers")):
        return None
    language_model = getattr(model, "language_model", None)  # mlx-lm's Qwen 3.5: `model.model` is its body
    if getattr(model, "lm_head", None) is not None:
        head = model.lm_head
    elif language_model is not None and getattr(language_model, "lm_head", None) is not None:
        head = language_model.lm_head
    elif hasattr(inner, "embed_tokens") or hasattr(inner, "embeddings"):
        head = token_embedding(inner).as_linear
    else:
        return None
    probe = mx.array([[1, 2, 3]])
    try:
        full = model(probe, cache=make_prompt_cache(model))  # the model's own caches, or KVCaches (DeepSeek-V3's)
        split = head(inner(probe, cache=make_prompt_cache(model)))
    except Exception:  # an unusual model signature: use the full forward pass
        return None
    return head if mx.allclose(full, split, atol=1e-5, rtol=1e-5).item() else None


def embedding_and_head(model: nn.Module, head: Callable[[mx.array], mx.array] | None) -> tuple[Callable, Callable]:
    """The model's token embedding, as its first layer sees it (runner/embedding_scale.py: Gemma's x sqrt(hidden)),
    and its `hidden -> logits`, which drafters reading its hidden states share: mlx-lm's body and split head (`head`,
    from split_head), or a vision-language model's language model's (vision/language.py) when the head does not
    split."""
    body = body_of(model)
    if head is not None and body is not None:
        embed, logits = token_embedding(body), head
    else:
        embed, logits = model.embed_tokens, model.logits_from_hidden
    return scaled(embed, embedding_scale(model, embed)), logits


# Prefill chunks that end within this many tokens may share a pass, if padding them to the
# longest adds at most a quarter. A shared pass attends through a ragged mask, without the causal
# blocks that halve a long chunk's attention: `bench batch`'s prefill (16 prompts of 273-468
# tokens) took 22.9 s in shared passes and 17.7 s alone, so only short chunks share, where a
# pass's fixed cost dominates (32 chat prompts at once: time to first token 3.2 s -> 1.2 s).
SHARED_PREFILL_MAX_END = 256
SHARED_PREFILL_PADDING = 1.25


def prefill_passes(inputs: Sequence[StepInput]) -> list[list[int]]:
    """The prefill chunks (inputs of more than one token) grouped into passes, as input indices."""
    alone: list[list[int]] = []
    groups: list[list[int]] = []
    totals: list[int] = []
    chunks = [i for i, x in enumerate(inputs) if len(x.token_ids) > 1 or x.embedding is not None]
    for i in sorted(chunks, key=lambda i: len(inputs[i].token_ids)):
        x = inputs[i]
        width = len(x.token_ids)  # the longest so far: sorted by length
        if x.start + width > SHARED_PREFILL_MAX_END or x.embedding is not None:
            alone.append([i])
        elif groups and width * (len(groups[-1]) + 1) <= SHARED_PREFILL_PADDING * (totals[-1] + width):
            groups[-1].append(i)
            totals[-1] += width
        else:
            groups.append([i])
            totals.append(width)
    return groups + alone


def state_model_passes(inputs: Sequence[StepInput]) -> list[list[int]]:
    """Passes of a model with state layers: decode rows (one token after existing state) together,
    every other chunk alone. A ragged prefill pass is exact only for models that mask their state by
    `lengths` (design 14, finding 4), and a fresh row (state None) must not meet rows with state."""
    decode = [i for i, x in enumerate(inputs) if len(x.token_ids) == 1 and x.start > 0 and x.embedding is None]
    alone = [[i] for i, x in enumerate(inputs) if i not in decode]
    return ([decode] if decode else []) + alone


def logit_positions(batch: Sequence[StepInput]) -> tuple[mx.array, mx.array]:
    """(row, column) index arrays of the positions whose logits a pass returns: each input's last
    `num_logits` positions, in order."""
    for x in batch:
        if not 1 <= x.num_logits <= len(x.token_ids):
            raise ValueError(f"num_logits {x.num_logits} outside 1..{len(x.token_ids)} (the input's tokens)")
    if all(x.num_logits == 1 for x in batch):
        return mx.arange(len(batch)), mx.array([len(x.token_ids) - 1 for x in batch])
    rows = [b for b, x in enumerate(batch) for _ in range(x.num_logits)]
    columns = [len(x.token_ids) - x.num_logits + j for x in batch for j in range(x.num_logits)]
    return mx.array(rows), mx.array(columns)
