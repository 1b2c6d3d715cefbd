"""OpenAI chat's tools, tool_choice, response_format and reasoning fields, checked and translated into the chat
pipeline's spec (chat/spec.py); every 400 names the offending field and says what was expected. The rules they
share with the other APIs live in tool_list, tool_choice and output_format."""

from __future__ import annotations

from mlxpaged_app.server.chat.spec import EFFORTS, OutputFormat, ReasoningSpec, ToolChoice, ToolSpec
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.openai.protocol import ChatRequest
from mlxpaged_app.server.output_format import check_format_alone, json_output_format
from mlxpaged_app.server.tool_list import function_tools

SCHEMA_EXAMPLE = '{"json_schema": {"name": ..., "schema": {<a JSON schema object>}, "strict": ...}}'


def tool_specs(tools: object) -> tuple[ToolSpec, ...]:
    return function_tools(tools, "function", '{"type": "function", "function": {...}}')


def output_format(value: object) -> OutputFormat:
    return None if value is None else json_output_format(value, "response_format", "json_schema", SCHEMA_EXAMPLE)


def reasoning_spec(body: ChatRequest) -> ReasoningSpec:
    effort, param = body.reasoning_effort, "reasoning_effort"
    if effort is None and body.reasoning is not None:
        effort, param = body.reasoning.get("effort"), "reasoning.effort"
    if effort is not None and effort not in EFFORTS:
        raise invalid_param(param, f"{param} must be one of {', '.join(EFFORTS)}, got {effort!r}")
    return ReasoningSpec(body.enable_thinking, effort, dict(body.chat_template_kwargs or {}))


def check_combination(body: ChatRequest, output: OutputFormat, choice: ToolChoice) -> None:
    """What cannot be enforced together."""
    check_format_alone(output, choice, "response_format", "'none'")
    if body.ignore_eos and (output is not None or choice != "none"):
        raise invalid_param(
            "ignore_eos",
            "ignore_eos cannot be combined with response_format or tool calls: "
            "an enforced structure must be able to end",
        )
