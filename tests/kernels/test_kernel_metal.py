"""Apple-GPU checks of the real Metal kernel: it compiles and matches the oracle and the reference
path over the same case matrix as the emulated tests. Skipped where MLX has no Metal device."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention
from mlxpaged.kernels.paged_attention import paged_attention_kernel
from mlxpaged.kernels.reference import paged_attention_reference
from tests.kernels.test_kernel_emulated import LONG, MATRIX, edge_lens
from tests.kernels.test_kernel_sinks_emulated import MATRIX as SINKS_MATRIX
from tests.msl.oracle import make_decode_case, max_error

import mlx.core as mx
import numpy as np
import pytest

pytestmark = [
    pytest.mark.metal,
    pytest.mark.skipif(not mx.metal.is_available(), reason="metal: needs an Apple GPU (Metal); skipped elsewhere"),
]


def check_on_gpu(case, **options):
    out = paged_attention_kernel(*case.args(), window=case.window, sinks=case.sinks, **options)
    mx.eval(out)
    assert max_error(out, case.expected()) < case.tolerance
    reference = paged_attention_reference(*case.args(), window=case.window, sinks=case.sinks)
    assert max_error(out, np.array(reference.astype(mx.float32), dtype=np.float64)) < case.tolerance


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype,window", MATRIX)
def test_matrix_on_gpu(heads, kv_heads, head_dim, block_size, dtype, window, two_pass):
    case = make_decode_case(
        heads + head_dim, edge_lens(block_size), heads, kv_heads, head_dim, block_size, dtype, window
    )
    check_on_gpu(case, two_pass=two_pass, partition_tokens=block_size * 3 // 2)


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim,block_size,dtype,window,sinks", SINKS_MATRIX)
def test_sinks_and_value_widths_on_gpu(heads, kv_heads, head_dim, v_dim, block_size, dtype, window, sinks, two_pass):
    case = make_decode_case(
        heads * 10 + v_dim,
        edge_lens(block_size),
        heads,
        kv_heads,
        head_dim,
        block_size,
        dtype,
        window,
        v_dim=v_dim,
        sinks=sinks,
    )
    check_on_gpu(case, two_pass=two_pass, partition_tokens=block_size * 3 // 2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_every_specialisation_compiles_and_runs(dtype, head_dim, block_size):
    gqa = min(8, 2048 // head_dim)  # the most query heads per KV head the kernel takes at this D
    case = make_decode_case(
        head_dim + block_size, [block_size + 1, 3 * block_size], 2 * gqa, 2, head_dim, block_size, dtype
    )
    check_on_gpu(case)
    check_on_gpu(case, two_pass=True, partition_tokens=block_size)


@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block_size,dtype,window,two_pass", LONG)
def test_long_contexts_on_gpu(lens, heads, kv_heads, head_dim, block_size, dtype, window, two_pass):
    case = make_decode_case(sum(lens), lens, heads, kv_heads, head_dim, block_size, dtype, window)
    check_on_gpu(case, two_pass=two_pass)


def test_dispatch_uses_the_kernel_on_metal():
    assert attention.resolved_backend() == "kernel"
    case = make_decode_case(3, [100, 2000], 32, 8, 128, 16, "float16", window=512)
    with attention.attention_backend("kernel"):
        out = attention.paged_attention(*case.args(), window=case.window)
    assert max_error(out, case.expected()) < case.tolerance


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,tail,sinks",
    [
        (8, 2, 128, 16, "bfloat16", 6, False),
        (4, 2, 96, 32, "float16", 33, True),
    ],
)
def test_pool_then_tail_on_gpu(heads, kv_heads, head_dim, block_size, dtype, tail, sinks):
    """A decode pass queued ahead (runner/deferred_writes.py): pages in place, then K/V not written yet."""
    from mlxpaged.kernels.paged_attention import tail_partials
    from tests.kernels.test_kernel_tail_emulated import tail_case

    case, k, v, expected = tail_case(
        head_dim, [1, block_size, 3 * block_size + 5], tail, heads, kv_heads, head_dim, block_size, dtype, sinks
    )
    out = paged_attention_kernel(
        case.q,
        case.k_pool,
        case.v_pool,
        case.block_tables,
        case.context_lens,
        case.scale,
        sinks=case.sinks,
        tail=tail_partials(case.q, k, v, case.scale),
    )
    mx.eval(out)
    assert max_error(out, expected) < case.tolerance
