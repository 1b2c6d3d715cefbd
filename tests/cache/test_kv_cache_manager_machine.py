"""Cache manager and block pool under a hypothesis state machine over random workloads.

It keeps a fake KV store (slot -> the token prefix whose KV the slot holds), so a false prefix hit,
a write into a shared block or a missed copy-on-write shows up as a slot holding the wrong prefix,
not just as a broken counter.
"""

from mlxpaged.cache.block_pool import NoFreeBlocksError, sha256_block_hash
from mlxpaged.cache.specs import table_lengths
from mlxpaged.engine.request import Request
from tests.cache.kv_sequences import UNLIMITED, pool_of

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

# Per layer group, None (full attention) or a ring size: dense, and hybrids with small rings
# that wrap after two or three blocks.
GROUP_LAYOUTS = [(None,), (None, 2), (3, None, 3), (2,)]


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 24), bs=st.sampled_from([8, 16]), groups=st.sampled_from(GROUP_LAYOUTS))
    def setup(self, num_blocks, bs, groups):
        self.bs = bs
        self.pool = pool_of(num_blocks, bs, enable_prefix_cache=groups == (None,), group_max_blocks=groups)
        self.kv = {}  # slot -> tuple of the tokens whose KV the slot holds (prefix through it)
        self.next_id = 0

    def live(self):
        return sorted(self.pool.requests)

    def prompts(self):
        # Whole-block segments from a tiny set so that prefixes collide often.
        segs = st.lists(
            st.sampled_from([(0,) * self.bs, (1,) * self.bs, (0, 1) * (self.bs // 2)]), min_size=1, max_size=3
        )
        tail = st.lists(st.integers(0, 2), max_size=self.bs)
        return st.tuples(segs, tail).map(lambda s: [t for seg in s[0] for t in seg] + s[1])

    def new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(data=st.data(), extra=st.integers(0, 3), prefill=st.booleans())
    def allocate(self, data, extra, prefill):
        rid = self.try_allocate(data.draw(self.prompts()), extra)
        if rid is not None and prefill:  # as the engine does when the prompt fits one chunk
            self.compute_tokens(rid, self.pool.num_tokens(rid))

    @rule(data=st.data())
    def allocate_under_pressure(self, data):
        # A unique prompt as large as the free space forces evictions of cached blocks.
        n = data.draw(st.integers(1, max(1, self.pool.num_free_blocks * self.bs)))
        self.try_allocate([1000 + self.next_id] * n, 0)

    def try_allocate(self, tokens, extra):
        rid, expected_hit = self.new_id(), self.pool.lookup_prefix(tokens)
        predicted = self.pool.can_allocate(tokens, extra)
        before = self.pool.block_state()
        try:
            alloc = self.pool.allocate(rid, tokens, extra)
        except NoFreeBlocksError:
            assert not predicted and self.pool.block_state() == before
            event("allocate: no free blocks")
            if self.live():  # preempt the oldest request, as the scheduler would
                self.pool.free(self.live()[0])
            return None
        assert predicted and alloc.num_cached_tokens == expected_hit
        event("allocate: prefix hit" if expected_hit else "allocate: miss")
        if expected_hit % self.bs:
            event("allocate: partial block taken over")
        assert alloc.num_cached_tokens < len(tokens)
        assert sum(map(len, alloc.block_tables)) == self.pool.num_blocks_for(len(tokens) + extra)
        for pos, slot in enumerate(self.pool.slots_for(rid, 0, alloc.num_cached_tokens)):  # hits hold their KV
            assert self.kv.get(slot) == tuple(tokens[: pos + 1]), f"cached position {pos} holds other KV"
        return rid

    @precondition(lambda self: self.pool.requests)
    @rule(data=st.data(), amount=st.integers(1, 20))
    def compute(self, data, amount):
        self.compute_tokens(data.draw(st.sampled_from(self.live())), amount)

    def compute_tokens(self, rid, amount):
        """Write fake KV for the next `amount` uncomputed tokens, as the runner would."""
        start, total = self.pool.num_computed_tokens(rid), self.pool.num_tokens(rid)
        end, tokens = min(total, start + amount), self.pool.token_ids(rid)
        for group in range(len(self.pool.group_max_blocks)):
            for pos, slot in zip(range(start, end), self.pool.slots_for(rid, start, end, group), strict=True):
                assert self.pool.ref_count(slot // self.bs) == 1, "write into a shared block"
                self.kv[slot] = tuple(tokens[: pos + 1])
        self.pool.mark_computed(rid, end)

    @precondition(lambda self: self.pool.requests)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        rid = data.draw(st.sampled_from(self.live()))
        n, tables = self.pool.num_tokens(rid), self.pool.block_tables(rid)
        try:
            self.pool.append_slot(rid, token)
        except NoFreeBlocksError:
            assert self.pool.num_free_blocks < len(tables)  # at most one new block per table
            assert self.pool.num_tokens(rid) == n and self.pool.block_tables(rid) == tables
            return
        assert self.pool.num_tokens(rid) == n + 1
        grown = [len(new) - len(old) for old, new in zip(tables, self.pool.block_tables(rid), strict=True)]
        assert set(grown) <= {0, 1} and (n % self.bs == 0 or not any(grown))

    @precondition(lambda self: self.pool.requests)
    @rule(data=st.data())
    def fork(self, data):
        parent, child = data.draw(st.sampled_from(self.live())), self.new_id()
        before = self.pool.block_state()
        try:
            copies = self.pool.fork(parent, child)
        except NoFreeBlocksError:
            assert self.pool.block_state() == before
            return
        event(f"fork: {min(len(copies), 2)} copies")
        for cow in copies:  # as the KV layer does; a slot never written holds garbage after
            assert self.pool.ref_count(cow.dst_block) == 1
            for off in range(cow.num_tokens):
                src, dst = cow.src_block * self.bs + off, cow.dst_block * self.bs + off
                if src in self.kv:
                    self.kv[dst] = self.kv[src]
                else:
                    self.kv.pop(dst, None)
        assert self.pool.token_ids(child) == self.pool.token_ids(parent)

    @precondition(lambda self: self.pool.requests)
    @rule(data=st.data())
    def free(self, data):
        self.pool.free(data.draw(st.sampled_from(self.live())))

    @precondition(lambda self: self.pool.requests)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def free_and_extend(self, data, more):
        """A follow-up turn: its prompt extends a finished request's tokens, so the finished one's
        partly computed last block can be taken over."""
        rid = data.draw(st.sampled_from(self.live()))
        tokens = self.pool.token_ids(rid)
        self.pool.free(rid)
        self.try_allocate(tokens + more, 0)

    @rule(data=st.data())
    def lookup(self, data):
        tokens = data.draw(self.prompts())
        hit = self.pool.lookup_prefix(tokens)
        assert hit < len(tokens)
        assert self.pool.can_allocate(tokens) == (
            self.pool.num_blocks_for(len(tokens)) - hit // self.bs <= self.free_besides_hits(tokens)
        )

    def free_besides_hits(self, tokens):
        hits = self.pool.manager._match_prefix(Request("probe", tokens, UNLIMITED))[0]
        return self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)

    @rule()
    def reset_prefix_cache(self):
        if self.next_id % 7 == 0:  # rarely, or the cache would hardly ever be warm
            self.pool.reset_prefix_cache()

    @invariant()
    def accounting(self):
        pool, s = self.pool.manager.pool, self.pool.stats()
        assert s.num_free + s.num_owned + s.num_cached_free == s.num_blocks
        free = {b.block_id for b in pool._free}
        cached = set(pool._evictable)
        owned = {b for b in range(pool.num_blocks) if pool.ref_count(b) > 0}
        assert not (free & owned) and not (free & cached) and not (cached & owned)
        assert free | cached | owned == set(range(pool.num_blocks))
        assert len(free) == len(pool._free) == s.num_free
        states = pool.block_state()
        assert states.count("cached") == s.num_cached_free
        assert states.count("owned") + states.count("shared") == s.num_owned

    @invariant()
    def ref_counts_match_tables(self):
        counts = [0] * self.pool.num_blocks
        for rid in self.live():
            blocks = [b for table in self.pool.block_tables(rid) for b in table]
            assert len(blocks) == len(set(blocks))
            for b in blocks:
                counts[b] += 1
        assert counts == [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]

    @invariant()
    def remembered_block_tables_are_the_tables(self):
        # block_tables answers from ids remembered since the last change; the invariants above ask it after
        # every rule, so a change that forgot to drop them shows here as a stale answer.
        for rid in self.live():
            assert self.pool.block_tables(rid) == self.pool.manager.read_block_tables(rid)

    @invariant()
    def tables_cover_tokens_and_rings_stay_bounded(self):
        pool = self.pool
        for rid in self.live():
            need = table_lengths(pool.num_tokens(rid), self.bs, pool.group_max_blocks)
            for table, n, cap in zip(pool.block_tables(rid), need, pool.group_max_blocks, strict=True):
                assert n <= len(table) and (cap is None or len(table) <= cap)
                if cap is not None:
                    assert all(pool.ref_count(b) == 1 for b in table), "a shared ring block"

    @invariant()
    def hashes_name_the_prefix_their_kv_holds(self):
        manager, bs = self.pool.manager, self.bs
        in_map = set()
        for h, same in manager.pool._cached.items():
            for block_id, block in same.items():
                assert block.block_id == block_id and block.block_hash == h
                prefix = self.kv[block_id * bs + bs - 1]  # the KV of the block's last slot names it all
                assert len(prefix) % bs == 0 and self.chain_hash(prefix) == h
                for off in range(bs):
                    assert self.kv[block_id * bs + off] == prefix[: len(prefix) - bs + off + 1]
                in_map.add(block_id)
        assert in_map == {b.block_id for b in manager.pool.blocks if b.block_hash is not None}

    @invariant()
    def partial_blocks_hold_their_tokens_after_their_parent(self):
        pool, bs = self.pool.manager.pool, self.bs
        free = {b.block_id for b in pool._free}
        for parent, blocks in pool._partials.items():
            for block_id, tokens in blocks.items():
                assert block_id in free and 0 < len(tokens) < bs
                prefix = self.kv[block_id * bs + len(tokens) - 1]
                full = len(prefix) - len(tokens)
                assert full % bs == 0 and prefix[full:] == tokens and self.chain_hash(prefix[:full]) == parent
                for off in range(len(tokens)):
                    assert self.kv[block_id * bs + off] == prefix[: full + off + 1]

    @invariant()
    def memoized_hashes_are_the_chain_of_the_tokens_now(self):
        """Each live request's kept hashes (BlockHashes, computed once) equal a fresh chain over its tokens."""
        manager, bs = self.pool.manager, self.bs
        for rid in self.live():
            request = self.pool.request(rid)
            kept = manager.hashes.first(request, request.num_tokens // bs)
            tokens = request.all_token_ids
            assert kept == [self.chain_hash(tokens[: (i + 1) * bs]) for i in range(len(kept))]

    def chain_hash(self, tokens):
        h, bs = None, self.bs
        for i in range(0, len(tokens), bs):
            h = sha256_block_hash(h, tuple(tokens[i : i + bs]), self.pool.extra_key)
        return h

    @invariant()
    def computed_kv_is_this_requests_and_writes_are_private(self):
        pool, bs = self.pool, self.bs
        for rid in self.live():
            tokens, computed = pool.token_ids(rid), pool.num_computed_tokens(rid)
            for group, table in enumerate(pool.block_tables(rid)):
                slots = pool.slots_for(rid, 0, len(tokens), group)
                # A ring holds the positions of its last len(table) logical blocks; a growing
                # table holds them all.
                first = max(0, ((len(tokens) - 1) // bs - len(table) + 1) * bs)
                for pos in range(first, computed):
                    assert self.kv[slots[pos]] == tuple(tokens[: pos + 1]), "KV of another prefix"
                for slot in slots[computed:]:
                    assert pool.ref_count(slot // bs) == 1, "pending write into a shared block"

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        event(f"evictions > 0: {self.pool.stats().evictions > 0}")
        for rid in self.live():
            self.pool.free(rid)
        s = self.pool.stats()
        assert s.num_owned == 0 and self.pool.num_free_blocks == self.pool.num_blocks


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolMachine = PoolMachine.TestCase
