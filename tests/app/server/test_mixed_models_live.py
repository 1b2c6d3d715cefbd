"""One live `mlxpaged serve` with a generative model and an embedding model in its store (tiny random ones): the
official `openai` client chats with one and embeds with the other (loaded on demand, both answering, also at
once), each API refuses the other kind with the reason, and the Ollama API lists, shows, loads and unloads both
through the registry (/api/tags, /api/ps with memory and keep-alive expiry, keep_alive 0, load_duration)."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
from pathlib import Path

from mlxpaged import Embedder
from tests.app.server.test_model_registry_live import serving_store
from tests.app.server.test_server_live import AUTH, KEY
from tests.embedding.tiny_embedding import write_tiny_embedding_dir
from tests.tiny_models import write_tiny_llama_dir

import numpy as np
import ollama
import openai
import pytest

HI = [{"role": "user", "content": "Say something."}]
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("store")
    write_tiny_llama_dir(root / "tiny-a", dtype="float32", seed=1)
    write_tiny_embedding_dir(root / "tiny-embed", "last", context=64)
    return root


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    flags = ("--api-key", KEY, "--keep-alive", "10m", "--cache-tokens", "512", "--default-max-tokens", "8")
    with serving_store(store, tmp_path_factory.mktemp("serve") / "server.log", *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def olla(server):
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def expected(store):
    """The library's vectors for TEXTS, in this process."""
    with Embedder.from_pretrained(str(store / "tiny-embed")) as embedder:
        return embedder.embed(TEXTS).vectors


def chat(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=HI, max_tokens=4, temperature=0)
    assert reply.model == model
    return reply.choices[0].message.content


def test_openai_client_chats_and_embeds_on_one_server(server, client, expected):
    first = chat(client, "tiny-a")
    assert "tiny-embed" not in server.health()["models"]  # not loaded until asked for
    floats = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="tiny-embed", input=TEXTS)  # the client's default: base64
    np.testing.assert_allclose([d.embedding for d in floats.data], expected, atol=1e-5)
    np.testing.assert_allclose([d.embedding for d in packed.data], expected, atol=1e-5)
    assert floats.model == "tiny-embed" and floats.usage.prompt_tokens > 0
    assert chat(client, "tiny-a") == first  # the generative model still answers, the same (greedy)
    health = server.health()
    models = health["models"]
    assert {models["tiny-a"]["kind"], models["tiny-embed"]["kind"]} == {"generative", "embedding"}
    assert models["tiny-embed"]["memory_bytes"] > 0
    assert health["memory"]["held_bytes"] == sum(m["memory_bytes"] for m in models.values())
    cards = {card.id: card.model_extra["mlxpaged"] for card in client.models.list().data}
    assert cards["tiny-embed"]["kind"] == "embedding" and cards["tiny-embed"]["dimensions"] > 0


def test_both_kinds_answer_at_once(client, expected):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(chat, client, "tiny-a") for _ in range(3)]
        embeds = [pool.submit(client.embeddings.create, model="tiny-embed", input=TEXTS) for _ in range(3)]
        replies = [c.result() for c in chats]
        vectors = [[d.embedding for d in e.result().data] for e in embeds]
    assert len(set(replies)) == 1  # greedy: one answer however many ask at once
    for got in vectors:
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_each_api_refuses_the_other_kind_with_the_reason(client, olla):
    with pytest.raises(openai.BadRequestError, match="is an embedding model") as chat_refused:
        chat(client, "tiny-embed")
    assert chat_refused.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError, match="cannot embed: tiny-a is not an embedding model") as refused:
        client.embeddings.create(model="tiny-a", input="hi")
    assert refused.value.code == "model_not_supported" and refused.value.param == "model"
    with pytest.raises(ollama.ResponseError, match="is an embedding model") as ollama_chat:
        olla.chat(model="tiny-embed", messages=HI)
    with pytest.raises(ollama.ResponseError, match="sentence-transformers") as ollama_embed:
        olla.embed(model="tiny-a:latest", input="hi")
    assert ollama_chat.value.status_code == ollama_embed.value.status_code == 400


def test_ollama_lists_shows_and_reports_both(olla, expected):
    reply = olla.embed(model="tiny-embed:latest", input=TEXTS)
    np.testing.assert_allclose(reply.embeddings, expected, atol=1e-5)
    olla.chat(model="tiny-a", messages=[])  # loaded
    listed = {m.model: m for m in olla.list().models}
    assert {"tiny-a:latest", "tiny-embed:latest"} <= set(listed)
    assert listed["tiny-embed:latest"].details.family == "qwen3"
    running = {m.model: m for m in olla.ps().models}
    assert set(running) == {"tiny-a:latest", "tiny-embed:latest"}
    for model in running.values():
        assert model.size > 0 and model.size_vram in (0, model.size)
        left = model.expires_at - dt.datetime.now(dt.UTC)
        assert dt.timedelta(minutes=9) < left <= dt.timedelta(minutes=10, seconds=1)  # --keep-alive 10m
    shown = olla.show("tiny-embed:latest")
    assert shown.capabilities == ["embedding"] and shown.modelinfo["qwen3.context_length"] == 64
    assert "completion" in olla.show("tiny-a").capabilities


def test_ollama_keep_alive_unloads_and_load_duration_is_the_load(olla):
    olla.chat(model="tiny-a", messages=[])
    unloaded = olla.generate(model="tiny-a:latest", keep_alive=0)
    assert unloaded.done_reason == "unload"
    assert "tiny-a:latest" not in {m.model for m in olla.ps().models}  # idle: gone before the reply
    loading = olla.generate(model="tiny-a", prompt="Hi", options={"num_predict": 2, "temperature": 0})
    loaded = olla.generate(model="tiny-a", prompt="Hi", options={"num_predict": 2, "temperature": 0})
    assert loading.response == loaded.response
    assert loading.load_duration > 10 * loaded.load_duration  # the first one waited for the load
    assert "tiny-a:latest" in {m.model for m in olla.ps().models}
    kept = olla.embed(model="tiny-embed", input="", keep_alive=-1)  # empty input: only load (and keep forever)
    assert kept.embeddings == []
    [embedder] = [m for m in olla.ps().models if m.model == "tiny-embed:latest"]
    assert embedder.expires_at > dt.datetime.now(dt.UTC) + dt.timedelta(days=365)
    with pytest.raises(ollama.ResponseError, match="does not exist") as unknown:
        olla.generate(model="llama3.2", keep_alive=0)
    assert unknown.value.status_code == 404
    olla.chat(model="tiny-a", messages=[], keep_alive=0)
    assert "tiny-a:latest" not in {m.model for m in olla.ps().models}
    assert "completion" in olla.show("tiny-a").capabilities  # /api/show loads a model that is not loaded
    assert "tiny-a:latest" in {m.model for m in olla.ps().models}
