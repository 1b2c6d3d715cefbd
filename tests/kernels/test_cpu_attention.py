"""The CPU attention paths (kernels/cpu_attention.py) against the NumPy float64 oracle."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import cpu_attention
from mlxpaged.kernels.cpu_attention import attend, paged_attention_cpu, shifted_exp
from mlxpaged.kernels.numpy_attention import attend_numpy
from tests.msl.oracle import attend as oracle_attend
from tests.msl.oracle import causal_oracle, make_decode_case, max_error, quantize

import mlx.core as mx
import numpy as np
import pytest


@pytest.fixture(autouse=True)
def always_gather_mm(monkeypatch):
    """Small test cases would otherwise take the reference path (GATHER_MM_MIN_KEYS)."""
    monkeypatch.setattr(cpu_attention, "GATHER_MM_MIN_KEYS", 0)


def test_small_decode_calls_take_the_reference_path(monkeypatch):
    def gather_mm_inputs(rows, mask):
        raise AssertionError("the gather_mm path was taken")

    monkeypatch.setattr(cpu_attention, "GATHER_MM_MIN_KEYS", 1024)
    monkeypatch.setattr(cpu_attention, "_page_arrays", gather_mm_inputs)
    case = make_decode_case(8, [40, 23], 8, 2, 64, 8)  # 2 sequences x 40 keys
    assert max_error(paged_attention_cpu(*case.args()), case.expected()) < 1e-5


def test_shifted_exp_matches_exp_to_float32_precision():
    x = np.concatenate([np.linspace(-87.0, 0.0, 200_001), [-1e-8, -0.5, -1.5]])
    got = np.array(shifted_exp(mx.array(x.astype(np.float32)), mx.array(0.0)), dtype=np.float64)
    want = np.exp(x.astype(np.float32).astype(np.float64))
    near = x > -20  # where softmax weights matter: a few float32 ulps
    assert np.max(np.abs(got - want)[near] / want[near]) < 1e-6
    assert np.max(np.abs(got - want) / want) < 1e-5  # far tail: rounding of x * log2(e) dominates


def test_shifted_exp_of_masked_scores_is_exactly_zero():
    scores = mx.array([[-np.inf, -1e30, -200.0, 0.0, 3.0]], dtype=mx.float32)
    got = np.array(shifted_exp(scores, mx.array([[3.0]])))
    assert got[0, 0] == got[0, 1] == got[0, 2] == 0.0
    assert got[0, 3] == pytest.approx(np.exp(-3.0), rel=1e-6) and got[0, 4] == 1.0


@pytest.mark.parametrize("length,keys", [(1, 1), (5, 5), (63, 63), (64, 64), (65, 65), (200, 200), (130, 400)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 96)])
def test_attend_causal(length, keys, heads, kv_heads, head_dim):
    """Bottom-right aligned causal masks, across the query-block boundaries (QUERY_BLOCK 64)."""
    rng = np.random.default_rng(length * 1000 + keys + heads)
    q, q64 = quantize(rng.standard_normal((1, heads, length, head_dim)), "float32")
    k, k64 = quantize(rng.standard_normal((1, kv_heads, keys, head_dim)), "float32")
    v, v64 = quantize(rng.standard_normal((1, kv_heads, keys, head_dim)), "float32")
    out = attend(q, k, v, head_dim**-0.5, "causal")
    expected = causal_oracle(q64[0], k64[0], v64[0], head_dim**-0.5, query_offset=keys - length)
    assert max_error(out, expected[None]) < 1e-5


@pytest.mark.parametrize("length,keys", [(4, 37), (70, 137)])  # 70: past numpy_attention's query block
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "per_head", "none"])
@pytest.mark.parametrize("attend", [attend, attend_numpy], ids=["mlx", "numpy"])
def test_attend_ragged_batch_masks(attend, mask_kind, length, keys):
    """A ragged batch's masks (cache_view._ragged_mask is boolean [B, 1, L, K]), additive and per-head ones."""
    rng = np.random.default_rng(3)
    batch, heads, kv_heads, dim = 3, 8, 2, 64
    q, q64 = quantize(rng.standard_normal((batch, heads, length, dim)), "float32")
    k, k64 = quantize(rng.standard_normal((batch, kv_heads, keys, dim)), "float32")
    v, v64 = quantize(rng.standard_normal((batch, kv_heads, keys, dim)), "float32")
    allowed = rng.random((batch, heads if mask_kind == "per_head" else 1, length, keys)) > 0.3
    allowed[..., 0] = True  # every row sees a key
    if mask_kind == "none":
        allowed[:] = True
    mask = {
        "bool": mx.array(allowed),
        "per_head": mx.array(allowed),
        "none": None,
        "additive": mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32)),
    }[mask_kind]
    out = attend(q, k, v, 0.125, mask)
    group = heads // kv_heads

    def one_head(b, h):
        kv = slice(h // group, h // group + 1)
        return oracle_attend(q64[b, h : h + 1], k64[b, kv], v64[b, kv], 0.125, allowed[b, h % allowed.shape[1]])[0]

    expected = np.stack([np.stack([one_head(b, h) for h in range(heads)]) for b in range(batch)])
    assert max_error(out, expected) < 1e-5


def test_attend_keeps_the_query_dtype():
    q = mx.random.normal((1, 4, 3, 64)).astype(mx.float16)
    k = mx.random.normal((1, 2, 3, 64)).astype(mx.float16)
    out = attend(q, k, k, 0.125, "causal")
    assert out.dtype == mx.float16
    want = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")
    assert mx.allclose(out, want, atol=2e-3).item()


def edge_lens(block_size: int) -> list[int]:
    return [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]


@pytest.mark.parametrize("window", [None, 5, 17])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(4, 4, 64, 8), (8, 4, 96, 16), (8, 2, 128, 32), (9, 3, 64, 16), (8, 1, 64, 32)],
)
def test_paged_decode_edge_lengths(heads, kv_heads, head_dim, block_size, window):
    case = make_decode_case(1, edge_lens(block_size), heads, kv_heads, head_dim, block_size, window=window)
    out = paged_attention_cpu(*case.args(), window=window)
    assert out.dtype == mx.float32
    assert max_error(out, case.expected()) < 1e-5


