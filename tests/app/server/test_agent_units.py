"""What real coding agents send, without a server: Codex's namespace and hosted tools on /v1/responses, the one
max_tokens rule (reply_budget), grammar warnings that name their tool, and a tokenizer told the real context."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

from mlxpaged_app.server.chat.spec import (
    ChatRequestSpec,
    Finish,
    JsonSchemaOutput,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from mlxpaged_app.server.chat.structure import grammar_notes
from mlxpaged_app.server.errors import APIError
from mlxpaged_app.server.param_names import ANTHROPIC, OPENAI_CHAT, RESPONSES
from mlxpaged_app.server.reply_budget import reply_budget
from mlxpaged_app.server.responses.inputs import input_messages
from mlxpaged_app.server.responses.protocol import ResponsesRequest
from mlxpaged_app.server.responses.serving import echoed, responses_spec
from mlxpaged_app.server.responses.shapes import ResponseBuilder, response_head
from mlxpaged_app.server.responses.tools import flat_name, responses_tools
from mlxpaged_app.server.state import LONG_SEQUENCE_WARNING, fit_tokenizer_to_context

import pytest
from openai.types.responses import Response

SPAWN = {
    "type": "function",
    "name": "spawn_agent",
    "description": "Start a helper.",
    "parameters": {
        "type": "object",
        "properties": {"message": {"type": "string", "maxLength": 16}},
        "required": ["message"],
    },
}
WAIT = {"type": "function", "name": "wait", "parameters": {"type": "object", "properties": {}}}
SHELL = {
    "type": "function",
    "name": "shell",
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}},
}
# Tools as Codex 0.171 sends them by default: its own function tools, a namespace, and hosted tools.
CODEX_TOOLS = [
    SHELL,
    {"type": "namespace", "name": "multi_agent_v1", "description": "Helpers.", "tools": [SPAWN, WAIT]},
    {"type": "web_search", "external_web_access": False},
    {"type": "image_generation"},
    {"type": "mcp", "server_label": "docs", "server_url": "https://example.invalid"},
]


def _error(call, *args) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args)
    return caught.value


# --- Responses tools as Codex sends them ------------------------------------------------------------------------


def test_namespaces_flatten_and_hosted_tools_are_left_out():
    tools = responses_tools(CODEX_TOOLS)
    assert [t.name for t in tools.specs] == ["shell", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait"]
    assert tools.specs[1].parameters == SPAWN["parameters"] and tools.specs[1].description == "Start a helper."
    assert tools.dropped == ("tools[2] (web_search)", "tools[3] (image_generation)", "tools[4] (mcp)")
    assert tools.call_fields("multi_agent_v1__wait") == {"namespace": "multi_agent_v1", "name": "wait"}
    assert tools.call_fields("shell") == {"name": "shell"}


def test_flat_names_follow_codex_trimming():
    assert flat_name("mcp__codex_apps__gmail", "_search_emails") == "mcp__codex_apps__gmail__search_emails"
    assert flat_name("ns_", "tool") == "ns__tool"


def test_codex_request_fields_are_accepted():
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "You are Codex.",
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}
            ],
            "tools": CODEX_TOOLS,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0199-session",
            "client_metadata": {"originator": "codex_exec"},
            "text": {"verbosity": "low"},
        }
    )
    spec = responses_spec(body)
    assert [t.name for t in spec.tools] == ["shell", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait"]
    assert spec.tool_choice == "auto" and spec.reasoning.effort == "medium" and spec.output is None


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        (CODEX_TOOLS, {"type": "web_search"}, "tool_choice"),
        (CODEX_TOOLS, {"type": "web_search_preview"}, "tool_choice"),
        (CODEX_TOOLS, {"type": "mcp", "server_label": "docs"}, "tool_choice"),
        ([{"type": "web_search"}], "required", "tool_choice"),  # nothing left to call
        ([{"type": "custom", "name": "apply_patch"}], None, "tools[0].type"),  # a client tool we cannot parse
        ([{"type": "namespace", "tools": [SPAWN]}], None, "tools[0].name"),
        ([{"type": "namespace", "name": "n", "tools": [{"type": "function"}]}], None, "tools[0].tools[0].name"),
        (
            [{"type": "namespace", "name": "n", "tools": [SPAWN]}, {**SPAWN, "name": "n__spawn_agent"}],
            None,
            "tools[1].name",
        ),
    ],
)
def test_what_cannot_work_is_a_400_naming_it(tools, choice, param):
    body = ResponsesRequest.model_validate({"input": "Hi", "tools": tools, "tool_choice": choice})
    assert _error(responses_spec, body).param == param


def test_a_namespaced_call_goes_back_as_codex_parses_it():
    """Codex builds ToolName::new(namespace, name) from a function_call item (core/src/tools/router.rs)."""
    body = ResponsesRequest.model_validate({"input": "Hi", "tools": CODEX_TOOLS})
    builder = ResponseBuilder(
        response_head("m", echoed(body, responses_spec(body))), responses_tools(CODEX_TOOLS).call_fields
    )
    builder.start()
    events = builder.feed(
        [
            ToolCallStart(0, "call_1", "multi_agent_v1__spawn_agent"),
            ToolCallArgs(0, '{"message": "hi"}'),
            ToolCallEnd(0, {"message": "hi"}),
            Finish("tool_calls"),
        ]
    )
    item = builder.response()["output"][0]
    assert (item["type"], item["namespace"], item["name"]) == ("function_call", "multi_agent_v1", "spawn_agent")
    done = next(e for e in events if e["type"] == "response.output_item.done")
    assert done["item"]["namespace"] == "multi_agent_v1" and done["item"]["name"] == "spawn_agent"
    assert Response.model_validate(builder.response()).output[0].call_id == "call_1"


def test_a_replayed_namespaced_call_renders_under_the_flat_name():
    items = [
        {"role": "user", "content": "Go."},
        {
            "type": "function_call",
            "call_id": "c1",
            "namespace": "multi_agent_v1",
            "name": "spawn_agent",
            "arguments": '{"message": "hi"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "started"},
    ]
    messages = input_messages(items, None)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert messages[2]["name"] == "multi_agent_v1__spawn_agent"


# --- one max_tokens rule ----------------------------------------------------------------------------------------


def _state(limit=8192, default=1024, cache_bound=False):
    return SimpleNamespace(context_limit=limit, default_max_tokens=default, cache_limits_context=cache_bound)


@pytest.mark.parametrize(
    "prompt, requested, expected",
    [
        (7687, 1024, 505),  # opencode against an 8k context: clamped, not refused
        (100, 32000, 8092),
        (100, None, 1024),
        (8000, None, 192),
        (8191, 32000, 1),
        (100, 0, 0),
        (100, -3, -3),
    ],
)
def test_max_tokens_is_clamped_to_what_fits(prompt, requested, expected):
    assert reply_budget(_state(), prompt, requested, OPENAI_CHAT) == expected


def test_only_a_prompt_that_does_not_fit_is_refused_with_the_numbers_and_the_fix():
    error = _error(reply_budget, _state(), 20237, 32000, ANTHROPIC)
    assert error.status == 400 and error.code == "context_length_exceeded" and error.param == "messages"
    assert "20237 tokens" in error.message and "8192" in error.message and "max_tokens 32000" in error.message
    assert "--max-model-len 32768" in error.message and "longer context" in error.message
    assert error.prompt_tokens == 20237
    error = _error(reply_budget, _state(), 8192, None, RESPONSES)
    assert error.param == "input" and "no max_output_tokens" in error.message
    error = _error(reply_budget, _state(limit=4096, cache_bound=True), 5000, 10, OPENAI_CHAT)
    assert "KV cache capacity of 4096" in error.message and "--cache-tokens" in error.message


# --- logs a person can use ----------------------------------------------------------------------------------------


def test_grammar_warnings_name_the_tool_they_are_about():
    tools = (
        ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}}),
        ToolSpec("Edit", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}),
    )
    warning = 'Unimplemented keys: ["propertyNames"]'
    [note] = grammar_notes(ChatRequestSpec([], tools=tools), (warning,))
    assert "tool Edit" in note and "Bash" not in note and warning in note
    spec = ChatRequestSpec([], output=JsonSchemaOutput({"type": "object"}), names=RESPONSES)
    assert "text.format" in grammar_notes(spec, (warning,))[0]


def test_the_tokenizer_is_told_the_context_the_engine_runs():
    inner = SimpleNamespace(model_max_length=8192, deprecation_warnings={})
    fit_tokenizer_to_context(SimpleNamespace(_tokenizer=inner), 32768)
    assert inner.model_max_length == 32768 and inner.deprecation_warnings[LONG_SEQUENCE_WARNING]
    fit_tokenizer_to_context(SimpleNamespace(_tokenizer=inner), 4096)  # never lowered
    assert inner.model_max_length == 32768


def test_no_indexing_errors_warning_from_the_real_tokenizer():
    """The default model's tokenizer (transformers) on prompts past its trained 8192 tokens, within the engine's
    context and past it: no warning once the server has fitted it (what the context cannot hold is refused)."""
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(Path(__file__).resolve().parents[3] / "models" / "smollm2-135m-float32")
    fit_tokenizer_to_context(tokenizer, 16384)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # transformers' logger does not propagate: listen on it directly
    logging.getLogger("transformers").addHandler(handler)
    try:
        assert len(tokenizer.encode("hello " * 9000)) > 8192 and len(tokenizer.encode("hello " * 20000)) > 16384
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [r for r in records if "indexing errors" in r.getMessage()]
