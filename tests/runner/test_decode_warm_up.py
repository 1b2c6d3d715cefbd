"""The compiled decode pass warms up in the cache's own geometry: V narrower than K (MLA models) included."""

from __future__ import annotations

import warnings

from tests.archs.harness import build
from tests.engine.test_engine import (
    GREEDY,
    reference_tokens,
    tiny_engine,
    tokenizer,  # noqa: F401  (the fixture, shared)
)
from tests.tiny_models import random_tokens

import pytest


@pytest.mark.parametrize("module", ["deepseek_v2", "minicpm3"])
def test_a_model_with_v_narrower_than_k_decodes_compiled(module, tokenizer):
    model = build(module)
    prompt = random_tokens(12, seed=5)
    with warnings.catch_warnings(record=True) as caught:  # the engine thread warns when warm-up fails
        warnings.simplefilter("always")
        with tiny_engine(model, tokenizer) as engine:
            geometry = engine.kv.pool_geometries[0]
            assert geometry.v_dim < geometry.k_dim and engine.kv.plain_full_attention
            got = engine.generate([prompt], GREEDY)[0].token_ids
            decoder = engine.runner.decoder
    assert not [w for w in caught if "compiled decode is off" in str(w.message)]
    assert decoder is not None
    assert got == reference_tokens(model, prompt, GREEDY.max_tokens)
