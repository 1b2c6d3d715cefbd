"""The chat pipeline's parts without a server: the output parser under any chunking (against a whole-text
reference), the generic tool fallback and prefix stability of rendered prompts, template kwargs, the tool-call
schemas, and the OpenAI request checks (each bad field a 400 naming it)."""

from __future__ import annotations

import itertools
import json
import re

from mlxpaged.engine.engine import StreamDelta
from mlxpaged_app.server.chat.output import OutputParser
from mlxpaged_app.server.chat.pipeline import ChoiceResult
from mlxpaged_app.server.chat.render import fallback_messages, render_prompt, template_inputs
from mlxpaged_app.server.chat.spec import (
    ChatRequestSpec,
    NamedTool,
    ReasoningSpec,
    ToolCallArgs,
    ToolCallStart,
    ToolSpec,
)
from mlxpaged_app.server.chat.tool_formats import GENERIC_FORMAT, ToolFormat
from mlxpaged_app.server.errors import APIError
from mlxpaged_app.server.openai.protocol import ChatRequest
from mlxpaged_app.server.openai.serving_chat import chat_spec

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools

THINK = ("<think>", "</think>")
HERMES = ToolFormat("json_tools", "<tool_call>", "</tool_call>", json_tools.parse_tool_call, "object")
WEATHER = ToolSpec(
    "get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "Weather now"
)
TIME = ToolSpec("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}})
CALLS = [
    {"name": "get_weather", "arguments": {"city": 'Paris "centre" {x}', "days": [1, 2]}},
    {"name": "get_time", "arguments": {"zone": "CET"}},
]
GENERIC_TEXT = f"<think>Maybe <tool_call> later.</think>Sure, checking.<tool_call>{json.dumps(CALLS)}</tool_call>"
HERMES_TEXT = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in CALLS)


def parse(text: str, cuts: list[int], fmt: ToolFormat = GENERIC_FORMAT, reason: str = "stop") -> ChoiceResult:
    parser = OutputParser(
        think=THINK, tools=fmt, tool_dicts=[], new_call_id=iter(f"call_{i}" for i in itertools.count()).__next__
    )
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    result = ChoiceResult()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        for event in parser.feed(StreamDelta("r", piece, finish_reason=reason if last else None)):
            result.add(event)
    return result


def reference(text: str) -> tuple[str, str, list[dict]]:
    """The obvious whole-text reading: (reasoning, text, calls)."""
    reasoning = re.findall(r"<think>(.*?)</think>", text, re.S)
    rest = re.sub(r"<think>.*?</think>", "", text, flags=re.S)
    calls = []
    for block in re.findall(r"<tool_call>(.*?)</tool_call>", rest, re.S):
        parsed = json.loads(block)
        calls += parsed if isinstance(parsed, list) else [parsed]
    return "".join(reasoning), re.sub(r"<tool_call>.*?</tool_call>", "", rest, flags=re.S), calls


@pytest.mark.parametrize("text, fmt", [(GENERIC_TEXT, GENERIC_FORMAT), (HERMES_TEXT, HERMES)])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_output_parser_any_chunking_matches_the_reference(text, fmt, data):
    cuts = data.draw(st.lists(st.integers(1, len(text) - 1), max_size=25))
    result = parse(text, cuts, fmt)
    reasoning, plain, calls = reference(text)
    assert (result.reasoning, result.text) == (reasoning, plain)
    assert [{"name": c.name, "arguments": c.arguments} for c in result.tool_calls] == calls
    assert [c.arguments_text for c in result.tool_calls] == [json.dumps(c["arguments"]) for c in calls]
    assert result.finish.reason == "tool_calls"


def test_arguments_stream_as_they_are_generated():
    """Fed one character at a time, a call's start comes before its arguments end, in many pieces."""
    parser = OutputParser(think=None, tools=GENERIC_FORMAT, tool_dicts=[], new_call_id=lambda: "call_x")
    text = f"<tool_call>{json.dumps(CALLS[:1])}</tool_call>"
    per_char = [parser.feed(StreamDelta("r", ch)) for ch in text]
    starts = [i for i, events in enumerate(per_char) if any(isinstance(e, ToolCallStart) for e in events)]
    args = [i for i, events in enumerate(per_char) if any(isinstance(e, ToolCallArgs) for e in events)]
    assert len(starts) == 1 and len(args) == len(json.dumps(CALLS[0]["arguments"]))
    assert starts[0] == args[0] and args[-1] < len(text) - len("}]</tool_call>")


