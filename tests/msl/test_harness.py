"""The Metal-on-CPU harness runs correct kernels and demonstrably catches broken ones."""

import mlxpaged  # noqa: F401
from tests.msl.harness import MetalEmulationError, run_kernel

import mlx.core as mx
import numpy as np
import pytest

# A block sum: simd_sum per simdgroup, partials through threadgroup memory, one barrier.
BLOCK_SUM = """
uint i = thread_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
threadgroup float partial[32];
float v = i < uint(n[0]) ? float(inp[i]) : 0.0f;
float s = simd_sum(v);
if (lane == 0) partial[sg] = s;
BARRIER
if (i < uint(n[0])) {
  float total = 0.0f;
  for (uint k = 0; k < simdgroups_per_threadgroup; k++) total += partial[k];
  out[i] = T(total);
}
"""


def block_sum_kernel(name: str, barrier: str = "threadgroup_barrier(mem_flags::mem_threadgroup);", body=BLOCK_SUM):
    return mx.fast.metal_kernel(
        name=name, input_names=["inp", "n"], output_names=["out"], source=body.replace("BARRIER", barrier)
    )


def run_block_sum(kernel, x: mx.array, group: int, **options):
    n = mx.array([x.size], dtype=mx.int32)
    return run_kernel(
        kernel,
        inputs=[x, n],
        template=[("T", x.dtype)],
        grid=(x.size, 1, 1),
        threadgroup=(group, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
        **options,
    )[0]


def expected_block_sum(x: np.ndarray, group: int) -> np.ndarray:
    out = np.empty_like(x, dtype=np.float64)
    for start in range(0, x.size, group):
        out[start : start + group] = x[start : start + group].astype(np.float64).sum()
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correct_kernel_runs_with_partial_threadgroups(dtype, seed):
    size, group = 1000, 256  # the last group has 232 threads: dispatchThreads semantics
    x = (mx.arange(size) % 7).astype(dtype)
    out = run_block_sum(block_sum_kernel("block_sum"), x, group, seed=seed)
    assert out.dtype == dtype
    expected = mx.array(expected_block_sum(np.array(x.astype(mx.float32)), group).astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), np.array(expected.astype(mx.float32)))


