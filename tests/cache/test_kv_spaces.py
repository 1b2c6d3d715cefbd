"""Pools per block space (kv_cache.py): gemma4's window and full layers of other head_dims get pools of their
own space's block count, ids of one space index only its pools, copies stay in their space, and a cache of one
geometry keeps its one space."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.specs import KVGeometry

import mlx.core as mx
import numpy as np
import pytest

BS = 4
WINDOW, FULL = KVGeometry(1, 8, 8), KVGeometry(2, 16, 16)
KINDS = [8, None, 8, None]  # two groups of two: window (layers 0, 2) and full (layers 1, 3)
GEOMETRIES = [WINDOW, FULL, WINDOW, FULL]


def cache(num_blocks=(3, 10)) -> PagedKVCache:
    return PagedKVCache(4, num_blocks, BS, None, None, mx.float32, KINDS, GEOMETRIES)


def rand(*shape, seed=0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_each_space_has_pools_of_its_own_block_count():
    kv = cache()
    assert kv.spaces == ((0,), (1,)) and kv.group_spaces == (0, 1) and kv.space_blocks == (3, 10)
    assert [kv.key_pool(layer).shape[0] for layer in range(4)] == [3, 10, 3, 10]
    window_block, full_block = 2 * 2 * BS * 8 * 4, 2 * 2 * 2 * BS * 16 * 4  # 2 layers, K and V, float32
    assert kv.nbytes == 3 * window_block + 10 * full_block
    assert kv.bytes_per_block == window_block + full_block  # one id in every space
    with pytest.raises(ValueError, match="ask space_blocks"):
        _ = kv.num_blocks
    assert cache(5).space_blocks == (5, 5) and cache(5).num_blocks == 5  # one count for every space


def test_ids_index_their_own_space():
    kv = cache()
    k, v = rand(BS, 2, 16), rand(BS, 2, 16, seed=1)
    kv.write(1, list(range(9 * BS, 10 * BS)), k, v)  # block 9: only the full space has it
    got_k, got_v = kv.gather(1, [9], BS)
    np.testing.assert_array_equal(np.array(got_k), np.array(k).transpose(1, 0, 2))
    np.testing.assert_array_equal(np.array(got_v), np.array(v).transpose(1, 0, 2))
    with pytest.raises(ValueError, match="out of range"):
        kv.write(0, list(range(9 * BS, 10 * BS)), rand(BS, 1, 8), rand(BS, 1, 8))  # the window space has 3
    with pytest.raises(ValueError, match="outside the pool"):
        kv.write_run(2, 5, 0, rand(1, 1, 2, 8), rand(1, 1, 2, 8))


def test_copies_stay_in_their_space():
    kv = cache()
    full_k, window_k = rand(BS, 2, 16, seed=2), rand(BS, 1, 8, seed=3)
    kv.write(3, list(range(BS)), full_k, full_k)  # full space, block 0
    kv.write(2, list(range(BS)), window_k, window_k)  # window space, block 0
    kv.copy_blocks([(0, 7)], space=1)
    np.testing.assert_array_equal(np.array(kv.gather(3, [7], BS)[0]), np.array(full_k).transpose(1, 0, 2))
    kv.copy_blocks([(0, 2)], space=0)
    np.testing.assert_array_equal(np.array(kv.gather(2, [2], BS)[0]), np.array(window_k).transpose(1, 0, 2))
    assert not np.array(kv.gather(3, [2], BS)[0]).any()  # the full space's block 2 was not touched
    with pytest.raises(ValueError, match="out of range"):
        kv.copy_blocks([(0, 7)], space=0)


def test_one_geometry_keeps_one_space():
    kv = PagedKVCache(4, 6, BS, 2, 16, mx.float32, KINDS)
    assert kv.spaces == ((0, 1),) and kv.space_blocks == (6,) and kv.num_blocks == 6


def test_block_counts_must_match_the_spaces():
    with pytest.raises(ValueError, match="the layers make 2"):
        cache((3, 4, 5))
    with pytest.raises(ValueError, match="positive integers"):
        cache((3, 0))
