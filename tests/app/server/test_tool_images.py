"""Images a tool returned, in every API: the tool message keeps its text and the images follow the run of tool
messages in a user turn (at the start of the user's own turn when one follows), because chat templates render a
tool turn as text (chat/tool_images.py). Live: tests/vision/test_server_images.py."""

from __future__ import annotations

import base64

from mlxpaged_app.server.chat.tool_images import images_after_tool_turns
from mlxpaged_app.server.errors import APIError
from mlxpaged_app.server.ollama.convert import chat_messages as ollama_messages
from mlxpaged_app.server.ollama.protocol import Message
from mlxpaged_app.server.openai.prompts import chat_messages as openai_messages
from mlxpaged_app.server.openai.protocol import ChatRequest
from mlxpaged_app.server.responses.inputs import input_messages

import pytest

URL = "data:image/png;base64,aGk="
SHOT = {"type": "image", "image": URL}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def tool(call_id: str, content) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": "shot", "content": content}


CALLS = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}, {"id": "c2"}]}


@pytest.mark.parametrize(
    "after, expected",
    [
        ([{"role": "user", "content": "What?"}], [{"role": "user", "content": [SHOT, SHOT, text("What?")]}]),
        (
            [{"role": "assistant", "content": "ok"}],
            [{"role": "user", "content": [SHOT, SHOT]}, {"role": "assistant", "content": "ok"}],
        ),
        ([], [{"role": "user", "content": [SHOT, SHOT]}]),
    ],
    ids=["user-follows", "assistant-follows", "last"],
)
def test_a_run_of_tool_messages_keeps_its_text_and_its_images_follow_it(after, expected):
    messages = [CALLS, tool("c1", [text("one:"), SHOT]), tool("c2", [SHOT]), *after]
    assert images_after_tool_turns(messages) == [CALLS, tool("c1", "one:"), tool("c2", ""), *expected]


def test_tool_messages_without_images_are_left_as_they_are():
    messages = [CALLS, tool("c1", "done"), {"role": "user", "content": "next"}]
    assert images_after_tool_turns(messages) == messages


def test_openai_tool_messages_take_image_url_parts():
    request = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Take a screenshot"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}],
                },
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": [{"type": "text", "text": "taken:"}, {"type": "image_url", "image_url": {"url": URL}}],
                },
            ],
        }
    )
    assert openai_messages(request)[2:] == [tool("c1", "taken:"), {"role": "user", "content": [SHOT]}]
    request.messages[1].content = [{"type": "image_url", "image_url": {"url": URL}}]
    with pytest.raises(APIError, match=r"messages\[1\].content\[0\]: content part type 'image_url' is not supported"):
        openai_messages(request)  # an assistant's own turn takes no images


def test_responses_function_call_outputs_take_input_image_parts():
    items = [
        {"role": "user", "content": "Take a screenshot"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": "taken:"}, {"type": "input_image", "image_url": URL}],
        },
        {"role": "user", "content": "What does it show?"},
    ]
    assert input_messages(items, None)[2:] == [
        tool("c1", "taken:"),
        {"role": "user", "content": [SHOT, text("What does it show?")]},
    ]
    items[2]["output"] = "plain text"
    assert input_messages(items, None)[2] == tool("c1", "plain text")


def test_ollama_tool_messages_take_images():
    png = base64.b64encode(b"hi").decode()
    messages = [
        Message(role="user", content="Take a screenshot"),
        Message.model_validate(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "function": {"name": "shot", "arguments": {}}}],
            }
        ),
        Message(role="tool", content="taken:", tool_call_id="c1", images=[png]),
    ]
    out = ollama_messages(messages)
    assert out[2] == {"role": "tool", "content": "taken:", "tool_call_id": "c1", "name": "shot"}
    assert out[3] == {"role": "user", "content": [{"type": "image", "image": b"hi"}]}
    messages[1].images = [png]
    with pytest.raises(APIError, match=r"only user and tool messages carry images, not 'assistant'"):
        ollama_messages(messages)
