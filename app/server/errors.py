"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause is raised as an `APIError` somewhere in the request path and
turned into JSON here, so the server never answers 500 to a client mistake. On /v1/messages* the
same error is answered in Anthropic's shape, under /api/ in Ollama's (`error_response` picks by path).
"""

from __future__ import annotations

from mlxpaged_app.server.anthropic.errors import anthropic_status, error_body, is_anthropic_path, new_request_id
from mlxpaged_app.server.ollama import errors as ollama
from mlxpaged_app.server.server_log import log

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    """An error answered to the client as OpenAI does: status, message, type, param and code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}
        self.prompt_tokens: int | None = None  # set where the prompt's length is known: the refusal's log line says it

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_response(exc: APIError, path: str) -> JSONResponse:
    """The error in the shape of the API the path belongs to; a refusal (4xx) gets its log line."""
    if exc.status < 500:
        log_refusal(exc, path)
    if ollama.is_ollama_path(path):
        return JSONResponse(ollama.error_body(exc.message), status_code=exc.status, headers=exc.headers)
    if not is_anthropic_path(path):
        return exc.response()
    request_id = new_request_id()
    return JSONResponse(
        error_body(exc.status, exc.message, request_id),
        status_code=anthropic_status(exc.status),
        headers={**exc.headers, "request-id": request_id},
    )


def invalid_param(param: str | None, message: str, code: str | None = None) -> APIError:
    """400 for a parameter the client got wrong; `message` says which and why."""
    return APIError(400, message, param=param, code=code or "invalid_value")


def model_not_found(requested: str, served: list[str]) -> APIError:
    return APIError(
        404,
        f"The model '{requested}' does not exist on this server; it serves: {', '.join(served)}",
        param="model",
        code="model_not_found",
    )


def embedding_model_only(model: str) -> APIError:
    return APIError(
        400,
        f"The model '{model}' is an embedding model: this server answers /v1/embeddings and /api/embed with it, "
        "not chat, completions, messages or responses",
        param="model",
        code="model_not_supported",
    )


def not_an_embedding_model(model: str, reason: str) -> APIError:
    return APIError(400, f"The model '{model}' cannot embed: {reason}", param="model", code="model_not_supported")


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"request body exceeds the server's limit of {limit:,} bytes (set by `mlxpaged serve --max-body-size`)",
        code="request_too_large",
    )


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def queue_full(in_flight: int, capacity: int, retry_after: int) -> APIError:
    return APIError(
        429,
        f"the server is at capacity ({in_flight} requests in flight, limit {capacity}); retry after {retry_after} s",
        type="rate_limit_exceeded",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="unavailable", headers={"Retry-After": "5"})


def model_memory_refused(message: str) -> APIError:
    """A model that cannot fit the memory budget even after unloading idle models: 503, the numbers in `message`."""
    return APIError(503, message, type="service_unavailable", param="model", code="insufficient_memory")


def model_load_failed(name: str, reason: str) -> APIError:
    """The model's files are there but loading them failed (a corrupt or unsupported directory): the server's
    problem, not the request's; other models keep serving."""
    return APIError(
        500, f"model {name!r} failed to load: {reason}", type="server_error", param="model", code="model_load_failed"
    )


def adapter_load_failed(name: str, reason: str) -> APIError:
    """An adapter in the model store cannot be served (corrupt files, or not fitting its model): the server's problem,
    not the request's; the model and its other adapters keep serving."""
    return APIError(
        500,
        f"adapter {name!r} cannot be served: {reason}",
        type="server_error",
        param="model",
        code="adapter_load_failed",
    )


def model_still_loading(name: str, waited: float) -> APIError:
    return APIError(
        503,
        f"model {name!r} is still loading after {waited:g} s (`mlxpaged serve --load-timeout`); retry shortly",
        type="service_unavailable",
        param="model",
        code="model_loading",
        headers={"Retry-After": "10"},
    )


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def log_refusal(exc: APIError, path: str) -> None:
    """One line per refused request: the endpoint, the status and code, the parameter, the prompt's length when
    known, and the message the client got (so the log says why, not just "400 Bad Request")."""
    where = f" param={exc.param}" if exc.param else ""
    prompt = f" prompt_tokens={exc.prompt_tokens}" if exc.prompt_tokens is not None else ""
    log.info("refused %s: %d %s%s%s: %s", path, exc.status, exc.code or exc.type, where, prompt, exc.message)


async def handle_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def handle_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own 404 / 405 in the API's error shape instead of plain text."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    error = APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
    return error_response(error, request.url.path)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not a client mistake: 500 in the API's error shape (Starlette still logs the traceback)."""
    error = server_error(f"internal error while serving {request.url.path}: {type(exc).__name__}")
    return error_response(error, request.url.path)
