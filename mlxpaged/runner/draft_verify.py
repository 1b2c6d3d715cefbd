"""Verifying speculative drafts: which of a sequence's drafted tokens the model keeps.

A chunk [last, d1..dk] returns logits at each of its k + 1 positions. Position j is sampled
exactly as plain decoding would sample generation index g + j (the same sampler, the same
seeded key), and the drafts are kept while the sample equals them; the first sample that
differs (or the bonus sample after k kept drafts) ends the run.

For a draft that is a point mass on d this *is* speculative rejection sampling (Leviathan et
al. 2023): accept d with probability p(d) = P(sample == d), and otherwise the sample is a draw
from p conditioned on != d, i.e. p with d removed and renormalised. Greedy is the special case
"keep while argmax == draft". Since every position draws with its own (seed, index) key, a
seeded run's tokens are the ones plain decoding draws, not only equal in distribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.runner.sampling import SampleResult, SamplerState, sample_batch

import mlx.core as mx


@dataclass
class ShiftedState(SamplerState):
    """A sampler state drawing `offset` tokens past its sequence's next one (draft position j
    draws with key index g + j), with the `drafted` tokens before that position read as its history by its
    penalties (a repetition penalty at position j counts the drafts before it, as plain decoding would once they
    are kept); a constrained row's constraint at that position (RowConstraint.drafted_masks) in place of its
    matcher."""

    offset: int = 0
    drafted: tuple[int, ...] = ()

    @classmethod
    def of(cls, state: SamplerState, offset: int, constraint=None, drafted: Sequence[int] = ()) -> ShiftedState:
        """`state` shifted: the same settings and sequence (shared, not copied)."""
        if offset and state.params.logits_processors:
            raise ValueError("rows with logits processors cannot be drafted (a processor may keep state)")
        if offset and state.constraint is not None and constraint is None:
            raise ValueError("a constrained row's drafted position needs its mask (RowConstraint.drafted_masks)")
        if len(drafted) != offset:
            raise ValueError(f"position {offset} of a drafted run follows {offset} drafts, not {len(drafted)}")
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(SamplerState)}
        if constraint is not None:
            fields["constraint"] = constraint
        return cls(**fields, offset=offset, drafted=tuple(drafted))

    @property
    def output_token_ids(self) -> list[int]:
        history = self.sequence.output_token_ids
        return [*history, *self.drafted] if self.drafted else history

    @property
    def generation_index(self) -> int:
        return len(self.sequence.output_token_ids)  # the recorded history's: `offset` says how far past it

    def key_words(self, ahead: int = 0) -> tuple[int, int]:
        return super().key_words(ahead + self.offset)


def kept_prefix(samples: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the samples at their positions."""
    kept = 0
    while kept < len(drafts) and samples[kept] == drafts[kept]:
        kept += 1
    return kept


def _positions(state: SamplerState, drafts: list[int]) -> list | SampleResult:
    """Each position's constraint of a run [last, *drafts] (None for all: unconstrained, or nothing drafted), or
    the row's error when its grammar fails before sampling."""
    if state.constraint is None or not drafts:
        return [None] * (len(drafts) + 1)
    from mlxpaged.constraints import ConstraintError  # llguidance loads only for constrained requests

    try:
        state.constraint.catch_up(state.output_token_ids)
        return state.constraint.drafted_masks(drafts)
    except ConstraintError as exc:
        return SampleResult(error=exc)


def sample_with_drafts(
    logits: mx.array, drafts: list[list[int]], rows: list[tuple[int, SamplerState]]
) -> list[SampleResult]:
    """One result per sampling row (as `sample_batch`), from `logits` holding len(drafts[i]) + 1
    rows for sampling chunk i. A drafting row's result is the token that ends its run, with the
    kept drafts' results in `accepted`."""
    firsts = [0]
    for chunk_drafts in drafts:
        firsts.append(firsts[-1] + len(chunk_drafts) + 1)
    if logits.shape[0] != firsts[-1]:
        raise ValueError(f"logits has {logits.shape[0]} rows, the drafts need {firsts[-1]}")
    take: list[int] = []
    states: list[SamplerState] = []
    spans: list[int] = []
    failed: dict[int, SampleResult] = {}  # rows whose grammar failed before sampling
    for r, (chunk, state) in enumerate(rows):
        n = len(drafts[chunk]) + 1
        positions = _positions(state, drafts[chunk])
        if isinstance(positions, SampleResult):
            failed[r] = positions
            spans.append(0)
            continue
        take += range(firsts[chunk + 1] - n, firsts[chunk + 1])
        states += [ShiftedState.of(state, j, positions[j], drafts[chunk][:j]) for j in range(n)]
        spans.append(n)
    results = sample_batch(logits[mx.array(take)], states) if states else []
    out, at = [], 0
    for r, ((chunk, _), n) in enumerate(zip(rows, spans, strict=True)):
        if r in failed:
            out.append(failed[r])
            continue
        run = results[at : at + n]
        at += n
        if any(r.error is not None for r in run):
            out.append(next(r for r in run if r.error is not None))
            continue
        kept = kept_prefix([r.token for r in run if r.token is not None], drafts[chunk])  # no error: a token
        out.append(dataclasses.replace(run[kept], accepted=tuple(run[:kept])))
    return out
