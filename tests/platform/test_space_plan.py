"""The memory plan for several block spaces (platform/space_plan.py): a gemma4-like layout, whose window and
full layers have pools of other widths, holds no idle pages, keeps `max_num_seqs` rings and gives the rest to
full attention, so the same memory holds longer sequences than one shared block-id space did."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.specs import group_layers, space_block_bytes
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.errors import InsufficientMemoryError
from mlxpaged.platform.memory import plan_memory
from mlxpaged.platform.space_plan import SpaceNeeds, fitting_tokens, size_spaces
from tests.platform.space_waste import (
    BLOCK,
    DEVICE,
    DTYPE_BYTES,
    GEOMETRIES,
    KINDS,
    WINDOW,
    GiB,
    gemma4_like,
    idle_fraction,
    shared_space_capacity,
)

import pytest

RING = WINDOW // BLOCK + 1  # 33 blocks per window group per sequence
WINDOW_GROUPS = sum(g.window is not None for g in group_layers(KINDS))  # 5 groups of 5 leaves


def plan(memory=2 * GiB, seqs=16, **cache):
    settings = CacheConfig(kv_memory=memory, block_size=BLOCK, **cache)
    return plan_memory(DEVICE, gemma4_like(), settings, SchedulerConfig(max_num_seqs=seqs))


def test_block_spaces_hold_no_idle_pages():
    # One shared space: a window group's id leaves the full pools' page idle, and the reverse.
    assert idle_fraction(1024, spaces=False) > 0.55 and idle_fraction(131_072, spaces=False) > 0.33
    assert idle_fraction(1024, spaces=True) == idle_fraction(131_072, spaces=True) == 0


def test_rings_for_every_sequence_and_the_rest_to_full_attention():
    p = plan()
    window_bytes, full_bytes = space_block_bytes(KINDS, GEOMETRIES, BLOCK, DTYPE_BYTES)
    assert p.space_blocks[0] == 16 * WINDOW_GROUPS * RING  # max_num_seqs rings in every window group
    assert p.space_blocks[1] == (2 * GiB - p.space_blocks[0] * window_bytes) // full_bytes
    assert p.kv_bytes == p.space_blocks[0] * window_bytes + p.space_blocks[1] * full_bytes <= 2 * GiB
    assert p.num_blocks == sum(p.space_blocks) and "block spaces" in p.describe()
    assert p.token_capacity == p.space_blocks[1] * BLOCK  # one full group: a block per 16 tokens


@pytest.mark.parametrize("memory", [2 * GiB, 8 * GiB])
def test_the_same_memory_holds_more_tokens_than_one_shared_space(memory):
    before = shared_space_capacity(memory, 16)
    after = plan(memory).token_capacity
    assert after > 1.3 * before  # a third of the shared space's pages were idle


def test_demand_caps_each_space():
    p = plan(memory=16 * GiB, seqs=2, cache_tokens=4096)
    # 4096 tokens: 256 blocks + one partial per sequence in the full group; a window group at most 2 rings.
    assert p.space_blocks == (WINDOW_GROUPS * 2 * RING, 4096 // BLOCK + 2)
    assert "capped by --cache-tokens" in p.reason


def test_a_tight_budget_keeps_one_longest_sequence_and_fewer_rings():
    spaces = [SpaceNeeds(100, (3, 3)), SpaceNeeds(50, (None,))]
    need = 2 * 3 * 100 + 64 * 50  # 1024 tokens of 16: 3 ring blocks per window group, 64 full blocks
    blocks, rings, per_group = size_spaces(spaces, need + 2 * 600 + 10, 16, 8, 1024, [None, None])
    assert rings == 3 and blocks == (18, 64) and per_group == 64  # 8 sequences' rings do not fit: 3 do
    assert fitting_tokens(spaces, need - 1, 16, 1024) == 1008  # one block fewer
    with pytest.raises(InsufficientMemoryError, match="room for"):
        plan(memory=2**20)
