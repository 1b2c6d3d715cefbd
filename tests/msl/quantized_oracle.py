"""Quantized paged test cases and the float64 dequantization the oracle reads them through.

The oracle unpacks `mx.quantize`'s layout itself (element i of a uint32 word in bits [i * bits, (i + 1) *
bits), value = q * scale + bias per group), in float64 from the same packed arrays the pools hold, so a path
that dequantizes wrongly, or reads the wrong page's scales, disagrees with it.
"""

from __future__ import annotations

import mlxpaged  # noqa: F401  (loads OpenBLAS before mlx)
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.quantized_pages import QuantizedPages
from tests.msl.oracle import DecodeCase, make_decode_case

import mlx.core as mx
import numpy as np

# Our paths against the oracle over the same quantized values: only float32 rounding apart.
EXACT_TOLERANCE = 1e-4
# Against the oracle over the values before quantization (unit-normal K/V, unit-normal queries, D 64):
# the quantization's own error in the output, measured max ~0.01 (8-bit) and ~0.25 (4-bit) on these cases.
QUANTIZATION_TOLERANCE = {8: 0.03, 4: 0.5}


def dequantize64(pages: QuantizedPages) -> np.ndarray:
    """The pool's values in float64, unpacked from its data, scales and biases by NumPy."""
    bits, group = pages.bits, pages.group_size
    words = np.array(pages.data).astype(np.uint64)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)[None]
    q = (words[..., None] >> shifts) & np.uint64((1 << bits) - 1)
    q = q.reshape(*words.shape[:-1], words.shape[-1] * per_word).astype(np.float64)
    scales = np.repeat(np.array(pages.scales.astype(mx.float32), dtype=np.float64), group, axis=-1)
    biases = np.repeat(np.array(pages.biases.astype(mx.float32), dtype=np.float64), group, axis=-1)
    return q * scales + biases


def quantize_pool(pool: mx.array, quantization: KVQuantization) -> QuantizedPages:
    pages = QuantizedPages.zeros(tuple(pool.shape), pool.dtype, quantization)
    pages.data, pages.scales, pages.biases = pages.quantize(pool)
    mx.eval(pages.arrays)
    return pages


def quantized_case(case: DecodeCase, bits: int, group_size: int = 64) -> tuple[DecodeCase, DecodeCase]:
    """(the case with quantized pools and its oracle over their dequantized float64 values, the same case
    with the oracle over the values before quantization)."""
    quantization = KVQuantization(bits, group_size)
    k, v = quantize_pool(case.k_pool, quantization), quantize_pool(case.v_pool, quantization)
    exact = DecodeCase(**{**case.__dict__, "k_pool": k, "v_pool": v, "k64": dequantize64(k), "v64": dequantize64(v)})
    return exact, DecodeCase(**{**case.__dict__, "k_pool": k, "v_pool": v})


def make_quantized_decode_case(
    seed: int,
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    bits: int,
    group_size: int = 64,
    **kwargs,
) -> tuple[DecodeCase, DecodeCase]:
    return quantized_case(
        make_decode_case(seed, lens, heads, kv_heads, head_dim, block_size, **kwargs), bits, group_size
    )
