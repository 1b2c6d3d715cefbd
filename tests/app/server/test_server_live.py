"""`mlxpaged serve` as a real process on a loopback port with the real default model, driven by
the official `openai` client and by raw HTTP: semantics, bad input, disconnects, load, shutdown.

One server per module (model load ~2 s); replies are kept short. Timing is reported, never asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
READY = re.compile(r"ready at (http://[\d.]+:\d+)/v1")


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def blocks_back(self, deadline: float = 10.0) -> float:
        """Seconds until no block is owned by a request (asserted within a generous deadline)."""
        start = time.monotonic()
        while self.health()["blocks_used"] and time.monotonic() - start < deadline:
            time.sleep(0.02)
        assert self.health()["blocks_used"] == 0, self.health()
        return time.monotonic() - start


def start_server(log: Path, *extra: str, timeout: float = 180.0) -> Server:
    command = [
        sys.executable,
        "-m",
        "mlxpaged_app.cli",
        "serve",
        "--port",
        "0",
        "--cache-tokens",
        "4096",
        "--default-max-tokens",
        "64",
        "--log-level",
        "warning",
        "--no-access-log",
        *extra,
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = READY.search(log.read_text(errors="replace"))
        if match:
            return Server(match.group(1), process, log)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    pytest.fail(f"server did not become ready:\n{log.read_text(errors='replace')[-3000:]}")


def stop_server(server: Server, timeout: float = 60.0) -> int:
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = start_server(log, "--api-key", KEY, "--max-body-size", "64KB", "--drain-timeout", "5")
    yield srv
    assert_clean_exit(stop_server(srv), log)


def assert_clean_exit(code: int, log: Path) -> None:
    text = log.read_text(errors="replace")
    assert "mlxpaged serve: stopped" in text, text[-3000:]  # the server's own shutdown completed
    assert code == 0, text[-3000:]


@contextmanager
def serving(workdir: Path, *extra: str) -> Iterator[Server]:
    """A live server with the test key and `extra` flags, its log in `workdir`; it must exit cleanly."""
    log = workdir / "server.log"
    server = start_server(log, "--api-key", KEY, *extra)
    yield server
    assert_clean_exit(stop_server(server), log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=120, max_retries=0)


# --- OpenAI semantics through the official client --------------------------------------------------


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    assert server.health()["status"] == "ok"


def test_chat_greedy(client):
    reply = client.chat.completions.create(model="smollm2-135m", messages=FRANCE, max_tokens=20, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and reply.id.startswith("chatcmpl-")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 20
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_matches_non_stream(client):
    plain = client.chat.completions.create(model="smollm2-135m", messages=FRANCE, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m",
            messages=FRANCE,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_stream_and_not(client):
    plain = client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    streamed = list(
        client.completions.create(
            model="smollm2-135m", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert plain.object == "text_completion" and plain.choices[0].text
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_n_2_chat_and_stream(client):
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=FRANCE, max_tokens=8, n=2, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.message.content for c in reply.choices)
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m", messages=FRANCE, max_tokens=8, n=2, temperature=1.0, seed=3, stream=True
        )
    )
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in reply.choices}  # seeded: same samples


def test_stop_string(client):
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=FRANCE, max_tokens=20, temperature=0, stop=["Paris"]
    )
    assert "Paris" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    listed = client.completions.create(
        model="smollm2-135m", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7", " 6"]
    )
    assert " 6" not in listed.choices[0].text and listed.choices[0].finish_reason == "stop"


def test_seed_reproducible(client):
    def sample(seed):
        return (
            client.chat.completions.create(
                model="smollm2-135m", messages=FRANCE, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed
            )
            .choices[0]
            .message.content
        )

    assert sample(1234) == sample(1234)


def test_second_turn_hits_the_prefix_cache(client):
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    first = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And three animals?"},
    ]
    second = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_logprobs(client):
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=FRANCE, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy picks the most likely


PARIS, COMMA = 7042, 28  # " Paris" and "," in SmolLM2's vocabulary


def test_logit_bias_bans_and_forces_tokens(client):
    def complete(**fields):
        return (
            client.completions.create(model="smollm2-135m", prompt="The capital of France is", temperature=0, **fields)
            .choices[0]
            .text
        )

    assert complete(max_tokens=1) == " Paris"  # a completion keeps the space, as OpenAI's and vLLM's do
    assert complete(max_tokens=1, logit_bias={str(PARIS): -100}) not in (" Paris", "")
    assert complete(max_tokens=3, logit_bias={str(COMMA): 100}) == ",,,"


# --- bad input: the documented status and error shape, then a normal request ------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": "smollm2-135m", "messages": OK_MESSAGES, "max_tokens": 2, **fields}


BAD_INPUTS = [  # (id, path, body as dict or raw bytes, headers or None for the key, status, param)
    ("malformed-json", CHAT, b'{"messages": [', None, 400, None),
    ("empty-body", CHAT, b"", None, 400, None),
    ("json-array", CHAT, b"[1, 2]", None, 400, None),
    ("non-utf8", CHAT, b'{"messages": "\xff\xfe"}', None, 400, None),
    ("nan", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None, 400, None),
    ("no-messages", CHAT, {"model": "smollm2-135m"}, None, 400, "messages"),
    ("empty-messages", CHAT, chat(messages=[]), None, 400, "messages"),
    ("messages-not-list", CHAT, chat(messages="hi"), None, 400, "messages"),
    ("unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), None, 400, "messages[0].role"),
    ("missing-role", CHAT, chat(messages=[{"content": "hi"}]), None, 400, "messages[0].role"),
    ("content-number", CHAT, chat(messages=[{"role": "user", "content": 5}]), None, 400, "messages[0].content"),
    (
        "image-part-without-url",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        None,
        400,
        "messages[0].content[0].image_url",
    ),
    (
        "image-to-a-text-model",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]),
        None,
        400,
        "messages",
    ),
    ("negative-max-tokens", CHAT, chat(max_tokens=-5), None, 400, "max_tokens"),
    ("zero-max-tokens", CHAT, chat(max_tokens=0), None, 400, "max_tokens"),
    ("string-max-tokens", CHAT, chat(max_tokens="10"), None, 400, "max_tokens"),
    ("float-max-completion-tokens", CHAT, chat(max_completion_tokens=1.5), None, 400, "max_completion_tokens"),
    ("negative-temperature", CHAT, chat(temperature=-1), None, 400, "temperature"),
    ("string-temperature", CHAT, chat(temperature="hot"), None, 400, "temperature"),
    ("top-p-above-1", CHAT, chat(top_p=1.5), None, 400, "top_p"),
    ("top-p-zero", CHAT, chat(top_p=0), None, 400, "top_p"),
    ("negative-top-k", CHAT, chat(top_k=-5), None, 400, "top_k"),
    ("min-p-above-1", CHAT, chat(min_p=2), None, 400, "min_p"),
    ("presence-penalty", CHAT, chat(presence_penalty=5), None, 400, "presence_penalty"),
    ("frequency-penalty", CHAT, chat(frequency_penalty=-3), None, 400, "frequency_penalty"),
    ("stop-list-too-long", CHAT, chat(stop=[str(i) for i in range(17)]), None, 400, "stop"),
    ("stop-not-string", CHAT, chat(stop=5), None, 400, "stop"),
    ("stop-empty-string", CHAT, chat(stop=[""]), None, 400, "stop"),
    ("n-zero", CHAT, chat(n=0), None, 400, "n"),
    ("n-huge", CHAT, chat(n=10**6), None, 400, "n"),
    ("logprobs-string", CHAT, chat(logprobs="yes"), None, 400, "logprobs"),
    ("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=50), None, 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs"),
    ("seed-string", CHAT, chat(seed="abc"), None, 400, "seed"),
    ("stream-string", CHAT, chat(stream="yes"), None, 400, "stream"),
    ("stream-options-type", CHAT, chat(stream=True, stream_options="usage"), None, 400, "stream_options"),
    ("tool-without-function", CHAT, chat(tools=[{"type": "function"}]), None, 400, "tools[0].function"),
    ("logit-bias-past-vocab", CHAT, chat(logit_bias={str(10**9): 5}), None, 400, "logit_bias"),
    ("unknown-model", CHAT, chat(model="gpt-9"), None, 404, "model"),
    ("prompt-over-the-cache", COMPLETIONS, {"prompt": "hello " * 5000}, None, 400, "prompt"),
    ("oversized-body", CHAT, chat(messages=[{"role": "user", "content": "x" * 100_000}]), None, 413, None),
    ("missing-key", CHAT, chat(), {}, 401, None),
    ("wrong-key", CHAT, chat(), {"Authorization": "Bearer wrong"}, 401, None),
    ("malformed-auth", CHAT, chat(), {"Authorization": KEY}, 401, None),
    ("completion-no-prompt", COMPLETIONS, {"max_tokens": 2}, None, 400, "prompt"),
    ("completion-prompt-object", COMPLETIONS, {"prompt": {"a": 1}}, None, 400, "prompt"),
    ("completion-empty-prompt", COMPLETIONS, {"prompt": ""}, None, 400, "prompt"),
    ("completion-token-out-of-vocab", COMPLETIONS, {"prompt": [10**9], "max_tokens": 2}, None, 400, "prompt"),
    ("completion-logprobs-too-many", COMPLETIONS, {"prompt": "hi", "logprobs": 50}, None, 400, "logprobs"),
    ("completion-best-of", COMPLETIONS, {"prompt": "hi", "best_of": 3}, None, 400, "best_of"),
    ("completion-suffix", COMPLETIONS, {"prompt": "hi", "suffix": "end"}, None, 400, "suffix"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("name, path, body, headers, status, param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_then_a_normal_request(http, name, path, body, headers, status, param):
    headers = AUTH if headers is None else headers
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        r = http.post(path, json=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert error["param"] == param, error
    ok = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


def test_an_image_to_the_text_model_is_refused_naming_it_before_any_url_is_fetched(http):
    image = {"type": "image_url", "image_url": {"url": "http://192.0.2.1/never-fetched.png"}}  # TEST-NET: no host
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": [image]}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and "model 'smollm2-135m' takes no images: it is a text model" in r.text, r.text


def test_error_messages_carry_the_numbers(http):
    r = http.post(COMPLETIONS, json={"prompt": "hello " * 5000}, headers=AUTH)
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "KV cache capacity" in error["message"]
    assert re.search(r"\d{4} tokens", error["message"])
    assert "64,000" in http.post(CHAT, content=b"x" * 70_000, headers=AUTH).json()["error"]["message"]


def test_unknown_route_and_method(http):
    assert http.get("/v1/nothing", headers=AUTH).status_code == 404
    r = http.get(CHAT, headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# --- disconnects and load ---------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server, http):
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with http.stream("POST", COMPLETIONS, json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        events = list(itertools.islice((line for line in lines if line.startswith("data: ")), 3))
        assert len(events) == 3
        assert server.health()["blocks_used"] > 0
    elapsed = server.blocks_back()
    print(f"\nblocks back to the pool {elapsed * 1000:.0f} ms after the client disconnected")


async def _one_stream(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
        "max_tokens": 12,
        "stream": True,
        "temperature": 0.7,
        "seed": i,
    }
    async with client.stream("POST", CHAT, json=body, headers=AUTH) as r:
        text = "".join([line async for line in r.aiter_lines()])
        return r.status_code, text


async def _load(url: str, clients: int) -> list[tuple[int, str]]:
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as client:
        return await asyncio.gather(*(_one_stream(client, i) for i in range(clients)))


def test_32_concurrent_streams(server):
    start = time.monotonic()
    results = asyncio.run(_load(server.url, 32))
    print(f"\n32 concurrent streams done in {time.monotonic() - start:.1f} s")
    assert [status for status, _ in results] == [200] * 32
    assert all(text.endswith("data: [DONE]") for _, text in results)
    server.blocks_back()


def test_metrics_after_traffic(http):
    text = http.get("/metrics").text
    assert re.search(r'mlxpaged_requests_total\{route="/v1/chat/completions",status="400"\} \d+', text)
    assert re.search(r'mlxpaged_requests_total\{route="/v1/chat/completions",status="401"\} [1-9]', text)
    model = 'model="smollm2-135m"'  # every model's samples carry its name
    assert re.search(rf"mlxpaged_cached_prompt_tokens_total{{{model}}} [1-9]", text)
    assert re.search(rf"mlxpaged_time_to_first_token_seconds_count{{{model}}} [1-9]", text)
    assert f'mlxpaged_kv_blocks{{{model},state="used"}} 0' in text and f"mlxpaged_queue_depth{{{model}}} 0" in text


# --- process lifecycle --------------------------------------------------------------------------------


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxpaged_app.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MLXPAGED_API_KEY": ""},
    )


def test_refuses_public_bind_without_key():
    done = _serve("--host", "0.0.0.0", "--port", "0")
    assert done.returncode == 1 and "--api-key" in done.stderr and "Traceback" not in done.stderr


def test_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _serve("--port", str(taken.getsockname()[1]))
    assert done.returncode == 1 and "cannot listen" in done.stderr and "Traceback" not in done.stderr


def test_sigterm_drains_then_exits_zero(tmp_path):
    srv = start_server(tmp_path / "drain.log", "--drain-timeout", "1")
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", COMPLETIONS, json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        srv.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "abort"
    assert_clean_exit(srv.process.wait(60), srv.log)
