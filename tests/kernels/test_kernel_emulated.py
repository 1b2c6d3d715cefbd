"""The paged-attention kernel, Metal and its CUDA twin, each run on the CPU by its strict emulator, against the
float64 oracle.

The matrix covers every listed value (GQA 1/2/4/8, head dims 64/96/128/256 and the other
multiples of 32, block sizes 8/16/32, three dtypes, windows, one and two passes, several
fiber-shuffle seeds) without the full cross product; a few cases run thousands of tokens.
"""

import mlxpaged  # noqa: F401
from mlxpaged.kernels.paged_attention import paged_attention_kernel
from tests.msl.oracle import make_decode_case, max_error

import numpy as np
import pytest

MATRIX = [
    # (heads, kv_heads, head_dim, block_size, dtype, window)
    (4, 4, 64, 8, "float32", None),
    (4, 2, 96, 16, "float16", 5),
    (8, 2, 128, 32, "bfloat16", None),
    (8, 1, 256, 16, "float32", 20),
    (8, 1, 64, 32, "float16", None),
    (8, 2, 256, 8, "bfloat16", 9),
    (4, 2, 128, 8, "float32", None),
    (2, 2, 96, 32, "bfloat16", 33),
]


def edge_lens(block_size: int) -> list[int]:
    return [0, 1, block_size - 1, block_size, block_size + 1, 4 * block_size + 3]


def check(emulator, case, seed: int, **options):
    out = paged_attention_kernel(*case.args(), window=case.window, launcher=emulator(strict=True, seed=seed), **options)
    error = max_error(out, case.expected())
    assert error < case.tolerance, f"error {error:.3g} over tolerance {case.tolerance}"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype,window", MATRIX)
def test_edge_lengths(heads, kv_heads, head_dim, block_size, dtype, window, two_pass, seed, emulator):
    case = make_decode_case(
        seed * 1000 + heads * 7 + head_dim + block_size,
        edge_lens(block_size),
        heads,
        kv_heads,
        head_dim,
        block_size,
        dtype,
        window,
    )
    # Partitions of 1.5 blocks: boundaries fall inside blocks as well as on them.
    check(emulator, case, seed, two_pass=two_pass, partition_tokens=block_size * 3 // 2)


@pytest.mark.parametrize("head_dim", [32, 160, 192, 224])
def test_other_head_dims(head_dim, emulator):
    case = make_decode_case(head_dim, [1, 17, 40], 4, 2, head_dim, 16, "float32")
    check(emulator, case, head_dim)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_shuffle_seeds(seed, emulator):
    case = make_decode_case(100 + seed, [0, 7, 8, 9, 30], 8, 2, 64, 8, "float16", window=None)
    check(emulator, case, seed, two_pass=seed % 2 == 1, partition_tokens=16)


LONG = [
    # (lens, heads, kv_heads, head_dim, block_size, dtype, window, two_pass)
    ([3001, 4096], 2, 1, 64, 32, "float32", None, False),
    ([5003], 4, 2, 128, 16, "float16", 1000, True),
    ([4100, 37], 2, 2, 64, 16, "bfloat16", None, True),
]


@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block_size,dtype,window,two_pass", LONG)
def test_long_contexts(lens, heads, kv_heads, head_dim, block_size, dtype, window, two_pass, emulator):
    case = make_decode_case(sum(lens), lens, heads, kv_heads, head_dim, block_size, dtype, window)
    check(emulator, case, 5, two_pass=two_pass)


def test_automatic_variant_and_wide_padded_table(emulator):
    # One sequence, wide table: the documented rule picks two passes (512-token partitions).
    case = make_decode_case(9, [2100], 2, 1, 64, 32, "float32", max_blocks=70)
    check(emulator, case, 0)
    padded = make_decode_case(10, [5, 0, 19], 4, 2, 64, 8, "float32", max_blocks=6)
    check(emulator, padded, 1)


def test_fewer_simdgroups_than_head_dim_lanes(emulator):
    # 4 simdgroups (128 threads) write a 256-wide head in two strides.
    case = make_decode_case(11, [1, 33, 70], 4, 2, 256, 16, "float32", window=40)
    check(emulator, case, 2, num_simdgroups=4)
    check(emulator, case, 3, num_simdgroups=4, two_pass=True, partition_tokens=16)


def test_all_empty_sequences_give_zeros(emulator):
    case = make_decode_case(12, [0, 0], 4, 2, 64, 16, "float16")
    out = paged_attention_kernel(*case.args(), launcher=emulator())
    assert np.all(np.array(out) == 0)
