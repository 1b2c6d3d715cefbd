"""Hidden states -> one vector per input: pooling over a pass's chunks, then truncation and normalization.

Rows are right-padded: row r's real tokens are columns 0 .. lengths[r] - 1 of the pass. Pooling reads only those,
so whatever the padding columns hold never reaches a vector. Everything is summed in float32, whatever the model's
dtype.
"""

from __future__ import annotations

import mlx.core as mx

POOLINGS = ("last", "mean", "cls")
NORM_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize module calls


class PooledRows:
    """Pools one pass, fed its hidden states chunk by chunk (columns start .. start + width - 1)."""

    def __init__(self, pooling: str, lengths: list[int]) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        self.lengths = mx.array(lengths, dtype=mx.int32)
        self.pooled: mx.array | None = None

    def add(self, hidden: mx.array, start: int) -> None:
        hidden = hidden.astype(mx.float32)
        width = hidden.shape[1]
        if self.pooling == "mean":
            columns = mx.arange(start, start + width, dtype=mx.int32)
            real = (columns[None, :] < self.lengths[:, None]).astype(mx.float32)
            part = (hidden * real[..., None]).sum(axis=1)
            self.pooled = part if self.pooled is None else self.pooled + part
        elif self.pooling == "cls":
            if start == 0:
                self.pooled = hidden[:, 0]
        else:
            last = self.lengths - 1 - start  # the last real token's column in this chunk, if it is in it
            here = (last >= 0) & (last < width)
            picked = mx.take_along_axis(hidden, mx.clip(last, 0, width - 1)[:, None, None], axis=1)[:, 0]
            self.pooled = picked if self.pooled is None else mx.where(here[:, None], picked, self.pooled)
        mx.eval(self.pooled)  # a chunk's hidden states are freed before the next is computed

    def result(self) -> mx.array:
        if self.pooled is None:
            raise ValueError("no hidden states were added")
        if self.pooling == "mean":
            return self.pooled / self.lengths[:, None].astype(mx.float32)
        return self.pooled


def finish(vectors: mx.array, normalize: bool, dimensions: int | None) -> mx.array:
    """Keep the first `dimensions` components (Matryoshka truncation, None: all), then L2-normalize if the model
    does: a truncated vector is normalized again, as OpenAI's `dimensions` returns it (sentence-transformers'
    `truncate_dim` does it with `normalize_embeddings=True`), so cosine similarity stays a dot product."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = mx.sqrt((vectors * vectors).sum(axis=1, keepdims=True))
        vectors = vectors / mx.maximum(norms, NORM_EPS)
    return vectors
