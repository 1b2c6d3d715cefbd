"""Per-request sampling: SamplerState and the batched sampler the runner calls (what a caller asks
for is mlxpaged.sampling_params.SamplingParams).

One `sample_batch(logits [B, V], states)` per engine step builds every row into one graph and
evaluates it once. The pieces come from mlx-lm: its repetition / presence / frequency penalty
processors, its top-p / min-p / top-k filters (in `make_sampler`'s order, on the untempered
log-probabilities), and user processors with its `processor(tokens, logits)` signature.

Definitions (what the engine and the HTTP layer report):
- logprobs are log_softmax of the *raw* model logits, before penalties, processors, temperature
  and filters: vLLM's default `logprobs_mode="raw_logprobs"`. They describe the model, not the
  sampler, so they do not change with temperature (a masked token can still show up in them).
- repetition_penalty (HF / vLLM / mlx-lm's sign-aware rule: positive logits divided, negative
  ones multiplied) covers prompt and generated tokens, with no window, as HF and vLLM do.
- presence / frequency penalties follow OpenAI: logit[j] -= presence * (c[j] > 0) + frequency * c[j]
  where c[j] counts j among the *generated* tokens only (as vLLM; the prompt is not counted).
- Randomness: a row's draw at generation index i uses a key hashed from (seed, sequence_index, i)
  alone, so a seeded request samples the same tokens alone, batched, or rebuilt after preemption
  (`make_state(params, request)` on a request that already has output; for an unseeded request
  rebuild with `dataclasses.replace(params, seed=state.seed)`, or simply keep the state object).
- History: a state reads its sequence's tokens through the request that owns them (request.py);
  it keeps no copy, so the tokens the scheduler appends are the history the next draw sees.
- Constraints (constraints.py): a grammar mask applied last, after penalties and processors (a logit_bias
  cannot revive a masked token); its row never samples lazily, as it needs the previous token.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mlxpaged.kernels.reference import host_list
from mlxpaged.sampling_params import MAX_N, SamplingParams, token_id_list
from mlxpaged.validation import require_number

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

if TYPE_CHECKING:
    from mlxpaged.constraints import BatchMask, RowConstraint


class TokenSequence(Protocol):
    """What a sampler state reads its history from: a `Request` (request.py)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplerState:
    """One sequence's sampling settings and RNG identity; its history is read through `sequence`.
    Holds no MLX or cache resources."""

    params: SamplingParams
    seed: int  # params.seed, or drawn at creation for unseeded requests
    sequence: TokenSequence
    sequence_index: int = 0  # which of the request's n samples this is
    constraint: RowConstraint | None = None  # this sequence's grammar matcher
    _prompt_array: mx.array | None = field(default=None, repr=False)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.sequence.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.sequence.output_token_ids

    @property
    def generation_index(self) -> int:
        return len(self.output_token_ids)

    @property
    def has_processors(self) -> bool:
        """True when sampling needs the history up to the previous token (never sampled ahead, LazySample)."""
        return self.has_row_processors or self.constraint is not None

    @property
    def has_row_processors(self) -> bool:
        """True when penalties or user processors rewrite this row's logits (`_process_row`)."""
        p = self.params
        return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logits_processors)

    def key_words(self, ahead: int = 0) -> tuple[int, int]:
        """The two uint32 words of this draw's key: a hash of (seed, sequence_index, index);
        `ahead` draws for a token that many places after the next (a pipelined step)."""
        text = f"{self.seed}:{self.sequence_index}:{self.generation_index + ahead}".encode()
        value = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
        return value >> 32, value & 0xFFFFFFFF

    def all_tokens(self) -> mx.array:
        if self._prompt_array is None:
            self._prompt_array = mx.array(self.prompt_token_ids, dtype=mx.int32)
        if not self.output_token_ids:
            return self._prompt_array
        return mx.concatenate([self._prompt_array, self.output_tokens()])

    def output_tokens(self) -> mx.array:
        return mx.array(self.output_token_ids, dtype=mx.int32)


