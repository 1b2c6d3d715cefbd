"""`mlxpaged bench memory`: KV bytes reserved, paged blocks vs mlx-lm's batch cache, and what prefix sharing saves."""

from __future__ import annotations

from argparse import Namespace

from mlxpaged.config import DEFAULT_BLOCK_SIZE
from mlxpaged.units import format_size


def kv_shape(model_name: str | None) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, dtype bytes) of a model as the CPU backend loads it, before loading."""
    from mlxpaged.loading.checkpoint import facts_before_load
    from mlxpaged.loading.loader import default_dtype
    from mlxpaged.loading.model_store import provision, resolve

    kv = facts_before_load(provision(resolve(model_name), default_dtype()), "cpu").kv
    return kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype_bytes


def mlx_lm_batch_cache_bytes(prompt_lens: list[int], new_tokens: int, heads: int, head_dim: int) -> int:
    """Bytes one layer of mlx-lm's BatchKVCache holds for these requests (left-padded batch)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    longest = max(prompt_lens)
    cache = BatchKVCache(left_padding=[longest - n for n in prompt_lens])
    batch = len(prompt_lens)
    cache.update_and_fetch(mx.zeros((batch, heads, longest, head_dim)), mx.zeros((batch, heads, longest, head_dim)))
    step = mx.zeros((batch, heads, 1, head_dim))
    for _ in range(new_tokens):
        cache.update_and_fetch(step, step)
    return cache.nbytes


def paged_blocks(prompts: list[list[int]], new_tokens: int, block_size: int, prefix_cache: bool) -> int:
    """Blocks owned once every request has its prompt and `new_tokens` generated tokens."""
    from mlxpaged.cache.block_pool import BlockPool
    from mlxpaged.cache.kv_cache_manager import KVCacheManager
    from mlxpaged.cache.specs import FullAttentionSpec
    from mlxpaged.engine.request import Request

    manager = KVCacheManager(BlockPool(100_000), [FullAttentionSpec(block_size)], enable_prefix_cache=prefix_cache)
    for rid, prompt in enumerate(prompts):
        request = Request(str(rid), list(prompt), max_tokens=new_tokens + 1)
        request.num_computed_tokens = manager.allocate(request).num_cached_tokens
        request.num_computed_tokens = len(prompt)  # prefilled: full blocks become shareable
        manager.cache_blocks(request)
        for t in range(new_tokens):
            request.output_token_ids.append(1 + t)
            manager.allocate_slots(request)
    return manager.stats().num_owned


def bench_memory(args: Namespace) -> int:
    """KV bytes reserved for 16 ragged requests, paged vs mlx-lm's batch cache; prefix sharing."""
    import random

    layers, heads, head_dim, dtype_bytes = kv_shape(args.model)
    per_token = 2 * layers * heads * head_dim * dtype_bytes
    rng = random.Random(0)
    lens = [rng.randint(32, 1024) for _ in range(16)]
    new, block = 128, DEFAULT_BLOCK_SIZE
    needed = sum(n + new for n in lens) * per_token
    paged = paged_blocks([[rng.randrange(50, 40000) for _ in range(n)] for n in lens], new, block, True)
    paged_bytes = paged * block * per_token
    batch_bytes = mlx_lm_batch_cache_bytes(lens, new, heads, head_dim) * layers
    print(f"KV per token {per_token} B ({layers} layers x {heads} kv heads x {head_dim} x {dtype_bytes} B x K,V)")
    print(f"16 ragged requests, prompts {min(lens)}-{max(lens)} tokens, {new} new tokens each:")
    print(f"  tokens need            {format_size(needed):>10}")
    print(f"  paged (block {block})      {format_size(paged_bytes):>10}  {paged_bytes / needed:.3f}x of need")
    print(
        f"  mlx-lm BatchKVCache    {format_size(batch_bytes):>10}  {batch_bytes / needed:.3f}x of need "
        f"(measured nbytes of one layer x {layers})"
    )
    prefix = [rng.randrange(50, 40000) for _ in range(1024)]
    shared = [prefix + [rng.randrange(50, 40000) for _ in range(rng.randint(20, 200))] for _ in range(8)]
    cold = paged_blocks(shared, new, block, False) * block * per_token
    warm = paged_blocks(shared, new, block, True) * block * per_token
    print("8 requests sharing a 1,024-token prefix (+20-200 own tokens, 128 new):")
    print(f"  without prefix cache   {format_size(cold):>10}")
    print(f"  with prefix cache      {format_size(warm):>10}  saves {format_size(cold - warm)} ({1 - warm / cold:.0%})")
    return 0
