"""The pages' quantizer (cache/group_fit.py) against a NumPy float64 twin, and its layout against mx.dequantize."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache import group_fit
from mlxpaged.cache.kv_quant import KVQuantization

import mlx.core as mx
import numpy as np
import pytest


def fitted_twin(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Group by group in float64: min-max levels, the least-squares scale and bias for them, the levels again."""
    top = 2**bits - 1
    out = np.empty_like(x, dtype=np.float64)
    rows = x.reshape(-1, group).astype(np.float64)
    for i, g in enumerate(rows):
        low, high = g.min(), g.max()
        step = max((high - low) / top, 1e-8)
        levels = np.clip(np.round((g - low) / step), 0, top)
        if levels.var() > 0:
            step, bias = np.polyfit(levels, g, 1)  # least squares: g ~ step * levels + bias
            step = max(step, 1e-8)
        else:
            bias = g.mean()
        levels = np.clip(np.round((g - bias) / step), 0, top)
        out.reshape(-1, group)[i] = levels * step + bias
    return out


def rand(*shape, seed=0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape)
    x[..., 5] *= 6  # an outlier channel, as keys have
    return x.astype(np.float32)


@pytest.mark.parametrize("group", [64, 32])
def test_fitted_4bit_groups_equal_the_float64_twin(group):
    x = rand(3, 2, 16, 128, seed=1)
    got = np.array(group_fit.round_trip(mx.array(x), KVQuantization(4, group)))
    want = fitted_twin(x, 4, group)
    # float32 against float64: a level can flip only where an element sits on a rounding boundary
    close = np.isclose(got, want, atol=1e-5)
    assert close.mean() > 0.999
    step = (x.reshape(-1, group).max(1) - x.reshape(-1, group).min(1)).max() / 15
    assert np.abs(got - want).max() <= step * 1.01


def test_fitting_lowers_the_groups_error_below_min_max():
    x = rand(64, 8, 64, seed=2)
    q = KVQuantization(4, 64)
    fitted = np.array(group_fit.round_trip(mx.array(x), q))
    minmax = np.array(mx.dequantize(*mx.quantize(mx.array(x), group_size=64, bits=4), group_size=64, bits=4))
    assert ((fitted - x) ** 2).mean() < 0.97 * ((minmax - x) ** 2).mean()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_fitted_pages_read_back_through_mx_dequantize_as_stored(dtype):
    """The packed words, scales and biases are mx.quantize's layout: mx.dequantize reads each element as
    level * scale + bias, the levels chosen for the scales and biases as stored (rounded to the dtype)."""
    x = mx.array(rand(4, 3, 64, seed=3)).astype(dtype)
    q = KVQuantization(4, 64)
    data, scales, biases = group_fit.quantize(x, q)
    assert data.dtype == mx.uint32 and data.shape == (4, 3, 8)
    assert scales.dtype == biases.dtype == dtype and scales.shape == (4, 3, 1)
    back = np.array(mx.dequantize(data, scales, biases, group_size=64, bits=4).astype(mx.float32))
    s, b = (np.array(a.astype(mx.float32)) for a in (scales, biases))
    levels = np.clip(np.round((np.array(x.astype(mx.float32)) - b) / s), 0, 15)
    tolerance = {mx.float32: 1e-6, mx.float16: 1e-2, mx.bfloat16: 5e-2}[dtype]
    np.testing.assert_allclose(back, levels * s + b, atol=tolerance * np.abs(back).max())


def test_a_constant_group_reads_back_exactly():
    x = mx.full((2, 64), 3.25)
    np.testing.assert_array_equal(np.array(group_fit.round_trip(x, KVQuantization(4, 64))), np.full((2, 64), 3.25))


def test_8bit_pages_keep_mx_quantize():
    x = mx.array(rand(5, 128, seed=4))
    for got, want in zip(
        group_fit.quantize(x, KVQuantization(8, 64)), mx.quantize(x, group_size=64, bits=8), strict=True
    ):
        assert mx.array_equal(got, want)
