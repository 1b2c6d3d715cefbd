"""Unmodified mlx-lm models on paged memory give mlx-lm's own logits (float32 tolerance)."""

from __future__ import annotations

from collections.abc import Sequence

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.cache_view import PagedCacheView, paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from tests.tiny_models import (
    grow_tables,
    random_tokens,
    shuffled_blocks,
    tiny_gemma3,
    tiny_hybrid_llama,
    tiny_llama,
    tiny_qwen3,
)

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

RTOL = 1e-5  # of the logits' magnitude: float32 summation order differs between the paths

MODELS = {
    "llama": tiny_llama,
    "qwen3": tiny_qwen3,
    "hybrid_llama": tiny_hybrid_llama,
    "gemma3": tiny_gemma3,
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def layer_windows(model) -> list[int | None]:
    """Per layer, the sliding window mlx-lm's own cache gives it, or None (full attention)."""
    if not hasattr(model, "make_cache"):
        return [None] * len(model.layers)
    windows: list[int | None] = []
    for layer, cache in enumerate(model.make_cache()):
        if type(cache) is KVCache:
            windows.append(None)
        elif type(cache) is RotatingKVCache and cache.keep == 0:
            windows.append(cache.max_size)
        else:
            raise ValueError(f"layer {layer}: mlx-lm cache {type(cache).__name__} has no paged equivalent")
    return windows


def make_paged_cache(
    model,
    kv_cache: PagedKVCache,
    block_tables: Sequence[Sequence[list[int]]],
    offsets: Sequence[int] | None = None,
    num_new: Sequence[int] | None = None,
) -> list[PagedCacheView]:
    """The per-layer cache list for `model(tokens, cache=...)`, after checking the model fits the pools."""
    windows = tuple(layer_windows(model))
    if windows != kv_cache.layer_windows:
        raise ValueError(f"model layer windows {windows} differ from the cache's {kv_cache.layer_windows}")
    return paged_views(kv_cache, block_tables, offsets, num_new)


def paged_cache_for(model, block_size: int, num_blocks: int = 96) -> PagedKVCache:
    args = model.args
    dim = args.head_dim or args.hidden_size // args.num_attention_heads
    return PagedKVCache(
        len(model.layers), num_blocks, block_size, args.num_key_value_heads, dim, mx.float32, layer_windows(model)
    )


def assert_close(paged: mx.array, ref: mx.array) -> None:
    diff, scale = mx.abs(paged - ref).max().item(), mx.abs(ref).max().item()
    assert diff <= RTOL * max(1.0, scale), f"max |diff| {diff} at logit scale {scale}"


def run_single(model, chunks: list[int], steps: int, block_size: int) -> None:
    """Prefill in `chunks`, then greedy decode `steps` tokens; compare every pass to mlx-lm."""
    kv = paged_cache_for(model, block_size)
    tables, free = [[] for _ in kv.groups], shuffled_blocks(kv.num_blocks)
    views, ref_cache = make_paged_cache(model, kv, [tables]), make_prompt_cache(model)
    prompt, pos, token = random_tokens(sum(chunks)), 0, None  # token: the last greedy one, fed once past the prompt
    for size in chunks + [1] * steps:
        grow_tables(kv, tables, free, pos + size)
        x = mx.array([prompt[pos : pos + size]]) if pos < len(prompt) else token
        ref = model(x, cache=ref_cache)
        assert_close(model(x, cache=views), ref)
        token, pos = mx.argmax(ref[:, -1:], axis=-1), pos + size
        assert views[0].offset == pos == ref_cache[0].offset
    for spec, table in zip(kv.specs, tables, strict=True):  # the ring never outgrows ceil(W / bs) + 1 blocks
        assert len(table) == spec.blocks_needed(pos)


@pytest.mark.parametrize(
    "chunks,block_size",
    [([37], 8), ([20, 17], 8), ([5, 9, 3, 20], 4), ([1] * 12, 8), ([64], 16)],
    ids=["one_prefill", "two_chunks", "ragged_chunks", "token_by_token", "block_aligned"],
)
def test_logits_match_mlx_lm(model, chunks, block_size):
    run_single(model, chunks, steps=6, block_size=block_size)


def test_window_smaller_than_a_block_and_not_a_multiple():
    run_single(tiny_gemma3(window=5), [7, 30, 2], steps=8, block_size=4)
    run_single(tiny_gemma3(window=3), [9, 1, 5], steps=5, block_size=8)


def run_ragged(model, rounds: list[list[int]], steps: int, block_size: int = 8) -> None:
    """Sequences batched right-padded with their own offsets, each compared to its own mlx-lm run."""
    batch = len(rounds[0])
    kv = paged_cache_for(model, block_size, num_blocks=160)
    tables = [[[] for _ in kv.groups] for _ in range(batch)]
    free, refs = shuffled_blocks(kv.num_blocks), [make_prompt_cache(model) for _ in range(batch)]
    prompts = [random_tokens(sum(r[b] for r in rounds), seed=b) for b in range(batch)]
    pos, next_token = [0] * batch, None  # next_token: set by each round, read once a row is past its prompt
    for num_new in rounds + [[1] * batch] * steps:
        rows = [prompts[b][pos[b] : pos[b] + n] or [int(next_token[b])] for b, n in enumerate(num_new)]
        for b in range(batch):
            grow_tables(kv, tables[b], free, pos[b] + num_new[b])
        width = max(num_new)
        padded = mx.array([row + [0] * (width - len(row)) for row in rows])
        out = model(padded, cache=make_paged_cache(model, kv, tables, offsets=pos, num_new=num_new))
        next_token = []
        for b, row in enumerate(rows):
            ref = model(mx.array([row]), cache=refs[b])
            assert_close(out[b, len(row) - 1], ref[0, -1])
            next_token.append(mx.argmax(ref[0, -1]).item())
            pos[b] += len(row)


def test_ragged_batch_prefill_then_decode(model):
    run_ragged(model, [[37, 20, 5]], steps=5)


def test_ragged_batch_mixes_prefill_chunks_with_decode():
    run_ragged(tiny_gemma3(), [[10, 3, 5], [10, 1, 1], [17, 16, 1]], steps=3)
    run_ragged(tiny_llama(), [[9, 1], [1, 30]], steps=2)


@pytest.mark.parametrize("builder", [tiny_llama, tiny_gemma3])
def test_mlx_lm_generate_step_runs_unchanged_on_views(builder):
    model = builder()
    kv = paged_cache_for(model, 8)
    tables, free = [[] for _ in kv.groups], shuffled_blocks(kv.num_blocks)
    grow_tables(kv, tables, free, 37 + 16)  # generate_step cannot grow tables: allocate up front
    prompt = mx.array(random_tokens(37))
    views = make_paged_cache(model, kv, [tables])
    paged = [t for t, _ in generate_step(prompt, model, prompt_cache=views, max_tokens=16)]
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=16)]
    assert paged == plain


