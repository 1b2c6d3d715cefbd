"""Drafting one position behind the model, chained on the drafter's own output: the model's own multi-token-prediction
layers (`speculative="mtp"`; loading/mtp_head.py) and EAGLE-3 heads (`speculative="eagle3"`; loading/eagle3_model.py,
which read several of the model's layers, through a head and vocabulary of their own). Below, "the MTP block" is
either.

The MTP block runs one position behind the model: its position q reads the model's hidden state at q and the token
at q + 1, so it can only take a position once the model has computed it and the next token is known. After every
step the model's runner hands back the hidden states of the positions it computed (Runner.capture_hidden), and
`observe` keeps those whose tokens stand (a verify pass's rejected drafts are dropped). Each step, before the model
runs, `propose` feeds the MTP block every kept position of the step's requests, in passes batched across rows on
pools of its own that share the model's block ids (as a draft model's do, runner/model_drafter.py). A drafting row's
last fed position gives its first draft; k - 1 more passes, queued lazily, feed the draft before and, in place of the
model's hidden state there (not computed yet), the MTP block's own output. The drafts are argmaxes, point masses that
runner/draft_verify.py verifies exactly: what the MTP block computes changes how many drafts are kept, never the
tokens. Its pages therefore only need to be right where they are read often: positions the model did not compute
(prefix-cache hits, blocks read back from disk) keep whatever the block holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.runner.kept_hidden import KeptHidden
from mlxpaged.runner.model_drafter import drafts_by_row
from mlxpaged.runner.model_runner import Runner
from mlxpaged.runner.passes import StepInput, embedding_and_head, prefill_passes

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlxpaged.engine.scheduler import ScheduledChunk

SHORT_FEED = 9  # positions of a feed that shares the decode rows' pass (a verify row's: k <= 7 drafts + 1, and one)


class ChainedDrafter:
    def __init__(self, head: nn.Module, kv: PagedKVCache, target: Runner, name: str, vocab_size: int):
        """`target`: the model's runner, capturing hidden states; its embedding and LM head are the MTP block's."""
        if target.last_hidden is None:
            raise ValueError("the MTP block needs the model's runner to capture hidden states (capture_hidden)")
        self.head, self.kv, self.target, self.name, self.vocab_size = head, kv, target, name, vocab_size
        self.draft_ids = getattr(head, "draft_ids", None)  # EAGLE-3: its own LM head and vocabulary map
        embed, lm_head = embedding_and_head(target.model, target.head)
        # A head's own embedding (EAGLE-3's, a nextn layer's) and LM head (a nextn layer's), else the model's;
        # `logits_input`: what the LM head reads of the head's output (a nextn layer's norm; else the output).
        own_embed, own_head = getattr(head, "embed_tokens", None), getattr(head, "lm_head", None)
        self.embed = own_embed if own_embed is not None else embed
        self.lm_head = own_head if own_head is not None else lm_head
        self.logits_input = getattr(head, "logits_input", None)
        self.kept = KeptHidden()  # the model's hidden states not fed yet, per request

    def observe(self, chunks: Sequence[ScheduledChunk], accepted: dict[str, list[int]]) -> None:
        """After a step: keep the hidden states of the positions whose tokens stand."""
        self.kept.observe(chunks, self.target.last_hidden or [], accepted)

    def propose(
        self, chunks: Sequence[ScheduledChunk], drafting: Sequence[tuple[ScheduledChunk, int]]
    ) -> list[list[int]]:
        """Drafts of `drafting`'s chunks (their block tables holding room for k drafts), k tokens each, in order; the
        MTP block is fed every kept position of `chunks`' requests on the way."""
        rows = {id(chunk) for chunk, _ in drafting}
        feeds: list[StepInput] = []
        states: list[mx.array] = []
        feed_of: dict[int, int] = {}  # id(drafting chunk) -> its feed
        for chunk in chunks:
            feed = self._feed(chunk, samples=id(chunk) in rows)
            if feed is not None:
                if feed[0].samples:
                    feed_of[id(chunk)] = len(feeds)
                feeds.append(feed[0])
                states.append(feed[1])
        outputs = self._run(feeds, states)
        if not drafting:
            return []
        firsts = [feed_of[id(chunk)] for chunk, _ in drafting]
        last = mx.stack([outputs[i] for i in firsts])[:, None]  # [B, 1, H]: each row's output at its last position
        tokens = [self._argmax(last[:, -1])]
        live = list(range(len(drafting)))
        for j in range(1, max(k for _, k in drafting)):
            keep = [i for i, r in enumerate(live) if drafting[r][1] > j]
            live = [live[i] for i in keep]
            fed = tokens[-1]
            if len(keep) < fed.shape[0]:
                fed, last = fed[mx.array(keep)], last[mx.array(keep)]
            step = [self._next(feeds[firsts[r]], j) for r in live]
            last = self._pass(step, fed[:, None], last)
            tokens.append(self._argmax(last[:, -1]))
            mx.async_eval(tokens[-1], self.kv.pools)  # each pass reads the pools the one before wrote: in order
        return drafts_by_row(tokens, [k for _, k in drafting])

    def ready(self, chunk: ScheduledChunk) -> bool:
        """Whether `chunk` (a decode chunk) can draft now: the model computed its request's position before the
        chunk's last token, which gives the first draft (else it decodes plainly, and drafts next step)."""
        return self.kept.ready(chunk)

    def _feed(self, chunk: ScheduledChunk, samples: bool) -> tuple[StepInput, mx.array] | None:
        """The MTP block's input for `chunk`'s request: its kept positions not fed yet (their hidden states and the
        tokens after them). A drafting row's (`ready`) ends at the position before its last token's, which is fed
        again if it was already."""
        taken = self.kept.take(chunk, last_again=samples)
        if taken is None:
            return None
        first, hidden = taken
        tokens = chunk.request.token_ids_between(first + 1, first + hidden.shape[0] + 1)
        return StepInput(tokens, first, chunk.block_tables, samples), hidden

    def _run(self, feeds: list[StepInput], states: list[mx.array]) -> list[mx.array]:
        """Feed the MTP block: rows of a few positions (decode and verify rows) share a pass, longer ones are grouped
        as prefill chunks are (passes.prefill_passes). Each feed's output at its last position [H], in order."""
        short = [i for i, x in enumerate(feeds) if len(x.token_ids) <= SHORT_FEED]
        long = [i for i in range(len(feeds)) if i not in short]
        passes = [short] if short else []
        passes += [[long[i] for i in rows] for rows in prefill_passes([feeds[i] for i in long])]
        last: dict[int, mx.array] = {}
        previous = None
        for rows in passes:
            batch = [feeds[i] for i in rows]
            width = max(len(x.token_ids) for x in batch)
            tokens = mx.array([list(x.token_ids) + [0] * (width - len(x.token_ids)) for x in batch], dtype=mx.int32)
            hidden = mx.stack([_padded(states[i], width) for i in rows])
            out = self._pass(batch, tokens, hidden)
            for b, i in enumerate(rows):
                last[i] = out[b, len(feeds[i].token_ids) - 1]
            if previous is not None:
                mx.eval(previous)  # still reading the pools: this pass's writes, queued now, would copy them
            mx.async_eval(out, self.kv.pools)
            previous = out
        return [last[i] for i in range(len(feeds))]

    def _pass(self, batch: list[StepInput], tokens: mx.array, hidden: mx.array) -> mx.array:
        """The MTP block over `batch` (tokens [B, L], hidden [B, L, H]) through paged views of its pools."""
        views = paged_views(
            self.kv, [x.block_tables for x in batch], [x.start for x in batch], [len(x.token_ids) for x in batch]
        )
        return self.head(self.embed(tokens), hidden.astype(self.kv.dtype), views)

    def _argmax(self, outputs: mx.array) -> mx.array:
        """The drafts of outputs [B, H]: the model's LM head's argmax (never an id past the model's vocabulary), or the
        head's own (`draft_ids`: EAGLE-3's, in the model's ids)."""
        if self.draft_ids is not None:
            return self.draft_ids(outputs).astype(mx.int32)
        if self.logits_input is not None:
            outputs = self.logits_input(outputs)
        logits = self.lm_head(outputs).astype(mx.float32)
        return mx.argmax(logits[:, : self.vocab_size], axis=-1).astype(mx.int32)

    @staticmethod
    def _next(feed: StepInput, j: int) -> StepInput:
        """Draft pass j + 1 of a row: one token (fed lazily) at the position after the last pass's."""
        return StepInput([0], feed.start + len(feed.token_ids) - 1 + j, feed.block_tables, True)

    def fork(self, parent_id: str, child_id: str, copies: Sequence) -> None:
        """An n > 1 sequence starts from its parent: the MTP block's pages get the same copy-on-write copies, and
        the child is fed the parent's kept positions too."""
        self.kv.copy_on_write(copies)
        self.kept.fork(parent_id, child_id)

    def keep_only(self, live: Callable[[str], bool]) -> None:
        """Forget the requests that are no longer `live` (finished, aborted)."""
        self.kept.keep_only(live)


def _padded(states: mx.array, width: int) -> mx.array:
    return states if states.shape[0] == width else mx.pad(states, [(0, width - states.shape[0]), (0, 0)])
