"""Pools per geometry class: each layer's own K and V widths and heads, K-is-V layers, pools shared by
the same position of every group only within one geometry, and the bytes the plan counts for them."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.specs import KVGeometry, assign_pools, group_layers, pool_block_bytes
from mlxpaged.platform.model_facts import KVShape

import mlx.core as mx
import numpy as np
import pytest

BS, NB = 4, 12
LATENT = KVGeometry(1, 8, 3)  # MLA: the latent as K, the RoPE key as "V"
WIDE = KVGeometry(2, 6, 4)  # V narrower than K, 2 heads
INDEXER = KVGeometry(1, 5, 5, k_is_v=True)  # DSA's indexer: update_and_fetch(k, k)


def rand(*shape, seed=0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def mixed(windows=None, geometries=(LATENT, INDEXER, WIDE)) -> PagedKVCache:
    return PagedKVCache(len(geometries), NB, BS, 1, 1, mx.float32, windows, geometries)


def reference_gather(written: dict, table: list[int], length: int, heads: int, dim: int) -> np.ndarray:
    """The slow twin of `gather`: each position's row looked up by its slot in what was written."""
    out = np.zeros((heads, length, dim), np.float32)
    for p in range(length):
        slot = table[p // BS] * BS + p % BS
        out[:, p] = written.get(slot, np.zeros((heads, dim), np.float32))
    return out


def test_each_layer_has_pools_of_its_own_heads_and_widths():
    kv = mixed()
    shapes = [(kv.key_pool(i).shape, kv.value_pool(i).shape) for i in range(3)]
    assert shapes == [
        ((NB, 1, BS, 8), (NB, 1, BS, 3)),
        ((NB, 1, BS, 5), (NB, 1, BS, 5)),
        ((NB, 2, BS, 6), (NB, 2, BS, 4)),
    ]
    assert kv.value_pool(1) is kv.key_pool(1)  # K-is-V: one array
    per_block = BS * (1 * (8 + 3) + 1 * 5 + 2 * (6 + 4)) * 4
    assert kv.bytes_per_block == per_block and kv.nbytes == NB * per_block
    assert kv.bytes_by_class() == {LATENT: NB * BS * 11 * 4, INDEXER: NB * BS * 5 * 4, WIDE: NB * BS * 20 * 4}
    assert not kv.single_geometry


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_write_then_gather_matches_the_slow_twin(layer):
    kv = mixed()
    geo = kv.geometry(layer)
    table, length = [7, 2, 9], 10
    slots = [table[p // BS] * BS + p % BS for p in range(length)]
    k = rand(length, geo.kv_heads, geo.k_dim, seed=layer)
    v = k if geo.k_is_v else rand(length, geo.kv_heads, geo.v_dim, seed=layer + 10)
    kv.write(layer, slots, k, v)
    got_k, got_v = kv.gather(layer, table, length)
    want_k = reference_gather({s: np.array(k[t]) for t, s in enumerate(slots)}, table, length, geo.kv_heads, geo.k_dim)
    want_v = reference_gather({s: np.array(v[t]) for t, s in enumerate(slots)}, table, length, geo.kv_heads, geo.v_dim)
    np.testing.assert_array_equal(np.array(got_k), want_k)
    np.testing.assert_array_equal(np.array(got_v), want_v)
    others = [i for i in range(3) if i != layer]
    assert not any(np.any(np.array(kv.key_pool(i))) for i in others)  # no other layer's pool was touched


def test_k_is_v_gather_returns_one_array_and_write_run_writes_once():
    kv = mixed()
    k = rand(1, 1, 3, 5, seed=3)
    kv.write_run(1, 4, 1, k, k)
    got_k, got_v = kv.gather_blocks(1, mx.array([[4]], dtype=mx.int32))
    assert got_v is got_k
    np.testing.assert_array_equal(np.array(got_k)[0, :, 1:4], np.array(k)[0])


def test_write_names_the_layer_and_the_width_it_expected():
    kv = mixed()
    with pytest.raises(ValueError, match=r"layer 2: v has shape \(1, 2, 6\), expected \(1, 2, 4\)"):
        kv.write(2, [0], rand(1, 2, 6), rand(1, 2, 6))


def test_copy_blocks_copies_every_pool_once():
    kv = mixed()
    for layer in range(3):
        geo = kv.geometry(layer)
        k = rand(BS, geo.kv_heads, geo.k_dim, seed=layer)
        kv.write(layer, list(range(3 * BS, 4 * BS)), k, k if geo.k_is_v else rand(BS, geo.kv_heads, geo.v_dim))
    kv.copy_blocks([(3, 8)])
    for pool in kv.pools:
        np.testing.assert_array_equal(np.array(pool[8]), np.array(pool[3]))
    assert len(kv.pools) == 5  # 3 key pools, 2 value pools (the indexer's K is its V)


def test_same_position_shares_a_pool_only_within_a_geometry():
    # gemma4-like: window layers of one geometry, a full layer of another; groups of one layer.
    small, large = KVGeometry(1, 4, 4), KVGeometry(1, 8, 8)
    windows, geometries = [8, 8, None, 8], [small, small, large, small]
    pool_of, pools = assign_pools(group_layers(windows), geometries)
    assert pool_of == [0, 0, 1, 0] and pools == [small, large]
    kv = mixed(windows, geometries)
    assert kv.key_pool(3) is kv.key_pool(0) and kv.key_pool(2).shape == (NB, 1, BS, 8)
    assert kv.bytes_per_block == BS * (8 + 16) * 4


def test_one_geometry_keeps_todays_pools():
    windows = [8, 8, None, 8, 8, None]
    geo = KVGeometry(2, 4, 4)
    pool_of, pools = assign_pools(group_layers(windows), [geo] * 6)
    # groups (0, 1), (3, 4), (2, 5): pool j serves the j-th layer of every group, as before classes
    assert pool_of == [0, 1, 0, 0, 1, 1] and pools == [geo, geo]
    assert len(pools) == 2 and PagedKVCache(6, NB, BS, 2, 4, mx.float32, windows).single_geometry


def test_plan_bytes_count_each_layers_real_widths():
    shape = KVShape(3, 1, 8, 4, None, (LATENT, INDEXER, WIDE))
    assert shape.bytes_per_token == (11 + 5 + 20) * 4
    assert (
        shape.block_bytes(BS) == mixed().bytes_per_block == pool_block_bytes([None] * 3, shape.layer_geometries, BS, 4)
    )
    with pytest.raises(ValueError, match="geometries has 2 entries for 3 layers"):
        KVShape(3, 1, 8, 4, None, (LATENT, WIDE))


def test_bad_geometries_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="v_dim == k_dim, got 4 and 3"):
        KVGeometry(1, 4, 3, k_is_v=True)
    with pytest.raises(ValueError, match="geometries has 1 entries for 2 layers"):
        PagedKVCache(2, NB, BS, 1, 4, mx.float32, None, [LATENT])


def test_the_plan_sizes_blocks_in_real_bytes():
    from mlxpaged.config import CacheConfig, SchedulerConfig
    from mlxpaged.platform.memory import DeviceFacts, ModelFacts, plan_memory

    # DeepSeek-V3-like: 61 layers caching a 512-wide latent and a 64-wide RoPE key, one "head", bf16.
    latent = KVShape(61, 1, 512, 2, None, (KVGeometry(1, 512, 64),) * 61)
    mac = DeviceFacts("metal", 64 * 2**30, 40_000_000_000, 48 * 2**30, "64 GB Mac")
    plan = plan_memory(
        mac,
        ModelFacts(latent, 4_000_000_000, 7168, 129280, 8192),
        CacheConfig(kv_memory=2**30),
        SchedulerConfig(max_num_seqs=4),
    )
    assert plan.bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # not 61 x 2 x 512 (K and V of the K width)
    assert plan.block_bytes == 16 * 70_272 and plan.num_blocks == 2**30 // plan.block_bytes
