"""Decode buffers: each layer's K/V of a pipelined run in one contiguous array, as mlx-lm's caches keep them.

A GPU that is not driven by the Metal kernel attends contiguous K/V (MLX's fused attention). Gathering every
row's pages each pass costs, per layer, a gather of the whole context and copies of the pending tail (measured on
an H200 at batch 1: 0.87x mlx-lm; with a buffer 1.04x). So a run of queued-ahead passes (deferred_writes.py)
gathers the pages once into a buffer [B, KVH, capacity, D] per layer, and each pass writes its one token per row
into the next column: one slice update per layer, in place when MLX can donate, exactly mlx-lm's KVCache step.

Rows of different lengths are right-aligned, as mlx-lm's BatchKVCache does: every row's newest token sits in the
same column, so one slice update writes them all; row r's position p lives in column p + shift[r], and the
columns before shift[r] are padding, masked out (no mask at all when every shift is equal: batch 1 never has one).

A buffer is a copy of its rows' K/V, so it takes memory the plan left unused (MemoryPlan.spare_bytes); a pass
whose buffers would not fit gathers its pages instead (deferred_writes.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

# Columns a buffer grows by (mlx-lm's KVCache.step): one concatenate per 256 tokens.
BUFFER_STEP = 256


@dataclass(frozen=True)
class Alignment:
    """Where a run's rows sit in its buffers: `column`, the newest token's column (every row's); `shifts`, each
    row's column of its position 0 (column = position + shift). The longest row has shift 0: buffers start at
    the first column any row uses."""

    column: int
    shifts: tuple[int, ...]

    @classmethod
    def right_aligned(cls, positions: Sequence[int]) -> Alignment:
        """Rows whose newest tokens are at `positions`, the longest row unpadded."""
        column = max(positions)
        return cls(column, tuple(column - p for p in positions))

    def next(self) -> Alignment:
        return Alignment(self.column + 1, self.shifts)

    def holds(self, positions: Sequence[int]) -> bool:
        """True when these are the rows' positions in this column (every row advanced together)."""
        return all(p + s == self.column for p, s in zip(positions, self.shifts, strict=True))

    @property
    def padded(self) -> bool:
        """True when some row does not use every column (its leading ones are padding)."""
        return any(self.shifts)

    def mask(self) -> mx.array | None:
        """[B, 1, 1, column + 1] True where a row has a key; None when every row has every column (batch 1, or
        rows of one length): then MLX's fused decode attention takes the call."""
        if not self.padded:
            return None
        columns = mx.arange(self.column + 1)[None, :]
        return (columns >= mx.array(self.shifts)[:, None])[:, None, None, :]

    def select(self, rows: Sequence[int]) -> tuple[Alignment, int]:
        """The alignment of these rows, and how many leading columns none of them uses (to trim off)."""
        shifts = [self.shifts[r] for r in rows]
        trim = min(shifts)
        return Alignment(self.column - trim, tuple(s - trim for s in shifts)), trim


def capacity_for(column: int) -> int:
    """Columns a buffer needs to write `column`: rounded up to BUFFER_STEP."""
    return -(-(column + 1) // BUFFER_STEP) * BUFFER_STEP


def token_bytes(kv) -> int:
    """Bytes one token of one row takes in the buffers of every layer (K and V in the pools' dtype)."""
    per_element = kv.dtype.size
    return sum(g.kv_heads * (g.k_dim + (0 if g.k_is_v else g.v_dim)) for g in kv.geometries) * per_element


def from_pages(pages: mx.array, alignment: Alignment, tail: mx.array | None, capacity: int) -> mx.array:
    """A layer's buffer: each row's positions before its pending tail from its gathered pages [B, KVH, W, D]
    (row r's position p goes to column p + shifts[r]), then `tail` [B, KVH, held, D] (K/V not in the pools yet)
    in the columns just before `alignment.column`, then room up to `capacity` columns. The newest token's column
    is left for the pass to write."""
    held = 0 if tail is None else tail.shape[2]
    end = alignment.column - held  # columns 0..end - 1 come from the pages
    if not alignment.padded:
        from_pool = pages[..., :end, :]
    else:
        positions = mx.arange(end)[None, :] - mx.array(alignment.shifts)[:, None]  # [B, columns]
        index = mx.clip(positions, 0, pages.shape[2] - 1)[:, None, :, None]  # padding reads a valid key, masked
        from_pool = mx.take_along_axis(pages, index, axis=2)
    room = mx.zeros((*pages.shape[:2], capacity - alignment.column, pages.shape[3]), dtype=pages.dtype)
    return mx.concatenate([from_pool, *([tail] if tail is not None else []), room], axis=2)


def grown(buffer: mx.array, capacity: int) -> mx.array:
    """`buffer` with room up to `capacity` columns."""
    room = mx.zeros((*buffer.shape[:2], capacity - buffer.shape[2], buffer.shape[3]), dtype=buffer.dtype)
    return mx.concatenate([buffer, room], axis=2)
