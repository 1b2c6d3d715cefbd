"""Prefill attention computed by NumPy (kernels/numpy_attention.py) against the NumPy float64 oracle,
and the dispatch that sends only big eager calls there. Ragged-batch masks: test_cpu_attention.py runs
the same cases through both implementations."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention, numpy_attention
from mlxpaged.kernels.numpy_attention import QUERY_BLOCK, attend_numpy, numpy_attention_applies
from tests.kernels.test_reference_paged import write_sequence
from tests.msl.oracle import attend as oracle_attend
from tests.msl.oracle import causal_oracle, max_error, quantize, random_sinks

import mlx.core as mx
import numpy as np
import pytest
from threadpoolctl import threadpool_info


def case(
    seed: int,
    batch: int,
    heads: int,
    kv_heads: int,
    length: int,
    keys: int,
    dim: int,
    v_dim: int | None = None,
    dtype: str = "float32",
):
    rng = np.random.default_rng(seed)
    q, q64 = quantize(rng.standard_normal((batch, heads, length, dim)), dtype)
    k, k64 = quantize(rng.standard_normal((batch, kv_heads, keys, dim)), dtype)
    v, v64 = quantize(rng.standard_normal((batch, kv_heads, keys, v_dim or dim)), dtype)
    return rng, (q, k, v), (q64, k64, v64)


@pytest.mark.parametrize(
    "length,keys",
    [
        (1, 1),
        (5, 5),
        (QUERY_BLOCK - 1, QUERY_BLOCK - 1),
        (QUERY_BLOCK, QUERY_BLOCK),
        (QUERY_BLOCK + 1, QUERY_BLOCK + 1),
        (200, 200),
        (130, 400),
        (8, 1000),
    ],
)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 96)])
def test_causal_across_query_blocks(length, keys, heads, kv_heads, head_dim):
    """Bottom-right causal: queries sit at the end of the keys (a chunk after a cached prefix)."""
    _, (q, k, v), (q64, k64, v64) = case(length * 1000 + keys + heads, 1, heads, kv_heads, length, keys, head_dim)
    out = attend_numpy(q, k, v, head_dim**-0.5, "causal")
    expected = causal_oracle(q64[0], k64[0], v64[0], head_dim**-0.5, query_offset=keys - length)
    assert max_error(out, expected[None]) < 1e-5


@pytest.mark.parametrize("mask", ["causal", None])
def test_sinks_and_value_width(mask):
    """gpt-oss sinks join each head's max and denominator; V may be narrower than K (latent attention)."""
    heads, kv_heads, length, keys = 8, 2, 90, 150
    rng, (q, k, v), (q64, k64, v64) = case(7, 1, heads, kv_heads, length, keys, 64, v_dim=32)
    sinks, sinks64 = random_sinks(rng, heads)
    out = attend_numpy(q, k, v, 0.125, mask, sinks)
    if mask == "causal":
        expected = causal_oracle(q64[0], k64[0], v64[0], 0.125, query_offset=keys - length, sinks64=sinks64)
    else:
        expected = oracle_attend(q64[0], k64[0], v64[0], 0.125, np.ones((length, keys), bool), sinks64)
    assert out.shape == (1, heads, length, 32)
    assert max_error(out, expected[None]) < 1e-5


