"""Cache manager over the block pool: unit tests per method (state machine: test_kv_cache_manager_machine.py).

`Sequences` (tests/cache/kv_sequences.py) plays the scheduler's part: it owns each sequence's Request (its
tokens and computed count) and calls the manager as the scheduler does.
"""

from mlxpaged.cache.block_pool import BlockPool, NoFreeBlocksError, sha256_block_hash
from mlxpaged.cache.kv_cache_manager import CopyOnWrite, KVCacheManager, UnknownRequestError
from mlxpaged.cache.specs import FullAttentionSpec, SlidingWindowSpec, sequence_capacity, table_lengths
from mlxpaged.config import CacheConfig
from tests.cache.kv_sequences import BS, Sequences, computed_pool, manager_for, pool_of, prompt

import pytest

# ---- construction -------------------------------------------------------------------


@pytest.mark.parametrize("bs", [8, 16, 32])
def test_valid_block_sizes(bs):
    pool = pool_of(4, bs)
    assert pool.block_size == bs and pool.num_free_blocks == 4


def test_default_block_size_is_16():
    assert CacheConfig().block_size == 16


@pytest.mark.parametrize("num_blocks, bs, needle", [(4, 12, "12"), (0, 16, "0"), (-3, 8, "-3")])
def test_constructor_validation_names_the_numbers(num_blocks, bs, needle):
    with pytest.raises(ValueError, match=needle):
        pool_of(num_blocks, bs)


# ---- allocate / can_allocate ----------------------------------------------------------


def test_allocate_fresh_prompt():
    pool = pool_of(8, BS)
    alloc = pool.allocate("a", prompt(20))
    assert alloc.num_cached_tokens == 0
    assert len(alloc.block_tables[0]) == 3 == len(set(alloc.block_tables[0]))
    assert pool.block_tables("a") == alloc.block_tables
    assert pool.num_tokens("a") == 20 and pool.token_ids("a") == prompt(20)
    assert pool.num_free_blocks == 5 and "a" in pool


def test_allocate_reserves_new_slots():
    pool = pool_of(8, BS)
    assert len(pool.allocate("a", prompt(8), num_new_slots=1).block_tables[0]) == 2
    assert len(pool.allocate("b", prompt(7), num_new_slots=1).block_tables[0]) == 1
    # The reserved slot is used by the next append without taking a block.
    pool.append_slot("b", 99)
    assert pool.slots_for("b", 7, 8) == [pool.block_tables("b")[0][0] * BS + 7]
    assert pool.num_free_blocks == 5


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"token_ids": []}, "empty"),
        ({"token_ids": [1], "num_new_slots": -1}, "-1"),
    ],
)
def test_allocate_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        pool_of(4, BS).allocate("a", **kwargs)


def test_allocate_duplicate_request_id():
    pool = pool_of(4, BS)
    pool.allocate("a", [1])
    with pytest.raises(ValueError, match="already"):
        pool.allocate("a", [1])


def test_allocate_exhausted_is_atomic_and_carries_numbers():
    pool = pool_of(4, BS)
    computed_pool(pool, "a", prompt(17))  # 3 blocks, 2 of them cached when freed
    pool.free("a")
    before = (pool.block_state(), pool.stats())
    assert not pool.can_allocate(prompt(17) + prompt(24, 100))
    with pytest.raises(NoFreeBlocksError) as err:
        pool.allocate("b", prompt(17) + prompt(24, 100))  # 2 hits + 4 new, 2 free besides hits
    assert (err.value.needed, err.value.available, err.value.total) == (4, 2, 4)
    assert "4" in str(err.value)
    assert (pool.block_state(), pool.stats()) == before and "b" not in pool


