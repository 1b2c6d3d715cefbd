"""Fused q/k/v and gate/up projections (loading/fused_projections.py): the same outputs, the same parameters once,
nothing held after a layer, and only on a GPU's path."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.fused_projections import ProjectionSlice, fuse_projections
from mlxpaged.platform import backend
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import tiny_engine
from tests.tiny_models import random_tokens, tiny_llama, tiny_qwen2

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


def _linear_out(x: mx.array, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ W.T + b in float64: the projection's meaning, computed apart from MLX."""
    out = np.array(x.astype(mx.float32), dtype=np.float64) @ weight.astype(np.float64).T
    return out if bias is None else out + bias


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2 (q/k/v biases)"])
def test_a_fused_model_gives_the_same_logits_with_its_parameters_counted_once(build):
    model = build()
    tokens = mx.array([random_tokens(9, seed=3)])
    before, params = model(tokens), _params(model)
    layers = len(model.layers)
    assert fuse_projections(model) == 2 * layers  # q/k/v and gate/up in every layer
    after = _params(model)
    assert sum(v.size for v in after.values()) == sum(v.size for v in params.values())
    attn = "model.layers.0.self_attn"
    joined = np.concatenate([params[f"{attn}.{n}_proj.weight"] for n in "qkv"])
    np.testing.assert_array_equal(after[f"{attn}.fused_q_proj_k_proj_v_proj.weight"], joined)
    assert not any(k.startswith(f"{attn}.q_proj") for k in after)
    np.testing.assert_allclose(np.array(model(tokens)), np.array(before), rtol=1e-5, atol=1e-5)
    assert fuse_projections(model) == 0  # nothing left to fuse


def test_each_projection_keeps_its_meaning_whatever_the_input():
    model = tiny_qwen2(num_layers=1)
    attn = model.layers[0].self_attn
    weights = {n: np.array(attn[f"{n}_proj"].weight) for n in "qkv"}
    biases = {n: np.array(attn[f"{n}_proj"].bias) for n in "qkv"}
    fuse_projections(model)
    x, y = (
        mx.random.normal((1, 3, weights["q"].shape[1]), key=mx.random.key(1)),
        mx.random.normal((1, 3, weights["q"].shape[1]), key=mx.random.key(2)),
    )
    # q and v of one input, k of another, then k of the first: every call is its own projection's output.
    calls = [("q", x), ("k", y), ("v", x), ("k", x), ("q", x)]
    for name, arg in calls:
        np.testing.assert_allclose(
            np.array(attn[f"{name}_proj"](arg)), _linear_out(arg, weights[name], biases[name]), rtol=1e-5, atol=1e-5
        )


def test_a_group_lets_its_outputs_go_once_each_projection_took_its_slice():
    model = tiny_llama(num_layers=1)
    fuse_projections(model)
    attn = model.layers[0].self_attn
    shared = attn.q_proj.shared
    x = mx.random.normal((1, 2, attn.fused_q_proj_k_proj_v_proj.weight.shape[1]))
    attn.q_proj(x)
    attn.k_proj(x)
    assert shared._input is x  # v's slice still to be taken
    attn.v_proj(x)
    assert shared._input is None and shared._outputs == []


def test_quantized_projections_fuse_exactly():
    model = tiny_llama()
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([random_tokens(7, seed=5)])
    before = model(tokens)
    assert fuse_projections(model) == 2 * len(model.layers)
    fused = model.layers[0].mlp.fused_gate_proj_up_proj
    assert isinstance(fused, nn.QuantizedLinear) and (fused.group_size, fused.bits) == (32, 4)
    np.testing.assert_array_equal(np.array(model(tokens)), np.array(before))


def test_groups_that_cannot_be_one_matmul_are_left_alone():
    class Adapted(nn.Linear):  # a subclass (a LoRA or sharded linear): its call is its own
        pass

    model = tiny_llama(num_layers=3)
    first, second, third = model.layers
    first.self_attn.k_proj = Adapted(*reversed(first.self_attn.k_proj.weight.shape), bias=False)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: path == "model.layers.1.mlp.gate_proj")
    assert isinstance(second.mlp.gate_proj, nn.QuantizedLinear)  # beside a plain up_proj
    third.mlp.up_proj = nn.Linear(*reversed(third.mlp.up_proj.weight.shape), bias=True)  # gate_proj has none
    assert fuse_projections(model) == 3  # layer 0's gate/up, layer 1's and 2's q/k/v
    assert isinstance(first.mlp.gate_proj, ProjectionSlice) and type(first.self_attn.q_proj) is nn.Linear
    assert isinstance(second.self_attn.q_proj, ProjectionSlice) and type(second.mlp.up_proj) is nn.Linear
    assert isinstance(third.self_attn.v_proj, ProjectionSlice) and type(third.mlp.gate_proj) is nn.Linear


def test_only_a_gpu_path_engine_fuses_and_it_decodes_as_the_unfused_engine():
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [random_tokens(n, seed=n) for n in (5, 23, 40)]
    from mlxpaged.loading.loader import load_model

    tokenizer = load_model().tokenizer
    cpu_model = tiny_llama()
    with tiny_engine(cpu_model, tokenizer) as engine:
        plain = [c.token_ids for c in engine.generate(prompts, params)]
    assert type(cpu_model.layers[0].self_attn.q_proj) is nn.Linear
    with backend.simulate("cuda"):
        gpu_model = tiny_llama()
        with tiny_engine(gpu_model, tokenizer) as engine:
            fused = [c.token_ids for c in engine.generate(prompts, params)]
    assert isinstance(gpu_model.layers[0].self_attn.q_proj, ProjectionSlice)
    assert fused == plain
