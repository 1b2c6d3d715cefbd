"""`POST /v1/responses` through `mlxpaged serve` and the official `openai` client (`client.responses`).

Two live servers, as in test_server_tools.py: the real default model (text, streaming, max_output_tokens,
text.format and enforced calls - the last two need mlxpaged.constraints - a replayed agent loop, bad
requests) and the scripted model (reasoning, parallel function calls, and an agent loop feeding each reply's
output items back as input: exact and deterministic).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from tests.app.server.test_server_live import KEY, serving
from tests.app.server.test_server_tools import PERSON, SCHEMAS, SCRIPT, SCRIPTED_CALLS, SYSTEM, TOOLS
from tests.scripted_models import write_scripted_model

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smollm2-135m"
FRANCE = "What is the capital of France?"
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses tools are flat


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("responses"), "--max-body-size", "64KB") as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=300, max_retries=0), server


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    model = write_scripted_model(tmp_path_factory.mktemp("scripted") / "scripted-model", SCRIPT)
    with serving(model.parent, "--model", str(model)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=120, max_retries=0), server


def _collapsed(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def _items(response) -> list[tuple]:
    """Output items without their ids (which differ per response)."""
    return [
        (i.type, i.content[0].text) if i.type in ("message", "reasoning") else (i.type, i.name, i.arguments)
        for i in response.output
    ]


# --- the default model ---------------------------------------------------------------------------------------


def test_text_reply(smol):
    client, _ = smol
    reply = client.responses.create(
        model=MODEL, input=FRANCE, temperature=0, max_output_tokens=20, store=True, metadata={"run": "1"}
    )
    assert "Paris" in reply.output_text and reply.status == "completed" and reply.id.startswith("resp_")
    assert [item.type for item in reply.output] == ["message"] and reply.output[0].role == "assistant"
    assert reply.store is False and reply.metadata == {"run": "1"}  # accepted, but nothing is stored
    usage = reply.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 20
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_stream_events_in_order_and_final_response(smol):
    client, _ = smol
    plain = client.responses.create(model=MODEL, input=FRANCE, temperature=0, max_output_tokens=12)
    with client.responses.stream(model=MODEL, input=FRANCE, temperature=0, max_output_tokens=12) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _collapsed([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens and final.status == plain.status


def test_max_output_tokens_makes_it_incomplete(smol):
    client, _ = smol
    cut = client.responses.create(model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"
    events = list(client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, stream=True))
    assert (
        events[-1].type == "response.incomplete"
        and events[-1].response.incomplete_details.reason == "max_output_tokens"
    )


def test_json_schema_output_validates(smol):
    """Needs mlxpaged.constraints (llguidance) in the engine."""
    client, _ = smol
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    reply = client.responses.create(
        model=MODEL,
        input="Invent a person. Reply in JSON.",
        text={"format": fmt},
        temperature=0.9,
        max_output_tokens=60,
    )
    assert reply.status == "completed", reply
    jsonschema.validate(json.loads(reply.output_text), PERSON)


def test_required_call_then_its_output(smol):
    """Needs mlxpaged.constraints: the call is enforced, the answer turn takes function_call_output."""
    client, _ = smol
    first = client.responses.create(
        model=MODEL, input=ASK, tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0.8
    )
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_") and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    answer = client.responses.create(
        model=MODEL,
        tools=FLAT_TOOLS,
        max_output_tokens=20,
        temperature=0,
        input=[
            *ASK,
            *[i.model_dump(exclude_none=True) for i in first.output],
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C and sunny"},
        ],
    )
    assert answer.output and answer.usage.input_tokens > first.usage.input_tokens


def test_readme_example_runs(smol):
    """The README's Responses example as written (its tool call needs mlxpaged.constraints)."""
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    code = readme.split("### The Responses API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    _client, server = smol
    code = code.replace("http://127.0.0.1:8000/v1", f"{server.url}/v1").replace('"unused"', f'"{KEY}"')
    scope: dict = {}
    exec(code, scope)
    assert "Paris" in scope["reply"].output_text and scope["final"].status == "completed"
    assert (scope["call"].name, json.loads(scope["call"].arguments)) == ("get_weather", {"city": "Paris"})
    assert scope["answer"].usage.input_tokens_details.cached_tokens >= scope["first"].usage.input_tokens * 0.9


def _cache_rates(usages: list) -> list[float]:
    rates = [u.input_tokens_details.cached_tokens / p.input_tokens for p, u in itertools.pairwise(usages)]
    print(f"\ncached tokens / previous input per turn: {[f'{r:.0%}' for r in rates]}")
    return rates


def test_replayed_agent_loop_hits_the_prefix_cache(smol):
    """Recorded function_call / function_call_output turns (tool_choice none: no grammar needed)."""
    client, _ = smol
    items, usages = list(ASK), []
    for turn in range(4):
        reply = client.responses.create(
            model=MODEL,
            instructions=SYSTEM,
            input=items,
            tools=FLAT_TOOLS,
            tool_choice="none",
            max_output_tokens=4,
            temperature=0,
        )
        usages.append(reply.usage)
        items += [
            {
                "type": "function_call",
                "call_id": f"call_{turn}",
                "name": "get_weather",
                "arguments": json.dumps({"city": f"City{turn}", "unit": "celsius"}),
            },
            {"type": "function_call_output", "call_id": f"call_{turn}", "output": f"{10 + turn} C, cloudy"},
        ]
    assert all(rate >= 0.9 for rate in _cache_rates(usages)), usages


# --- the scripted model: reasoning, parallel calls, output items fed back ------------------------------------


def test_reasoning_message_and_parallel_calls(scripted):
    client, _ = scripted
    reply = client.responses.create(model="scripted-model", input=ASK, tools=FLAT_TOOLS, temperature=0.7)
    assert _items(reply) == [
        ("reasoning", "Maybe <tool_call> later."),
        ("message", "Let me check."),
        *[("function_call", name, json.dumps(args)) for name, args in SCRIPTED_CALLS],
    ]
    assert reply.status == "completed" and reply.output_text == "Let me check."
    assert all(i.call_id.startswith("call_") and i.id.startswith("fc_") for i in reply.output[2:])
    assert reply.usage.output_tokens_details.reasoning_tokens >= 1


def test_streamed_calls_arrive_in_pieces(scripted):
    client, _ = scripted
    plain = client.responses.create(model="scripted-model", input=ASK, tools=FLAT_TOOLS)
    with client.responses.stream(model="scripted-model", input=ASK, tools=FLAT_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _items(final) == _items(plain)
    first_call = [e for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == 2]
    assert len(first_call) >= 2  # as generated, not one piece at the end
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.output_index, e.arguments) for e in done] == [
        (2 + i, json.dumps(args)) for i, (_, args) in enumerate(SCRIPTED_CALLS)
    ]
    assert [e.type for e in events if e.type.startswith("response.reasoning_text")][
        -1
    ] == "response.reasoning_text.done"


