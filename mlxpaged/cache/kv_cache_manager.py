"""Per-request block tables over the block pool: allocation with prefix-cache hits, growth, forks
(copy-on-write), caching of computed blocks, freeing. Plain Python (no MLX), modelled on vLLM v1's
KVCacheManager with one `SingleTypeManager` per layer group's spec (specs.py).

A request's tokens and computed count are read from the `Request` (request.py), never copied here.
Only the tables and the hashes of the request's cached leading blocks (the chain to extend) are
kept, by request id.

The prefix cache needs a single full-attention table: ring blocks of a sliding window are
overwritten as it slides, so they can never be shared (hybrid models run with the cache off, as
kv_cache.py explains); forks copy rings instead of sharing them.

Block spaces. Each group draws its block ids from the `BlockPool` of its space (`spaces`: one index per group,
specs.block_spaces): groups whose pages live in disjoint pools (gemma4's window and full layers) get a pool
each, so an id one group holds never leaves another group's page unused. Every change takes from all spaces
or none (atomic), and a request fits only when each space has its blocks. The prefix cache runs with one
group, so it lives in that group's space (`pool`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from mlxpaged.cache.block_hashes import BlockHashes
from mlxpaged.cache.block_pool import (
    BlockPool,
    BlockPoolStats,
    HashFn,
    KVCacheBlock,
    NoFreeBlocksError,
    sha256_block_hash,
)
from mlxpaged.cache.specs import KVCacheSpec, spaces_capacity
from mlxpaged.config import VALID_BLOCK_SIZES
from mlxpaged.engine.request import Request


class UnknownRequestError(KeyError):
    """No block table exists for this request id."""


class LowerTier(Protocol):
    """Full blocks kept below the pool, by chain hash (the disk tier: engine/kv_tiering.py). Reading and writing
    are apart, so a run of blocks is read and checked before any block is taken for it, and the reading may
    happen in the background while the request waits (`prefetch`)."""

    def contains(self, block_hash: Hashable) -> bool: ...

    def prefetch(self, key: Hashable, block_hashes: list[Hashable]) -> bool:
        """Start reading the blocks for request `key` (if not started); whether they are read."""
        ...

    def forget(self, key: Hashable) -> None:
        """Request `key` went away: drop what was read for it."""
        ...

    def read(self, block_hashes: list[Hashable], key: Hashable = None) -> list:
        """The pages of the leading blocks it could read and check (opaque here), in order: maybe fewer
        (those prefetched for `key` first)."""
        ...

    def write(self, block_ids: list[int], block_hashes: list[Hashable], pages: list) -> None:
        """Write pages `read` returned for `block_hashes` into `block_ids` (one each)."""
        ...


@dataclass
class Allocation:
    block_tables: list[list[int]]  # one per layer group
    num_cached_tokens: int
    last_block_hash: Hashable | None = None  # of the last cached block used (None: no hit)
    num_lower_tier_tokens: int = 0  # of num_cached_tokens, read back from the lower tier (disk)


@dataclass(frozen=True)
class CopyOnWrite:
    """The KV layer must copy the first `num_tokens` slots of src_block into dst_block."""

    src_block: int
    dst_block: int
    num_tokens: int
    space: int = 0  # the block space both ids are in (specs.block_spaces)


class SingleTypeManager:
    """One layer group's tables, by request id (vLLM's SingleTypeKVCacheManager)."""

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        self.tables: dict[Hashable, list[KVCacheBlock]] = {}

    def num_new_blocks(self, request_id: Hashable, num_tokens: int) -> int:
        """Blocks the table still lacks to hold `num_tokens` tokens."""
        return max(0, self.spec.blocks_needed(num_tokens) - len(self.tables[request_id]))

    def block_at(self, request_id: Hashable, position: int) -> KVCacheBlock:
        table = self.tables[request_id]
        return table[self.spec.table_index(position // self.spec.block_size, len(table))]

    def fork(
        self, parent: list[KVCacheBlock], fresh: list[KVCacheBlock], num_computed: int
    ) -> tuple[list[KVCacheBlock], list[CopyOnWrite]]:
        """The child's table (shared leading blocks, then `fresh`) and the copies it needs first."""
        bs = self.spec.block_size
        if self.spec.max_blocks is None:
            shared = parent[: self.spec.shareable_blocks(num_computed)]
            copies = []
            if num_computed % bs and fresh:  # the partly computed block
                copies.append(CopyOnWrite(parent[len(shared)].block_id, fresh[0].block_id, num_computed % bs))
            return shared + fresh, copies
        written = min(-(-num_computed // bs), len(fresh))  # ring blocks holding computed KV
        pairs = zip(parent[:written], fresh, strict=False)  # the written ones
        return fresh, [CopyOnWrite(s.block_id, d.block_id, bs) for s, d in pairs]


@dataclass
class _CachedChain:
    block_hashes: list[Hashable]  # of the request's leading blocks in the prefix cache
    epoch: int  # the pool's cache epoch when the chain began
    partial: tuple[KVCacheBlock, tuple] | None = None  # the block after the chain and its computed tokens
    root: Hashable | None = None  # what a partial block with no full block before it is kept under (_partial_root)

    @property
    def partial_parent(self) -> Hashable | None:
        return self.block_hashes[-1] if self.block_hashes else self.root


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool | Sequence[BlockPool],
        specs: Sequence[KVCacheSpec],
        *,
        spaces: Sequence[int] | None = None,
        enable_prefix_cache: bool = True,
        extra_key: object = None,
        hash_fn: HashFn = sha256_block_hash,
        prefix_filter: Callable[[list[Hashable]], int] | None = None,
        prepare_resume: Callable[[Hashable], bool] | None = None,
        lower_tier: LowerTier | None = None,
    ):
        """`prefix_filter(hashes)`: how many leading blocks of a cached chain a request may use (models
        with state layers can resume only where their state was checkpointed); None: all of them.
        `prepare_resume(hash)`: at allocation, make the resume point after that block ready (a state checkpoint
        read from disk); False: it cannot be, resume earlier. `lower_tier`: where blocks missing from the pool
        may still be found.
        `pool`: one BlockPool, or one per block space with `spaces` naming each group's (None: all in pool 0)."""
        specs = tuple(specs)
        if not specs:
            raise ValueError("a KV cache manager needs at least one layer group spec, got none")
        self.pools = [pool] if isinstance(pool, BlockPool) else list(pool)
        self.spaces = tuple(spaces) if spaces is not None else (0,) * len(specs)
        if len(self.spaces) != len(specs) or set(self.spaces) != set(range(len(self.pools))):
            raise ValueError(
                f"spaces {self.spaces} must name one of the {len(self.pools)} block pools for each of the "
                f"{len(specs)} groups, and use every pool"
            )
        sizes = {s.block_size for s in specs}
        if len(sizes) != 1 or not sizes <= set(VALID_BLOCK_SIZES):
            raise ValueError(
                f"block_size must be one of {VALID_BLOCK_SIZES}, the same for every group, got {sorted(sizes)}"
            )
        if enable_prefix_cache and not (len(specs) == 1 and specs[0].shares_prefix):
            raise ValueError(
                f"the prefix cache needs one full-attention table per request (or a state model's "
                f"token table), got group_max_blocks {tuple(s.max_blocks for s in specs)}"
            )
        self.pool = self.pools[self.spaces[0]]  # the prefix cache's (it runs with one group)
        self.block_size = specs[0].block_size
        self.managers = [SingleTypeManager(s) for s in specs]
        self.enable_prefix_cache = enable_prefix_cache
        self.extra_key = extra_key
        self.hash_fn = hash_fn
        self.hashes = BlockHashes(self.block_size, hash_fn, extra_key)  # each request's, computed once
        self.prefix_filter = prefix_filter
        self.prepare_resume = prepare_resume
        self.lower_tier = lower_tier
        self._chains: dict[Hashable, _CachedChain] = {}
        # block_tables' answer per request, read once per change of its tables (dropped by every change): the
        # engine asks for every running request's tables twice a step, and rebuilding them is O(context).
        self._table_ids: dict[Hashable, list[list[int]]] = {}
        # The longest sequence the pools can hold (None: any length).
        self.capacity_tokens = spaces_capacity(
            [p.num_blocks for p in self.pools],
            self.block_size,
            [self._in_space(self.group_max_blocks, s) for s in range(len(self.pools))],
        )

    # ---- queries ------------------------------------------------------------------

    @property
    def group_max_blocks(self) -> tuple[int | None, ...]:
        return tuple(m.spec.max_blocks for m in self.managers)

    @property
    def num_blocks(self) -> int:
        """Blocks of every space together."""
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.pools)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` tokens holds over all its tables."""
        return sum(m.spec.blocks_needed(num_tokens) for m in self.managers)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` tokens fits the pools at all (every space its blocks)."""
        need = self._by_space([m.spec.blocks_needed(num_tokens) for m in self.managers])
        return all(n <= p.num_blocks for n, p in zip(need, self.pools, strict=True))

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._chains

    def block_tables(self, request_id: Hashable) -> list[list[int]]:
        """The request's block ids, one table per layer group (fresh lists: the caller may keep or change them)."""
        ids = self._table_ids.get(request_id)
        if ids is None:
            self._check_known(request_id)
            ids = self._table_ids[request_id] = self.read_block_tables(request_id)
        return [list(table) for table in ids]

    def read_block_tables(self, request_id: Hashable) -> list[list[int]]:
        """`block_tables` read from the tables themselves (its slow twin, which tests compare it with)."""
        self._check_known(request_id)
        return [[b.block_id for b in m.tables[request_id]] for m in self.managers]

    def stats(self) -> BlockPoolStats:
        """The pools' stats, block counts summed over the spaces (the prefix cache's figures: its one pool's)."""
        stats = [p.stats() for p in self.pools]
        own = self.pool.stats()
        return replace(
            own,
            num_blocks=sum(s.num_blocks for s in stats),
            num_free=sum(s.num_free for s in stats),
            num_owned=sum(s.num_owned for s in stats),
            num_cached_free=sum(s.num_cached_free for s in stats),
        )

    def can_allocate(self, request: Request, num_new_slots: int | None = None) -> bool:
        hits = self._match_prefix(request)[0]
        fresh = [m.spec.blocks_needed(request.num_tokens + (num_new_slots or 0)) for m in self.managers]
        fresh[0] -= len(hits)
        return self._short_space(fresh, hits) is None

    # ---- request lifecycle --------------------------------------------------------

    def loading(self, request: Request) -> bool:
        """Whether the request's blocks in the lower tier are still being read (begun here if not yet): it waits
        to be allocated meanwhile, and other requests run."""
        if self.lower_tier is None or not self.enable_prefix_cache:
            return False
        below = self._match_lower_tier(request, self._match_prefix(request, filtered=False)[1])
        return bool(below) and not self.lower_tier.prefetch(request.request_id, below)

    def joins_prefill(self, request: Request, prefilling: Sequence[Request], min_tokens: int) -> bool:
        """Whether one of these prefilling requests is yet to compute at least `min_tokens` of the request's tokens
        after its cached prefix (the same tokens before them): the request then waits to find them cached instead of
        computing them beside it. Agents that share a system prompt and arrive together: admitted while the first
        one prefilled it in budgeted steps, two of them computed 1,569 and 1,173 of its ~2,350 tokens again, each
        step of it a stall for the decoding streams (bench fleet; docs/design/issue38-load.md, session 31)."""
        if not self.enable_prefix_cache or not prefilling:  # asked every step a request waits: no lookup for nothing
            return False
        index = len(self._match_prefix(request, filtered=False)[0])
        last = (request.num_tokens - 1) // self.block_size  # never the block of its last token (it must run one)
        wanted = -(-min_tokens // self.block_size)  # blocks
        if last - index < wanted:
            return False
        mine = list(self.hashes.iter(request, index, index + wanted))
        return any(
            other.num_computed_tokens < (index + 1) * self.block_size
            and list(self.hashes.iter(other, index, index + wanted)) == mine
            for other in prefilling
        )

    def forget_loading(self, request_id: Hashable) -> None:
        """A waiting request went away: what was read for it is dropped."""
        if self.lower_tier is not None:
            self.lower_tier.forget(request_id)

    def allocate(self, request: Request, num_new_slots: int | None = None) -> Allocation:
        """Give a new request tables for its tokens (plus `num_new_slots` reserved slots), sharing
        the longest cached prefix of full blocks. Atomic: on NoFreeBlocksError nothing changed."""
        rid, num_tokens = request.request_id, request.num_tokens
        extra = 0 if num_new_slots is None else num_new_slots
        if rid in self._chains:
            raise ValueError(f"request {rid!r} already has blocks")
        if not num_tokens:
            raise ValueError("cannot allocate an empty prompt: the model needs a token to run")
        if extra < 0:
            raise ValueError(f"num_new_slots must be >= 0, got {extra}")
        hits, hashes = self._match_prefix(request, filtered=False)  # only with the prefix cache: then one table
        below = self._match_lower_tier(request, hashes)  # blocks after the hits, in the lower tier
        pages = self.lower_tier.read(below, rid) if below and self.lower_tier is not None else []
        below = below[: len(pages)]  # the run read and checked
        usable = self._resume_point(hashes + below)
        hits, hashes = hits[:usable], hashes[:usable]
        below = below[: usable - len(hits)]
        partial = None if below else self._match_partial(request, hashes)
        fresh = [m.spec.blocks_needed(num_tokens + extra) for m in self.managers]
        fresh[0] -= len(hits)
        self._check_free(fresh, hits)
        self.pool.touch(hits)
        # The partial block is one of the free blocks counted above: it is the first fresh block (one group).
        taken = [self.pool.take_partial_block(partial[0])] if partial else []
        tables = self._take(fresh, taken)
        if self.enable_prefix_cache:
            self.pool.record_prefix_query(num_tokens, len(hits) * self.block_size + (partial[1] if partial else 0))
        loaded = self._write_lower_tier(tables[0][: len(below)], below, pages)  # the first fresh blocks
        hashes = hashes + below
        tables[0] = hits + tables[0]
        for manager, table in zip(self.managers, tables, strict=True):
            manager.tables[rid] = table
        self._table_ids.pop(rid, None)
        cached = (len(hits) + loaded) * self.block_size + (partial[1] if partial else 0)
        chain = _CachedChain(hashes, self.pool.cache_epoch, root=_partial_root(request))
        if partial:
            chain.partial = (taken[0], tuple(request.token_ids_between(len(hits) * self.block_size, cached)))
        self._chains[rid] = chain
        tables_ids = [[b.block_id for b in t] for t in tables]
        return Allocation(tables_ids, cached, hashes[-1] if hashes else None, loaded * self.block_size)

    def allocate_slots(self, request: Request, num_tokens: int | None = None) -> list[list[int]]:
        """Grow the tables to hold `num_tokens` tokens (default: all of the request's; one more is
        room for a token not sampled yet, which a pipelined step writes early). A full table takes
        a block every block_size tokens, a full ring wraps. Returns the tables. Atomic: on
        NoFreeBlocksError nothing changed."""
        self.ensure_slots(request, num_tokens)
        return self.block_tables(request.request_id)

    def ensure_slots(self, request: Request, num_tokens: int | None = None) -> None:
        """`allocate_slots` without building the tables to return (the scheduler grows every running request
        each step and reads the tables later). Most steps grow nothing: the pool is then not asked."""
        rid = request.request_id
        self._check_known(rid)
        n = request.num_tokens if num_tokens is None else num_tokens
        grow = [m.num_new_blocks(rid, n) for m in self.managers]
        if any(grow):
            self._check_free(grow)
            for manager, blocks in zip(self.managers, self._take(grow), strict=True):
                manager.tables[rid] += blocks
            self._table_ids.pop(rid, None)
        for manager in self.managers:
            block = manager.block_at(rid, n - 1)
            if block.ref_cnt != 1:  # only computed full blocks are shared, so this is a manager bug
                raise RuntimeError(
                    f"position {n - 1} of {rid!r} would be written into block "
                    f"{block.block_id}, which has ref count {block.ref_cnt}"
                )

    def free_slots_after(self, request: Request, num_tokens: int) -> None:
        """Shrink full-attention tables to the blocks `num_tokens` tokens need: the slots of rejected
        speculative tokens go back to the pool. Rings are refused (their slots are reused, not grown)."""
        rid = request.request_id
        self._check_known(rid)
        if not request.num_computed_tokens <= num_tokens:
            raise ValueError(
                f"request {rid!r}: cannot free slots below its {request.num_computed_tokens} "
                f"computed tokens (asked to keep {num_tokens})"
            )
        for manager, space in zip(self.managers, self.spaces, strict=True):
            if not manager.spec.rolls_back:
                raise ValueError(f"request {rid!r}: a sliding-window ring cannot give back speculative slots")
            table = manager.tables[rid]
            keep = manager.spec.blocks_needed(num_tokens)
            if len(table) > keep:
                self.pools[space].free_blocks(list(reversed(table[keep:])))
                del table[keep:]
                self._table_ids.pop(rid, None)

    def cache_blocks(self, request: Request) -> None:
        """Enter the request's full computed blocks into the prefix cache (the scheduler calls this
        after advancing `request.num_computed_tokens`). Only computed blocks: a hit on unwritten KV
        would be garbage."""
        rid, computed = request.request_id, request.num_computed_tokens
        chain = self._chain(rid)
        bs = self.block_size
        if not len(chain.block_hashes) * bs <= computed <= request.num_tokens or any(
            m.num_new_blocks(rid, computed) for m in self.managers
        ):
            raise ValueError(
                f"request {rid!r}: {computed} computed tokens must be within "
                f"{len(chain.block_hashes) * bs}..{request.num_tokens} and have slots"
            )
        if not self.enable_prefix_cache or chain.epoch != self.pool.cache_epoch:
            return
        table = self.managers[0].tables[rid]
        first = len(chain.block_hashes)  # the chain is a prefix of the request's hashes
        for i, block_hash in enumerate(self.hashes.iter(request, first, computed // bs), start=first):
            if table[i].block_hash is None:
                self.pool.cache_full_block(table[i], block_hash)
            chain.block_hashes.append(block_hash)
        start = len(chain.block_hashes) * bs  # == computed // bs * bs
        # A partial block is kept by its tokens only: not one where an image starts (another image, same tokens).
        partial = computed > start and not request.images_start_between(start, computed)
        chain.partial = (table[start // bs], tuple(request.token_ids_between(start, computed))) if partial else None

    def block_hash(self, request_id: Hashable, num_blocks: int) -> Hashable | None:
        """The chain hash of the request's first `num_blocks` blocks, once they are cached (else None)."""
        hashes = self._chain(request_id).block_hashes
        return hashes[num_blocks - 1] if 0 < num_blocks <= len(hashes) else None

    def fork(self, parent: Request, child: Request) -> list[CopyOnWrite]:
        """Give `child` a copy of the parent's computed sequence and return the copies the KV layer
        must do first. Computed full blocks of a full-attention table are shared and the rest are
        fresh, so neither side ever writes into a shared block; a partly computed block is copied.
        A ring is copied whole (at most ceil(window / block_size) + 1 blocks), far cheaper than
        having the child recompute its prompt. Atomic: on NoFreeBlocksError nothing changed."""
        pid, cid, computed = parent.request_id, child.request_id, parent.num_computed_tokens
        chain = self._chain(pid)
        if cid in self._chains:
            raise ValueError(f"request {cid!r} already has blocks")
        if child.token_ids_between(0, computed) != parent.token_ids_between(0, computed):
            raise ValueError(f"request {cid!r} does not start with the {computed} computed tokens of {pid!r}")
        shared = [min(m.spec.shareable_blocks(computed), len(m.tables[pid])) for m in self.managers]
        fresh = [len(m.tables[pid]) - n for m, n in zip(self.managers, shared, strict=True)]
        self._check_free(fresh)
        copies: list[CopyOnWrite] = []
        for manager, space, n, blocks in zip(self.managers, self.spaces, shared, self._take(fresh), strict=True):
            self.pools[space].touch(manager.tables[pid][:n])
            manager.tables[cid], more = manager.fork(manager.tables[pid], blocks, computed)
            self._table_ids.pop(cid, None)
            copies += [replace(c, space=space) for c in more]
        n_hashed = min(len(chain.block_hashes), shared[0])
        self._chains[cid] = _CachedChain(chain.block_hashes[:n_hashed], chain.epoch, root=chain.root)
        return copies

    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks. Tail blocks are queued first so that a chain is evicted tail
        before head (its head is the part other prompts most likely share)."""
        self._check_known(request_id)
        chain = self._chains.pop(request_id)
        tables = [m.tables.pop(request_id) for m in self.managers]
        self._table_ids.pop(request_id, None)
        for space, pool in enumerate(self.pools):
            pool.free_blocks(
                [b for s, table in zip(self.spaces, tables, strict=True) if s == space for b in reversed(table)]
            )
        if chain.partial is not None and chain.epoch == self.pool.cache_epoch and chain.partial[0].ref_cnt == 0:
            self.pool.cache_partial_block(chain.partial[0], chain.partial_parent, chain.partial[1])

    # ---- internals ----------------------------------------------------------------

    def _check_known(self, request_id: Hashable) -> None:
        if request_id not in self._chains:
            raise UnknownRequestError(request_id)

    def _chain(self, request_id: Hashable) -> _CachedChain:
        self._check_known(request_id)
        return self._chains[request_id]

    def _match_partial(self, request: Request, hashes: list[Hashable]) -> tuple[int, int] | None:
        """(block id, n): a free partial block holding the KV of the n tokens after the matched full
        blocks, never covering the last token; None without the prefix cache or a match. Never with a
        prefix filter: state layers resume from checkpoints at block boundaries only (state_cache.py)."""
        start, last = len(hashes) * self.block_size, request.num_tokens - 1
        if not self.enable_prefix_cache or self.prefix_filter is not None or start >= last:
            return None
        if request.images_start_between(start, last):  # a partial block is keyed by its tokens only
            return None
        parent = hashes[-1] if hashes else _partial_root(request)
        return self.pool.match_partial_block(parent, request.token_ids_between(start, last))

    def _match_lower_tier(self, request: Request, hashes: list[Hashable]) -> list[Hashable]:
        """Hashes of the blocks right after the pool's chain that the lower tier holds (a leading run),
        never covering the last token."""
        if self.lower_tier is None or not self.enable_prefix_cache:
            return []
        found = []
        for block_hash in self.hashes.iter(request, len(hashes), (request.num_tokens - 1) // self.block_size):
            if not self.lower_tier.contains(block_hash):
                break
            found.append(block_hash)
        return found

    def _write_lower_tier(self, blocks: list[KVCacheBlock], block_hashes: list[Hashable], pages: list) -> int:
        """Write the lower tier's pages (read already) into fresh `blocks` and cache them as the pool's own."""
        if not blocks or self.lower_tier is None:
            return 0
        self.lower_tier.write([b.block_id for b in blocks], block_hashes, pages[: len(blocks)])
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            self.pool.cache_full_block(block, block_hash)
        return len(blocks)

    def _resume_point(self, block_hashes: list[Hashable]) -> int:
        """How many leading blocks of the chain a request may use: all of them, or with a prefix filter the
        longest run ending where the model can resume, whose resume point `prepare_resume` made ready."""
        if self.prefix_filter is None:
            return len(block_hashes)
        usable = self.prefix_filter(block_hashes)
        while usable and self.prepare_resume is not None and not self.prepare_resume(block_hashes[usable - 1]):
            usable = self.prefix_filter(block_hashes[: usable - 1])
        return usable

    def _available_besides(self, hits: list[KVCacheBlock]) -> int:
        # Touching an evictable hit takes it out of the free pool without allocating it.
        return self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)

    def _in_space(self, per_group: Sequence, space: int) -> list:
        """The entries of `per_group` whose group draws from `space`."""
        return [x for x, s in zip(per_group, self.spaces, strict=True) if s == space]

    def _by_space(self, counts: Sequence[int]) -> list[int]:
        """Per-group block counts summed per space."""
        return [sum(self._in_space(counts, s)) for s in range(len(self.pools))]

    def _short_space(self, counts: Sequence[int], hits: Sequence[KVCacheBlock] = ()) -> tuple[int, int, int] | None:
        """(needed, available, total) of the first space lacking the blocks of `counts` (per group; the prefix
        cache's `hits` are in `pool`'s space), or None when every space has them."""
        for need, pool in zip(self._by_space(counts), self.pools, strict=True):
            available = self._available_besides(list(hits)) if pool is self.pool else pool.num_free_blocks
            if need > available:
                return need, available, pool.num_blocks
        return None

    def _check_free(self, counts: Sequence[int], hits: Sequence[KVCacheBlock] = ()) -> None:
        """Raise NoFreeBlocksError (before anything changes) unless every space has its blocks of `counts`."""
        short = self._short_space(counts, hits)
        if short is not None:
            raise NoFreeBlocksError(*short)

    def _take(self, counts: Sequence[int], first: Sequence[KVCacheBlock] = ()) -> list[list[KVCacheBlock]]:
        """Fresh blocks per group, `counts[i]` each from its space's pool, in group order (`_check_free` first);
        `first`: blocks already taken from `pool`, handed out before its new ones."""
        fresh = []
        for n, pool in zip(self._by_space(counts), self.pools, strict=True):
            given = list(first) if pool is self.pool else []
            fresh.append(iter(given + pool.get_new_blocks(n - len(given))))
        return [[next(fresh[s]) for _ in range(n)] for n, s in zip(counts, self.spaces, strict=True)]

    def _match_prefix(self, request: Request, filtered: bool = True) -> tuple[list[KVCacheBlock], list[Hashable]]:
        """Longest chain of cached full blocks for the request's tokens and their hashes, never covering
        the last token (the model must run at least one position to produce logits); `filtered`: cut to
        the prefix filter's usable run (allocate filters the pool's and the lower tier's run together)."""
        if not self.enable_prefix_cache:
            return [], []
        hits: list[KVCacheBlock] = []
        hashes: list[Hashable] = []
        for block_hash in self.hashes.iter(request, 0, (request.num_tokens - 1) // self.block_size):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
            hashes.append(block_hash)
        if filtered and self.prefix_filter is not None:
            usable = self.prefix_filter(hashes)
            hits, hashes = hits[:usable], hashes[:usable]
        return hits, hashes


def _partial_root(request: Request) -> Hashable | None:
    """The key of a request's partial block when no full block comes before it: a full block's hash names the
    adapter the request runs with (block_hashes.py), so a partial block with none before it names it here."""
    return None if request.adapter is None else ("adapter", request.adapter)
