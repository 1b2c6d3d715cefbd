"""Inputs -> token rows: texts through the model's tokenizer, token arrays checked; lengths against the context.

Texts are tokenized as sentence-transformers tokenizes them: the Hugging Face tokenizer with its special tokens
(Qwen3-Embedding's appends <|endoftext|>, the token its last-token pooling reads), a prompt put before the text.
With `truncate`, the tokenizer truncates a text to the context (keeping its special tokens) and a token array
keeps its first tokens; without it, a longer input is refused with its length and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

from mlxpaged.errors import EmbeddingInputError, InputTooLongError

Inputs = str | Sequence[str] | Sequence[Sequence[int]]


def token_rows(
    tokenizer, inputs: Inputs, vocab_size: int, max_tokens: int | None, truncate: bool, prompt: str = ""
) -> list[list[int]]:
    """One row of token ids per input, each non-empty, in the vocabulary and within `max_tokens` (None: any)."""
    items: list = [inputs] if isinstance(inputs, str) else list(inputs)
    if not items:
        raise EmbeddingInputError("no inputs to embed: pass at least one text or token array", param="input")
    if all(isinstance(item, str) for item in items):
        rows = encode_texts(tokenizer, [prompt + item for item in items], max_tokens if truncate else None)
    else:
        rows = [_token_array(i, item, vocab_size) for i, item in enumerate(items)]
        if truncate and max_tokens is not None:
            rows = [row[:max_tokens] for row in rows]
    for index, row in enumerate(rows):
        if not row:
            raise EmbeddingInputError(f"input {index} is empty (0 tokens); nothing to embed", param="input")
        if max_tokens is not None and len(row) > max_tokens:
            raise InputTooLongError(index, len(row), max_tokens)
    return rows


def encode_texts(tokenizer, texts: list[str], max_tokens: int | None) -> list[list[int]]:
    """Token ids with the tokenizer's special tokens; truncated to `max_tokens` by the tokenizer when given.
    verbose=False: a text past the tokenizer's model_max_length is refused here with the numbers instead."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the Hugging Face one
    if max_tokens is None:
        encoded = hf(texts, add_special_tokens=True, verbose=False)
    else:
        encoded = hf(texts, add_special_tokens=True, truncation=True, max_length=max_tokens, verbose=False)
    return [list(ids) for ids in encoded["input_ids"]]


def _token_array(index: int, item: object, vocab_size: int) -> list[int]:
    if isinstance(item, str) or not isinstance(item, Sequence):
        raise EmbeddingInputError(
            f"input {index} is a {type(item).__name__}; inputs are all texts or all token arrays (lists of ints)",
            param="input",
        )
    for value in item:
        if not _is_token_id(value, vocab_size):
            raise EmbeddingInputError(
                f"input {index} holds {value!r}, not a token id of this model (integers 0 to {vocab_size - 1})",
                param="input",
            )
    return [int(t) for t in item]


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and 0 <= int(value) < vocab_size
