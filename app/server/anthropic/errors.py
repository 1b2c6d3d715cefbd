"""Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}, "request_id"}`.

The server raises one APIError everywhere; the path decides the shape (server/errors.py), so a bad key, a body
too large or a full queue on /v1/messages* reads as Anthropic's SDK expects (its exception class is chosen by
the status code, the error type names the kind)."""

from __future__ import annotations

import uuid

PATH = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for "overloaded"; this server says 503 while it drains for shutdown


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def anthropic_status(status: int) -> int:
    return OVERLOADED if status == 503 else status


def error_type(status: int) -> str:
    """The type for a status; any other 4xx (405 wrong method) is an invalid request, 5xx an api_error."""
    return ERROR_TYPES.get(anthropic_status(status), "invalid_request_error" if status < 500 else "api_error")


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


def error_body(status: int, message: str, request_id: str | None = None) -> dict:
    return {
        "type": "error",
        "error": {"type": error_type(status), "message": message},
        "request_id": request_id or new_request_id(),
    }
