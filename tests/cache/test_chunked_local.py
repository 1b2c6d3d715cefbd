"""Chunked-local attention (llama4) on pages: the spec and the view against mlx-lm's own ChunkedKVCache,
the obviously correct twin (a contiguous array trimmed to the last `chunk` tokens before each pass)."""

from __future__ import annotations

from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.specs import Chunked, ChunkedLocalSpec, SlidingWindowSpec, group_layers, sequence_capacity
from mlxpaged.errors import ConfigError

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ChunkedKVCache

HEADS, DIM = 2, 4


def _passes(cache: PagedKVCache, table: list[int], lengths: list[int], seed: int = 0):
    """Run passes of `lengths` new tokens through a paged view and an mlx-lm ChunkedKVCache side by
    side; yield (paged start, mlx-lm start, paged K/V, mlx-lm K/V) per pass."""
    mx.random.seed(seed)
    twin = ChunkedKVCache(cache.groups[0].chunk)
    offset = 0
    for n in lengths:
        keys, values = mx.random.normal((1, HEADS, n, DIM)), mx.random.normal((1, HEADS, n, DIM))
        view = paged_views(cache, [[table]], [offset], [n])[0]
        twin.maybe_trim_front()  # what llama4 does before reading start_position
        start = view.start_position
        view.maybe_trim_front()
        got = view.update_and_fetch(keys, values)
        want = twin.update_and_fetch(keys, values)
        mx.eval(got, cache.keys, cache.values)
        yield start, twin.start_position, got, want
        offset += n


def _ring(chunk: int, block_size: int) -> tuple[PagedKVCache, list[int]]:
    spec = ChunkedLocalSpec(block_size, chunk)
    cache = PagedKVCache(1, spec.max_blocks + 2, block_size, HEADS, DIM, layer_windows=[Chunked(chunk)])
    return cache, list(range(2, 2 + spec.max_blocks))  # a ring of other ids than 0..n: tables are read


@pytest.mark.parametrize(
    "lengths", [[5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [30, 1, 1, 1, 9, 1, 17, 1, 1], [8, 8, 8, 1, 7, 1]]
)
def test_view_hands_the_model_what_mlx_lm_chunked_cache_does(lengths):
    cache, table = _ring(chunk=8, block_size=8)
    for start, want_start, (k, v), (wk, wv) in _passes(cache, table, lengths):
        assert start == want_start
        assert k.shape == wk.shape and mx.array_equal(k, wk).item() and mx.array_equal(v, wv).item()


@settings(max_examples=25, deadline=None)
@given(
    chunk=st.integers(1, 20),
    block_size=st.sampled_from([4, 8, 16]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
)
def test_any_chunk_block_size_and_pass_lengths_match_mlx_lm(chunk, block_size, lengths):
    cache, table = _ring(chunk, block_size)
    for start, want_start, (k, _), (wk, _) in _passes(cache, table, lengths, seed=chunk):
        assert start == want_start and mx.array_equal(k, wk).item()


def test_spec_stores_chunk_plus_one_tokens_in_a_ring_and_shares_nothing():
    spec = ChunkedLocalSpec(8, 8)
    assert spec.max_blocks == SlidingWindowSpec(8, 9).max_blocks == 3
    assert [spec.blocks_needed(n) for n in (1, 8, 9, 17, 100, 10_000)] == [1, 1, 2, 3, 3, 3]
    assert spec.shareable_blocks(10_000) == 0
    assert [spec.key_start(o) for o in (0, 5, 8, 9, 100)] == [0, 0, 0, 1, 92]
    assert [spec.chunk_start(p) for p in (0, 7, 8, 15, 16)] == [0, 0, 8, 8, 16]
    # Blocks of finished chunks are never read again: a key at p is read only while p >= key_start.
    assert [spec.skipped_blocks(n) for n in (8, 16, 24, 25)] == [0, 1, 2, 2]
    assert sequence_capacity(3, 8, [spec.max_blocks]) is None  # a ring of 3 blocks holds any length


def test_chunked_layers_form_their_own_groups_apart_from_a_window_of_the_same_size():
    groups = group_layers([Chunked(8), 9, Chunked(8), 9, None, None])
    assert [(g.layers, g.window, g.chunk) for g in groups] == [((0, 2), 9, 8), ((1, 3), 9, None), ((4, 5), None, None)]
    assert isinstance(groups[0].spec(8), ChunkedLocalSpec) and isinstance(groups[1].spec(8), SlidingWindowSpec)
    assert groups[0].spec(8).key_start(20) == ChunkedLocalSpec(8, 8).key_start(20) == 12


def test_bad_chunk_sizes_are_refused_with_the_number():
    with pytest.raises(ConfigError, match=r"chunk.*0"):
        Chunked(0)
    with pytest.raises(ConfigError, match=r"chunk.*-3"):
        ChunkedLocalSpec(8, -3)


def test_start_position_is_one_sequences():
    cache, table = _ring(chunk=8, block_size=8)
    views = paged_views(cache, [[table], [table]], [3, 20], [1, 1])
    with pytest.raises(ValueError, match="holds 2"):
        _ = views[0].start_position
