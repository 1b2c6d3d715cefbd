"""The Anthropic Messages API through `mlxpaged serve` and the official `anthropic` client.

Two live servers, as in test_server_tools.py: the real default model (SmolLM2: text, streaming, stop sequences,
usage and the prefix cache, tool_use enforced by constrained decoding - that needs mlxpaged.constraints) and the
scripted model (thinking, text and parallel tool_use blocks, exact and deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.app.server.test_server_live import KEY, serving
from tests.app.server.test_server_tools import SCRIPT, SCRIPTED_CALLS
from tests.app.server.test_server_tools import TOOLS as OPENAI_TOOLS
from tests.scripted_models import write_scripted_model

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

pytestmark = pytest.mark.slow
SMOL = "smollm2-135m"
TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in OPENAI_TOOLS
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
GREEDY = {"temperature": 0}  # SDK 2.x has no sampling parameters; older SDKs and Claude Code send them
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SYSTEM = (
    "You are a careful weather assistant for travellers. Use the tools to look up the weather and the "
    "local time before you answer, and say which city each answer is about. "
) * 10


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("smol"), "--max-body-size", "64KB") as server:
        yield _client(server), server


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    model = write_scripted_model(tmp_path_factory.mktemp("scripted") / "scripted-model", SCRIPT)
    with serving(model.parent, "--model", str(model)) as server:
        yield _client(server), server


def _count(server, **body) -> int:
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


# --- the default model ------------------------------------------------------------------------------------


def test_text_message_usage_and_cache_read(smol):
    client, server = smol
    first = client.messages.create(model=SMOL, max_tokens=20, system=SYSTEM, messages=FRANCE, extra_body=GREEDY)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert [b.type for b in first.content] == ["text"] and "Paris" in first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens") and 0 < first.usage.output_tokens <= 20
    follow = [
        *FRANCE,
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = client.messages.create(model=SMOL, max_tokens=8, system=SYSTEM, messages=follow, extra_body=GREEDY)
    usage = second.usage
    total = usage.input_tokens + usage.cache_read_input_tokens
    assert usage.cache_read_input_tokens >= 0.8 * (first.usage.input_tokens + first.usage.cache_read_input_tokens)
    assert total == _count(server, model=SMOL, system=SYSTEM, messages=follow)  # count_tokens == the prompt
    assert usage.cache_creation_input_tokens == 0


def test_stream_text_matches_the_whole_message(smol):
    client, _ = smol
    whole = client.messages.create(model=SMOL, max_tokens=12, messages=FRANCE, extra_body=GREEDY)
    with client.messages.stream(model=SMOL, max_tokens=12, messages=FRANCE, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert (
        final.usage.input_tokens + final.usage.cache_read_input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


def test_stop_sequences(smol):
    client, _ = smol
    reply = client.messages.create(
        model=SMOL, max_tokens=20, messages=FRANCE, extra_body=GREEDY, stop_sequences=["zzz", "Paris"]
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "Paris"
    assert "Paris" not in reply.content[0].text and reply.content[0].text
    with client.messages.stream(
        model=SMOL, max_tokens=20, messages=FRANCE, extra_body=GREEDY, stop_sequences=["Paris"]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Paris")


def test_tool_use_with_tool_choice_any_validates(smol):
    """Needs constrained decoding (mlxpaged.constraints): SmolLM2's template has no tool support."""
    client, _ = smol
    reply = client.messages.create(
        model=SMOL,
        max_tokens=80,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0.8},
    )
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(calls) == 1 and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, SCHEMAS[calls[0].name])


