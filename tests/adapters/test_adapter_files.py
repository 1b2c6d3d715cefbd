"""Reading an adapter directory: what mlx_lm.lora writes is read, and each way it can be wrong is refused with what
is wrong (AdapterError), before any model is touched."""

from __future__ import annotations

import json

from mlxpaged.adapters.files import read_adapter
from mlxpaged.errors import AdapterError
from tests.tiny_adapters import write_adapter
from tests.tiny_models import tiny_llama

import mlx.core as mx
import pytest


@pytest.fixture
def lora(tmp_path):
    return write_adapter(tiny_llama, tmp_path / "lora", "lora", rank=4, scale=3.0, num_layers=2)


def test_what_mlx_lm_lora_writes_is_read(lora):
    files = read_adapter(lora)
    assert (files.kind, files.scale, files.rank, files.base_model) == ("lora", 3.0, 4, "tiny")
    # every linear layer of the last two of tiny_llama's three layers (mlx-lm's default keys)
    assert {p.split(".")[2] for p in files.modules} == {"1", "2"} and len(files.modules) == 14
    assert files.nbytes == sum(u.lora_a.nbytes + u.lora_b.nbytes for u in files.modules.values())
    assert read_adapter(lora).digest == files.digest


def test_the_digest_names_the_weights(lora):
    before = read_adapter(lora).digest
    weights = mx.load(str(lora / "adapters.safetensors"))
    weights = {k: v * 2 if k.endswith("lora_b") else v for k, v in weights.items()}
    mx.save_safetensors(str(lora / "adapters.safetensors"), weights)
    assert read_adapter(lora).digest != before  # a retrained adapter never hits the old one's cached blocks


def edit_config(directory, **changes):
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda d: (d / "adapters.safetensors").unlink(), "has no adapters.safetensors"),
        (lambda d: (d / "adapter_config.json").write_text("{not json"), "is not valid JSON"),
        (lambda d: (d / "adapter_config.json").write_text("[1, 2]"), "is not a JSON object"),
        (lambda d: (d / "adapters.safetensors").write_bytes(b"\x00" * 40), "cannot be read as safetensors"),
        (lambda d: edit_config(d, fine_tune_type="full"), "a full fine-tune, not an adapter"),
        (lambda d: edit_config(d, fine_tune_type="qlora"), "fine_tune_type 'qlora' is not one of lora, dora"),
        (lambda d: edit_config(d, lora_parameters={"rank": 8, "alpha": 16}), "takes 'scale', not 'alpha'"),
    ],
)
def test_a_broken_adapter_directory_is_refused_with_what_is_wrong(lora, spoil, message):
    spoil(lora)
    with pytest.raises(AdapterError, match=message):
        read_adapter(lora)


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"model.layers.0.mlp.up_proj.lora_a": mx.zeros((64, 4))}, "has lora_a only"),
        ({"model.layers.0.mlp.up_proj.bias": mx.zeros((64,))}, "'model.layers.0.mlp.up_proj.bias' is not a LORA"),
        (
            {
                "model.layers.0.mlp.up_proj.lora_a": mx.zeros((64, 4)),
                "model.layers.0.mlp.up_proj.lora_b": mx.zeros((8, 9)),
            },
            "disagree on the rank",
        ),
        (
            {"layers.0.experts.lora_a": mx.zeros((4, 2, 64)), "layers.0.experts.lora_b": mx.zeros((3, 64, 2))},
            "disagree on the rank or the experts",
        ),
        (
            {"layers.0.experts.lora_a": mx.zeros((4, 2, 64)), "layers.0.experts.lora_b": mx.zeros((64, 2))},
            "neither a linear layer's update",
        ),
    ],
)
def test_tensors_that_are_not_an_adapters_are_refused(lora, weights, message):
    mx.save_safetensors(str(lora / "adapters.safetensors"), weights)
    with pytest.raises(AdapterError, match=message):
        read_adapter(lora)


def test_a_switch_layers_update_is_read_per_expert(lora):
    mx.save_safetensors(
        str(lora / "adapters.safetensors"),
        {"layers.0.experts.lora_a": mx.zeros((4, 2, 64)), "layers.0.experts.lora_b": mx.zeros((4, 32, 2))},
    )
    update = read_adapter(lora).modules["layers.0.experts"]
    assert (update.experts, update.rank, update.dims) == (4, 2, (64, 32))


def test_dora_of_a_switch_layer_is_refused_as_mlx_lm_refuses_it(lora):
    edit_config(lora, fine_tune_type="dora")
    mx.save_safetensors(
        str(lora / "adapters.safetensors"),
        {"layers.0.experts.lora_a": mx.zeros((4, 2, 64)), "layers.0.experts.lora_b": mx.zeros((4, 32, 2))},
    )
    with pytest.raises(AdapterError, match="which DoRA does not adapt"):
        read_adapter(lora)
