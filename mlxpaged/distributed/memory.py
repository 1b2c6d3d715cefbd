"""The pool size every rank can hold: each rank plans its own memory, rank 0's scheduler hands out the block ids,
so every rank's pools take the smallest rank's block count (ranks.agree_min), and its plan follows from it.
Ranks on one host (two processes on one Mac, the loopback runs) plan from their share of its memory."""

from __future__ import annotations

import dataclasses

from mlxpaged.platform.memory import DeviceFacts, MemoryPlan, ModelFacts, sequence_capacity


def host_share(device: DeviceFacts, ranks_here: int) -> DeviceFacts:
    """`device` as one of `ranks_here` ranks on one host sees it: each plans from 1/N of the unified memory
    (Metal) or RAM (CPU), which they all draw on, so N ranks together plan what one process would instead of
    N times it (a swap storm on a Mac). CUDA ranks each have a GPU of their own (NCCL: one device per rank):
    unchanged."""
    if ranks_here <= 1 or device.backend == "cuda":
        return device
    working_set = device.max_recommended_working_set_size
    return dataclasses.replace(
        device,
        total_bytes=device.total_bytes // ranks_here,
        available_bytes=device.available_bytes // ranks_here,
        max_recommended_working_set_size=None if working_set is None else working_set // ranks_here,
        name=f"{device.name} (a 1/{ranks_here} share: {ranks_here} ranks on this host)",
    )


def agreed_plan(plan: MemoryPlan, facts: ModelFacts, num_blocks: int, num_ranks: int) -> MemoryPlan:
    """`plan` cut to `num_blocks` (at most its own): the longest sequence and the KV bytes follow. The
    breakdown's lines stay this rank's own."""
    if num_blocks > plan.num_blocks:
        raise ValueError(f"the ranks agreed on {num_blocks:,} blocks, more than this rank's {plan.num_blocks:,}")
    if num_blocks == plan.num_blocks:
        return plan
    caps = [spec.max_blocks for spec in facts.kv.table_specs(plan.block_size)]
    return dataclasses.replace(
        plan,
        num_blocks=num_blocks,
        space_blocks=(num_blocks,),  # one block space: build.py refuses several across ranks
        token_capacity=sequence_capacity(num_blocks, plan.block_size, caps),
        kv_bytes=num_blocks * plan.block_bytes,
        reason=f"the smallest of {num_ranks} ranks' caches (this rank's: {plan.num_blocks:,} blocks, {plan.reason})",
    )
