"""The CPU backend's SwiGLU (kernels/cpu_activations.py) against a NumPy float64 reference, and its routing
(runner/activation_routing.py): the engine's passes take it, every other caller keeps mlx-lm's."""

import sys

import mlxpaged  # noqa: F401
from mlxpaged.kernels.cpu_activations import swiglu_cpu, swiglu_cpu_applies
from mlxpaged.runner.activation_routing import engine_activations, route_cpu_activations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations


def reference(gate: np.ndarray, x: np.ndarray) -> np.ndarray:
    g = gate.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * x.astype(np.float64)


def test_swiglu_matches_float64_to_float32_precision():
    gate = np.concatenate([np.linspace(-30.0, 30.0, 300_001), [0.0, -0.0, 1e-8, -1e-8, 87.0, -87.0]]).astype(np.float32)
    x = np.random.default_rng(0).uniform(-3, 3, gate.shape).astype(np.float32)
    got = np.array(swiglu_cpu(mx.array(gate), mx.array(x)), dtype=np.float64)
    want = reference(gate, x)
    scale = np.abs(gate.astype(np.float64) * x)  # silu(g) * x is at most |g x|: relative to that, a few ulps
    assert np.max(np.abs(got - want) / np.maximum(scale, 1e-30)) < 1e-6


def test_swiglu_saturates_without_inf_or_nan():
    gate = mx.array([-1e4, -200.0, -100.0, 100.0, 200.0, 1e4], dtype=mx.float32)
    x = mx.array([2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    got = np.array(swiglu_cpu(gate, x))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:3], 0.0, atol=1e-30)  # silu(g) -> 0 for g -> -inf
    np.testing.assert_allclose(got[3:], np.array(gate)[3:] * 2.0, rtol=1e-7)  # silu(g) -> g for g -> inf


def test_swiglu_agrees_with_mlx_lm_within_a_few_ulps():
    rng = np.random.default_rng(1)
    gate, x = (mx.array(rng.normal(0, 3, (7, 33, 96)).astype(np.float32)) for _ in range(2))
    ours, theirs = np.array(swiglu_cpu(gate, x)), np.array(activations.swiglu(gate, x))
    assert np.max(np.abs(ours - theirs) / (np.abs(theirs) + 1e-30)) < 2e-6


def test_only_float32_operands_of_one_shape_apply():
    a = mx.zeros((2, 3))
    assert swiglu_cpu_applies(a, a)
    assert not swiglu_cpu_applies(a.astype(mx.bfloat16), a.astype(mx.bfloat16))
    assert not swiglu_cpu_applies(a, mx.zeros((1, 3)))


def test_routed_swiglu_is_mlx_lms_own_outside_the_engines_passes():
    import mlx_lm.models.llama as llama  # a module that imports swiglu by name

    assert route_cpu_activations() > 0
    assert route_cpu_activations() > 0  # idempotent: routing twice keeps one dispatcher
    routed = llama.swiglu
    assert routed.original is sys.modules["mlx_lm.models.activations"].swiglu.original
    gate, x = mx.array(np.linspace(-6, 6, 999, dtype=np.float32)), mx.ones((999,))
    original = routed.original(gate, x)
    assert mx.array_equal(routed(gate, x), original)  # outside: bit for bit mlx-lm's
    with engine_activations():
        inside = routed(gate, x)
        assert mx.array_equal(inside, swiglu_cpu(gate, x))
        half = routed(gate.astype(mx.bfloat16), x.astype(mx.bfloat16))  # not float32: mlx-lm's
        assert mx.array_equal(half, routed.original(gate.astype(mx.bfloat16), x.astype(mx.bfloat16)))
    assert mx.array_equal(routed(gate, x), original)  # the block restores the caller's state


def test_another_threads_calls_keep_mlx_lms_own_while_the_engine_builds():
    import threading

    import mlx_lm.models.llama as llama

    route_cpu_activations()
    seen = {}

    def other_thread():  # MLX arrays stay on the thread (and stream) that made them
        gate, x = mx.array(np.linspace(-6, 6, 999, dtype=np.float32)), mx.ones((999,))
        seen["routed"], seen["own"] = np.array(llama.swiglu(gate, x)), np.array(llama.swiglu.original(gate, x))

    with engine_activations():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert np.array_equal(seen["routed"], seen["own"])


@pytest.mark.parametrize("width", [1, 1536])
def test_swiglu_compiles_inside_a_traced_pass(width):
    """A compiled decode pass (runner/decode_pass.py, not shapeless) traces through it."""
    rng = np.random.default_rng(2)
    gate, x = (mx.array(rng.normal(0, 2, (3, width)).astype(np.float32)) for _ in range(2))
    traced = mx.compile(lambda g, u: swiglu_cpu(g, u) * 2.0)
    np.testing.assert_allclose(
        np.array(traced(gate, x)), 2 * reference(np.array(gate), np.array(x)), rtol=2e-6, atol=1e-7
    )
