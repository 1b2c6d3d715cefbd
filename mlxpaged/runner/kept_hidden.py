"""The model's hidden states a drafter reads, per request, kept from the step that computed them until the drafter is
fed them (runner/chained_drafter.py: the MTP layers; runner/dflash_drafter.py: DFlash's context). The model's runner
hands them back per input (Runner.capture_hidden); `observe` keeps, after each step, those of the positions whose
tokens stand (a chunk's computed positions; a verify chunk's up to its last accepted draft, also on a model whose
state layers roll back and compute them again: the values are the same); `take` gives the drafter the positions it
was not fed yet. Positions the model never computed (prefix-cache hits, blocks read back from disk) are never fed:
what the drafter's pages hold there only changes how many drafts are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from mlxpaged.engine.scheduler import ScheduledChunk


@dataclass
class _Kept:
    """A request's positions start.. whose hidden states the model computed, for its admission; those before `fed`
    are in the drafter's pages already. Once fed, the last position's is kept: a drafting row whose positions were
    all fed (a chunk cut short by the step's budget) may need it again."""

    admission: int
    start: int
    hidden: mx.array  # [positions, H]
    fed: int

    @property
    def end(self) -> int:
        return self.start + self.hidden.shape[0]

    def merged(self, start: int, hidden: mx.array) -> _Kept:
        """These positions and `hidden`'s at start.. (recomputed ones: the same), when the two touch; else the new."""
        end = start + hidden.shape[0]
        if start > self.end or end < self.start:
            return _Kept(self.admission, start, hidden, start)  # a gap: what the model did not compute is not fed
        parts = [self.hidden[: start - self.start]] if self.start < start else []
        parts += [hidden] + ([self.hidden[end - self.start :]] if end < self.end else [])
        return _Kept(self.admission, min(start, self.start), mx.concatenate(parts), self.fed)


class KeptHidden:
    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}

    def __bool__(self) -> bool:
        return bool(self._kept)

    def observe(
        self, chunks: Sequence[ScheduledChunk], hidden: Sequence[mx.array | None], accepted: dict[str, list[int]]
    ) -> None:
        """After a step (`hidden`: each chunk's positions' hidden states): keep those of the positions whose tokens
        stand, each chunk's computed ones (a drafting chunk's: its tokens before the drafts and the accepted ones)."""
        for chunk, states in zip(chunks, hidden, strict=False):
            if states is None:
                continue
            request = chunk.request
            kept = len(chunk.token_ids) - len(chunk.drafts) + len(accepted.get(request.request_id, []))
            kept = min(kept, request.num_tokens - 1 - chunk.start)  # positions whose next token stands
            if kept <= 0:
                continue
            states = states[:kept]
            old = self._kept.get(request.request_id)
            if old is not None and old.admission == request.num_preemptions:
                self._kept[request.request_id] = old.merged(chunk.start, states)
            else:
                self._kept[request.request_id] = _Kept(request.num_preemptions, chunk.start, states, chunk.start)

    def ready(self, chunk: ScheduledChunk) -> bool:
        """Whether the model computed the position before `chunk`'s last token (a decode chunk: it drafts from
        there). Not so for a chunk of several tokens the model has not computed: a preempted request's, a first step
        after a fork."""
        kept = self._kept.get(chunk.request.request_id)
        return (
            kept is not None
            and kept.admission == chunk.request.num_preemptions
            and kept.end == chunk.start + len(chunk.token_ids) - 1
        )

    def take(self, chunk: ScheduledChunk, last_again: bool = False) -> tuple[int, mx.array] | None:
        """(first position, hidden states [n, H]) of `chunk`'s request that the drafter was not fed yet, now fed; with
        `last_again`, at least the last kept position. None: nothing to feed."""
        request = chunk.request
        kept = self._kept.get(request.request_id)
        if kept is None or kept.admission != request.num_preemptions or (kept.fed >= kept.end and not last_again):
            return None
        first = min(max(kept.start, kept.fed), kept.end - 1)
        self._kept[request.request_id] = _Kept(kept.admission, kept.end - 1, kept.hidden[-1:], kept.end)
        return first, kept.hidden[first - kept.start :]

    def fork(self, parent_id: str, child_id: str) -> None:
        """A child sequence starts from its parent's positions (unpreempted)."""
        kept = self._kept.get(parent_id)
        if kept is not None:
            self._kept[child_id] = _Kept(0, kept.start, kept.hidden, kept.fed)

    def keep_only(self, live: Callable[[str], bool]) -> None:
        """Forget the requests that are no longer `live` (finished, aborted)."""
        for request_id in [rid for rid in self._kept if not live(rid)]:
            del self._kept[request_id]
