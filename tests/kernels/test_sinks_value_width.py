"""Sinks (a per-head logit in the softmax, gpt-oss) and V narrower or wider than K (latent caches) on
the reference, CPU and entry-point paths, against the NumPy float64 oracle (tests/msl/oracle.py)."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention, cpu_attention, reference
from mlxpaged.kernels.cpu_attention import attend, decode_attention_cpu, paged_attention_cpu
from mlxpaged.kernels.reference import decode_plan, page_rows, paged_attention_reference
from tests.kernels.test_reference_paged import write_sequence
from tests.msl.oracle import (
    DTYPES,
    TOLERANCE,
    causal_oracle,
    make_decode_case,
    max_error,
    quantize,
    random_sinks,
)
from tests.msl.oracle import (
    attend as oracle_attend,
)

import mlx.core as mx
import numpy as np
import pytest

DECODE_PATHS = {"reference": paged_attention_reference, "cpu": paged_attention_cpu}

CASES = [
    # (heads, kv_heads, head_dim, v_dim, block_size, window, sinks)
    (8, 2, 64, 64, 8, None, True),  # GQA 4 with sinks
    (4, 4, 64, 32, 16, None, False),  # V narrower than K (MLA-style latent split)
    (8, 1, 32, 96, 8, 11, True),  # V wider than K, MQA, window, sinks
    (9, 3, 64, 16, 16, 5, True),  # odd GQA group, narrow V
]


def edge_lens(block_size: int) -> list[int]:
    return [0, 1, block_size, block_size + 1, 3 * block_size + 2]


@pytest.fixture
def gather_mm_always(monkeypatch):
    """Small cases would otherwise take the reference path inside the CPU path (GATHER_MM_MIN_KEYS)."""
    monkeypatch.setattr(cpu_attention, "GATHER_MM_MIN_KEYS", 0)


@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim,block_size,window,sinks", CASES)
def test_paged_decode(gather_mm_always, path, heads, kv_heads, head_dim, v_dim, block_size, window, sinks):
    case = make_decode_case(
        heads + v_dim,
        edge_lens(block_size),
        heads,
        kv_heads,
        head_dim,
        block_size,
        window=window,
        v_dim=v_dim,
        sinks=sinks,
    )
    out = DECODE_PATHS[path](*case.args(), window=window, sinks=case.sinks)
    assert out.shape == (len(case.lens), heads, 1, v_dim)
    assert max_error(out, case.expected()) < 1e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reference_decode_half_precision(dtype):
    case = make_decode_case(5, [1, 17, 40], 8, 2, 64, 8, dtype, window=20, v_dim=32, sinks=True)
    out = paged_attention_reference(*case.args(), window=20, sinks=case.sinks)
    assert out.dtype == DTYPES[dtype] and max_error(out, case.expected()) < TOLERANCE[dtype]


def test_sinks_change_the_output_and_the_oracle_tells():
    """The cases' sinks matter (a path that drops them fails), and a sink of -1e30 is no sink at all."""
    case = make_decode_case(3, [5, 40], 8, 2, 64, 8, sinks=True)
    dropped = paged_attention_reference(*case.args())
    assert max_error(dropped, case.expected()) > 1e-2
    silent = mx.full((8,), -1e30)
    plain = make_decode_case(3, [5, 40], 8, 2, 64, 8)
    assert max_error(paged_attention_reference(*plain.args(), sinks=silent), plain.expected()) < 1e-5


def test_reference_never_folds_gqa_with_sinks(monkeypatch):
    monkeypatch.setattr(reference, "FOLD_GQA_MIN_KEYS", 1)
    case = make_decode_case(4, [3, 40, 64], 8, 2, 64, 16, window=30, v_dim=32, sinks=True)
    assert max_error(paged_attention_reference(*case.args(), window=30, sinks=case.sinks), case.expected()) < 1e-5
    plain = make_decode_case(4, [3, 40, 64], 8, 2, 64, 16, window=30, v_dim=32)
    assert max_error(paged_attention_reference(*plain.args(), window=30), plain.expected()) < 1e-5


@pytest.mark.parametrize("path", ["reference", "cpu"])
def test_compiled_pass_entry_point(gather_mm_always, path):
    """decode_attention (array inputs only) as the compiled decode pass calls it."""
    case = make_decode_case(6, [9, 30, 17], 8, 2, 64, 8, v_dim=32, sinks=True)
    plan = decode_plan(case.block_tables, tuple(case.lens), None, case.k_pool.shape, 3)
    rows = page_rows(mx.array(case.tables_np), case.k_pool.shape)
    mask = mx.arange(rows.shape[2] * 8)[None, :] < mx.array(case.lens)[:, None]
    mask = mask.reshape(3, 1, 1, -1)
    with attention.attention_backend(path):
        out = attention.decode_attention(case.q, case.k_pool, case.v_pool, rows, mask, case.scale, case.sinks)
    assert plan is not None and max_error(out, case.expected()) < 1e-5
    direct = decode_attention_cpu(case.q, case.k_pool, case.v_pool, rows, mask, case.scale, case.sinks)
    assert max_error(direct, case.expected()) < 1e-5


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_paged_attention_entry_point(gather_mm_always, backend):
    case = make_decode_case(7, [0, 7, 33], 8, 4, 64, 16, window=9, v_dim=128, sinks=True)
    with attention.attention_backend(backend):
        out = attention.paged_attention(*case.args(), window=9, sinks=case.sinks)
    assert max_error(out, case.expected()) < 1e-5