def test_masks_follow_mlx_lm_caches():
    kv = PagedKVCache(2, 16, 4, 1, 8, mx.float32, [None, 6])
    full_tables, window_tables = list(range(8)), [8, 9, 10]
    views = paged_views(kv, [[full_tables, window_tables]], offsets=[20])
    full, window = KVCache(), RotatingKVCache(max_size=6)
    full.offset = window.offset = 20
    assert views[0].make_mask(1) is None and views[0].make_mask(3) == "causal"
    expected = full.make_mask(3, return_array=True, window_size=None)
    assert mx.array_equal(views[0].make_mask(3, return_array=True), expected)
    assert views[1].make_mask(1, window_size=6) is None
    expected = create_causal_mask(3, 5, window_size=6)  # 5 old keys kept, as RotatingKVCache concatenates
    assert mx.array_equal(views[1].make_mask(3, window_size=6), expected)
    assert mx.array_equal(window.make_mask(3, window_size=6), expected)


def test_ragged_mask_shape_and_padding_rows():
    kv = PagedKVCache(1, 16, 4, 1, 8, mx.float32)
    views = paged_views(kv, [[[0, 1]], [[2, 3, 4]]], offsets=[3, 9], num_new=[2, 1])
    assert isinstance(views[0].offset, mx.array) and views[0].offset.tolist() == [3, 9]
    mask = views[0].make_mask(2)
    assert mask.shape == (2, 1, 2, 12) and mask.dtype == mx.bool_
    assert mask[0, 0, 1].tolist() == [True] * 5 + [False] * 7
    assert mask[1, 0, 0].tolist() == mask[1, 0, 1].tolist() == [True] * 10 + [False] * 2


