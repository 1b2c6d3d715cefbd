"""The memory plan of a model with no KV layers (mamba2): one table of zero-byte blocks (specs.NoKVSpec)
that only numbers tokens, so memory bounds none of them and demand sizes them."""

from __future__ import annotations

from mlxpaged.cache.specs import NoKVSpec
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.loading.probe import probe_layout
from mlxpaged.platform.memory import FREE_BLOCK_TOKENS, DeviceFacts, ModelFacts, plan_memory
from tests.archs.harness import build

import pytest

GiB = 2**30


@pytest.fixture(scope="module")
def facts():
    layout = probe_layout(build("mamba2"))
    assert layout.state_only and not layout.kv_leaves and layout.state_leaves
    return ModelFacts.from_layout(layout, 10**8, 4, None)  # mamba configs name no context length


@pytest.mark.parametrize(
    "cache", [CacheConfig(memory_fraction=0.5), CacheConfig(kv_memory="1GB")], ids=["memory_fraction", "kv_memory"]
)
def test_zero_byte_blocks_are_sized_by_demand_not_by_the_kv_budget(facts, cache):
    assert facts.kv.num_layers == 0 and facts.kv.table_specs(16) == (NoKVSpec(16),)
    plan = plan_memory(DeviceFacts("cpu", 64 * GiB, 32 * GiB), facts, cache, SchedulerConfig(max_num_seqs=4))
    assert plan.block_bytes == 0 and plan.kv_bytes == 0 and plan.bytes_per_token == 0
    # A budget's worth would be endless: each block is one Python object, so demand caps them.
    assert plan.num_blocks == 4 * FREE_BLOCK_TOKENS // 16, (plan.num_blocks, plan.reason)
    assert "zero bytes" in plan.reason


def test_cache_tokens_size_zero_byte_blocks_as_any_table(facts):
    plan = plan_memory(
        DeviceFacts("cpu", 64 * GiB, 32 * GiB), facts, CacheConfig(cache_tokens=1000), SchedulerConfig(max_num_seqs=4)
    )
    assert plan.num_blocks == -(-1000 // 16) + 4 and plan.kv_bytes == 0
    assert plan.token_capacity == plan.num_blocks * 16
