"""The Anthropic adapter without a server: request translation, streamed events against the non-streamed body
(the SDK's own accumulator folds our events into the message we would have sent whole), pings, error shapes."""

from __future__ import annotations

import asyncio
import json

from mlxpaged_app.server.anthropic.convert import messages_spec
from mlxpaged_app.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from mlxpaged_app.server.anthropic.shapes import envelope, message_body
from mlxpaged_app.server.anthropic.streaming import BlockStream
from mlxpaged_app.server.chat.pipeline import ChoiceResult
from mlxpaged_app.server.chat.spec import (
    Finish,
    NamedTool,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from mlxpaged_app.server.errors import APIError, error_response, queue_full, unavailable
from mlxpaged_app.server.sse import with_pings

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "input_schema": WEATHER, "description": "Weather"}]
BILLING = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=0a1b2;"


def _spec(**body):
    return messages_spec(MessagesRequest.model_validate({"model": "m", "max_tokens": 9, **body}))


def test_conversation_translates_blocks_and_drops_the_billing_header():
    spec = _spec(
        system=[{"type": "text", "text": BILLING}, {"type": "text", "text": "Be brief."}],
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
        ],
    )
    assert spec.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "rain"},
        {"role": "user", "content": "And tomorrow?\nThanks."},
    ]  # consecutive user turns merged
    assert spec.tool_choice == "auto" and spec.parallel_tool_calls
    assert spec.api == "anthropic" and spec.tools[0].parameters == WEATHER


def test_tool_result_error_and_choices():
    spec = _spec(
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True, "content": "timeout"}],
            },
        ],
    )
    assert spec.messages[-1] == {
        "role": "tool",
        "tool_call_id": "t",
        "name": "get_weather",
        "content": "Error: timeout",
    }
    assert spec.tool_choice == NamedTool("get_weather") and not spec.parallel_tool_calls
    ask = [{"role": "user", "content": "x"}]
    assert _spec(tools=TOOLS, tool_choice={"type": "any"}, messages=ask).tool_choice == "required"
    assert _spec(tools=TOOLS, tool_choice={"type": "none"}, messages=ask).tool_choice == "none"
    assert _spec(messages=ask).tool_choice == "none"


def test_sampling_stop_and_thinking_reach_the_spec():
    spec = _spec(
        messages=[{"role": "user", "content": "x"}],
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        stop_sequences=["END"],
        thinking={"type": "enabled", "budget_tokens": 2048},
        stream=True,
    )
    assert (spec.sampling.temperature, spec.sampling.top_p, spec.sampling.top_k) == (0.5, 0.9, 5)
    assert spec.sampling.stop == ["END"] and spec.stream and spec.reasoning.kwargs() == {"enable_thinking": True}
    off = _spec(messages=[{"role": "user", "content": "x"}], thinking={"type": "disabled"})
    assert off.reasoning.kwargs() == {"enable_thinking": False}
    counted = messages_spec(
        CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    )
    assert counted.max_tokens is None and not counted.stream


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages[0].content[0].type"),
        (
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}],
            "messages[0].content[0].tool_use_id",
        ),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "prefill"}], "messages"),
        (
            [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
            "messages[0].content[0].type",
        ),
    ],
)
def test_unusable_conversations_are_400s_naming_the_block(messages, param):
    with pytest.raises(APIError) as caught:
        _spec(messages=messages)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


# --- streamed events == the whole message --------------------------------------------------------------------

EVENTS = [
    ReasoningDelta("Let me "),
    ReasoningDelta("think."),
    TextDelta("Sure"),
    TextDelta(", checking."),
    ToolCallStart(0, "toolu_a", "get_weather"),
    ToolCallArgs(0, '{"city": '),
    ToolCallArgs(0, '"Paris"}'),
    ToolCallEnd(0, {"city": "Paris"}),
    ToolCallStart(1, "toolu_b", "get_weather"),
    ToolCallArgs(1, '{"city": "Rome"}'),
    ToolCallEnd(1, {"city": "Rome"}),
    Finish("tool_calls"),
]
COUNTS = {"prompt_tokens": 50, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 32}}


