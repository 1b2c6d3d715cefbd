"""Tool calls and thinking through the Ollama API and the official `ollama` client, on the scripted model
(tests/scripted_models.py: a Hermes-style template with think markers, which says a fixed script - a think block,
text, then two parallel tool calls - at any temperature, so every field is exact).
"""

from __future__ import annotations

import json

from tests.app.server.test_server_live import KEY, serving
from tests.app.server.test_server_tools import SCRIPT, SCRIPTED_CALLS, TOOLS
from tests.scripted_models import write_scripted_model

import httpx
import ollama
import pytest

pytestmark = pytest.mark.slow
MODEL = "scripted-model"
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    model = write_scripted_model(tmp_path_factory.mktemp("scripted") / MODEL, SCRIPT)
    with serving(model.parent, "--model", str(model)) as server:
        yield ollama.Client(host=server.url, headers=AUTH, timeout=120), server


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, dict(c.function.arguments)) for c in message.tool_calls or []]


def test_tool_calls_come_back_with_arguments_as_objects(scripted):
    client, server = scripted
    reply = client.chat(model=MODEL, messages=ASK, tools=TOOLS, options={"temperature": 0.7})
    assert _calls(reply.message) == SCRIPTED_CALLS and reply.done_reason == "stop"
    assert reply.message.thinking == "Maybe <tool_call> later."  # the <tool_call> inside the think block is no call
    assert reply.message.content == "Let me check."
    raw = httpx.post(
        f"{server.url}/api/chat",
        json={"model": MODEL, "messages": ASK, "tools": TOOLS, "stream": False},
        headers=AUTH,
        timeout=120,
    ).json()
    calls = raw["message"]["tool_calls"]
    assert [c["function"]["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    assert all(isinstance(c["function"]["arguments"], dict) for c in calls)  # an object, not OpenAI's JSON text


def test_streamed_calls_arrive_whole_and_thinking_in_pieces(scripted):
    client, _ = scripted
    parts = list(client.chat(model=MODEL, messages=ASK, tools=TOOLS, stream=True))
    thinking = [p.message.thinking for p in parts if p.message.thinking]
    assert "".join(thinking) == "Maybe <tool_call> later."
    assert "".join(p.message.content for p in parts) == "Let me check."
    with_calls = [p for p in parts if p.message.tool_calls]
    assert [call for p in with_calls for call in _calls(p.message)] == SCRIPTED_CALLS
    assert all(not p.done for p in with_calls) and parts[-1].done and parts[-1].done_reason == "stop"


def test_a_tool_round_trip_is_accepted(scripted):
    """The reply's calls sent back as history (arguments objects, no ids) and each result named by tool_name."""
    client, _ = scripted
    first = client.chat(model=MODEL, messages=ASK, tools=TOOLS)
    history = [
        *ASK,
        first.message,
        {"role": "tool", "tool_name": "get_weather", "content": json.dumps({"temperature": 21})},
        {"role": "tool", "tool_name": "get_time", "content": "14:05"},
    ]
    second = client.chat(model=MODEL, messages=history, tools=TOOLS, options={"num_predict": 3})
    assert second.done and second.prompt_eval_count > first.prompt_eval_count + first.eval_count


def test_think_is_accepted_and_show_says_the_model_thinks(scripted):
    client, _ = scripted
    assert client.show(MODEL).capabilities == ["completion", "tools", "thinking"]
    # three tokens: <think>, the thought, </think>
    reply = client.chat(model=MODEL, messages=ASK, think="high", options={"num_predict": 3})
    assert reply.message.thinking == "Maybe <tool_call> later." and reply.message.content == ""
    assert reply.done_reason == "length"
    generated = client.generate(model=MODEL, prompt="Weather?", think=True, options={"num_predict": 4})
    assert generated.thinking == "Maybe <tool_call> later." and generated.response == "Let me check."
