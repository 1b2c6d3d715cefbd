"""A request's `tools`, the rules every API shares: a list of at most MAX_TOOLS, names unique; each API parses
one tool in its own form."""

from __future__ import annotations

import re
from typing import Callable

from mlxpaged_app.server.chat.spec import ToolSpec
from mlxpaged_app.server.errors import invalid_param

MAX_TOOLS = 128  # OpenAI's and Anthropic's own limit
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule (Anthropic's has no '.')
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_list(tools: object, parse: Callable[[object, str], ToolSpec], *, shape: str,
              name_field: str) -> tuple[ToolSpec, ...]:
    """Each tool parsed by `parse(tool, where)`. `shape` shows one tool in the API's own form; `name_field` is
    where a tool's name sits in it."""
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
