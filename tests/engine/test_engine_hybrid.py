"""Hybrid sliding-window models in the engine: tiny gemma3_text and a llama with mixed `layer_types`,
windows of 12 and 20 tokens, so prompts run far past the window and every ring wraps."""

from __future__ import annotations

import dataclasses
import time

from mlxpaged.errors import RequestTooLongError
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import GREEDY, assert_pool_empty, reference_tokens, tiny_engine
from tests.tiny_models import random_tokens, tiny_gemma3, tiny_hybrid_llama

import pytest

LONG = dataclasses.replace(GREEDY, max_tokens=40)  # decodes well past either window

# (model, engine settings): rings of ceil(12 / 8) + 1 = 3 and ceil(20 / 16) + 1 = 3 blocks. Windows
# that are no multiple of the block size: with window == block_size one block is already a perfect ring,
# and a ring that does not wrap would go unnoticed.
HYBRIDS = {
    "gemma3-w12-bs8": (lambda: tiny_gemma3(window=12), {"block_size": 8}),
    "llama-w20-bs16": (lambda: tiny_hybrid_llama(window=20), {"block_size": 16}),
}


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request):
    build, settings = HYBRIDS[request.param]
    return build(), settings


@pytest.fixture(scope="module")
def engine(hybrid, tokenizer):
    model, settings = hybrid
    with tiny_engine(model, tokenizer, **settings) as eng:
        assert len(eng.kv.groups) > 1 and not eng.kv_manager.enable_prefix_cache
        yield eng
        assert_pool_empty(eng)


@pytest.mark.parametrize("length", [5, 30, 100])
def test_hybrid_matches_mlx_lm(engine, length):
    prompt = random_tokens(length, seed=length)
    got = engine.generate([prompt], LONG)[0]
    assert got.token_ids == reference_tokens(engine.model, prompt, LONG.max_tokens)
    assert_pool_empty(engine)


def test_hybrid_concurrent_chunked_requests_equal_solo_unchunked_runs(hybrid, engine, tokenizer):
    prompts = [random_tokens(n, seed=n) for n in (3, 17, 40, 5, 64, 12, 33, 9)]
    solo = [engine.generate([p], LONG)[0].token_ids for p in prompts]  # max_batch_tokens 2048: one chunk
    model, settings = hybrid
    # A 24-token budget chunks every long prompt (chunks longer than a ring) between decode steps.
    with tiny_engine(model, tokenizer, max_batch_tokens=24, max_num_seqs=8, **settings) as chunked:
        assert [c.token_ids for c in chunked.generate(prompts, LONG)] == solo
        assert_pool_empty(chunked)


def test_hybrid_preempted_request_resumes_with_identical_output(hybrid, engine, tokenizer):
    prompts = [random_tokens(20, seed=s) for s in range(4)]
    expected = [c.token_ids for c in engine.generate(prompts, LONG)]
    model, settings = hybrid
    # 4 x 60 tokens need more full-attention blocks than --cache-tokens 64 leaves beside the rings.
    with tiny_engine(model, tokenizer, cache_tokens=64, max_num_seqs=4, **settings) as tight:
        got = [c.token_ids for c in tight.generate(prompts, LONG)]
        assert tight.stats()["preemptions"] > 0
        assert_pool_empty(tight)
    assert got == expected


def test_hybrid_n_sequences_copy_the_rings(engine):
    prompt = random_tokens(37, seed=11)  # past the window, ending in a partial block
    alone = engine.generate([prompt], LONG)[0].token_ids
    forked = engine.generate([prompt], dataclasses.replace(LONG, n=3))
    assert [c.token_ids for c in forked] == [alone] * 3
    sampled = engine.generate([prompt], SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in sampled}) == 3
    assert_pool_empty(engine)


def test_hybrid_abort_frees_every_table(engine):
    def slow(tokens, logits):  # keeps the request running while the test looks at it
        time.sleep(0.01)
        return logits

    params = dataclasses.replace(LONG, max_tokens=400, logits_processors=[slow])
    stream = engine.stream(random_tokens(50, seed=2), params)
    request_id = next(stream).request_id
    held = engine.request_blocks(request_id)  # every group's table: the prompt's and more
    assert len(held) == len(set(held))
    assert engine.kv_manager.num_blocks_for(50) <= len(held) <= engine.kv_manager.num_blocks_for(450)
    assert engine.stats()["blocks_used"] >= len(held) and engine.block_states().count("owned") > 0
    stream.close()  # aborts the request
    assert_pool_empty(engine)
    assert engine.request_blocks(request_id) == [] and set(engine.block_states()) == {"free"}


def test_hybrid_too_long_request_is_rejected_with_the_ring_aware_capacity(hybrid, tokenizer):
    model, settings = hybrid
    with tiny_engine(model, tokenizer, cache_tokens=64, max_num_seqs=2, **settings) as eng:
        capacity = eng.scheduler.capacity_tokens
        bs = eng.kv_manager.block_size
        assert capacity == eng.plan.token_capacity and capacity % bs == 0
        assert (
            eng.kv_manager.num_blocks_for(capacity)
            <= eng.kv_manager.num_blocks
            < eng.kv_manager.num_blocks_for(capacity + 1)
        )
        assert capacity > eng.kv_manager.num_blocks * bs // len(eng.kv.groups)  # rings stop at their size
        with pytest.raises(RequestTooLongError, match=f"exceeds the KV cache capacity of {capacity} tokens"):
            eng.generate([random_tokens(capacity - 19)], GREEDY)  # + 20 new tokens: one too many
        done = eng.generate([random_tokens(capacity - 20)], GREEDY)[0]
        assert done.finish_reason == "length" and len(done.token_ids) == 20
        assert_pool_empty(eng)
