"""Images the model encoded, kept by digest and bounded by bytes: an image sent again is not encoded again.

An agent re-sends the same screenshot every turn. While its tokens are in the prefix cache the turn's new tokens
are embedded as text and nothing is encoded (embedding.py). When they are not (evicted, a prompt that differs
before the image, a model whose prefix cache is off: sliding-window models like Gemma 3), the prompt's
embeddings are the text's with each image's rows as the model merged them the last time: the vision tower and
projector do not run. What is kept of an image is those rows ([tokens of its span, hidden]: what the model put at
its tokens), so a prompt can be put together without the tower only when every one of its images is kept.

Only for models whose merged embeddings are all their language model reads of `get_input_embeddings`' output
(embedding.py `reads_argument`: Gemma 3's 4-D mask is not read), and Qwen3-VL's, whose deepstack features for later
layers are kept beside the rows (each image's share of them) and its mask of visual positions is the prompt's image
tokens again. A model that reads anything else encodes every time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class EncodedImage:
    """What is kept of one image: its merged rows [tokens of its span, hidden] and, for a deepstack model
    (Qwen3-VL), its features for each later layer it feeds ([its image tokens, hidden] per layer; else none)."""

    rows: mx.array
    deepstack: tuple[mx.array, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + sum(a.nbytes for a in self.deepstack)


class EncodedImages:
    """Each image's merged embedding rows by digest, least recently used out first beyond `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, EncodedImage] = OrderedDict()
        self.nbytes = 0
        self.hits = 0  # prompts put together without the tower

    def images(self, digests: Sequence[str]) -> list[EncodedImage] | None:
        """What is kept of every image in `digests`, in order; None unless all are kept."""
        if not digests or any(d not in self._kept for d in digests):
            return None
        for digest in digests:
            self._kept.move_to_end(digest)
        self.hits += 1
        return [self._kept[d] for d in digests]

    def rows(self, digests: Sequence[str]) -> list[mx.array] | None:
        """The merged rows of every image in `digests`, in order; None unless all are kept."""
        images = self.images(digests)
        return None if images is None else [image.rows for image in images]

    def keep(self, digest: str, rows: mx.array, deepstack: Sequence[mx.array] = ()) -> None:
        """Keep an image's rows and deepstack features (fresh copies: a slice would pin the prompt's whole arrays)."""
        if digest in self._kept:
            return
        image = EncodedImage(mx.array(rows), tuple(mx.array(a) for a in deepstack))
        if image.nbytes > self.max_bytes:
            return
        mx.eval(image.rows, *image.deepstack)
        self._kept[digest] = image
        self.nbytes += image.nbytes
        while self.nbytes > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def clear(self) -> None:
        """Forget every image (the next prompt with one runs the tower again)."""
        self._kept.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._kept)
