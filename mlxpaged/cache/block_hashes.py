"""Each request's chain of full-block hashes, each computed once (vLLM's `request.block_hashes`).

The prefix cache asks for a waiting request's hashes several times a step (`loading`, `can_allocate`,
`allocate`, and again every step it waits) and once more as its blocks are computed (`cache_blocks`). A
block's hash is a sha256 over its token ids: an 8k prompt's 509 blocks took ~3 ms each time on the 2-core
CPU, three times per step, on the host work that a cached prompt's time to first token waits on (design
note issue21-gpu, "Cached prefix: host time"). So they are kept per request and extended as its tokens
grow; a hash is a function of the tokens alone (and the manager's hash function and extra key), so it never
goes stale while they only grow. Whoever drops tokens (`Scheduler.drop_last_outputs`) calls `trim` at once,
before any token is appended again.

A new request repeats the blocks of earlier ones (a chat's next turn is the last one plus a few tokens), so the
hashes of recently hashed blocks are also kept by (parent hash, token ids), the hash function's own arguments:
a lookup instead of a sha256 (an 8k prompt: 0.06 ms against 1.2 ms on the 2-core CPU). Plain Python (no MLX).

"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterator

from mlxpaged.cache.block_pool import HashFn
from mlxpaged.engine.request import Request

# Blocks whose hashes are kept across requests: 256k tokens of recent prompts at block size 16, at most ~12 MB
# of keys (a tuple of the block's token ids each).
MAX_RECENT = 16384


class BlockHashes:
    """The chain hashes of each live request's full blocks, computed on first use. Held weakly by request,
    so a request that goes away (finished, or only ever probed) takes its hashes with it."""

    def __init__(self, block_size: int, hash_fn: HashFn, extra_key: object, max_recent: int = MAX_RECENT):
        self.block_size, self.hash_fn, self.extra_key = block_size, hash_fn, extra_key
        self._memo: weakref.WeakKeyDictionary[Request, list[Hashable]] = weakref.WeakKeyDictionary()
        # (parent hash, token ids, image digests, adapter id) -> hash of the blocks hashed lately, any request's;
        # emptied when full.
        self._recent: dict[tuple[Hashable | None, tuple, tuple, str | None], Hashable] = {}
        self.max_recent = max_recent

    def iter(self, request: Request, start: int = 0, stop: int | None = None) -> Iterator[Hashable]:
        """The hashes of full blocks start, start + 1, ... (up to `stop`, or every full block), each computed
        only when first reached: a caller that stops at the first miss hashes nothing past it."""
        memo = self._known(request)
        full = request.num_tokens // self.block_size
        for i in range(start, full if stop is None else min(stop, full)):
            while len(memo) <= i:  # the chain: every block before i first
                memo.append(self._hash(request, len(memo), memo[-1] if memo else None))
            yield memo[i]

    def first(self, request: Request, num_blocks: int) -> list[Hashable]:
        """The hashes of the first `num_blocks` full blocks (fewer if the request has fewer)."""
        return list(self.iter(request, 0, num_blocks))

    def trim(self, request: Request) -> None:
        """The request's last tokens were dropped: forget the hashes of the blocks they were in (tokens appended
        later may differ)."""
        self._known(request)

    def _known(self, request: Request) -> list[Hashable]:
        """The request's hashes so far, less those of blocks it no longer fills."""
        memo = self._memo.setdefault(request, [])
        full = request.num_tokens // self.block_size
        if len(memo) > full:
            del memo[full:]
        return memo

    def _hash(self, request: Request, index: int, parent: Hashable | None) -> Hashable:
        bs = self.block_size
        tokens = tuple(request.token_ids_between(index * bs, (index + 1) * bs))
        images = request.block_images(index, bs) if request.images else ()
        key = (parent, tokens, images, request.adapter)
        block_hash = self._recent.get(key)
        if block_hash is None:
            if len(self._recent) >= self.max_recent:
                self._recent.clear()  # a miss only costs a hash again
            # A block where an image starts hashes its digest too (the image's tokens are the same for any
            # image of its size); text blocks keep the hash they always had. Every block of a sequence run with an
            # adapter hashes the adapter's id: its K/V are the adapted model's, never the base model's or another's.
            extra = (self.extra_key, images) if images else self.extra_key
            if request.adapter is not None:
                extra = (extra, "adapter", request.adapter)
            block_hash = self._recent[key] = self.hash_fn(parent, tokens, extra)
        return block_hash