def test_can_allocate_counts_prefix_hits_and_evictable_blocks():
    pool = pool_of(4, BS)
    computed_pool(pool, "a", prompt(24))
    pool.allocate("x", [7])  # 4th block
    assert pool.num_free_blocks == 0
    # 24 tokens -> 2 full hits (the last block is recomputed) + 1 new: nothing free.
    assert not pool.can_allocate(prompt(24))
    pool.free("x")
    assert pool.can_allocate(prompt(24))  # the hits are owned by "a", the new one is free
    assert not pool.can_allocate(prompt(40))
    pool.free("a")  # now all 3 of a's blocks are evictable, plus x's free block
    assert pool.num_free_blocks == 4
    assert pool.can_allocate(prompt(24) + prompt(8, 50))  # 2 hits + 2 new of 4
    assert not pool.can_allocate(prompt(24) + prompt(17, 50))  # 2 hits + 3 new > 2 left


# ---- prefix cache ---------------------------------------------------------------------


def test_prefix_hit_shares_full_blocks_only_after_computed():
    pool = pool_of(16, BS)
    pool.allocate("a", prompt(20))
    assert pool.lookup_prefix(prompt(20)) == 0  # KV not written yet: no hit
    pool.mark_computed("a", 10)
    assert pool.lookup_prefix(prompt(20)) == 8
    pool.mark_computed("a", 20)
    alloc = pool.allocate("b", [*prompt(16), 500, 501])
    assert alloc.num_cached_tokens == 16
    assert alloc.block_tables[0][:2] == pool.block_tables("a")[0][:2]
    assert alloc.block_tables[0][2] != pool.block_tables("a")[0][2]
    assert [pool.ref_count(b) for b in alloc.block_tables[0]] == [2, 2, 1]
    assert pool.num_computed_tokens("b") == 16


def test_fully_cached_prompt_recomputes_last_block():
    pool = pool_of(16, BS)
    computed_pool(pool, "a", prompt(24))
    alloc = pool.allocate("b", prompt(24))
    assert alloc.num_cached_tokens == 16  # never the whole prompt
    assert alloc.block_tables[0][2] != pool.block_tables("a")[0][2]
    assert pool.allocate("c", prompt(17)).num_cached_tokens == 16
    assert pool.allocate("d", prompt(16)).num_cached_tokens == 8


def test_generated_tokens_become_cacheable():
    pool = pool_of(16, BS)
    computed_pool(pool, "a", prompt(6))
    for i, tok in enumerate([60, 61, 62, 63]):
        pool.append_slot("a", tok)
        pool.mark_computed("a", 7 + i)
    assert pool.lookup_prefix([*prompt(6), 60, 61, 62]) == 8
    assert pool.lookup_prefix([*prompt(6), 60, 99, 62]) == 0


def test_prefix_cache_disabled():
    pool = pool_of(8, BS, enable_prefix_cache=False)
    computed_pool(pool, "a", prompt(24))
    assert pool.allocate("b", prompt(24)).num_cached_tokens == 0
    pool.free("a")
    assert set(pool.block_state()) == {"free", "owned"}
    assert pool.stats().prefix_queries == 0


def test_free_keeps_cached_blocks_findable_and_reusable():
    pool = pool_of(8, BS)
    computed_pool(pool, "a", prompt(20))
    table = pool.block_tables("a")[0]
    pool.free("a")
    assert pool.block_state()[table[0]] == "cached" and pool.block_state()[table[2]] == "free"
    alloc = pool.allocate("b", prompt(20))
    # Two full blocks and 3 of the partial block's 4 tokens (the last token always runs).
    assert alloc.num_cached_tokens == 19 and alloc.block_tables[0] == table
    assert pool.stats().num_cached_free == 0  # touching took them out of the free queue


def test_hash_chains_parent_and_extra_key():
    h0 = sha256_block_hash(None, (1, 2), None)
    assert h0 == sha256_block_hash(None, (1, 2), None) and isinstance(h0, bytes)
    assert h0 != sha256_block_hash(h0, (1, 2), None)
    assert h0 != sha256_block_hash(None, (1, 2), "other-model")
    assert h0 != sha256_block_hash(None, (12,), None)