def test_a_mask_cut_short_of_the_block_padding_is_widened_with_columns_that_admit_nothing():
    """mlx-vlm's Qwen3.5 attention keeps max(offset) + L + 1 columns of its mask; the keys come in whole blocks."""
    kv = PagedKVCache(1, 16, 4, 1, 8, mx.float32)
    views = paged_views(kv, [[[0, 1]], [[2, 3, 4]]], offsets=[3, 9], num_new=[2, 1])
    mask = views[0].make_mask(2)
    keys, values = views[0].update_and_fetch(mx.zeros((2, 1, 2, 8)), mx.zeros((2, 1, 2, 8)))
    assert keys.shape[-2] == mask.shape[-1] == 12
    cut = mask[..., : 9 + 2 + 1]
    assert mx.array_equal(views[0].widened(cut, keys, values), mask)
    additive = mx.where(cut, 0.0, -1e9)
    assert mx.array_equal(views[0].widened(additive, keys, values) == 0.0, mask)
    assert views[0].widened(mask[..., :10], keys, values).shape[-1] == 12  # every row's keys kept
    assert views[0].widened(mask[..., :9], keys, values).shape[-1] == 9  # cuts a row's last key: left to fail
    assert views[0].widened(cut, mx.array(keys), values) is cut  # K/V the view did not return
    assert views[0].widened("causal", keys, values) == "causal" and views[0].widened(None, keys, values) is None


def test_decode_step_writes_pools_in_place():
    model = tiny_gemma3()
    kv = paged_cache_for(model, 8, num_blocks=16384)  # 16 MiB pools
    tables, free = [[] for _ in kv.groups], shuffled_blocks(kv.num_blocks)
    grow_tables(kv, tables, free, 37 + 1 + 2 + 30)
    views = make_paged_cache(model, kv, [tables])
    mx.eval(model(mx.array([random_tokens(37)]), cache=views), kv.keys, kv.values)
    pool_ids = [id(p) for p in kv.keys + kv.values]
    # decode; a short chunk (window layers on the paged path); a long one (window layers split)
    for tokens in ([[5]], [[6, 7]], [random_tokens(30, seed=3)]):
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(model(mx.array(tokens), cache=views), kv.keys, kv.values)
        grew = mx.get_peak_memory() - base
        assert grew < kv.keys[0].nbytes // 4, f"a step allocated {grew} bytes: a pool was copied"
    assert [id(p) for p in kv.keys + kv.values] == pool_ids


def test_rejects_tables_that_do_not_fit():
    model = tiny_gemma3()
    kv = paged_cache_for(model, 8)
    short = [[0], [1], [2]]
    with pytest.raises(ValueError, match="need"):
        model(mx.array([random_tokens(12)]), cache=make_paged_cache(model, kv, [short]))
    too_long = [[0, 1, 2], [3, 4], [5]]
    with pytest.raises(ValueError, match="at most 2"):
        model(mx.array([random_tokens(3)]), cache=make_paged_cache(model, kv, [too_long]))
    with pytest.raises(ValueError, match="layer windows"):
        make_paged_cache(tiny_llama(), kv, [short])
    with pytest.raises(ValueError, match="one per layer group"):
        paged_views(kv, [[[0]]])
    with pytest.raises(ValueError, match="num_new"):
        paged_views(kv, [short, short], offsets=[0, 0], num_new=[0, 2])


def test_layer_windows_follow_the_models_own_caches():
    assert layer_windows(tiny_llama()) == [None] * 3
    assert layer_windows(tiny_qwen3()) == [None] * 2
    assert layer_windows(tiny_hybrid_llama()) == [8, 8, None, 8]
    assert layer_windows(tiny_gemma3()) == [8, 8, None, 8, 8, None]


@pytest.mark.slow
def test_default_model_logits_match_mlx_lm(default_model):
    model, tokenizer = default_model
    prompt = tokenizer.encode(
        "Paged attention keeps the key and value cache in fixed-size blocks, so "
        "many requests can share one pool of memory without fragmentation. Explain in two "
        "short sentences why this helps a local chat server."
    )
    assert 35 <= len(prompt) <= 50  # three blocks of 16
    kv = paged_cache_for(model, 16, num_blocks=32)
    tables, free = [[]], shuffled_blocks(32, seed=7)
    views, ref_cache = make_paged_cache(model, kv, [tables]), make_prompt_cache(model)
    x = mx.array([prompt])
    for _ in range(4):  # prefill, then 3 decode steps
        grow_tables(kv, tables, free, views[0].offset + x.shape[1])
        ref = model(x, cache=ref_cache)
        assert_close(model(x, cache=views), ref)
        x = mx.argmax(ref[:, -1:], axis=-1)
    assert len(tables[0]) == 3 and tables[0] != sorted(tables[0])