def test_keys_in_either_header(smol):
    _, server = smol
    body = {"model": SMOL, "max_tokens": 2, "messages": FRANCE}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for headers in (
            {"x-api-key": KEY},
            {"Authorization": f"Bearer {KEY}"},
            {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "x"},
        ):
            r = http.post("/v1/messages?beta=true", json=body, headers=headers)
            assert r.status_code == 200 and r.json()["type"] == "message", (headers, r.text)
        for headers in ({"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {}):
            r = http.post("/v1/messages", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=SMOL, max_tokens=2, messages=FRANCE
        )


# --- the scripted model: thinking, text and tool_use blocks -------------------------------------------------


def test_thinking_text_and_tool_use_blocks(scripted):
    client, _ = scripted
    reply = client.messages.create(
        model="scripted-model",
        max_tokens=100,
        messages=ASK,
        tools=TOOLS,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 1.0},
    )
    assert [b.type for b in reply.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert reply.content[0].thinking == "Maybe <tool_call> later." and reply.content[1].text == "Let me check."
    assert [(b.name, b.input) for b in reply.content[2:]] == SCRIPTED_CALLS and reply.stop_reason == "tool_use"
    with client.messages.stream(model="scripted-model", max_tokens=100, messages=ASK, tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in reply.content
    ]


def test_tool_result_turn(scripted):
    client, server = scripted
    first = client.messages.create(model="scripted-model", max_tokens=100, messages=ASK, tools=TOOLS)
    calls = [b for b in first.content if b.type == "tool_use"]
    results = [
        {"type": "tool_result", "tool_use_id": c.id, "content": [{"type": "text", "text": f"{c.name}: ok"}]}
        for c in calls
    ]
    results[-1]["is_error"] = True
    messages = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": results},
    ]
    second = client.messages.create(model="scripted-model", max_tokens=100, messages=messages, tools=TOOLS)
    assert second.stop_reason == "tool_use"
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert prompt == _count(server, model="scripted-model", messages=messages, tools=TOOLS)
    assert prompt > first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0


def _raw_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for frame in text.strip().split("\n\n"):
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        events.append((lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])))
    return events


def test_raw_stream_has_event_lines_ping_and_order(scripted):
    _, server = scripted
    body = {"model": "scripted-model", "max_tokens": 100, "messages": ASK, "tools": TOOLS, "stream": True}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _raw_events(r.text)
    adapter = TypeAdapter(RawMessageStreamEvent)
    for name, data in events:
        assert name == data["type"]
        if name != "ping":
            adapter.validate_python(data)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [d["index"] for d in starts] == list(range(4))
    assert [d["content_block"]["type"] for d in starts] == ["thinking", "text", "tool_use", "tool_use"]
    pieces = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta" and d["index"] == 2]
    assert len(pieces) >= 2 and json.loads("".join(pieces)) == SCRIPTED_CALLS[0][1]  # as generated
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


# --- bad requests: each a 4xx in Anthropic's shape, and the next good request is served -------------------------


def _user(*blocks):
    return {"messages": [{"role": "user", "content": list(blocks)}]}


