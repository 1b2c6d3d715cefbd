"""Quantized page pools: one pool's packed data, scales and biases, written by quantizing as tokens arrive.

A `QuantizedPages` stands where a full-precision pool array stands (`PagedKVCache.keys[j]`): the same block
ids, heads and block size, its three arrays laid out as `mx.quantize` lays out the pool's rows (kv_quant.py;
the rows quantized by group_fit.py: mx.quantize's groups, or least-squares fitted ones for 4-bit pages).
It has the logical `shape` and `dtype` of the pool it replaces, so shape checks read alike for both. Writes
quantize the new rows and assign each array in place (the same indexed assignment as full pools, so the
same rule holds: no other live view of an array, or MLX copies it). Reads take whole pages of all three
arrays by the same rows and dequantize only what was taken (`dequantize`), or hand the packed pages to
`mx.quantized_matmul` (kernels/quantized_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.cache import group_fit
from mlxpaged.cache.kv_quant import KVQuantization

import mlx.core as mx


class QuantizedPages:
    """Pool `[num_blocks, kv_heads, block_size, dim]` stored quantized: `data` uint32 `[..., dim * bits / 32]`,
    `scales` and `biases` `[..., dim / group_size]` in the model's dtype."""

    def __init__(self, data: mx.array, scales: mx.array, biases: mx.array, quantization: KVQuantization):
        self.data, self.scales, self.biases, self.quantization = data, scales, biases, quantization

    @classmethod
    def zeros(cls, shape: tuple[int, int, int, int], dtype: mx.Dtype, quantization: KVQuantization) -> QuantizedPages:
        *lead, dim = shape
        q = quantization
        return cls(
            mx.zeros((*lead, q.packed_width(dim)), mx.uint32),
            mx.zeros((*lead, q.groups(dim)), dtype),
            mx.zeros((*lead, q.groups(dim)), dtype),
            q,
        )

    @property
    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.data, self.scales, self.biases

    def with_arrays(self, arrays: Sequence[mx.array]) -> QuantizedPages:
        data, scales, biases = arrays
        return QuantizedPages(data, scales, biases, self.quantization)

    @property
    def bits(self) -> int:
        return self.quantization.bits

    @property
    def group_size(self) -> int:
        return self.quantization.group_size

    @property
    def shape(self) -> tuple[int, ...]:
        """The full-precision pool's shape: the last axis counts elements, not packed words."""
        *lead, groups = self.scales.shape
        return (*lead, groups * self.group_size)

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def quantize(self, rows: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """`rows` [..., dim] in the pool's dtype as (data, scales, biases), as they are stored."""
        return group_fit.quantize(rows, self.quantization)

    def store(self, index: tuple, rows: mx.array) -> None:
        """`pool[index] = rows`, quantized: each array assigned in place at the same index."""
        for array, part in zip(self.arrays, self.quantize(rows), strict=True):
            array[index] = part

    def take_pages(self, rows: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Whole (block, head) pages of the three arrays by page row ids `rows` [B, KVH, nb] (block * KVH + head)
        -> each [B, KVH, nb * block_size, width]: one take per array, no transpose copy."""
        num_blocks, heads, size = self.data.shape[:3]
        batch, _, n = rows.shape
        out = []
        for array in self.arrays:
            width = array.shape[-1]
            flat = array.reshape(num_blocks * heads, size * width)
            out.append(mx.take(flat, rows, axis=0).reshape(batch, heads, n * size, width))
        return out[0], out[1], out[2]

    def dequantize(self, packed: Sequence[mx.array]) -> mx.array:
        """Packed rows (e.g. from `take_pages`) back to the pool's dtype."""
        data, scales, biases = packed
        return mx.dequantize(data, scales, biases, group_size=self.group_size, bits=self.bits)


Pool = mx.array | QuantizedPages  # one pool: a full-precision array, or its quantized pages


def store(pool: Pool, index: tuple, rows: mx.array) -> None:
    """`pool[index] = rows` in place; a quantized pool stores the rows quantized."""
    if isinstance(pool, QuantizedPages):
        pool.store(index, rows)
    else:
        pool[index] = rows


def store_pair(keys: Pool, values: Pool, index: tuple, k: mx.array, v: mx.array) -> None:
    """A layer's new K and V rows into its two pools at one index. Two quantized pools of one quantization and
    width quantize their rows in one call, side by side (a group never crosses the seam: the width is whole
    groups), then split: the same numbers in half the ops, which a decode step on the CPU pays per op (fitted
    4-bit groups are some 30 small ops a call: group_fit.py)."""
    if not (
        isinstance(keys, QuantizedPages)
        and isinstance(values, QuantizedPages)
        and keys.quantization == values.quantization
        and k.shape == v.shape
        and k.dtype == v.dtype
    ):
        store(keys, index, k)
        store(values, index, v)
        return
    for key_array, value_array, part in zip(
        keys.arrays, values.arrays, keys.quantize(mx.concatenate([k, v], axis=-1)), strict=True
    ):
        half = part.shape[-1] // 2
        key_array[index] = part[..., :half]
        value_array[index] = part[..., half:]


def is_quantized(pool: object) -> bool:
    return isinstance(pool, QuantizedPages)


def pool_arrays(pools: Sequence[mx.array | QuantizedPages]) -> list[mx.array]:
    """Every array of `pools`, in order (a quantized pool's data, scales, biases)."""
    out: list[mx.array] = []
    for pool in pools:
        out.extend(pool.arrays if isinstance(pool, QuantizedPages) else (pool,))
    return out


def as_arguments(pools: Sequence[mx.array | QuantizedPages]) -> list:
    """Pools as `mx.compile` takes them (arrays or tuples of arrays); `from_arguments` undoes it."""
    return [pool.arrays if isinstance(pool, QuantizedPages) else pool for pool in pools]


def from_arguments(arguments: Sequence, like: Sequence[mx.array | QuantizedPages]) -> list:
    """Traced or returned pool arguments back in the shape of `like` (quantized pools rebuilt)."""
    return [
        old.with_arrays(new) if isinstance(old, QuantizedPages) else new
        for new, old in zip(arguments, like, strict=True)
    ]
