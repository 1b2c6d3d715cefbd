"""`mlxpaged serve --model <embedding model>` as a real process, driven by the official clients: `openai`'s
`embeddings.create` (float and base64, the client's default) and `ollama`'s `embed`. The model is a tiny random
qwen3 embedding model (tests/embedding/tiny_embedding.py): it loads in well under a second."""

from __future__ import annotations

from mlxpaged import Embedder
from tests.app.server.test_server_live import KEY, serving
from tests.embedding.tiny_embedding import write_tiny_embedding_dir

import httpx
import numpy as np
import ollama
import openai
import pytest

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_embedding_dir(tmp_path_factory.mktemp("emb") / "tiny-embed", "last", context=64)


@pytest.fixture(scope="module")
def expected(model_dir):
    """The library's vectors for TEXTS, in this process."""
    return Embedder.from_pretrained(str(model_dir)).embed(TEXTS).vectors


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve"), "--model", str(model_dir)) as srv:
        yield srv


def test_openai_client_float_and_base64(server, model_dir, expected):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=60, max_retries=0)
    floats = client.embeddings.create(model=str(model_dir), input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="tiny-embed", input=TEXTS)  # the client asks for base64 by default
    assert [d.index for d in floats.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in floats.data], expected, atol=1e-6)
    np.testing.assert_allclose([d.embedding for d in packed.data], expected, atol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == packed.usage.prompt_tokens > 0
    short = client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=16)
    assert len(short.data[0].embedding) == 16
    np.testing.assert_allclose(np.linalg.norm(short.data[0].embedding), 1.0, atol=1e-5)


def test_openai_client_sees_chat_refused_and_errors_named(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=60, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="is an embedding model") as chat:
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    assert chat.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError, match="more than the model's context of 64") as long:
        client.embeddings.create(model="tiny-embed", input=[list(range(1, 100))])
    assert long.value.code == "context_length_exceeded" and long.value.param == "input"


def test_ollama_client_embed(server, expected):
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    reply = client.embed(model="tiny-embed", input=TEXTS)
    np.testing.assert_allclose(reply.embeddings, expected, atol=1e-6)
    assert reply.model == "tiny-embed" and reply.prompt_eval_count > 0 and reply.total_duration > 0
    one = client.embed(model="tiny-embed", input=TEXTS[0], dimensions=8)
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 8
    with pytest.raises(ollama.ResponseError, match="does not exist on this server") as missing:
        client.embed(model="llama3", input="hi")
    assert missing.value.status_code == 404


def test_ollama_route_needs_the_api_key(server):
    reply = httpx.post(f"{server.url}/api/embed", json={"model": "tiny-embed", "input": "hi"}, timeout=30)
    assert reply.status_code == 401