TOOL = {"name": "get_weather", "input_schema": SCHEMAS["get_weather"]}
DROP = object()
BAD = [
    ("no-max-tokens", {"max_tokens": DROP}, 400),
    ("max-tokens-zero", {"max_tokens": 0}, 400),
    ("empty-messages", {"messages": []}, 400),
    ("role-tool", {"messages": [{"role": "tool", "content": "x"}]}, 400),
    (
        "image-block",
        _user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}),
        400,
    ),
    ("document-block", _user({"type": "document", "source": {"type": "text", "data": "x"}}), 400),
    ("block-without-type", _user({"text": "hi"}), 400),
    ("content-number", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("tool-result-unknown-id", _user({"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}), 400),
    ("tool-use-from-user", _user({"type": "tool_use", "id": "t", "name": "f", "input": {}}), 400),
    ("assistant-prefill", {"messages": [*FRANCE, {"role": "assistant", "content": "The"}]}, 400),
    ("choice-tool-not-in-tools", {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400),
    ("choice-any-without-tools", {"tool_choice": {"type": "any"}}, 400),
    ("choice-bad-type", {"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, 400),
    ("server-tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400),
    ("input-schema-missing", {"tools": [{"name": "f"}]}, 400),
    ("input-schema-not-object", {"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, 400),
    ("tool-name-spaces", {"tools": [{"name": "get weather", "input_schema": {"type": "object"}}]}, 400),
    ("duplicate-tool-names", {"tools": [TOOL, TOOL]}, 400),
    ("temperature-1.5", {"temperature": 1.5}, 400),
    ("top-k-negative", {"top_k": -1}, 400),
    ("stop-sequences-a-string", {"stop_sequences": "END"}, 400),
    ("system-number", {"system": 5}, 400),
    ("thinking-bad-type", {"thinking": {"type": "sometimes"}}, 400),
    (
        "output-config-bad-schema",
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}},
        400,
    ),
    ("unknown-model", {"model": "claude-sonnet-4-5"}, 404),
]


def _bad_then_good(server, path: str, data: bytes, headers: dict) -> httpx.Response:
    good = {"model": SMOL, "max_tokens": 2, "messages": FRANCE}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        bad = http.post(path, content=data, headers={"content-type": "application/json", **headers})
        ok = http.post("/v1/messages", json=good, headers={"x-api-key": KEY})
    assert ok.status_code == 200 and ok.json()["content"][0]["type"] == "text", ok.text
    return bad


def _assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    assert r.headers["request-id"] == body["request_id"]


@pytest.mark.parametrize("name, change, status", BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_a_good_one(smol, name, change, status):
    body = {"model": SMOL, "max_tokens": 2, "messages": FRANCE, **change}
    body = {k: v for k, v in body.items() if v is not DROP}
    r = _bad_then_good(smol[1], "/v1/messages", json.dumps(body).encode(), {"x-api-key": KEY})
    _assert_anthropic_error(r, status, {400: "invalid_request_error", 404: "not_found_error"}[status])


RAW = [
    (
        "malformed-json",
        "/v1/messages",
        b'{"model": "x", "messages": [',
        {"x-api-key": KEY},
        400,
        "invalid_request_error",
    ),
    ("no-key", "/v1/messages", b"{}", {}, 401, "authentication_error"),
    (
        "body-too-large",
        "/v1/messages",
        b'{"system": "' + b"x" * 70_000 + b'"}',
        {"x-api-key": KEY},
        413,
        "request_too_large",
    ),
    (
        "count-tokens-image",
        "/v1/messages/count_tokens",
        json.dumps({"model": SMOL, **_user({"type": "image", "source": {}})}).encode(),
        {"x-api-key": KEY},
        400,
        "invalid_request_error",
    ),
    ("unknown-route", "/v1/messages/batches", b"{}", {"x-api-key": KEY}, 404, "not_found_error"),
]


@pytest.mark.parametrize("name, path, data, headers, status, kind", RAW, ids=[r[0] for r in RAW])
def test_raw_bad_request_then_a_good_one(smol, name, path, data, headers, status, kind):
    _assert_anthropic_error(_bad_then_good(smol[1], path, data, headers), status, kind)


def test_sdk_raises_its_own_errors(smol):
    client, _ = smol
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model=SMOL, max_tokens=5, messages=FRANCE, extra_body={"temperature": 3})
    with pytest.raises(anthropic.NotFoundError, match="claude-opus"):
        client.messages.create(model="claude-opus-4", max_tokens=5, messages=FRANCE)


# --- a replayed agent loop: every turn after the first reads the previous prompt from the prefix cache ---------


def _billing(turn: int) -> dict:
    """Claude Code's first system block: a hash that changes with every request."""
    return {
        "type": "text",
        "text": f"x-anthropic-billing-header: cc_version=2.1.{turn}; cc_entrypoint=cli; cch={turn * 7919:05x};",
    }


def test_replayed_agent_loop_hits_the_prefix_cache(smol):
    client, server = smol
    messages = list(ASK)
    prompts, cached = [], []
    for turn in range(5):
        system = [_billing(turn), {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        if turn == 0:
            assert _count(server, model=SMOL, system=system, messages=[ASK[0]]) >= 300
        reply = client.messages.create(
            model=SMOL,
            max_tokens=4,
            system=system,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "none"},
            extra_body=GREEDY,
            metadata={"user_id": "u1"},
        )
        prompts.append(reply.usage.input_tokens + reply.usage.cache_read_input_tokens)
        cached.append(reply.usage.cache_read_input_tokens)
        call_id = f"toolu_{turn:02d}"
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Checking city {turn}."},
                    {
                        "type": "tool_use",
                        "id": call_id,
                        "name": "get_weather",
                        "input": {"city": f"City{turn}", "unit": "celsius"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call_id, "content": f"{10 + turn} C, cloudy"}],
            },
        ]
    rates = [c / p for c, p in zip(cached[1:], prompts[:-1], strict=True)]
    print(f"\ncache_read_input_tokens / previous prompt per turn: {[f'{r:.0%}' for r in rates]}")
    assert all(rate >= 0.9 for rate in rates), list(zip(prompts, cached, strict=True))


def test_readme_snippet_runs(smol, capsys):
    """The README's Anthropic example, pointed at this server."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("#### Anthropic Messages API") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n", 10)]
    code = code.replace("http://127.0.0.1:8000", smol[1].url).replace('api_key="unused"', f'api_key="{KEY}"')
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert ("end_turn" in printed or "max_tokens" in printed) and len(printed.splitlines()) >= 2, printed


def test_client_leaving_mid_stream_frees_its_blocks(smol):
    _, server = smol
    body = {
        "model": SMOL,
        "max_tokens": 400,
        "messages": FRANCE,
        "stream": True,
        "system": "Write a long story about rivers.",
    }
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    server.blocks_back()
