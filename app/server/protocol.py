"""Request bodies of the OpenAI API: read, decode, parse and type-check, or a 400 naming the field.

Types are checked strictly (a string is not a number, `true` is not 1, 1.5 is not an integer);
ranges are checked by `SamplingParams` (see openai_params). Unknown fields are ignored, as
OpenAI-compatible servers do, so newer clients keep working.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request

from mlxpaged_app.server.errors import APIError, body_too_large, invalid_param

_TAG = re.compile(r"^[a-z_][a-z0-9_]*$")  # field names; pydantic's union tags ("list[str]", "Message") are not
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None  # a string or a list of text parts: checked in openai_params with better messages
    name: str | None = None


class _GenerationFields(_Strict):
    """Fields both endpoints share. None means "not sent": the server's default applies."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Any = None  # a string or a list of strings: SamplingParams says which when it is neither
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None  # vLLM's extension; handy for benchmarks


class ChatRequest(_GenerationFields):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None


class CompletionRequest(_GenerationFields):
    prompt: Any  # a string, a list of strings, a list of token ids, or a list of such lists
    logprobs: int | None = None  # the legacy API: how many top alternatives per token
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


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
        raise invalid_param(None, f"the request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} "
                                  f"at offset {exc.start})", "invalid_encoding") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise invalid_param(None, f"malformed JSON in the request body: {exc.msg} at line {exc.lineno} "
                                  f"column {exc.colno}", "invalid_json") from None
    except ValueError as exc:  # NaN / Infinity, or a number too deep to parse
        raise invalid_param(None, f"malformed JSON in the request body: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid_param(None, f"the request body must be a JSON object, got a JSON {type(data).__name__}",
                            "invalid_json")
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


def parse_request(raw: bytes, model: type[_Strict]):
    """Decode and type-check one request body into `model`, or raise a 400 APIError."""
    data = decode_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
