"""How the memory plan shares the KV budget between block spaces (specs.block_spaces) when a model has several:
layer groups whose pages live in disjoint pools (gemma4's sliding layers and its full layers of another
head_dim) each draw block ids from their own space, so each space gets its own number of blocks.

The rule, from what each space needs per sequence: a sliding-window (or chunked) group holds at most its
ring per sequence, and at most `max_num_seqs` sequences run at once, so the ring groups of every space get
`max_num_seqs` rings (fewer when memory must hold one longest sequence first, never fewer than one); every
full-attention group gets the same number of blocks, M, from what is left (ceil(tokens / block_size) per
sequence: the part that grows with context). Each space is then capped by its demand (memory.py's
`_demand`: --cache-tokens or the model's context), and never below what one longest sequence needs.
Plain Python (no MLX).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.cache.specs import table_lengths


@dataclass(frozen=True)
class SpaceNeeds:
    """One block space as the plan sees it: bytes per block id and its groups' `max_blocks` (None: full)."""

    block_bytes: int
    group_max_blocks: tuple[int | None, ...]

    @property
    def ring_blocks(self) -> int:
        """Blocks of one ring per ring group: what one sequence holds at most in the ring groups."""
        return sum(cap for cap in self.group_max_blocks if cap is not None)

    @property
    def growing_groups(self) -> int:
        """Groups that take a block every block_size tokens however long the sequence (full attention)."""
        return sum(cap is None for cap in self.group_max_blocks)

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of `num_tokens` tokens holds in this space."""
        return sum(table_lengths(num_tokens, block_size, self.group_max_blocks))


def fitting_tokens(spaces: Sequence[SpaceNeeds], budget: int, block_size: int, limit: int) -> int:
    """Tokens (whole blocks, at most `limit`) of the longest one sequence whose blocks in every space fit `budget`."""

    def fits(n: int) -> bool:
        return sum(s.blocks_for(n * block_size, block_size) * s.block_bytes for s in spaces) <= budget

    low, high = 0, -(-limit // block_size)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * block_size


def size_spaces(
    spaces: Sequence[SpaceNeeds],
    budget: int,
    block_size: int,
    max_num_seqs: int,
    longest: int,
    demands: Sequence[int | None],
) -> tuple[tuple[int, ...], int, int]:
    """(blocks of each space, rings per ring group, blocks per full-attention group): the module's rule for
    `budget` bytes, which must hold one `longest`-token sequence (the caller checked it)."""
    need = [s.blocks_for(longest, block_size) for s in spaces]
    ring_bytes = sum(s.ring_blocks * s.block_bytes for s in spaces)  # one ring in every ring group
    grow_bytes = sum(s.growing_groups * s.block_bytes for s in spaces)  # one block in every full group
    rings = max_num_seqs
    if ring_bytes:
        rings = max(1, min(max_num_seqs, (budget - -(-longest // block_size) * grow_bytes) // ring_bytes))
    # Ring-only spaces first, capped by their demand; then full groups share what is left equally per group.
    fixed = [
        _capped(rings * s.ring_blocks, demand) if not s.growing_groups else rings * s.ring_blocks
        for s, demand in zip(spaces, demands, strict=True)
    ]
    left = budget - sum(n * s.block_bytes for n, s in zip(fixed, spaces, strict=True))
    per_group = max(0, left // grow_bytes) if grow_bytes else 0
    blocks = tuple(
        max(n_need, _capped(n + s.growing_groups * per_group, demand))
        for s, n, n_need, demand in zip(spaces, fixed, need, demands, strict=True)
    )
    return blocks, rings, per_group


def _capped(blocks: int, demand: int | None) -> int:
    return blocks if demand is None else min(blocks, demand)
