"""The attention status of a model whose pools have several geometries: the kernel is prepared once per
`attention_geometries` entry and attention.py merges their reasons into one PreparedAttention."""

from mlxpaged.kernels import attention
from tests.kernels.test_attention_self_check import CountingEmulator, kernel_path

import mlx.core as mx


def test_a_geometry_the_kernel_cannot_take_shows_in_the_status_whatever_the_order():
    with kernel_path(CountingEmulator()):
        # (query heads, KV heads, K width, V width, sinks), as paged_support.attention_geometries lists them
        prepared = attention.prepare_model_attention(mx.float32, 16, [(4, 2, 16, 16, False), (2, 1, 64, 64, False)])
        status = prepared.status()
    assert "head dim 16" in status["reason"], status
