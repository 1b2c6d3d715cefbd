"""Pool bytes held but never written, with one block-id space shared by every layer group (before issue 24
part 2) and with block spaces (specs.block_spaces), for a gemma4-like layout; and what the same memory holds.
`python -m tests.platform.space_waste` prints the figures the issue 24 note reports."""

from __future__ import annotations

from mlxpaged.cache.specs import (
    KVGeometry,
    block_spaces,
    group_layers,
    pool_block_bytes,
    sequence_capacity,
    table_lengths,
)
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.platform.memory import DeviceFacts, KVShape, ModelFacts, plan_memory

GiB = 2**30
BLOCK = 16
DTYPE_BYTES = 2  # bfloat16 K/V
# gemma4-like: 5 sliding-window leaves per full-attention leaf (30 KV leaves), window leaves 1x256, full 1x512
# (the widths design note issue14 measured the shared space's idle pages with).
WINDOW = 512
KINDS: tuple = ((WINDOW,) * 5 + (None,)) * 5
GEOMETRIES = tuple(KVGeometry(1, 512, 512) if kind is None else KVGeometry(1, 256, 256) for kind in KINDS)
CONTEXT = 131_072
DEVICE = DeviceFacts("metal", 64 * GiB, 40 * GiB, 48 * GiB, "64 GB Mac")


def gemma4_like(context: int = CONTEXT) -> ModelFacts:
    return ModelFacts(KVShape(len(KINDS), 1, 256, DTYPE_BYTES, KINDS, GEOMETRIES), 8 * GiB, 2560, 262_144, context)


def idle_fraction(num_tokens: int, spaces: bool) -> float:
    """Of the pool bytes one sequence of `num_tokens` tokens holds, the share no layer of it ever writes."""
    groups = group_layers(KINDS)
    page = {g.index: sum(GEOMETRIES[layer].page_bytes(BLOCK, DTYPE_BYTES) for layer in g.layers) for g in groups}
    caps = [g.spec(BLOCK).max_blocks for g in groups]
    held_blocks = table_lengths(num_tokens, BLOCK, caps)  # per group
    written = sum(n * page[g] for g, n in enumerate(held_blocks))
    if not spaces:  # every id stands for a page in every pool
        held = sum(held_blocks) * pool_block_bytes(KINDS, GEOMETRIES, BLOCK, DTYPE_BYTES)
    else:  # an id stands for a page in its space's pools only
        held = 0
        for space in block_spaces(groups, GEOMETRIES):
            space_page = max(page[g] for g in space)  # one geometry per space here: every group's page is the same
            held += sum(held_blocks[g] for g in space) * space_page
    return 1 - written / held


def shared_space_capacity(kv_memory: int, max_num_seqs: int) -> int | None:
    """The longest sequence the same KV memory held with one block-id space (the plan before block spaces)."""
    caps = [g.spec(BLOCK).max_blocks for g in group_layers(KINDS)]
    blocks = kv_memory // pool_block_bytes(KINDS, GEOMETRIES, BLOCK, DTYPE_BYTES)
    demand = max_num_seqs * sum(table_lengths(CONTEXT, BLOCK, caps))
    return sequence_capacity(min(blocks, demand), BLOCK, caps)


def main() -> None:
    for tokens in (1024, 8192, 32768, CONTEXT):
        before, after = idle_fraction(tokens, spaces=False), idle_fraction(tokens, spaces=True)
        print(f"{tokens:>7,} tokens: idle pool bytes of one sequence {before:.1%} shared space, {after:.1%} spaces")
    for memory in (2 * GiB, 8 * GiB):
        plan = plan_memory(DEVICE, gemma4_like(), CacheConfig(kv_memory=memory, block_size=BLOCK), SchedulerConfig())
        before = shared_space_capacity(memory, SchedulerConfig().max_num_seqs)
        print(
            f"{memory // GiB} GiB of KV: one sequence up to {before:,} tokens with one space, "
            f"{plan.token_capacity:,} with spaces ({plan.token_capacity / before:.2f}x); {plan.reason}"
        )


if __name__ == "__main__":
    main()
