"""An exact change of coordinates for K/V before they are quantized into pages (4-bit pages: kv_bits=4).

SmolLM2-like models have key channels of very unequal size (and queries whose large channels are other ones),
so one scale per 64 elements of a token's key row spends 16 levels on a few channels. Attention only needs
`q . k` and `sum p v`, which these transforms keep, so the model's function is unchanged in exact arithmetic:

- keys: `k' = (k * s) H - c_k`, queries `q' = (q / s) H`: `q' . k' = q . k - q' . c_k`, the same shift for
  every key of a query, which softmax ignores (H is orthonormal and symmetric, its own inverse);
- values: `v' = v H - c_v`, and the attention output over stored values `o' = P v'` maps back by
  `o = (o' + c_v) H` (the weights P of a row sum to one).

`s` is per layer, per KV head and channel, equal within each RoPE pair (keys are stored after RoPE, which
rotates a pair: equal scales commute with it, so the balance holds at every position). It balances keys against
queries, `s_c = sqrt(rms(q_c) / rms(k_c))` over a short calibration prefill (runner/kv_calibration.py), so the
products' error spreads over channels instead of riding on a few; H, a Sylvester-Hadamard matrix over the head
width, then spreads what is left of the outliers over the whole row. The centers `c` are the calibration's mean
K and V in those coordinates: SmolLM2's keys carry a common component of 70-85% of their RMS, which one affine
scale per row cannot take out; each is then moved by about half a 4-bit level at most, so that a typical
position-0 row (the attention sink) is stored exactly (runner/kv_calibration.py, `sink_shift`). Measured:
docs/design/issue24-quantized-pages.md. Layers whose attention has sinks (a softmax column with no value) get zero
centers: there neither shift is exact.

The pages hold K/V in these coordinates. Every read that hands K/V to the model (`PagedKVCache.gather_blocks`,
`as_stored`) maps them back; attention that reads the pools in place (kernels) takes `queries_in` and maps its
output back with `output_out`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

VERSION = 1  # bump when the coordinates change: pages written under another version mean other numbers


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two): symmetric, its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two order, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rope_pairs_equal(scale: np.ndarray, traditional: bool) -> bool:
    """True when `scale` [..., D] is equal within every pair RoPE rotates together."""
    d = scale.shape[-1]
    if traditional:
        return bool(np.array_equal(scale[..., 0::2], scale[..., 1::2]))
    return bool(np.array_equal(scale[..., : d // 2], scale[..., d // 2 :]))


@dataclass(frozen=True)
class LayerTransform:
    """One layer's coordinates: `key_scale` [kv_heads, D] (float32), the rotation H [D, D], and the centers
    `key_center`, `value_center` [kv_heads, D] subtracted in the rotated coordinates.

    A decode pass maps each layer's queries in and its attention output back: the query's per-head scale comes
    repeated per query head and the value center already rotated, built once here, so each map is one multiply
    or add and one 2-D matmul by H per call (on the CPU a batch-1 decode step pays per op: a per-head batched
    matmul, [heads, D, D], cost 3x the multiply and the 2-D matmul together, 30 layers: 1.1 ms against 0.4).
    The K/V writes and reads keep the scale and the 2-D rotation apart as well: pages written by any path
    (decode, prefill, mlx-lm's twin in the tests) must round to the same levels, which one order of operations
    for every path keeps."""

    key_scale: mx.array
    rotation: mx.array
    key_center: mx.array
    value_center: mx.array
    # query heads per KV head -> `per_query_head`'s two arrays
    _by_group: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def kv_heads(self) -> int:
        return self.key_scale.shape[0]

    def per_query_head(self, group: int) -> tuple[mx.array, mx.array]:
        """For `group` query heads per KV head (query head i reads KV head i // group): the queries' scales 1/s
        [heads, 1, D] and the output's shift c_v H [heads, 1, D]. Built once per group size, in NumPy (float64,
        then float32): it is first asked inside a compiled pass's trace, where MLX ops would be traced into every
        call."""
        if group not in self._by_group:
            s, h, c_v = (np.asarray(a, dtype=np.float64) for a in (self.key_scale, self.rotation, self.value_center))
            self._by_group[group] = tuple(
                mx.array(np.repeat(a[:, None, :], group, axis=0).astype(np.float32)) for a in (1.0 / s, c_v @ h)
            )
        return self._by_group[group]


class KVTransform:
    """Per-layer coordinates of stored K/V (None for a layer: stored as the model gives them)."""

    def __init__(self, layers: Sequence[LayerTransform | None]):
        self.layers = tuple(layers)

    @classmethod
    def from_arrays(cls, layers: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray] | None]) -> KVTransform:
        """Per layer: (key scale, key center, value center), each [kv_heads, D], the centers in the rotated
        coordinates (None: that layer untransformed)."""
        rotations: dict[int, mx.array] = {}
        out: list[LayerTransform | None] = []
        for arrays in layers:
            if arrays is None:
                out.append(None)
                continue
            scale, key_center, value_center = (mx.array(np.asarray(a, dtype=np.float32)) for a in arrays)
            d = scale.shape[-1]
            if d not in rotations:
                rotations[d] = mx.array(hadamard(d).astype(np.float32))
            out.append(LayerTransform(scale, rotations[d], key_center, value_center))
        return cls(out)

    def digest(self) -> str:
        """sha256 of every layer's coordinates: what a page's numbers mean (the disk tier's fingerprint)."""
        h = hashlib.sha256(f"kv-transform-v{VERSION}|".encode())
        for i, t in enumerate(self.layers):
            h.update(f"{i}:".encode())
            if t is not None:
                for a in (t.key_scale, t.key_center, t.value_center):
                    h.update(np.asarray(a, dtype=np.float32).tobytes())
        return h.hexdigest()

    def applies(self, layer: int) -> bool:
        return self.layers[layer] is not None

    # K/V `[..., kv_heads, tokens, D]` (head_axis=-3) or token-major `[..., kv_heads, D]` (head_axis=-2).
    def keys_in(self, layer: int, k: mx.array, head_axis: int = -3) -> mx.array:
        t = self.layers[layer]
        if t is None:
            return k
        x = _rotate(k.astype(mx.float32) * _per_head(t.key_scale, head_axis), t.rotation)
        return (x - _per_head(t.key_center, head_axis)).astype(k.dtype)

    def keys_out(self, layer: int, k: mx.array, head_axis: int = -3) -> mx.array:
        t = self.layers[layer]
        if t is None:
            return k
        x = _rotate(k.astype(mx.float32) + _per_head(t.key_center, head_axis), t.rotation)
        return (x / _per_head(t.key_scale, head_axis)).astype(k.dtype)

    def values_in(self, layer: int, v: mx.array, head_axis: int = -3) -> mx.array:
        t = self.layers[layer]
        if t is None:
            return v
        return (_rotate(v.astype(mx.float32), t.rotation) - _per_head(t.value_center, head_axis)).astype(v.dtype)

    def values_out(self, layer: int, v: mx.array, head_axis: int = -3) -> mx.array:
        t = self.layers[layer]
        if t is None:
            return v
        return _rotate(v.astype(mx.float32) + _per_head(t.value_center, head_axis), t.rotation).astype(v.dtype)

    def queries_in(self, layer: int, q: mx.array) -> mx.array:
        """Queries `[B, heads, L, D]` (heads a multiple of the KV heads, grouped as GQA groups them). The key
        center is left out: it adds the same `q . c` to every score of a query, which softmax ignores."""
        t = self.layers[layer]
        if t is None:
            return q
        inverse_scale, _ = t.per_query_head(q.shape[1] // t.kv_heads)
        return _rotate(q.astype(mx.float32) * inverse_scale, t.rotation).astype(q.dtype)  # (q / s) H

    def output_out(self, layer: int, out: mx.array) -> mx.array:
        """Attention output over stored values `[B, heads, L, D]` back to the model's coordinates: the value
        center comes back whole because the weights of a softmax sum to one (no sinks: see kv_calibration);
        `(o + c_v) H = o H + c_v H`."""
        t = self.layers[layer]
        if t is None:
            return out
        _, center = t.per_query_head(out.shape[1] // t.kv_heads)
        return (_rotate(out.astype(mx.float32), t.rotation) + center).astype(out.dtype)


def _per_head(x: mx.array, head_axis: int) -> mx.array:
    return x[:, None, :] if head_axis == -3 else x


def _rotate(x: mx.array, rotation: mx.array) -> mx.array:
    return x @ rotation
