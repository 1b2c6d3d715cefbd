"""n > 1 forks on pools of several geometries (K-is-V with two classes; shared K/V): a fork copies the prompt's
partly computed block in every pool, so the forks keep mlx-lm's greedy tokens."""

from __future__ import annotations

from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.sampling_params import SamplingParams
from tests.archs.harness import _vocab, build, prompts, reference
from tests.archs.scenarios import BLOCK_SIZE, compare
from tests.engine.test_engine import (
    assert_pool_empty,
    tiny_engine,
    tokenizer,  # noqa: F401  (the fixture, shared)
)

import pytest


@pytest.mark.parametrize("module", ["deepseek_v32", "gemma4_text"])  # K-is-V + two classes; shared K/V
def test_greedy_n_sequences_on_pools_of_several_geometries_match_mlx_lm(module, tokenizer, monkeypatch):
    """n > 1 forks copy the prompt's partly computed block: in every pool (copy_blocks), or the copied
    sequences read another class's stale pages and leave mlx-lm's greedy tokens."""
    copies = []
    real_copy = PagedKVCache.copy_blocks
    monkeypatch.setattr(
        PagedKVCache, "copy_blocks", lambda kv, pairs, space=0: (copies.extend(pairs), real_copy(kv, pairs, space))
    )
    model = build(module)
    case = reference(model, prompts(_vocab(model))[0])
    assert len(case.prompt) % BLOCK_SIZE  # a partial last block, which a fork copies
    params = SamplingParams(temperature=0.0, n=3, max_tokens=len(case.tokens), ignore_eos=True)
    with tiny_engine(model, tokenizer, cache_tokens=512, block_size=BLOCK_SIZE) as engine:
        assert len(set(engine.kv.geometries)) > 1
        for completion in engine.generate([case.prompt], params):
            assert compare(list(completion.token_ids), case) is None
        assert_pool_empty(engine)
    assert copies  # the forks copied the partial block rather than recomputing the prompt
