"""Tool calls, structured outputs and reasoning through `mlxpaged serve` and the official `openai` client.

Two live servers: the real default model (SmolLM2, whose template has no tool support: the generic fallback,
enforced by constrained decoding) and a scripted model (tests/scripted_models.py: a Hermes-style template and
think markers, so the native json_tools path, reasoning and parallel calls are exact and deterministic).
Named / required calls, response_format and the live agent loop on the default model need
mlxpaged.constraints (llguidance) in the engine.
"""

from __future__ import annotations

import itertools
import json

from tests.app.server.test_server_live import KEY, serving
from tests.scripted_models import write_scripted_model

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Local time in a time zone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SCRIPT = [
    "<think>",
    "Maybe <tool_call> later.",
    "</think>",
    "Let me check.",
    "<tool_call>",
    '[{"name": "get_weather", "arguments": ',
    '{"city": ',
    '"Paris", ',
    '"unit": "celsius"}',
    '}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
    "</tool_call>",
]
SCRIPTED_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("smol")) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=300, max_retries=0), server


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    model = write_scripted_model(tmp_path_factory.mktemp("scripted") / "scripted-model", SCRIPT)
    with serving(model.parent, "--model", str(model)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=120, max_retries=0), server


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _valid(calls: list[tuple[str, dict]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])


# --- the scripted model: native format, reasoning, parallel calls (exact) --------------------------------------


def test_reasoning_split_and_parallel_calls(scripted):
    client, _ = scripted
    reply = client.chat.completions.create(model="scripted-model", messages=ASK, tools=TOOLS, temperature=0.7)
    message = reply.choices[0].message
    assert message.reasoning_content == message.model_extra["reasoning"] == "Maybe <tool_call> later."
    assert message.content == "Let me check."  # the <tool_call> inside the think block is not a call
    assert _calls(message) == SCRIPTED_CALLS and reply.choices[0].finish_reason == "tool_calls"
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)


def test_streamed_reasoning_and_calls_arrive_in_pieces(scripted):
    client, _ = scripted
    chunks = list(client.chat.completions.create(model="scripted-model", messages=ASK, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "Maybe <tool_call> later." and "".join(d.content or "" for d in deltas) == "Let me check."
    pieces = [t for d in deltas for t in d.tool_calls or []]
    firsts = [p for p in pieces if p.id is not None]
    assert [(p.index, p.function.name, p.function.arguments) for p in firsts] == [
        (0, "get_weather", ""),
        (1, "get_time", ""),
    ]
    assert all(p.function.name is None and p.type is None for p in pieces if p.id is None)
    first_args = [p.function.arguments for p in pieces if p.index == 0 and p.id is None]
    assert len(first_args) >= 2  # as generated: one piece per token, not one chunk at the end
    for index, (_, arguments) in enumerate(SCRIPTED_CALLS):
        assert json.loads("".join(p.function.arguments for p in pieces if p.index == index)) == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_reads_no_calls(scripted):
    client, _ = scripted
    reply = client.chat.completions.create(model="scripted-model", messages=ASK, tools=TOOLS, tool_choice="none")
    message = reply.choices[0].message
    assert not message.tool_calls and message.content.startswith("Let me check.<tool_call>")
    assert reply.choices[0].finish_reason == "stop"


def _agent_loop(client, model: str, system: str, turns: int, **extra) -> list:
    """Each turn: the model's calls, then their results appended; returns every turn's usage."""
    messages = [{"role": "system", "content": system}, *ASK]
    usages = []
    for turn in range(turns):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=60, temperature=0, **extra
        )
        usages.append(reply.usage)
        message = reply.choices[0].message
        assert message.tool_calls, (turn, message)
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [c.model_dump(exclude_none=True) for c in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn} of {call.id}"})
    return usages


def _assert_cached(usages: list) -> None:
    rates = [u.prompt_tokens_details.cached_tokens / p.prompt_tokens for p, u in itertools.pairwise(usages)]
    print(f"\ncached tokens / previous prompt per turn: {[f'{r:.0%}' for r in rates]}")
    assert all(rate >= 0.9 for rate in rates), [(u.prompt_tokens, u.prompt_tokens_details) for u in usages]


def test_agent_loop_hits_the_prefix_cache_native(scripted):
    client, _ = scripted
    system = " ".join(f"rule{i}" for i in range(300))  # one token per word: ~300 tokens before the talk
    _assert_cached(_agent_loop(client, "scripted-model", system, 5))


# --- the default model: generic fallback + constrained decoding --------------------------------------------------

SYSTEM = (
    "You are a weather assistant. Use the tools to answer questions about weather and time. "
    "Always call a tool before answering. "
) * 4


def test_replayed_agent_loop_hits_the_prefix_cache_fallback(smol):
    """A recorded loop replayed with tool_choice none (no grammar needed): only the rendering is tested."""
    client, _ = smol
    messages = [{"role": "system", "content": SYSTEM}, *ASK]
    usages = []
    for turn in range(4):
        reply = client.chat.completions.create(
            model="smollm2-135m", messages=messages, tools=TOOLS, max_tokens=4, tool_choice="none", temperature=0
        )
        usages.append(reply.usage)
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": f"City{turn}", "unit": "celsius"})},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"{10 + turn} C, cloudy"},
        ]
    _assert_cached(usages)


