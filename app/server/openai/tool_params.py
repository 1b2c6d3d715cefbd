"""OpenAI chat's tools, tool_choice, response_format and reasoning fields, checked and translated into the
chat pipeline's spec (chat/spec.py); every 400 names the offending field and says what was expected."""

from __future__ import annotations

import re

from mlxpaged_app.server.chat.spec import (JsonObjectOutput, JsonSchemaOutput, NamedTool, OutputFormat,
                                           ReasoningSpec, ToolChoice, ToolSpec)
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.openai.protocol import ChatRequest

MAX_TOOLS = 128  # OpenAI's own limit
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CHOICES = "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"


def tool_specs(tools: object) -> tuple[ToolSpec, ...]:
    return tool_list(tools, _tool, shape='{"type": "function", "function": {...}}', name_field="function.name")


def tool_list(tools: object, parse, *, shape: str, name_field: str) -> tuple[ToolSpec, ...]:
    """A request's `tools`: a list of at most MAX_TOOLS, each parsed by `parse(tool, where)`, names unique.
    `shape` shows one tool in the API's own form; `name_field` is where a tool's name sits in it."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise invalid_param("tools", f"'tools' must be a list of {shape} objects, got a JSON {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise invalid_param("tools", f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}")
    specs = [parse(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [s.name for s in specs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid_param(f"tools[{i}].{name_field}", f"tools[{i}]: the name {name!r} is already used by "
                                                            f"tools[{names.index(name)}]; tool names must be unique")
    return tuple(specs)


def _tool(tool: object, where: str) -> ToolSpec:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise invalid_param(f"{where}.type", f"{where}: tool type {kind!r} is not supported; this server runs "
                                             "function tools ({\"type\": \"function\", ...})", "unsupported_value")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid_param(f"{where}.function", f"{where}.function must be an object with a 'name'")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise invalid_param(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, "
                                                      f"'_', '.' or '-', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_param(f"{where}.function.description", f"{where}.function.description must be a string")
    return ToolSpec(name, _parameters(function.get("parameters"), f"{where}.function.parameters"), description)


def _parameters(schema: object, where: str) -> dict:
    if schema is None:
        return EMPTY_PARAMETERS
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise invalid_param(where, f"{where} must be a JSON schema of type 'object' (the arguments object), "
                                   f"got {str(schema)[:60]}")
    return schema


def tool_choice(value: object, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid_param("tool_choice", f"tool_choice must be {CHOICES}, got {value!r}")
        choice: ToolChoice = value
    else:
        choice = _named(value)
    if choice != "none" and not tools:
        raise invalid_param("tool_choice", f"tool_choice {value!r} needs 'tools', and the request has none")
    if isinstance(choice, NamedTool) and choice.name not in [t.name for t in tools]:
        raise invalid_param("tool_choice", f"tool_choice names the function {choice.name!r}, which is not among "
                                           f"the tools: {', '.join(t.name for t in tools)}")
    return choice


def _named(value: object) -> NamedTool:
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid_param("tool_choice", f"tool_choice must be {CHOICES}, got {str(value)[:60]}")
    return NamedTool(function["name"])


def output_format(value: object) -> OutputFormat:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObjectOutput()
    if kind != "json_schema":
        raise invalid_param("response_format", f"response_format type {kind!r} is not supported; use 'text', "
                                               "'json_object' or 'json_schema'", "unsupported_value")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise invalid_param("response_format.json_schema.schema", "response_format json_schema needs "
                            "{\"json_schema\": {\"name\": ..., \"schema\": {<a JSON schema object>}, \"strict\": ...}}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_param("response_format.json_schema.strict", "response_format.json_schema.strict must be "
                                                                  f"true or false, got {strict!r}")
    return JsonSchemaOutput(schema, bool(strict), spec.get("name"))


def reasoning_spec(body: ChatRequest) -> ReasoningSpec:
    effort, param = body.reasoning_effort, "reasoning_effort"
    if effort is None and body.reasoning is not None:
        effort, param = body.reasoning.get("effort"), "reasoning.effort"
    if effort is not None and effort not in EFFORTS:
        raise invalid_param(param, f"{param} must be one of {', '.join(EFFORTS)}, got {effort!r}")
    return ReasoningSpec(body.enable_thinking, effort, dict(body.chat_template_kwargs or {}))


def check_combination(body: ChatRequest, output: OutputFormat, choice: ToolChoice) -> None:
    """What cannot be enforced together."""
    if output is not None and choice != "none":
        raise invalid_param("response_format", "response_format with tools is not supported: send tool_choice "
                                               "'none' (the reply then follows response_format), or no "
                                               "response_format", "unsupported_value")
    if body.ignore_eos and (output is not None or choice != "none"):
        raise invalid_param("ignore_eos", "ignore_eos cannot be combined with response_format or tool calls: "
                                          "an enforced structure must be able to end")
