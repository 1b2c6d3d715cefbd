"""The Responses adapter without a server: input items to chat messages, and chat events to a response and its
stream events, checked against the official client's own types and its own stream accumulator (the SDK's
`ResponseStreamState`, what `client.responses.stream()` runs) as the independent twin of our response body."""

from __future__ import annotations

from mlxpaged_app.server.chat.spec import (
    Finish,
    JsonSchemaOutput,
    NamedTool,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from mlxpaged_app.server.errors import APIError
from mlxpaged_app.server.responses.inputs import input_messages
from mlxpaged_app.server.responses.protocol import ResponsesRequest
from mlxpaged_app.server.responses.serving import responses_spec
from mlxpaged_app.server.responses.shapes import ResponseBuilder, response_head

import pytest
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 9,
    "total_tokens": 49,
    "prompt_tokens_details": {"cached_tokens": 32},
}
ECHO = {
    "instructions": None,
    "max_output_tokens": None,
    "temperature": None,
    "top_p": None,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "text": {"format": {"type": "text"}},
    "reasoning": {"effort": None, "summary": None},
    "metadata": {},
}
EVENT = TypeAdapter(ResponseStreamEvent)


def _run(deltas: list[list]) -> tuple[ResponseBuilder, list[dict]]:
    builder = ResponseBuilder(response_head("m", ECHO))
    events = builder.start()
    for delta in deltas:
        events += builder.feed(delta)
    return builder, events + builder.complete(USAGE)


