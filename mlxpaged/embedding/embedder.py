"""Embedder: texts or token arrays -> one vector each, from an embedding model mlx-lm can load.

    from mlxpaged import Embedder
    with Embedder.from_pretrained("Qwen/Qwen3-Embedding-0.6B") as embedder:
        result = embedder.embed(["first text", "second text"], dimensions=256)
        result.vectors          # numpy float32 [2, 256]
        result.token_counts     # tokens each input took

Inputs are tokenized (inputs.py), grouped into passes by a token budget (batching.py: many inputs in one forward
pass, right-padded), run through the model's transformer body (body.py, forward.py), pooled as the model's
sentence-transformers files say (model_files.py, pooling.py), then truncated to `dimensions` and normalized.
The model is computed on the caller's thread, one call at a time (a lock): MLX work is never interleaved, and
neither are tokenizer calls.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.embedding.batching import plan_passes
from mlxpaged.embedding.body import find_body
from mlxpaged.embedding.forward import run_pass
from mlxpaged.embedding.inputs import Inputs, token_rows
from mlxpaged.embedding.load import load_embedding_model
from mlxpaged.embedding.memory import check_fits
from mlxpaged.embedding.model_files import EmbeddingSpec, embedding_spec
from mlxpaged.embedding.pooling import finish
from mlxpaged.errors import EmbeddingInputError, EngineClosedError
from mlxpaged.loading.loader import LoadedModel, locate_model
from mlxpaged.loading.model_store import ModelRef
from mlxpaged.loading.progress import Progress
from mlxpaged.platform import backend
from mlxpaged.platform.memory import DeviceFacts
from mlxpaged.platform.model_facts import context_length
from mlxpaged.validation import require_int

import mlx.core as mx
import numpy as np

DEFAULT_MAX_BATCH_TOKENS = 2048  # padded tokens per forward pass: SchedulerConfig's max_batch_tokens default


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: np.ndarray  # float32 [inputs, dimensions], in input order
    token_counts: list[int]  # tokens of each input as embedded (after truncation)
    forward_passes: int  # passes the model ran (batching.py)

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)


class Embedder:
    """An embedding model, loaded: `embed` runs it over a batch of inputs."""

    def __init__(self, loaded: LoadedModel, spec: EmbeddingSpec, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS):
        require_int("max_batch_tokens", max_batch_tokens, low=1, setting=True)
        self.loaded, self.spec, self.max_batch_tokens = loaded, spec, max_batch_tokens
        self.vocab_size = _vocab_size(loaded)
        self.body = find_body(loaded.model, self.vocab_size)
        self.max_input_tokens = context_length(loaded.config)  # None: the config names none, no limit
        pad = getattr(loaded.tokenizer, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0  # never read: see forward.py
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_pretrained(
        cls, model: str, progress: Progress | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    ) -> Embedder:
        """A preset name, local path or hub id of an embedding model (model_files.py: which models are). A model
        that is not one raises NotAnEmbeddingModelError saying why; one that cannot fit raises
        InsufficientMemoryError before any weight is read (once its files are local)."""
        require_int("max_batch_tokens", max_batch_tokens, low=1, setting=True)
        ref, path = locate_model(model, progress)
        return cls.from_local(ref, path, max_batch_tokens)

    @classmethod
    def from_local(cls, ref: ModelRef, path: Path, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> Embedder:
        """An embedding model already on this machine: `ref` as resolved, `path` its directory (what
        from_pretrained does once the files are local; the server's model registry starts here)."""
        spec = embedding_spec(path, ref.preset.options if ref.preset else None)
        check_fits(path, backend.current(), max_batch_tokens, DeviceFacts.detect())
        return cls(load_embedding_model(ref, path, backend.current()), spec, max_batch_tokens)

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def dimensions(self) -> int:
        """The full embedding width (the model's hidden size)."""
        return self.body.width

    def describe(self) -> str:
        context = f"{self.max_input_tokens:,}" if self.max_input_tokens else "no limit"
        return (
            f"embedding model {self.name}: {self.spec.describe()}, {self.dimensions} dimensions, "
            f"context {context} tokens, {self.loaded.dtype}, up to {self.max_batch_tokens:,} tokens per pass"
        )

    def embed(
        self, inputs: Inputs, dimensions: int | None = None, *, truncate: bool = False, prompt_name: str | None = None
    ) -> EmbeddingResult:
        """One vector per input (texts, or token arrays taken as they are). `dimensions` keeps the first
        components and normalizes again if the model normalizes; `truncate` cuts inputs longer than the context
        instead of refusing them; `prompt_name` picks a prompt of config_sentence_transformers.json to put before
        each text (default: the model's default_prompt_name, if any)."""
        dimensions = self._check_dimensions(dimensions)
        prompt = self._prompt(prompt_name)
        with self._lock:  # the tokenizer too: a Hugging Face tokenizer asked to truncate is not safe across threads
            if self._closed:
                raise EngineClosedError("the embedder was closed")
            rows = token_rows(self.tokenizer, inputs, self.vocab_size, self.max_input_tokens, truncate, prompt)
            vectors, passes = self._embed_rows(rows)
            vectors = finish(vectors, self.spec.normalize, dimensions)
            array = np.array(vectors, dtype=np.float32)
        return EmbeddingResult(array, [len(row) for row in rows], passes)

    def _embed_rows(self, rows: list[list[int]]) -> tuple[mx.array, int]:
        passes = plan_passes([len(row) for row in rows], self.max_batch_tokens)
        outputs = [
            run_pass(self.body, self.spec.pooling, [rows[i] for i in p.rows], p.chunk, self.pad_id) for p in passes
        ]
        order = mx.array([i for p in passes for i in p.rows])
        return mx.concatenate(outputs)[mx.argsort(order)], len(passes)

    def _check_dimensions(self, dimensions: int | None) -> int | None:
        if dimensions is None:
            return None
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= self.dimensions:
            raise EmbeddingInputError(
                f"dimensions must be an integer from 1 to {self.dimensions} (this model's width), got {dimensions!r}",
                param="dimensions",
            )
        return dimensions

    def _prompt(self, prompt_name: str | None) -> str:
        name = prompt_name if prompt_name is not None else self.spec.default_prompt_name
        if name is None:
            return ""
        if name not in self.spec.prompts:
            known = ", ".join(sorted(self.spec.prompts)) or "none"
            raise EmbeddingInputError(
                f"unknown prompt_name {name!r}; this model's prompts: {known}", param="prompt_name"
            )
        return self.spec.prompts[name]

    def close(self) -> None:
        """Refuse further calls; the model's memory goes once nothing else holds it."""
        with self._lock:
            self._closed = True

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _vocab_size(loaded: LoadedModel) -> int:
    """Token ids the embedding table holds: config.json's vocab_size (its text_config's), else the tokenizer's."""
    for source in (loaded.config, loaded.config.get("text_config") or {}):
        value = source.get("vocab_size")
        if isinstance(value, int) and value > 0:
            return value
    return len(loaded.tokenizer.vocab)
