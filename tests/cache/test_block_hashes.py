"""Each request's block hashes, computed once (cache/block_hashes.py), against a fresh chain over its tokens
(the slow twin), and the cache manager hashing each block of a request once however often it matches."""

from __future__ import annotations

import gc

from mlxpaged.cache.block_hashes import BlockHashes
from mlxpaged.cache.block_pool import sha256_block_hash
from mlxpaged.engine.request import Request
from tests.cache.kv_sequences import UNLIMITED, manager_for

from hypothesis import given, settings
from hypothesis import strategies as st

BS = 8
EXTRA = ("model", "f32")


def fresh_chain(tokens: list[int], bs: int = BS) -> list[bytes]:
    """The slow twin: every full block's chain hash, from scratch."""
    hashes: list[bytes] = []
    for i in range(len(tokens) // bs):
        hashes.append(sha256_block_hash(hashes[-1] if hashes else None, tuple(tokens[i * bs : (i + 1) * bs]), EXTRA))
    return hashes


class CountingHash:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, parent, tokens, extra):
        self.calls += 1
        return sha256_block_hash(parent, tokens, extra)


# (op, n): append n output tokens, drop n output tokens, or ask for the first n blocks' hashes (or those from
# block n on).
OPS = st.lists(st.tuples(st.sampled_from(["append", "drop", "first", "iter"]), st.integers(0, 9)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=40), ops=OPS, max_recent=st.sampled_from([1, 3, 1000]))
def test_kept_hashes_are_always_the_fresh_chain_of_the_tokens_now(prompt, ops, max_recent):
    """Tokens from a tiny alphabet, so blocks repeat and the hashes kept across requests are hit (and emptied
    when `max_recent` is small); a second request on the same tokens reads them."""
    hashes = BlockHashes(BS, sha256_block_hash, EXTRA, max_recent=max_recent)
    request = Request("r", prompt, UNLIMITED)
    for step, (op, n) in enumerate(ops):
        want = fresh_chain(request.all_token_ids)
        if op == "append":  # different tokens from those a drop took: a stale hash would show
            request.output_token_ids.extend((step + j) % 4 for j in range(n))
        elif op == "drop":  # as Scheduler.drop_last_outputs does
            del request.output_token_ids[len(request.output_token_ids) - min(n, len(request.output_token_ids)) :]
            hashes.trim(request)
        elif op == "iter":  # from block n on, as the lower tier's match and cache_blocks ask
            assert list(hashes.iter(request, n)) == want[n:]
        else:
            assert hashes.first(request, n) == want[:n]
    assert hashes.first(request, request.num_tokens) == fresh_chain(request.all_token_ids)
    again = Request("again", request.all_token_ids, UNLIMITED)
    assert hashes.first(again, again.num_tokens) == fresh_chain(again.all_token_ids)


def test_each_block_is_hashed_once_however_often_it_is_matched():
    """A waiting request is matched by loading, can_allocate and allocate, step after step; then its
    computed blocks are cached: every full block hashed once in all."""
    spy = CountingHash()
    manager = manager_for(64, BS, hash_fn=spy, extra_key=EXTRA)
    first = Request("a", list(range(10 * BS + 2)), UNLIMITED)
    manager.allocate(first)
    first.num_computed_tokens = first.num_tokens
    manager.cache_blocks(first)
    manager.free("a")  # its partial block stays findable too
    assert spy.calls == 10
    follow_up = Request("b", first.all_token_ids + [7] * (3 * BS), UNLIMITED)
    spy.calls = 0
    for _ in range(3):  # three steps of waiting
        assert manager.can_allocate(follow_up)
        assert not manager.loading(follow_up)
    allocation = manager.allocate(follow_up)
    assert allocation.num_cached_tokens == 10 * BS + 2  # the full blocks, then the partial one's 2 tokens
    follow_up.num_computed_tokens = follow_up.num_tokens
    manager.cache_blocks(follow_up)
    assert spy.calls == 3  # its full blocks after the first request's 10 (their hashes are known), once each
    assert manager.hashes.first(follow_up, 13) == fresh_chain(follow_up.all_token_ids)


def test_a_miss_stops_the_hashing():
    """A cold prompt's match hashes its first block only (the first miss): the rest wait for cache_blocks."""
    spy = CountingHash()
    manager = manager_for(64, BS, hash_fn=spy, extra_key=EXTRA)
    assert manager.can_allocate(Request("cold", list(range(20 * BS)), UNLIMITED))
    assert spy.calls == 1


def test_a_request_that_goes_away_takes_its_hashes_with_it():
    hashes = BlockHashes(BS, sha256_block_hash, EXTRA)
    request = Request("r", list(range(5 * BS)), UNLIMITED)
    assert len(hashes.first(request, 5)) == 5
    del request
    gc.collect()
    assert len(hashes._memo) == 0
