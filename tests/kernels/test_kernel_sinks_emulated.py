"""The paged kernel (Metal and its CUDA twin) with sinks and V width != K width, run by the strict CPU
emulators against the float64 oracle; broken copies (a sink per partition, none in the reduce, V read at K's
stride) must fail; the self-check covers the new variants."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention
from mlxpaged.kernels import paged_attention as pa
from mlxpaged.kernels import self_check as sc
from tests.kernels.test_kernel_self_check import mutate  # noqa: F401 (fixture)
from tests.msl.harness import Emulator, MetalEmulationError
from tests.msl.oracle import make_decode_case, max_error

import mlx.core as mx
import numpy as np
import pytest

MATRIX = [
    # (heads, kv_heads, head_dim, v_dim, block_size, dtype, window, sinks)
    (8, 2, 64, 64, 8, "float32", None, True),
    (4, 4, 64, 32, 16, "float16", None, False),
    (8, 1, 32, 128, 16, "bfloat16", 20, True),
    (6, 2, 128, 64, 8, "float32", 9, True),
]


def check(emulator, case, seed: int, **options):
    out = pa.paged_attention_kernel(
        *case.args(), window=case.window, sinks=case.sinks, launcher=emulator(strict=True, seed=seed), **options
    )
    assert out.shape == case.expected().shape
    error = max_error(out, case.expected())
    assert error < case.tolerance, f"error {error:.3g} over tolerance {case.tolerance}"


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim,block_size,dtype,window,sinks", MATRIX)
def test_edge_lengths(heads, kv_heads, head_dim, v_dim, block_size, dtype, window, sinks, two_pass, emulator):
    lens = [0, 1, block_size, block_size + 1, 4 * block_size + 3]
    case = make_decode_case(
        heads * 10 + v_dim, lens, heads, kv_heads, head_dim, block_size, dtype, window, v_dim=v_dim, sinks=sinks
    )
    # Partitions of 1.5 blocks: several per sequence, so a sink counted per partition shows.
    check(emulator, case, heads, two_pass=two_pass, partition_tokens=block_size * 3 // 2)


def test_long_context_two_pass_with_sinks(emulator):
    case = make_decode_case(31, [3001, 40], 4, 2, 64, 32, "float32", v_dim=32, sinks=True)
    check(emulator, case, 1, two_pass=True)


def run_case(two_pass: bool, v_dim: int = 64) -> tuple[float, float]:
    case = make_decode_case(22, [0, 1, 15, 16, 17, 45], 4, 2, 64, 16, "float32", v_dim=v_dim, sinks=True)
    out = pa.paged_attention_kernel(
        *case.args(), sinks=case.sinks, launcher=Emulator(), two_pass=two_pass, partition_tokens=12
    )
    return max_error(out, case.expected()), case.tolerance


NO_SINK_IN_REDUCE = (
    "paged_attention_reduce",
    "if (SINKS) {\n  const float sink = sinks[head];",
    "if (false) {\n  const float sink = 0;",
)
MUTATIONS = [
    # (section, old, new, two_pass)
    ("paged_attention_decode", "#if !PA_PARTITIONED\n  if (SINKS) {", "#if 1\n  if (SINKS) {", True),
    (*NO_SINK_IN_REDUCE, True),
    ("paged_attention_decode", "    group_max = top;\n", "", False),
    (
        "paged_attention_decode",
        "    total = total * metal::exp(group_max - top) + metal::exp(sink - top);\n",
        "",
        False,
    ),
]


@pytest.mark.parametrize(
    "section,old,new,two_pass",
    MUTATIONS,
    ids=["sink_per_partition", "no_sink_in_reduce", "sink_not_in_max", "sink_not_in_sum"],
)
def test_broken_sinks_are_caught(mutate, section, old, new, two_pass):
    mutate((section, old, new))
    error, tolerance = run_case(two_pass)
    assert error > tolerance


def test_value_rows_read_at_the_key_stride_are_caught(mutate):
    mutate(("paged_attention_decode", "v_pool[(slot) * DV + (e)]", "v_pool[(slot) * D + (e)]"))
    with pytest.raises(MetalEmulationError, match=r"out-of-bounds|not inside any buffer"):
        run_case(False, v_dim=32)  # K rows are twice as wide: the last slots read past V's buffer


@pytest.mark.parametrize(
    "variant",
    [
        sc.KernelVariant("float32", 64, 16, 4, False, 32, True),
        sc.KernelVariant("float16", 32, 8, 2, True, 128, True),
        sc.KernelVariant("bfloat16", 128, 16, 1, True, 64, False),
    ],
    ids=lambda v: v.describe(),
)
def test_self_check_variants_with_sinks_and_value_width(variant):
    check = sc.check_variant(variant, Emulator())
    assert (check.ok, check.reason) == (True, None)


def test_variant_names_and_equal_widths_are_one_variant():
    variant = sc.KernelVariant("float16", 64, 16, 2, False, 32, True)
    assert variant.describe() == "float16 D=64 DV=32 BS=16 G=2 sinks one-pass"
    assert sc.KernelVariant("float16", 64, 16, 2, False, 64) == sc.KernelVariant("float16", 64, 16, 2, False)
    one, two = sc.variants_for(
        dtype="float32", head_dim=64, block_size=8, num_heads=8, num_kv_heads=2, v_dim=32, sinks=True
    )
    assert (one.value_dim, one.sinks, two.two_pass) == (32, True, True)
    assert "value head dim 48" in sc.check_variant(sc.KernelVariant("float32", 64, 16, 1, False, 48)).reason


def test_self_check_catches_a_kernel_that_ignores_sinks(mutate):
    mutate(NO_SINK_IN_REDUCE)
    with_sinks = sc.check_variant(sc.KernelVariant("float32", 64, 16, 2, True, None, True), Emulator())
    without = sc.check_variant(sc.KernelVariant("float32", 64, 16, 2, True), Emulator())
    assert not with_sinks.ok and with_sinks.reason.startswith("mismatch")
    assert without.ok


def test_entry_point_dispatches_sinks_to_the_kernel():
    case = make_decode_case(41, [3, 20], 8, 2, 64, 16, v_dim=32, sinks=True)
    with attention.kernel_launcher(Emulator()), attention.attention_backend("kernel"):
        status = attention.prepare_attention(mx.float32, 64, 16, 8, 2, v_dim=32, sinks=True).status()
        out = attention.paged_attention(*case.args(), sinks=case.sinks)
    assert status["path"] == "kernel", status["reason"]
    assert [v.variant.sinks and v.variant.value_dim == 32 for v in status["variants"]] == [True, True]
    assert max_error(out, case.expected()) < 1e-5
    assert np.array(out).shape == (2, 8, 1, 32)