@pytest.mark.parametrize(
    "text, calls, plain",
    [
        ('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', [{"name": "f", "arguments": {"a": 1}}], ""),
        ('<tool_call>[{"arguments": {"a": 1}, "name": "f"}]</tool_call>', [{"name": "f", "arguments": {"a": 1}}], ""),
        ("Hi <tool_call>not json</tool_call> there", [], "Hi <tool_call>not json</tool_call> there"),
    ],
)
def test_off_canonical_calls_parse_at_the_end_marker(text, calls, plain):
    for cuts in ([], list(range(1, len(text)))):
        result = parse(text, cuts)
        assert [{"name": c.name, "arguments": c.arguments} for c in result.tool_calls] == calls
        assert result.text == plain
        assert result.finish.reason == ("tool_calls" if calls else "stop")


def test_a_cut_call_finishes_with_length():
    text = f"<tool_call>{json.dumps(CALLS)}</tool_call>"
    started = parse(text[:60], [5, 20], reason="length")
    assert started.finish.reason == "length" and started.tool_calls[0].arguments is None
    assert started.tool_calls[0].arguments_text == text[len('<tool_call>[{"name": "get_weather", "arguments": ') : 60]
    not_started = parse(text[:40], [5, 20], reason="length")
    assert not_started.finish.reason == "length" and not not_started.tool_calls
    assert not_started.text == text[:40]  # given back as it was generated, never lost


def test_reasoning_open_at_the_start_and_no_tools_parsed_when_not_asked():
    parser = OutputParser(think=THINK, tools=None, tool_dicts=[], new_call_id=lambda: "x", reasoning_open=True)
    events = parser.feed(StreamDelta("r", "hmm</think><tool_call>[]</tool_call>", finish_reason="stop"))
    result = ChoiceResult()
    for event in events:
        result.add(event)
    assert result.reasoning == "hmm" and result.text == "<tool_call>[]</tool_call>" and not result.tool_calls


# --- schemas of calls --------------------------------------------------------------------------------------


