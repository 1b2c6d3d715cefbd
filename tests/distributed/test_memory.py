"""The plan cut to the block count the ranks agreed on is the plan a cache of that size gets on its own."""

from __future__ import annotations

import dataclasses

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import CacheConfig
from mlxpaged.distributed.memory import agreed_plan, host_share
from mlxpaged.distributed.ranks import ranks_on_this_host
from mlxpaged.platform.memory import DeviceFacts, plan_memory
from tests.platform.test_memory import LLAMA3_8B, MAC_64

import mlx.core as mx
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


def test_ranks_on_one_host_plan_from_their_share_of_its_memory():
    # A 64 GB Mac, the model's weights split over 2 ranks: each plans from half the working set with half the
    # weights, so the two pools together are about what one process plans (each rank keeps a whole activation
    # reserve: a little less), not twice it.
    model = dataclasses.replace(LLAMA3_8B, context_length=32_768)  # pools sized by memory, not a token cap
    half_model = dataclasses.replace(model, weight_bytes=model.weight_bytes // 2)
    one = plan_memory(MAC_64, model, CacheConfig())
    each = plan_memory(host_share(MAC_64, 2), half_model, CacheConfig())
    alone = plan_memory(MAC_64, half_model, CacheConfig())  # what each rank planned before: the whole host
    assert host_share(MAC_64, 2).working_set_bytes == MAC_64.working_set_bytes // 2
    assert 0.85 * one.kv_bytes <= 2 * each.kv_bytes <= one.kv_bytes, (each.kv_bytes, one.kv_bytes)
    assert 2 * alone.kv_bytes > 1.2 * one.kv_bytes  # the overcommit this prevents
    assert host_share(MAC_64, 1) is MAC_64
    cuda = DeviceFacts("cuda", 80 * 2**30, 79 * 2**30)
    assert host_share(cuda, 2) is cuda  # a GPU per rank: nothing shared


def test_a_group_of_one_counts_one_rank_on_its_host():
    assert ranks_on_this_host(mx.distributed.init()) == 1
