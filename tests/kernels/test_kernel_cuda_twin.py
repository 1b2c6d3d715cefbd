"""The CUDA twin of the paged kernel (paged_attention.cu) as the engine meets it on MLX's CUDA backend: the same
sections and inputs as the Metal source, self-checked per variant through its CPU harness (a broken twin falls
back, the Metal source's checks untouched), and, forced on a CUDA backend where MLX cannot build it (this CPU,
simulated as CUDA), the reference attends with one warning instead of the engine failing."""

import warnings

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention
from mlxpaged.kernels import paged_attention as pa
from mlxpaged.kernels import self_check as sc
from mlxpaged.platform import backend
from tests.kernels.test_kernel_self_check import mutate  # noqa: F401 (fixture)
from tests.msl.cuda_harness import CudaEmulator, translation_unit
from tests.msl.harness import Emulator
from tests.msl.oracle import make_decode_case, max_error

import mlx.core as mx
import pytest

VARIANTS = sc.variants_for(dtype="bfloat16", head_dim=64, block_size=16, num_heads=8, num_kv_heads=2)
BROKEN_REDUCE = ("paged_attention_reduce", "acc[i] / total", "acc[i] / (total + 1.0f)")


def test_both_sources_have_the_same_sections_and_the_language_follows_the_backend():
    assert pa.source_sections("cuda").keys() == pa.source_sections("metal").keys()
    assert pa.kernel_language() == "metal"  # this CPU: the Metal source is what a forced launcher runs
    with backend.simulate("cuda"):
        assert pa.kernel_language() == "cuda"
        kernel = pa.decode_kernel(True, False, "cuda")
    assert isinstance(kernel, pa.CudaKernel) and kernel.output_names == ("o_part", "m_part", "l_part")
    assert kernel.input_names == tuple(pa.DECODE_INPUTS)
    with pytest.raises(ValueError, match="kernel language must be one of metal, cuda"):
        pa.source_sections("opencl")


def test_the_harness_writes_the_signature_as_mlx_does():
    """MLX 0.32.4's build_kernel: custom_kernel_<name><template hash>, inputs const T*, outputs T*, constexprs."""
    kernel = pa.reduce_kernel("cuda")
    call = {
        # o_part, m_part, l_part, params, sinks
        "inputs": [
            mx.zeros((1, 2, 3, 32)),
            mx.zeros((1, 2, 3)),
            mx.zeros((1, 2, 3)),
            mx.zeros((6,), mx.int32),
            mx.zeros(1),
        ],
        "template": [("T", mx.bfloat16), ("DV", 32), ("SINKS", 0)],
        "output_dtypes": [mx.bfloat16],
    }
    unit, function = translation_unit(kernel, call)
    assert function == "custom_kernel_paged_attention_reduce_bfloat16_32_0"
    assert "const int32_t* params" in unit and "__nv_bfloat16* out) {" in unit
    assert "  using T = __nv_bfloat16;\n  constexpr int DV = 32;\n  constexpr int SINKS = 0;" in unit


def test_the_self_check_runs_the_cuda_twin_and_a_broken_one_falls_back(mutate):
    assert all(sc.check_variant(v, CudaEmulator(), "cuda").ok for v in VARIANTS)
    mutate(BROKEN_REDUCE, language="cuda")
    launcher = CudaEmulator()
    one, two = (sc.check_variant(v, launcher, "cuda") for v in VARIANTS)
    assert one.ok and str(two.reason).startswith("mismatch: max error"), two  # only the two-pass one reduces
    assert all(sc.check_variant(v, Emulator(), "metal").ok for v in VARIANTS)  # the Metal source is its own


def test_a_broken_twin_falls_back_with_one_warning_naming_the_cuda_kernel(mutate):
    mutate(BROKEN_REDUCE, language="cuda")
    case = make_decode_case(4, [3, 40], 8, 2, 64, 16, "bfloat16")
    with (
        backend.simulate("cuda"),
        attention.kernel_launcher(CudaEmulator()),
        attention.attention_backend("kernel"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        prepared = attention.prepare_attention(mx.bfloat16, 64, 16, 8, 2)
        status = prepared.status()
        out = attention.paged_attention(*case.args(), window=None)
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1 and "the CUDA paged-attention kernel failed its self-check" in texts[0], texts
    assert status["path"] == "kernel (with reference fallback)", status
    assert max_error(out, case.expected()) < case.tolerance


def test_forced_on_a_cuda_backend_that_cannot_build_it_the_reference_attends():
    """Simulated CUDA on this CPU: MLX refuses to build a cuda_kernel, so every variant fails its check with
    MLX's own message and the reference attends: the kernel can never take the engine down."""
    case = make_decode_case(5, [1, 17], 4, 2, 64, 16, "float16")
    with (
        backend.simulate("cuda"),
        attention.attention_backend("kernel"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        assert attention.resolved_backend() == "kernel"
        status = attention.prepare_attention(mx.float16, 64, 16, 4, 2).status()
        out = attention.paged_attention(*case.args())
    assert status["path"] == "reference", status
    assert status["reason"].startswith("self-check failed on the CUDA GPU") and "No CUDA back-end" in status["reason"]
    assert any("CUDA paged-attention kernel" in str(w.message) for w in caught)
    assert max_error(out, case.expected()) < case.tolerance
