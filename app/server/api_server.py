"""`mlxpaged serve`: an OpenAI-compatible HTTP API over one `Engine`.

Why Starlette (on uvicorn) rather than FastAPI: what FastAPI adds is automatic body parsing,
422 validation errors and OpenAPI docs, and this API needs all three done differently — bodies
read under a size limit and decoded with our own UTF-8 / JSON errors, every error in OpenAI's
shape with status 400 and the offending `param`, and no extra public routes. Starlette gives the
routing, middleware and streaming that FastAPI itself is built on, with nothing to override;
pydantic (already a FastAPI dependency) still types the request bodies (openai_schemas).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
GET /metrics. Modules: openai_schemas / openai_params (requests), openai_serving (the shared
flow), openai_chat / openai_completions (the two shapes), openai_engine (admission and engine
events), openai_sse (streaming with disconnect), openai_metrics, openai_errors, openai_runner
(the process: signals, uvicorn, printing the plan).
"""

from __future__ import annotations

import hmac

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxpaged_app.server.serving_chat import ChatEndpoint
from mlxpaged_app.server.serving_completion import CompletionEndpoint
from mlxpaged_app.server.errors import (APIError, handle_api_error, handle_http_exception, handle_unexpected,
                                        model_not_found, unauthorized)
from mlxpaged_app.server.metrics import CONTENT_TYPE
from mlxpaged_app.server.serving import ServerConfig, ServerState, serve_generation

__all__ = ["ServerConfig", "ServerState", "create_app"]

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def chat_completions(request: Request) -> Response:
    return await serve_generation(request, _state(request), ChatEndpoint)


async def completions(request: Request) -> Response:
    return await serve_generation(request, _state(request), CompletionEndpoint)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "mlxpaged",
            "max_model_len": state.context_limit}


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


async def get_model(request: Request) -> Response:
    state = _state(request)
    model_id = request.path_params["model_id"]
    if model_id not in state.model_names:
        raise model_not_found(model_id, [state.model_id])
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    """200 while the server takes requests; 503 once it is draining for shutdown."""
    state = _state(request)
    stats = state.engine.stats()
    body = {"status": "draining" if state.draining else "ok", "model": state.model_id,
            "requests_in_flight": state.admission.in_flight, "requests_running": stats["requests_running"],
            "requests_waiting": stats["requests_waiting"], "blocks_used": stats["blocks_used"],
            "blocks_free": stats["blocks_free"], "blocks_total": stats["blocks_total"]}
    return JSONResponse(body, status_code=503 if state.draining else 200)


async def metrics(request: Request) -> Response:
    state = _state(request)
    text = state.metrics.render(state.engine.stats(), state.admission.in_flight, state.admission.capacity)
    return Response(text, media_type=CONTENT_TYPE)


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer <key>` when a key is set."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            problem = self._problem(Headers(scope=scope).get("authorization"))
            if problem is not None:
                await unauthorized(problem).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _problem(self, header: str | None) -> str | None:
        if not header:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "malformed Authorization header: expected 'Bearer <key>'"
        if not hmac.compare_digest(token.strip().encode(), self.key):
            return "incorrect API key"
        return None


class StatusCountMiddleware:
    """Counts responses by route and status for /metrics (unknown paths pooled as "other")."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.state.metrics.count_request(route, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def _middleware(state: ServerState) -> list[Middleware]:
    stack = []
    if state.config.cors_origins:  # none unless asked for: browsers on other origins get no access
        stack.append(Middleware(CORSMiddleware, allow_origins=list(state.config.cors_origins),
                                allow_methods=["GET", "POST", "OPTIONS"],
                                allow_headers=["Authorization", "Content-Type"]))
    stack.append(Middleware(StatusCountMiddleware, state=state))
    if state.config.api_key:
        stack.append(Middleware(APIKeyMiddleware, api_key=state.config.api_key))
    return stack


def create_app(engine, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app over a loaded `Engine`; the caller owns the engine (and closes it)."""
    state = ServerState(engine, config or ServerConfig())
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {APIError: handle_api_error, HTTPException: handle_http_exception, Exception: handle_unexpected}
    app = Starlette(routes=routes, middleware=_middleware(state), exception_handlers=handlers)
    app.state.server = state
    return app
