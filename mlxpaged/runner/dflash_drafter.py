"""Drafting with a DFlash drafter (`speculative="dflash"`; the model: loading/dflash_model.py).

The drafter's context is the model's layer outputs at each position it computed (Runner.capture_hidden with the
drafter's `target_layer_ids`), kept per request after each step (runner/kept_hidden.py). Each step, before the model
runs, `propose` writes the context K/V of every kept position not fed yet into the drafter's pools (one pass over the
step's requests; pools of its own that share the model's block ids, as a draft model's do), then runs every drafting
row's block - its last token and k mask tokens, at the positions after its context - in one pass, each block attending
over its own row both ways (PagedCacheView.make_mask): the model's LM head over the mask positions gives the k drafts,
argmaxes, which runner/draft_verify.py verifies exactly. The block's K/V are written at those positions too (the
attention reads them from the pages) and replaced by the context's once the model has computed them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.loading.dflash_model import DFlashModel
from mlxpaged.runner.kept_hidden import KeptHidden
from mlxpaged.runner.model_runner import Runner
from mlxpaged.runner.passes import embedding_and_head

import mlx.core as mx

if TYPE_CHECKING:
    from mlxpaged.engine.scheduler import ScheduledChunk


class DFlashDrafter:
    def __init__(self, model: DFlashModel, kv: PagedKVCache, target: Runner, name: str, vocab_size: int):
        """`target`: the model's runner, capturing the drafter's layers; its embedding and LM head are the drafter's."""
        if target.last_hidden is None:
            raise ValueError("a DFlash drafter needs the model's runner to capture its layers (capture_hidden)")
        self.model, self.kv, self.target, self.name, self.vocab_size = model, kv, target, name, vocab_size
        self.embed, self.lm_head = embedding_and_head(target.model, target.head)
        self.kept = KeptHidden()  # the model's layer outputs not written as context yet, per request

    def observe(self, chunks: Sequence[ScheduledChunk], accepted: dict[str, list[int]]) -> None:
        """After a step: keep the layer outputs of the positions whose tokens stand."""
        self.kept.observe(chunks, self.target.last_hidden or [], accepted)

    def ready(self, chunk: ScheduledChunk) -> bool:
        """Whether `chunk` (a decode chunk) can draft now: its context reaches the position before its last token."""
        return self.kept.ready(chunk)

    def propose(
        self, chunks: Sequence[ScheduledChunk], drafting: Sequence[tuple[ScheduledChunk, int]]
    ) -> list[list[int]]:
        """Drafts of `drafting`'s chunks (their block tables holding room for k drafts), k tokens each, in order; the
        context of every kept position of `chunks`' requests is written on the way."""
        contexts = [(chunk, taken) for chunk in chunks if (taken := self.kept.take(chunk)) is not None]
        if contexts:
            self._write_context(contexts)
        if not drafting:
            return []
        # Every drafting row's block in one pass: its last token and k mask tokens (padded to the longest block with
        # mask tokens that are neither written nor read), at the positions after its context.
        width = max(k for _, k in drafting) + 1
        mask = self.model.config.mask_token_id
        tokens = mx.array([[chunk.token_ids[-1]] + [mask] * (width - 1) for chunk, _ in drafting], dtype=mx.int32)
        ends = [chunk.start + len(chunk.token_ids) - 1 for chunk, _ in drafting]  # the last tokens' positions
        views = paged_views(self.kv, [c.block_tables for c, _ in drafting], ends, [k + 1 for _, k in drafting])
        hidden = self.model(self.embed(tokens), views)
        logits = self.model.logits(self.lm_head, hidden[:, 1:]).astype(mx.float32)
        ids = mx.argmax(logits[..., : self.vocab_size], axis=-1).astype(mx.int32)
        mx.eval(ids, self.kv.pools)
        rows: list[list[int]] = ids.tolist()  # type: ignore[assignment]  # a 2-D int32 array
        return [row[:k] for row, (_, k) in zip(rows, drafting, strict=True)]

    def _write_context(self, contexts: list[tuple[ScheduledChunk, tuple[int, mx.array]]]) -> None:
        """Every kept position's context K/V, all rows in one ragged pass (padding rows are not written)."""
        width = max(hidden.shape[0] for _, (_, hidden) in contexts)
        hidden = mx.stack(
            [mx.pad(h, [(0, width - h.shape[0]), (0, 0)]) if h.shape[0] < width else h for _, (_, h) in contexts]
        )
        views = paged_views(
            self.kv,
            [chunk.block_tables for chunk, _ in contexts],
            [first for _, (first, _) in contexts],
            [h.shape[0] for _, (_, h) in contexts],
        )
        self.model.write_context(hidden.astype(self.kv.dtype), views)
        mx.async_eval(self.kv.pools)

    def fork(self, parent_id: str, child_id: str, copies: Sequence) -> None:
        """An n > 1 sequence starts from its parent: the drafter's pages get the same copy-on-write copies, and the
        child is fed the parent's kept positions too."""
        self.kv.copy_on_write(copies)
        self.kept.fork(parent_id, child_id)

    def keep_only(self, live: Callable[[str], bool]) -> None:
        """Forget the requests that are no longer `live` (finished, aborted)."""
        self.kept.keep_only(live)
