"""model_files.py: which directories are embedding models, and what their sentence-transformers files say."""

from __future__ import annotations

import json

from mlxpaged.embedding.model_files import embedding_spec, is_embedding_model
from mlxpaged.errors import NotAnEmbeddingModelError, UnsupportedModelError
from tests.embedding.tiny_embedding import PROMPTS, write_sentence_transformers_files

import pytest

ST = "sentence_transformers.models."


def write(path, name: str, value) -> None:
    (path / name).parent.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(json.dumps(value))


@pytest.mark.parametrize(("pooling", "normalize"), [("last", True), ("mean", False), ("cls", True)])
def test_the_pipeline_of_a_sentence_transformers_model(tmp_path, pooling, normalize):
    write_sentence_transformers_files(tmp_path, pooling, normalize)
    spec = embedding_spec(tmp_path)
    assert (spec.pooling, spec.normalize, spec.source) == (pooling, normalize, "modules.json")
    assert spec.prompts == PROMPTS and spec.default_prompt_name is None
    assert is_embedding_model(tmp_path)


def test_a_pooling_folder_named_in_modules_json_is_read_from_there(tmp_path):
    write(
        tmp_path, "modules.json", [{"path": "", "type": ST + "Transformer"}, {"path": "pool", "type": ST + "Pooling"}]
    )
    write(tmp_path, "pool/config.json", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    assert embedding_spec(tmp_path).pooling == "cls"


def test_defaults_when_files_or_keys_are_absent(tmp_path):
    write(tmp_path, "1_Pooling/config.json", {"word_embedding_dimension": 64})  # no modules.json, no mode set
    spec = embedding_spec(tmp_path)
    assert (spec.pooling, spec.normalize, spec.prompts, spec.source) == ("mean", False, {}, "1_Pooling/config.json")


def test_the_default_prompt_name_is_read(tmp_path):
    write_sentence_transformers_files(tmp_path, "last", True)
    write(tmp_path, "config_sentence_transformers.json", {"prompts": PROMPTS, "default_prompt_name": "query"})
    assert embedding_spec(tmp_path).default_prompt_name == "query"


def test_a_directory_without_the_files_is_not_an_embedding_model(tmp_path):
    write(tmp_path, "config.json", {"model_type": "qwen3"})
    with pytest.raises(NotAnEmbeddingModelError, match="no sentence-transformers pooling configuration"):
        embedding_spec(tmp_path)
    assert not is_embedding_model(tmp_path)
    spec = embedding_spec(tmp_path, {"pooling": "lasttoken", "normalize": True})  # a preset may say it instead
    assert (spec.pooling, spec.normalize, spec.source) == ("last", True, "presets.toml")


def test_modules_json_without_pooling_is_not_an_embedding_model(tmp_path):
    write(tmp_path, "modules.json", [{"path": "", "type": ST + "Transformer"}])
    with pytest.raises(NotAnEmbeddingModelError, match="names no Pooling module"):
        embedding_spec(tmp_path)


@pytest.mark.parametrize(
    ("modules", "pooling", "match"),
    [
        (["Transformer", "Pooling", "Dense", "Normalize"], {}, "modules this server does not run: Dense"),
        (["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens is not supported"),
        (
            ["Transformer", "Pooling"],
            {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
            "pooling_mode_mean_tokens, pooling_mode_cls_token is not supported",
        ),
        (["Transformer", "Pooling"], {"pooling_mode_lasttoken": True, "include_prompt": False}, "include_prompt"),
    ],
)
def test_pipelines_this_package_does_not_run_are_refused_naming_the_part(tmp_path, modules, pooling, match):
    write(tmp_path, "modules.json", [{"path": "1_Pooling" if m == "Pooling" else "", "type": ST + m} for m in modules])
    write(tmp_path, "1_Pooling/config.json", pooling)
    with pytest.raises(UnsupportedModelError, match=match):
        embedding_spec(tmp_path)
    assert is_embedding_model(tmp_path)  # it is one: the server refuses it at load, saying why
