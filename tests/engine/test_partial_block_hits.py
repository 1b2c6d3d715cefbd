"""A prompt that extends a finished one takes over its partly filled last block (block_pool.py) and
still decodes exactly what mlx-lm decodes from scratch: the taken-over slots hold the right KV."""

from __future__ import annotations

import dataclasses

from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import (
    GREEDY,
    assert_pool_empty,
    reference_tokens,
    tiny_engine,
    tokenizer,  # noqa: F401  (the fixture, shared)
)
from tests.tiny_models import random_tokens, tiny_llama

import pytest


@pytest.mark.parametrize("first", [13, 21, 30])  # 8-token blocks: 5, 5 and 6 tokens in the last one
def test_extended_prompt_reuses_the_partial_block_and_matches_mlx_lm(tokenizer, first):
    model = tiny_llama()
    params = dataclasses.replace(GREEDY, max_tokens=6)
    with tiny_engine(model, tokenizer) as eng:
        prompt = random_tokens(first, seed=first)
        reply = eng.generate([prompt], params)[0]
        extended = prompt + reply.token_ids + random_tokens(4, seed=99)
        got = eng.generate([extended], params)[0]
        # Cached: the prompt and every reply token but the last (its KV was never computed).
        assert got.cached_tokens == first + len(reply.token_ids) - 1
        assert got.cached_tokens % 8  # so the partial block was taken over
        assert got.token_ids == reference_tokens(model, extended, params.max_tokens)
        assert_pool_empty(eng)


def test_a_prompt_diverging_inside_the_partial_block_recomputes_from_there(tokenizer):
    model = tiny_llama()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with tiny_engine(model, tokenizer) as eng:
        prompt = random_tokens(20, seed=3)  # 16 + 4 tokens
        eng.generate([prompt], one)
        other = prompt[:18] + [t + 1 for t in prompt[18:]] + random_tokens(5, seed=4)
        got = eng.generate([other], GREEDY)[0]
        assert got.cached_tokens == 18
        assert got.token_ids == reference_tokens(model, other, GREEDY.max_tokens)
