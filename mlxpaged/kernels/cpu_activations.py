"""SwiGLU for MLX's CPU backend, where ``exp`` runs scalar.

mlx-lm's ``swiglu(gate, x)`` is ``silu(gate) * x``: one ``exp`` per element of the MLP's hidden width, ~14 ns each on
the 2-core CPU backend (MLX 0.32). For a 153-token turn of the embedded model (SmolLM2-135M: 30 layers, 1,536 wide)
that was 3.35 ms a layer, 0.10 s of a 0.50 s prefill at 2,400 tokens of context, more than the layers' attention
scores' exp. Here ``exp(-gate)`` is cpu_attention's polynomial (2^n * p(f), ``exp2_parts``) and
silu(gate) * x = gate * x / (1 + exp(-gate)): 0.59 ms a layer, checked against a NumPy float64 reference
(tests/kernels/test_cpu_activations.py).

The engine's own passes take it on the CPU backend (runner/activation_routing.py); mlx-lm's stays mlx-lm's own.
"""

from __future__ import annotations

from functools import partial

from mlxpaged.kernels.cpu_attention import LOG2E, exp2_parts

import mlx.core as mx

# exp(-gate) is 2^t with t clipped here: beyond it silu(gate) is gate (to float32 precision) or below 2^-126 * |gate|.
_EXP2_LIMIT = 126.0


@partial(mx.compile, shapeless=True)
def _exp_neg_parts(gate: mx.array) -> tuple[mx.array, mx.array]:
    return exp2_parts(mx.clip(gate * -LOG2E, -_EXP2_LIMIT, _EXP2_LIMIT))


@partial(mx.compile, shapeless=True)
def _gated(gate: mx.array, x: mx.array, p: mx.array, two_n: mx.array) -> mx.array:
    return gate * x / (1.0 + p * two_n)


def swiglu_cpu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x for float32 arrays of one shape (what mlx-lm's ``swiglu`` returns)."""
    p, bits = _exp_neg_parts(gate)
    return _gated(gate, x, p, mx.view(bits, mx.float32))


def swiglu_cpu_applies(gate: mx.array, x: mx.array) -> bool:
    """Float32 operands of one shape (the CPU backend's weights are float32): anything else is mlx-lm's own."""
    return gate.dtype == mx.float32 and x.dtype == mx.float32 and gate.shape == x.shape
