"""The Responses API's tools, tool_choice, text.format and reasoning, checked and translated into the chat
pipeline's spec. Same rules as the chat API (tool_params.py), Responses' spellings: tools are flat
(`{"type": "function", "name", "parameters", "strict"}`), a named choice is `{"type": "function", "name"}`,
the output format lives in `text.format` with its schema beside `name`."""

from __future__ import annotations

import json

from mlxpaged_app.server.chat.spec import (JsonObjectOutput, JsonSchemaOutput, NamedTool, OutputFormat,
                                           ReasoningSpec, ToolChoice, ToolSpec)
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.openai.tool_params import EFFORTS, EMPTY_PARAMETERS, TOOL_NAME, tool_list

CHOICES = "'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}"


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


def tool_choice(value: object, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        choice: ToolChoice = value
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        choice = NamedTool(value["name"])
    else:
        raise invalid_param("tool_choice", f"tool_choice must be {CHOICES}, got {json.dumps(value)[:60]}")
    if choice != "none" and not tools:
        raise invalid_param("tool_choice", f"tool_choice {json.dumps(value)} needs 'tools', and the request has none")
    if isinstance(choice, NamedTool) and choice.name not in [t.name for t in tools]:
        raise invalid_param("tool_choice", f"tool_choice names the function {choice.name!r}, which is not among "
                                           f"the tools: {', '.join(t.name for t in tools)}")
    return choice


def output_format(text: object) -> OutputFormat:
    """`text.format`: text (None: nothing enforced), json_object, or json_schema {name, schema, strict}."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_param("text", f"'text' must be an object such as {{\"format\": {{\"type\": \"text\"}}}}, "
                                    f"got {json.dumps(text)[:40]}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObjectOutput()
    if kind != "json_schema":
        raise invalid_param("text.format", f"text.format type {kind!r} is not supported; use 'text', "
                                           "'json_object' or 'json_schema'", "unsupported_value")
    if not isinstance(fmt.get("schema"), dict):
        raise invalid_param("text.format.schema", "text.format json_schema needs {\"type\": \"json_schema\", "
                                                  "\"name\": ..., \"schema\": {<a JSON schema object>}}")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_param("text.format.strict", f"text.format.strict must be true or false, got {strict!r}")
    return JsonSchemaOutput(fmt["schema"], bool(strict), fmt.get("name"))


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
    if output is not None and choice != "none":
        raise invalid_param("text.format", "text.format json with tools is not supported: send tool_choice "
                                           "'none' (the reply then follows text.format), or no text.format",
                            "unsupported_value")
