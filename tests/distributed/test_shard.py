"""Tensor parallel is refused at load, with the reason, where mlx-lm cannot shard the model."""

from __future__ import annotations

from mlxpaged.distributed.shard import tensor_parallel_reason
from tests.tiny_models import tiny_llama


def test_a_llama_with_divisible_heads_shards():
    config = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
    assert tensor_parallel_reason(tiny_llama(1), config, 2) is None


def test_heads_that_do_not_divide_are_refused():
    config = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
    reason = tensor_parallel_reason(tiny_llama(1), config, 4)
    assert reason is not None and "num_key_value_heads (2)" in reason and "4 ranks" in reason


def test_a_model_without_shard_is_refused():
    class Unshardable:
        pass

    reason = tensor_parallel_reason(Unshardable(), {"model_type": "mystery"}, 2)
    assert reason is not None and "'mystery'" in reason
