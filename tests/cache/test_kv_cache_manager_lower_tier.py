"""The cache manager with a lower tier (the disk tier's part, plain Python): blocks after the pool's hits that
the tier holds are loaded into the request's first fresh blocks and count as cached; a failed load falls back to
prefill; the pool's own hits still come first. The tier here is a dict by hash that records what it loaded.
With a state model's prefix filter, the run ends at the last resume point (a checkpoint in RAM or below) that
could be made ready, over the pool's hits and the tier's blocks together, before any block is taken."""

from tests.cache.kv_sequences import BS, Sequences, manager_for, prompt

import pytest


class DictTier:
    def __init__(self, hashes=(), fail_after=None):
        self.hashes, self.fail_after, self.loads = set(hashes), fail_after, []

    def contains(self, block_hash):
        return block_hash in self.hashes

    def prefetch(self, key, block_hashes):
        return True  # read at once (the engine's tier reads in the background: tests/engine/test_disk_loads.py)

    def forget(self, key):
        pass

    def read(self, block_hashes, key=None):
        n = len(block_hashes) if self.fail_after is None else min(self.fail_after, len(block_hashes))
        return [("page", h) for h in block_hashes[:n]]

    def write(self, block_ids, block_hashes, pages):
        assert pages == [("page", h) for h in block_hashes]  # what read returned, for the same blocks
        self.loads.append((list(block_ids), list(block_hashes)))


def chain(manager, tokens, n):
    hashes, parent = [], None
    for i in range(n):
        parent = manager.hash_fn(parent, tuple(tokens[i * BS : (i + 1) * BS]), manager.extra_key)
        hashes.append(parent)
    return hashes


def test_blocks_found_below_are_loaded_and_count_as_cached():
    tokens = prompt(5 * BS + 3)
    probe = manager_for(16, BS)
    tier = DictTier(chain(probe, tokens, 4))  # 4 of the 5 full blocks
    seqs = Sequences(manager_for(16, BS, lower_tier=tier))
    alloc = seqs.allocate("a", tokens)
    assert alloc.num_cached_tokens == 4 * BS and alloc.num_lower_tier_tokens == 4 * BS
    ((ids, hashes),) = tier.loads
    assert ids == alloc.block_tables[0][:4] and hashes == chain(probe, tokens, 4)
    assert all(seqs.pool.blocks[b].block_hash == h for b, h in zip(ids, hashes, strict=True))  # now RAM hits too
    assert alloc.last_block_hash == hashes[-1]
    # A second request finds them in the pool: nothing more is loaded.
    assert seqs.allocate("b", tokens).num_cached_tokens == 4 * BS and len(tier.loads) == 1


def test_the_pools_hits_come_first_and_the_tier_continues_the_chain():
    tokens = prompt(6 * BS + 1)
    seqs = Sequences(manager_for(32, BS, lower_tier=DictTier()))
    seqs.allocate("a", tokens[: 2 * BS + 1])
    seqs.mark_computed("a", 2 * BS + 1)
    seqs.manager.lower_tier = tier = DictTier(chain(seqs.manager, tokens, 6))
    alloc = seqs.allocate("b", tokens)
    assert alloc.num_cached_tokens == 6 * BS and alloc.num_lower_tier_tokens == 4 * BS
    assert tier.loads[0][1] == chain(seqs.manager, tokens, 6)[2:]


@pytest.mark.parametrize("fail_after", [0, 2])
def test_a_load_that_stops_early_leaves_the_rest_to_prefill(fail_after):
    tokens = prompt(5 * BS + 3)
    probe = manager_for(16, BS)
    seqs = Sequences(manager_for(16, BS, lower_tier=DictTier(chain(probe, tokens, 5), fail_after=fail_after)))
    alloc = seqs.allocate("a", tokens)
    assert alloc.num_cached_tokens == fail_after * BS
    table = alloc.block_tables[0]
    assert [seqs.pool.blocks[b].block_hash is not None for b in table] == [True] * fail_after + [False] * (
        len(table) - fail_after
    )
    seqs.mark_computed("a", len(tokens))  # the prefilled rest is cached as usual
    assert seqs.allocate("b", tokens).num_cached_tokens == 5 * BS


