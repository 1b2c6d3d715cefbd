"""A Responses request's `tools` as Codex and other agents send them: function tools as they are, `namespace`
tools flattened to their function tools, and hosted tools (which OpenAI runs on its side: web search, file
search, ...) dropped - this server cannot run them, and a 400 would stop the agent over a tool the model can
do without. A tool_choice that forces a hosted tool stays a 400: the client asked for something that cannot
happen.

A namespaced tool reaches the model under one flat name (Codex's own: `namespace__name`); a call of it goes
back as Codex parses one, `{"type": "function_call", "namespace": ..., "name": <the tool's own name>}`, and a
replayed call with a namespace renders under the flat name again, so the next prompt extends the last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mlxpaged_app.server.chat.spec import ToolSpec
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.tool_list import MAX_TOOLS, check_unique_names, function_tool

SHAPE = '{"type": "function", "name": ..., "parameters": ...}'
NAMESPACE_SHAPE = '{"type": "namespace", "name": ..., "tools": [<function tools>]}'
# Tools OpenAI runs itself; the prefixes cover dated variants (web_search_preview_2025_03_11, ...).
HOSTED_PREFIXES = ("web_search", "file_search", "code_interpreter", "image_generation", "computer_use", "mcp")


def is_hosted(kind: object) -> bool:
    return isinstance(kind, str) and kind.startswith(HOSTED_PREFIXES)


def flat_name(namespace: str, name: str) -> str:
    """What the model calls a namespaced tool: Codex's canonical flat name (its `ToolName::canonical_flat_name`:
    stray underscores around the `__` trimmed)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


@dataclass(frozen=True)
class ResponsesTools:
    specs: tuple[ToolSpec, ...] = ()
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat name -> (namespace, name)
    dropped: tuple[str, ...] = ()  # the hosted tools left out, as "tools[7] (web_search)"

    def call_fields(self, flat: str) -> dict:
        """A function_call item's name fields for a call of `flat`, as Codex reads them."""
        if flat not in self.namespaced:
            return {"name": flat}
        namespace, name = self.namespaced[flat]
        return {"namespace": namespace, "name": name}


def responses_tools(tools: object) -> ResponsesTools:
    """The function tools the model sees; a 400 names the tool at fault (`tools[4].tools[1].name`)."""
    if tools is None:
        return ResponsesTools()
    if not isinstance(tools, list):
        raise invalid_param("tools", f"'tools' must be a list of {SHAPE} objects, got a JSON {type(tools).__name__}")
    specs: list[ToolSpec] = []
    wheres: list[str] = []
    namespaced: dict[str, tuple[str, str]] = {}
    dropped: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if is_hosted(kind):
            dropped.append(f"{where} ({kind})")
        elif kind == "namespace":
            for j, (spec, namespace, name) in enumerate(_namespace_tools(tool, where)):
                specs.append(spec)
                wheres.append(f"{where}.tools[{j}]")
                namespaced[spec.name] = (namespace, name)
        else:
            _check_strict(tool, where)
            specs.append(function_tool(tool, where, None, SHAPE))
            wheres.append(where)
    if len(specs) > MAX_TOOLS:
        raise invalid_param(
            "tools", f"'tools' holds {len(specs)} function tools (namespaces flattened); at most {MAX_TOOLS}"
        )
    check_unique_names(specs, wheres)
    return ResponsesTools(tuple(specs), namespaced, tuple(dropped))


def _namespace_tools(tool: dict, where: str) -> list[tuple[ToolSpec, str, str]]:
    namespace, children = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace:
        raise invalid_param(f"{where}.name", f"{where}: a namespace tool needs a 'name' ({NAMESPACE_SHAPE})")
    if not isinstance(children, list):
        raise invalid_param(f"{where}.tools", f"{where}.tools must be a list of function tools ({NAMESPACE_SHAPE})")
    out = []
    for j, child in enumerate(children):
        at = f"{where}.tools[{j}]"
        name = child.get("name") if isinstance(child, dict) else None
        if not isinstance(name, str):
            raise invalid_param(f"{at}.name", f"{at}.name must be a string, got {json.dumps(name)[:40]}")
        _check_strict(child, at)
        spec = function_tool({**child, "name": flat_name(namespace, name)}, at, None, SHAPE)
        out.append((spec, namespace, name))
    return out


def _check_strict(tool: object, where: str) -> None:
    """Responses' function tools carry `strict` beside the name."""
    strict = tool.get("strict") if isinstance(tool, dict) else None
    if strict is not None and not isinstance(strict, bool):
        raise invalid_param(f"{where}.strict", f"{where}.strict must be true or false, got {strict!r}")


def check_choice_not_hosted(choice: object) -> None:
    """tool_choice {"type": "web_search"} (or any hosted tool) asks for a call this server cannot make."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if is_hosted(kind):
        raise invalid_param(
            "tool_choice",
            f"tool_choice forces the hosted tool {kind!r}, which this server cannot "
            "run (it runs function tools; hosted tools in 'tools' are left out); use "
            "'auto' or name a function tool",
            "unsupported_value",
        )