def test_extra_key_is_passed_to_hash_fn():
    seen = []

    def spy(parent, tokens, extra):
        seen.append(extra)
        return sha256_block_hash(parent, tokens, extra)

    pool = pool_of(4, BS, extra_key=("smollm2", "f32"), hash_fn=spy)
    computed_pool(pool, "a", prompt(9))
    assert seen and set(seen) == {("smollm2", "f32")}


def test_a_block_is_found_by_its_chained_hash_alone():
    """vLLM v1's scheme: the hash names the whole prefix, and nothing else is compared."""
    a, b, c = [1] * BS, [2] * BS, [3] * BS
    collide = pool_of(8, BS, hash_fn=lambda parent, tokens, extra: 0)
    computed_pool(collide, "x", a + b + [0])
    assert collide.lookup_prefix(c + c + [0]) == 16  # so a colliding hash function would be wrong
    pool = pool_of(32, BS)
    computed_pool(pool, "x", a + b + [0])
    assert pool.lookup_prefix(c + b + [0]) == 0  # b under a different parent
    assert pool.lookup_prefix([*b, 0]) == 0  # b at the root
    assert pool.lookup_prefix(a + c + [0]) == 8
    assert pool.lookup_prefix(a + b + [0]) == 16
    computed_pool(pool, "y", c + b + [0])
    assert pool.allocate("z", c + b + [5]).block_tables[0][:2] == pool.block_tables("y")[0][:2]
    assert pool.allocate("w", a + b + [5]).block_tables[0][:2] == pool.block_tables("x")[0][:2]


def test_duplicate_chains_stay_reachable_after_one_copy_is_evicted():
    pool = pool_of(6, BS)
    pool.allocate("a", prompt(17))
    pool.allocate("b", prompt(17))  # same prompt, nothing computed yet: no sharing
    pool.mark_computed("a", 17)
    pool.mark_computed("b", 17)
    pool.free("a")
    pool.free("b")  # queue (LRU first): a2 a1 a0 b2 b1 b0; a2, b2 are partial -> free list
    pool.allocate("fill", prompt(32, 1000))  # 2 free + evicts a1, a0
    assert pool.stats().evictions == 2
    assert pool.lookup_prefix(prompt(17)) == 16  # b's copy of the chain still matches


def test_reset_prefix_cache():
    pool = pool_of(8, BS)
    computed_pool(pool, "a", prompt(17))
    computed_pool(pool, "b", prompt(17, 100))
    pool.free("a")
    pool.reset_prefix_cache()
    assert pool.lookup_prefix(prompt(17)) == 0 and pool.lookup_prefix(prompt(17, 100)) == 0
    assert "cached" not in pool.block_state() and pool.num_free_blocks == 5
    for i in range(7):  # b's second block fills up; it must not be registered as a root
        pool.append_slot("b", 117 + i)
        pool.mark_computed("b", 18 + i)
    assert pool.lookup_prefix([*pool.token_ids("b")[16:24], 0]) == 0
    assert pool.lookup_prefix(prompt(17, 100)) == 0
    computed_pool(pool, "c", prompt(17))
    assert pool.lookup_prefix(prompt(17)) == 16  # new requests cache again


# ---- eviction order -------------------------------------------------------------------


def test_eviction_is_lru_and_tail_before_head():
    pool = pool_of(6, BS)
    computed_pool(pool, "old", prompt(24))  # 3 full blocks: chain o0 -> o1 -> o2
    computed_pool(pool, "new", prompt(24, 100))  # n0 -> n1 -> n2
    old, new = pool.block_tables("old")[0], pool.block_tables("new")[0]
    pool.free("old")
    pool.free("new")
    evicted = []
    for i in range(6):
        before = pool.block_state()
        pool.allocate(f"f{i}", [9000 + i])
        evicted += [b for b, s in enumerate(pool.block_state()) if s == "owned" != before[b]]
    assert evicted == old[::-1] + new[::-1]
    assert pool.stats().evictions == 6


