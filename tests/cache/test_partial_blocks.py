"""A freed request's partly computed last block is taken over by a prompt that extends it, and only
while it waits unused in the free list (the state machine in test_kv_cache_manager_machine.py checks
that taken-over slots hold the right KV under random workloads)."""

from tests.cache.kv_sequences import BS, computed_pool, pool_of, prompt


def freed_after_prefill(tokens, num_blocks=8, **kwargs):
    pool = pool_of(num_blocks, BS, **kwargs)
    computed_pool(pool, "a", tokens)
    table = pool.block_tables("a")[0]
    pool.free("a")
    return pool, table


def test_a_longer_prompt_takes_the_partial_block_over():
    pool, table = freed_after_prefill(prompt(20))  # 2 full blocks of 8, 4 tokens in the third
    alloc = pool.allocate("b", prompt(30))
    assert alloc.num_cached_tokens == 20 and alloc.block_tables[0][:3] == table
    assert pool.ref_count(table[2]) == 1 and pool.block_state()[table[2]] == "owned"
    assert pool.stats().hit_tokens == 20


def test_only_the_tokens_both_prompts_share_are_taken():
    pool, table = freed_after_prefill(prompt(20))
    diverging = [*prompt(18), 99, 100, 101]
    assert pool.lookup_prefix(diverging) == 18
    alloc = pool.allocate("b", diverging)
    assert alloc.num_cached_tokens == 18 and alloc.block_tables[0][2] == table[2]


def test_a_prompt_after_other_full_blocks_does_not_match():
    pool, _ = freed_after_prefill(prompt(20))
    assert pool.allocate("b", prompt(16, start=100) + prompt(4, start=16) + [7]).num_cached_tokens == 0


def test_a_partial_block_handed_out_for_other_work_is_forgotten():
    pool, table = freed_after_prefill(prompt(20), num_blocks=4)
    pool.allocate("other", prompt(9, start=500))  # takes both free blocks, the partial one among them
    assert table[2] in pool.block_tables("other")[0]
    pool.free("other")
    assert pool.lookup_prefix(prompt(30)) == 16


def test_reset_and_a_cache_off_forget_partial_blocks():
    pool, _ = freed_after_prefill(prompt(20))
    pool.reset_prefix_cache()
    assert pool.lookup_prefix(prompt(30)) == 0
    off, _ = freed_after_prefill(prompt(20), enable_prefix_cache=False)
    assert off.allocate("b", prompt(30)).num_cached_tokens == 0


def test_a_decoded_tail_is_kept_up_to_its_computed_tokens():
    pool = pool_of(8, BS)
    computed_pool(pool, "a", prompt(10))
    pool.append_slot("a", 10)  # a sampled token whose KV is not computed yet
    pool.free("a")
    assert pool.lookup_prefix(prompt(12)) == 10
