"""The runner on a model with state layers (tiny Qwen 3.5), compared with mlx-lm's own caches array by
array: a ragged batch does not show in greedy tokens (design 14, finding 4), so the state rows and the
logits are compared, after a chunked prefill next to another prompt and after batched decode steps."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.state_cache import StateStore
from mlxpaged.loading.probe import probe_layout
from mlxpaged.runner.model_runner import Runner
from mlxpaged.runner.passes import StepInput, state_model_passes
from tests.tiny_models import grow_tables, random_tokens, shuffled_blocks, tiny_qwen3_5

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

ATOL = 1e-4


class Sequence:
    """One prompt run twice: on the runner (slot, tables) and on mlx-lm's own cache."""

    def __init__(self, model, kv, store, free, prompt):
        self.kv, self.free, self.tokens = kv, free, list(prompt)
        self.slot, self.tables, self.start = store.allocate(), [[] for _ in kv.groups], 0
        self.ref_cache = make_prompt_cache(model)
        self.ref_logits = model(mx.array([prompt]), cache=self.ref_cache)[0, -1]

    def chunk(self, n: int | None = None) -> StepInput:
        tokens = self.tokens[self.start :] if n is None else self.tokens[self.start : self.start + n]
        grow_tables(self.kv, self.tables, self.free, self.start + len(tokens))
        x = StepInput(tokens, self.start, self.tables, True, self.slot)
        self.start += len(tokens)
        return x

    def feed(self, model, token: int) -> None:
        self.tokens.append(token)
        self.ref_logits = model(mx.array([[token]]), cache=self.ref_cache)[0, -1]


def assert_state_matches(layout, store, seq) -> None:
    for leaf in layout.state_leaves:
        want = seq.ref_cache[leaf.path[0]].cache
        got = store.row(seq.slot, leaf.path)
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert g is not None and g.shape == w.shape, (leaf.path, i)
            diff = mx.abs(g - w).max().item()
            assert mx.allclose(g, w, atol=ATOL, rtol=ATOL).item(), f"{leaf.path}[{i}]: max diff {diff}"


def tiny(module: str):
    from tests.archs.harness import build

    return tiny_qwen3_5() if module == "qwen3_5 (tiny_models)" else build(module)


# Qwen 3.5 and lfm2 mask their state by lengths; the others do not (finding 4), mamba and rwkv7 have no
# KV at all, recurrent_gemma treats a fresh state (None) unlike zeros and has a window KV leaf.
MODULES = ["qwen3_5 (tiny_models)", "lfm2", "mamba", "rwkv7", "nemotron_h", "olmo_hybrid", "recurrent_gemma"]


@pytest.mark.parametrize("module", MODULES)
def test_state_rows_and_logits_match_mlx_lm_through_chunked_prefill_and_batched_decode(module):
    model = tiny(module)
    layout = probe_layout(model)
    kv = PagedKVCache.for_layout(layout, 32, 8, mx.float32)
    store = StateStore(layout.state_leaves, 4)
    runner = Runner(model, kv, layout, store)
    free = shuffled_blocks(32)
    a, b = (Sequence(model, kv, store, free, random_tokens(n, seed=n)) for n in (21, 13))
    runner.step([a.chunk(10)])
    logits = runner.step([a.chunk(), b.chunk()])  # a's state carried across chunks; b fresh, in its own pass
    for _ in range(3):
        for seq, row in zip((a, b), logits, strict=True):
            assert mx.allclose(row, seq.ref_logits, atol=ATOL, rtol=ATOL).item(), mx.abs(row - seq.ref_logits).max()
            assert_state_matches(layout, store, seq)
        nxt = [int(mx.argmax(row).item()) for row in logits]
        for seq, token in zip((a, b), nxt, strict=True):
            seq.feed(model, token)
        logits = runner.step([a.chunk(), b.chunk()])  # one batched decode pass of both
    assert store.num_free == 2


def test_state_models_prefill_alone_and_decode_together():
    def x(n, start):
        return StepInput([1] * n, start, [], True, 0)

    # a fresh one-token prompt (start 0) has no state yet: it must not share the decode pass
    assert state_model_passes([x(1, 5), x(4, 0), x(1, 0), x(1, 9), x(3, 2)]) == [[0, 3], [1], [2], [4]]
