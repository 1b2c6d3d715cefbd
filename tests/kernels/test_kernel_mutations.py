"""Deliberately broken copies of the real paged-attention kernel must fail the emulated tests."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import paged_attention as pa
from tests.kernels.test_kernel_self_check import mutate  # noqa: F401 (fixture: a patched copy of a kernel source)
from tests.msl.cuda_harness import CudaEmulator
from tests.msl.harness import Emulator, MetalEmulationError
from tests.msl.oracle import make_decode_case, max_error

import pytest

EMULATORS = {"metal": Emulator, "cuda": CudaEmulator}


def run_case(two_pass: bool = False, seed: int = 0, language: str = "metal"):
    case = make_decode_case(21, [0, 1, 15, 16, 17, 45], 4, 2, 64, 16, "float32")
    launcher = EMULATORS[language](seed=seed)
    out = pa.paged_attention_kernel(*case.args(), launcher=launcher, two_pass=two_pass, partition_tokens=24)
    return max_error(out, case.expected()), case.tolerance


def test_unmutated_kernel_passes(mutate):
    mutate(("paged_attention_decode", "const float min_score", "const float min_score"))
    error, tolerance = run_case()
    assert error < tolerance


MUTATIONS = [
    # (section, old, new, expected failure, two_pass)
    (
        "paged_attention_decode",
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n",
        "}\n",
        "race on 'tg_out'",
        False,
    ),
    (
        "paged_attention_decode",
        "    const float score = metal::simd_sum(partial);",
        "    const float score = lane < 16 ? metal::simd_sum(partial) : partial;",
        "only some lanes",
        False,
    ),
    (
        "paged_attention_decode",
        "t < last; t += NSG",
        "t <= last; t += NSG",
        "out-of-bounds|not inside any buffer",
        False,
    ),
    ("paged_attention_decode", "    l_part[head_row * num_partitions + part] = total;\n", "", "wrong answer", True),
    (
        "paged_attention_decode",
        "if (lane == 0) {\n  for (int g = 0; g < G; g++) {",
        "if (lane == 0 && sg > 0) {\n  for (int g = 0; g < G; g++) {",
        "uninitialised threadgroup memory 'tg_max'",
        False,
    ),
    ("paged_attention_reduce", "acc[i] / total", "acc[i] / (total + 1.0f)", "wrong answer", True),
]


CUDA_MUTATIONS = [
    # The CUDA twin broken the same ways: its harness must catch each as the Metal one does.
    ("paged_attention_decode", "  __syncthreads();\n}\n", "}\n", "race on 'tg_out'", False),
    (
        "paged_attention_decode",
        "    const float score = pa_warp_sum(partial);",
        "    const float score = lane < 16 ? pa_warp_sum(partial) : partial;",
        "only some lanes",
        False,
    ),
    MUTATIONS[2],  # one token too many: the same line in both sources
    MUTATIONS[3],  # an unwritten partial sum
    MUTATIONS[4],  # uninitialised shared memory
    ("header", "for (int offset = 16; offset > 0", "for (int offset = 8; offset > 0", "wrong answer", False),
    MUTATIONS[5],  # a wrong reduce
]
CASES = [("metal", *m) for m in MUTATIONS] + [("cuda", *m) for m in CUDA_MUTATIONS]
NAMES = ["missing_barrier", "divergent_simd_sum", "off_by_one_token", "unwritten_partial_sum"]
NAMES += ["uninitialised_threadgroup", "bad_reduce"]
CUDA_NAMES = [*NAMES[:5], "half_a_warp_summed", "bad_reduce"]


@pytest.mark.parametrize(
    "language,section,old,new,expected,two_pass",
    CASES,
    ids=[f"metal-{n}" for n in NAMES] + [f"cuda-{n}" for n in CUDA_NAMES],
)
def test_broken_kernel_is_caught(mutate, language, section, old, new, expected, two_pass):
    mutate((section, old, new), language=language)
    if expected == "wrong answer":
        error, tolerance = run_case(two_pass, language=language)
        assert error > tolerance
        return
    with pytest.raises(MetalEmulationError, match=expected):
        run_case(two_pass, language=language)


def test_the_metal_source_is_left_alone_when_the_cuda_twin_is_mutated(mutate):
    mutate(("paged_attention_reduce", "acc[i] / total", "acc[i] / (total + 1.0f)"), language="cuda")
    error, tolerance = run_case(two_pass=True)
    assert error < tolerance
