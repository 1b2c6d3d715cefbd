"""The HTTP layer in-process, over a fake engine that follows the Engine contract (n > 1 included).

Fast (no model): shapes of bodies and events, admission (429), auth, body limits, metrics,
draining, failures, and the flag checks. The real model behind a real socket is test_server_live.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlxpaged.config import SchedulerConfig
from mlxpaged.engine.engine import RequestFailedError, StreamDelta
from mlxpaged.errors import RequestTooLongError
from mlxpaged.kernels.self_check import KernelVariant, VariantCheck
from mlxpaged.sampling_params import SamplingParams
from mlxpaged_app.server.api_server import create_app
from mlxpaged_app.server.engine_client import Generation
from mlxpaged_app.server.flags import ServeError, check_bind, is_loopback
from mlxpaged_app.server.metrics import ServerMetrics
from mlxpaged_app.server.sse import ClientGone, EventStream, unless_disconnected
from mlxpaged_app.server.state import ServerConfig

import httpx
import pytest

FAKE_ATTENTION = {
    "path": "kernel (with reference fallback)",
    "reason": 'self-check failed: "x"',
    "variants": [
        VariantCheck(KernelVariant("float16", 64, 16, 3, False), True, None, 0.01),
        VariantCheck(
            KernelVariant("float16", 64, 16, 3, True), False, "mismatch: max error 0.31 > tolerance 0.004", 0.02
        ),
    ],
}


class FakeTokenizer:
    """One token per byte (ids = byte + 10), so prompt lengths are easy to predict."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + 10 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(max(0, i - 10) for i in ids).decode(errors="replace")

    def apply_chat_template(
        self, messages: list[dict], tools=None, add_generation_prompt=True, tokenize=True, **kwargs
    ) -> list[int]:
        if any(m["content"] == "template-error" for m in messages):
            raise RuntimeError("Conversation roles must alternate")
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


@dataclass
class FakePlan:
    token_capacity: int = 4096
    kv_bytes: int = 1 << 20
    block_bytes: int = 4096
    wired_limit_bytes: int | None = None
    breakdown: tuple = (("device limit", 1 << 30), ("KV cache", 1 << 20))


@dataclass
class FakeLoaded:
    name: str = "fake-model"
    path: Path = Path("/models/fake-model-float32")


@dataclass
class FakeRun:
    params: object
    sink: object
    aborted: threading.Event = field(default_factory=threading.Event)


class FakeEngine:
    """Emits "w0 w1 ..." per sequence from a thread; `gate` holds every request until set."""

    def __init__(self, max_num_seqs: int = 4, step: float = 0.001, fail: bool = False) -> None:
        self.loaded, self.plan, self.tokenizer = FakeLoaded(), FakePlan(), FakeTokenizer()
        self.scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs)
        self.max_model_len = 8192
        self.step, self.fail = step, fail
        self.gate = threading.Event()
        self.gate.set()
        self.runs: dict[str, FakeRun] = {}
        self.aborted: list[str] = []
        self.submitted: list[tuple[list[int], object]] = []

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        if any(m["content"] == "template-error" for m in messages):
            raise RuntimeError("Conversation roles must alternate")
        return self.tokenizer.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def submit(self, prompt, params, sink, adapter=None) -> str:
        tokens = list(prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) + params.max_tokens > self.max_model_len:
            raise RequestTooLongError(len(tokens), params.max_tokens, self.max_model_len, "model context")
        request_id = f"req-{len(self.submitted)}"
        self.submitted.append((tokens, params))
        self.runs[request_id] = run = FakeRun(params, sink)
        threading.Thread(target=self._emit, args=(request_id, len(tokens), run), daemon=True).start()
        return request_id

    def _emit(self, request_id: str, prompt_tokens: int, run: FakeRun) -> None:
        self.gate.wait(10)
        p = run.params
        for step in range(p.max_tokens):
            if self.fail:
                run.sink(RequestFailedError("engine step failed: boom"))
                return
            aborted = run.aborted.is_set()  # read once: an abort landing mid-step must still end every sequence
            for index in range(p.n):
                last = step == p.max_tokens - 1 or aborted
                reason = ("abort" if aborted else "length") if last else None
                run.sink(
                    StreamDelta(
                        request_id,
                        f"w{step} ",
                        100 + step,
                        -0.5 if p.logprobs else None,
                        [(100 + step, -0.5)] * p.top_logprobs if p.logprobs else None,
                        reason,
                        index,
                        prompt_tokens if last else 0,
                        3 if last else 0,
                        step + 1 if last else 0,
                    )
                )
            if aborted:
                return
            time.sleep(self.step)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self.runs:
            self.runs[request_id].aborted.set()

    def stats(self) -> dict:
        return {
            "blocks_total": 10,
            "blocks_free": 10,
            "blocks_used": 0,
            "blocks_cached": 2,
            "prefix_hit_rate": 0.5,
            "prefix_hit_tokens": 3,
            "requests_running": 0,
            "requests_waiting": 0,
            "generation_tokens_per_s": 1.0,
            "preemptions": 0,
            "memory_plan": self.plan,
            "attention": FAKE_ATTENTION,
            "speculative": "ngram",
            "spec_draft_tokens_total": 40,
            "spec_accepted_tokens_total": 30,
            "spec_acceptance_rate": 0.75,
        }


