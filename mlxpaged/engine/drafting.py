"""Speculative decoding, the scheduler's side: which decoding sequences draft this step, how many
tokens, and how well their drafts fared. Plain Python (no MLX).

After `Scheduler.schedule()`, `extend(out)` appends drafts to decode chunks [last] -> [last, d1..dk]
and gives them slots: prompt lookup's (runner/ngram_drafter.py, one sequence at a time) or a draft
model's (runner/model_drafter.py, every drafting row in k batched passes); the runner verifies every position
(runner/draft_verify.py); `Scheduler.update_from_output` keeps the accepted drafts and frees the
slots of the rest; `record` adapts each sequence's k to how its drafts fare.

A drafting step runs an eager pass of k + 1 tokens instead of the compiled one-token pass, so
a rejected draft costs time: a sequence whose drafts keep failing, or that keeps finding nothing
to draft, stops drafting for a while, twice as long each time (free text then decodes, and
pipelines, as without speculation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mlxpaged.cache.block_pool import NoFreeBlocksError
from mlxpaged.engine.request import Request
from mlxpaged.engine.speculation_gate import SpeculationGate
from mlxpaged.runner.ngram_drafter import NgramDrafter

if TYPE_CHECKING:
    from mlxpaged.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

MAX_PAUSE = 64  # steps a failing sequence waits before drafting again, at most


class BatchDrafter(Protocol):
    """Drafts for every drafting row at once, from a model: a draft model (runner/model_drafter.py), the model's own
    MTP layers or an EAGLE-3 head (runner/chained_drafter.py), a DFlash drafter (runner/dflash_drafter.py)."""

    name: str

    def propose(
        self, chunks: Sequence[ScheduledChunk], drafting: Sequence[tuple[ScheduledChunk, int]]
    ) -> list[list[int]]: ...

    def ready(self, chunk: ScheduledChunk) -> bool:
        """Whether this decode chunk can draft now (a drafter reading the model's hidden states needs the one before
        its last token)."""

    def observe(self, chunks: Sequence[ScheduledChunk], accepted: dict[str, list[int]]) -> None:
        """After a step: what it computed and kept (for a drafter reading the model's hidden states)."""

    def fork(self, parent_id: str, child_id: str, copies: list) -> None: ...

    def keep_only(self, live: Callable[[str], bool]) -> None: ...


class PromptDrafter(Protocol):
    """One sequence's drafter from its tokens alone (NgramDrafter; bench spec's oracle replays a recorded run)."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]: ...


@dataclass
class DraftPolicy:
    """One sequence's adaptive draft length: full after a fully accepted draft, the accepted
    length + 1 after a partial one, halved after a miss; two misses in a row pause drafting."""

    max_k: int
    k: int = 0
    pause: int = 0  # steps left without drafting
    next_pause: int = 2
    misses: int = 0
    empty: int = 0  # steps in a row the drafter found nothing to propose
    drafter: PromptDrafter = field(default_factory=NgramDrafter)

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    def wants_draft(self) -> bool:
        if self.pause:
            self.pause -= 1
            return False
        return True

    def no_draft(self) -> None:
        """The drafter found no n-gram for this step. Two such steps in a row pause drafting as two
        misses do: while a sequence may draft the runner does not pipeline it, and a reply with
        nothing to look up would otherwise never pipeline (at batch > 1, where pipelining pays)."""
        self.empty += 1
        if self.empty >= 2:
            self.pause, self.next_pause, self.empty = self.next_pause, min(2 * self.next_pause, MAX_PAUSE), 0

    def update(self, proposed: int, accepted: int) -> None:
        self.empty = 0
        if accepted == proposed:
            self.k, self.misses, self.next_pause = self.max_k, 0, 2
        elif accepted:
            self.k, self.misses = max(1, accepted + 1), 0
        else:
            self.k, self.misses = max(1, self.k // 2), self.misses + 1
            if self.misses >= 2:
                self.pause, self.next_pause, self.misses = self.next_pause, min(2 * self.next_pause, MAX_PAUSE), 0


@dataclass
class SpeculationStats:
    draft_tokens: int = 0  # drafted and verified
    accepted_tokens: int = 0
    drafting_steps: int = 0  # sequence-steps that drafted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def snapshot(self) -> dict:
        return {
            "spec_draft_tokens_total": self.draft_tokens,
            "spec_accepted_tokens_total": self.accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
        }


class Speculator:
    """`can_draft(request)`: False for sequences with logits processors, which are verified one token at a
    time. `model`: a draft model, MTP layers, a DFlash drafter or an EAGLE-3 head propose the drafts, all rows
    together (BatchDrafter); None: each sequence's prompt lookup does. `gate` decides, per step, whether drafting
    pays at this batch size (engine/speculation_gate.py)."""

    def __init__(
        self,
        scheduler: Scheduler,
        max_draft_tokens: int,
        can_draft: Callable[[Request], bool],
        model: BatchDrafter | None = None,
    ):
        self.scheduler, self.max_draft_tokens, self._can_draft = scheduler, max_draft_tokens, can_draft
        self.model = model
        self.new_drafter: Callable[[], PromptDrafter] = NgramDrafter  # each sequence's own, without a draft model
        self.gate = SpeculationGate()  # steps aside at batch sizes where drafting was measured not to pay
        self._decoding_rows = 0  # this step's rows, when it only decodes (what the gate learns from); else 0
        self.stats = SpeculationStats()
        self._policies: dict[str, DraftPolicy] = {}

    def extend(self, out: SchedulerOutput) -> None:
        """Append drafts to this step's decode chunks, within the step's token budget and the pool."""
        budget = self.scheduler.max_batch_tokens - out.num_batch_tokens
        asked: list[tuple[ScheduledChunk, int]] = []  # a draft model's rows: (chunk, k), their slots reserved
        decoding = [chunk for chunk in out.chunks if _decodes(chunk, self.max_draft_tokens)]
        only_decodes = len(decoding) == len(out.chunks)
        self._decoding_rows = len(decoding) if only_decodes else 0
        drafting = self.gate.decide(len(decoding)) if only_decodes else self.gate.leaning(len(decoding))
        for chunk in decoding if drafting else []:
            request = chunk.request
            if budget <= 0 or not self._can_draft(request):
                continue
            policy = self._policies.get(request.request_id)
            if policy is None:
                policy = self._policies[request.request_id] = DraftPolicy(
                    self.max_draft_tokens, drafter=self.new_drafter()
                )
            room = request.max_tokens - len(request.output_token_ids) - 1  # the run ends with a sampled token
            k = min(policy.k, room, budget)
            if k <= 0 or (self.model is not None and not self.model.ready(chunk)) or not policy.wants_draft():
                continue
            if self.model is None:
                drafts = policy.drafter.propose(request.all_token_ids, k)
                if not drafts:
                    policy.no_draft()
                    continue
                k = len(drafts)
            try:
                chunk.block_tables = self.scheduler.kv_manager.allocate_slots(request, request.num_tokens + k)
            except NoFreeBlocksError:
                continue  # the pool is short: decode plainly
            chunk.state_before = self.scheduler.hold_state(request)  # state layers roll back to it on a rejection
            if self.model is None:
                _append(out, chunk, drafts)
            else:
                asked.append((chunk, k))
            budget -= k
        if self.model is not None:  # also when nothing drafts: the step's prompt chunks fill the draft's pages
            for (chunk, _), drafts in zip(asked, self.model.propose(out.chunks, asked), strict=True):
                _append(out, chunk, drafts)

    def observe(self, out: SchedulerOutput, accepted: dict[str, list[int]]) -> None:
        """After the step's update: what it computed and kept, for a drafter that reads the model's hidden states."""
        if self.model is not None:
            self.model.observe(out.chunks, accepted)

    def fork(self, parent_id: str, child_id: str, copies: list) -> None:
        """An n > 1 sequence starts: a draft model's pages get the parent's copy-on-write copies too."""
        if self.model is not None:
            self.model.fork(parent_id, child_id, copies)

    def record(self, out: SchedulerOutput, accepted: dict[str, list[int]], seconds: float) -> None:
        """Adapt each drafting sequence's k to how many of its drafts were kept; forget finished ones. A step that
        only decoded took `seconds`: the gate learns its tokens per second."""
        if self._decoding_rows:
            tokens = sum(1 + len(accepted.get(c.request.request_id, [])) for c in out.chunks)
            self.gate.record(self._decoding_rows, any(c.drafts for c in out.chunks), tokens, seconds)
        for chunk in out.chunks:
            policy = self._policies.get(chunk.request.request_id)
            if chunk.drafts and policy is not None:
                kept = len(accepted.get(chunk.request.request_id, []))
                self.stats.draft_tokens += len(chunk.drafts)
                self.stats.accepted_tokens += kept
                self.stats.drafting_steps += 1
                policy.update(len(chunk.drafts), kept)
        for request_id in [rid for rid in self._policies if self.scheduler.get(rid) is None]:
            del self._policies[request_id]
        if self.model is not None:  # finished and aborted requests
            self.model.keep_only(lambda request_id: self.scheduler.get(request_id) is not None)

    def may_draft(self, requests: list[Request]) -> bool:
        """True when one of `requests` may draft next step (the runner then does not pipeline it)."""
        if not self.gate.leaning(len(requests)):
            return False
        for request in requests:
            policy = self._policies.get(request.request_id)
            if self._can_draft(request) and (policy is None or policy.pause == 0):
                return True
        return False


def _decodes(chunk: ScheduledChunk, max_draft_tokens: int) -> bool:
    """A chunk drafts may follow: it samples a reply's next token, from its last token or, on a model with state
    layers after a rejected draft, from the kept tokens fed again (at most k + 1: scheduler.update_from_output)."""
    request = chunk.request
    return chunk.samples and bool(request.output_token_ids) and len(chunk.token_ids) <= max_draft_tokens + 1


def _append(out: SchedulerOutput, chunk: ScheduledChunk, drafts: list[int]) -> None:
    """`chunk` [..., last] -> [..., last, *drafts], its slots reserved already."""
    chunk.token_ids, chunk.drafts = [*chunk.token_ids, *drafts], drafts
    out.num_batch_tokens += len(drafts)
