"""A cache manager plus the Requests it serves: the test side of the scheduler's part."""

from mlxpaged.cache.block_pool import BlockPool
from mlxpaged.cache.kv_cache_manager import KVCacheManager, UnknownRequestError
from mlxpaged.cache.specs import FullAttentionSpec, SlidingWindowSpec
from mlxpaged.engine.request import Request

BS = 8
UNLIMITED = 1 << 30


def manager_for(num_blocks, bs=16, groups=(None,), prefix_cache=True, **kwargs) -> KVCacheManager:
    """A manager whose groups are full attention (None) or sliding-window rings of `cap` blocks."""
    specs = [FullAttentionSpec(bs) if cap is None else SlidingWindowSpec(bs, (cap - 1) * bs) for cap in groups]
    return KVCacheManager(BlockPool(num_blocks), specs, enable_prefix_cache=prefix_cache, **kwargs)


def slots_for(manager: KVCacheManager, request: Request, start: int, end: int, group: int = 0) -> list[int]:
    """Physical slots (block * block_size + offset) of positions [start, end) in one group's
    table. In a ring, later positions reuse the slots of those a window earlier."""
    rid = request.request_id
    if rid not in manager:
        raise UnknownRequestError(rid)
    table = manager.managers[group]
    if not 0 <= start <= end <= request.num_tokens or table.num_new_blocks(rid, end):
        raise ValueError(
            f"slot range [{start}, {end}) outside the {request.num_tokens} tokens of request {rid!r} that have slots"
        )
    bs = manager.block_size
    return [table.block_at(rid, p).block_id * bs + p % bs for p in range(start, end)]


def lookup_prefix(manager: KVCacheManager, token_ids) -> int:
    """Tokens allocate() would take from the cache now (the manager's own matching); no side effects, no stats."""
    probe = Request("probe", list(token_ids), UNLIMITED)
    hits, hashes = manager._match_prefix(probe)
    partial = manager._match_partial(probe, hashes)
    return len(hits) * manager.block_size + (partial[1] if partial else 0)


class Sequences:
    """The manager plus the Requests it serves, by id, written as the scheduler writes them."""

    def __init__(self, manager: KVCacheManager):
        self.manager = manager
        self.requests: dict = {}

    def __getattr__(self, name):  # queries go straight to the manager
        return getattr(self.manager, name)

    def __contains__(self, request_id) -> bool:
        return request_id in self.manager

    def request(self, request_id) -> Request:
        """The live request, or a stand-in the manager does not know (it raises UnknownRequestError)."""
        return self.requests.get(request_id) or Request(request_id, [0], UNLIMITED)

    def allocate(self, request_id, token_ids, num_new_slots=None):
        request = Request(request_id, list(token_ids), UNLIMITED)
        allocation = self.manager.allocate(request, num_new_slots)
        request.num_computed_tokens = allocation.num_cached_tokens
        self.requests[request_id] = request
        return allocation

    def can_allocate(self, token_ids, num_new_slots=None) -> bool:
        return self.manager.can_allocate(Request("probe", list(token_ids), UNLIMITED), num_new_slots)

    def mark_computed(self, request_id, num_computed_tokens) -> None:
        request = self.request(request_id)
        before, request.num_computed_tokens = request.num_computed_tokens, num_computed_tokens
        try:
            self.manager.cache_blocks(request)
        except ValueError:
            request.num_computed_tokens = before
            raise

    def append_slot(self, request_id, token_id) -> None:
        request = self.request(request_id)
        request.output_token_ids.append(token_id)
        try:
            self.manager.allocate_slots(request)
        except Exception:
            request.output_token_ids.pop()
            raise

    def reserve_next_slot(self, request_id):
        request = self.request(request_id)
        return self.manager.allocate_slots(request, request.num_tokens + 1)

    def fork(self, parent_id, child_id):
        parent = self.request(parent_id)
        child = Request(child_id, parent.all_token_ids, UNLIMITED)
        copies = self.manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.requests[child_id] = child
        return copies

    def free(self, request_id) -> None:
        self.manager.free(request_id)
        del self.requests[request_id]

    def slots_for(self, request_id, start, end, group=0):
        return slots_for(self.manager, self.request(request_id), start, end, group)

    def lookup_prefix(self, token_ids) -> int:
        return lookup_prefix(self.manager, token_ids)

    def ref_count(self, block_id) -> int:
        return self.manager.pool.ref_count(block_id)

    def block_state(self) -> list[str]:
        return self.manager.pool.block_state()

    def reset_prefix_cache(self) -> None:
        self.manager.pool.reset_prefix_cache()

    def num_tokens(self, request_id) -> int:
        return self.requests[request_id].num_tokens

    def token_ids(self, request_id) -> list:
        return self.requests[request_id].all_token_ids

    def num_computed_tokens(self, request_id) -> int:
        return self.requests[request_id].num_computed_tokens


def pool_of(num_blocks, bs=16, enable_prefix_cache=True, group_max_blocks=(None,), **kwargs) -> Sequences:
    return Sequences(manager_for(num_blocks, bs, group_max_blocks, enable_prefix_cache, **kwargs))


def prompt(n_tokens, start=0):
    return list(range(start, start + n_tokens))


def computed_pool(pool, rid, tokens):
    """Allocate and mark the whole prompt computed, as the engine does after prefill."""
    alloc = pool.allocate(rid, tokens)
    pool.mark_computed(rid, len(tokens))
    return alloc
