"""The paged kernel's quantized variant (PA_DEQUANT; Metal and its CUDA twin), run on the CPU by the strict
emulators, against the float64 oracle over the pages' own dequantized values; its self-check catches a wrong
dequantization; and the engine on the kernel path with quantized pages gives the quantized twin's tokens."""

from __future__ import annotations

import mlxpaged  # noqa: F401
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.kernels import attention
from mlxpaged.kernels import self_check as sc
from mlxpaged.kernels.paged_attention import paged_attention_kernel
from tests.archs.quantized_reference import assert_greedy_matches
from tests.engine.test_engine import GREEDY, tiny_engine, tokenizer  # noqa: F401
from tests.kernels.test_kernel_self_check import mutate  # noqa: F401  (fixture)
from tests.msl.harness import Emulator
from tests.msl.oracle import max_error
from tests.msl.quantized_oracle import EXACT_TOLERANCE, QUANTIZATION_TOLERANCE, make_quantized_decode_case
from tests.tiny_models import random_tokens, tiny_llama

import pytest

MATRIX = [
    # (heads, kv_heads, head_dim, block_size, bits, group, dtype, window, sinks, v_dim)
    (8, 2, 64, 16, 8, 64, "float32", None, False, None),
    (4, 2, 64, 8, 4, 32, "float32", 5, False, None),
    (8, 1, 128, 32, 4, 64, "float16", None, True, None),
    (4, 4, 96, 16, 8, 32, "bfloat16", None, False, 64),
]
# The oracle's values are the pages' own, so only the dtype's rounding separates them (oracle.TOLERANCE).
DTYPE_TOLERANCE = {"float32": EXACT_TOLERANCE, "float16": 1e-2, "bfloat16": 3e-2}
WRONG_DEQUANT = ("header", "(e) / QGROUP]) +", "(e) / QGROUP]) * 1.01f +")


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("params", MATRIX, ids=lambda p: f"H{p[0]}KV{p[1]}D{p[2]}BS{p[3]}q{p[4]}g{p[5]}{p[6]}")
def test_the_quantized_variant_matches_the_oracle(params, two_pass, emulator):
    heads, kv_heads, dim, size, bits, group, dtype, window, sinks, v_dim = params
    exact, original = make_quantized_decode_case(
        3, [0, 1, size - 1, size + 1, 4 * size + 3], heads, kv_heads, dim, size, bits, group,
        dtype=dtype, window=window, sinks=sinks, v_dim=v_dim,
    )  # fmt: skip
    out = paged_attention_kernel(
        *exact.args(),
        window=window,
        sinks=exact.sinks,
        two_pass=two_pass,
        partition_tokens=size * 3 // 2,
        launcher=emulator(strict=True, seed=1),
    )
    assert max_error(out, exact.expected()) < DTYPE_TOLERANCE[dtype]
    assert max_error(out, original.expected()) < QUANTIZATION_TOLERANCE[bits] + DTYPE_TOLERANCE[dtype]


def test_the_self_check_covers_the_quantized_variants(mutate):
    variants = sc.variants_for(
        dtype="float32", head_dim=64, block_size=16, num_heads=4, num_kv_heads=2, quantization=KVQuantization(4, 32)
    )
    assert [v.describe() for v in variants] == [
        "float32 D=64 BS=16 G=2 q4/32 one-pass",
        "float32 D=64 BS=16 G=2 q4/32 two-pass",
    ]
    assert all(sc.check_variant(v, Emulator()).ok for v in variants)
    mutate(WRONG_DEQUANT)  # every scale 1% off: the full-precision variants never read it
    assert all(str(sc.check_variant(v, Emulator()).reason).startswith("mismatch: max error") for v in variants)
    plain = sc.variants_for(dtype="float32", head_dim=64, block_size=16, num_heads=4, num_kv_heads=2)
    assert all(sc.check_variant(v, Emulator()).ok for v in plain)


def test_the_engine_on_the_kernel_path_reads_quantized_pages_through_the_kernel(tokenizer):
    model = tiny_llama(head_dim=64)
    prompts = [random_tokens(n, seed=s) for s, n in enumerate((19, 6))]
    params = GREEDY.__class__(temperature=0.0, max_tokens=5, ignore_eos=True)
    with (
        attention.kernel_launcher(Emulator()),
        attention.attention_backend("kernel"),
        tiny_engine(model, tokenizer, kv_bits=8) as engine,
    ):
        status = engine.built.attention.status()
        got = [c.token_ids for c in engine.generate(prompts, params)]
    assert status["path"] == "kernel" and "q8/32" in status["reason"], status  # 8-bit pages: groups of 32
    assert_greedy_matches(got, model, prompts, 8)
