"""The factor between a model's token embedding and its first layer's input (runner/embedding_scale.py), read off the
model on a probe: Gemma's sqrt(hidden) (mlx-lm scales inline, Hugging Face inside the embedding), 1 where the layer
sees the embedding as it is, and 1 where it sees more than a scaled embedding (GPT-2 adds absolute positions)."""

from __future__ import annotations

import importlib

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.runner.embedding_scale import embedding_scale, scaled
from tests.archs.configs import config_for
from tests.tiny_models import _build

import mlx.core as mx
import pytest


def model_of(module: str):
    return _build(importlib.import_module(f"mlx_lm.models.{module}"), config_for(module), seed=0)


@pytest.mark.parametrize(
    "module,expected",
    [("gemma", 64**0.5), ("gemma2", 128**0.5), ("gemma3_text", 64**0.5), ("llama", 1.0), ("qwen3_5", 1.0)],
)
def test_the_scale_is_what_the_first_layer_sees(module, expected):
    model = model_of(module)
    layer = type(model.layers[0])
    assert embedding_scale(model, model.model.embed_tokens) == pytest.approx(expected, rel=1e-6)
    assert type(model.layers[0]) is layer  # the probe put the layer back as it was


def test_positions_added_to_the_embedding_give_no_scale():
    model = model_of("gpt2")
    assert embedding_scale(model, model.model.wte) == 1.0


def test_the_scaled_embedding_is_the_embedding_times_the_scale_in_its_dtype():
    model = model_of("gemma")
    embed = model.model.embed_tokens
    assert scaled(embed, 1.0) is embed
    tokens = mx.array([[3, 4]])
    got = scaled(embed, 8.0)(tokens)
    assert got.dtype == embed(tokens).dtype and mx.array_equal(got, embed(tokens) * 8.0)