def test_a_half_precision_additive_mask():
    """deepseek-style models add position scores as a mask in the model's dtype; NumPy has no bfloat16."""
    rng, (q, k, v), (q64, k64, v64) = case(13, 1, 4, 2, 70, 90, 32, dtype="bfloat16")
    bias, bias64 = quantize(rng.standard_normal((70, 90)), "bfloat16")
    out = attend_numpy(q, k, v, 0.2, bias)
    expected = np.stack(
        [oracle_attend_biased(q64[0, h], k64[0, h // 2], v64[0, h // 2], 0.2, bias64) for h in range(4)]
    )
    assert out.dtype == mx.bfloat16
    assert max_error(out, expected[None]) < 2e-2


def oracle_attend_biased(q, k, v, scale, bias):
    """float64 softmax(q k^T * scale + bias) v for one head."""
    scores = q @ k.T * scale + bias
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def test_half_precision_inputs_keep_their_dtype():
    _, (q, k, v), (q64, k64, v64) = case(11, 1, 4, 2, 40, 40, 64, dtype="bfloat16")
    out = attend_numpy(q, k, v, 0.125, "causal")
    assert out.dtype == mx.bfloat16
    assert max_error(out, causal_oracle(q64[0], k64[0], v64[0], 0.125)[None]) < 1e-2


def test_the_call_leaves_blas_threads_as_it_found_them():
    before = [lib["num_threads"] for lib in threadpool_info()]
    _, (q, k, v), _ = case(1, 1, 9, 3, 300, 300, 64)
    attend_numpy(q, k, v, 0.125, "causal")
    assert [lib["num_threads"] for lib in threadpool_info()] == before


def test_which_calls_apply():
    q = mx.zeros((1, 9, 512, 64))
    assert numpy_attention_applies(q, mx.zeros((1, 3, 512, 64)), "causal")
    assert not numpy_attention_applies(q[:, :, :8], mx.zeros((1, 3, 8, 64)), "causal")  # too small for a sync
    assert not numpy_attention_applies(q, mx.zeros((1, 3, 100, 64)), "causal")  # queries no key would see
    assert not numpy_attention_applies(q, mx.zeros((1, 2, 512, 64)), None)  # 9 heads over 2 KV heads


def test_eager_sdpa_sends_big_calls_to_numpy_and_small_ones_to_mlx(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "attend_numpy", lambda *a, **kw: calls.append("numpy") or mx.zeros((1,)))
    monkeypatch.setattr(attention, "attend", lambda *a, **kw: calls.append("mlx") or mx.zeros((1,)))
    monkeypatch.setattr(attention, "resolved_backend", lambda: "cpu")
    big, small = mx.zeros((1, 9, 512, 64)), mx.zeros((1, 9, 4, 64))
    attention.eager_sdpa(big, mx.zeros((1, 3, 512, 64)), mx.zeros((1, 3, 512, 64)), 0.125, "causal")
    attention.eager_sdpa(small, mx.zeros((1, 3, 4, 64)), mx.zeros((1, 3, 4, 64)), 0.125, "causal")
    attention.sdpa(big, mx.zeros((1, 3, 512, 64)), mx.zeros((1, 3, 512, 64)), 0.125, "causal")  # compiled passes
    assert calls == ["numpy", "mlx", "mlx"]


def test_agrees_with_the_mlx_path_at_the_threshold(monkeypatch):
    """Just above MIN_SCORES both paths are in use in one engine; they must give the same numbers."""
    from mlxpaged.kernels.cpu_attention import attend

    length = -(-numpy_attention.MIN_SCORES // (9 * 256))
    _, (q, k, v), _ = case(5, 1, 9, 3, length, 256, 64)
    assert numpy_attention_applies(q, k, "causal")
    assert mx.allclose(attend_numpy(q, k, v, 0.125, "causal"), attend(q, k, v, 0.125, "causal"), atol=1e-5).item()


# --- pages read in place ---------------------------------------------------------------------------

PAGED_CASES = [
    # (prefix, chunk, block_size, heads, kv_heads, head_dim, key_tile)
    (0, 37, 16, 4, 2, 64, 32),  # a cold chunk: the diagonal crosses tiles
    (32, 8, 16, 9, 3, 64, 16),  # a hit on a block boundary, tile = one block
    (45, 19, 8, 8, 4, 128, 24),  # mid-block, tile not a multiple of the block size
    (100, 1, 32, 8, 1, 96, 4096),  # one query, one tile
    (300, 7, 16, 9, 3, 64, 64),  # many tiles split across the workers
    (10, 130, 16, 4, 4, 64, 48),  # three query blocks
]


@pytest.mark.parametrize("prefix,chunk,block_size,heads,kv_heads,head_dim,key_tile", PAGED_CASES)
def test_pages_in_place_against_the_oracle(monkeypatch, prefix, chunk, block_size, heads, kv_heads, head_dim, key_tile):
    monkeypatch.setattr(numpy_attention, "KEY_TILE", key_tile)
    monkeypatch.setattr(numpy_attention, "worker_count", lambda: 4)  # key splits to merge on any machine
    rng = np.random.default_rng(prefix * 7 + chunk)
    table, (k_pool, v_pool), _, (k64, v64) = write_sequence(
        rng, prefix + chunk, kv_heads, head_dim, block_size, "float32"
    )
    q, q64 = quantize(rng.standard_normal((1, heads, chunk, head_dim)), "float32")
    out = numpy_attention.attend_pages_numpy(q, k_pool, v_pool, list(table), prefix + chunk, head_dim**-0.5)
    expected = causal_oracle(q64[0], k64, v64, head_dim**-0.5, query_offset=prefix)
    assert max_error(out, expected[None]) < 1e-5


@pytest.mark.parametrize("key_tile", [16, 4096])
def test_pages_in_place_with_sinks_and_value_width(monkeypatch, key_tile):
    from tests.kernels.test_sinks_value_width import _scatter

    monkeypatch.setattr(numpy_attention, "KEY_TILE", key_tile)
    monkeypatch.setattr(numpy_attention, "worker_count", lambda: 4)
    rng = np.random.default_rng(key_tile)
    prefix, chunk, heads, kv_heads, block_size = 70, 9, 8, 2, 16
    table, (k_pool, _), _, (k64, _) = write_sequence(rng, prefix + chunk, kv_heads, 64, block_size, "float32")
    v_pool, v64 = _scatter(rng, table, prefix + chunk, kv_heads, 32, block_size, k_pool.shape[0])
    q, q64 = quantize(rng.standard_normal((1, heads, chunk, 64)), "float32")
    sinks, sinks64 = random_sinks(rng, heads)
    out = numpy_attention.attend_pages_numpy(q, k_pool, v_pool, mx.array(table), prefix + chunk, 0.125, sinks)
    expected = causal_oracle(q64[0], k64, v64, 0.125, query_offset=prefix, sinks64=sinks64)
    assert max_error(out, expected[None]) < 1e-5


def test_pages_in_place_equal_the_gathered_path():
    """The engine takes one or the other by the chunk's size: same numbers either way."""
    rng = np.random.default_rng(2)
    prefix, chunk = 500, 12
    table, (k_pool, v_pool), _, _ = write_sequence(rng, prefix + chunk, 3, 64, 16, "float32")
    q = mx.array(rng.standard_normal((1, 9, chunk, 64)).astype(np.float32))
    paged = numpy_attention.attend_pages_numpy(q, k_pool, v_pool, list(table), prefix + chunk, 0.125)
    rows = mx.array(np.asarray(table[: -(-(prefix + chunk) // 16)], dtype=np.int32)[None])
    from mlxpaged.kernels.reference import gather_pages, page_rows

    rows = page_rows(rows, k_pool.shape)
    keys, values = (
        gather_pages(k_pool, rows)[..., : prefix + chunk, :],
        gather_pages(v_pool, rows)[..., : prefix + chunk, :],
    )
    assert mx.allclose(paged, attend_numpy(q, keys, values, 0.125, "causal"), atol=1e-6).item()


def test_key_splits_are_merged(monkeypatch):
    """A hit's 8 queries over 300 keys in tiles of 32 keys: 4 workers ask for splits of the tiles, whose
    partial (max, sum, values) must merge into the one softmax."""
    splits = []
    merge = numpy_attention._merge
    monkeypatch.setattr(
        numpy_attention, "_merge", lambda parts, sinks: splits.append(len(parts)) or merge(parts, sinks)
    )
    monkeypatch.setattr(numpy_attention, "worker_count", lambda: 4)
    monkeypatch.setattr(numpy_attention, "KEY_TILE", 32)
    rng = np.random.default_rng(4)
    table, (k_pool, v_pool), _, (k64, v64) = write_sequence(rng, 300, 3, 64, 16, "float32")
    q, q64 = quantize(rng.standard_normal((1, 9, 8, 64)), "float32")
    out = numpy_attention.attend_pages_numpy(q, k_pool, v_pool, list(table), 300, 0.125)
    assert splits and min(splits) > 1
    assert max_error(out, causal_oracle(q64[0], k64, v64, 0.125, query_offset=292)[None]) < 1e-5


def test_concurrent_calls_leave_blas_threads_as_they_found_them():
    """Two engines in one process prefill at once: the BLAS limits must not nest out of order."""
    from concurrent.futures import ThreadPoolExecutor

    before = [lib["num_threads"] for lib in threadpool_info()]
    _, (q, k, v), _ = case(1, 1, 9, 3, 200, 200, 64)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: mx.eval(attend_numpy(q, k, v, 0.125, "causal")), range(16)))
    assert [lib["num_threads"] for lib in threadpool_info()] == before


def test_a_table_too_short_for_the_context_is_refused():
    pool = mx.zeros((4, 1, 8, 64))
    with pytest.raises(ValueError, match="need 3 blocks"):
        numpy_attention.attend_pages_numpy(mx.zeros((1, 1, 4, 64)), pool, pool, [0, 1], 20, 0.125)


def test_only_few_queries_over_enough_keys_read_pages_in_place():
    few, many = mx.zeros((1, 9, 8, 64)), mx.zeros((1, 9, QUERY_BLOCK + 1, 64))
    assert numpy_attention.pages_in_place_apply(few, 16384)
    assert not numpy_attention.pages_in_place_apply(few, 64)  # too little work for a sync
    assert not numpy_attention.pages_in_place_apply(many, 16384)  # gathered K/V are as fast from here
