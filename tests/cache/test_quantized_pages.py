"""Quantized page pools: layout, writes quantized as stored, gathers, copy-on-write, block export / import,
bytes per block, and the settings' checks."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache import group_fit
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.quantized_pages import QuantizedPages, store, store_pair
from mlxpaged.cache.specs import KVGeometry
from mlxpaged.config import CacheConfig
from mlxpaged.errors import ConfigError
from tests.msl.quantized_oracle import dequantize64

import mlx.core as mx
import numpy as np
import pytest

H, D, BS, NB = 2, 64, 8, 12


def cache(bits: int | None = 8, group: int | None = None, dtype=mx.float32, layers: int = 2, **kw) -> PagedKVCache:
    quant = None if bits is None else KVQuantization(bits, group)
    return PagedKVCache(layers, NB, BS, H, D, dtype, quantization=quant, **kw)


def rand(*shape, seed=0, dtype=mx.float32) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def round_trip(x: mx.array, bits: int, group: int | None = None) -> mx.array:
    """As the pages quantize (group_fit.py, checked against its float64 twin in test_group_fit.py)."""
    return group_fit.round_trip(x, KVQuantization(bits, group))


@pytest.mark.parametrize("bits,group", [(8, 32), (8, 64), (4, 64), (4, 32)])
def test_pools_are_laid_out_as_mx_quantize_lays_them_out(bits, group):
    kv = cache(bits, group, mx.float16)
    pool = kv.key_pool(0)
    assert isinstance(pool, QuantizedPages) and pool.shape == (NB, H, BS, D) and pool.dtype == mx.float16
    assert pool.data.shape == (NB, H, BS, D * bits // 32) and pool.data.dtype == mx.uint32
    assert pool.scales.shape == pool.biases.shape == (NB, H, BS, D // group)
    assert pool.scales.dtype == pool.biases.dtype == mx.float16
    # pools: every array of every pool (2 layers x K and V x data, scales, biases)
    assert len(kv.pools) == 12 and all(any(p is a for a in kv.pools) for p in pool.arrays)
    assert kv.nbytes == sum(p.nbytes for p in kv.pools) == NB * kv.bytes_per_block


@pytest.mark.parametrize("bits", [8, 4])
def test_writes_store_quantized_rows_and_gathers_dequantize_them(bits):
    kv = cache(bits)
    slots = [5 * BS + 3, 0, 11 * BS + 7, 2 * BS]
    k, v = rand(4, H, D, seed=1), rand(4, H, D, seed=2)
    kv.write(1, slots, k, v)
    keys = dequantize64(kv.key_pool(1))  # NumPy's own unpacking of the stored words
    for t, slot in enumerate(slots):
        np.testing.assert_allclose(keys[slot // BS, :, slot % BS], np.array(round_trip(k[t], bits)), atol=1e-6)
    got_k, got_v = kv.gather(1, [5], 4)  # block 5, offsets 0..3: slot 5*BS+3 is token 3
    np.testing.assert_array_equal(np.array(got_k[:, 3]), np.array(round_trip(k[0], bits)))
    np.testing.assert_array_equal(np.array(got_v[:, 3]), np.array(round_trip(v[0], bits)))
    error = np.abs(np.array(got_k[:, 3]) - np.array(k[0])).max()
    assert 0 < error < {8: 0.05, 4: 0.8}[bits]  # quantized, within the quantization's step


def test_a_run_write_equals_the_indexed_write():
    a, b = cache(4), cache(4)
    k, v = rand(1, H, 5, D, seed=3), rand(1, H, 5, D, seed=4)
    a.write_run(0, 7, 2, k, v)
    b.write(0, [7 * BS + 2 + i for i in range(5)], k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))
    for x, y in zip(a.pools, b.pools, strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_copy_on_write_copies_data_scales_and_biases():
    kv = cache(8)
    for layer in range(2):
        kv.write(layer, [3 * BS + i for i in range(BS)], rand(BS, H, D, seed=layer), rand(BS, H, D, seed=9 + layer))
    kv.copy_blocks([(3, 10)])
    for pool in kv.pools:
        np.testing.assert_array_equal(np.array(pool[10]), np.array(pool[3]))
    np.testing.assert_array_equal(np.array(kv.gather(1, [10], BS)[0]), np.array(kv.gather(1, [3], BS)[0]))


@pytest.mark.parametrize(
    "bits,dtype", [(None, mx.float32), (None, mx.bfloat16), (8, mx.float16), (4, mx.bfloat16), (8, mx.float32)]
)
def test_export_and_import_round_trip_every_array_of_a_block(bits, dtype):
    src, dst = cache(bits, dtype=dtype), cache(bits, dtype=dtype)
    for layer in range(2):
        kv_rows = rand(BS, H, D, seed=layer, dtype=dtype), rand(BS, H, D, seed=5 + layer, dtype=dtype)
        src.write(layer, [4 * BS + i for i in range(BS)], *kv_rows)
    pages = src.export_block(4)
    assert len(pages) == len(src.pools) and all(isinstance(p, np.ndarray) for p in pages)
    dst.import_block(9, pages)
    for a, b in zip(src.pools, dst.pools, strict=True):
        assert mx.array_equal(a[4], b[9]).item()
    assert mx.array_equal(src.gather(0, [4], BS)[0], dst.gather(0, [9], BS)[0]).item()
    assert all(np.array_equal(x, y) for x, y in zip(pages, dst.export_block(9), strict=True))
    with pytest.raises(ValueError, match=r"each needs \d+ arrays"):
        dst.import_block(1, pages[:-1])
    with pytest.raises(ValueError, match="out of range"):
        dst.export_block(NB)


def test_a_k_is_v_layer_keeps_one_quantized_pool():
    kv = PagedKVCache(
        1, NB, BS, None, None, mx.float32, geometries=[KVGeometry(1, 64, 64, True)], quantization=KVQuantization(8)
    )
    assert kv.value_pool(0) is kv.key_pool(0) and len(kv.pools) == 3
    k = rand(2, 1, 64, seed=7)
    kv.write(0, [0, 1], k, k)
    got_k, got_v = kv.gather(0, [0], 2)
    assert mx.array_equal(got_k, got_v).item() and mx.array_equal(got_k[0], round_trip(k[:, 0], 8)).item()


def test_quantized_block_bytes_hold_the_promised_token_ratios():
    full = cache(None, dtype=mx.float16).bytes_per_block
    ratio8, ratio4 = (full / cache(b, dtype=mx.float16).bytes_per_block for b in (8, 4))  # each kv_bits' groups
    assert ratio8 == pytest.approx(16 / 9) and ratio8 >= 1.77  # 8 bits + a 16-bit scale and bias per 32
    assert ratio4 == pytest.approx(16 / 4.5) and ratio4 >= 3.5  # 4 bits + a 16-bit scale and bias per 64
    assert full / cache(8, 64, dtype=mx.float16).bytes_per_block == pytest.approx(16 / 8.5)


def test_widths_that_do_not_split_into_groups_are_refused_with_the_numbers():
    with pytest.raises(ConfigError, match=r"widths include 96 .*multiple of 64.*kv_group_size=32"):
        PagedKVCache(1, NB, BS, 2, 96, mx.float32, quantization=KVQuantization(8, 64))
    with pytest.raises(ConfigError, match="kv_bits"):
        CacheConfig(kv_bits=3)
    with pytest.raises(ConfigError, match="kv_group_size"):
        CacheConfig(kv_bits=8, kv_group_size=16)
    assert CacheConfig(kv_bits=4, kv_group_size=32).quantization == KVQuantization(4, 32)
    assert CacheConfig().quantization is None
    # Unset, each kv_bits takes its own groups: 32 at 8 bits (issue 41: cache/kv_quant.py), 64 at 4.
    assert CacheConfig(kv_bits=8).quantization == KVQuantization(8) == KVQuantization(8, 32)
    assert CacheConfig(kv_bits=4).quantization == KVQuantization(4) == KVQuantization(4, 64)


@pytest.mark.parametrize("bits", [8, 4])
def test_k_and_v_quantized_in_one_call_equal_each_stored_alone(bits):
    """store_pair quantizes a layer's K and V side by side in one call: the same arrays as two stores."""
    paired, apart = cache(bits), cache(bits)
    index = (mx.array([[3], [7]]), mx.arange(H)[None, :], mx.array([[1], [5]]))
    k, v = rand(2, H, D, seed=11), rand(2, H, D, seed=12) * 4
    store_pair(paired.key_pool(0), paired.value_pool(0), index, k, v)
    store(apart.key_pool(0), index, k)
    store(apart.value_pool(0), index, v)
    for x, y in zip(paired.pools, apart.pools, strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    assert not np.array_equal(np.array(paired.key_pool(0).data), np.array(paired.value_pool(0).data))
