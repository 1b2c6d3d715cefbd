"""mlx-vlm's write API for state caches, over any mlx-lm ArraysCache.

mlx-lm's state layers read and write their cache by item (`cache[0] = conv_input[:, -n:]`). mlx-vlm's newer
ones (Qwen3.5's gated-delta layers) hand the cache the update instead: `update_window` keeps the trailing causal
window of a convolution's input, `update_recurrent` runs a state transition and keeps its final state. Its cache
implements them so that it can also keep the intermediate states for speculative decoding; the engine keeps
no history (`history_capacity` 0), so both come down to the same item writes mlx-lm's layers make, and a class
that mixes this in (the probe's cache, the engine's StateView) records and stores them as it does those.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


class StateUpdates:
    """`update_window` / `update_recurrent` as mlx-vlm's ArraysCache defines them, with no history kept.
    The class mixing this in gives item access and `lengths` (per row, the new tokens of a ragged pass)."""

    history_capacity = 0  # mlx-vlm's layers ask it whether to compute intermediate states

    def update_window(self, index: int, source: mx.array, width: int, *, lengths: mx.array | None = None) -> mx.array:
        """Keep the `width` inputs before each row's next token: the last `width` of `source` [B, T, ...], or,
        for a ragged pass, those ending at each row's `lengths` (its padding after them is not its input)."""
        width = int(width)
        length = source.shape[1] - width
        if width < 0 or length < 0:
            raise ValueError(f"a causal window of {width} over {source.shape[1]} inputs")
        if lengths is None:
            state = mx.contiguous(source[:, length : length + width])
        else:
            positions = mx.clip(lengths, 0, length)[:, None] + mx.arange(width)
            positions = positions.reshape(*positions.shape, *([1] * (source.ndim - 2)))
            state = mx.take_along_axis(source, positions, axis=1)
        self[index] = state  # type: ignore[index]  # the ArraysCache this is mixed into
        return state

    def update_recurrent(
        self, index: int, length: int, update: Callable[[mx.array | None, int | None], tuple]
    ) -> tuple[mx.array, mx.array]:
        """Run `update(state, None)` from the state at `index` over `length` new tokens; keep its final state."""
        if length < 1:
            raise ValueError("a recurrent update needs at least one token")
        output, state = update(self[index], None)[:2]  # type: ignore[index]
        self[index] = state  # type: ignore[index]
        return output, state
