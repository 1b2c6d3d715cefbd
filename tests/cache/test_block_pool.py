"""The block pool alone (blocks, ref counts, free queue, hash map, LRU), the layer specs, and the
rule that the pool, manager, specs and scheduler are plain Python."""

import inspect
import subprocess
import sys

from mlxpaged.cache.block_pool import BlockPool, KVCacheBlock, NoFreeBlocksError
from mlxpaged.cache.specs import FullAttentionSpec, LayerGroup, SlidingWindowSpec
from mlxpaged_app.bench.memory import paged_blocks
from tests.cache.kv_sequences import computed_pool, pool_of, prompt

import pytest
from hypothesis import given
from hypothesis import strategies as st

BS = 8


def test_new_blocks_come_from_the_free_list_then_the_lru_cached_ones():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"ha")
    pool.cache_full_block(b, b"hb")
    pool.free_blocks([b, a])  # b first: b is evicted first
    assert pool.block_state() == ["cached", "cached", "free", "free"] and pool.num_free_blocks == 4
    assert [x.block_id for x in pool.get_new_blocks(3)] == [2, 3, b.block_id]
    assert pool.get_cached_block(b"hb") is None and pool.get_cached_block(b"ha") is a
    assert pool.stats().evictions == 1


def test_touch_takes_a_cached_block_out_of_the_eviction_queue():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h")
    pool.free_blocks([a])
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError) as err:
        pool.get_new_blocks(2)  # atomic: the one free block stays free
    assert (err.value.needed, err.value.available, err.value.total) == (2, 1, 2) and pool.num_free_blocks == 1


def test_misuse_is_refused_with_the_block_and_its_state():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h")
    with pytest.raises(RuntimeError, match="block 0 cannot be cached: ref count 1"):
        pool.cache_full_block(a, b"other")
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="block 0 freed with ref count 0"):
        pool.free_blocks([a])
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1, got 0"):
        BlockPool(0)


def test_reset_forgets_hashes_and_changes_the_epoch():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"a")
    pool.cache_full_block(b, b"b")
    pool.free_blocks([a])
    epoch = pool.cache_epoch
    pool.reset_prefix_cache()
    assert pool.cache_epoch == epoch + 1 and pool.get_cached_block(b"b") is None
    assert pool.block_state() == ["free", "owned", "free"]


def _values(obj, seen: set) -> list:
    """Every value reachable from a pool's attributes (containers and blocks followed)."""
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ in ("deque", "OrderedDict"):
        items = list(obj)
    elif isinstance(obj, KVCacheBlock):
        items = [getattr(obj, name) for name in obj.__slots__]
    elif isinstance(obj, BlockPool):
        items = list(vars(obj).values())
    else:
        return [obj]
    return [v for item in items for v in _values(item, seen)]


def test_the_block_pool_holds_no_per_request_state():
    seqs = pool_of(16, BS)
    computed_pool(seqs, "req-alpha", prompt(20))
    seqs.fork("req-alpha", "req-beta")
    seqs.append_slot("req-beta", 7)
    reachable = _values(seqs.manager.pool, set())
    assert reachable and not any(isinstance(v, str) and v.startswith("req-") for v in reachable)
    assert not any(type(v).__name__ == "Request" for v in reachable)
    for name, method in inspect.getmembers(BlockPool, inspect.isfunction):
        assert not any("request" in p for p in inspect.signature(method).parameters), name
    for rid in ("req-alpha", "req-beta"):  # the tables are the manager's
        assert rid in seqs.manager and seqs.manager.block_tables(rid)[0]


def test_pool_manager_specs_and_scheduler_import_no_mlx():
    code = (
        "import sys; import mlxpaged.cache.block_pool, mlxpaged.cache.kv_cache_manager, mlxpaged.cache.specs, "
        "mlxpaged.engine.scheduler, mlxpaged.engine.request; "
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- specs ------------------------------------------------------------------------------------


@given(n=st.integers(0, 500), window=st.integers(1, 100), bs=st.sampled_from([8, 16, 32]))
def test_a_ring_holds_every_block_a_later_query_reads(n, window, bs):
    spec = SlidingWindowSpec(bs, window)
    assert spec.skipped_blocks(n) == spec.key_start(n) // bs  # the first key a query at n reads
    live = -(-(n + 1) // bs) - spec.skipped_blocks(n)  # blocks from the window's start to position n
    assert live <= spec.max_blocks == -(-window // bs) + 1
    assert spec.blocks_needed(n) == min(-(-n // bs), spec.max_blocks) and spec.shareable_blocks(n) == 0


@given(n=st.integers(0, 500), bs=st.sampled_from([8, 16, 32]))
def test_full_attention_grows_shares_computed_blocks_and_frees_nothing(n, bs):
    spec = FullAttentionSpec(bs)
    assert spec.blocks_needed(n) == LayerGroup(0, (0,), None).spec(bs).blocks_needed(n) == -(-n // bs)
    assert spec.shareable_blocks(n) == n // bs and spec.skipped_blocks(n) == 0
    assert spec.table_index(n, n + 1) == n and spec.max_blocks is None


@given(
    window=st.one_of(st.none(), st.integers(1, 100)),
    bs=st.sampled_from([8, 16, 32]),
    table_length=st.integers(1, 40),
    data=st.data(),
)
def test_physical_blocks_are_physical_block_of_each(window, bs, table_length, data):
    """The slice (full attention) and the ring's wrap, against the one-block lookup they replace."""
    spec = FullAttentionSpec(bs) if window is None else SlidingWindowSpec(bs, window)
    table = list(range(100, 100 + (table_length if spec.max_blocks is None else spec.max_blocks)))
    first = data.draw(st.integers(0, 60 if spec.max_blocks is not None else len(table)))
    count = data.draw(st.integers(0, 60 if spec.max_blocks is not None else len(table) - first))
    assert spec.physical_blocks(table, first, count) == [spec.physical_block(table, first + i) for i in range(count)]


def test_layer_group_facts_are_importable_from_kv_cache_too():
    from mlxpaged.cache import kv_cache, specs

    assert kv_cache.LayerGroup is specs.LayerGroup and kv_cache.group_layers is specs.group_layers
    assert LayerGroup(0, (0,), 12).spec(8) == SlidingWindowSpec(8, 12)


def test_the_memory_bench_counts_owned_blocks_with_and_without_prefix_sharing():
    """`mlxpaged bench memory` counts blocks through the manager: 2 prompts of 20 tokens + 4 generated."""
    for cache, owned in ((True, 2 + 2 * 1), (False, 2 * 3)):  # 24 tokens: 3 blocks each
        assert paged_blocks([prompt(20), prompt(20)], 4, BS, cache) == owned