def client_for(engine: FakeEngine, **config) -> httpx.AsyncClient:
    app = create_app(engine, ServerConfig(**config))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def sse_events(text: str) -> list:
    datas = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in datas]


@pytest.mark.asyncio
async def test_chat_reply_shape():
    async with client_for(FakeEngine()) as client:
        r = await client.post("/v1/chat/completions", json=CHAT)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and r.headers["x-request-id"] == body["id"]
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "w0 w1 w2 "},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": len("<user>hi<assistant>"),
        "completion_tokens": 3,
        "total_tokens": len("<user>hi<assistant>") + 3,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


@pytest.mark.asyncio
async def test_chat_stream_events_and_usage():
    async with client_for(FakeEngine()) as client:
        r = await client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "w0 w1 w2 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.asyncio
async def test_n_samples_share_one_request():
    engine = FakeEngine()
    async with client_for(engine) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, "n": 3})
    body = r.json()
    assert len(engine.submitted) == 1 and engine.submitted[0][1].n == 3  # one prefill, forked by the engine
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 9
    assert body["usage"]["prompt_tokens"] == len("<user>hi<assistant>")  # counted once


@pytest.mark.asyncio
async def test_completion_batch_indices_and_echo():
    engine = FakeEngine()
    async with client_for(engine) as client:
        r = await client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 1, "echo": True})
    body = r.json()
    assert body["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "abw0 "),
        (1, "abw0 "),
        (2, "cdew0 "),
        (3, "cdew0 "),
    ]
    assert body["usage"]["prompt_tokens"] == 5


@pytest.mark.asyncio
async def test_completion_token_id_prompt_and_stream():
    engine = FakeEngine()
    async with client_for(engine) as client:
        r = await client.post("/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 2, "stream": True})
    events = sse_events(r.text)
    assert engine.submitted[0][0] == [11, 12, 13]
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == "w0 w1 "


@pytest.mark.asyncio
async def test_logprobs_shapes():
    async with client_for(FakeEngine()) as client:
        chat = (await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})).json()
        legacy = (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1})).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and content[0]["logprob"] == -0.5 and len(content[0]["top_logprobs"]) == 2
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    lp = legacy["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -0.5] and len(lp["top_logprobs"]) == 2 and lp["text_offset"][0] == 0


@pytest.mark.asyncio
async def test_queue_full_answers_429_with_retry_after():
    engine = FakeEngine(max_num_seqs=1)
    engine.gate.clear()  # hold the first request in flight
    async with client_for(engine, max_queue=1) as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        second = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        while len(engine.submitted) < 2:
            await asyncio.sleep(0.01)
        third = await client.post("/v1/chat/completions", json=CHAT)
        engine.gate.set()
        assert (await first).status_code == 200 and (await second).status_code == 200
        after = await client.post("/v1/chat/completions", json=CHAT)
    assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1
    assert third.json()["error"]["code"] == "queue_full"
    assert after.status_code == 200


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "header, ok",
    [
        (None, False),
        ("Bearer nope", False),
        ("Basic s3cret", False),
        ("Bearer", False),
        ("Bearer s3cret", True),
        ("bearer s3cret", True),
    ],
)
async def test_api_key(header, ok):
    headers = {"Authorization": header} if header else {}
    async with client_for(FakeEngine(), api_key="s3cret") as client:
        r = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        models = await client.get("/v1/models", headers=headers)
        health = await client.get("/health")
    assert r.status_code == models.status_code == (200 if ok else 401)
    if not ok:
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert health.status_code == 200