def test_prefix_hit_refreshes_lru_position():
    pool = pool_of(4, BS)
    computed_pool(pool, "a", prompt(9))  # a0 cached, a1 partial
    computed_pool(pool, "b", prompt(9, 100))
    a0, b0 = pool.block_tables("a")[0][0], pool.block_tables("b")[0][0]
    pool.free("a")
    pool.free("b")
    pool.allocate("hit", prompt(9))  # touches a0, so it becomes the most recently used
    pool.free("hit")
    pool.allocate("x", prompt(24, 500))  # 2 free + evicts 1 cached (b0, the LRU one)
    assert pool.block_state()[a0] == "cached" and pool.block_state()[b0] == "owned"


def test_uncached_free_blocks_are_used_before_evicting():
    pool = pool_of(3, BS)
    computed_pool(pool, "a", prompt(16))
    pool.free("a")
    pool.allocate("b", [1])
    assert pool.stats().evictions == 0 and pool.stats().num_cached_free == 2


# ---- append_slot / slots_for / mark_computed --------------------------------------------


def test_append_slot_slots_and_new_blocks():
    pool = pool_of(4, BS)
    pool.allocate("a", prompt(7))
    (b0,) = pool.block_tables("a")[0]
    pool.append_slot("a", 7)
    assert pool.block_tables("a")[0] == [b0] and pool.num_free_blocks == 3
    pool.append_slot("a", 8)
    b1 = pool.block_tables("a")[0][1]
    assert pool.num_tokens("a") == 9
    assert pool.slots_for("a", 6, 9) == [b0 * BS + 6, b0 * BS + 7, b1 * BS]
    assert pool.slots_for("a", 3, 3) == []


def test_ensure_slots_grows_as_allocate_slots_does_and_tables_come_back_fresh():
    """The scheduler's ensure_slots is allocate_slots without the tables: the same blocks, taken only when a
    table must grow; block_tables answers with lists of its own (a caller's change cannot reach the next answer)."""
    pools = [pool_of(12, BS, enable_prefix_cache=False, group_max_blocks=(None, 2)) for _ in range(2)]
    for pool in pools:
        pool.allocate("a", prompt(BS - 1))
    for n in range(BS, 3 * BS + 2):
        grown = pools[0].manager.allocate_slots(pools[0].request("a"), n)
        pools[1].manager.ensure_slots(pools[1].request("a"), n)
        assert pools[1].block_tables("a") == grown and pools[1].num_free_blocks == pools[0].num_free_blocks
    tables = pools[1].block_tables("a")
    tables[0].append(99)
    tables[1].clear()
    assert pools[1].block_tables("a") == grown == pools[1].manager.read_block_tables("a")
    with pytest.raises(NoFreeBlocksError):
        pools[1].manager.ensure_slots(pools[1].request("a"), 13 * BS)
    assert pools[1].block_tables("a") == grown and pools[1].num_free_blocks == pools[0].num_free_blocks


def test_append_slot_exhausted():
    pool = pool_of(1, BS)
    pool.allocate("a", prompt(8))
    with pytest.raises(NoFreeBlocksError) as err:
        pool.append_slot("a", 1)
    assert (err.value.needed, err.value.available, err.value.total) == (1, 0, 1)
    assert pool.num_tokens("a") == 8


@pytest.mark.parametrize("start, end", [(-1, 2), (2, 1), (0, 6)])
def test_slots_for_range_errors(start, end):
    pool = pool_of(4, BS)
    pool.allocate("a", prompt(5))
    with pytest.raises(ValueError, match="outside"):
        pool.slots_for("a", start, end)


