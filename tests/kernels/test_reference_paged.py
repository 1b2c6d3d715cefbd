"""The pure-MLX reference path against the NumPy float64 oracle."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import reference
from mlxpaged.kernels.reference import paged_attention_reference, paged_prefill_attention_reference
from tests.msl.oracle import DTYPES, TOLERANCE, causal_oracle, make_decode_case, max_error, quantize, shuffled_tables

import mlx.core as mx
import numpy as np
import pytest


def edge_lens(block_size: int) -> list[int]:
    return [0, 1, block_size - 1, block_size, block_size + 1]


DECODE_MATRIX = [
    # (heads, kv_heads, head_dim, block_size, dtype)
    (4, 4, 64, 8, "float32"),
    (8, 4, 96, 16, "float16"),
    (8, 2, 128, 32, "bfloat16"),
    (16, 2, 256, 16, "float32"),
    (8, 1, 64, 32, "float16"),
    (4, 2, 128, 8, "bfloat16"),
]


@pytest.mark.parametrize("window", [None, 5, 17])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", DECODE_MATRIX)
def test_decode_edge_lengths(heads, kv_heads, head_dim, block_size, dtype, window):
    case = make_decode_case(
        1, [*edge_lens(block_size), 3 * block_size + 2], heads, kv_heads, head_dim, block_size, dtype, window
    )
    out = paged_attention_reference(*case.args(), window=window)
    assert out.dtype == DTYPES[dtype]
    assert max_error(out, case.expected()) < case.tolerance


@pytest.mark.parametrize("window", [None, 1000])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_long_context(dtype, window):
    case = make_decode_case(2, [3001, 4096, 17], 8, 2, 128, 16, dtype, window)
    out = paged_attention_reference(*case.args(), window=window)
    assert max_error(out, case.expected()) < case.tolerance


@pytest.mark.parametrize("fold_min_keys", [1, 1 << 30], ids=["folded_gqa", "plain_gqa"])
def test_decode_both_sdpa_layouts(monkeypatch, fold_min_keys):
    monkeypatch.setattr(reference, "FOLD_GQA_MIN_KEYS", fold_min_keys)
    case = make_decode_case(7, [0, 3, 40, 64], 8, 2, 64, 16, "float32", window=30)
    assert max_error(paged_attention_reference(*case.args(), window=30), case.expected()) < 1e-5


def test_decode_equal_lengths_take_the_unmasked_path():
    case = make_decode_case(3, [64, 64, 64], 8, 4, 64, 16)
    out = paged_attention_reference(*case.args())
    assert max_error(out, case.expected()) < 1e-5


def test_decode_wide_padded_table_and_all_zero_lengths():
    case = make_decode_case(4, [5, 0], 4, 2, 64, 8, max_blocks=9)
    assert max_error(paged_attention_reference(*case.args()), case.expected()) < 1e-5
    empty = make_decode_case(5, [0, 0], 4, 2, 64, 8)
    out = paged_attention_reference(*empty.args())
    assert np.all(np.array(out) == 0)


def test_decode_rejects_context_beyond_table():
    case = make_decode_case(6, [20], 4, 2, 64, 8)
    with pytest.raises(ValueError, match="capacity"):
        paged_attention_reference(
            case.q, case.k_pool, case.v_pool, case.block_tables[:, :2], case.context_lens, case.scale
        )


def write_sequence(rng, total, kv_heads, head_dim, block_size, dtype):
    """Contiguous K/V of a whole sequence and the same tokens scattered into a shuffled pool."""
    tables, num_blocks = shuffled_tables(rng, [total], block_size, spare=4)
    k, k64 = quantize(rng.standard_normal((kv_heads, total, head_dim)), dtype)
    v, v64 = quantize(rng.standard_normal((kv_heads, total, head_dim)), dtype)
    pools = []
    for values in (k64, v64):
        pool = np.zeros((num_blocks, kv_heads, block_size, head_dim))
        for t in range(total):
            pool[tables[0, t // block_size], :, t % block_size, :] = values[:, t, :]
        pools.append(mx.array(pool.astype(np.float32)).astype(DTYPES[dtype]))
    return tables[0], pools, (k, v), (k64, v64)


PREFILL_CASES = [
    # (prefix_len, chunk_len, block_size, heads, kv_heads, head_dim, window, dtype)
    (0, 37, 16, 4, 2, 64, None, "float32"),
    (32, 20, 16, 8, 2, 64, None, "float32"),  # prefix-cache hit on block boundary
    (45, 19, 8, 4, 4, 128, None, "float16"),  # chunked prefill mid-block
    (100, 1, 32, 8, 1, 96, None, "bfloat16"),
    (70, 30, 16, 4, 2, 64, 24, "float32"),  # sliding window skips whole blocks
    (5, 40, 8, 8, 4, 64, 16, "float32"),
    (0, 12, 8, 4, 2, 64, 3, "float16"),
]


@pytest.mark.parametrize("prefix,chunk,block_size,heads,kv_heads,head_dim,window,dtype", PREFILL_CASES)
def test_prefill_matches_full_causal_attention(prefix, chunk, block_size, heads, kv_heads, head_dim, window, dtype):
    rng = np.random.default_rng(prefix * 1000 + chunk)
    total = prefix + chunk
    table, (k_pool, v_pool), (k, v), (k64, v64) = write_sequence(rng, total, kv_heads, head_dim, block_size, dtype)
    q_all, q64 = quantize(rng.standard_normal((1, heads, total, head_dim)), dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention_reference(
        q_all[:, :, prefix:], k_pool, v_pool, mx.array(table), prefix, chunk, scale, window
    )
    whole = causal_oracle(q64[0], k64, v64, scale, window)[None, :, prefix:]
    assert max_error(out, whole) < TOLERANCE[dtype]
    if window is None:
        contiguous = mx.fast.scaled_dot_product_attention(q_all, k[None], v[None], scale=scale, mask="causal")[
            :, :, prefix:
        ]
        diff = mx.abs(out.astype(mx.float32) - contiguous.astype(mx.float32)).max().item()
        assert diff < TOLERANCE[dtype]


def test_prefill_empty_chunk_and_bad_shapes():
    q = mx.zeros((1, 4, 0, 64))
    pool = mx.zeros((4, 2, 8, 64))
    assert paged_prefill_attention_reference(q, pool, pool, mx.array([0, 1]), 3, 0, 0.1).shape == (1, 4, 0, 64)
    with pytest.raises(ValueError):
        paged_prefill_attention_reference(mx.zeros((1, 4, 5, 64)), pool, pool, mx.array([0]), 4, 5, 0.1)
    with pytest.raises(ValueError):
        paged_prefill_attention_reference(mx.zeros((1, 4, 5, 64)), pool, pool, mx.array([0]), 0, 5, 0.1, window=0)