@pytest.mark.asyncio
async def test_body_limit_declared_and_streamed():
    async def chunks():
        for _ in range(10):
            yield b" " * 100

    async with client_for(FakeEngine(), max_body_size=500) as client:
        declared = await client.post("/v1/chat/completions", content=b" " * 600)
        streamed = await client.post("/v1/chat/completions", content=chunks())
        fine = await client.post("/v1/chat/completions", json=CHAT)
    assert declared.status_code == streamed.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large" and "500" in declared.json()["error"]["message"]
    assert fine.status_code == 200


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body, param",
    [
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "messages": [{"role": "user", "content": "template-error"}]}, "messages"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].image_url",
        ),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages[0].content[0]",
        ),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({**CHAT, "logit_bias": {"5": 150}}, "logit_bias"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 9000}, "prompt"),
        ({**CHAT, "n": 0}, "n"),
    ],
)
async def test_bad_parameters_name_the_field(body, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    async with client_for(FakeEngine()) as client:
        r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.asyncio
async def test_unknown_fields_are_ignored_and_aliases_accepted():
    engine = FakeEngine()
    async with client_for(engine) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "model": "fake-model-float32", "user": "u", "metadata": {"a": 1}, "future_field": [1]},
        )
        other = await client.get("/v1/models/fake-model")
    assert r.status_code == 200 and other.json()["id"] == "fake-model"


@pytest.mark.asyncio
async def test_default_max_tokens_is_clipped_to_the_context():
    engine = FakeEngine()
    engine.plan.token_capacity = 30
    async with client_for(engine, default_max_tokens=1000) as client:
        r = await client.post("/v1/completions", json={"prompt": "x" * 20})
    assert r.status_code == 200 and engine.submitted[0][1].max_tokens == 10


@pytest.mark.asyncio
async def test_context_limit_is_the_model_context_when_the_cache_fits_any_length():
    engine = FakeEngine()
    engine.plan.token_capacity = None  # every layer slides over a window: the cache never runs out
    async with client_for(engine) as client:
        r = await client.get("/v1/models")
    assert r.json()["data"][0]["max_model_len"] == 8192


@pytest.mark.asyncio
async def test_metrics_text_format():
    async with client_for(FakeEngine()) as client:
        await client.post("/v1/chat/completions", json=CHAT)
        await client.post("/v1/chat/completions", json={"messages": []})
        text = (await client.get("/metrics")).text
    assert 'mlxpaged_requests_total{route="/v1/chat/completions",status="200"} 1' in text
    assert 'mlxpaged_requests_total{route="/v1/chat/completions",status="400"} 1' in text
    model = 'model="fake-model"'  # every model's samples carry its name
    assert f'mlxpaged_time_to_first_token_seconds_bucket{{{model},le="+Inf"}} 1' in text
    assert f'mlxpaged_kv_blocks{{{model},state="free"}} 10' in text
    assert f"mlxpaged_prefix_cache_hit_rate{{{model}}} 0.5" in text
    assert f'mlxpaged_memory_bytes{{{model},kind="kv_cache"}} 1048576' in text
    assert f"mlxpaged_spec_acceptance_rate{{{model}}} 0.75" in text
    assert f"mlxpaged_spec_draft_tokens_total{{{model}}} 40" in text
    assert f"mlxpaged_model_loaded{{{model}}} 1" in text
    assert (
        f'mlxpaged_attention_path{{{model},path="kernel (with reference fallback)",'
        'reason="self-check failed: \\"x\\""} 1' in text
    )
    assert (
        f'mlxpaged_kernel_self_check_passed{{{model},variant="float16 D=64 BS=16 G=3 two-pass",'
        'reason="mismatch: max error 0.31 > tolerance 0.004"} 0'
    ) in text
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    assert len(families) == len(set(families))  # one HELP / TYPE per family, whatever the number of models
    for line in text.splitlines():  # every sample line is "name{labels} number"
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


