"""Several models behind one live `mlxpaged serve` process, driven by the official clients: tiny random models
in a model store of their own (MLXPAGED_MODELS_DIR), loaded on demand by the requests' `model`."""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.app.server.test_server_live import Server, assert_clean_exit, start_server, stop_server
from tests.tiny_models import write_tiny_llama_dir

import httpx
import ollama
import openai
import pytest

HI = [{"role": "user", "content": "Say something."}]


def make_store(root: Path) -> Path:
    write_tiny_llama_dir(root / "tiny-a", dtype="float32", seed=1)
    write_tiny_llama_dir(root / "tiny-b", dtype="float32", seed=2, hidden=256)  # ~50 MB of weights to see go
    write_tiny_llama_dir(root / "tiny-c", dtype="float32", seed=3)
    broken = root / "tiny-broken"
    broken.mkdir()
    (broken / "config.json").write_text((root / "tiny-a" / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((root / "tiny-a" / "model.safetensors").read_bytes()[:1000])
    return root


@contextmanager
def serving_store(store: Path, log: Path, *flags: str) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXPAGED_MODELS_DIR", str(store))
        server = start_server(log, "--model", "tiny-a", "--log-level", "info", *flags)
    try:
        yield server
    finally:
        assert_clean_exit(stop_server(server), log)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    flags = ("--keep-alive", "30s", "--cache-tokens", "512", "--max-batch-tokens", "128", "--default-max-tokens", "8")
    with serving_store(store, tmp_path_factory.mktemp("serve") / "server.log", *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


def metric(server: Server, name: str, model: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf'^mlxpaged_{name}{{model="{re.escape(model)}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def loaded(server: Server) -> dict:
    return server.health()["models"]


def wait_until(condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.1)
    return time.monotonic() - start


def greedy(client: openai.OpenAI, model: str, **extra):
    return client.chat.completions.create(model=model, messages=HI, max_tokens=6, temperature=0.0, **extra)


def test_two_models_alternately_and_concurrently_each_from_its_own_engine(server, client):
    before = {m: metric(server, "generation_tokens_total", m) for m in ("tiny-a", "tiny-b")}
    alternate = [greedy(client, m) for m in ("tiny-a", "tiny-b", "tiny-a", "tiny-b")]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(lambda m: greedy(client, m), ["tiny-a", "tiny-b"] * 4))
    replies = alternate + mixed
    by_model: dict[str, set[str]] = {}
    for reply, asked in zip(replies, ["tiny-a", "tiny-b"] * 6, strict=True):
        assert reply.model == asked
        by_model.setdefault(asked, set()).add(reply.choices[0].message.content)
    assert len(by_model["tiny-a"]) == len(by_model["tiny-b"]) == 1  # greedy: one engine per model, same answer
    assert by_model["tiny-a"] != by_model["tiny-b"]  # two different random models answered
    for model in ("tiny-a", "tiny-b"):  # each engine counted exactly its own requests' tokens
        generated = sum(r.usage.completion_tokens for r in replies if r.model == model)
        assert metric(server, "generation_tokens_total", model) - before[model] == generated
    assert {"tiny-a", "tiny-b"} <= set(loaded(server))


def test_concurrent_first_requests_load_a_model_once(server, client):
    assert "tiny-c" not in loaded(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: greedy(client, "tiny-c"), range(4)))
    assert {r.model for r in replies} == {"tiny-c"} and metric(server, "model_loads_total", "tiny-c") == 1


def test_models_list_marks_what_is_loaded(server, client):
    greedy(client, "tiny-a")
    cards = {m.id: m for m in client.models.list().data}
    assert {"tiny-a", "tiny-b", "tiny-c", "tiny-broken"} <= set(cards)
    assert cards["tiny-a"].mlxpaged["loaded"] is True and cards["tiny-a"].mlxpaged["memory_bytes"] > 0
    assert cards["tiny-broken"].mlxpaged["loaded"] is False
    assert client.models.retrieve("tiny-c").id == "tiny-c"


def test_idle_model_unloaded_after_its_keep_alive_gives_memory_back(server, client):
    greedy(client, "tiny-b", extra_body={"keep_alive": "2s"})
    held = server.health()["memory"]
    weights = loaded(server)["tiny-b"]["weights_bytes"]
    waited = wait_until(lambda: not {"tiny-b"} & {*loaded(server), *server.health()["unloading"]}, 20)
    after = server.health()["memory"]
    print(
        f"\ntiny-b unloaded {waited:.1f} s after its reply (keep_alive 2s); MLX active "
        f"{held['mlx_active_bytes']:,} -> {after['mlx_active_bytes']:,} B, RSS {held['process_resident_bytes']:,} -> "
        f"{after['process_resident_bytes']:,} B (noisy); weights {weights:,} B"
    )
    assert held["held_bytes"] - after["held_bytes"] >= weights  # it was loaded after its reply (weights read)
    assert held["mlx_active_bytes"] - after["mlx_active_bytes"] >= weights
    assert held["process_resident_bytes"] - after["process_resident_bytes"] >= weights // 2
    assert greedy(client, "tiny-b").model == "tiny-b"  # and it loads again on the next request


def test_keep_alive_zero_unloads_now_and_minus_one_never(server, client):
    greedy(client, "tiny-c", extra_body={"keep_alive": 0})
    wait_until(lambda: "tiny-c" not in loaded(server), 5)  # the server's own keep-alive is 30 s
    body = {"model": "tiny-c", "max_tokens": 4, "messages": HI, "keep_alive": -1}  # Anthropic's body too
    assert httpx.post(f"{server.url}/v1/messages", json=body, timeout=60).status_code == 200
    greedy(client, "tiny-c", extra_body={"keep_alive": "1s"})  # then -1 again: the last request's value holds
    greedy(client, "tiny-c", extra_body={"keep_alive": -1})
    time.sleep(2.5)
    assert loaded(server)["tiny-c"]["keep_alive_s"] is None
    bad = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": "tiny-c", "messages": HI, "keep_alive": "soon"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


def test_a_model_that_fails_to_load_says_why_and_the_others_keep_serving(server, client):
    with pytest.raises(openai.InternalServerError) as failed:
        greedy(client, "tiny-broken")
    message = failed.value.body["message"]
    assert "tiny-broken" in message and "failed to load" in message and "safetensors" in message
    anthropic = httpx.post(
        f"{server.url}/v1/messages", json={"model": "tiny-broken", "max_tokens": 4, "messages": HI}, timeout=60
    )
    assert anthropic.json()["type"] == "error" and "failed to load" in anthropic.json()["error"]["message"]
    with pytest.raises(ollama.ResponseError, match="failed to load") as ollama_failed:  # Ollama's {"error": ...}
        ollama.Client(host=server.url, timeout=60).chat(model="tiny-broken:latest", messages=HI)
    assert ollama_failed.value.status_code == 500
    assert "tiny-broken" in server.health()["failed"] and "tiny-broken" not in loaded(server)
    assert greedy(client, "tiny-a").model == "tiny-a"
    with pytest.raises(openai.NotFoundError):
        greedy(client, "no-such-model")


def test_a_model_that_cannot_fit_is_refused_with_the_numbers(store, tmp_path):
    """A budget for one tiny model: the second unloads the idle first; while one is busy the other is refused."""
    flags = ("--max-memory", "60MB", "--max-batch-tokens", "64", "--cache-tokens", "2048", "--keep-alive", "-1")
    with serving_store(store, tmp_path / "budget.log", *flags) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", timeout=120, max_retries=0)
        time.sleep(0.6)  # past the hand-out grace of the startup model
        assert greedy(client, "tiny-c").model == "tiny-c"
        assert set(loaded(srv)) == {"tiny-c"}  # tiny-a, idle, was unloaded to make room
        body = {"model": "tiny-c", "prompt": "Once", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as busy:
            lines = busy.iter_lines()  # kept: a closed line iterator would close the stream, ending the request
            next(line for line in lines if line.startswith("data: "))
            with pytest.raises(openai.APIStatusError) as refused:
                greedy(client, "tiny-a")
            anthropic = httpx.post(
                f"{srv.url}/v1/messages", json={"model": "tiny-a", "max_tokens": 4, "messages": HI}, timeout=60
            )
            ollama_reply = httpx.post(f"{srv.url}/api/chat", json={"model": "tiny-a", "messages": HI}, timeout=60)
        error = refused.value
        assert ollama_reply.status_code == 503 and "--max-memory" in ollama_reply.json()["error"]
        assert set(ollama_reply.json()) == {"error"}
        assert error.status_code == 503 and error.body["code"] == "insufficient_memory"
        assert re.search(
            r"needs \d+\.\d+ [MG]B .* of the 0\.06 GB memory budget \(--max-memory\)", error.body["message"]
        )
        assert "tiny-c" in error.body["message"] and "in flight" in error.body["message"]
        assert anthropic.status_code >= 500 and anthropic.json()["type"] == "error"
        assert "--max-memory" in anthropic.json()["error"]["message"]
        assert set(loaded(srv)) == {"tiny-c"}
