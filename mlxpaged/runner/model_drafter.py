"""Drafting with a second, smaller model (`draft_model=`): its own runner on pools of its own that share the
target's block ids, so one block table indexes both models' pages.

Each step, before the target runs:
- every prefill chunk of the step runs through the draft too (no logits), so a prompt's draft pages are written as
  its target pages are, and a prefix-cache hit skips both models' prefill;
- each drafting row runs k draft passes, batched across rows: the first feeds what the draft has not seen yet
  (its last token, and after a fully accepted run the last draft too) and each later one feeds the previous pass's
  argmax, lazily, so the k passes are queued without waiting on one another. The k argmaxes are the row's drafts.

A draft's argmax is a point mass, which runner/draft_verify.py verifies exactly (greedy and sampled alike). What the
draft computes never reaches the target's tokens: stale or wrong draft pages (a block whose draft pages another
request wrote, a prefix restored from disk) can only lower how many drafts are kept.

`_synced[request]`: how many leading positions of the request may hold draft K/V of its tokens, for its latest
admission. A chunk starts at the request's computed tokens, past which the target rejected drafts, so the draft
resumes from the lesser of the two: after k drafts with a kept, that is the bonus token's position (the draft pages
of the kept ones are right); after all k kept, the last draft's, which the draft never fed itself. At an admission
(the first, or after a preemption) it starts at the prefix-cache hit in the pool: blocks read back from the disk tier
bring the model's pages only, and the draft computes its own for them with the first chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mlxpaged.runner.model_runner import Runner
from mlxpaged.runner.passes import StepInput

import mlx.core as mx

if TYPE_CHECKING:
    from mlxpaged.engine.scheduler import ScheduledChunk


class ModelDrafter:
    def __init__(self, runner: Runner, name: str, vocab_size: int):
        """`vocab_size`: the target's; a draft whose head is wider never proposes an id past it (the verify pass
        feeds the drafts to the target's embedding)."""
        self.runner, self.name, self.vocab_size = runner, name, vocab_size
        self._synced: dict[str, tuple[int, int]] = {}  # request -> (its admission: preemptions, synced positions)

    @property
    def kv(self):
        return self.runner.kv

    def propose(
        self, chunks: Sequence[ScheduledChunk], drafting: Sequence[tuple[ScheduledChunk, int]]
    ) -> list[list[int]]:
        """Drafts of `drafting`'s chunks (decode chunks: one token, or the kept tokens fed again after a state
        model's rollback; block tables already holding room for k drafts), k tokens each, in order; every other chunk
        of `chunks` that feeds a prompt is prefilled into the draft's pages on the way."""
        rows = {id(chunk) for chunk, _ in drafting}
        inputs: list[StepInput] = []
        for chunk in chunks:
            if id(chunk) not in rows and (len(chunk.token_ids) > 1 or not chunk.samples):
                inputs.append(self._catch_up(chunk, chunk.start + len(chunk.token_ids), samples=False))
        firsts = [self._catch_up(chunk, _last(chunk) + 1, samples=True) for chunk, _ in drafting]
        logits = self.runner.step([*inputs, *firsts])
        if not drafting:
            return []
        assert logits is not None  # every drafting row samples
        tokens = [self._argmax(logits)]  # pass j's draft of each row still drafting
        live = list(range(len(drafting)))  # rows of `drafting` in the last pass, in order
        for j in range(1, max(k for _, k in drafting)):
            keep = [i for i, r in enumerate(live) if drafting[r][1] > j]
            live = [live[i] for i in keep]
            step = [self._next(drafting[r][0], j) for r in live]
            fed = tokens[-1] if len(keep) == tokens[-1].shape[0] else tokens[-1][mx.array(keep)]
            logits = self.runner.decode_ahead(step, fed)
            self.runner.launch(logits)  # each pass reads the pools the one before wrote: queued in order
            tokens.append(self._argmax(logits))
        drafts = drafts_by_row(tokens, [k for _, k in drafting])
        for chunk, k in drafting:  # positions up to the last token's + k - 1 hold it and k - 1 drafts now
            self._synced[chunk.request.request_id] = (chunk.request.num_preemptions, _last(chunk) + k)
        return drafts

    def _argmax(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits[:, : self.vocab_size], axis=-1).astype(mx.int32)

    def _catch_up(self, chunk: ScheduledChunk, end: int, samples: bool) -> StepInput:
        """The tokens of `chunk`'s request from the first one the draft lacks up to `end` (exclusive)."""
        request = chunk.request
        admission, synced = self._synced.get(request.request_id, (-1, 0))
        if admission != request.num_preemptions:  # admitted since: the pool's hits hold the draft's pages too
            synced = request.num_pool_hit_tokens
        start = min(synced, chunk.start)
        self._synced[request.request_id] = (request.num_preemptions, end)
        return StepInput(request.token_ids_between(start, end), start, chunk.block_tables, samples)

    @staticmethod
    def _next(chunk: ScheduledChunk, j: int) -> StepInput:
        """Draft pass j + 1 of a row: one token (fed lazily) at the position after the last pass's."""
        return StepInput([0], _last(chunk) + j, chunk.block_tables, True)

    def ready(self, chunk: ScheduledChunk) -> bool:
        """A draft model catches up with whatever its pages lack: any decode chunk can draft."""
        return True

    def observe(self, chunks: Sequence[ScheduledChunk], accepted: dict[str, list[int]]) -> None:
        """A draft model reads tokens only: the next `propose` learns what the step kept from the chunks' starts."""

    def fork(self, parent_id: str, child_id: str, copies: Sequence) -> None:
        """An n > 1 sequence starts from its parent: the draft's pages get the same copy-on-write copies."""
        self.kv.copy_on_write(copies)
        if parent_id in self._synced:
            self._synced[child_id] = (0, self._synced[parent_id][1])  # a child starts unpreempted

    def keep_only(self, live: Callable[[str], bool]) -> None:
        """Forget the requests that are no longer `live` (finished, aborted)."""
        for request_id in [rid for rid in self._synced if not live(rid)]:
            del self._synced[request_id]


def drafts_by_row(passes: list[mx.array], lengths: Sequence[int]) -> list[list[int]]:
    """Each row's drafts from batched draft passes (evaluated here): pass j holds a token for each row with more
    than j drafts (`lengths`), in row order."""
    mx.eval(passes)
    drafts: list[list[int]] = [[] for _ in lengths]
    live = list(range(len(lengths)))
    for j, row_tokens in enumerate(passes):
        live = [r for r in live if lengths[r] > j]
        values: list[int] = row_tokens.tolist()  # type: ignore[assignment]  # a 1-D int32 array
        for r, token in zip(live, values, strict=True):
            drafts[r].append(token)
    return drafts


def _last(chunk: ScheduledChunk) -> int:
    """The position of a drafting chunk's last token (its drafts follow it): one token, or after a rejection on a
    model with state layers, the kept tokens fed again and the last."""
    return chunk.start + len(chunk.token_ids) - 1