def _positions_as_keys(positions: list[list[int]]) -> mx.array:
    """K/V [B, 1, L, 2] whose values are each token's position (-1: padding): what a read returns names its keys."""
    return mx.array(positions, dtype=mx.float32)[:, None, :, None] * mx.ones((1, 1, 1, 2))


def _write_positions(kv: PagedKVCache, tables, counts: list[int]) -> None:
    """Positions 0..count-1 of each row written to every layer's pages, as a prefill would."""
    width = max(counts)
    views = paged_views(kv, tables, num_new=counts)
    keys = _positions_as_keys([list(range(c)) + [-1] * (width - c) for c in counts])
    for view in views:
        view.update_and_fetch(keys, keys)
    mx.eval(kv.pools)


def _span_reference(spans, window, queries: list[list[int]], keys: mx.array, ends: list[int]) -> list:
    """The mask written out by positions: a real key (its position where a gather of every row from 0 puts it, or
    any key of a batch-1 read) not after the query and inside the window, or in the query's span."""
    out = []
    for b, row in enumerate(queries):
        positions = [int(p) for p in keys[b, 0, :, 0].tolist()]
        rows = []
        for q in row:
            span = next(((s, e) for s, e in spans[b] if s <= q < e), None)
            allowed = []
            for j, p in enumerate(positions):
                real = 0 <= p < ends[b] and (len(queries) == 1 or p == j)
                causal = p <= q and (window is None or p > q - window)
                allowed.append(real and (causal or (span is not None and span[0] <= p < span[1])))
            rows.append(allowed)
        out.append([rows])
    return out


@pytest.mark.parametrize(
    "offsets, num_new, spans",
    [
        ([5], [9], [[(7, 12)]]),  # batch 1: full layer; the window layer within its ring
        ([5], [17], [[(6, 9), (10, 20)]]),  # batch 1: the window layer reads its old keys, then the new ones
        ([3, 13], [6, 2], [[(4, 9)], []]),  # ragged: a span in one row (its last block gathered twice), padding
    ],
    ids=["exact", "exact-split", "ragged"],
)
def test_spans_attended_both_ways_see_their_later_keys_and_nothing_else_changes(offsets, num_new, spans):
    """Gemma 4's images (engine/request.py Request.both_ways): each token in a span sees every key of that span
    (after it, or out of its window); every other entry is the causal (windowed) mask, checked against the masks
    written out by position over the keys the pass returns."""
    kv = PagedKVCache(2, 40, 4, 1, 2, mx.float32, [None, 6])
    tables = [[list(range(10 * b, 10 * b + 8)), [10 * b + 8, 10 * b + 9, 30 + b]] for b in range(len(offsets))]
    _write_positions(kv, tables, offsets)
    views = paged_views(kv, tables, offsets, num_new, both_ways=spans)
    width = max(num_new)
    rows = list(zip(offsets, num_new, strict=True))
    new = _positions_as_keys([[o + i if i < n else -1 for i in range(width)] for o, n in rows])
    queries = [[o + min(i, n - 1) for i in range(width)] for o, n in rows]
    ends = [o + n for o, n in rows]
    for view, window in zip(views, (None, 6), strict=True):
        if window is not None and len(offsets) > 1:
            continue  # a window layer's ragged keys come in ring order; its batch-1 masks are the ones checked
        mask = view.make_mask(width, window_size=window)
        keys, _ = view.update_and_fetch(new, new)
        assert mask.tolist() == _span_reference(spans, window, queries, keys, ends)
    plain = paged_views(kv, tables, offsets, num_new)[0].make_mask(width, return_array=True)
    spanned = paged_views(kv, tables, offsets, num_new, both_ways=spans)[0].make_mask(width)
    if len(offsets) == 1:
        plain = plain[None, None]
    assert (spanned & ~plain).any().item()  # the spans did admit keys the causal mask does not