@pytest.mark.asyncio
async def test_draining_refuses_new_work():
    app = create_app(FakeEngine())
    app.state.server.draining = True
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        health = await client.get("/health")
        r = await client.post("/v1/chat/completions", json=CHAT)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


@pytest.mark.asyncio
async def test_engine_failure_is_a_server_error_in_the_right_place():
    async with client_for(FakeEngine(fail=True)) as client:
        plain = await client.post("/v1/chat/completions", json=CHAT)
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"
    events = sse_events(streamed.text)
    assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"


@pytest.mark.asyncio
async def test_shutdown_abort_ends_streams_with_abort():
    engine = FakeEngine(step=0.05)
    app = create_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 500}))
        while not app.state.server.registry.find_loaded(None).active:
            await asyncio.sleep(0.01)
        app.state.server.abort_all()
        body = (await task).json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert app.state.server.registry.find_loaded(None).in_flight == 0


@pytest.mark.asyncio
async def test_unless_disconnected_cancels_the_work():
    cancelled = asyncio.Event()

    async def work():
        try:
            await asyncio.sleep(10)
        finally:
            cancelled.set()

    async def receive():
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    with pytest.raises(ClientGone):
        await unless_disconnected(receive, work())
    await asyncio.wait_for(cancelled.wait(), 1)


@pytest.mark.asyncio
async def test_event_stream_closes_when_the_client_leaves():
    closed, finalized = [], []

    async def events():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.01)
        finally:
            finalized.append(True)

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    await EventStream(events(), on_close=lambda: closed.append(True))({"type": "http"}, receive, send)
    assert closed == [True] and finalized == [True] and 1 < len(sent) < 100


def test_bind_checks():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    check_bind("127.0.0.1", None, False)
    check_bind("0.0.0.0", "key", False)
    check_bind("0.0.0.0", None, True)
    with pytest.raises(ServeError, match="--api-key"):
        check_bind("0.0.0.0", None, False)


def test_the_cli_reads_serve_flags_without_loading_the_http_stack():
    """`mlxpaged --help` and every other command build the serve parser: it must stay light."""
    code = (
        "import sys, mlxpaged_app.server.flags; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'starlette', 'uvicorn', 'pydantic', 'mlx'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.asyncio
async def test_text_parts_and_developer_role_reach_the_template():
    engine = FakeEngine()
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c"},
    ]
    async with client_for(engine) as client:
        r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200
    assert engine.tokenizer.decode(engine.submitted[0][0]) == "<system>be brief<user>a\nb<assistant><user>c<assistant>"


@pytest.mark.asyncio
async def test_cors_only_when_asked_for():
    preflight = {
        "Origin": "http://app.local",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    async with client_for(FakeEngine(), api_key="k") as client:
        closed = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "http://app.local", "Authorization": "Bearer k"}
        )
    async with client_for(FakeEngine(), api_key="k", cors_origins=("http://app.local",)) as client:
        allowed = await client.options("/v1/chat/completions", headers=preflight)
        other = await client.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.local"})
    assert closed.status_code == 200 and "access-control-allow-origin" not in closed.headers
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://app.local"
    assert other.status_code == 400


@pytest.mark.asyncio
async def test_unknown_model_id_route():
    async with client_for(FakeEngine()) as client:
        r = await client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_serve_max_model_len_reaches_the_engine_settings_only_when_given():
    import argparse

    from mlxpaged.config import split_settings
    from mlxpaged_app.server.flags import add_serve_arguments, cache_settings

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    given = cache_settings(parser.parse_args(["--max-model-len", "16384"]))
    assert given["max_model_len"] == 16384 and split_settings(given)[1].max_model_len == 16384
    assert "max_model_len" not in cache_settings(parser.parse_args([]))


