"""`mlxpaged serve --model M --draft-model D`, `--speculative mtp` and `--speculative dflash|eagle3 --draft-model D`: a
live server whose replies are the model's own greedy replies, drafted by a second model of the same tokenizer, by the
checkpoint's MTP layers, by a DFlash drafter or by an EAGLE-3 head, with the drafts counted in /metrics; a draft of
another tokenizer, or a checkpoint without MTP layers, stops the server before it listens, saying why."""

from __future__ import annotations

import json

from mlxpaged import Engine, SamplingParams
from tests.app.server.test_model_registry_live import metric, serving_store
from tests.app.server.test_server_live import assert_clean_exit, start_server, stop_server
from tests.tiny_models import add_mtp_layers, write_tiny_model_dir

import openai
import pytest

HI = [{"role": "user", "content": "Count from one to ten."}]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-store")
    write_tiny_model_dir(root / "tiny-a", "llama", dtype="float32", seed=1, layers=3)
    write_tiny_model_dir(root / "tiny-draft", "qwen3", dtype="float32", seed=2, layers=1)
    other = write_tiny_model_dir(root / "tiny-other", "llama", dtype="float32", seed=3)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    return root


def reply(server, n: int = 24, model: str = "tiny-a") -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)
    done = client.chat.completions.create(model=model, messages=HI, max_tokens=n, temperature=0.0)
    return done.choices[0].message.content or ""


def test_a_draft_model_gives_the_models_own_replies_and_counts_its_drafts(store, tmp_path):
    """Beside another model of the store loaded on demand, which answers as it does alone and drafts nothing."""
    flags = ("--cache-tokens", "1024", "--max-batch-tokens", "128")
    with serving_store(store, tmp_path / "plain.log", *flags) as server:
        expected, other = reply(server), reply(server, model="tiny-draft")
    with serving_store(store, tmp_path / "draft.log", *flags, "--draft-model", "tiny-draft") as server:
        assert reply(server) == expected
        assert reply(server, model="tiny-draft") == other
        assert reply(server) == expected
        assert metric(server, "spec_draft_tokens_total", "tiny-a") > 0
        assert metric(server, "generation_tokens_total", "tiny-draft") > 0
        assert metric(server, "spec_draft_tokens_total", "tiny-draft") == 0


def test_a_draft_of_another_tokenizer_stops_the_server_before_it_listens(store, tmp_path):
    log = tmp_path / "refused.log"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(pytest.fail.Exception):
        patch.setenv("MLXPAGED_MODELS_DIR", str(store))
        start_server(log, "--model", "tiny-a", "--draft-model", "tiny-other", "--cache-tokens", "1024")
    assert "another tokenizer" in log.read_text()


def test_mtp_layers_give_the_models_own_replies_and_count_their_drafts(store, tmp_path):
    mtp = add_mtp_layers(write_tiny_model_dir(store / "tiny-mtp", "qwen3_5", dtype="float32", seed=3, layers=4))
    with Engine.from_pretrained(str(mtp), cache_tokens=1024) as engine:
        expected = engine.chat(HI, SamplingParams(temperature=0.0, max_tokens=24)).text
    log = tmp_path / "mtp.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXPAGED_MODELS_DIR", str(store))
        server = start_server(log, "--model", "tiny-mtp", "--speculative", "mtp", "--cache-tokens", "1024")
    try:
        assert reply(server, model="tiny-mtp") == expected
        assert metric(server, "spec_draft_tokens_total", "tiny-mtp") > 0
    finally:
        assert_clean_exit(stop_server(server), log)


def test_a_checkpoint_without_mtp_layers_stops_the_server_before_it_listens(store, tmp_path):
    log = tmp_path / "no-mtp.log"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(pytest.fail.Exception):
        patch.setenv("MLXPAGED_MODELS_DIR", str(store))
        start_server(log, "--model", "tiny-a", "--speculative", "mtp", "--cache-tokens", "1024")
    assert "multi-token-prediction layers of qwen3_5" in log.read_text()


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_a_drafter_checkpoint_gives_the_models_own_replies_and_counts_its_drafts(store, tmp_path, method):
    from tests.engine import test_dflash, test_eagle3

    if method == "dflash":
        drafter = test_dflash.write_drafter_dir(tmp_path / method, test_dflash.random_drafter())
    else:
        config = {**test_eagle3.CONFIG, "transformer_layer_config": {**test_eagle3.LAYER, "vocab_size": 49152}}
        drafter = test_eagle3.write_head_dir(tmp_path / method, test_eagle3.random_head(config), config)
    with Engine.from_pretrained(str(store / "tiny-a"), cache_tokens=1024) as engine:
        expected = engine.chat(HI, SamplingParams(temperature=0.0, max_tokens=24)).text
    log = tmp_path / f"{method}.log"
    flags = ("--speculative", method, "--draft-model", str(drafter), "--cache-tokens", "1024")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXPAGED_MODELS_DIR", str(store))
        server = start_server(log, "--model", "tiny-a", *flags)
    try:
        assert reply(server) == expected
        assert metric(server, "spec_draft_tokens_total", "tiny-a") > 0
    finally:
        assert_clean_exit(stop_server(server), log)