def test_mark_computed_validation():
    pool = pool_of(4, BS)
    pool.allocate("a", prompt(17))
    pool.mark_computed("a", 9)  # one full block cached: the computed count cannot fall below it
    for bad in (7, 18):
        with pytest.raises(ValueError, match=f"{bad} computed tokens must be within 8..17"):
            pool.mark_computed("a", bad)
    assert pool.num_computed_tokens("a") == 9


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.free("nope"),
        lambda p: p.block_tables("nope")[0],
        lambda p: p.append_slot("nope", 1),
        lambda p: p.fork("nope", "c"),
        lambda p: p.slots_for("nope", 0, 0),
        lambda p: p.mark_computed("nope", 0),
        lambda p: p.reserve_next_slot("nope"),
    ],
)
def test_unknown_request(call):
    with pytest.raises(UnknownRequestError):
        call(pool_of(2, BS))


# ---- fork -------------------------------------------------------------------------------


def test_fork_partial_last_block_is_copied():
    pool = pool_of(8, BS)
    computed_pool(pool, "p", prompt(11))
    copies = pool.fork("p", "c")
    p, c = pool.block_tables("p")[0], pool.block_tables("c")[0]
    assert c[0] == p[0] and c[1] != p[1]
    assert copies == [CopyOnWrite(src_block=p[1], dst_block=c[1], num_tokens=3)]
    assert pool.ref_count(p[0]) == 2 and pool.block_state()[p[0]] == "shared"
    assert pool.token_ids("c") == prompt(11) and pool.num_computed_tokens("c") == 11
    pool.append_slot("c", 1)
    pool.append_slot("p", 2)
    assert pool.slots_for("c", 11, 12) == [c[1] * BS + 3] and pool.slots_for("p", 11, 12) == [p[1] * BS + 3]


def test_fork_full_last_block_is_shared_and_appends_get_new_blocks():
    pool = pool_of(8, BS)
    computed_pool(pool, "p", prompt(16))
    assert pool.fork("p", "c") == []
    assert pool.block_tables("c") == pool.block_tables("p")
    pool.append_slot("p", 1)
    pool.append_slot("c", 1)
    (slot_p,), (slot_c,) = pool.slots_for("p", 16, 17), pool.slots_for("c", 16, 17)
    assert slot_p // BS != slot_c // BS
    assert slot_p // BS not in pool.block_tables("c")[0][:2]


def test_fork_uncomputed_full_block_is_not_shared():
    pool = pool_of(8, BS)
    pool.allocate("p", prompt(16))
    pool.mark_computed("p", 12)
    (cow,) = pool.fork("p", "c")
    assert pool.block_tables("c")[0][0] == pool.block_tables("p")[0][0]
    assert cow.num_tokens == 4 and cow.dst_block == pool.block_tables("c")[0][1]


def test_fork_errors_are_atomic():
    pool = pool_of(2, BS)
    computed_pool(pool, "p", prompt(3))
    pool.allocate("q", [1])
    with pytest.raises(ValueError, match="already"):
        pool.fork("p", "q")
    before = pool.block_state()
    with pytest.raises(NoFreeBlocksError):
        pool.fork("p", "c")
    assert pool.block_state() == before and "c" not in pool


# ---- layer groups: one table per group, window groups as rings ----------------------------


def test_hybrid_tables_grow_and_rings_wrap():
    pool = pool_of(16, BS, enable_prefix_cache=False, group_max_blocks=(None, 2))
    alloc = pool.allocate("a", prompt(20))
    assert [len(t) for t in alloc.block_tables] == [3, 2] and pool.num_free_blocks == 11
    full, ring = alloc.block_tables
    assert not set(full) & set(ring)  # one block-id space
    for tok in range(20, 41):
        pool.append_slot("a", tok)
    assert [len(t) for t in pool.block_tables("a")] == [6, 2] and pool.num_free_blocks == 8
    assert pool.block_tables("a")[1] == ring  # no new blocks: the ring is reused
    # Logical block b of the ring lives in ring[b % 2]: position 40 (block 5) in ring[1].
    assert pool.slots_for("a", 40, 41, group=1) == [ring[1] * BS]
    assert pool.slots_for("a", 16, 17, group=1) == pool.slots_for("a", 0, 1, group=1) == [ring[0] * BS]
    pool.free("a")
    assert pool.num_free_blocks == 16


