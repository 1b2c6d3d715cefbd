"""The block pool of the paged KV cache: blocks, reference counts, the free queue, the prefix-cache
hash map and LRU eviction. Plain Python (no MLX), modelled on vLLM v1's BlockPool, and it knows
nothing of requests: per-request tables live in kv_cache_manager.py.

A full block whose KV is computed can be cached under its block hash (a chain: see
`sha256_block_hash`). A freed block with a hash stays findable in an LRU queue and is evicted only
when the pool needs a block; a freed block without one goes back to the free list, used first.

Partial blocks: a freed request's last, partly computed block stays findable by (hash of the full
blocks before it, its computed tokens) while it waits in the free list, so a prompt that extends
the freed one takes it over instead of recomputing up to block_size - 1 tokens (SGLang's radix
cache keeps tokens, not blocks, for the same reason). Handing it out for anything else forgets it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxpaged.validation import require_int

# (parent block hash or None, block token ids, extra keys) -> block hash; the parent is this function's own
# earlier result, so a HashFn may take its own hash type there (Any: Callable cannot say "its own return type").
HashFn = Callable[[Any, tuple, object], Hashable]


def sha256_block_hash(parent_hash: bytes | None, token_ids: tuple, extra_key: object) -> bytes:
    """vLLM v1's block hash: sha256 of (parent hash, the block's token ids, extra keys).

    One scheme, chosen over nano-vllm's xxhash + token compare: the parent hash makes the hash name
    the whole prefix, and at 256 bits a collision is not a concern, so a hit needs no stored tokens
    and no parent identity, and the hash is stable across processes (unlike hash()). extra_key must
    have a stable repr (str, ints, tuples of them)."""
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


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None  # set while the block is in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int):
        require_int("num_blocks", num_blocks, low=1)
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: deque[KVCacheBlock] = deque(self.blocks)  # unhashed, ref 0
        # Hashed blocks with ref 0, least recently used first (an O(1) doubly-linked list).
        self._evictable: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._cached: dict[Hashable, dict[int, KVCacheBlock]] = {}  # hash -> blocks with that hash
        # Free partial blocks: parent hash (None: the first block) -> {block id: its computed tokens}.
        self._partials: dict[Hashable | None, dict[int, tuple]] = {}
        self._partial_parent: dict[int, Hashable | None] = {}  # block id -> its key in _partials
        # Bumped by reset_prefix_cache: a chain started under an older epoch must not be extended.
        self.cache_epoch = 0
        # Called with each block entering the prefix cache (the disk tier persists it: engine/kv_tiering.py).
        self.on_cached: Callable[[KVCacheBlock], None] | None = None
        self._queries = self._query_tokens = self._hit_tokens = self._evictions = 0

    # ---- queries ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        """A block cached under this hash (the oldest-cached of equal ones), or None."""
        same = self._cached.get(block_hash)
        return next(iter(same.values())) if same else None

    def stats(self) -> BlockPoolStats:
        owned = sum(1 for b in self.blocks if b.ref_cnt > 0)
        rate = self._hit_tokens / self._query_tokens if self._query_tokens else 0.0
        return BlockPoolStats(
            self.num_blocks,
            len(self._free),
            owned,
            len(self._evictable),
            self._queries,
            self._query_tokens,
            self._hit_tokens,
            rate,
            self._evictions,
        )

    def block_state(self) -> list[str]:
        """Per block: "free", "owned" (ref 1), "shared" (ref > 1) or "cached" (ref 0, hashed)."""

        def state(b: KVCacheBlock) -> str:
            if b.ref_cnt > 1:
                return "shared"
            if b.ref_cnt == 1:
                return "owned"
            return "cached" if b.block_hash is not None else "free"

        return [state(b) for b in self.blocks]

    # ---- changes ------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """n blocks with ref 1: never-cached first, then evict the least recently used. Atomic:
        on NoFreeBlocksError nothing changed."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(n, self.num_free_blocks, self.num_blocks)
        taken = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
                self._forget_partial(b.block_id)
            else:
                b = self._evictable.popitem(last=False)[1]
                self._uncache(b)
                self._evictions += 1
            b.ref_cnt = 1
            taken.append(b)
        return taken

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit, a fork); a cached free block
        leaves the eviction queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._evictable[b.block_id]
            b.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference on each block, in order: of the blocks this frees, the first is
        evicted first."""
        for b in blocks:
            if b.ref_cnt < 1:
                raise RuntimeError(f"block {b.block_id} freed with ref count {b.ref_cnt}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self._free.append(b)
                else:
                    self._evictable[b.block_id] = b

    def cache_full_block(self, block: KVCacheBlock, block_hash: Hashable) -> None:
        """Make an owned block findable under `block_hash` (its KV is computed and full)."""
        if block.ref_cnt < 1 or block.block_hash is not None:
            raise RuntimeError(
                f"block {block.block_id} cannot be cached: ref count {block.ref_cnt}, hash {block.block_hash!r}"
            )
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, {})[block.block_id] = block
        if self.on_cached is not None:
            self.on_cached(block)

    def cache_partial_block(self, block: KVCacheBlock, parent_hash: Hashable | None, token_ids: tuple) -> None:
        """Make a free, unhashed block findable by the tokens whose KV its first slots hold."""
        if block.ref_cnt != 0 or block.block_hash is not None or not token_ids:
            raise RuntimeError(
                f"block {block.block_id} cannot be cached as partial: ref count {block.ref_cnt}, "
                f"hash {block.block_hash!r}, {len(token_ids)} tokens"
            )
        self._forget_partial(block.block_id)
        self._partials.setdefault(parent_hash, {})[block.block_id] = token_ids
        self._partial_parent[block.block_id] = parent_hash

    def match_partial_block(self, parent_hash: Hashable | None, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(block id, n) of the free partial block after `parent_hash` sharing the longest run of leading
        tokens with `token_ids` (n >= 1 of them), or None. No side effects."""
        best = None
        for block_id, cached in self._partials.get(parent_hash, {}).items():
            n = _common_prefix(cached, token_ids)
            if n and (best is None or n > best[1]):
                best = (block_id, n)
        return best

    def take_partial_block(self, block_id: int) -> KVCacheBlock:
        """Take a free partial block `match_partial_block` named out of the free list, with ref 1."""
        if block_id not in self._partial_parent:
            raise RuntimeError(f"block {block_id} is not a free partial block")
        self._forget_partial(block_id)
        block = self.blocks[block_id]
        self._free.remove(block)
        block.ref_cnt = 1
        return block

    def record_prefix_query(self, query_tokens: int, hit_tokens: int) -> None:
        self._queries += 1
        self._query_tokens += query_tokens
        self._hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every hash. Owned blocks keep their KV, but their chains can no longer be found or
        extended (`cache_epoch` changes)."""
        for b in self.blocks:
            b.block_hash = None
        self._free.extend(self._evictable.values())
        self._evictable.clear()
        self._cached.clear()
        self._partials.clear()
        self._partial_parent.clear()
        self.cache_epoch += 1

    def _forget_partial(self, block_id: int) -> None:
        if block_id in self._partial_parent:
            parent = self._partial_parent.pop(block_id)
            del self._partials[parent][block_id]
            if not self._partials[parent]:
                del self._partials[parent]

    def _uncache(self, block: KVCacheBlock) -> None:
        same_hash = self._cached[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self._cached[block.block_hash]
        block.block_hash = None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter one bounds it
        if x != y:
            break
        n += 1
    return n