@pytest.mark.parametrize("length,keys", [(1, 1), (5, 5), (65, 65), (130, 400)])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_sdpa_causal_with_sinks_and_narrow_values(backend, length, keys):
    """Prefill: the causal blocks of cpu_attention.attend each add the sink once per row."""
    rng = np.random.default_rng(length + keys)
    heads, kv_heads, dim, v_dim = 8, 2, 64, 32
    q, q64 = quantize(rng.standard_normal((1, heads, length, dim)), "float32")
    k, k64 = quantize(rng.standard_normal((1, kv_heads, keys, dim)), "float32")
    v, v64 = quantize(rng.standard_normal((1, kv_heads, keys, v_dim)), "float32")
    sinks, sinks64 = random_sinks(rng, heads)
    with attention.attention_backend(backend):
        out = attention.sdpa(q, k, v, dim**-0.5, "causal", sinks)
    expected = causal_oracle(q64[0], k64[0], v64[0], dim**-0.5, query_offset=keys - length, sinks64=sinks64)
    assert max_error(out, expected[None]) < 1e-5


def test_cpu_attend_ragged_mask_with_sinks_and_fully_masked_rows():
    """Boolean batch masks; a row that sees no key gives zeros (the sink alone has no value)."""
    rng = np.random.default_rng(11)
    batch, heads, kv_heads, length, keys, dim, v_dim = 2, 4, 2, 3, 20, 32, 64
    q, q64 = quantize(rng.standard_normal((batch, heads, length, dim)), "float32")
    k, k64 = quantize(rng.standard_normal((batch, kv_heads, keys, dim)), "float32")
    v, v64 = quantize(rng.standard_normal((batch, kv_heads, keys, v_dim)), "float32")
    sinks, sinks64 = random_sinks(rng, heads)
    allowed = rng.random((batch, 1, length, keys)) > 0.4
    allowed[1, 0, 2] = False
    out = attend(q, k, v, 0.2, mx.array(allowed), sinks)
    expected = np.stack([oracle_attend(q64[b], k64[b], v64[b], 0.2, allowed[b, 0], sinks64) for b in range(batch)])
    assert max_error(out, expected) < 1e-5
    assert np.all(np.array(out)[1, :, 2] == 0)


@pytest.mark.parametrize("prefix,chunk,window", [(0, 37, None), (32, 20, None), (70, 30, 24), (0, 12, 3)])
def test_paged_prefill_with_sinks_and_narrow_values(prefix, chunk, window):
    rng = np.random.default_rng(prefix + chunk)
    heads, kv_heads, dim, v_dim, block_size = 8, 2, 64, 32, 16
    table, (k_pool, _), _, (k64, _) = write_sequence(rng, prefix + chunk, kv_heads, dim, block_size, "float32")
    v_table_pool = _scatter(rng, table, prefix + chunk, kv_heads, v_dim, block_size, k_pool.shape[0])
    v_pool, v64 = v_table_pool
    q, q64 = quantize(rng.standard_normal((1, heads, prefix + chunk, dim)), "float32")
    sinks, sinks64 = random_sinks(rng, heads)
    out = attention.paged_prefill_attention(
        q[:, :, prefix:], k_pool, v_pool, mx.array(table), prefix, chunk, dim**-0.5, window, sinks
    )
    whole = causal_oracle(q64[0], k64, v64, dim**-0.5, window, sinks64=sinks64)[None, :, prefix:]
    assert max_error(out, whole) < 1e-5


def _scatter(rng, table, total, kv_heads, dim, block_size, num_blocks):
    """A V pool of width `dim` holding `total` random tokens at `table`'s slots, and their float64 values."""
    values, values64 = quantize(rng.standard_normal((kv_heads, total, dim)), "float32")
    pool = np.zeros((num_blocks, kv_heads, block_size, dim), np.float32)
    for t in range(total):
        pool[table[t // block_size], :, t % block_size, :] = np.array(values)[:, t, :]
    return mx.array(pool), values64


def test_bad_sinks_and_mismatched_pools_are_refused_with_the_shapes():
    case = make_decode_case(8, [5], 8, 2, 64, 8, v_dim=32)
    for path in DECODE_PATHS.values():
        with pytest.raises(ValueError, match=r"sinks \(4,\) must hold one logit per query head \(8,\)"):
            path(*case.args(), sinks=mx.zeros((4,)))
        with pytest.raises(ValueError, match=r"K and V need the same \[blocks, kv_heads, block_size\]"):
            path(case.q, case.k_pool, case.v_pool[:, :1], case.block_tables, case.context_lens, case.scale)
        with pytest.raises(ValueError, match="the queries' width 64"):
            path(case.q, case.v_pool, case.v_pool, case.block_tables, case.context_lens, case.scale)
