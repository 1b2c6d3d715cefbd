"""/v1/embeddings and /api/embed in process (httpx over ASGI) on a tiny random embedding model: the vectors are
the library's, in each API's shape; bad requests are refused in each API's error shape, naming the field; a
generative model refuses embeddings and an embedding model refuses chat. tests/app/server/test_embeddings_live.py
drives a real `mlxpaged serve` with the official clients."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import re

from mlxpaged import Embedder
from mlxpaged_app.server.api_server import create_app
from tests.app.server.test_server_unit import FakeEngine, FakeLoaded
from tests.embedding.tiny_embedding import write_tiny_embedding_dir

import httpx
import numpy as np
import pytest

TEXTS = ["hello world", "a longer sentence about paged attention", "x"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = write_tiny_embedding_dir(tmp_path_factory.mktemp("emb") / "tiny-embed", "last", context=32)
    return Embedder.from_pretrained(str(path))


def client_for(served) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(served)), base_url="http://test")


async def post(served, path: str, body: dict) -> httpx.Response:
    async with client_for(served) as client:
        return await client.post(path, json=body)


def decode(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<f4")


@pytest.mark.asyncio
async def test_openai_float_and_base64_give_the_library_vectors(embedder):
    expected = embedder.embed(TEXTS)
    plain = (await post(embedder, "/v1/embeddings", {"model": embedder.name, "input": TEXTS})).json()
    packed = (await post(embedder, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"})).json()
    assert plain["object"] == "list" and plain["model"] == embedder.name
    assert [d["index"] for d in plain["data"]] == [0, 1, 2] and plain["data"][0]["object"] == "embedding"
    np.testing.assert_array_equal(np.array([d["embedding"] for d in plain["data"]], dtype=np.float32), expected.vectors)
    np.testing.assert_array_equal(np.stack([decode(d["embedding"]) for d in packed["data"]]), expected.vectors)
    tokens = expected.total_tokens
    assert plain["usage"] == packed["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


@pytest.mark.asyncio
async def test_openai_input_shapes_and_dimensions(embedder):
    ids = [embedder.tokenizer.encode(text) for text in TEXTS[:2]]
    one_string = (await post(embedder, "/v1/embeddings", {"input": TEXTS[0]})).json()
    one_array = (await post(embedder, "/v1/embeddings", {"input": ids[0]})).json()
    arrays = (await post(embedder, "/v1/embeddings", {"input": ids, "dimensions": 8})).json()
    assert len(one_string["data"]) == len(one_array["data"]) == 1
    np.testing.assert_allclose(one_string["data"][0]["embedding"], one_array["data"][0]["embedding"], atol=1e-6)
    expected = embedder.embed(ids, dimensions=8).vectors
    np.testing.assert_allclose([d["embedding"] for d in arrays["data"]], expected, atol=1e-7)
    assert arrays["usage"]["prompt_tokens"] == sum(map(len, ids))


@pytest.mark.parametrize(
    ("body", "param", "code", "match"),
    [
        ({"input": []}, "input", "empty_input", "'input' is empty"),
        ({"input": [""]}, "input", "invalid_value", "input 0 is empty"),
        ({"input": ["a", 1]}, "input", "invalid_type", "invalid 'input"),
        ({"input": [[1, 2], [49152]]}, "input", "invalid_value", "input 1 holds 49152"),
        ({"input": ["a"] * 2049}, "input", "invalid_value", "'input' has 2049 items; at most 2048"),
        ({"input": [list(range(1, 41))]}, "input", "context_length_exceeded", "40 tokens, more than .* of 32"),
        ({"input": "a", "dimensions": 65}, "dimensions", "invalid_value", "from 1 to 64"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "invalid_type", "encoding_format"),
        ({"model": "gpt-4", "input": "a"}, "model", "model_not_found", "does not exist on this server"),
        ({}, "input", "missing_required_parameter", "'input' is required"),
    ],
)
@pytest.mark.asyncio
async def test_openai_errors_name_the_parameter(embedder, body, param, code, match):
    reply = await post(embedder, "/v1/embeddings", body)
    error = reply.json()["error"]
    assert reply.status_code == (404 if code == "model_not_found" else 400), error
    assert (error["param"], error["code"]) == (param, code)
    assert re.search(match, error["message"]), error["message"]


@pytest.mark.asyncio
async def test_ollama_embed_shape_truncation_and_empty_input(embedder):
    reply = (await post(embedder, "/api/embed", {"model": embedder.name, "input": TEXTS})).json()
    assert set(reply) == {"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}
    np.testing.assert_array_equal(np.array(reply["embeddings"], dtype=np.float32), embedder.embed(TEXTS).vectors)
    assert reply["prompt_eval_count"] == embedder.embed(TEXTS).total_tokens and reply["total_duration"] > 0
    one = (await post(embedder, "/api/embed", {"model": embedder.name, "input": "x", "dimensions": 4})).json()
    np.testing.assert_allclose(one["embeddings"], embedder.embed(["x"], dimensions=4).vectors, atol=1e-7)
    long_text = " ".join(["word"] * 60)  # past the 32-token context: Ollama truncates by default
    cut = (await post(embedder, "/api/embed", {"model": embedder.name, "input": long_text})).json()
    assert cut["prompt_eval_count"] == 32
    for empty in ("", [], None):
        nothing = (await post(embedder, "/api/embed", {"model": embedder.name, "input": empty})).json()
        assert nothing["embeddings"] == [] and nothing["prompt_eval_count"] == 0


@pytest.mark.parametrize(
    ("body", "status", "match"),
    [
        ({"input": "x", "truncate": False, "text": " ".join(["w"] * 60)}, 400, "more than the model's context of 32"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions must be an integer from 1 to 64"),
        ({"input": ["x", 3]}, 400, "invalid 'input"),
        ({"input": "x", "model": "llama3"}, 404, "'llama3' does not exist on this server"),
        ({"input": "x", "model": None}, 400, "invalid 'model'"),
    ],
)
@pytest.mark.asyncio
async def test_ollama_errors_are_ollama_shaped(embedder, body, status, match):
    body = {"model": embedder.name, **body}
    if "text" in body:
        body["input"] = body.pop("text")
    reply = await post(embedder, "/api/embed", body)
    assert reply.status_code == status and set(reply.json()) == {"error"}
    assert re.search(match, reply.json()["error"]), reply.json()


@pytest.mark.asyncio
async def test_an_embedding_model_refuses_chat_and_reports_itself(embedder):
    async with client_for(embedder) as client:
        chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        messages = await client.post(
            "/v1/messages",
            json={"model": embedder.name, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        )
        models = (await client.get("/v1/models")).json()
        health = (await client.get("/health")).json()
        metrics = (await client.get("/metrics")).text
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_supported"
    assert "is an embedding model: this server answers /v1/embeddings and /api/embed" in chat.json()["error"]["message"]
    assert messages.status_code == 400 and "embedding model" in messages.json()["error"]["message"]
    card = models["data"][0]["mlxpaged"]
    assert (card["kind"], card["dimensions"], card["pooling"], card["loaded"]) == ("embedding", 64, "last", True)
    assert models["data"][0]["max_model_len"] == 32
    assert (health["status"], health["model"], health["requests_in_flight"]) == ("ok", embedder.name, 0)
    assert health["models"][embedder.name]["kind"] == "embedding" and health["blocks_total"] == 0  # no KV cache
    assert f'mlxpaged_requests_in_flight{{model="{embedder.name}"}} 0' in metrics


@pytest.mark.asyncio
async def test_a_generative_model_refuses_embeddings_with_the_reason(tmp_path):
    generative = write_tiny_embedding_dir(tmp_path / "gen", sentence_transformers=False)
    engine = FakeEngine()
    engine.loaded = dataclasses.replace(FakeLoaded(), path=generative)
    openai_reply = await post(engine, "/v1/embeddings", {"input": "hi"})
    ollama_reply = await post(engine, "/api/embed", {"model": "fake-model", "input": "hi"})
    error = openai_reply.json()["error"]
    assert openai_reply.status_code == 400 and (error["param"], error["code"]) == ("model", "model_not_supported")
    reason = "gen is not an embedding model: its directory has no sentence-transformers pooling configuration"
    assert f"The model 'fake-model' cannot embed: {reason}" in error["message"]
    assert ollama_reply.status_code == 400 and reason in ollama_reply.json()["error"]


@pytest.mark.asyncio
async def test_concurrent_requests_each_get_their_own_vectors(embedder):
    """Eight requests at once (the Ollama route truncates, which a shared tokenizer must not do concurrently)."""
    texts = [f"request {i}: " + " ".join(["word"] * (5 * i)) for i in range(8)]
    async with client_for(embedder) as client:
        replies = await asyncio.gather(
            *(client.post("/api/embed", json={"model": embedder.name, "input": text}) for text in texts)
        )
    got = np.array([reply.json()["embeddings"][0] for reply in replies], dtype=np.float32)
    np.testing.assert_allclose(got, embedder.embed(texts, truncate=True).vectors, atol=1e-5)