def test_bfloat16_rounds_to_nearest_even():
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even mantissa (1).
    k = mx.fast.metal_kernel(
        name="bf16_round",
        input_names=["inp"],
        output_names=["out"],
        source="uint i = thread_position_in_grid.x; out[i] = bfloat16_t(inp[i]);",
    )
    values = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-12], np.float32)
    x = mx.array(values)
    out = run_kernel(
        k, inputs=[x], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.bfloat16]
    )[0]
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), np.array(x.astype(mx.bfloat16).astype(mx.float32)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_missing_barrier_is_caught(seed):
    # Depending on the fiber order the reader either finds the slot unwritten or races the writer.
    x = mx.ones((256,))
    with pytest.raises(MetalEmulationError, match=r"(race on|uninitialised threadgroup memory) 'partial'"):
        run_block_sum(block_sum_kernel("block_sum_no_barrier", barrier=""), x, 256, seed=seed)


# Reuses one threadgroup slot per round; the barrier after the reads protects the next write.
ROUNDS = """
uint i = thread_position_in_grid.x;
threadgroup float slot[1];
float acc = 0.0f;
for (int r = 0; r < 3; r++) {
  if (i == 0) slot[0] = float(inp[r]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  acc += slot[0];
  SECOND_BARRIER
}
out[i] = acc;
"""


def test_missing_second_barrier_is_caught_as_write_after_read_race():
    call = {
        "inputs": [mx.array([1.0, 2.0, 4.0])],
        "grid": (64, 1, 1),
        "threadgroup": (64, 1, 1),
        "output_shapes": [(64,)],
        "output_dtypes": [mx.float32],
    }
    good = mx.fast.metal_kernel(
        name="rounds",
        input_names=["inp"],
        output_names=["out"],
        source=ROUNDS.replace("SECOND_BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
    )
    assert np.all(np.array(run_kernel(good, **call)[0]) == 7.0)
    bad = mx.fast.metal_kernel(
        name="rounds_race", input_names=["inp"], output_names=["out"], source=ROUNDS.replace("SECOND_BARRIER", "")
    )
    with pytest.raises(MetalEmulationError, match="race on 'slot'\\[0\\]: overwritten while other threads read it"):
        run_kernel(bad, **call)


def test_missing_barrier_gives_seed_dependent_results_without_strict_checks():
    """The shuffled fiber order alone shakes out the ordering assumption."""
    x = mx.ones((256,))
    kernel = block_sum_kernel("block_sum_no_barrier_lax", barrier="")
    outs = [np.array(run_block_sum(kernel, x, 256, strict=False, seed=s)) for s in range(4)]
    assert any(not np.array_equal(outs[0], o, equal_nan=True) for o in outs[1:])
    assert any(np.isnan(o).any() or not np.all(o == 256) for o in outs)


def test_divergent_simd_sum_is_caught():
    body = BLOCK_SUM.replace("float s = simd_sum(v);", "float s = lane < 16 ? simd_sum(v) : v;")
    with pytest.raises(MetalEmulationError, match=r"simd_sum .*only some lanes"):
        run_block_sum(block_sum_kernel("divergent_sum", body=body), mx.ones((64,)), 64)


def test_simd_sum_after_early_exit_is_caught():
    body = "if (thread_index_in_simdgroup >= 30) return;\n" + BLOCK_SUM
    with pytest.raises(MetalEmulationError, match=r"only some lanes .* exited"):
        run_block_sum(block_sum_kernel("early_exit_sum", body=body), mx.ones((64,)), 64)


def test_barrier_reached_by_some_threads_is_caught():
    body = """
    uint i = thread_position_in_grid.x;
    if (simdgroup_index_in_threadgroup == 0) threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = inp[i];
    """
    k = mx.fast.metal_kernel(name="partial_barrier", input_names=["inp"], output_names=["out"], source=body)
    with pytest.raises(MetalEmulationError, match=r"barrier at line \d+ reached by only some threads"):
        run_kernel(
            k,
            inputs=[mx.ones((128,))],
            grid=(128, 1, 1),
            threadgroup=(128, 1, 1),
            output_shapes=[(128,)],
            output_dtypes=[mx.float32],
        )


def test_off_by_one_read_names_the_buffer():
    k = mx.fast.metal_kernel(
        name="off_by_one",
        input_names=["inp"],
        output_names=["out"],
        source="uint i = thread_position_in_grid.x; out[i] = inp[i + 1];",
    )
    x = mx.ones((100,))
    with pytest.raises(MetalEmulationError, match="out-of-bounds read 0 bytes past the end of buffer 'inp'"):
        run_kernel(
            k, inputs=[x], grid=(100, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(100,)], output_dtypes=[mx.float32]
        )


def test_off_by_one_write_names_the_buffer():
    k = mx.fast.metal_kernel(
        name="off_by_one_write",
        input_names=["inp"],
        output_names=["out"],
        source="uint i = thread_position_in_grid.x; out[i + 1] = inp[i];",
    )
    with pytest.raises(MetalEmulationError, match=r"out-of-bounds write .* buffer 'out'"):
        run_kernel(
            k,
            inputs=[mx.ones((64,))],
            grid=(64, 1, 1),
            threadgroup=(64, 1, 1),
            output_shapes=[(64,)],
            output_dtypes=[mx.float32],
        )


def test_uninitialised_threadgroup_read_is_caught():
    body = BLOCK_SUM.replace("if (lane == 0) partial[sg] = s;", "if (lane == 0 && sg > 0) partial[sg] = s;")
    with pytest.raises(MetalEmulationError, match="uninitialised threadgroup memory 'partial'\\[0\\]"):
        run_block_sum(block_sum_kernel("uninit", body=body), mx.ones((128,)), 128)


def test_threadgroup_memory_limit_is_enforced():
    body = BLOCK_SUM.replace(
        "threadgroup float partial[32];", "threadgroup float partial[32];\nthreadgroup float big[8192];\nbig[0] = 0.0f;"
    )
    with pytest.raises(MetalEmulationError, match="threadgroup memory exceeds 32768 bytes: 'big'"):
        run_block_sum(block_sum_kernel("too_much_tg", body=body), mx.ones((32,)), 32)


def test_threadgroup_index_out_of_bounds_is_caught():
    body = BLOCK_SUM.replace("partial[k]", "partial[k + 1]")
    with pytest.raises(MetalEmulationError, match="'partial' index 32 out of bounds"):
        run_block_sum(block_sum_kernel("tg_oob", body=body), mx.ones((1024,)), 1024)


def test_write_to_input_is_caught():
    k = mx.fast.metal_kernel(
        name="writes_input",
        input_names=["inp"],
        output_names=["out"],
        source="uint i = thread_position_in_grid.x; ((device float*)inp)[i] = 0; out[i] = 1;",
    )
    with pytest.raises(MetalEmulationError, match="read-only input buffer 'inp'"):
        run_kernel(
            k,
            inputs=[mx.ones((64,))],
            grid=(64, 1, 1),
            threadgroup=(64, 1, 1),
            output_shapes=[(64,)],
            output_dtypes=[mx.float32],
        )


def test_unwritten_outputs_are_poisoned_and_init_value_honoured():
    k = mx.fast.metal_kernel(
        name="writes_half",
        input_names=["inp"],
        output_names=["out"],
        source="uint i = thread_position_in_grid.x; if (i % 2 == 0) out[i] = inp[i];",
    )
    call = {
        "inputs": [mx.ones((8,))],
        "grid": (8, 1, 1),
        "threadgroup": (8, 1, 1),
        "output_shapes": [(8,)],
        "output_dtypes": [mx.float32],
    }
    assert np.isnan(np.array(run_kernel(k, **call)[0])[1::2]).all()
    assert (np.array(run_kernel(k, init_value=3.0, **call)[0])[1::2] == 3.0).all()


def test_shuffles_and_lane_exchange():
    body = """
    uint i = thread_position_in_grid.x;
    float v = float(inp[i]);
    out[4 * i + 0] = simd_shuffle_down(v, 1);
    out[4 * i + 1] = simd_shuffle_xor(v, 3);
    out[4 * i + 2] = simd_broadcast(v, 5);
    out[4 * i + 3] = simd_max(v);
    """
    k = mx.fast.metal_kernel(name="exchange", input_names=["inp"], output_names=["out"], source=body)
    x = mx.arange(64).astype(mx.float32)
    out = np.array(
        run_kernel(
            k, inputs=[x], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(256,)], output_dtypes=[mx.float32]
        )[0]
    ).reshape(64, 4)
    lane = np.arange(64) % 32
    base = np.arange(64) - lane
    np.testing.assert_array_equal(out[:, 0], np.where(lane < 31, np.arange(64) + 1, np.arange(64)))
    np.testing.assert_array_equal(out[:, 1], base + (lane ^ 3))
    np.testing.assert_array_equal(out[:, 2], base + 5)
    np.testing.assert_array_equal(out[:, 3], base + 31)