def test_agent_loop_feeding_output_items_back_hits_the_prefix_cache(scripted):
    client, _ = scripted
    instructions = " ".join(f"rule{i}" for i in range(300))  # one token per word: ~300 tokens before the talk
    items, usages = list(ASK), []
    for turn in range(4):
        reply = client.responses.create(
            model="scripted-model", instructions=instructions, input=items, tools=FLAT_TOOLS, temperature=0
        )
        usages.append(reply.usage)
        calls = [i for i in reply.output if i.type == "function_call"]
        assert len(calls) == 2, (turn, reply.output)
        items += [i.model_dump(exclude_none=True) for i in reply.output]
        items += [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"result {turn} of {c.name}"}
            for c in calls
        ]
    assert all(rate >= 0.9 for rate in _cache_rates(usages)), usages


# --- bad requests: each a 4xx in OpenAI's error shape, and the next good request is served -----------------------


def _call(call_id="c1", arguments="{}"):
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": arguments}


JSON_FORMAT = {"format": {"type": "json_object"}}
BAD = [
    ("previous-response-id", {"previous_response_id": "resp_1"}, "previous_response_id"),
    ("no-input", {"input": None}, "input"),
    ("empty-input", {"input": []}, "input"),
    ("item-type-unknown", {"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    (
        "output-without-call-id",
        {"input": [*ASK, _call(), {"type": "function_call_output", "output": "1"}]},
        "input[2].call_id",
    ),
    (
        "output-unknown-call",
        {"input": [*ASK, {"type": "function_call_output", "call_id": "x", "output": "1"}]},
        "input[1].call_id",
    ),
    ("arguments-not-json", {"input": [*ASK, _call(arguments="{nope")]}, "input[1].arguments"),
    ("role-tool", {"input": [{"role": "tool", "content": "1"}]}, "input[0].role"),
    (
        "image-to-a-text-model",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input",
    ),
    (
        "image-without-url",
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0].image_url",
    ),
    ("instructions-number", {"instructions": 5}, "instructions"),
    ("schema-missing", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ("format-unknown", {"text": {"format": {"type": "yaml"}}}, "text.format"),
    ("custom-tool", {"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    (
        "choice-forces-web-search",
        {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
        "tool_choice",
    ),
    ("tool-without-name", {"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ("duplicate-tools", {"tools": FLAT_TOOLS[:1] * 2}, "tools[1].name"),
    ("choice-unknown-function", {"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
    ("choice-bad-string", {"tools": FLAT_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("effort-huge", {"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ("background", {"background": True}, "background"),
    ("conversation", {"conversation": "conv_1"}, "conversation"),
    ("temperature-3", {"temperature": 3}, "temperature"),
    ("max-output-tokens-0", {"max_output_tokens": 0}, "max_output_tokens"),
    ("include-unknown", {"include": ["file_search_call.results"]}, "include[0]"),
    ("parallel-not-bool", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("format-with-tools", {"tools": FLAT_TOOLS, "text": JSON_FORMAT}, "text.format"),
]


def _post_then_good(server, content: bytes | None = None, headers: dict = AUTH, **body) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        if content is None:
            r = http.post("/v1/responses", json={"input": FRANCE, "max_output_tokens": 2, **body}, headers=headers)
        else:
            r = http.post("/v1/responses", content=content, headers={**headers, "content-type": "application/json"})
        ok = http.post("/v1/responses", json={"input": FRANCE, "max_output_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["status"] == "incomplete" and ok.json()["output_text"]
    return r


def _assert_openai_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error


@pytest.mark.parametrize("name, body, param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_a_good_one(smol, name, body, param):
    _assert_openai_error(_post_then_good(smol[1], **body), 400, param)


def test_transport_errors_then_a_good_one(smol):
    server = smol[1]
    _assert_openai_error(_post_then_good(server, content=b'{"input": "x",'), 400, None)
    _assert_openai_error(_post_then_good(server, model="gpt-9"), 404, "model")
    _assert_openai_error(_post_then_good(server, headers={}), 401, None)
    _assert_openai_error(_post_then_good(server, input="x" * 70_000), 413, None)


def test_uncompilable_schema_is_a_400_with_the_reason(smol):
    """Needs mlxpaged.constraints: llguidance's own reason reaches the client."""
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "strin"}, "strict": True}
    r = _post_then_good(smol[1], text={"format": fmt})
    _assert_openai_error(r, 400, "text.format")
    assert "cannot be enforced: " in r.json()["error"]["message"]
