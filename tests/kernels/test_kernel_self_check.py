"""The kernel self-check (kernels/self_check.py) through the CPU harness: a correct kernel passes,
a mutated, racy or uncompilable one fails with a reason that says which; the Metal GPU version is
checked on a Mac (`pytest -m metal`)."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import paged_attention as pa
from mlxpaged.kernels import self_check as sc
from tests.msl.harness import Emulator

import mlx.core as mx
import pytest

# Mutations of paged_attention.metal: (section, old, new).
WRONG_SCALE = ("paged_attention_decode", "q[g * EPL + i] = scale[0] *", "q[g * EPL + i] = 0.5f * scale[0] *")
WRONG_REDUCE = ("paged_attention_reduce", "acc[i] / total", "acc[i] / (total + 1.0f)")
MISSING_BARRIER = ("paged_attention_decode", "  threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n", "}\n")
NOT_COMPILING = ("header", "// (no shared helpers", "undeclared_type broken;\n// (no shared helpers")


@pytest.fixture
def mutate(monkeypatch):
    """mutate((section, old, new), language="metal"): the kernel wrapper builds from a patched copy of that source
    (paged_attention.metal, or .cu for "cuda"); the other source stays as it is."""
    original = pa.source_sections

    def apply(mutation: tuple[str, str, str], language: str = "metal") -> None:
        section, old, new = mutation
        sections = dict(original(language))
        assert old in sections[section], f"mutation target not found: {old!r}"
        sections[section] = sections[section].replace(old, new, 1)
        monkeypatch.setattr(
            pa, "source_sections", lambda lang="metal": sections if lang == language else original(lang)
        )
        pa.decode_kernel.cache_clear()
        pa.reduce_kernel.cache_clear()
        sc.clear_checks()

    yield apply
    pa.decode_kernel.cache_clear()
    pa.reduce_kernel.cache_clear()
    sc.clear_checks()


def test_variants_for_one_model():
    one, two = sc.variants_for(dtype="float16", head_dim=64, block_size=16, num_heads=9, num_kv_heads=3)
    assert (one.gqa, one.two_pass, two.two_pass) == (3, False, True)
    assert one.describe() == "float16 D=64 BS=16 G=3 one-pass"
    assert two.describe() == "float16 D=64 BS=16 G=3 two-pass"
    with pytest.raises(ValueError, match="9 query heads is not a multiple of 2 KV heads"):
        sc.variants_for(dtype="float16", head_dim=64, block_size=16, num_heads=9, num_kv_heads=2)
    with pytest.raises(ValueError, match="got 'int8'"):
        sc.variants_for(dtype="int8", head_dim=64, block_size=16, num_heads=8, num_kv_heads=2)


@pytest.mark.parametrize(
    "variant",
    [
        sc.KernelVariant("float32", 64, 16, 3, False),
        sc.KernelVariant("float16", 128, 8, 1, True),
        sc.KernelVariant("bfloat16", 96, 32, 2, True),
    ],
    ids=lambda v: v.describe(),
)
def test_correct_kernel_passes_and_is_cached(variant):
    launcher = Emulator()
    check = sc.check_variant(variant, launcher)
    assert (check.ok, check.reason, check.variant) == (True, None, variant)
    assert check.seconds > 0  # its cost is reported (stats, doctor), not asserted: tests never fail on timing
    assert sc.check_variant(variant, launcher) is check  # once per process per (variant, launcher)


def test_wrong_numbers_are_a_mismatch(mutate):
    mutate(WRONG_REDUCE)  # only the two-pass merge is wrong
    one, two = (
        sc.check_variant(v, Emulator())
        for v in sc.variants_for(dtype="float32", head_dim=64, block_size=16, num_heads=4, num_kv_heads=2)
    )
    assert one.ok and one.reason is None
    assert not two.ok
    assert two.reason.startswith("mismatch: max error ") and two.reason.endswith(" > tolerance 0.0001")
    assert float(two.reason.split()[3]) > sc.TOLERANCE["float32"]


def test_a_race_is_an_exception(mutate):
    mutate(MISSING_BARRIER)
    check = sc.check_variant(sc.KernelVariant("float16", 64, 8, 2, False), Emulator())
    assert not check.ok
    assert check.reason.startswith("exception: MetalEmulationError:") and "race on 'tg_out'" in check.reason


def test_source_that_does_not_compile(mutate):
    mutate(NOT_COMPILING)
    check = sc.check_variant(sc.KernelVariant("float32", 64, 16, 1, True), Emulator())
    assert not check.ok
    assert check.reason.startswith("compile error: ") and "undeclared_type" in check.reason


def test_unsupported_variant_says_why():
    check = sc.check_variant(sc.KernelVariant("float32", 80, 16, 1, False), Emulator())
    assert not check.ok and "head dim 80" in check.reason


def test_metal_compile_errors_are_named():
    error = RuntimeError(
        "[metal::Device] Unable to build metal library from source\n"
        "program_source:12:3: error: unknown type name 'undeclared_type'\n"
    )
    assert sc.failure_reason(error) == "compile error: program_source:12:3: error: unknown type name 'undeclared_type'"
    assert sc.failure_reason(ValueError("bad\nmore")) == "exception: ValueError: bad"


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="metal: needs an Apple GPU (Metal); skipped elsewhere")
def test_every_default_variant_passes_on_the_gpu():
    for dtype in sc.TOLERANCE:
        for variant in sc.variants_for(dtype=dtype, head_dim=64, block_size=16, num_heads=9, num_kv_heads=3):
            check = sc.check_variant(variant)
            assert check.ok, check.reason
            print(
                f"{variant.describe()}: {check.seconds:.3f} s"
            )  # the "well under a second": read, not asserted
