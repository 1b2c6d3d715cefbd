"""Attention over quantized pages, every path, against the NumPy float64 oracle.

Two checks per case (tests/msl/quantized_oracle.py): against the oracle over the pages' own dequantized
values (NumPy unpacks the packed words: EXACT_TOLERANCE, float32 rounding only), and against the oracle over
the K/V before quantization (QUANTIZATION_TOLERANCE: the error 8 or 4 bits cost, which must stay that small).
"""

from __future__ import annotations

import mlxpaged  # noqa: F401
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.kernels import reference
from mlxpaged.kernels.attention import (
    attention_backend,
    decode_attention,
    eager_sdpa,
    kernel_attention_with_tail,
    paged_attention,
    paged_prefill_attention,
    prepare_model_attention,
)
from mlxpaged.kernels.reference import page_rows
from tests.msl.oracle import causal_oracle, gather_sequence, max_error
from tests.msl.quantized_oracle import (
    EXACT_TOLERANCE,
    QUANTIZATION_TOLERANCE,
    make_quantized_decode_case,
)

import mlx.core as mx
import numpy as np
import pytest

CASES = [
    # (heads, kv_heads, head_dim, block_size, bits, group, window, v_dim, sinks)
    (9, 3, 64, 16, 8, 64, None, None, False),
    (9, 3, 64, 16, 4, 64, None, None, False),
    (8, 2, 128, 8, 4, 32, None, 64, False),
    (4, 4, 64, 32, 8, 32, 20, None, False),
    (8, 1, 64, 16, 8, 64, None, None, True),
]
LENS = [0, 1, 15, 16, 17, 70]


def check(out: mx.array, exact, original, bits: int) -> None:
    assert max_error(out, exact.expected()) < EXACT_TOLERANCE
    assert max_error(out, original.expected()) < QUANTIZATION_TOLERANCE[bits]


def case_for(params, seed=0, lens=LENS):
    heads, kv_heads, dim, size, bits, group, window, v_dim, sinks = params
    return make_quantized_decode_case(
        seed, lens, heads, kv_heads, dim, size, bits, group, window=window, v_dim=v_dim, sinks=sinks
    )


@pytest.mark.parametrize("backend", ["cpu", "reference", "fused"])
@pytest.mark.parametrize("params", CASES)
def test_decode_on_every_backend_matches_the_oracle(params, backend):
    exact, original = case_for(params)
    with attention_backend(backend):
        out = paged_attention(*exact.args(), window=exact.window, sinks=exact.sinks)
    check(out, exact, original, params[4])


@pytest.mark.parametrize("params", CASES[:3] + CASES[4:])
def test_the_compiled_form_matches_the_oracle(params):
    # decode_attention: array inputs only (rows and mask), what the compiled decode pass calls
    exact, original = case_for(params, seed=1, lens=[1, 15, 33])
    size = exact.k_pool.shape[2]
    width = exact.block_tables.shape[1]
    rows = page_rows(exact.block_tables, exact.k_pool.shape)
    lens = mx.array(exact.lens)
    mask = (mx.arange(width * size)[None, :] < lens[:, None])[:, None, None, :]
    out = mx.compile(lambda q, r, m: decode_attention(q, exact.k_pool, exact.v_pool, r, m, exact.scale, exact.sinks))(
        exact.q, rows, mask
    )
    check(out, exact, original, params[4])