def test_hybrid_append_needing_blocks_in_several_tables_is_atomic():
    pool = pool_of(4, BS, enable_prefix_cache=False, group_max_blocks=(None, 3))
    pool.allocate("a", prompt(8))  # one block per table
    pool.allocate("x", [1, 2, 3])  # the other two
    with pytest.raises(NoFreeBlocksError) as err:
        pool.append_slot("a", 9)  # both of a's tables end at token 8
    assert (err.value.needed, err.value.available) == (2, 0)
    assert pool.num_tokens("a") == 8 and [len(t) for t in pool.block_tables("a")] == [1, 1]
    pool.free("x")
    pool.append_slot("a", 9)
    assert [len(t) for t in pool.block_tables("a")] == [2, 2] and pool.num_free_blocks == 0


def test_hybrid_fork_shares_full_blocks_and_copies_rings():
    pool = pool_of(32, BS, enable_prefix_cache=False, group_max_blocks=(2, None))
    computed_pool(pool, "p", prompt(27))  # 3 full blocks + 3 tokens; the ring of 2 has wrapped
    copies = pool.fork("p", "c")
    (p_ring, p_full), (c_ring, c_full) = pool.block_tables("p"), pool.block_tables("c")
    assert c_full[:3] == p_full[:3] and c_full[3] != p_full[3]
    assert not set(c_ring) & set(p_ring)
    assert copies == [
        CopyOnWrite(p_ring[0], c_ring[0], BS),
        CopyOnWrite(p_ring[1], c_ring[1], BS),
        CopyOnWrite(p_full[3], c_full[3], 3),
    ]
    assert pool.ref_count(p_full[0]) == 2 and all(pool.ref_count(b) == 1 for b in p_ring + c_ring)
    short = pool_of(8, BS, enable_prefix_cache=False, group_max_blocks=(3, None))
    computed_pool(short, "p", prompt(5))  # one ring block holds KV: one copy
    assert len([c for c in short.fork("p", "c") if c.num_tokens == BS]) == 1


def test_prefix_cache_needs_a_single_full_table():
    with pytest.raises(ValueError, match="prefix cache needs one full-attention table"):
        pool_of(8, BS, group_max_blocks=(None, 2))
    with pytest.raises(ValueError, match="prefix cache"):
        pool_of(8, BS, group_max_blocks=(2,))
    with pytest.raises(ValueError, match="at least one layer group spec"):
        KVCacheManager(BlockPool(8), [], enable_prefix_cache=False)
    with pytest.raises(ValueError, match=r"the same for every group, got \[8, 16\]"):
        KVCacheManager(BlockPool(8), [FullAttentionSpec(8), FullAttentionSpec(16)], enable_prefix_cache=False)
    for bad in [{"window": 0}, {"window": 1.5}, {"window": True}, {"block_size": -8}]:
        with pytest.raises(ValueError, match="positive integers"):
            SlidingWindowSpec(**{"block_size": BS, "window": 8, **bad})


@pytest.mark.parametrize(
    "num_blocks, groups, capacity",
    [
        (10, (None,), 80),  # the dense case: every block holds block_size tokens of the sequence
        (10, (None, 2), 64),  # n + min(n, 2) <= 10: n = 8
        (5, (None, 3), 16),  # n + min(n, 3) <= 5: n = 2, before the ring is full
        (10, (3, None, 2), 40),  # n + 5 <= 10
        (5, (3, 2), None),  # rings only, and they fit: any length
        (4, (3, 2), 16),  # rings only, too few blocks for both: 2 + 2 <= 4
    ],
)
def test_capacity_is_the_longest_sequence_that_fits(num_blocks, groups, capacity):
    assert sequence_capacity(num_blocks, BS, groups) == capacity
    if capacity is not None:
        assert sum(table_lengths(capacity, BS, groups)) <= num_blocks
        assert sum(table_lengths(capacity + 1, BS, groups)) > num_blocks