@pytest.mark.parametrize("window", [None, 1000])
def test_paged_decode_long_context(window):
    case = make_decode_case(2, [3001, 4096, 17], 8, 2, 128, 16, window=window)
    assert max_error(paged_attention_cpu(*case.args(), window=window), case.expected()) < 1e-5


def test_paged_decode_equal_lengths_padded_tables_and_empty_contexts():
    equal = make_decode_case(3, [64, 64, 64], 8, 4, 64, 16)
    assert max_error(paged_attention_cpu(*equal.args()), equal.expected()) < 1e-5
    padded = make_decode_case(4, [5, 0], 4, 2, 64, 8, max_blocks=9)
    assert max_error(paged_attention_cpu(*padded.args()), padded.expected()) < 1e-5
    empty = make_decode_case(5, [0, 0], 4, 2, 64, 8)
    assert np.all(np.array(paged_attention_cpu(*empty.args())) == 0)


def test_paged_decode_reads_the_pages_it_is_given(monkeypatch):
    """Planted bug: shifting every page id by one must be caught by the oracle comparison."""
    case = make_decode_case(6, [40, 23], 8, 2, 64, 8, spare_blocks=4)
    build = cpu_attention._page_arrays

    def shifted(rows, mask):
        pages, queries, mask = build(rows, mask)
        return (pages + case.k_pool.shape[1]) % (case.k_pool.shape[0] * case.k_pool.shape[1]), queries, mask

    monkeypatch.setattr(cpu_attention, "_page_arrays", shifted)
    assert max_error(paged_attention_cpu(*case.args()), case.expected()) > 1e-2
