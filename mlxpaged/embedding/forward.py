"""One pass of the embedder: right-padded rows through the transformer body, pooled chunk by chunk.

Right padding needs no mask: the model attends causally (mlx-lm builds every text model so), so a real token
never reads the padding after it, and pooling (pooling.py) reads real tokens only. Every row starts at position
0, as it would alone. The body gets the model's own cache list, so a pass longer than its chunk runs in several
calls, each attending to the keys of the chunks before it, as a chunked prefill does.
"""

from __future__ import annotations

from mlxpaged.embedding.body import TransformerBody
from mlxpaged.embedding.pooling import PooledRows

import mlx.core as mx


def run_pass(body: TransformerBody, pooling: str, rows: list[list[int]], chunk: int, pad_id: int) -> mx.array:
    """The pooled vectors of `rows` (token ids, none empty) as [len(rows), body.width] float32."""
    lengths = [len(row) for row in rows]
    width = max(lengths)
    tokens = mx.array([row + [pad_id] * (width - len(row)) for row in rows], dtype=mx.int32)
    pooled = PooledRows(pooling, lengths)
    cache = body.make_cache()
    for start in range(0, width, chunk):
        pooled.add(body.call(tokens[:, start : start + chunk], cache=cache), start)
    return pooled.result()
