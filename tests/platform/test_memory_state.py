"""The memory plan of a model with state layers: state slots and checkpoints are planned up front,
apart from the KV cache, and the KV blocks get what is left."""

from __future__ import annotations

import dataclasses

from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.platform.memory import CHECKPOINTS_PER_SEQUENCE, DeviceFacts, plan_memory
from mlxpaged.units import format_size
from tests.platform.test_memory import SMOL, assert_adds_up

import pytest

MiB = 2**20
# Little memory, so the KV cache is sized by memory rather than by demand.
SMALL_HOST = DeviceFacts("cpu", 8 * 2**30, 4 * 2**30, None, "small")


def test_state_bytes_are_planned_per_slot_and_checkpoint_apart_from_kv():
    hybrid = dataclasses.replace(SMOL, state_bytes_per_sequence=4 * MiB)
    scheduler = SchedulerConfig(max_num_seqs=8)
    cache = CacheConfig(memory_fraction=0.5)
    plain, plan = (plan_memory(SMALL_HOST, m, cache, scheduler) for m in (SMOL, hybrid))
    slots, checkpoints = 8, CHECKPOINTS_PER_SEQUENCE * 8
    assert (plan.num_state_slots, plan.num_checkpoints) == (slots, checkpoints)
    assert plan.state_bytes == (slots + checkpoints) * 4 * MiB
    label = f"state ({slots} slots + {checkpoints} checkpoints x {format_size(4 * MiB)})"
    assert dict(plan.breakdown)[label] == plan.state_bytes
    # the KV cache gets half of what is left after the state, not of what was left before it
    assert plain.kv_bytes - plan.kv_bytes == pytest.approx(plan.state_bytes / 2, abs=plan.block_bytes)
    assert plain.state_bytes == 0 and "state:" not in plain.describe()
    assert f"{slots} slots + {checkpoints} checkpoints" in plan.describe()
    assert_adds_up(plan)
