"""How a model writes tool calls: its markers, how its call text parses (mlx-lm's own tool parsers), and
the JSON schema of its calls, from which chat/structure.py builds the grammar that enforces them.

Two formats can be enforced: the generic fallback (templates without tool support, e.g. the default
SmolLM2's: `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`, a JSON list, parsed by
mlx-lm's json_tools parser) and json_tools itself (Hermes / Qwen: one `<tool_call>\\n{...}\\n</tool_call>` per
call). Other native formats (XML-ish qwen3_coder, glm47, ...) are parsed but cannot be grammar-constrained:
a JSON grammar would contradict what the model was trained to write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from mlxpaged_app.server.chat.spec import NamedTool, ToolChoice, ToolSpec

from mlx_lm.tool_parsers import json_tools

GENERIC = "generic"


@dataclass(frozen=True)
class ToolFormat:
    name: str  # GENERIC, or the mlx-lm tool parser's module name
    start: str
    end: str  # "" when a call runs to the end of the reply (mistral)
    parse: Callable  # mlx-lm's parse_tool_call(text, tools) -> dict | list[dict]
    layout: Literal["list", "object"] | None  # JSON between the markers; None: not JSON (no grammar)

    @property
    def enforceable(self) -> bool:
        return self.layout is not None

    def grammar_markers(self) -> tuple[str, str]:
        """(begin, end) around the JSON as the model writes them (Hermes puts the JSON on its own line)."""
        if self.layout == "object":
            return self.start + "\n", "\n" + self.end
        return self.start, self.end

    def calls_schema(self, tools: tuple[ToolSpec, ...], choice: ToolChoice, parallel: bool) -> dict:
        """The JSON between the markers: one call object, or a list of them (at most one unless parallel)."""
        chosen = [t for t in tools if not isinstance(choice, NamedTool) or t.name == choice.name]
        calls = [_call_schema(t) for t in chosen]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.layout == "object":
            return one
        return {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def _call_schema(tool: ToolSpec) -> dict:
    """Key order name, then arguments: the grammar forces schema order, json.dumps keeps it."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


GENERIC_FORMAT = ToolFormat(
    GENERIC, json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, "list"
)


def tool_format(tokenizer) -> ToolFormat:
    """The model's own format when mlx-lm found a parser for its template, else the generic fallback."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return GENERIC_FORMAT
    name = tokenizer.init_kwargs.get("tool_parser_type") or "native"
    # tokenizer.tool_parser is mlx_lm.tool_parsers.<name>.parse_tool_call, chosen by mlx-lm at load.
    return ToolFormat(
        name,
        tokenizer.tool_call_start,
        tokenizer.tool_call_end or "",
        tokenizer.tool_parser,
        "object" if name == "json_tools" else None,
    )