# ---- stats / block_state ------------------------------------------------------------------


def test_stats_and_block_state():
    pool = pool_of(8, BS)
    computed_pool(pool, "a", prompt(20))
    pool.allocate("b", prompt(20))  # 16 of 20 tokens hit
    pool.free("a")
    s = pool.stats()
    assert (s.num_blocks, s.num_owned, s.num_cached_free, s.num_free) == (8, 3, 0, 5)
    assert (s.prefix_queries, s.query_tokens, s.hit_tokens) == (2, 40, 16)
    assert s.hit_rate == pytest.approx(0.4) and s.evictions == 0
    pool.free("b")
    states = pool.block_state()
    assert states.count("cached") == 2 and states.count("free") == 6
    assert pool_of(1).stats().hit_rate == 0.0


def test_reserve_next_slot_is_the_slot_append_slot_fills():
    """A pipelined step writes the next token's KV before its id is known: the reserved slot must
    be the one append_slot gives that token later, and no block may be taken twice."""
    pool = pool_of(7, BS, enable_prefix_cache=False, group_max_blocks=(None, 2))
    pool.allocate("a", prompt(2 * BS))  # both tables exactly full
    tables = pool.reserve_next_slot("a")
    assert [len(t) for t in tables] == [3, 2]  # the full table grew, the full ring wraps
    assert pool.num_tokens("a") == 2 * BS and pool.num_free_blocks == 2
    assert pool.reserve_next_slot("a") == tables  # idempotent until the token is appended
    pool.append_slot("a", 7)
    assert pool.block_tables("a") == tables and pool.num_free_blocks == 2
    assert pool.slots_for("a", 2 * BS, 2 * BS + 1) == [tables[0][2] * BS]
    pool.allocate("x", prompt(BS))  # one block per table: the pool is now empty
    for tok in range(BS - 1):
        pool.append_slot("a", tok)
    with pytest.raises(NoFreeBlocksError):
        pool.reserve_next_slot("a")  # position 3 * BS needs a fourth block in the full table
    assert pool.block_tables("a") == tables and pool.num_tokens("a") == 3 * BS
    pool.free("a")
    pool.free("x")
    assert pool.num_free_blocks == 7


# ---- free_slots_after (speculative rollback) ---------------------------------------------


def test_free_slots_after_gives_back_the_blocks_past_the_kept_tokens():
    seqs = Sequences(manager_for(8, BS))
    seqs.allocate("a", prompt(10))
    request = seqs.request("a")
    tables = seqs.manager.allocate_slots(request, 10 + 13)  # drafts up to position 22: 3 blocks
    assert len(tables[0]) == 3 and seqs.num_free_blocks == 5
    seqs.mark_computed("a", 10)
    seqs.manager.free_slots_after(request, 11)  # one draft kept: 11 tokens need 2 blocks
    assert seqs.block_tables("a")[0] == tables[0][:2] and seqs.num_free_blocks == 6
    seqs.manager.free_slots_after(request, 11)  # nothing more to give
    assert seqs.num_free_blocks == 6


def test_free_slots_after_refuses_to_cut_computed_kv_or_a_ring():
    seqs = Sequences(manager_for(8, BS))
    seqs.allocate("a", prompt(10))
    seqs.mark_computed("a", 10)
    with pytest.raises(ValueError, match="below its 10 computed tokens"):
        seqs.manager.free_slots_after(seqs.request("a"), 9)
    rings = Sequences(manager_for(8, BS, groups=(None, 2), prefix_cache=False))
    rings.allocate("b", prompt(10))
    with pytest.raises(ValueError, match="ring"):
        rings.manager.free_slots_after(rings.request("b"), 10)