def test_never_the_last_token_and_never_without_the_prefix_cache():
    tokens = prompt(3 * BS)  # the third block holds the last token: only two may come from below
    probe = manager_for(8, BS)
    tier = DictTier(chain(probe, tokens, 3))
    assert Sequences(manager_for(8, BS, lower_tier=tier)).allocate("a", tokens).num_cached_tokens == 2 * BS
    off = Sequences(manager_for(8, BS, prefix_cache=False, lower_tier=tier))
    assert off.allocate("a", tokens).num_cached_tokens == 0


class Checkpoints:
    """A state model's resume points (StateCache's part): hashes with a checkpoint, some of them unreadable."""

    def __init__(self, hashes=(), unreadable=()):
        self.hashes, self.unreadable, self.prepared = set(hashes), set(unreadable), []

    def usable_blocks(self, block_hashes):
        return max((n for n in range(1, len(block_hashes) + 1) if block_hashes[n - 1] in self.hashes), default=0)

    def prepare(self, block_hash):
        self.prepared.append(block_hash)
        if block_hash in self.unreadable:
            self.hashes.discard(block_hash)  # as a file failing its checks: never counted again
            return False
        return True


def state_manager(num_blocks, tier, points):
    return manager_for(
        num_blocks, BS, prefix_filter=points.usable_blocks, prepare_resume=points.prepare, lower_tier=tier
    )


@pytest.mark.parametrize("in_ram", [0, 2])
def test_a_state_model_resumes_at_the_last_checkpoint_over_ram_and_disk(in_ram):
    tokens = prompt(6 * BS + 3)
    hashes = chain(manager_for(32, BS), tokens, 6)
    points = Checkpoints({hashes[1], hashes[4]})  # checkpoints after blocks 2 and 5 (a chunk end, the prompt's)
    seqs = Sequences(state_manager(32, DictTier(hashes), points))
    if in_ram:  # the pool holds the first blocks itself
        seqs.manager.lower_tier = None
        seqs.allocate("warm", tokens[: in_ram * BS + 1])
        seqs.mark_computed("warm", in_ram * BS + 1)
        seqs.manager.lower_tier = DictTier(hashes)
    tier = seqs.manager.lower_tier
    alloc = seqs.allocate("a", tokens)
    assert alloc.num_cached_tokens == 5 * BS and alloc.last_block_hash == hashes[4]
    assert alloc.num_lower_tier_tokens == (5 - in_ram) * BS and tier.loads[0][1] == hashes[in_ram:5]
    assert points.prepared == [hashes[4]]  # made ready before any block was taken


def test_an_unreadable_checkpoint_resumes_earlier_and_takes_no_block_past_it():
    tokens = prompt(6 * BS + 3)
    hashes = chain(manager_for(32, BS), tokens, 6)
    points = Checkpoints({hashes[1], hashes[4]}, unreadable={hashes[4]})
    tier = DictTier(hashes)
    seqs = Sequences(state_manager(32, tier, points))
    alloc = seqs.allocate("a", tokens)
    assert alloc.num_cached_tokens == 2 * BS and alloc.last_block_hash == hashes[1]
    assert points.prepared == [hashes[4], hashes[1]]
    assert tier.loads == [(alloc.block_tables[0][:2], hashes[:2])]  # only the blocks it resumes after
    cached = [seqs.pool.blocks[b].block_hash is not None for b in alloc.block_tables[0]]
    assert cached == [True, True] + [False] * (len(cached) - 2)  # the rest is prefilled, never a stale hit


def test_a_block_that_fails_its_read_ends_the_run_at_the_checkpoint_before_it():
    tokens = prompt(6 * BS + 3)
    hashes = chain(manager_for(32, BS), tokens, 6)
    points = Checkpoints({hashes[1], hashes[4]})
    seqs = Sequences(state_manager(32, DictTier(hashes, fail_after=3), points))
    alloc = seqs.allocate("a", tokens)
    assert alloc.num_cached_tokens == 2 * BS and alloc.last_block_hash == hashes[1]
    assert points.prepared == [hashes[1]]  # the checkpoint after block 5 was never a candidate