def test_calls_schema_accepts_valid_calls_only():
    schema = GENERIC_FORMAT.calls_schema((WEATHER, TIME), "required", parallel=False)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_time", "arguments": {}}] * 2,
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate(
        [{"name": "get_time", "arguments": {}}] * 2,
        GENERIC_FORMAT.calls_schema((WEATHER, TIME), "required", parallel=True),
    )
    named = HERMES.calls_schema((WEATHER, TIME), NamedTool("get_time"), parallel=True)
    jsonschema.validate({"name": "get_time", "arguments": {}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, named)


# --- rendering ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tokenizer():
    """The default model's tokenizer (a template without tool support)."""
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load

    return load(Path(__file__).resolve().parents[3] / "models" / "smollm2-135m-float32")


def test_plain_chat_renders_as_the_template_alone(smol_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert render_prompt(smol_tokenizer, ChatRequestSpec(messages)) == list(expected)


def _agent_turn(messages: list[dict], call: dict, call_id: str, result: str) -> list[dict]:
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": call}],
    }
    return [*messages, assistant, {"role": "tool", "tool_call_id": call_id, "name": call["name"], "content": result}]


def test_fallback_prompt_and_each_agent_turn_extends_the_last(smol_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
    first = render_prompt(smol_tokenizer, ChatRequestSpec(messages, (WEATHER, TIME)))
    text = smol_tokenizer.decode(first)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\nYou may call functions.")
    assert json.dumps(WEATHER.as_template_tool()) in text and text.endswith("<|im_start|>assistant\n")
    generated = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    second_messages = _agent_turn(messages, call, "call_1", "18 C, sunny")
    second = render_prompt(smol_tokenizer, ChatRequestSpec(second_messages, (WEATHER, TIME)))
    assert second[: len(first)] == first
    assert smol_tokenizer.decode(second).startswith(
        text + generated + '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"name": "get_weather", "content": "18 C'
    )
    # tool_choice and parallel_tool_calls change the grammar, never the prompt
    again = ChatRequestSpec(
        second_messages, (WEATHER, TIME), tool_choice=NamedTool("get_time"), parallel_tool_calls=False
    )
    assert render_prompt(smol_tokenizer, again) == second


def test_fallback_merges_parallel_results_into_one_user_turn():
    calls = [{"id": f"c{i}", "type": "function", "function": c} for i, c in enumerate(CALLS)]
    messages = [
        {"role": "user", "content": "Both?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "name": "get_weather", "content": "sun"},
        {"role": "tool", "tool_call_id": "c1", "name": "get_time", "content": "noon"},
    ]
    out = fallback_messages(messages, ())
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1]["content"] == f"<tool_call>{json.dumps(CALLS)}</tool_call>"
    assert out[2]["content"].count("<tool_response>") == 2 and "noon" in out[2]["content"]


def test_native_templates_get_tools_and_history_as_is():
    class Native:
        has_tool_calling = True

    messages = [{"role": "user", "content": "hi"}]
    assert template_inputs(Native(), ChatRequestSpec(messages, (WEATHER,))) == (messages, [WEATHER.as_template_tool()])
    assert template_inputs(Native(), ChatRequestSpec(messages)) == (messages, None)


@pytest.fixture(scope="module")
def echo_tokenizer(smol_tokenizer):
    """A copy of the default tokenizer whose template shows the kwargs it gets."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = type(smol_tokenizer._tokenizer).from_pretrained(str(smol_tokenizer._tokenizer.name_or_path))
    hf.chat_template = "{{ enable_thinking }}|{{ reasoning_effort }}|{{ foo }}"
    return TokenizerWrapper(hf)


@pytest.mark.parametrize(
    "reasoning, shown",
    [
        (ReasoningSpec(), "False||"),  # mlx-lm passes enable_thinking=has_thinking when the request leaves it out
        (ReasoningSpec(effort="none"), "False|none|"),
        (ReasoningSpec(enable_thinking=True, effort="none"), "True|none|"),
        (ReasoningSpec(effort="high", template_kwargs={"enable_thinking": False, "foo": 3}), "False|high|3"),
        (ReasoningSpec(enable_thinking=True, template_kwargs={"foo": "bar"}), "True||bar"),
    ],
)
def test_template_kwargs_reach_the_template(echo_tokenizer, reasoning, shown):
    prompt = render_prompt(echo_tokenizer, ChatRequestSpec([{"role": "user", "content": "x"}], reasoning=reasoning))
    assert echo_tokenizer.decode(prompt) == shown


# --- OpenAI request checks ----------------------------------------------------------------------------------


def _tool(name="get_weather", **function):
    return {"type": "function", "function": {"name": name, "parameters": WEATHER.parameters, **function}}


USER = [{"role": "user", "content": "hi"}]
BAD = [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [_tool(), _tool()]}, "tools[1].function.name"),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [_tool()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"messages": [*USER, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c9", "content": "42"}]}, "messages[1].tool_call_id"),
    (
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ({"reasoning_effort": "huge"}, "reasoning_effort"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"chat_template_kwargs": ["a"]}, "chat_template_kwargs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_object"}, "tools": [_tool()]}, "response_format"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_tool_fields_name_the_field(extra, param):
    from mlxpaged_app.server.request_body import validation_error

    from pydantic import ValidationError

    try:
        chat_spec(ChatRequest.model_validate({"messages": USER, **extra}))
    except APIError as exc:
        error = exc
    except ValidationError as exc:
        error = validation_error(exc)
    else:
        pytest.fail("no error")
    assert error.status == 400 and error.param == param, error.message


def test_good_request_translates():
    body = {
        "messages": [
            *USER,
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "hmm",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        ],
        "tools": [_tool()],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low"},
        "chat_template_kwargs": {"x": 1},
    }
    spec = chat_spec(ChatRequest.model_validate(body))
    assert spec.tool_choice == NamedTool("get_weather") and not spec.parallel_tool_calls
    assert spec.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert spec.messages[1]["reasoning_content"] == "hmm" and spec.messages[2]["name"] == "get_weather"
    assert spec.reasoning.kwargs() == {"reasoning_effort": "low", "x": 1} and spec.tools[0].name == "get_weather"
