"""The CPU path's decode over quantized pages (kernels/quantized_attention.py `attend_quantized_unpacked`: integer
levels through float32 matmuls, scales and biases folded around them) against the float64 oracle
(tests/msl/quantized_oracle.py) and against its twin, the reference's quantized matmuls, over the same pages."""

from __future__ import annotations

import mlxpaged  # noqa: F401
from mlxpaged.kernels import cpu_attention, quantized_attention
from mlxpaged.kernels.attention import attention_backend, decode_attention, paged_attention
from mlxpaged.kernels.reference import page_rows, paged_attention_reference
from tests.msl.oracle import max_error
from tests.msl.quantized_oracle import EXACT_TOLERANCE, QUANTIZATION_TOLERANCE, make_quantized_decode_case

import mlx.core as mx
import numpy as np
import pytest

CASES = [
    # (heads, kv_heads, head_dim, block_size, bits, group, window, v_dim, sinks)
    (9, 3, 64, 16, 8, 64, None, None, False),  # SmolLM2's geometry: one group per row
    (9, 3, 64, 16, 4, 64, None, None, False),
    (8, 2, 64, 16, 8, 32, None, None, False),  # two groups per row
    (8, 2, 128, 8, 4, 32, None, 64, False),  # four groups of K, two of a narrower V
    (4, 4, 64, 32, 8, 32, 20, None, False),  # no GQA, a sliding window
    (8, 1, 64, 16, 4, 64, 40, None, True),  # one KV head, a window and sinks
]
LENS = [0, 1, 15, 16, 17, 70]  # a batch of different lengths, an empty one among them


@pytest.fixture
def spy(monkeypatch):
    """Every row count the unpacked form attended (so a test knows it ran); 4-bit at any length."""
    calls = []
    real = cpu_attention.attend_quantized_unpacked

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "attend_quantized_unpacked", counted)
    monkeypatch.setattr(quantized_attention, "UNPACKED_4BIT_MIN_KEYS", 0)
    return calls


def case_for(params, seed=0, lens=LENS):
    heads, kv_heads, dim, size, bits, group, window, v_dim, sinks = params
    return make_quantized_decode_case(
        seed, lens, heads, kv_heads, dim, size, bits, group, window=window, v_dim=v_dim, sinks=sinks
    )


@pytest.mark.parametrize("params", CASES)
def test_unpacked_decode_matches_the_oracle_and_the_quantized_matmuls(params, spy):
    exact, original = case_for(params)
    with attention_backend("cpu"):
        out = paged_attention(*exact.args(), window=exact.window, sinks=exact.sinks)
    assert spy == [len(LENS)]
    assert max_error(out, exact.expected()) < EXACT_TOLERANCE
    assert max_error(out, original.expected()) < QUANTIZATION_TOLERANCE[params[4]]
    twin = paged_attention_reference(*exact.args(), window=exact.window, sinks=exact.sinks)
    assert max_error(out, np.array(twin, dtype=np.float64)) < 1e-5
    assert np.all(np.array(out)[0] == 0)  # the empty sequence


@pytest.mark.parametrize("params", [CASES[0], CASES[1], CASES[3], CASES[5]])
def test_the_compiled_pass_form_matches_the_oracle_over_padded_tables(params, spy):
    # decode_attention as the compiled decode pass calls it: page rows padded past each sequence, masked out.
    exact, original = case_for(params, seed=1, lens=[1, 15, 33])
    size = exact.k_pool.shape[2]
    width = exact.block_tables.shape[1]
    rows = page_rows(exact.block_tables, exact.k_pool.shape)
    lens = mx.array(exact.lens)
    mask = (mx.arange(width * size)[None, :] < lens[:, None])[:, None, None, :]
    if exact.window is not None:
        mask = mask & (mx.arange(width * size)[None, :] >= lens[:, None] - exact.window)[:, None, None, :]
    with attention_backend("cpu"):
        compiled = mx.compile(
            lambda q, r, m: decode_attention(q, exact.k_pool, exact.v_pool, r, m, exact.scale, exact.sinks)
        )
        out = compiled(exact.q, rows, mask)
    assert spy == [3]
    assert max_error(out, exact.expected()) < EXACT_TOLERANCE
    assert max_error(out, original.expected()) < QUANTIZATION_TOLERANCE[params[4]]


def test_short_4bit_passes_keep_the_quantized_matmuls_and_8bit_never_does(monkeypatch):
    calls = []
    real = cpu_attention.attend_quantized_unpacked
    monkeypatch.setattr(cpu_attention, "attend_quantized_unpacked", lambda *a, **k: calls.append(1) or real(*a, **k))
    for params, unpacked in ((CASES[1], False), (CASES[0], True)):
        exact, _ = case_for(params, seed=2, lens=[5, 9])  # 2 x 1 page of 16: 32 keys
        with attention_backend("cpu"):
            out = paged_attention(*exact.args())
        assert bool(calls) == unpacked
        assert max_error(out, exact.expected()) < EXACT_TOLERANCE
        calls.clear()
    assert not quantized_attention.unpacked_applies(4, quantized_attention.UNPACKED_4BIT_MIN_KEYS - 1)
    assert quantized_attention.unpacked_applies(4, quantized_attention.UNPACKED_4BIT_MIN_KEYS)


@pytest.mark.parametrize("params", [CASES[1], CASES[3]])
def test_swapped_nibbles_are_caught_by_the_oracle(params, spy, monkeypatch):
    """Planted bug: 4-bit levels read high nibble first must fail, so the oracle checks the unpacking."""
    real = quantized_attention._split_rows
    monkeypatch.setattr(quantized_attention, "_split_rows", lambda x, bits, group: real(x, bits, group)[::-1])
    exact, _ = case_for(params, seed=3, lens=[40])
    with attention_backend("cpu"):
        out = paged_attention(*exact.args(), window=exact.window, sinks=exact.sinks)
    assert spy == [1]
    assert max_error(out, exact.expected()) > 1e-2


def test_pages_of_half_precision_scales_take_the_reference(spy):
    # The CPU path takes float32 pages only (its fast dtype); float16 pages: the quantized matmuls, still exact.
    exact, _ = make_quantized_decode_case(4, [3, 40], 9, 3, 64, 16, 8, 64, dtype="float16")
    with attention_backend("cpu"):
        out = paged_attention(*exact.args())
    assert spy == []
    assert max_error(out, exact.expected()) < 1e-2
