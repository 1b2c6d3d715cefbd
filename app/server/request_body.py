"""A request body from the wire to a typed request: read under a size limit, decode UTF-8 and JSON,
validate against a pydantic schema (protocol.py), or raise a 400 naming the offending field."""

from __future__ import annotations

import json
import re

from mlxpaged_app.server.errors import APIError, body_too_large, invalid_param

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

_TAG = re.compile(r"^[a-z_][a-z0-9_]*$")  # field names; pydantic's union tags ("list[str]", "Message") are not
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or 413 as soon as it is known to exceed `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def decode_json(raw: bytes) -> dict:
    """The body as a JSON object, or 400 saying what is wrong with it."""
    if not raw.strip():
        raise invalid_param(None, "the request body is empty; send a JSON object", "invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_param(
            None,
            f"the request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
            "invalid_encoding",
        ) from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise invalid_param(
            None,
            f"malformed JSON in the request body: {exc.msg} at line {exc.lineno} column {exc.colno}",
            "invalid_json",
        ) from None
    except ValueError as exc:  # NaN / Infinity, or a number too deep to parse
        raise invalid_param(None, f"malformed JSON in the request body: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid_param(
            None, f"the request body must be a JSON object, got a JSON {type(data).__name__}", "invalid_json"
        )
    return data


def error_param(loc: tuple) -> str | None:
    """`messages[1].role` from pydantic's location ('messages', 1, 'role'), union tags dropped."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _TAG.match(part) and part not in _TYPE_TAGS:
            text += f".{part}" if text else part
    return text or None


def _describe(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False)[0]
    param = error_param(first["loc"])
    if first["type"] == "missing":
        return invalid_param(param, f"'{param}' is required", "missing_required_parameter")
    got = f" (got {_describe(first['input'])})" if "input" in first else ""
    return invalid_param(param, f"invalid '{param}': {first['msg']}{got}", "invalid_type")


def parse_request(raw: bytes, model: type[BaseModel]):
    """Decode and type-check one request body into `model`, or raise a 400 APIError."""
    data = decode_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
