"""Old home of the block pool, kept so that existing imports work while callers move (issue 13):
the pool is now block_pool.py (blocks only), the per-request tables kv_cache_manager.py, the
table arithmetic specs.py. `BlockPool` here is the old request-id API over them, for
app/bench.py's memory benchmark; it owns the `Request`s it creates."""

from __future__ import annotations

from typing import Hashable, Sequence

from mlxpaged.block_pool import BlockPoolStats, NoFreeBlocksError, sha256_block_hash  # noqa: F401
from mlxpaged.block_pool import BlockPool as _Blocks
from mlxpaged.kv_cache_manager import Allocation, CopyOnWrite, KVCacheManager, UnknownRequestError  # noqa: F401
from mlxpaged.request import Request
from mlxpaged.specs import FullAttentionSpec, sequence_capacity, table_lengths  # noqa: F401


class BlockPool:
    """One full-attention table per request, keyed by request id (the pre-split API)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_cache: bool = True):
        self.manager = KVCacheManager(_Blocks(num_blocks), [FullAttentionSpec(block_size)],
                                      enable_prefix_cache=enable_prefix_cache)
        self._requests: dict[Hashable, Request] = {}

    def allocate(self, request_id: Hashable, token_ids: Sequence[int]) -> Allocation:
        request = Request(request_id, list(token_ids), max_tokens=1)
        allocation = self.manager.allocate(request)
        request.num_computed_tokens = allocation.num_cached_tokens
        self._requests[request_id] = request
        return allocation

    def mark_computed(self, request_id: Hashable, num_computed_tokens: int) -> None:
        request = self._requests[request_id]
        request.num_computed_tokens = num_computed_tokens
        self.manager.cache_blocks(request)

    def append_slot(self, request_id: Hashable, token_id: int) -> None:
        request = self._requests[request_id]
        request.output_token_ids.append(token_id)
        try:
            self.manager.allocate_slots(request)
        except NoFreeBlocksError:
            request.output_token_ids.pop()
            raise

    def free(self, request_id: Hashable) -> None:
        self.manager.free(request_id)
        del self._requests[request_id]

    def stats(self) -> BlockPoolStats:
        return self.manager.stats()
