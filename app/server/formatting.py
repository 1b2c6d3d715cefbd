"""What every API's bodies share: response ids, the text of single tokens, and per-token logprobs as the
engine reports them (each API lays them out its own way: openai/shapes.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from mlxpaged.engine.engine import StreamDelta


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class TokenText:
    """The text of single token ids, for logprobs (decoded once per id)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self._cache:
            self._cache[token_id] = self._tokenizer.decode([token_id])
        return self._cache[token_id]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None


def delta_logprobs(delta: StreamDelta) -> list[TokenLogprob]:
    if delta.token_id is None or delta.logprob is None:
        return []
    return [TokenLogprob(delta.token_id, delta.logprob, delta.top_logprobs)]
