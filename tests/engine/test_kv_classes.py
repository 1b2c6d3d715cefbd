"""Models whose K/V are not one geometry per layer, on the engine: latent MLA, a KV-only CacheList with a
K-is-V indexer (two geometry classes), shared K/V over two classes with a None-padded cache list, an
unused cache, fewer caches than layers. Greedy tokens equal mlx-lm's generate_step on a prefix-cache hit
and after preemption, and the pool is empty afterwards (alone and batched: test_cache_tree.py); also
K != V with sinks and windows (mimo_v2_flash), two MLA caches per layer (longcat_flash), a serial model (afm7)."""

from __future__ import annotations

from mlxpaged.sampling_params import SamplingParams
from tests.archs.harness import _vocab, build, prompts, reference
from tests.archs.scenarios import BLOCK_SIZE, compare
from tests.engine.test_engine import assert_pool_empty, tiny_engine

import pytest

NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
MODULES = [
    "deepseek_v3",
    "deepseek_v32",
    "gemma4_text",
    "nemotron-nas",
    "gemma3n",
    "longcat_flash",
    "mimo_v2_flash",
    "afm7",
]  # afm7: one sequence per pass (runner/batch_check.py)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


def expect(model, prompt):
    return reference(model, prompt)


def check(got, case) -> None:
    why = compare(list(got.token_ids), case)
    assert why is None, f"prompt of {len(case.prompt)}: {why}"


@pytest.mark.parametrize("module", MODULES)
def test_prefix_hit_matches_mlx_lm(module, tokenizer):
    model = build(module)
    first = expect(model, prompts(_vocab(model))[0])
    second = expect(model, first.prompt + first.tokens + [5, 6, 7, 8, 9, 10, 11, 12, 13])  # A + reply + 9 tokens
    with tiny_engine(model, tokenizer, cache_tokens=512, block_size=BLOCK_SIZE) as engine:
        check(engine.generate([first.prompt], GREEDY)[0], first)
        warm = engine.generate([second.prompt], GREEDY)[0]
        check(warm, second)
        by_class = engine.stats()["kv_memory_by_class"]  # e.g. DSA: "K 1x4, V 1x32" and "K 1x128 = V"
        assert sum(by_class.values()) == engine.kv.nbytes and len(by_class) == len(set(engine.kv.geometries))
        if engine.kv_manager.enable_prefix_cache:  # off only for sliding-window models (kv_cache.py)
            assert warm.cached_tokens >= len(first.prompt) // BLOCK_SIZE * BLOCK_SIZE
        assert_pool_empty(engine)


@pytest.mark.parametrize("module", MODULES)
def test_preempted_requests_match_mlx_lm(module, tokenizer):
    model = build(module)
    cases = [expect(model, p) for p in prompts(_vocab(model))] + [expect(model, list(range(40, 60)))]
    # 3 sequences of 21-33 tokens need 11+ blocks of 8 per full group; the pool holds far fewer at once.
    with tiny_engine(model, tokenizer, cache_tokens=40, max_num_seqs=3, block_size=BLOCK_SIZE) as tight:
        got = tight.generate([c.prompt for c in cases], GREEDY)
        assert tight.stats()["preemptions"] > 0
        for completion, case in zip(got, cases, strict=True):
            check(completion, case)
        assert_pool_empty(tight)