def _sdk_final(events: list[dict]) -> Response | None:
    """What the official client's stream helper assembles from the events (it raises on a malformed stream)."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final = None
    for event in events:
        for handled in state.handle_event(EVENT.validate_python(event)):
            if handled.type == "response.completed":
                final = handled.response
    return final


CALL = [
    ReasoningDelta("Think"),
    ReasoningDelta("ing."),
    TextDelta("Let me"),
    TextDelta(" check."),
    ToolCallStart(0, "call_a", "get_weather"),
    ToolCallArgs(0, '{"city": '),
    ToolCallArgs(0, '"Paris"}'),
    ToolCallEnd(0, {"city": "Paris"}),
    ToolCallStart(1, "call_b", "get_time"),
    ToolCallArgs(1, "{}"),
    ToolCallEnd(1, {}),
    Finish("tool_calls"),
]


def test_stream_events_rebuild_the_non_streamed_response():
    builder, events = _run([[e] for e in CALL])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    body = Response.model_validate(builder.response())
    assert [item.type for item in body.output] == ["reasoning", "message", "function_call", "function_call"]
    assert body.output[0].content[0].text == "Thinking." and body.output_text == "Let me check."
    assert [(c.call_id, c.name, c.arguments) for c in body.output[2:]] == [
        ("call_a", "get_weather", '{"city": "Paris"}'),
        ("call_b", "get_time", "{}"),
    ]
    assert body.status == "completed" and body.usage.input_tokens_details.cached_tokens == 32
    assert body.usage.output_tokens_details.reasoning_tokens == 2
    done = sorted((e for e in events if e["type"] == "response.output_item.done"), key=lambda e: e["output_index"])
    assert [e["item"] for e in done] == builder.response()["output"]
    for index, item in enumerate(builder.response()["output"]):  # the deltas add up to each item's text
        pieces = "".join(e["delta"] for e in events if e.get("output_index") == index and "delta" in e)
        assert pieces == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
    final = _sdk_final(events)
    assert final.output_text == body.output_text and [i.id for i in final.output] == [i.id for i in body.output]


def test_event_order_per_item():
    _, events = _run([[e] for e in CALL])
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed"
    arguments = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert [e["delta"] for e in arguments if e["output_index"] == 2] == ['{"city": ', '"Paris"}']
    for index in range(4):  # every item: added first, done last, its content between
        mine = [e["type"] for e in events if e.get("output_index") == index]
        assert mine[0] == "response.output_item.added" and mine[-1] == "response.output_item.done"


def test_a_cut_reply_is_incomplete_and_every_item_is_closed():
    cut = [TextDelta("Sure."), ToolCallStart(0, "call_a", "get_weather"), ToolCallArgs(0, '{"ci'), Finish("length")]
    builder, events = _run([cut])
    body = Response.model_validate(builder.response())
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    assert [(i.type, i.status) for i in body.output] == [("message", "completed"), ("function_call", "incomplete")]
    assert events[-1]["type"] == "response.incomplete"
    added = {e["output_index"] for e in events if e["type"] == "response.output_item.added"}
    assert added == {e["output_index"] for e in events if e["type"] == "response.output_item.done"}
    assert _sdk_final(events) is None  # the client's helper sees no response.completed, as with OpenAI


def test_items_become_one_assistant_turn_per_reply():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "9:00"}]},
    ]
    messages = input_messages(items, "You help.")
    assert messages == [
        {"role": "system", "content": "You help."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Hm",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "21 C"},
        {"role": "tool", "tool_call_id": "c2", "name": "get_time", "content": "9:00"},
    ]


def test_a_call_after_a_new_reasoning_item_starts_a_new_turn():
    items = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    messages = input_messages(items, None)
    assert [m["role"] for m in messages] == ["user", "assistant", "assistant"]
    assert messages[2]["reasoning_content"] == "Call it." and "tool_calls" not in messages[1]


@pytest.mark.parametrize(
    "value, param",
    [
        (None, "input"),
        ("", "input"),
        ([], "input"),
        ([{"role": "system", "content": "x"}], "input"),
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
        ([3], "input[0]"),
        ([{"type": "function_call_output", "call_id": "nope", "output": "1"}], "input[0].call_id"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}], "input[0].arguments"),
    ],
)
def test_unusable_input_names_the_item(value, param):
    with pytest.raises(APIError) as caught:
        input_messages(value, None)
    assert caught.value.status == 400 and caught.value.param == param and caught.value.message


@pytest.mark.parametrize("end", ["abort", "engine failure"])
def test_a_reply_the_server_stops_ends_failed(end):
    builder = ResponseBuilder(response_head("m", ECHO))
    events = builder.start() + builder.feed([TextDelta("Hal")])
    if end == "abort":  # shutdown drain: the engine ends the sequence with finish_reason "abort"
        events += builder.feed([Finish("abort")]) + builder.complete(USAGE)
    else:
        events += builder.fail("generation failed: boom")
    for event in events:
        EVENT.validate_python(event)
    assert events[-1]["type"] == "response.failed" and builder.response()["status"] == "failed"
    assert builder.response()["error"]["message"]
    assert _sdk_final(events) is None


def test_request_fields_reach_the_chat_spec():
    body = ResponsesRequest.model_validate(
        {
            "input": "Hi",
            "instructions": "Be brief.",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "reasoning": {"effort": "low"},
            "stream": True,
            "store": True,
            "include": ["reasoning.encrypted_content"],
        }
    )
    spec = responses_spec(body)
    assert spec.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert spec.tools == (ToolSpec("f", {"type": "object"}),) and spec.tool_choice == NamedTool("f")
    assert not spec.parallel_tool_calls and spec.max_tokens == 7 and spec.stream and spec.api == "responses"
    assert (spec.sampling.temperature, spec.sampling.top_p) == (0.5, 0.9)
    assert spec.reasoning.kwargs() == {"reasoning_effort": "low"}
    fmt = {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}
    spec = responses_spec(ResponsesRequest.model_validate({"input": "Hi", "text": {"format": fmt}}))
    assert spec.output == JsonSchemaOutput({"type": "object"}, True, "p") and spec.tool_choice == "none"


def test_input_images_become_image_parts_of_user_turns():
    image = {"type": "input_image", "image_url": "data:image/png;base64,aGk="}
    [turn] = input_messages([{"role": "user", "content": [image, {"type": "input_text", "text": "What?"}]}], None)
    assert turn["content"] == [
        {"type": "image", "image": "data:image/png;base64,aGk="},
        {"type": "text", "text": "What?"},
    ]
    with pytest.raises(APIError, match="not supported here"):
        input_messages([{"role": "assistant", "content": [image]}, {"role": "user", "content": "x"}], None)
    with pytest.raises(APIError, match="file_id is not supported"):
        input_messages([{"role": "user", "content": [{"type": "input_image", "file_id": "f1"}]}], None)
