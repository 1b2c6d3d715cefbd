"""How the model is split over the ranks (tensor or pipeline parallel), refused at load, with the reasons, where
mlx-lm cannot split it as asked."""

from __future__ import annotations

from mlxpaged.distributed.shard import (
    PIPELINE,
    TENSOR,
    choose_parallel,
    pipeline_reason,
    pipeline_stack,
    tensor_parallel_reason,
)
from mlxpaged.errors import ConfigError
from tests.tiny_models import tiny_gemma3, tiny_llama, tiny_qwen2, tiny_qwen3_5

import pytest

LLAMA = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN2 = {**LLAMA, "model_type": "qwen2"}


def test_a_llama_with_divisible_heads_shards():
    assert tensor_parallel_reason(tiny_llama(1), LLAMA, 2) is None


def test_heads_that_do_not_divide_are_refused():
    reason = tensor_parallel_reason(tiny_llama(1), LLAMA, 4)
    assert reason is not None and "num_key_value_heads (2)" in reason and "4 ranks" in reason


def test_a_model_without_shard_is_refused():
    class Unshardable:
        pass

    reason = tensor_parallel_reason(Unshardable(), {"model_type": "mystery"}, 2)
    assert reason is not None and "'mystery'" in reason


def test_tensor_parallel_is_chosen_where_the_model_shards_and_pipeline_where_it_does_not():
    model = tiny_qwen2(4)  # mlx-lm has both for qwen2
    assert choose_parallel(model, QWEN2, 2) == TENSOR
    assert choose_parallel(model, QWEN2, 4) == PIPELINE  # 2 KV heads do not split over 4 ranks; 4 layers do
    assert choose_parallel(model, QWEN2, 2, PIPELINE) == PIPELINE  # asked for (serve --pipeline)


def test_pipeline_needs_a_layer_per_rank():
    reason = pipeline_reason(tiny_qwen2(2), QWEN2, 4)
    assert reason == "its 2 layers cannot be split over 4 ranks (each needs at least one)"
    with pytest.raises(ConfigError) as refused:
        choose_parallel(tiny_qwen2(2), QWEN2, 4)
    assert "tensor parallel: its num_key_value_heads (2) is not divisible by the 4 ranks" in str(refused.value)
    assert "pipeline parallel: its 2 layers cannot be split over 4 ranks" in str(refused.value)


def test_a_model_with_neither_is_refused_naming_both():
    config = {"model_type": "gemma3_text", "num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(ConfigError) as refused:
        choose_parallel(tiny_gemma3(2), config, 2)
    message = str(refused.value)
    assert message.startswith("cannot run this model over 2 processes: tensor parallel: ")
    assert "no tensor-parallel sharding (a shard() method) for model type 'gemma3_text'" in message
    assert "pipeline parallel: mlx-lm has no pipeline parallelism (a pipeline() method) for model type" in message


def test_pipeline_asked_of_a_model_mlx_lm_only_shards_is_refused():
    with pytest.raises(ConfigError) as refused:
        choose_parallel(tiny_llama(2), LLAMA, 2, PIPELINE)
    assert str(refused.value) == (
        "cannot run this model over 2 processes with pipeline parallelism: mlx-lm has no pipeline parallelism "
        "(a pipeline() method) for model type 'llama'"
    )
    with pytest.raises(ConfigError, match="parallel must be one of tensor, pipeline, got 'data'"):
        choose_parallel(tiny_llama(2), LLAMA, 2, "data")


def test_the_pipelined_layers_are_found_where_the_model_keeps_them():
    qwen2 = tiny_qwen2(2)
    assert pipeline_stack(qwen2) is qwen2.model
    qwen3_5 = tiny_qwen3_5()  # a language model's text model (model.language_model.model)
    assert pipeline_stack(qwen3_5) is qwen3_5.language_model.model
    assert pipeline_stack(tiny_llama(1)) is None