def test_named_and_required_calls_validate(smol):
    client, _ = smol
    named = client.chat.completions.create(
        model="smollm2-135m",
        messages=ASK,
        tools=TOOLS,
        temperature=0.8,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    calls = _calls(named.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"] and named.choices[0].finish_reason == "tool_calls"
    _valid(calls)
    required = client.chat.completions.create(
        model="smollm2-135m",
        messages=ASK,
        tools=TOOLS,
        temperature=0.8,
        seed=2,
        tool_choice="required",
        parallel_tool_calls=False,
        n=2,
    )
    for choice in required.choices:
        assert len(_calls(choice.message)) == 1 and choice.finish_reason == "tool_calls"
        _valid(_calls(choice.message))


def test_streamed_required_call_has_incremental_arguments(smol):
    client, _ = smol
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m", messages=ASK, tools=TOOLS, stream=True, tool_choice="required", temperature=0
        )
    )
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name in SCHEMAS and pieces[0].function.arguments == ""
    arguments = [p.function.arguments for p in pieces[1:] if p.index == 0]
    assert len(arguments) >= 2 and all(p.id is None for p in pieces[1:] if p.index == 0)
    jsonschema.validate(json.loads("".join(arguments)), SCHEMAS[pieces[0].function.name])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_result_turn_and_live_agent_loop(smol):
    client, _ = smol
    usages = _agent_loop(client, "smollm2-135m", SYSTEM, 4, tool_choice="required")
    _assert_cached(usages)
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]
    answer = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=TOOLS, max_tokens=30, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_and_json_object_outputs_validate(smol):
    client, _ = smol
    ask = [{"role": "user", "content": "Invent a person. Reply in JSON."}]
    strict = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=ask, response_format=strict, n=2, temperature=0.9, seed=5, max_tokens=60
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    loose = client.chat.completions.create(
        model="smollm2-135m", messages=ask, max_tokens=80, temperature=0, response_format={"type": "json_object"}
    )
    if loose.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(loose.choices[0].message.content), dict)
    cut = client.chat.completions.create(model="smollm2-135m", messages=ask, response_format=strict, max_tokens=5)
    assert cut.choices[0].finish_reason == "length"


# --- bad requests: each a 400 in OpenAI's shape, and the next good request is served ----------------------------


def _tool(name="get_weather", **function):
    return {"type": "function", "function": {"name": name, "parameters": WEATHER, **function}}


BAD = [
    ("tools-not-a-list", {"tools": {"a": 1}}, "tools"),
    ("tool-without-name", {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ("custom-tool", {"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ("duplicate-names", {"tools": [_tool(), _tool()]}, "tools[1].function.name"),
    ("parameters-not-object", {"tools": [_tool(parameters=[1])]}, "tools[0].function.parameters"),
    (
        "named-unknown",
        {"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("bad-choice-string", {"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice"),
    ("parallel-not-bool", {"tools": [_tool()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("format-unknown", {"response_format": {"type": "yaml"}}, "response_format"),
    (
        "schema-missing",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ("tool-message-no-id", {"messages": [*ASK, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id"),
    (
        "arguments-not-json",
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ("effort-huge", {"reasoning_effort": "huge"}, "reasoning_effort"),
    ("template-kwargs-list", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("ignore-eos-with-format", {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
]
UNCOMPILABLE = [
    ("schema-bad-type", {"type": "strin"}),
    ("schema-bad-ref", {"$ref": "#/nope"}),
    ("schema-look-around", {"type": "string", "pattern": "(?=a)b"}),
]


def _post_then_good(server, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body}, headers=AUTH)
        ok = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    return r


@pytest.mark.parametrize("name, body, param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests_then_a_good_one(smol, name, body, param):
    r = _post_then_good(smol[1], body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"], error


@pytest.mark.parametrize("name, schema", UNCOMPILABLE, ids=[u[0] for u in UNCOMPILABLE])
def test_uncompilable_schema_is_a_400_with_the_reason(smol, name, schema):
    strict = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = _post_then_good(smol[1], {"response_format": strict})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "cannot be enforced: " in error["message"], error
