"""Adapters behind a live `mlxpaged serve`, driven by the official `openai` and `ollama` clients: given with --lora
and found in the model store, listed as models of their own, chosen by a request's `model`, each equal to mlx-lm's
own greedy decode on `load(base, adapter_path=...)`; the base model and two adapters interleaved and concurrent;
prefix hits that never cross adapters; store adapters attached on demand within --max-loras; and adapters that
cannot be served refused with the reason: at startup (--lora), or per request (the store's), the server serving on."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.app.server.test_model_registry_live import serving_store
from tests.tiny_adapters import write_adapter
from tests.tiny_models import write_tiny_llama_dir

import httpx
import mlx.core as mx
import ollama
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

pytestmark = pytest.mark.slow
PROMPTS = [[1, 9, 4, 17, 300, 45, 12, 9, 9, 81, 7, 200, 13, 64, 5, 44, 3, 91], [2, 500, 600, 19, 23]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("store")
    base = write_tiny_llama_dir(root / "tiny-a", dtype="float32", seed=1)
    write_tiny_llama_dir(root / "tiny-wide", dtype="float32", seed=2, hidden=128)
    make = lambda: load(str(base))[0]  # noqa: E731
    adapters = root.parent / (root.name + "-adapters")
    write_adapter(make, adapters / "fr", "lora", seed=1, rank=8, scale=6.0, base=str(base))
    write_adapter(make, adapters / "pirate", "dora", seed=2, keys=["self_attn.v_proj", "mlp.down_proj"], base="tiny-a")
    write_adapter(lambda: load(str(root / "tiny-wide"))[0], adapters / "wide", seed=3, num_layers=1)
    # In the store itself: served on the model their config names, attached when first asked for.
    write_adapter(make, root / "shanty", "lora", seed=4, rank=4, base="tiny-a")
    write_adapter(make, root / "sea", "dora", seed=5, rank=4, base="tiny-a")
    write_adapter(lambda: load(str(root / "tiny-wide"))[0], root / "misfit", seed=6, num_layers=1, base="tiny-a")
    corrupt = write_adapter(make, root / "corrupt", seed=7, base="tiny-a")
    (corrupt / "adapters.safetensors").write_bytes(b"\x00" * 64)
    return root


def adapter_dir(store: Path, name: str) -> Path:
    return store.parent / (store.name + "-adapters") / name


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    lora = ["--lora", f"fr={adapter_dir(store, 'fr')}", "--lora", str(adapter_dir(store, "pirate"))]
    flags = ("--cache-tokens", "1024", "--default-max-tokens", "8", "--no-kv-disk", "--max-loras", "1", *lora)
    with serving_store(store, tmp_path_factory.mktemp("serve") / "server.log", *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def references(store) -> dict:
    """mlx-lm's greedy text for each prompt, by model name: the base model and each adapter loaded by mlx-lm."""
    out = {}
    paths = {"fr": adapter_dir(store, "fr"), "pirate": adapter_dir(store, "pirate")}
    paths |= {"shanty": store / "shanty", "sea": store / "sea"}
    for name, adapter in [("tiny-a", None), *paths.items()]:
        model, tokenizer = load(str(store / "tiny-a"), adapter_path=str(adapter) if adapter else None)
        texts = []
        for prompt in PROMPTS:
            tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)]
            texts.append(tokenizer.decode(tokens))
        out[name] = texts
    return out


def complete(client: openai.OpenAI, model: str, prompt: list[int]):
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )


def test_adapters_are_listed_with_the_model_they_run_on(server, client):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["fr"].parent == cards["pirate"].parent == "tiny-a"
    assert cards["fr"].mlxpaged["kind"] == "adapter" and cards["fr"].mlxpaged["rank"] == 8
    assert cards["pirate"].mlxpaged["fine_tune_type"] == "dora" and cards["fr"].mlxpaged["fine_tune_type"] == "lora"
    assert client.models.retrieve("tiny-a:fr").id == "fr"
    tags = {m.model: m for m in ollama.Client(host=server.url).list().models}
    assert tags["fr:latest"].details.parent_model == "tiny-a:latest"
    assert "pirate:latest" in tags and "tiny-a:latest" in tags


def test_each_adapter_answers_as_mlx_lm_does_with_it(server, client, references):
    for name in ("tiny-a", "fr", "pirate"):
        for prompt, want in zip(PROMPTS, references[name], strict=True):
            reply = complete(client, name, prompt)
            assert reply.model == name and reply.choices[0].text == want, name
    assert len({references[n][0] for n in references}) == len(references)  # the test can tell them all apart
    ollama_reply = ollama.Client(host=server.url).generate(
        model="tiny-a:fr", prompt="Hello", options={"temperature": 0, "num_predict": 4}
    )
    assert ollama_reply.model == "tiny-a:fr" and ollama_reply.response


