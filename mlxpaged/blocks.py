"""Block pool for the paged KV cache: block tables, ref counts, prefix cache, copy-on-write.

Plain Python (no MLX). Modelled on vLLM v1's BlockPool: a full block whose KV has been
computed gets a hash chained to its parent's; freed hashed blocks wait in an LRU queue
and are evicted only when the pool needs a block. Each request's tables live here,
keyed by a hashable request id.

Layer groups. A model that mixes sliding-window and full attention pages each layer group
(see kv_cache.py) through its own table, so a request holds one table per group, all drawn
from this one block-id space. A full-attention table grows with the sequence; a window
group's table stops at that group's `max_blocks` and is then reused as a ring (logical
block b lives in table[b % len(table)]). Ring blocks are overwritten as the window slides,
so they are never shared: the prefix cache needs a single full-attention table, and fork
copies ring blocks instead of sharing them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from mlxpaged.config import VALID_BLOCK_SIZES


# (parent hash or None, block token ids, extra key) -> hash
HashFn = Callable[[object, tuple, object], Hashable]


def sha256_block_hash(parent_hash: bytes | None, token_ids: tuple, extra_key: object) -> bytes:
    """Stable across processes, unlike hash(); extra_key should have a stable repr (str, ints)."""
    h = hashlib.sha256()
    h.update(b"R" if parent_hash is None else b"P" + parent_hash)
    h.update(b"|" + ",".join(map(str, token_ids)).encode() + b"|")
    h.update(repr(extra_key).encode())
    return h.digest()


class NoFreeBlocksError(Exception):
    """The pool cannot supply `needed` blocks; the scheduler preempts or waits on this."""

    def __init__(self, needed: int, available: int, total: int):
        super().__init__(f"need {needed} KV blocks but only {available} of {total} are free")
        self.needed, self.available, self.total = needed, available, total


class UnknownRequestError(KeyError):
    """No block table exists for this request id."""


def table_lengths(num_tokens: int, block_size: int, group_max_blocks: Sequence[int | None]) -> list[int]:
    """Per layer group, the blocks a sequence of `num_tokens` tokens holds: one per block_size
    tokens, at most `max_blocks` for a sliding-window ring (None: full attention, no limit)."""
    n = -(-num_tokens // block_size)
    return [n if cap is None else min(n, cap) for cap in group_max_blocks]


def sequence_capacity(num_blocks: int, block_size: int, group_max_blocks: Sequence[int | None]) -> int | None:
    """Tokens (whole blocks) of the longest sequence `num_blocks` blocks can hold; None when
    any length fits (only rings, and they fit)."""
    def fits(n: int) -> bool:
        return sum(table_lengths(n * block_size, block_size, group_max_blocks)) <= num_blocks

    if None not in group_max_blocks and fits(max(group_max_blocks)):
        return None
    low, high = 0, num_blocks  # what fits is <= num_blocks: some table takes a block per n
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * block_size


@dataclass
class Allocation:
    block_tables: list[list[int]]  # one per layer group
    num_cached_tokens: int


@dataclass(frozen=True)
class CopyOnWrite:
    """The KV layer must copy the first `num_tokens` slots of src_block into dst_block."""

    src_block: int
    dst_block: int
    num_tokens: int


@dataclass(frozen=True)
class BlockPoolStats:
    num_blocks: int
    num_free: int  # never cached, or evicted
    num_owned: int  # ref count > 0
    num_cached_free: int  # ref count 0 but still findable by hash (evictable)
    prefix_queries: int
    query_tokens: int
    hit_tokens: int
    hit_rate: float
    evictions: int


@dataclass(eq=False, frozen=True)
class _Key:
    """Content identity of a cached block. Blocks with equal content share one _Key, and a
    lookup requires `parent is` the previous hit, so a hash collision cannot splice chains."""

    hash: Hashable
    tokens: tuple
    parent: _Key | None


class _Block:
    __slots__ = ("block_id", "ref_cnt", "key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: _Key | None = None


@dataclass
class _Request:
    tables: list[list[_Block]]  # one per layer group; just one when the prefix cache is on
    tokens: list[int]
    num_computed: int = 0
    num_hashed: int = 0  # leading blocks already registered in the prefix cache
    cacheable: bool = True  # False after reset_prefix_cache: its chain root is gone


class BlockPool:
    """`group_max_blocks`: per layer group, None for a full-attention table, or the ring size
    of a sliding-window group (`LayerGroup.max_blocks`). The default is one full table."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_cache: bool = True,
                 extra_key: object = None, hash_fn: HashFn = sha256_block_hash,
                 group_max_blocks: Sequence[int | None] = (None,)):
        if block_size not in VALID_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {VALID_BLOCK_SIZES}, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        caps = tuple(group_max_blocks)
        if not caps or any(c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1)
                           for c in caps):
            raise ValueError(f"group_max_blocks must hold None or positive ints, one per group, got {caps}")
        if enable_prefix_cache and caps != (None,):
            raise ValueError(f"the prefix cache needs one full-attention table per request, "
                             f"got group_max_blocks {caps}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group_max_blocks = caps
        self.capacity_tokens = sequence_capacity(num_blocks, block_size, caps)  # longest sequence
        self.enable_prefix_cache = enable_prefix_cache
        self.extra_key = extra_key
        self._hash_fn = hash_fn
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[_Block] = deque(self._blocks)  # unhashed, ref 0
        # Hashed blocks with ref 0, least recently used first (an O(1) doubly-linked list).
        self._evictable: OrderedDict[int, _Block] = OrderedDict()
        self._cached: dict[Hashable, dict[int, _Block]] = {}  # hash -> blocks with that hash
        self._requests: dict[Hashable, _Request] = {}
        self._queries = self._query_tokens = self._hit_tokens = self._evictions = 0

    # ---- queries ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` tokens holds over all its tables."""
        return sum(table_lengths(num_tokens, self.block_size, self.group_max_blocks))

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def block_tables(self, request_id: Hashable) -> list[list[int]]:
        """The request's block ids, one table per layer group."""
        return [[b.block_id for b in table] for table in self._request(request_id).tables]

    def num_tokens(self, request_id: Hashable) -> int:
        return len(self._request(request_id).tokens)

    def token_ids(self, request_id: Hashable) -> list[int]:
        return list(self._request(request_id).tokens)

    def num_computed_tokens(self, request_id: Hashable) -> int:
        return self._request(request_id).num_computed

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def slots_for(self, request_id: Hashable, start: int, end: int, group: int = 0) -> list[int]:
        """Physical slots (block * block_size + offset) of logical positions [start, end) in one
        group's table. In a ring, later positions reuse the slots of those a window earlier."""
        req = self._request(request_id)
        if not 0 <= start <= end <= len(req.tokens):
            raise ValueError(f"slot range [{start}, {end}) outside 0..{len(req.tokens)} tokens")
        bs, table = self.block_size, req.tables[group]
        return [table[p // bs % len(table)].block_id * bs + p % bs for p in range(start, end)]

    def lookup_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens allocate() would take from the cache now; no side effects, no stats."""
        return len(self._match_prefix(list(token_ids))) * self.block_size

    def can_allocate(self, token_ids: Sequence[int], num_new_slots: int | None = None) -> bool:
        tokens = list(token_ids)
        hits = self._match_prefix(tokens)
        needed = self.num_blocks_for(len(tokens) + (num_new_slots or 0)) - len(hits)
        return needed <= self._available_besides(hits)

    def stats(self) -> BlockPoolStats:
        owned = sum(1 for b in self._blocks if b.ref_cnt > 0)
        rate = self._hit_tokens / self._query_tokens if self._query_tokens else 0.0
        return BlockPoolStats(self.num_blocks, len(self._free), owned, len(self._evictable),
                              self._queries, self._query_tokens, self._hit_tokens, rate,
                              self._evictions)

    def block_state(self) -> list[str]:
        """Per block: "free", "owned" (ref 1), "shared" (ref > 1) or "cached" (ref 0, hashed)."""
        def state(b: _Block) -> str:
            if b.ref_cnt > 1:
                return "shared"
            if b.ref_cnt == 1:
                return "owned"
            return "cached" if b.key is not None else "free"
        return [state(b) for b in self._blocks]

    # ---- request lifecycle --------------------------------------------------------

    def allocate(self, request_id: Hashable, token_ids: Sequence[int],
                 num_new_slots: int | None = None) -> Allocation:
        """Give a new request tables for its prompt (plus `num_new_slots` reserved slots),
        sharing the longest cached prefix of full blocks. Atomic: on NoFreeBlocksError
        nothing changed."""
        tokens = list(token_ids)
        extra = 0 if num_new_slots is None else num_new_slots
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has blocks")
        if not tokens:
            raise ValueError("cannot allocate an empty prompt: the model needs a token to run")
        if extra < 0:
            raise ValueError(f"num_new_slots must be >= 0, got {extra}")
        hits = self._match_prefix(tokens)  # only with the prefix cache: then one table
        fresh = table_lengths(len(tokens) + extra, self.block_size, self.group_max_blocks)
        fresh[0] -= len(hits)
        needed = sum(fresh)
        available = self._available_besides(hits)
        if needed > available:
            raise NoFreeBlocksError(needed, available, self.num_blocks)
        self._touch(hits)
        tables = _split(self._take(needed), fresh)
        tables[0] = hits + tables[0]
        cached = len(hits) * self.block_size
        if self.enable_prefix_cache:
            self._queries += 1
            self._query_tokens += len(tokens)
            self._hit_tokens += cached
        self._requests[request_id] = _Request(tables, tokens, cached, len(hits))
        return Allocation([[b.block_id for b in t] for t in tables], cached)

    def append_slot(self, request_id: Hashable, token_id: int) -> None:
        """Append one token; a table whose blocks are all used takes a new one, unless it is
        a full ring, which wraps. Raises NoFreeBlocksError (token not appended) when the pool
        cannot supply the blocks."""
        req = self._request(request_id)
        self._make_room(req)
        logical = len(req.tokens) // self.block_size
        for table in req.tables:
            # A growing table covers `logical`; a ring shorter than its limit does too, so
            # `% len` is the ring's `% max_blocks` wherever it matters.
            block = table[logical % len(table)]
            if block.ref_cnt != 1:  # full blocks only are shared, so this is a pool bug
                raise RuntimeError(f"write into block {block.block_id} with ref {block.ref_cnt}")
        req.tokens.append(token_id)

    def reserve_next_slot(self, request_id: Hashable) -> list[list[int]]:
        """Room for the token after the last one, without appending it: a pipelined step writes
        the KV of a token whose id is not known yet, and `append_slot` then fills the same slot.
        Returns the tables. Raises NoFreeBlocksError (nothing changed) when the pool is short."""
        req = self._request(request_id)
        self._make_room(req)
        return [[b.block_id for b in table] for table in req.tables]

    def mark_computed(self, request_id: Hashable, num_computed_tokens: int) -> None:
        """Record that the KV of the first `num_computed_tokens` tokens is written. Only
        then do full blocks enter the prefix cache: a hit on unwritten KV would be garbage."""
        req = self._request(request_id)
        if not req.num_computed <= num_computed_tokens <= len(req.tokens):
            raise ValueError(f"num_computed_tokens {num_computed_tokens} must be within "
                             f"{req.num_computed}..{len(req.tokens)}")
        req.num_computed = num_computed_tokens
        if self.enable_prefix_cache and req.cacheable:
            self._register_full_blocks(req)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[CopyOnWrite]:
        """Give child_id a copy of parent_id's sequence and return the copies the KV layer
        must do first. In a full-attention table computed full blocks are shared and the rest
        are fresh, so neither side ever writes into a shared block; a partly computed block is
        copied. A ring is copied whole instead of shared, since the window overwrites its
        blocks: at most ceil(window / block_size) + 1 block copies per group, far cheaper than
        having the child recompute its prompt."""
        parent = self._request(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already has blocks")
        bs, computed = self.block_size, parent.num_computed
        n_shared = computed // bs
        lengths = table_lengths(len(parent.tokens), bs, self.group_max_blocks)
        fresh = [n - n_shared if cap is None else n for n, cap in zip(lengths, self.group_max_blocks)]
        needed = sum(fresh)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(needed, self.num_free_blocks, self.num_blocks)
        tables, copies = _split(self._take(needed), fresh), []
        for src, table, cap in zip(parent.tables, tables, self.group_max_blocks):
            if cap is None:
                shared = src[:n_shared]
                for b in shared:
                    b.ref_cnt += 1
                if computed % bs and table:
                    copies.append(CopyOnWrite(src[n_shared].block_id, table[0].block_id, computed % bs))
                table[:0] = shared
            else:
                written = min(-(-computed // bs), len(table))  # ring blocks holding computed KV
                copies += [CopyOnWrite(s.block_id, d.block_id, bs) for s, d in zip(src[:written], table)]
        self._requests[child_id] = _Request(
            tables, list(parent.tokens), computed, min(parent.num_hashed, n_shared), parent.cacheable)
        return copies

    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks. Tail blocks are queued first so that a chain is
        evicted tail before head (its head is the part other prompts most likely share)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(request_id)
        for b in (b for table in req.tables for b in reversed(table)):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.key is None:
                    self._free.append(b)
                else:
                    self._evictable[b.block_id] = b

    def reset_prefix_cache(self) -> None:
        """Forget every hash. Running requests keep their blocks (their KV is still theirs)
        but stop registering new ones, since their chains can no longer be found."""
        for b in self._blocks:
            b.key = None
        self._free.extend(self._evictable.values())
        self._evictable.clear()
        self._cached.clear()
        for req in self._requests.values():
            req.cacheable = False

    # ---- internals ----------------------------------------------------------------

    def _request(self, request_id: Hashable) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(request_id) from None

    def _available_besides(self, hits: list[_Block]) -> int:
        # Touching an evictable hit takes it out of the free pool without allocating it.
        return self.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)

    def _match_prefix(self, tokens: list[int]) -> list[_Block]:
        """Longest chain of cached full blocks for `tokens`, never covering the last token
        (the model must run at least one position to produce logits)."""
        if not self.enable_prefix_cache:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = self._hash_fn(None if parent is None else parent.hash, chunk, self.extra_key)
            block = next((b for b in self._cached.get(h, {}).values()
                          if b.key.parent is parent and b.key.tokens == chunk), None)
            if block is None:
                break
            hits.append(block)
            parent = block.key
        return hits

    def _make_room(self, req: _Request) -> None:
        """Tables that end where the next token starts a block get that block (atomic)."""
        pos = len(req.tokens)
        if pos % self.block_size == 0:
            self._grow(req, pos // self.block_size)

    def _grow(self, req: _Request, logical: int) -> None:
        """Give every table that ends before logical block `logical` one more block (a ring
        only up to its limit). Atomic: on NoFreeBlocksError nothing changed."""
        grow = [t for t, cap in zip(req.tables, self.group_max_blocks)
                if len(t) == logical and (cap is None or logical < cap)]
        if len(grow) > self.num_free_blocks:
            raise NoFreeBlocksError(len(grow), self.num_free_blocks, self.num_blocks)
        for table, block in zip(grow, self._take(len(grow))):
            table.append(block)

    def _touch(self, blocks: list[_Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                del self._evictable[b.block_id]
            b.ref_cnt += 1

    def _take(self, n: int) -> list[_Block]:
        """n fresh blocks (ref 1): never-cached first, then evict least recently used."""
        taken = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b = self._evictable.popitem(last=False)[1]
                self._uncache(b)
                self._evictions += 1
            b.ref_cnt = 1
            taken.append(b)
        return taken

    def _uncache(self, block: _Block) -> None:
        same_hash = self._cached[block.key.hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self._cached[block.key.hash]
        block.key = None

    def _register_full_blocks(self, req: _Request) -> None:
        bs = self.block_size
        (blocks,) = req.tables
        for i in range(req.num_hashed, req.num_computed // bs):
            block = blocks[i]
            if block.key is None:  # a shared hit already carries its key
                parent = blocks[i - 1].key if i else None
                block.key = self._key_for(parent, tuple(req.tokens[i * bs:(i + 1) * bs]))
                self._cached.setdefault(block.key.hash, {})[block.block_id] = block
            req.num_hashed = i + 1

    def _key_for(self, parent: _Key | None, tokens: tuple) -> _Key:
        # Reuse the key of an identical cached block so chains through duplicates still match.
        h = self._hash_fn(None if parent is None else parent.hash, tokens, self.extra_key)
        for b in self._cached.get(h, {}).values():
            if b.key.parent is parent and b.key.tokens == tokens:
                return b.key
        return _Key(h, tokens, parent)


def _split(blocks: list[_Block], counts: Sequence[int]) -> list[list[_Block]]:
    """`blocks` cut into consecutive runs of `counts[i]` blocks."""
    tables, start = [], 0
    for n in counts:
        tables.append(blocks[start:start + n])
        start += n
    return tables
