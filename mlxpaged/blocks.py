"""Block pool for the paged KV cache: block tables, ref counts, prefix cache, copy-on-write.

Plain Python (no MLX). Modelled on vLLM v1's BlockPool: a full block whose KV has been
computed gets a hash chained to its parent's; freed hashed blocks wait in an LRU queue
and are evicted only when the pool needs a block. Each request's table lives here,
keyed by a hashable request id.
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


@dataclass
class Allocation:
    block_table: list[int]
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
    blocks: list[_Block]
    tokens: list[int]
    num_computed: int = 0
    num_hashed: int = 0  # leading blocks already registered in the prefix cache
    cacheable: bool = True  # False after reset_prefix_cache: its chain root is gone


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_cache: bool = True,
                 extra_key: object = None, hash_fn: HashFn = sha256_block_hash):
        if block_size not in VALID_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {VALID_BLOCK_SIZES}, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
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
        return -(-num_tokens // self.block_size)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: Hashable) -> list[int]:
        return [b.block_id for b in self._request(request_id).blocks]

    def num_tokens(self, request_id: Hashable) -> int:
        return len(self._request(request_id).tokens)

    def token_ids(self, request_id: Hashable) -> list[int]:
        return list(self._request(request_id).tokens)

    def num_computed_tokens(self, request_id: Hashable) -> int:
        return self._request(request_id).num_computed

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def slots_for(self, request_id: Hashable, start: int, end: int) -> list[int]:
        """Physical slots (block * block_size + offset) of logical positions [start, end)."""
        req = self._request(request_id)
        if not 0 <= start <= end <= len(req.tokens):
            raise ValueError(f"slot range [{start}, {end}) outside 0..{len(req.tokens)} tokens")
        bs = self.block_size
        return [req.blocks[p // bs].block_id * bs + p % bs for p in range(start, end)]

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
        """Give a new request blocks for its prompt (plus `num_new_slots` reserved slots),
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
        hits = self._match_prefix(tokens)
        needed = self.num_blocks_for(len(tokens) + extra) - len(hits)
        available = self._available_besides(hits)
        if needed > available:
            raise NoFreeBlocksError(needed, available, self.num_blocks)
        self._touch(hits)
        blocks = hits + self._take(needed)
        cached = len(hits) * self.block_size
        if self.enable_prefix_cache:
            self._queries += 1
            self._query_tokens += len(tokens)
            self._hit_tokens += cached
        self._requests[request_id] = _Request(blocks, tokens, cached, len(hits))
        return Allocation([b.block_id for b in blocks], cached)

    def append_slot(self, request_id: Hashable, token_id: int) -> int:
        """Append one token and return its physical slot; takes a new block when the last
        is full. Raises NoFreeBlocksError (token not appended) when the pool is empty."""
        req = self._request(request_id)
        pos = len(req.tokens)
        if pos == len(req.blocks) * self.block_size:
            if not self.num_free_blocks:
                raise NoFreeBlocksError(1, 0, self.num_blocks)
            req.blocks += self._take(1)
        block = req.blocks[pos // self.block_size]
        if block.ref_cnt != 1:  # full blocks only are shared, so this is a pool bug
            raise RuntimeError(f"write into block {block.block_id} with ref {block.ref_cnt}")
        req.tokens.append(token_id)
        return block.block_id * self.block_size + pos % self.block_size

    def reserve_slots(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Make the table hold `num_tokens` tokens without appending any: a pipelined step writes
        the KV of a token whose id is not known yet, and `append_slot` later fills the same slot.
        Returns the table. Raises NoFreeBlocksError (nothing changed) when the pool is short."""
        req = self._request(request_id)
        needed = self.num_blocks_for(num_tokens) - len(req.blocks)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(needed, self.num_free_blocks, self.num_blocks)
        if needed > 0:
            req.blocks += self._take(needed)
        return [b.block_id for b in req.blocks]

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

    def fork(self, parent_id: Hashable, child_id: Hashable) -> CopyOnWrite | None:
        """Give child_id a copy of parent_id's sequence. Computed full blocks are shared;
        the rest get fresh blocks so neither side ever writes into a shared block. Returns
        the copy the KV layer must do for a partly computed block, or None."""
        parent = self._request(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already has blocks")
        n_shared = parent.num_computed // self.block_size
        n_fresh = self.num_blocks_for(len(parent.tokens)) - n_shared
        if n_fresh > self.num_free_blocks:
            raise NoFreeBlocksError(n_fresh, self.num_free_blocks, self.num_blocks)
        shared = parent.blocks[:n_shared]
        for b in shared:
            b.ref_cnt += 1
        fresh = self._take(n_fresh)
        self._requests[child_id] = _Request(
            shared + fresh, list(parent.tokens), parent.num_computed,
            min(parent.num_hashed, n_shared), parent.cacheable)
        partial = parent.num_computed % self.block_size
        if partial and fresh:
            return CopyOnWrite(parent.blocks[n_shared].block_id, fresh[0].block_id, partial)
        return None

    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks. Tail blocks are queued first so that a chain is
        evicted tail before head (its head is the part other prompts most likely share)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(request_id)
        for b in reversed(req.blocks):
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
        for i in range(req.num_hashed, req.num_computed // bs):
            block = req.blocks[i]
            if block.key is None:  # a shared hit already carries its key
                parent = req.blocks[i - 1].key if i else None
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
