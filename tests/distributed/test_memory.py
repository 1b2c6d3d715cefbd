"""The plan cut to the block count the ranks agreed on is the plan a cache of that size gets on its own."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import CacheConfig
from mlxpaged.distributed.memory import agreed_plan
from mlxpaged.platform.memory import plan_memory
from tests.platform.test_memory import LLAMA3_8B, MAC_64

import pytest


def test_a_smaller_agreed_count_plans_as_that_cache_would():
    own = plan_memory(MAC_64, LLAMA3_8B, CacheConfig(kv_memory=2 * 10**9))
    # 600 blocks still hold one 8,192-token sequence (a rank short of that refused its own plan already)
    agreed = agreed_plan(own, LLAMA3_8B, 600, num_ranks=2)
    alone = plan_memory(MAC_64, LLAMA3_8B, CacheConfig(kv_memory=600 * own.block_bytes))
    assert (agreed.num_blocks, agreed.token_capacity, agreed.kv_bytes) == (
        alone.num_blocks,
        alone.token_capacity,
        alone.kv_bytes,
    )
    assert own.num_blocks == 953 and agreed.reason.startswith("the smallest of 2 ranks' caches (this rank's: 953")
    assert agreed_plan(own, LLAMA3_8B, own.num_blocks, 2) is own


def test_an_agreed_count_above_this_ranks_is_refused():
    own = plan_memory(MAC_64, LLAMA3_8B, CacheConfig(kv_memory=2 * 10**9))
    with pytest.raises(ValueError, match="agreed on 954 blocks, more than this rank's 953"):
        agreed_plan(own, LLAMA3_8B, own.num_blocks + 1, 2)
