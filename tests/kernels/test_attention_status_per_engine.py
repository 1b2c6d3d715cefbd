"""The attention status belongs to the model that was prepared (each engine keeps its PreparedAttention):
preparing a second model in the process does not change what the first one reports."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention

import mlx.core as mx


def test_two_prepared_models_keep_their_own_status():
    with attention.attention_backend("cpu"):
        float32 = attention.prepare_attention(mx.float32, 64, 16, 4, 2)
        float16 = attention.prepare_attention(mx.float16, 64, 16, 4, 2)  # prepared last
        assert float32.status() == {"path": "cpu", "reason": "forced: pages read in place", "variants": []}
        assert float16.status()["path"] == "reference"
        assert "this model's are float16" in float16.status()["reason"]


def test_a_model_lists_only_its_own_kernel_variants():
    from tests.kernels.test_attention_self_check import CountingEmulator, kernel_path

    with kernel_path(CountingEmulator()):
        narrow = attention.prepare_attention(mx.float32, 32, 8, 2, 1)
        wide = attention.prepare_attention(mx.float32, 64, 16, 4, 2)
        assert [c.variant.describe() for c in narrow.status()["variants"]] == [
            "float32 D=32 BS=8 G=2 one-pass",
            "float32 D=32 BS=8 G=2 two-pass",
        ]
        assert [c.variant.describe() for c in wide.status()["variants"]] == [
            "float32 D=64 BS=16 G=2 one-pass",
            "float32 D=64 BS=16 G=2 two-pass",
        ]
