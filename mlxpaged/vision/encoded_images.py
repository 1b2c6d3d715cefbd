"""Images the model encoded, kept by digest and bounded by bytes: an image sent again is not encoded again.

An agent re-sends the same screenshot every turn. While its tokens are in the prefix cache the turn's new tokens
are embedded as text and nothing is encoded (embedding.py). When they are not (evicted, a prompt that differs
before the image, a model whose prefix cache is off: sliding-window models like Gemma 3), the prompt's
embeddings are the text's with each image's rows as the model merged them the last time: the vision tower and
projector do not run. What is kept of an image is those rows ([tokens of its span, hidden]: what the model put at
its tokens), so a prompt can be put together without the tower only when every one of its images is kept.

Only for models whose merged embeddings are all `get_input_embeddings` returns: a model that returns more
encodes every time (Qwen3-VL: deepstack features for later layers; Gemma 3: a 4-D mask over the prompt, which
its language model, called as the engine calls it, does not read; telling such outputs apart is left for later).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import mlx.core as mx


class EncodedImages:
    """Each image's merged embedding rows by digest, least recently used out first beyond `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, mx.array] = OrderedDict()
        self.nbytes = 0
        self.hits = 0  # prompts put together without the tower

    def rows(self, digests: Sequence[str]) -> list[mx.array] | None:
        """The rows of every image in `digests`, in order; None unless all are kept."""
        if not digests or any(d not in self._rows for d in digests):
            return None
        for digest in digests:
            self._rows.move_to_end(digest)
        self.hits += 1
        return [self._rows[d] for d in digests]

    def keep(self, digest: str, rows: mx.array) -> None:
        """Keep an image's rows (a fresh copy: a slice would pin the prompt's whole embeddings)."""
        if digest in self._rows or rows.nbytes > self.max_bytes:
            return
        rows = mx.array(rows)  # a copy of the rows alone
        mx.eval(rows)
        self._rows[digest] = rows
        self.nbytes += rows.nbytes
        while self.nbytes > self.max_bytes:
            _, dropped = self._rows.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def __len__(self) -> int:
        return len(self._rows)
