"""The Responses API's tools, text.format and reasoning, checked and translated into the chat pipeline's spec.
Same rules as the chat API (tool_list, tool_choice, output_format), Responses' spellings: tools are flat
(`{"type": "function", "name", "parameters", "strict"}`), the output format lives in `text.format` with its
schema beside `name`."""

from __future__ import annotations

import json

from mlxpaged_app.server.chat.spec import EFFORTS, OutputFormat, ReasoningSpec, ToolChoice, ToolSpec
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.output_format import check_format_alone, json_output_format
from mlxpaged_app.server.tool_list import function_tools

SCHEMA_EXAMPLE = "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {<a JSON schema object>}}"


def tool_specs(tools: object) -> tuple[ToolSpec, ...]:
    specs = function_tools(tools, None, '{"type": "function", "name": ..., "parameters": ...}')
    for i, tool in enumerate(tools or []):  # Responses' tools carry `strict` beside the name
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise invalid_param(f"tools[{i}].strict", f"tools[{i}].strict must be true or false, got "
                                                      f"{tool['strict']!r}")
    return specs


def output_format(text: object) -> OutputFormat:
    """`text.format`: text (None: nothing enforced), json_object, or json_schema {name, schema, strict}."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_param("text", f"'text' must be an object such as {{\"format\": {{\"type\": \"text\"}}}}, "
                                    f"got {json.dumps(text)[:40]}")
    fmt = text.get("format")
    return None if fmt is None else json_output_format(fmt, "text.format", None, SCHEMA_EXAMPLE)


def reasoning_spec(reasoning: object) -> ReasoningSpec:
    """`reasoning.effort` reaches the chat template as `reasoning_effort` (chat/spec.py says how)."""
    if reasoning is None:
        return ReasoningSpec()
    if not isinstance(reasoning, dict):
        raise invalid_param("reasoning", f"'reasoning' must be an object such as {{\"effort\": \"low\"}}, "
                                         f"got {json.dumps(reasoning)[:40]}")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid_param("reasoning.effort", f"reasoning.effort must be one of {', '.join(EFFORTS)}, "
                                                f"got {json.dumps(effort)}")
    return ReasoningSpec(effort=effort)


def check_combination(output: OutputFormat, choice: ToolChoice) -> None:
    check_format_alone(output, choice, "text.format", "'none'")
