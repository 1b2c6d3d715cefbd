"""Load models through mlx-lm, and the plain (non-paged) generate path.

The baseline path is mlx-lm's own `stream_generate`: it is what the paged engine is
checked against, token for token.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

from mlxpaged.models import ModelRef, Progress, provision, resolve


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    ref: ModelRef
    path: Path
    dtype: str

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def config(self) -> dict:
        import json

        return json.loads((self.path / "config.json").read_text())


def on_metal() -> bool:
    return mx.metal.is_available()


def default_dtype() -> str:
    """float32 on MLX's CPU backend (half precision matmuls are 3-40x slower there); float16 on Metal."""
    return "float16" if on_metal() else "float32"


def load_model(name: str | None = None, progress: Progress | None = None) -> LoadedModel:
    """Resolve, provision if needed, and load a model; None loads the embedded default model."""
    ref = resolve(name)
    dtype = default_dtype()
    path = provision(ref, dtype, progress)
    model, tokenizer = mlx_lm_load(str(path))
    if not on_metal() and _has_half_dense_weights(model):
        model.set_dtype(mx.float32)  # CPU backend: float32 is the fast dtype
    return LoadedModel(model, tokenizer, ref, path, dtype)


def _has_half_dense_weights(model: nn.Module) -> bool:
    from mlx.utils import tree_flatten

    return any(v.dtype in (mx.float16, mx.bfloat16) for _, v in tree_flatten(model.parameters()))


def chat_prompt(tokenizer: TokenizerWrapper, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, ready for the reply."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def baseline_stream(loaded: LoadedModel, prompt: list[int] | str, max_tokens: int = 256,
                    temperature: float = 0.0) -> Iterator:
    """mlx-lm's own streaming generation (no paged cache): yields GenerationResponse objects."""
    sampler = make_sampler(temp=temperature)
    yield from stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens, sampler=sampler)


def print_progress(done: int, total: int, what: str) -> None:
    """A one-line progress bar on stderr, for downloads and conversion."""
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    sys.stderr.write(f"\r  {what:<20} [{'#' * filled}{'.' * (width - filled)}] {100 * done // max(total, 1):3d}%{end}")
    sys.stderr.flush()