def make_state(params: SamplingParams, sequence: TokenSequence, *, sequence_index: int = 0) -> SamplerState:
    """A sequence's sampler state, reading its tokens through `sequence` (a Request); one that
    already has output tokens resumes mid-generation."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    require_number("sequence_index", sequence_index, 0, MAX_N - 1, integer=True)
    token_id_list("prompt_token_ids", sequence.prompt_token_ids)
    token_id_list("output_token_ids", sequence.output_token_ids)
    seed = params.seed if params.seed is not None else secrets.randbits(64)
    constraint = params.constraint.new_row() if params.constraint is not None else None
    return SamplerState(params, seed, sequence, sequence_index, constraint=constraint)


@dataclass(frozen=True)
class SampleResult:
    """One row's outcome: a token (with logprobs if asked), or the error its processors raised."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: Exception | None = None
    accepted: tuple[SampleResult, ...] = ()  # speculative drafts kept before this token, in order


def _process_row(state: SamplerState, row: mx.array) -> mx.array:
    """mlx-lm's penalty processors, then the user's, on one [1, V] row (a copy, never the batch)."""
    p = state.params
    if p.repetition_penalty != 1.0:
        seen = state.all_tokens()
        if seen.size:
            row = make_repetition_penalty(p.repetition_penalty, seen.size)(seen, row)
    if state.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        generated = state.output_tokens()
        if p.presence_penalty:
            row = make_presence_penalty(p.presence_penalty, generated.size)(generated, row)
        if p.frequency_penalty:
            row = make_frequency_penalty(p.frequency_penalty, generated.size)(generated, row)
    if p.logits_processors:
        tokens = state.all_tokens()
        for processor in p.logits_processors:
            row = processor(tokens, row)
    return row


def _processed_rows(
    logits: mx.array, states: list[SamplerState], errors: dict[int, Exception]
) -> list[mx.array] | None:
    """Per-row processed logits, or None when no row has processors (the batch is used as is)."""
    if not any(state.has_row_processors for state in states):
        return None
    rows = []
    for i, state in enumerate(states):
        row = logits[i : i + 1]
        if state.has_row_processors and i not in errors:
            try:
                row = _process_row(state, row)
                if not isinstance(row, mx.array) or row.shape != (1, logits.shape[-1]):
                    raise ValueError(
                        f"a logits processor returned {getattr(row, 'shape', row)!r}, "
                        f"expected an mx.array shaped (1, {logits.shape[-1]})"
                    )
            except Exception as exc:  # user code: fail this request only
                errors[i] = exc
                row = logits[i : i + 1]
        rows.append(row)
    return rows


def _filter_key(params: SamplingParams, vocab: int) -> tuple:
    """(top_p, min_p, top_k), each None when it would keep every token."""
    return (
        params.top_p if params.top_p < 1.0 else None,
        params.min_p if params.min_p > 0.0 else None,
        params.top_k if 0 < params.top_k < vocab else None,
    )


def _apply_filters(logprobs: mx.array, key: tuple) -> mx.array:
    top_p, min_p, top_k = key  # mlx-lm's make_sampler order
    if top_p is not None:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p is not None:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k is not None:
        logprobs = apply_top_k(logprobs, top_k)
    return logprobs


def _filter_groups(logprobs: mx.array, states: list[SamplerState]) -> mx.array:
    """Apply each row's filters; rows sharing settings go through mlx-lm's filters together."""
    groups: dict[tuple, list[int]] = {}
    for i, state in enumerate(states):
        groups.setdefault(_filter_key(state.params, logprobs.shape[-1]), []).append(i)
    if len(groups) == 1:
        return _apply_filters(logprobs, next(iter(groups)))
    parts, order = [], []
    for key, rows in groups.items():
        parts.append(_apply_filters(logprobs[mx.array(rows)], key))
        order.extend(rows)
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return mx.concatenate(parts)[mx.array(inverse)]


def _draw(logits: mx.array, states: list[SamplerState], ahead: int) -> mx.array:
    """Inverse-CDF draw from softmax(filtered / T) with one uniform per row from that row's key.

    One exp pass per row: about half the cost of Gumbel-max (V random numbers and two logs) on
    the CPU backend. The filters see log-probabilities up to a per-row constant (the row's max is
    subtracted, not its logsumexp): top-p renormalises, min-p is relative, top-k is by rank.
    """
    shifted = _filter_groups(logits - mx.max(logits, axis=-1, keepdims=True), states)
    inv_temp = mx.array([1.0 / s.params.temperature for s in states], dtype=shifted.dtype)
    cdf = mx.cumsum(mx.exp(shifted * inv_temp[:, None]), axis=-1)
    keys = mx.array([s.key_words(ahead) for s in states], dtype=mx.uint32)
    uniform = mx.vmap(lambda key: mx.random.uniform(key=key))(keys)
    # 1 - u is in (0, 1], so the threshold is above 0 and at most the total: the first index
    # whose cdf reaches it has positive weight.
    threshold = (1.0 - uniform)[:, None] * cdf[:, -1:]
    return (cdf < threshold).sum(axis=-1).astype(mx.uint32)


