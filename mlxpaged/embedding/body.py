"""The model's transformer body: the part of an mlx-lm model that returns hidden states, not logits.

mlx-lm's Model classes keep it under one of a few names and return the final (normed) hidden states from it, the
LM head's input: `model.model` for most architectures (llama, qwen2/3, gemma, mistral, phi3, ...),
`model.language_model.model` for the multimodal wrappers (gemma3, qwen2_vl, mistral3, ...), `model.transformer`
(gpt_bigcode, dbrx, exaone, openelm, qwen, nanochat) and `model.backbone` (mamba, mamba2, nemotron_h). It is
called as `body(tokens, cache=...)` with the model's own cache list (mlx_lm.models.cache.make_prompt_cache), as
mlx-lm's generate calls the whole model: some bodies require one, and it lets a long batch run in chunks. The
cache is passed by name: a few bodies take a mask second (minicpm3); one that requires a mask (phixtral) is
refused. At load, one token through the body must come back as [1, 1, width] with a width other than the
vocabulary's, or the model is refused: those are logits (gpt_neox, gemma3n and lille-130m keep their output
projection inside the body). tests/embedding/arch_sweep.py runs the tiny config of every mlx-lm architecture
through the embedder against the body called plainly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxpaged.errors import UnsupportedModelError

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

BODY_PATHS = ("model", "language_model.model", "transformer", "backbone")


@dataclass(frozen=True)
class TransformerBody:
    call: Callable  # (tokens [rows, length], cache=cache list) -> hidden states [rows, length, width]
    path: str  # the attribute path, e.g. "model" or "language_model.model"
    width: int  # the hidden size: the embedding's full dimension
    make_cache: Callable[[], list]  # a fresh cache list for one batch


def find_body(model: nn.Module, vocab_size: int | None) -> TransformerBody:
    """The first body path that returns hidden states for one token; UnsupportedModelError when none does."""
    tried = []
    for path in BODY_PATHS:
        call = _attribute(model, path)
        if call is None or not callable(call):
            continue
        try:
            hidden = call(mx.array([[0]]), cache=make_prompt_cache(model))
        except Exception as exc:  # an architecture-specific signature; the next path may fit
            tried.append(f"{path}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        if _is_hidden(hidden, vocab_size):
            return TransformerBody(call, path, int(hidden.shape[2]), lambda: make_prompt_cache(model))
        tried.append(f"{path}: returned {_shape(hidden)}, not hidden states")
    found = "; ".join(tried) or f"none of {', '.join(BODY_PATHS)} exists"
    raise UnsupportedModelError(
        f"model type {type(model).__module__.rsplit('.', 1)[-1]!r} has no transformer body that returns hidden "
        f"states ({found})"
    )


def _is_hidden(value: object, vocab_size: int | None) -> bool:
    """[1, 1, width] for one token, the width not the vocabulary's (that would be logits)."""
    if not isinstance(value, mx.array) or value.ndim != 3:
        return False
    return value.shape[:2] == (1, 1) and value.shape[2] != vocab_size


def _attribute(model: nn.Module, path: str):
    found: object = model
    for name in path.split("."):
        found = getattr(found, name, None)
        if found is None:
            return None
    return found


def _shape(value: object) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, mx.array) else type(value).__name__
