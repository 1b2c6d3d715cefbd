"""A structured-output format as OpenAI's APIs spell it (chat's `response_format`, Responses' `text.format`): text
(nothing enforced), json_object, or json_schema with its schema, name and strict flag. The rule every API shares:
a format cannot be enforced together with tool calls."""

from __future__ import annotations

from mlxpaged_app.server.chat.spec import JsonObjectOutput, JsonSchemaOutput, OutputFormat, ToolChoice
from mlxpaged_app.server.errors import invalid_param


def json_output_format(fmt: object, param: str, nested: str | None, example: str) -> OutputFormat:
    """`fmt`: the format object sent as `param`; its schema, name and strict sit under `nested` (chat's
    "json_schema") or beside its type (None). `example` shows a json_schema format in the API's own form."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObjectOutput()
    if kind != "json_schema":
        raise invalid_param(
            param,
            f"{param} type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
            "unsupported_value",
        )
    spec = fmt if nested is None else fmt.get(nested)
    where = param if nested is None else f"{param}.{nested}"
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise invalid_param(f"{where}.schema", f"{param} json_schema needs {example}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_param(f"{where}.strict", f"{where}.strict must be true or false, got {strict!r}")
    return JsonSchemaOutput(schema, bool(strict), spec.get("name"))


def check_format_alone(output: OutputFormat, choice: ToolChoice, param: str, choice_none: str) -> None:
    """A format whose grammar covers the whole reply leaves no room for tool calls. `choice_none` shows
    tool_choice "none" as the API writes it."""
    if output is not None and choice != "none":
        raise invalid_param(
            param,
            f"{param} with tools is not supported: send tool_choice {choice_none} (the "
            f"reply then follows {param}), or no {param}",
            "unsupported_value",
        )
