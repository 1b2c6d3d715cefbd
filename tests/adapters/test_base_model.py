"""The base model an adapter's config names, against the model an engine runs: the same model under another owner,
precision or format is the same; another model is refused at load, naming both."""

from __future__ import annotations

import dataclasses
import functools
import json

from mlxpaged.adapters.base_model import names_model, normalized
from mlxpaged.errors import AdapterError
from tests.adapters.test_engine_adapters import GREEDY, PROMPTS, adapted_engine
from tests.tiny_adapters import adapted_reference, reference_tokens, write_adapter
from tests.tiny_models import tiny_llama

import pytest


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("mlx-community/Qwen3-4B-4bit", "qwen3-4b"),
        ("Qwen/Qwen3-4B", "qwen3-4b"),
        ("models/smollm2-135m-float32", "smollm2-135m"),
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
        ("mlx-community/Qwen3-30B-A3B-Instruct-2507-MLX-8bit", "qwen3-30b-a3b-instruct-2507"),
        ("/Users/me/models/Mistral-7B-Instruct-v0.3-bf16/", "mistral-7b-instruct-v0.3"),
    ],
)
def test_a_name_loses_its_owner_directory_precision_and_format(name, want):
    assert normalized(name) == want


def test_the_same_model_under_other_names_matches_and_another_does_not(tmp_path):
    names = ["smollm2-135m", "models/smollm2-135m-float32", "SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert names_model("HuggingFaceTB/SmolLM2-135M-Instruct", names)
    assert names_model("mlx-community/SmolLM2-135M-Instruct-8bit", names)
    assert not names_model("HuggingFaceTB/SmolLM2-360M-Instruct", names)
    assert not names_model("Qwen/Qwen3-0.6B", names)
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    assert names_model(str(link), ["unrelated"], tmp_path / "elsewhere")  # a path to the model's own directory


def with_base(directory, base):
    config = json.loads((directory / "adapter_config.json").read_text())
    if base is None:
        config.pop("model")
    else:
        config["model"] = base
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def test_an_adapter_trained_on_another_model_of_the_same_shapes_is_refused_naming_both(default_loaded, tmp_path):
    make = functools.partial(tiny_llama, 3)
    path = with_base(write_adapter(make, tmp_path / "a", seed=1), "Qwen/Qwen3-4B")
    with pytest.raises(AdapterError, match=r"was trained on 'Qwen/Qwen3-4B' .* not on this model \('tiny'\)"):
        adapted_engine(make, default_loaded.tokenizer, {"a": path})
    with adapted_engine(make, default_loaded.tokenizer, {}) as engine:
        with pytest.raises(AdapterError, match="was trained on 'Qwen/Qwen3-4B'"):
            engine.add_adapter("a", path)
        engine.adapters.known_as(["Qwen/Qwen3-4B"])  # a server's catalog matched that name to this model
        engine.add_adapter("a", path)


@pytest.mark.parametrize("base", ["mlx-community/tiny-4bit", None])
def test_the_same_model_quantized_or_no_base_named_is_served(default_loaded, tmp_path, base):
    make = functools.partial(tiny_llama, 3)
    path = with_base(write_adapter(make, tmp_path / "a", seed=1), base)
    params = dataclasses.replace(GREEDY, max_tokens=6)
    with adapted_engine(make, default_loaded.tokenizer, {"a": path}) as engine:
        got = engine.generate([PROMPTS[1]], params, adapter="a")[0].token_ids
    assert got == reference_tokens(adapted_reference(make, path), PROMPTS[1], params.max_tokens)