def test_the_base_model_and_two_adapters_interleaved_and_concurrent(server, client, references):
    names = ["fr", "tiny-a", "pirate"] * 4
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda n: complete(client, n, PROMPTS[len(n) % 2]), names))
    for name, reply in zip(names, replies, strict=True):
        assert reply.choices[0].text == references[name][len(name) % 2], name


def test_prefix_hits_never_cross_adapters(server, client):
    prompt = [7, 8, 9, 10] * 12  # three full blocks of 16
    first = complete(client, "fr", prompt)
    others = [complete(client, name, prompt) for name in ("pirate", "tiny-a")]
    again = complete(client, "fr", prompt)
    cached = lambda r: (r.usage.prompt_tokens_details.cached_tokens or 0) if r.usage.prompt_tokens_details else 0  # noqa: E731
    assert cached(first) == 0 and [cached(r) for r in others] == [0, 0]
    assert cached(again) >= 32 and again.choices[0].text == first.choices[0].text


def test_store_adapters_are_attached_on_demand_within_max_loras(server, client, references):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["shanty"].parent == "tiny-a" and cards["shanty"].mlxpaged["source"] == "model store"
    for name in ["shanty", "sea", "shanty", "tiny-a:sea"]:  # --max-loras 1: each detaches the other
        reply = complete(client, name, PROMPTS[0])
        assert reply.choices[0].text == references[name.removeprefix("tiny-a:")][0], name
    loaded = {m.id: m.mlxpaged["loaded"] for m in client.models.list().data}
    assert loaded["sea"] and not loaded["shanty"] and loaded["fr"]  # --lora adapters stay and do not count
    assert complete(client, "fr", PROMPTS[0]).choices[0].text == references["fr"][0]


@pytest.mark.parametrize(("name", "reason"), [("corrupt", "cannot be read as safetensors"), ("misfit", "does not fit")])
def test_a_store_adapter_that_cannot_be_served_fails_its_request_alone(server, client, references, name, reason):
    complete(client, "sea", PROMPTS[1])  # holds the one --max-loras slot
    with pytest.raises(openai.InternalServerError, match=reason) as failed:
        complete(client, name, PROMPTS[1])
    assert failed.value.body["code"] == "adapter_load_failed"
    assert complete(client, "pirate", PROMPTS[1]).choices[0].text == references["pirate"][1]  # the server serves on
    loaded = {m.id: m.mlxpaged["loaded"] for m in client.models.list().data}
    assert loaded["sea"] and not loaded[name]  # the attached store adapter was not detached for it


def test_an_unknown_adapter_name_is_a_404_naming_the_adapters(server, client):
    with pytest.raises(openai.NotFoundError, match="fr"):
        complete(client, "tiny-a:nope", PROMPTS[1])
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        ("wide", "does not fit this model"),
        ("corrupt", "cannot be read as safetensors"),
        ("elsewhere", "was trained on 'Qwen/Qwen3-4B'"),  # its shapes fit: the base its config names does not
    ],
)
def test_an_adapter_that_cannot_be_served_is_refused_at_startup(store, tmp_path, spoil, message):
    path = adapter_dir(store, "wide")
    if spoil == "corrupt":
        path = tmp_path / "corrupt"
        path.mkdir()
        (path / "adapter_config.json").write_bytes((adapter_dir(store, "fr") / "adapter_config.json").read_bytes())
        (path / "adapters.safetensors").write_bytes(b"\x00" * 64)
    elif spoil == "elsewhere":
        path = tmp_path / "elsewhere"
        shutil.copytree(adapter_dir(store, "fr"), path)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "model": "Qwen/Qwen3-4B"}))
    command = [sys.executable, "-m", "mlxpaged_app.cli", "serve", "--port", "0", "--model", str(store / "tiny-a")]
    done = subprocess.run([*command, "--lora", f"x={path}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr


def test_mlxpaged_models_lists_the_stores_adapters_with_their_base(store):
    env = {**os.environ, "MLXPAGED_MODELS_DIR": str(store)}
    done = subprocess.run(
        [sys.executable, "-m", "mlxpaged_app.cli", "models"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    listed = done.stdout[done.stdout.index("ADAPTER") :]
    for name in ("shanty", "sea", "corrupt", "misfit"):
        assert re.search(rf"^  {name}\s+tiny-a\s", listed, re.M), listed
