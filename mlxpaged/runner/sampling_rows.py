"""Who samples in a step: the one type the output processor builds and the runner reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from mlxpaged.runner.sampling import SamplerState


class SamplingSequence(Protocol):
    """A sequence that samples: the runner reads only its sampler (the engine's `Tracked` is one)."""

    sampler: SamplerState


S = TypeVar("S", bound=SamplingSequence)


@dataclass(frozen=True)
class SamplingRows(Generic[S]):
    """Each row to sample this step as (index among the step's sampling chunks, sequence), in order: a
    chunk's own sequence first, then the forks of an n > 1 request, which sample extra rows from its logits."""

    rows: list[tuple[int, S]]

    @property
    def sequences(self) -> list[S]:
        return [sequence for _, sequence in self.rows]

    @property
    def samplers(self) -> list[SamplerState]:
        """Each row's sampler, in row order."""
        return [sequence.sampler for _, sequence in self.rows]

    @property
    def chunk_samplers(self) -> list[SamplerState]:
        """The sampler of each sampling chunk's own sequence (its first row), in chunk order."""
        return [s.sampler for k, (i, s) in enumerate(self.rows) if k == 0 or self.rows[k - 1][0] != i]

    @property
    def chunk_of_row(self) -> list[int]:
        return [i for i, _ in self.rows]

    @property
    def sampler_rows(self) -> list[tuple[int, SamplerState]]:
        """(chunk index, sampler) of each row: what verifying drafts reads (draft_verify.sample_with_drafts)."""
        return [(i, s.sampler) for i, s in self.rows]

    @property
    def has_forks(self) -> bool:
        return len(self.rows) > len(self.chunk_samplers)