@pytest.mark.parametrize("params", CASES)
def test_prefill_over_quantized_pages_matches_the_causal_oracle(params):
    heads, _, dim, size, bits, _, window, _, _ = params
    total, prefix = 45, 29
    exact, original = case_for(params, seed=2, lens=[total])
    q = mx.array(np.random.default_rng(3).standard_normal((1, heads, total - prefix, dim)).astype(np.float32))
    q64 = np.array(q, dtype=np.float64)[0]
    table = exact.tables_np[0]
    out = paged_prefill_attention(
        q,
        exact.k_pool,
        exact.v_pool,
        mx.array(table[: -(-total // size)]),
        prefix,
        total - prefix,
        exact.scale,
        window,
        exact.sinks,
    )
    for case, tol in ((exact, EXACT_TOLERANCE), (original, QUANTIZATION_TOLERANCE[bits])):
        k, v = gather_sequence(case.k64, table, total), gather_sequence(case.v64, table, total)
        want = causal_oracle(q64, k, v, exact.scale, window, prefix, case.sinks64)
        assert max_error(out, want[None]) < tol


def test_prefill_through_numpy_over_the_dequantized_gather_matches_the_oracle():
    # The CPU backend's long prefill: the view gathers the pages dequantized, eager_sdpa hands them to NumPy.
    exact, _ = case_for(CASES[0], seed=4, lens=[300])
    table = mx.array(exact.tables_np[:, : -(-300 // 16)])
    rows = page_rows(table, exact.k_pool.shape)
    keys, values = reference.gather_pages(exact.k_pool, rows), reference.gather_pages(exact.v_pool, rows)
    q = mx.array(np.random.default_rng(5).standard_normal((1, 9, 300, 64)).astype(np.float32))
    with attention_backend("cpu"):
        out = eager_sdpa(q, keys[:, :, :300], values[:, :, :300], exact.scale, "causal")
    k = gather_sequence(exact.k64, exact.tables_np[0], 300)
    v = gather_sequence(exact.v64, exact.tables_np[0], 300)
    assert max_error(out, causal_oracle(np.array(q, dtype=np.float64)[0], k, v, exact.scale)[None]) < EXACT_TOLERANCE


def test_the_cpu_status_names_the_unpacked_levels_and_the_deferred_tail_is_declined():
    exact, _ = case_for(CASES[0])
    tail = mx.zeros((len(LENS), 3, 1, 64))
    assert (
        kernel_attention_with_tail(
            exact.q, exact.k_pool, exact.v_pool, exact.block_tables, exact.lens, tail, tail, exact.scale
        )
        is None
    )
    prepared = prepare_model_attention(mx.float32, 16, [(9, 3, 64, 64, False)], KVQuantization(8))
    with attention_backend("cpu"):
        status = prepared.status()
    assert status["path"] == "cpu" and "quantized pages" in status["reason"] and "integer levels" in status["reason"]
    half = prepare_model_attention(mx.float16, 16, [(9, 3, 64, 64, False)], KVQuantization(8))
    with attention_backend("cpu"):
        status = half.status()
    assert status["path"] == "reference" and "float32 scales" in status["reason"]


@pytest.mark.parametrize("params", [CASES[0], CASES[2], CASES[4]])
def test_quantized_matmuls_take_several_queries_per_sequence_under_a_causal_mask(params):
    # attend_pages with L > 1 query rows (a verify chunk's shape): mask rows broadcast over each GQA group.
    heads, _, dim, size, bits, _, _, _, _ = params
    exact, original = case_for(params, seed=6, lens=[40])
    blocks = -(-40 // size)
    rows = page_rows(mx.array(exact.tables_np[:, :blocks]), exact.k_pool.shape)
    q = mx.array(np.random.default_rng(7).standard_normal((1, heads, 4, dim)).astype(np.float32))
    keep = np.arange(blocks * size)[None, :] <= np.arange(36, 40)[:, None]  # queries at positions 36..39
    out = reference.attend_pages(
        q, exact.k_pool, exact.v_pool, rows, mx.array(keep)[None, None], exact.scale, exact.sinks
    )
    for case, tol in ((exact, EXACT_TOLERANCE), (original, QUANTIZATION_TOLERANCE[bits])):
        k = gather_sequence(case.k64, exact.tables_np[0], 40)
        v = gather_sequence(case.v64, exact.tables_np[0], 40)
        want = causal_oracle(np.array(q, dtype=np.float64)[0], k, v, exact.scale, None, 36, case.sinks64)
        assert max_error(out, want[None]) < tol
