"""The Responses API's text.format and reasoning, checked and translated into the chat pipeline's spec (tools:
tools.py). Same rules as the chat API (output_format), Responses' spellings: the output format lives in
`text.format` with its schema beside `name`."""

from __future__ import annotations

import json

from mlxpaged_app.server.chat.spec import EFFORTS, OutputFormat, ReasoningSpec, ToolChoice
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.output_format import check_format_alone, json_output_format

SCHEMA_EXAMPLE = '{"type": "json_schema", "name": ..., "schema": {<a JSON schema object>}}'


def output_format(text: object) -> OutputFormat:
    """`text.format`: text (None: nothing enforced), json_object, or json_schema {name, schema, strict}."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_param(
            "text", f'\'text\' must be an object such as {{"format": {{"type": "text"}}}}, got {json.dumps(text)[:40]}'
        )
    fmt = text.get("format")
    return None if fmt is None else json_output_format(fmt, "text.format", None, SCHEMA_EXAMPLE)


def reasoning_spec(reasoning: object) -> ReasoningSpec:
    """`reasoning.effort` reaches the chat template as `reasoning_effort` (chat/spec.py says how)."""
    if reasoning is None:
        return ReasoningSpec()
    if not isinstance(reasoning, dict):
        raise invalid_param(
            "reasoning",
            f'\'reasoning\' must be an object such as {{"effort": "low"}}, got {json.dumps(reasoning)[:40]}',
        )
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid_param(
            "reasoning.effort", f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {json.dumps(effort)}"
        )
    return ReasoningSpec(effort=effort)


def check_combination(output: OutputFormat, choice: ToolChoice) -> None:
    check_format_alone(output, choice, "text.format", "'none'")
