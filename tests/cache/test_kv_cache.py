"""Page pools: slot writes, gathers by block table, copy-on-write, layer groups."""

from __future__ import annotations

import time

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.kv_cache import LayerGroup, PagedKVCache, block_bytes, group_layers
from mlxpaged.cache.specs import NoKVSpec, SlidingWindowSpec
from tests.tiny_models import shuffled_blocks

import mlx.core as mx
import numpy as np
import pytest

H, D, BS = 2, 4, 8


def small_cache(num_layers=2, num_blocks=16, windows=None) -> PagedKVCache:
    return PagedKVCache(num_layers, num_blocks, BS, H, D, mx.float32, windows)


def rand(*shape, seed=0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_pools_have_the_documented_layout():
    kv = small_cache()
    assert kv.keys[0].shape == (16, H, BS, D) and kv.values[1].dtype == mx.float32
    assert kv.nbytes == 2 * 2 * 16 * H * BS * D * 4


def test_write_lands_in_block_and_offset():
    kv = small_cache()
    slots = [5 * BS + 3, 0, 11 * BS + 7, 2 * BS]
    k, v = rand(4, H, D, seed=1), rand(4, H, D, seed=2)
    kv.write(1, slots, k, v)
    keys, values = np.array(kv.key_pool(1)), np.array(kv.value_pool(1))
    for t, slot in enumerate(slots):
        np.testing.assert_array_equal(keys[slot // BS, :, slot % BS], np.array(k[t]))
        np.testing.assert_array_equal(values[slot // BS, :, slot % BS], np.array(v[t]))
    assert np.count_nonzero(keys) == k.size and not np.any(np.array(kv.key_pool(0)))


def test_write_accepts_an_mx_slot_mapping():
    kv = small_cache()
    kv.write(0, mx.array([9, 10]), rand(2, H, D), rand(2, H, D))
    np.testing.assert_array_equal(np.array(kv.key_pool(0))[1, :, 1:3], np.array(rand(2, H, D)).transpose(1, 0, 2))


@pytest.mark.parametrize(
    "slots,k,message",
    [
        ([16 * BS], rand(1, H, D), "out of range"),
        ([1, 2], rand(1, H, D), "shape"),
        ([1], rand(1, H, D).astype(mx.float16), "dtype"),
    ],
)
def test_write_rejects_bad_input(slots, k, message):
    with pytest.raises(ValueError, match=message):
        small_cache().write(0, slots, k, k)


def test_gather_follows_a_shuffled_table():
    kv = small_cache(num_blocks=32)
    table = shuffled_blocks(32, seed=3)[:4]
    k, v = rand(29, H, D, seed=4), rand(29, H, D, seed=5)
    slots = [table[p // BS] * BS + p % BS for p in range(29)]
    kv.write(0, slots, k, v)
    gk, gv = kv.gather(0, table, 29)
    assert gk.shape == (H, 29, D)
    np.testing.assert_array_equal(np.array(gk), np.array(k).transpose(1, 0, 2))
    np.testing.assert_array_equal(np.array(gv), np.array(v).transpose(1, 0, 2))
    with pytest.raises(ValueError, match="need 4 blocks"):
        kv.gather(0, table[:3], 29)


def test_gather_blocks_batches_tables():
    kv = small_cache()
    k = rand(16 * H * BS, D, seed=6).reshape(16, H, BS, D)
    kv.keys[0] = k  # direct pool fill for the check
    out, _ = kv.gather_blocks(0, mx.array([[3, 1], [7, 7]], dtype=mx.int32))
    assert out.shape == (2, H, 2 * BS, D)
    ref = np.array(k)
    np.testing.assert_array_equal(np.array(out[0, :, BS:]), ref[1])
    np.testing.assert_array_equal(np.array(out[1, :, :BS]), ref[7])


def test_copy_blocks_copies_every_layer():
    kv = small_cache(num_layers=3)
    for layer in range(3):
        k, v = rand(BS, H, D, seed=layer), rand(BS, H, D, seed=9 + layer)
        kv.write(layer, [2 * BS + i for i in range(BS)], k, v)
    before = [np.array(p) for p in kv.keys + kv.values]
    kv.copy_blocks([(2, 9)])
    for b, after in zip(before, kv.keys + kv.values, strict=True):
        after = np.array(after)
        np.testing.assert_array_equal(after[9], b[2])
        np.testing.assert_array_equal(np.delete(after, 9, axis=0), np.delete(b, 9, axis=0))


@pytest.mark.parametrize("pairs", [[(1, 1)], [(1, 2), (3, 2)], [(1, 16)], [(1, 2), (2, 3)]])
def test_copy_blocks_rejects_bad_pairs(pairs):
    with pytest.raises(ValueError):
        small_cache().copy_blocks(pairs)


def peak_growth(fn) -> int:
    """Bytes allocated above the live set while `fn` runs (and its result is evaluated)."""
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    fn()
    return mx.get_peak_memory() - base


def test_write_run_equals_the_indexed_write_and_checks_its_range():
    run, indexed = small_cache(), small_cache()
    k, v = rand(1, H, 3, D, seed=3), rand(1, H, 3, D, seed=4)
    run.write_run(1, 5, 4, k, v)  # slots 5*BS+4 .. 5*BS+6
    indexed.write(1, [5 * BS + 4, 5 * BS + 5, 5 * BS + 6], k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))
    for a, b in ((run.key_pool(1), indexed.key_pool(1)), (run.value_pool(1), indexed.value_pool(1))):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    with pytest.raises(ValueError, match="outside the pool"):
        run.write_run(0, 5, 6, k, v)  # 6 + 3 > BS
    with pytest.raises(ValueError, match="outside the pool"):
        run.write_run(0, 16, 0, k, v)


def test_single_runs_are_recognised():
    from mlxpaged.cache.cache_view import _single_run

    assert _single_run([42], 1, BS) == (5, 2)
    assert _single_run([40, 41, 42], 3, BS) == (5, 0)
    assert _single_run([46, 47, 48], 3, BS) is None  # crosses into block 6
    assert _single_run([40, 42], 2, BS) is None and _single_run([41], 2, BS) is None


def test_write_and_copy_are_in_place():
    kv = PagedKVCache(1, 16384, 16, 4, 64, mx.float32)  # 64 MiB per pool
    pool_id, pool_bytes = id(kv.keys[0]), kv.keys[0].nbytes
    k = rand(3, 4, 64)
    grow = peak_growth(lambda: (kv.write(0, [5, 700, 90000], k, k), mx.eval(kv.keys, kv.values)))
    assert id(kv.keys[0]) == pool_id
    assert grow < pool_bytes // 16, f"write allocated {grow} bytes: the pool was copied"
    one = k[:1].transpose(1, 0, 2)[None]  # [1, kv_heads, 1, head_dim]
    grow = peak_growth(lambda: (kv.write_run(0, 9, 3, one, one), mx.eval(kv.keys, kv.values)))
    assert id(kv.keys[0]) == pool_id
    assert grow < pool_bytes // 16, f"write_run allocated {grow} bytes: the pool was copied"
    grow = peak_growth(lambda: (kv.copy_blocks([(0, 100), (43, 7)]), mx.eval(kv.keys, kv.values)))
    assert grow < pool_bytes // 16, f"copy_blocks allocated {grow} bytes: a pool was copied"


def test_write_time_does_not_scale_with_pool_size():
    k = rand(1, 4, 64)
    for num_blocks in (256, 16384):
        kv = PagedKVCache(1, num_blocks, 16, 4, 64, mx.float32)
        best = float("inf")
        for i in range(5):
            start = time.perf_counter()
            kv.write(0, [i * 16 + 3], k, k)
            mx.eval(kv.keys, kv.values)
            best = min(best, time.perf_counter() - start)
        print(f"write of 1 token into a {kv.keys[0].nbytes >> 20} MiB pool: {best * 1e3:.3f} ms")


# --- layer groups ------------------------------------------------------------------------------


def test_full_attention_model_is_one_group_of_all_layers():
    (group,) = group_layers([None] * 5)
    assert group == LayerGroup(0, (0, 1, 2, 3, 4), None)
    assert small_cache(num_layers=5).supports_prefix_cache


def test_five_sliding_one_full_pattern_makes_equal_groups_by_gcd():
    windows = ([512] * 5 + [None]) * 2  # 10 sliding, 2 full -> gcd 2
    groups = group_layers(windows)
    assert [g.layers for g in groups] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (5, 11)]
    assert [g.window for g in groups] == [512] * 5 + [None]
    assert [g.index for g in groups] == list(range(6))


def test_groups_split_by_window_size_and_cover_each_layer_once():
    windows = [4, 8, None, 4, 8, None, 4, 8, None]
    groups = group_layers(windows)
    assert {len(g.layers) for g in groups} == {3}
    assert sorted(layer for g in groups for layer in g.layers) == list(range(9))
    assert all(windows[layer] == g.window for g in groups for layer in g.layers)


def test_hybrid_cache_shares_pools_across_groups():
    windows = [8, 8, None, 8, 8, None]  # gemma3-style: groups of 2
    kv = small_cache(num_layers=6, windows=windows)
    assert kv.group_size == 2 and len(kv.keys) == 2 and not kv.supports_prefix_cache
    assert kv.key_pool(2) is kv.key_pool(0) and kv.key_pool(5) is kv.key_pool(1)
    assert kv.bytes_per_block == 2 * 2 * H * BS * D * 4
    assert block_bytes([None] * 6, BS, H, D, mx.float32.size) == 3 * kv.bytes_per_block


def test_window_group_is_a_ring_of_ceil_window_over_block_plus_one():
    spec = LayerGroup(0, (0,), 10).spec(4)  # a group's table behaves as its spec says
    assert spec == SlidingWindowSpec(4, 10)
    assert spec.max_blocks == 4 and spec.ring_tokens == 16
    assert [spec.blocks_needed(n) for n in (1, 4, 5, 16, 17, 1000)] == [1, 1, 2, 4, 4, 4]
    table = [7, 3, 9, 1]
    # Position 16 is logical block 4: it recycles the oldest block, table[0].
    assert spec.slots(table, 14, 18) == [1 * 4 + 2, 1 * 4 + 3, 7 * 4, 7 * 4 + 1]
    assert spec.key_start(5) == 0 and spec.key_start(30) == 21
    assert spec.stored_start(0, 40) == 24
    with pytest.raises(ValueError, match="at most 4"):
        spec.check_table([*table, 2], 40)
    with pytest.raises(ValueError, match="need 2"):
        spec.check_table(table[:1], 5)


def test_full_group_table_is_linear():
    spec = LayerGroup(0, (0,), None).spec(4)
    assert spec.max_blocks is None and spec.ring_tokens is None and spec.blocks_needed(1000) == 250
    assert spec.slots([5, 2], 3, 6) == [23, 8, 9]


def test_a_model_without_kv_layers_gets_one_group_of_zero_byte_blocks_and_no_pools():
    kv = PagedKVCache(0, 10, BS, None, None, geometries=())
    (group,) = kv.groups
    assert group.layers == () and kv.specs == (NoKVSpec(BS),) and not kv.specs[0].stores_kv
    assert kv.pools == [] and kv.bytes_per_block == 0 and kv.nbytes == 0
    assert kv.supports_prefix_cache and not kv.plain_full_attention  # blocks number tokens: the prefix cache works
    assert kv.specs[0].blocks_needed(2 * BS + 1) == 3 and kv.specs[0].shareable_blocks(2 * BS + 1) == 2


@pytest.mark.parametrize(
    "args",
    [
        (-1, 4, 8, 2, 4, mx.float32, None),  # no layers is a model without KV (above); fewer is nothing
        (2, 0, 8, 2, 4, mx.float32, None),
        (2, 4, 0, 2, 4, mx.float32, None),
        (2, 4, 8, 0, 4, mx.float32, None),
        (2, 4, 8, None, 4, mx.float32, None),  # uniform layers need their heads and width
        (2, 4, 8, 2, 4, mx.float32, [None]),
        (2, 4, 8, 2, 4, mx.float32, [None, 0]),
    ],
)
def test_constructor_validates(args):
    with pytest.raises(ValueError):
        PagedKVCache(*args)
