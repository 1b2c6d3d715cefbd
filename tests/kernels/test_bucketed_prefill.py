"""A short chunk's prefill attention over pages gathered to a bucketed key length (kernels/bucketed_prefill.py),
against the NumPy float64 oracle, and where the dispatcher takes it."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels.attention import buckets_chunk_keys, paged_prefill_attention
from mlxpaged.kernels.bucketed_prefill import MIN_PAGES, bucketed_prefill_attention, page_bucket
from mlxpaged.platform import backend
from tests.kernels.test_reference_paged import write_sequence
from tests.msl.oracle import TOLERANCE, causal_oracle, max_error, quantize

import mlx.core as mx
import numpy as np
import pytest

CASES = [
    # (prefix_len, chunk_len, block_size, heads, kv_heads, head_dim, dtype)
    (0, 5, 16, 4, 2, 64, "float32"),  # no prefix: one page, padded to MIN_PAGES
    (120, 8, 16, 4, 2, 64, "float32"),  # exactly MIN_PAGES pages
    (137, 8, 16, 8, 2, 64, "float32"),  # 10 pages -> a bucket of 10
    (290, 3, 16, 4, 1, 128, "float16"),  # 19 pages -> 20: a padded page masked out
    (517, 30, 8, 4, 4, 64, "bfloat16"),  # mid-block chunk, 69 pages -> 72
]


@pytest.mark.parametrize("prefix,chunk,block_size,heads,kv_heads,head_dim,dtype", CASES)
def test_a_bucketed_chunk_attends_as_full_causal_attention(prefix, chunk, block_size, heads, kv_heads, head_dim, dtype):
    rng = np.random.default_rng(prefix * 100 + chunk)
    total = prefix + chunk
    table, (k_pool, v_pool), _, (k64, v64) = write_sequence(rng, total, kv_heads, head_dim, block_size, dtype)
    q_all, q64 = quantize(rng.standard_normal((1, heads, total, head_dim)), dtype)
    scale = head_dim**-0.5
    out = bucketed_prefill_attention(q_all[:, :, prefix:], k_pool, v_pool, list(table), prefix, chunk, scale)
    whole = causal_oracle(q64[0], k64, v64, scale)[None, :, prefix:]
    assert max_error(out, whole) < TOLERANCE[dtype]


def test_growing_prefixes_share_a_few_key_lengths():
    """A conversation's follow-ups (8 tokens more each) over 8k tokens: 4 key lengths per doubling, not one each."""
    lengths = {page_bucket(-(-n // 16)) for n in range(8200, 16384, 8)}
    assert len(lengths) == 4
    assert page_bucket(1) == MIN_PAGES


def test_a_table_too_short_is_refused():
    pool = mx.zeros((4, 2, 8, 64))
    with pytest.raises(ValueError, match="exceed the block table"):
        bucketed_prefill_attention(mx.zeros((1, 4, 5, 64)), pool, pool, [0], 4, 5, 0.1)


def test_only_a_short_batch_1_chunk_on_cuda_takes_it():
    q = mx.zeros((1, 4, 8, 64))
    assert not buckets_chunk_keys(q)  # the CPU backend: NumPy reads the pages
    with backend.simulate("cuda"):
        limit = backend.tuning().bucketed_chunk_keys
        assert buckets_chunk_keys(q) and buckets_chunk_keys(mx.zeros((1, 4, limit, 64)))
        assert not buckets_chunk_keys(mx.zeros((1, 4, limit + 1, 64)))
        assert not buckets_chunk_keys(mx.zeros((2, 4, 8, 64)))
    with backend.simulate("metal"):
        assert not buckets_chunk_keys(q)


def test_the_dispatcher_on_cuda_gives_the_reference_result():
    rng = np.random.default_rng(7)
    prefix, chunk = 200, 8
    table, (k_pool, v_pool), _, (k64, v64) = write_sequence(rng, prefix + chunk, 2, 64, 16, "float32")
    q_all, q64 = quantize(rng.standard_normal((1, 4, prefix + chunk, 64)), "float32")
    with backend.simulate("cuda"):
        out = paged_prefill_attention(q_all[:, :, prefix:], k_pool, v_pool, list(table), prefix, chunk, 0.125)
    whole = causal_oracle(q64[0], k64, v64, 0.125)[None, :, prefix:]
    assert max_error(out, whole) < TOLERANCE["float32"]
