"""Review 5: the 1 x 1 stand-in pool of a state-only model (mamba2) in the memory plan."""

from __future__ import annotations

import pytest

from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.loading.probe import probe_layout
from mlxpaged.platform.memory import DeviceFacts, ModelFacts, plan_memory
from tests.archs.harness import build

GiB = 2**30


@pytest.mark.parametrize("cache", [CacheConfig(memory_fraction=0.5), CacheConfig(kv_memory="1GB")],
                         ids=["memory_fraction", "kv_memory"])
def test_a_state_only_models_stand_in_pool_is_not_sized_by_the_kv_budget(cache):
    layout = probe_layout(build("mamba2"))
    assert not layout.kv_leaves and layout.state_leaves
    facts = ModelFacts.from_layout(layout, 10**8, 4, None)  # mamba configs name no context length
    plan = plan_memory(DeviceFacts("cpu", 64 * GiB, 32 * GiB), facts, cache, SchedulerConfig())
    # A pool nothing attends only numbers tokens: a million blocks already holds 16M-token sequences.
    # Before the cap: 1 GB / 128 B = 7.8M blocks (kv_memory), ~100M (memory_fraction): one Python object each.
    assert plan.num_blocks <= 10**6, (plan.num_blocks, plan.kv_bytes)