def _add_bias(logits: mx.array, states: list[SamplerState]) -> mx.array:
    """The rows' logit_bias added (OpenAI semantics: before filtering and sampling; the reported
    logprobs stay the model's own)."""
    entries = [
        (row, token, bias) for row, state in enumerate(states) for token, bias in state.params.logit_bias.items()
    ]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries, strict=True)
    bad = [t for t in tokens if t >= logits.shape[-1]]
    if bad:
        raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary of {logits.shape[-1]}")
    return logits.at[mx.array(rows), mx.array(tokens)].add(mx.array(biases, dtype=logits.dtype))


def _choose_tokens(processed: mx.array, states: list[SamplerState], ahead: int = 0) -> mx.array:
    processed = _add_bias(processed, states)
    tokens = mx.argmax(processed, axis=-1)
    drawn = [i for i, state in enumerate(states) if not state.params.greedy]
    if not drawn:
        return tokens
    if len(drawn) == len(states):
        return _draw(processed, states, ahead)
    index = mx.array(drawn)
    tokens[index] = _draw(processed[index], [states[i] for i in drawn], ahead).astype(tokens.dtype)
    return tokens


def _logprob_graph(logits: mx.array, tokens: mx.array, states: list[SamplerState], rows: list[int]) -> list[mx.array]:
    """[chosen] or [chosen, top ids, top values] of the raw log-softmax of `rows`; [] if none."""
    if not rows:
        return []
    if len(rows) < logits.shape[0]:
        index = mx.array(rows)
        logits, tokens = logits[index], tokens[index]
    raw = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(raw, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    k = min(max(states[i].params.top_logprobs for i in rows), raw.shape[-1])
    if k == 0:
        return [chosen]
    top_ids = mx.argpartition(-raw, kth=k - 1, axis=-1)[:, :k]
    return [chosen, top_ids, mx.take_along_axis(raw, top_ids, axis=-1)]


def _row_result(state: SamplerState, token: int, position: int | None, lists: list[list]) -> SampleResult:
    """`position` is the row's index among the rows that asked for logprobs (None: not asked)."""
    if position is None:
        return SampleResult(token)
    pairs = []
    if len(lists) == 3 and state.params.top_logprobs:
        pairs = sorted(zip(lists[1][position], lists[2][position], strict=True), key=lambda pair: (-pair[1], pair[0]))
        pairs = [(int(t), float(v)) for t, v in pairs[: state.params.top_logprobs]]
    return SampleResult(token, float(lists[0][position]), pairs)


def _evaluate(
    logits: mx.array,
    rows: list[mx.array] | None,
    masks: BatchMask | None,
    states: list[SamplerState],
    errors: dict[int, Exception],
) -> list[SampleResult]:
    if rows is not None:
        for i in errors:
            rows[i] = logits[i : i + 1]
    processed = logits if rows is None else mx.concatenate(rows)
    if masks is not None:
        processed = masks.apply(processed)
    tokens = _choose_tokens(processed, states)
    asked = [i for i, state in enumerate(states) if state.params.logprobs and i not in errors]
    extras = _logprob_graph(logits, tokens, states, asked)
    # A user processor may mask every token, or every token its grammar allows: fail that row, not sample 0.
    custom = [i for i, state in enumerate(states) if state.params.logits_processors and i not in errors]
    peaks = mx.max(processed[mx.array(custom)], axis=-1) if custom else mx.array([])
    mx.eval(tokens, peaks, *extras)
    for i, peak in zip(custom, host_list(peaks), strict=True):
        if not math.isfinite(peak):
            errors[i] = (
                masks.dead_end(i)
                if masks is not None and i in masks.rows
                else ValueError(f"logits processors left no finite logit (the largest is {peak})")
            )
    return _read_rows(tokens, extras, asked, states, errors)


def _read_rows(
    tokens: mx.array, extras: list[mx.array], asked: list[int], states: list[SamplerState], errors: dict[int, Exception]
) -> list[SampleResult]:
    """One SampleResult per row from the (evaluated or pending) token and logprob arrays."""
    token_list = host_list(tokens)
    lists = [host_list(extra) for extra in extras]
    position = {row: j for j, row in enumerate(asked)}
    return [
        SampleResult(error=errors[i]) if i in errors else _row_result(state, token_list[i], position.get(i), lists)
        for i, state in enumerate(states)
    ]


def _find_eval_failures(rows: list[mx.array], states: list[SamplerState], errors: dict[int, Exception]) -> bool:
    """Evaluate processed rows one by one; record the ones whose graph fails. True if any did."""
    found = False
    for i, (row, state) in enumerate(zip(rows, states, strict=True)):
        if state.has_row_processors and i not in errors:
            try:
                mx.eval(row)
            except Exception as exc:  # user code failing lazily, inside MLX
                errors[i] = exc
                found = True
    return found


def sample_batch(logits: mx.array, states: list[SamplerState]) -> list[SampleResult]:
    """Sample one token per row of `logits` [B, V] for `states` (one per row), in one evaluation.

    Does not record the tokens: the scheduler appends the ones it keeps to their requests.
    A row whose processors raise, or whose grammar reaches a dead end, gets `SampleResult(error=...)`;
    the other rows are unaffected.
    """
    if not isinstance(logits, mx.array) or logits.ndim != 2:
        raise ValueError(
            f"logits must be an mx.array shaped [batch, vocab], got {getattr(logits, 'shape', type(logits).__name__)}"
        )
    if logits.shape[0] != len(states):
        raise ValueError(f"logits has {logits.shape[0]} rows but states has {len(states)} entries")
    if not states:
        return []
    if logits.dtype != mx.float32:
        logits = logits.astype(mx.float32)
    errors: dict[int, Exception] = {}
    rows = _processed_rows(logits, states, errors)
    masks = _constraint_masks(logits, states, errors)
    try:
        return _evaluate(logits, rows, masks, states, errors)
    except Exception:
        if rows is None or not _find_eval_failures(rows, states, errors):
            raise
    return _evaluate(logits, rows, masks, states, errors)


def _constraint_masks(logits: mx.array, states: list[SamplerState], errors: dict[int, Exception]) -> BatchMask | None:
    """The grammar masks of the constrained rows (their matchers first catch up with their sequences)."""
    if all(state.constraint is None for state in states):
        return None
    from mlxpaged.constraints import BatchMask

    return BatchMask.build([s.constraint for s in states], [s.sequence for s in states], logits.shape[-1], errors)


class LazySample:
    """The tokens (and logprobs) of a batch as a lazy graph, for pipelining: the next model pass
    is built on `tokens` while this one computes; `results()` reads them. Only for rows without
    logits processors, penalties or constraints, which need the history up to the token being sampled.
    `ahead`: how many tokens each row is ahead of its recorded history (seeded keys follow).
    `launch=False` leaves the graph unqueued: the caller passes `arrays` to its own async_eval, or to the recorder
    thread (runner/recorder.py), which sets `recording`. `separate_read`: `results()` reads a copy of the tokens, not
    the array the next pass consumes, which the recorder thread may be evaluating meanwhile."""

    def __init__(
        self,
        logits: mx.array,
        states: list[SamplerState],
        ahead: int = 0,
        launch: bool = True,
        separate_read: bool = False,
    ):
        if any(state.has_processors for state in states):
            raise ValueError("rows with logits processors, penalties or constraints cannot be sampled lazily")
        logits = logits.astype(mx.float32)
        self.states = states
        self.tokens = _choose_tokens(logits, states, ahead).astype(mx.int32)
        self._read = mx.stop_gradient(self.tokens) if separate_read else self.tokens  # a new array on the same data
        self._asked = [i for i, state in enumerate(states) if state.params.logprobs]
        self._extras = _logprob_graph(logits, self.tokens, states, self._asked)
        self.arrays = [self.tokens, *self._extras] + ([self._read] if separate_read else [])
        self.recording: Future | None = None  # set when the recorder thread queues `arrays` (done once queued)
        if launch:
            mx.async_eval(*self.arrays)

    def results(self) -> list[SampleResult]:
        """Wait for the tokens; one SampleResult per row."""
        if self.recording is not None:
            self.recording.result()  # queued by the recorder thread: only then may this thread evaluate them
        return _read_rows(self._read, self._extras, self._asked, self.states, {})