def test_streamed_events_fold_into_the_non_streamed_message():
    env = envelope("m")
    choice = ChoiceResult()
    blocks = BlockStream()
    payloads = [
        {
            "type": "message_start",
            "message": {
                **env,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 50, "output_tokens": 0},
            },
        }
    ]
    for event in EVENTS:
        choice.add(event)
        payloads += blocks.feed(event)
    whole = message_body(env, choice, COUNTS)
    payloads += [
        {
            "type": "message_delta",
            "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": None},
            "usage": whole["usage"],
        },
        {"type": "message_stop"},
    ]
    adapter = TypeAdapter(RawMessageStreamEvent)
    snapshot, buffers = None, {}
    for payload in payloads:
        snapshot = accumulate_event(
            event=adapter.validate_python(payload), current_snapshot=snapshot, json_bufs=buffers
        )
    assert Message.model_validate(whole).model_dump() == Message.model_validate(snapshot.model_dump()).model_dump()
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole["stop_reason"] == "tool_use" and whole["usage"]["input_tokens"] == 18
    starts = [p["index"] for p in payloads if p["type"] == "content_block_start"]
    stops = [p["index"] for p in payloads if p["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "finish, reason",
    [
        (Finish("stop"), "end_turn"),
        (Finish("length"), "max_tokens"),
        (Finish("stop", "END"), "stop_sequence"),
        (Finish("abort"), None),
    ],
)
def test_stop_reasons(finish, reason):
    choice = ChoiceResult(text="hi", finish=finish)
    body = message_body(envelope("m"), choice, COUNTS)
    assert body["stop_reason"] == reason and body["stop_sequence"] == finish.stop_sequence


def test_pings_fill_silences_without_losing_items():
    async def slow():
        for item in ("a", "b"):
            await asyncio.sleep(0.05)
            yield item

    async def run():
        return [item async for item in with_pings(slow(), 0.02)]

    items = asyncio.run(run())
    assert [i for i in items if i is not None] == ["a", "b"] and items.count(None) >= 2


# --- errors: Anthropic's shape on /v1/messages*, OpenAI's elsewhere ----------------------------------------


@pytest.mark.parametrize(
    "error, status, kind",
    [
        (APIError(400, "bad"), 400, "invalid_request_error"),
        (APIError(401, "key"), 401, "authentication_error"),
        (APIError(404, "model"), 404, "not_found_error"),
        (APIError(413, "big"), 413, "request_too_large"),
        (queue_full(80, 80, 5), 429, "rate_limit_error"),
        (APIError(500, "bug"), 500, "api_error"),
        (unavailable("draining"), 529, "overloaded_error"),
        (APIError(405, "GET"), 405, "invalid_request_error"),
    ],
)
def test_errors_take_anthropics_shape_by_path(error, status, kind):
    response = error_response(error, "/v1/messages/count_tokens")
    body = json.loads(response.body)
    assert response.status_code == status and set(body) == {"type", "error", "request_id"}
    assert body["type"] == "error" and body["error"] == {"type": kind, "message": error.message}
    assert response.headers["request-id"] == body["request_id"]
    assert all(response.headers[k] == v for k, v in error.headers.items())  # Retry-After survives
    sdk_error = anthropic.Anthropic(api_key="k")._make_status_error("x", body=body, response=_httpx(response))
    assert sdk_error.status_code == status
    openai_shape = json.loads(error_response(error, "/v1/chat/completions").body)
    assert set(openai_shape) == {"error"} and openai_shape["error"]["message"] == error.message


def _httpx(response) -> httpx.Response:
    return httpx.Response(
        response.status_code, content=response.body, request=httpx.Request("POST", "http://x/v1/messages")
    )


def test_image_blocks_become_image_parts_where_the_user_put_them():
    """base64 as a data URL, a url source as it is (server/images.py reads both), text around them in order;
    consecutive user turns merge their parts."""
    png = {"type": "base64", "media_type": "image/png", "data": "aGk="}
    spec = messages_spec(
        MessagesRequest.model_validate(
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "source": png}]},
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}],
                    },
                ],
            }
        )
    )
    assert spec.messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image", "image": "data:image/png;base64,aGk="},
                {"type": "image", "image": "http://x/a.png"},
            ],
        }
    ]
    assistant = {"role": "assistant", "content": [{"type": "image", "source": png}]}
    body = {"model": "m", "max_tokens": 5, "messages": [assistant, {"role": "user", "content": "x"}]}
    with pytest.raises(APIError, match="image blocks belong to user messages"):
        messages_spec(MessagesRequest.model_validate(body))


def test_images_a_tool_returned_follow_its_tool_message_in_a_user_turn():
    """Claude Code's Read of an image file answers with an image block in the tool_result: the tool message keeps
    the result's text, its images go to the model in the user turn right after, before the user's own text."""
    png = {"type": "base64", "media_type": "image/png", "data": "aGk="}
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/tmp/shot.png"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "the screenshot:"}, {"type": "image", "source": png}],
    }
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "Read my screenshot"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result, {"type": "text", "text": "What does it show?"}]},
        ],
    }
    spec = messages_spec(MessagesRequest.model_validate(body))
    assert spec.messages[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "name": "Read", "content": "the screenshot:"},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "data:image/png;base64,aGk="},
                {"type": "text", "text": "What does it show?"},
            ],
        },
    ]
    result["content"] = [{"type": "document", "source": {}}]
    with pytest.raises(APIError, match=r"tool_result content of type 'document' is not supported; send text and"):
        messages_spec(MessagesRequest.model_validate(body))
