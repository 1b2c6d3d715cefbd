"""A request's `tools`, the rules every API shares: a list of at most MAX_TOOLS, names unique; each API parses
one tool in its own form - OpenAI's two APIs with `function_tool`, their function tools differing only in where
the function's fields sit."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from mlxpaged_app.server.chat.spec import ToolSpec
from mlxpaged_app.server.errors import invalid_param

MAX_TOOLS = 128  # OpenAI's and Anthropic's own limit
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule (Anthropic's has no '.')
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_list(
    tools: object, parse: Callable[[object, str], ToolSpec], *, shape: str, name_field: str
) -> tuple[ToolSpec, ...]:
    """Each tool parsed by `parse(tool, where)`. `shape` shows one tool in the API's own form; `name_field` is
    where a tool's name sits in it."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise invalid_param("tools", f"'tools' must be a list of {shape} objects, got a JSON {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise invalid_param("tools", f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}")
    specs = [parse(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    check_unique_names(specs, [f"tools[{i}]" for i in range(len(specs))], name_field)
    return tuple(specs)


def check_unique_names(specs: list[ToolSpec], wheres: list[str], name_field: str = "name") -> None:
    """400 naming the second tool of a name already used (`wheres[i]`: where specs[i] sits in the request)."""
    names = [s.name for s in specs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid_param(
                f"{wheres[i]}.{name_field}",
                f"{wheres[i]}: the name {name!r} is already used by "
                f"{wheres[names.index(name)]}; tool names must be unique",
            )


def function_tools(tools: object, nested: str | None, shape: str) -> tuple[ToolSpec, ...]:
    """OpenAI's function tools: the function's name, description and parameters under `nested` (chat's
    "function") or beside the type (Responses: None). `shape` shows one tool in the API's form."""
    name_field = "name" if nested is None else f"{nested}.name"
    return tool_list(
        tools, lambda tool, where: function_tool(tool, where, nested, shape), shape=shape, name_field=name_field
    )


def function_tool(tool: object, where: str, nested: str | None, shape: str) -> ToolSpec:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise invalid_param(
            f"{where}.type",
            f"{where}: tool type {kind!r} is not supported; this server runs function tools ({shape})",
            "unsupported_value",
        )
    fields, at = (tool, where) if nested is None else (tool.get(nested), f"{where}.{nested}")
    if not isinstance(fields, dict):
        raise invalid_param(at, f"{at} must be an object with a 'name'")
    name = fields.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise invalid_param(f"{at}.name", f"{at}.name must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r}")
    description = fields.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_param(f"{at}.description", f"{at}.description must be a string")
    return ToolSpec(name, _arguments_schema(fields.get("parameters"), f"{at}.parameters"), description)


def _arguments_schema(schema: object, where: str) -> dict:
    if schema is None:
        return EMPTY_PARAMETERS
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise invalid_param(
            where,
            f"{where} must be a JSON schema of type 'object' (the arguments object), got {json.dumps(schema)[:60]}",
        )
    return schema