@pytest.mark.asyncio
async def test_a_request_its_client_left_is_withdrawn_counted_and_logged_once(caplog):
    engine, metrics = FakeEngine(step=0.01), ServerMetrics()
    generation = Generation(engine, metrics, 1, time.perf_counter())
    generation.submit([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=1000), "messages")
    await generation.deltas().__anext__()  # a token read, then the client goes
    with caplog.at_level(logging.INFO, logger="mlxpaged.server"):
        generation.left("/v1/chat/completions")
        for _ in range(1000):
            if metrics.abandoned:
                break
            await asyncio.sleep(0.01)
        generation.left("/v1/chat/completions")
    assert engine.aborted == ["req-0"] and metrics.abandoned == {"/v1/chat/completions": 1}
    assert metrics.prompt_tokens == 5 and metrics.cached_tokens == 3 and metrics.generated_tokens >= 1
    [line] = [r.getMessage() for r in caplog.records if "client left" in r.getMessage()]
    assert line.startswith("client left /v1/chat/completions ") and "with 5 prompt tokens (3 cached)" in line
    whole = Generation(engine, metrics, 1, time.perf_counter())
    whole.submit([[1, 2]], SamplingParams(max_tokens=2), "messages")
    assert len([d async for d in whole.deltas()]) == 2
    whole.left("/v1/chat/completions")  # its reply had ended: nothing was left
    assert metrics.abandoned == {"/v1/chat/completions": 1} and engine.aborted == ["req-0"]


def test_serve_step_budget_reaches_the_engine_settings_and_0_turns_it_off():
    import argparse

    from mlxpaged.config import split_settings
    from mlxpaged.platform import backend
    from mlxpaged_app.server.flags import add_serve_arguments, cache_settings

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert split_settings(cache_settings(parser.parse_args(["--step-budget-ms", "300"])))[1].step_budget_ms == 300
    assert split_settings(cache_settings(parser.parse_args(["--step-budget-ms", "0"])))[1].step_budget_ms is None
    default = split_settings(cache_settings(parser.parse_args([])))[1]
    assert default.step_budget_ms == backend.tuning().step_budget_ms
    assert default.long_prompt_step_budget_ms == backend.tuning().long_prompt_step_budget_ms
    long_prompt = split_settings(cache_settings(parser.parse_args(["--long-prompt-step-budget-ms", "500"])))[1]
    assert long_prompt.long_prompt_step_budget_ms == 500
    off = split_settings(cache_settings(parser.parse_args(["--long-prompt-step-budget-ms", "0"])))[1]
    assert off.long_prompt_step_budget_ms is None  # the streams' budget then
    assert default.streams_step_budget_ms == backend.tuning().streams_step_budget_ms
    streams = split_settings(cache_settings(parser.parse_args(["--streams-step-budget-ms", "900"])))[1]
    assert streams.streams_step_budget_ms == 900
    off = split_settings(cache_settings(parser.parse_args(["--streams-step-budget-ms", "0"])))[1]
    assert off.streams_step_budget_ms is None  # the step budget then


@pytest.mark.asyncio
async def test_responses_in_progress_are_counted_until_each_ends():
    """What rank 0 giving up on a lost rank waits on before it exits (distributed/watchdog.py): a request held by the
    engine counts until its response has ended, an error response too."""
    engine = FakeEngine()
    engine.gate.clear()
    app = create_app(engine, ServerConfig())
    state = app.state.server
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        held = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        for _ in range(200):
            if engine.submitted:
                break
            await asyncio.sleep(0.01)
        assert state.responses_in_progress == 1
        assert (await client.post("/v1/chat/completions", json={"messages": []})).status_code == 400
        assert state.responses_in_progress == 1  # the error ended, the held request did not
        engine.gate.set()
        assert (await held).status_code == 200
    assert state.responses_in_progress == 0


def test_serve_image_memory_pixels_reaches_the_engine_settings_only_when_given():
    """`--image-memory-pixels N` plans the vision tower for exactly N pixels (platform/memory.py); without it the plan
    takes the largest size that fits."""
    import argparse

    from mlxpaged.config import split_settings
    from mlxpaged_app.server.flags import add_serve_arguments, cache_settings

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    given = cache_settings(parser.parse_args(["--image-memory-pixels", "1000000"]))
    assert split_settings(given)[0].image_memory_pixels == 1_000_000
    assert "image_memory_pixels" not in cache_settings(parser.parse_args([]))
