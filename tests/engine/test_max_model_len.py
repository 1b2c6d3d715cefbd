"""`max_model_len` replaces the model's own context: longer and shorter requests are judged by it."""

from __future__ import annotations

from mlxpaged.errors import RequestTooLongError
from tests.engine.test_engine import (
    GREEDY,
    reference_tokens,
    tiny_engine,
    tokenizer,  # noqa: F401  (the fixture, shared)
)
from tests.tiny_models import random_tokens, tiny_llama

import pytest


def test_a_longer_context_than_the_models_own_is_served(tokenizer):
    model = tiny_llama()
    trained = model.args.max_position_embeddings
    with tiny_engine(model, tokenizer, max_model_len=trained + 64, cache_tokens=trained + 128) as eng:
        assert eng.max_model_len == trained + 64 and eng.facts.context_length == trained
        prompt = random_tokens(trained + 64 - GREEDY.max_tokens, seed=1)
        assert eng.generate([prompt], GREEDY)[0].token_ids == reference_tokens(model, prompt, GREEDY.max_tokens)


def test_a_shorter_context_refuses_what_the_model_would_take(tokenizer):
    with tiny_engine(tiny_llama(), tokenizer, max_model_len=32) as eng, pytest.raises(RequestTooLongError, match="32"):
        eng.generate([random_tokens(13)], GREEDY)  # 13 + 20 reply tokens > 32
