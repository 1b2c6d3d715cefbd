"""Adapted layers against mlx-lm's own LoRA / DoRA layers (mlx_lm.tuner): bit for bit with one adapter for the whole
batch; several in one batch, and rows of the base model beside them, each row as if alone (to float32 noise: the
base model's own matmuls round differently at another batch size, 1.5e-5 here)."""

from __future__ import annotations

import functools

from mlxpaged.adapters.adapter_set import AdapterSet
from mlxpaged.adapters.layers import STACK_MIN_GROUPS, AdaptedLinear
from tests.tiny_adapters import adapted_reference, write_adapter
from tests.tiny_models import tiny_llama, tiny_qwen2

import mlx.core as mx
import mlx.nn as nn
import pytest


def quantized_llama():
    model = tiny_llama()
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


MODELS = {
    "llama": tiny_llama,
    "qwen2-bias": tiny_qwen2,  # q/k/v projections with a bias: DoRA adds it after its norm scale
    "llama-4bit": quantized_llama,  # DoRA dequantizes the base weight, as mlx-lm's does
}
TOKENS = mx.array([[5, 17, 99, 3, 42, 7], [8, 1, 250, 64, 9, 11], [2, 2, 2, 2, 2, 2]])


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_one_adapter_computes_what_mlx_lm_computes(tmp_path, arch, kind):
    make = MODELS[arch]
    directory = write_adapter(make, tmp_path / kind, kind, seed=3)
    want = adapted_reference(make, directory)(TOKENS)
    model = make()
    adapters = AdapterSet(model, {"a": directory})
    base = model(TOKENS)
    with adapters.rows.building([adapters.resolve("a").id] * TOKENS.shape[0], TOKENS.shape[1]):
        got = model(TOKENS)
    assert mx.array_equal(got, want)
    assert not mx.allclose(base, want).item()  # the adapter changes the output: the test can fail
    assert mx.array_equal(model(TOKENS), make()(TOKENS))  # outside a pass with adapter rows: the base model


def test_rows_of_several_adapters_and_the_base_model_share_a_pass(tmp_path):
    make = tiny_llama
    lora = write_adapter(make, tmp_path / "lora", "lora", seed=1, num_layers=3)
    dora = write_adapter(make, tmp_path / "dora", "dora", seed=2, keys=["self_attn.q_proj", "mlp.down_proj"])
    model = make()
    adapters = AdapterSet(model, {"lora": lora, "dora": dora})
    rows = [adapters.resolve("dora").id, None, adapters.resolve("lora").id]
    with adapters.rows.building(rows, TOKENS.shape[1]):
        got = model(TOKENS)
    references = [adapted_reference(make, dora), make(), adapted_reference(make, lora)]
    for i, reference in enumerate(references):
        alone = reference(TOKENS[i : i + 1])[0]
        assert mx.allclose(got[i], alone, atol=1e-4, rtol=1e-5).item(), i
        others = [r(TOKENS[i : i + 1])[0] for r in references if r is not reference]
        assert all(mx.abs(o - alone).max().item() > 1e-2 for o in others)  # each row's own adapter, not another's


def test_a_layer_adapted_by_several_adapters_is_wrapped_once(tmp_path):
    make = functools.partial(tiny_llama, 2)
    one = write_adapter(make, tmp_path / "one", seed=1)
    two = write_adapter(make, tmp_path / "two", seed=2, rank=8)
    model = make()
    AdapterSet(model, {"one": one, "two": two})
    wrapped = [name for name, m in model.named_modules() if isinstance(m, AdaptedLinear)]
    assert wrapped and len(wrapped) == len(set(wrapped))
    assert not any(isinstance(m.linear, AdaptedLinear) for m in model.modules() if isinstance(m, AdaptedLinear))
    # the adapters' arrays are not the model's parameters (weights, memory and disk fingerprints count the base)
    assert not [k for k, _ in nn.utils.tree_flatten(model.parameters()) if "lora" in k]


def test_a_layer_fed_the_pass_flattened_to_positions_applies_each_rows_adapter(tmp_path):
    make = functools.partial(tiny_llama, 2)
    model = make()
    adapters = AdapterSet(model, {"a": write_adapter(make, tmp_path / "a", seed=5)})
    layer = model.model.layers[1].mlp.up_proj
    assert isinstance(layer, AdaptedLinear)
    x = mx.random.normal((3, 4, 64))
    rows = [None, adapters.resolve("a").id, None]
    with adapters.rows.building(rows, 4):
        by_row = layer(x)
        flat = layer(x.reshape(12, 64))  # as a mixture-of-experts block feeds its experts
    assert mx.array_equal(flat.reshape(3, 4, -1), by_row)
    assert mx.allclose(by_row[0], layer.linear(x[0]), atol=1e-5).item()  # a base row
    assert not mx.allclose(by_row[1], layer.linear(x[1]), atol=1e-2).item()  # the adapted row


def test_many_adapters_in_one_pass_are_applied_stacked_each_row_as_if_alone(tmp_path):
    """At STACK_MIN_GROUPS adapters or more a layer applies them as one stacked update: the same numbers as each
    row's own adapter alone (to float32 noise), base rows untouched."""
    make = functools.partial(tiny_llama, 2)
    names = [f"a{i}" for i in range(STACK_MIN_GROUPS + 1)]
    paths = {n: write_adapter(make, tmp_path / n, seed=i, rank=2 + 2 * i, scale=1.0 + i) for i, n in enumerate(names)}
    model = make()
    adapters = AdapterSet(model, paths)
    rows = [adapters.resolve(n).id for n in names] + [None]
    tokens = mx.concatenate([TOKENS, TOKENS[:2]])
    layer = model.model.layers[1].self_attn.q_proj
    calls = []
    original = type(layer)._stacked
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(layer), "_stacked", lambda self, x, y: calls.append(1) or original(self, x, y))
        with adapters.rows.building(rows, tokens.shape[1]):
            got = model(tokens)
    assert calls  # the stacked path ran
    references = [adapted_reference(make, paths[n]) for n in names] + [make()]
    for i, reference in enumerate(references):
        alone = reference(tokens[i : i + 1])[0]
        assert mx.allclose(got[i], alone, atol=1e-4, rtol=1e-5).item(), i
        assert mx.abs(references[(i + 1) % len(references)](tokens[i : i + 1])[0] - alone).max().item() > 1e-2
