"""Review 5: the attention status of a model whose pools have several geometries (engine.py prepares the
kernel once per `attention_geometries` entry; attention.py keeps one global `_model_kv`)."""

import mlx.core as mx
import pytest

from mlxpaged.kernels import attention
from tests.kernels.test_attention_self_check import CountingEmulator, kernel_path


@pytest.mark.xfail(strict=True, reason="prepare_attention overwrites the global _model_kv per geometry: the status "
                   "reports only the last geometry prepared, here 'kernel' though the D=16 class runs the reference")
def test_a_geometry_the_kernel_cannot_take_shows_in_the_status_whatever_the_order():
    with kernel_path(CountingEmulator()):
        for head_dim, block_size, heads, kv_heads in [(16, 16, 4, 2), (64, 16, 2, 1)]:  # as Engine.__init__ loops
            status = attention.prepare_attention(mx.float32, head_dim, block_size, heads, kv_heads)
    assert "head dim 16" in status["reason"], status
