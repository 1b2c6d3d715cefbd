"""One tool_choice resolver for every API. Each API spells the four choices its own way (none, auto, required or
any, one named tool); after that the rules are the same: a choice other than none needs tools, a named tool
must be among them. Errors name the API's own parameter and show the value as the client wrote it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from mlxpaged_app.server.chat.spec import NamedTool, ToolChoice, ToolSpec
from mlxpaged_app.server.errors import invalid_param

API = Literal["openai", "responses", "anthropic"]
MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class Spelling:
    """How one API writes tool_choice."""

    parse: Callable[[object], ToolChoice]  # the value as the pipeline's choice, or a 400 naming what it accepts
    shown: Callable[[object], str]  # the value in an error message, as the client wrote it
    name_param: str  # where a named choice's name sits
    noun: str  # what the API calls a tool
    auto_without_tools_is_none: bool = False  # Anthropic: auto with no tools just means no calls


def _openai(value: object) -> ToolChoice:
    if value in MODES:
        return value
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return NamedTool(function["name"])
    raise _unknown(value, '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}', repr)


def _responses(value: object) -> ToolChoice:
    if value in MODES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return NamedTool(value["name"])
    raise _unknown(value, "'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}", json.dumps)


def _anthropic(value) -> ToolChoice:
    """`value`: the schema's ToolChoice, whose type the schema already checked."""
    return NamedTool(value.name) if value.type == "tool" else {"any": "required"}.get(value.type, value.type)


def _unknown(value: object, accepted: str, shown: Callable[[object], str]):
    return invalid_param("tool_choice", f"tool_choice must be {accepted}, got {shown(value)[:60]}")


SPELLINGS: dict[str, Spelling] = {
    "openai": Spelling(_openai, repr, "tool_choice", "function"),
    "responses": Spelling(_responses, json.dumps, "tool_choice", "function"),
    "anthropic": Spelling(
        _anthropic, lambda v: f'{{"type": {v.type!r}}}', "tool_choice.name", "tool", auto_without_tools_is_none=True
    ),
}


def resolve_tool_choice(value: object, tools: tuple[ToolSpec, ...], api: API) -> ToolChoice:
    """The pipeline's choice for a request's `tool_choice` (None: not sent) and `tools`."""
    if value is None:
        return "auto" if tools else "none"
    spelling = SPELLINGS[api]
    choice = spelling.parse(value)
    if choice == "auto" and not tools and spelling.auto_without_tools_is_none:
        return "none"
    if choice != "none" and not tools:
        raise invalid_param(
            "tool_choice", f"tool_choice {spelling.shown(value)} needs 'tools', and the request has none"
        )
    names = [t.name for t in tools]
    if isinstance(choice, NamedTool) and choice.name not in names:
        raise invalid_param(
            spelling.name_param,
            f"tool_choice names the {spelling.noun} {choice.name!r}, which is not among the tools: {', '.join(names)}",
        )
    return choice
