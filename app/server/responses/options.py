"""The Responses API's tools, text.format and reasoning, checked and translated into the chat pipeline's spec.
Same rules as the chat API (tool_list, tool_choice, output_format), Responses' spellings: tools are flat
(`{"type": "function", "name", "parameters", "strict"}`), the output format lives in `text.format` with its
schema beside `name`."""

from __future__ import annotations

import json

from mlxpaged_app.server.chat.spec import EFFORTS, OutputFormat, ReasoningSpec, ToolChoice, ToolSpec
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.output_format import check_format_alone, json_output_format
from mlxpaged_app.server.tool_list import EMPTY_PARAMETERS, TOOL_NAME, tool_list

SCHEMA_EXAMPLE = "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {<a JSON schema object>}}"


def tool_specs(tools: object) -> tuple[ToolSpec, ...]:
    return tool_list(tools, _tool, shape='{"type": "function", "name": ..., "parameters": ...}', name_field="name")


def _tool(tool: object, where: str) -> ToolSpec:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise invalid_param(f"{where}.type", f"{where}: tool type {kind!r} is not supported; this server runs "
                                             "function tools ({\"type\": \"function\", \"name\": ...}) only",
                            "unsupported_value")
    name = tool.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise invalid_param(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, '_', '.' or '-', "
                                             f"got {name!r}")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_param(f"{where}.description", f"{where}.description must be a string")
    if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
        raise invalid_param(f"{where}.strict", f"{where}.strict must be true or false, got {tool['strict']!r}")
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise invalid_param(f"{where}.parameters", f"{where}.parameters must be a JSON schema of type 'object' "
                                                   f"(the arguments object), got {json.dumps(parameters)[:60]}")
    return ToolSpec(name, parameters, description)


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
