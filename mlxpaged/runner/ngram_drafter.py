"""Prompt-lookup drafting (vLLM's `ngram` method, llama.cpp's lookup decoding): the tokens that
followed the latest earlier occurrence of the sequence's last n tokens, longest n first.

Plain Python (no MLX). The index grows with the sequence (each new token adds one n-gram per n),
so a lookup is a few dict reads however long the prompt is, instead of a scan per step.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.validation import require_int


class NgramDrafter:
    """Drafts for one sequence. `propose(tokens, k)` reads the whole sequence so far (prompt and
    output); it must only ever grow between calls (a preempted request keeps its tokens)."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        require_int("min_n", min_n, low=1)
        require_int("max_n", max_n, low=min_n)
        self.min_n, self.max_n = min_n, max_n
        # (n-gram) -> position just after its latest occurrence, over n-grams ending before the last token
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions < this are in `_next`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens continuing `tokens`, or [] when its last n-gram never occurred before."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        self._index(tokens, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return list(tokens[start : start + k])
        return []

    def _index(self, tokens: Sequence[int], end: int) -> None:
        """Add the n-grams ending at positions [_indexed, end) (exclusive of the sequence's last
        token, whose own suffix must not match itself)."""
        if end < self._indexed:
            raise ValueError(f"the sequence shrank from {self._indexed + 1} to {end + 1} tokens")
        for stop in range(self._indexed, end):  # n-gram tokens[stop - n + 1 : stop + 1]
            for n in range(self.min_n, min(self.max_n, stop + 1) + 1):
                self._next[tuple(tokens[stop - n + 1 : stop + 1])] = stop + 1
        self._indexed = end
