"""The paged kernel (Metal and its CUDA twin) attending the pools and then a tail of K/V not written yet (a
decode pass queued ahead, runner/deferred_writes.py), run on the CPU by the strict emulators, against the float64
oracle."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention
from mlxpaged.kernels.paged_attention import paged_attention_kernel, tail_partials
from tests.msl.oracle import attend, gather_sequence, make_decode_case, max_error, quantize

import mlx.core as mx
import numpy as np
import pytest


def tail_case(
    seed: int,
    lens: list[int],
    tail: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    sinks: bool = False,
):
    case = make_decode_case(seed, lens, heads, kv_heads, head_dim, block_size, dtype, sinks=sinks)
    rng = np.random.default_rng(seed + 1)
    k, k64 = quantize(rng.standard_normal((len(lens), kv_heads, tail, head_dim)), dtype)
    v, v64 = quantize(rng.standard_normal((len(lens), kv_heads, tail, head_dim)), dtype)
    expected = []
    for b, length in enumerate(lens):  # the pool's tokens, then the tail's, every one attended
        keys = np.concatenate([gather_sequence(case.k64, case.tables_np[b], length), k64[b]], axis=1)
        values = np.concatenate([gather_sequence(case.v64, case.tables_np[b], length), v64[b]], axis=1)
        allowed = np.ones((1, keys.shape[1]), dtype=bool)
        expected.append(attend(case.q64[b], keys, values, case.scale, allowed, case.sinks64))
    return case, k, v, np.stack(expected)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,tail,sinks",
    [
        (4, 4, 64, 8, "float32", 1, False),
        (8, 2, 128, 16, "bfloat16", 6, False),
        (4, 2, 96, 32, "float16", 33, True),
        (8, 1, 64, 8, "float32", 3, True),
    ],
)
def test_pool_then_tail_matches_the_oracle(seed, heads, kv_heads, head_dim, block_size, dtype, tail, sinks, emulator):
    case, k, v, expected = tail_case(
        seed * 100 + head_dim,
        [1, block_size - 1, block_size, 3 * block_size + 5],
        tail,
        heads,
        kv_heads,
        head_dim,
        block_size,
        dtype,
        sinks,
    )
    partials = tail_partials(case.q, k, v, case.scale)
    out = paged_attention_kernel(
        case.q,
        case.k_pool,
        case.v_pool,
        case.block_tables,
        case.context_lens,
        case.scale,
        sinks=case.sinks,
        partition_tokens=block_size * 3 // 2,
        launcher=emulator(strict=True, seed=seed),
        tail=partials,
    )
    error = max_error(out, expected)
    assert error < case.tolerance, f"error {error:.3g} over tolerance {case.tolerance}"


def test_the_entry_point_uses_the_kernel_only_where_it_attends(emulator):
    case, k, v, expected = tail_case(7, [5, 20], 2, 4, 2, 64, 8, "float32")
    args = (case.q, case.k_pool, case.v_pool, case.block_tables, case.context_lens, k, v, case.scale)
    assert attention.kernel_attention_with_tail(*args) is None  # the cpu path: the caller gathers instead
    with attention.kernel_launcher(emulator()), attention.attention_backend("kernel"):
        out = attention.kernel_attention_with_tail(*args)
    assert out is not None and max_error(out, expected) < case.tolerance
    assert isinstance(out, mx.array) and out.shape == (2, 4, 1, 64)
