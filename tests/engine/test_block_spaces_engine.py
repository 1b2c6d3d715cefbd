"""gemma4_text on the engine with two block spaces (its window layers 1x32, its full layer 1x64: disjoint pools,
specs.block_spaces): each space has its own block count, and greedy tokens equal mlx-lm's generate_step
batched, after preemption and in n > 1 forks; the same KV memory holds longer sequences than one shared space."""

from __future__ import annotations

from mlxpaged.cache.specs import sequence_capacity
from mlxpaged.sampling_params import SamplingParams
from tests.archs.harness import _vocab, build, prompts, reference
from tests.archs.scenarios import BLOCK_SIZE, compare
from tests.engine.test_engine import (
    assert_pool_empty,
    tiny_engine,
    tokenizer,  # noqa: F401  (the fixture, shared)
)

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build("gemma4_text")


@pytest.fixture(scope="module")
def cases(model):
    return [reference(model, p) for p in prompts(_vocab(model))] + [reference(model, list(range(40, 60)))]


def check(completions, cases) -> None:
    for completion, case in zip(completions, cases, strict=True):
        why = compare(list(completion.token_ids), case)
        assert why is None, f"prompt of {len(case.prompt)}: {why}"


def test_two_spaces_of_their_own_size_match_mlx_lm(model, cases, tokenizer):
    with tiny_engine(model, tokenizer, block_size=BLOCK_SIZE, max_num_seqs=4) as engine:
        kv = engine.kv
        assert len(kv.spaces) == 2 and kv.space_blocks[0] != kv.space_blocks[1]
        assert [p.num_blocks for p in engine.kv_manager.pools] == list(kv.space_blocks)
        assert engine.stats()["blocks_total"] == sum(kv.space_blocks) == len(engine.block_states())
        check(engine.generate([c.prompt for c in cases], GREEDY), cases)
        assert_pool_empty(engine)


def test_preempted_requests_match_mlx_lm(model, cases, tokenizer):
    # 4 sequences of 21-33 tokens need 3-5 blocks of 8 each in the full space; it holds 6 (cache_tokens 40).
    with tiny_engine(model, tokenizer, cache_tokens=40, max_num_seqs=3, block_size=BLOCK_SIZE) as tight:
        assert len(tight.kv.spaces) == 2
        got = tight.generate([c.prompt for c in cases], GREEDY)
        assert tight.stats()["preemptions"] > 0
        check(got, cases)
        assert_pool_empty(tight)


def test_forks_copy_in_their_space_and_match_mlx_lm(model, cases, tokenizer):
    case = cases[0]
    assert len(case.prompt) % BLOCK_SIZE  # a partial last block, which a fork copies in the full space
    params = SamplingParams(temperature=0.0, n=3, max_tokens=len(case.tokens), ignore_eos=True)
    with tiny_engine(model, tokenizer, block_size=BLOCK_SIZE) as engine:
        completions = engine.generate([case.prompt], params)
        assert len(completions) == 3
        check(completions, [case] * 3)
        assert_pool_empty(engine)


def test_the_same_memory_holds_more_tokens(model, tokenizer):
    memory = 2**27  # the tiny model states a 131,072-token context: one such sequence must fit
    with tiny_engine(model, tokenizer, cache_tokens=None, kv_memory=memory, block_size=BLOCK_SIZE) as engine:
        caps = [spec.max_blocks for spec in engine.kv.specs]
        shared = sequence_capacity(memory // engine.kv.bytes_per_block, BLOCK_SIZE, caps)  # one space, as before
        assert engine.plan.kv_bytes <= memory
        assert engine.plan.token_capacity > 1.3 * shared
