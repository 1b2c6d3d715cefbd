"""gpt-oss (attention sinks, alternating sliding / full layers) on the paged engine: greedy output equals
mlx-lm's generate_step token for token, alone and batched with prompts of other lengths."""

from __future__ import annotations

import dataclasses

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from tests.engine.test_engine import GREEDY, assert_pool_empty, reference_tokens, tiny_engine
from tests.tiny_models import random_tokens

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import gpt_oss

# From the tiny configs of docs/design/issue14-architectures.md (mlx-lm's own test config, shrunk; tests/archs).
GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "rope_theta": 10000,
    "vocab_size": 512,
    "head_dim": 16,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
PARAMS = dataclasses.replace(GREEDY, max_tokens=12)


def tiny_gpt_oss(seed: int = 0):
    """Random weights scaled up (as tests/tiny_models.py does) and sinks spread over the scores' range:
    the model's own init leaves them 0, which would test only half the formula."""
    mx.random.seed(seed)
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(GPT_OSS))
    model.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, model.parameters()))
    for layer in model.model.layers:
        layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape) * 2.0
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_gpt_oss()


@pytest.fixture(scope="module")
def prompts_and_reference(model):
    prompts = [random_tokens(n, seed=n, vocab=GPT_OSS["vocab_size"]) for n in (7, 21, 30)]
    return prompts, [reference_tokens(model, p, PARAMS.max_tokens) for p in prompts]


def test_sinks_decide_the_tokens(model, prompts_and_reference):
    """The comparison below can fail: the same model without sinks decodes other tokens."""
    prompts, want = prompts_and_reference
    plain = tiny_gpt_oss()
    for layer in plain.model.layers:
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -1e9)
    assert [reference_tokens(plain, p, PARAMS.max_tokens) for p in prompts] != want


def test_gpt_oss_alone_matches_mlx_lm(model, tokenizer, prompts_and_reference):
    prompts, want = prompts_and_reference
    with tiny_engine(model, tokenizer) as engine:
        assert [engine.generate([p], PARAMS)[0].token_ids for p in prompts] == want
        assert_pool_empty(engine)


def test_gpt_oss_batched_matches_mlx_lm(model, tokenizer, prompts_and_reference):
    prompts, want = prompts_and_reference
    with tiny_engine(model, tokenizer, max_batch_tokens=24) as engine:  # chunked prefill beside decode
        assert [c.token_ids for c in engine.generate(prompts, PARAMS)] == want
        assert_pool_empty(engine)
