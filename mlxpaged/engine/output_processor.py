"""The engine step's last stage, "process outputs": the live requests' samplers, detokenizers and
sinks, and what happens to them after a step (tokens delivered, requests finished, n > 1 sequences
forked, failures). It makes no MLX calls: a fork's block copies are the runner's, reached through
`fork`.

Two ids, two names: a `caller_id` is the id `Engine.submit` returned (what a caller aborts, what its
StreamDeltas carry); a `sequence_id` is one sequence's (its `Request.request_id`): an n > 1 request's
sequence i > 0 is "<caller_id>.<i>"."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxpaged.engine.metrics import StatsCounter
from mlxpaged.engine.request import Request, RequestStatus
from mlxpaged.engine.scheduler import Scheduler, SchedulerOutput
from mlxpaged.engine.text_stream import TextStream
from mlxpaged.errors import EngineClosedError, RequestFailedError
from mlxpaged.outputs import StreamDelta
from mlxpaged.runner.sampling import SampleResult, SamplerState, make_state
from mlxpaged.runner.sampling_rows import SamplingRows
from mlxpaged.sampling_params import SamplingParams

_FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


@dataclass(eq=False)  # compared by identity: requests are unique objects
class Tracked:
    """Engine-thread state of one request."""

    request: Request
    params: SamplingParams
    sampler: SamplerState
    text: TextStream
    sink: Callable[[object], None]
    index: int = 0
    caller_id: str = ""  # the id the caller knows (sequence 0's), for abort and n > 1
    forks: list[Tracked] = field(default_factory=list)  # n > 1: sequences 1.. before their fork
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None

    @property
    def sequence_id(self) -> str:
        return self.request.request_id


def split_results(rows: SamplingRows[Tracked], results: list[SampleResult]) -> tuple[dict[str, int], set[str]]:
    """(sampled token by sequence id, ids of the sequences whose sampling failed)."""
    sampled = {
        t.sequence_id: r.token
        for t, r in zip(rows.sequences, results, strict=True)
        if r.error is None and r.token is not None
    }  # no error: a token
    failed = {t.sequence_id for t, r in zip(rows.sequences, results, strict=True) if r.error is not None}
    return sampled, failed


class OutputProcessor:
    """The requests the engine serves, by sequence id. A sink that raises gets its request aborted
    through `pending_aborts`, applied before the next step; `fork(parent_id, child, first_token)`
    starts an n > 1 sequence (scheduler fork and block copies)."""

    def __init__(self, scheduler: Scheduler, tokenizer, stats: StatsCounter, fork: Callable[[str, Request, int], None]):
        self.scheduler, self.tokenizer, self.stats = scheduler, tokenizer, stats
        self._fork = fork
        self._tracked: dict[str, Tracked] = {}
        self.pending_aborts: list[str] = []

    def __getitem__(self, sequence_id: str) -> Tracked:
        return self._tracked[sequence_id]

    def add(self, request: Request, params: SamplingParams, sink) -> None:
        """Track a request the scheduler accepted (its sequence id is the caller's id), with its n - 1
        forks waiting for its prompt."""
        caller_id = request.request_id
        tracked = self._new(request, params, sink, 0, caller_id)
        tracked.forks = [self._new(self._fork_of(request, i), params, sink, i, caller_id) for i in range(1, params.n)]
        self._tracked[caller_id] = tracked

    @staticmethod
    def _fork_of(request: Request, index: int) -> Request:
        """Sequence `index` of an n > 1 request: the same prompt (its images and adapter too), its own id and tokens."""
        return Request(
            f"{request.request_id}.{index}",
            request.prompt_token_ids,
            request.max_tokens,
            images=request.images,
            multimodal=request.multimodal,
            adapter=request.adapter,
            both_ways=request.both_ways,
        )

    def _new(self, request: Request, params: SamplingParams, sink, index: int, caller_id: str) -> Tracked:
        sampler = make_state(params, request, sequence_index=index)
        text = TextStream(self.tokenizer, params, set(self.tokenizer.eos_token_ids))
        return Tracked(request, params, sampler, text, sink, index, caller_id)

    def abort(self, caller_id: str) -> None:
        for sequence_id in self._sequences_of(caller_id):
            self.finish(sequence_id, RequestStatus.FINISHED_ABORTED, "abort")

    def _sequences_of(self, caller_id: str) -> list[str]:
        return [sequence_id for sequence_id, t in self._tracked.items() if t.caller_id == caller_id]

    def sampling_rows(self, out: SchedulerOutput) -> SamplingRows[Tracked]:
        """The step's rows to sample: each sampling chunk's sequence, then its forks still waiting
        for the parent's prompt (n > 1: they sample their first token from the parent's logits)."""
        sampling = [self._tracked[c.request.request_id] for c in out.chunks if c.samples]
        return SamplingRows([(i, t) for i, parent in enumerate(sampling) for t in [parent, *parent.forks]])

    def process(self, out: SchedulerOutput, rows: SamplingRows[Tracked], results: list[SampleResult]) -> None:
        """Hand a step's samples (already recorded by the scheduler) to their requests: fail the
        ones whose sampling failed, start forks, deliver tokens and finish what stops."""
        ok, generated = [], 0  # one pass over the rows: this runs for every request on every step
        for tracked, result in zip(rows.sequences, results, strict=True):
            if result.error is not None:  # the scheduler skipped its chunk
                self.fail(tracked.caller_id, RequestFailedError(f"sampling failed: {result.error!r}"))
            else:
                ok.append((tracked, result))
                generated += 1 + len(result.accepted)
        self.stats.add_tokens(generated, sum(len(c.token_ids) for c in out.chunks))
        new_forks = [(t, r) for t, r in ok if t.sequence_id not in self._tracked]
        for tracked, result in new_forks:  # first: delivering the parent's token may finish it
            self._start_fork(tracked, result)
        started = {id(t) for t, _ in new_forks}  # their first token was delivered by _start_fork
        for tracked, result in ok:
            if id(tracked) in started:
                continue
            if result.accepted:
                self._deliver_run(tracked.sequence_id, result)
            else:  # the common case: one token, no run to walk
                self._deliver(tracked.sequence_id, result)

    def _deliver_run(self, sequence_id: str, result: SampleResult) -> None:
        """Deliver a row's accepted drafts, then its sampled token, until one of them finishes it."""
        run = [*result.accepted, result]
        for i, token in enumerate(run):
            if sequence_id not in self._tracked:
                return
            self._deliver(sequence_id, token, undelivered=len(run) - 1 - i)

    def _deliver(self, sequence_id: str, result, undelivered: int = 0) -> None:
        """`undelivered`: tokens of the run after this one, dropped from the request if this one stops it."""
        tracked = self._tracked.get(sequence_id)
        if tracked is None:
            return
        if tracked.first_token is None:
            tracked.first_token = time.perf_counter()
            self.stats.add_ttft(tracked.first_token - tracked.submitted)
        delta = tracked.text.push(result.token)
        event = StreamDelta(
            tracked.caller_id,
            delta.text,
            result.token,
            result.logprob,
            result.top_logprobs,
            delta.finish_reason if delta.finished else None,
            tracked.index,
            stop_sequence=delta.stop_matched,
        )
        if delta.finish_reason is not None:  # push() finishes with "stop" or "length"
            if undelivered:  # a stop inside an accepted run: the request ends at its stop token
                self.scheduler.drop_last_outputs(sequence_id, undelivered)
            self.finish(sequence_id, _FINISH_STATUS[delta.finish_reason], delta.finish_reason, last=event)
        else:
            self._emit(tracked, event)

    def finish(
        self,
        sequence_id: str,
        status: RequestStatus,
        reason: str | None,
        last: StreamDelta | None = None,
        notify: bool = True,
    ) -> None:
        tracked = self._tracked.pop(sequence_id, None)
        if tracked is None:
            return
        self.scheduler.finish(sequence_id, status)  # frees the blocks now
        if not notify:
            return
        for fork in tracked.forks:  # n > 1 sequences that never started end with their parent
            self._emit(
                fork,
                StreamDelta(
                    tracked.caller_id,
                    "",
                    finish_reason=reason,
                    index=fork.index,
                    prompt_tokens=len(tracked.request.prompt_token_ids),
                ),
            )
        request = tracked.request
        event = last or StreamDelta(tracked.caller_id, tracked.text.finish().text, index=tracked.index)
        event.request_id = tracked.caller_id
        event.finish_reason = reason
        event.prompt_tokens = len(request.prompt_token_ids)
        event.cached_tokens = request.num_cached_tokens
        event.completion_tokens = len(request.output_token_ids)
        self._emit(tracked, event)

    def _emit(self, tracked: Tracked, event: object) -> None:
        """Hand an event to the caller's sink. A sink that raises (its consumer is gone, e.g. a
        closed event loop) gets its request aborted, never the engine step that served everyone."""
        try:
            tracked.sink(event)
        except Exception:
            self.pending_aborts.append(tracked.caller_id)

    def _start_fork(self, tracked: Tracked, result) -> None:
        """Sequence i > 0 of an n > 1 request: share the parent's prompt blocks, then deliver its first token."""
        parent = self._tracked.get(tracked.caller_id)  # sequence 0's id is the caller's
        if parent is None or tracked not in parent.forks:
            return
        parent.forks.remove(tracked)
        self._fork(parent.sequence_id, tracked.request, result.token)
        self._tracked[tracked.sequence_id] = tracked
        self._deliver(tracked.sequence_id, result)

    def fail(self, caller_id: str, exc: BaseException) -> None:
        """Fail every sequence of a request (one event for the caller)."""
        members = self._sequences_of(caller_id)
        if members:
            self._emit(self._tracked[members[0]], exc)
        for sequence_id in members:
            self.finish(sequence_id, RequestStatus.FINISHED_ERROR, None, notify=False)

    def fail_all(self, exc: BaseException) -> None:
        for caller_id in {t.caller_id for t in self._tracked.values()}:
            self.fail(
                caller_id,
                exc if isinstance(exc, EngineClosedError) else RequestFailedError(f"engine step failed: {exc!r}"),
            )
