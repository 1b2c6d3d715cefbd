"""The engine step's last stage, "process outputs": the live requests' samplers, detokenizers and
sinks, and what happens to them after a step (tokens delivered, requests finished, n > 1 sequences
forked, failures). It makes no MLX calls: a fork's block copies are the runner's, reached through
`fork`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from mlxpaged.engine.metrics import StatsCounter
from mlxpaged.errors import EngineClosedError, RequestFailedError  # noqa: F401  (re-exported)
from mlxpaged.engine.request import Request, RequestStatus
from mlxpaged.outputs import StreamDelta
from mlxpaged.sampling_params import SamplingParams
from mlxpaged.runner.sampling import SampleResult, make_state
from mlxpaged.engine.scheduler import Scheduler, SchedulerOutput
from mlxpaged.engine.text_stream import TextStream

_FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


@dataclass(eq=False)  # compared by identity: requests are unique objects
class Tracked:
    """Engine-thread state of one request."""
    request: Request
    params: SamplingParams
    sampler: object
    text: TextStream
    sink: Callable[[object], None]
    index: int = 0
    group: str = ""  # the id the caller knows (the parent's), for abort and n > 1
    forks: list["Tracked"] = field(default_factory=list)  # n > 1: sequences 1.. before their fork
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None


Rows = list[tuple[int, Tracked]]  # each row to sample: (index among the sampling chunks, sequence)


def split_results(rows: Rows, results: list[SampleResult]) -> tuple[dict[str, int], set[str]]:
    """(sampled token by sequence id, ids of the sequences whose sampling failed)."""
    sampled = {t.request.request_id: r.token for (_, t), r in zip(rows, results) if r.error is None}
    failed = {t.request.request_id for (_, t), r in zip(rows, results) if r.error is not None}
    return sampled, failed


class OutputProcessor:
    """The requests the engine serves, by sequence id. A sink that raises gets its request aborted
    through `pending_aborts`, applied before the next step; `fork(parent_id, child, first_token)`
    starts an n > 1 sequence (scheduler fork and block copies)."""

    def __init__(self, scheduler: Scheduler, tokenizer, stats: StatsCounter,
                 fork: Callable[[str, Request, int], None]):
        self.scheduler, self.tokenizer, self.stats = scheduler, tokenizer, stats
        self._fork = fork
        self._tracked: dict[str, Tracked] = {}
        self.pending_aborts: list[str] = []

    def __getitem__(self, sequence_id: str) -> Tracked:
        return self._tracked[sequence_id]

    def add(self, request: Request, params: SamplingParams, sink) -> None:
        """Track a request the scheduler accepted, with its n - 1 forks waiting for its prompt."""
        tracked = self._new(request, params, sink, 0, request.request_id)
        tokens = request.prompt_token_ids
        tracked.forks = [self._new(Request(f"{request.request_id}.{i}", tokens, params.max_tokens), params, sink, i,
                                   request.request_id) for i in range(1, params.n)]
        self._tracked[request.request_id] = tracked

    def _new(self, request: Request, params: SamplingParams, sink, index: int, group: str) -> Tracked:
        state = make_state(params, request, sequence_index=index)
        text = TextStream(self.tokenizer, params, set(self.tokenizer.eos_token_ids))
        return Tracked(request, params, state, text, sink, index, group)

    def abort(self, group: str) -> None:
        for sequence_id in [rid for rid, t in self._tracked.items() if t.group == group]:
            self.finish(sequence_id, RequestStatus.FINISHED_ABORTED, "abort")

    def sampling_rows(self, out: SchedulerOutput) -> Rows:
        """The step's rows to sample: each sampling chunk's sequence, then its forks still waiting
        for the parent's prompt (n > 1: they sample their first token from the parent's logits)."""
        sampling = [self._tracked[c.request.request_id] for c in out.chunks if c.samples]
        return [(i, t) for i, parent in enumerate(sampling) for t in [parent, *parent.forks]]

    def process(self, out: SchedulerOutput, rows: Rows, results: list[SampleResult]) -> None:
        """Hand a step's samples (already recorded by the scheduler) to their requests: fail the
        ones whose sampling failed, start forks, deliver tokens and finish what stops."""
        for (_, tracked), result in zip(rows, results):
            if result.error is not None:  # the scheduler skipped its chunk
                self.fail(tracked.group, RequestFailedError(f"sampling failed: {result.error!r}"))
        ok = [(t, r) for (_, t), r in zip(rows, results) if r.error is None]
        self.stats.add_tokens(sum(1 + len(r.accepted) for _, r in ok), sum(len(c.token_ids) for c in out.chunks))
        new_forks = [(t, r) for t, r in ok if t.request.request_id not in self._tracked]
        for tracked, result in new_forks:  # first: delivering the parent's token may finish it
            self._start_fork(tracked, result)
        started = {id(t) for t, _ in new_forks}  # their first token was delivered by _start_fork
        for tracked, result in ok:
            if id(tracked) not in started:
                self._deliver_run(tracked.request.request_id, result)

    def _deliver_run(self, request_id: str, result: SampleResult) -> None:
        """Deliver a row's accepted drafts, then its sampled token, until one of them finishes it."""
        run = [*result.accepted, result]
        for i, token in enumerate(run):
            if request_id not in self._tracked:
                return
            self._deliver(request_id, token, undelivered=len(run) - 1 - i)

    def _deliver(self, request_id: str, result, undelivered: int = 0) -> None:
        """`undelivered`: tokens of the run after this one, dropped from the request if this one stops it."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        if tracked.first_token is None:
            tracked.first_token = time.perf_counter()
            self.stats.add_ttft(tracked.first_token - tracked.submitted)
        delta = tracked.text.push(result.token)
        event = StreamDelta(tracked.group, delta.text, result.token, result.logprob, result.top_logprobs,
                            delta.finish_reason if delta.finished else None, tracked.index,
                            stop_sequence=delta.stop_matched)
        if delta.finished:
            if undelivered:  # a stop inside an accepted run: the request ends at its stop token
                del tracked.request.output_token_ids[-undelivered:]
            self.finish(request_id, _FINISH_STATUS[delta.finish_reason], delta.finish_reason, last=event)
        else:
            self._emit(tracked, event)

    def finish(self, request_id: str, status: RequestStatus, reason: str | None,
               last: StreamDelta | None = None, notify: bool = True) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.scheduler.finish(request_id, status)  # frees the blocks now
        if not notify:
            return
        for fork in tracked.forks:  # n > 1 sequences that never started end with their parent
            self._emit(fork, StreamDelta(tracked.group, "", finish_reason=reason, index=fork.index,
                                         prompt_tokens=len(tracked.request.prompt_token_ids)))
        request = tracked.request
        event = last or StreamDelta(request_id, tracked.text.finish().text, index=tracked.index)
        event.request_id = tracked.group
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
            self.pending_aborts.append(tracked.group)

    def _start_fork(self, tracked: Tracked, result) -> None:
        """Sequence i > 0 of an n > 1 request: share the parent's prompt blocks, then deliver its first token."""
        parent = self._tracked.get(tracked.group)
        if parent is None or tracked not in parent.forks:
            return
        parent.forks.remove(tracked)
        self._fork(tracked.group, tracked.request, result.token)
        self._tracked[tracked.request.request_id] = tracked
        self._deliver(tracked.request.request_id, result)

    def fail(self, group: str, exc: BaseException) -> None:
        """Fail every sequence of a request (one event for the caller)."""
        members = [rid for rid, t in self._tracked.items() if t.group == group]
        if members:
            self._emit(self._tracked[members[0]], exc)
        for request_id in members:
            self.finish(request_id, RequestStatus.FINISHED_ERROR, None, notify=False)

    def fail_all(self, exc: BaseException) -> None:
        for group in {t.group for t in self._tracked.values()}:
            self.fail(group, exc if isinstance(exc, EngineClosedError)
                      else RequestFailedError(f"engine step failed: {exc!r}"))
