"""Which inputs share a forward pass, and in how many column chunks it runs. Plain Python, no MLX.

A pass holds rows padded to its longest input, so it costs rows x longest tokens. Inputs are taken longest
first, and a pass takes the next input while rows x longest stays within `max_batch_tokens`: similar lengths
share a pass, so little is padding. An input longer than the budget runs alone, in chunks of `max_batch_tokens`
columns through the model's cache (a causal model's hidden states do not depend on how its input was chunked).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pass:
    rows: tuple[int, ...]  # indices into the inputs, longest first
    length: int  # the longest row's tokens: the padded width
    chunk: int  # columns per model call (>= length when the pass runs in one call)

    @property
    def calls(self) -> int:
        return -(-self.length // self.chunk)


def plan_passes(lengths: list[int], max_batch_tokens: int) -> list[Pass]:
    """Every input in exactly one pass; each pass's rows x chunk within `max_batch_tokens`."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for index in order:
        current = groups[-1] if groups else None
        if current is not None and (len(current) + 1) * lengths[current[0]] <= max_batch_tokens:
            current.append(index)
        else:
            groups.append([index])
    passes = []
    for group in groups:
        length = lengths[group[0]]
        chunk = length if len(group) * length <= max_batch_tokens else max(1, max_batch_tokens // len(group))
        passes.append(Pass(tuple(group), length, chunk))
    return passes
