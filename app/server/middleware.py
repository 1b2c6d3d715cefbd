"""The ASGI middleware around the routes: CORS, counting responses for /metrics, and the API key."""

from __future__ import annotations

import hmac

from mlxpaged_app.server.errors import error_response, unauthorized
from mlxpaged_app.server.state import ServerState

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = ("/api/version",)  # under /api/ but public: what any client probes, as `/`, /health and /metrics


def needs_key(path: str) -> bool:
    """The /v1 routes, and Ollama's /api/ routes but its version."""
    return path.startswith("/v1") or (path.startswith("/api/") and path not in OPEN_PATHS)


class APIKeyMiddleware:
    """Every /v1 and /api/ route needs the key when one is set: `Authorization: Bearer <key>` (OpenAI, Anthropic's
    SDK 2.x, the `ollama` client given that header) or `x-api-key: <key>` (Claude Code with ANTHROPIC_API_KEY,
    older Anthropic SDKs)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]) and scope["method"] != "OPTIONS":
            headers = Headers(scope=scope)
            problem = self._problem(headers.get("authorization"), headers.get("x-api-key"))
            if problem is not None:
                await error_response(unauthorized(problem), scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _problem(self, authorization: str | None, x_api_key: str | None) -> str | None:
        if not authorization and not x_api_key:
            return "missing API key: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        if x_api_key and self._matches(x_api_key):
            return None
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return "malformed Authorization header: expected 'Bearer <key>'"
            if self._matches(token):
                return None
        return "incorrect API key"

    def _matches(self, key: str) -> bool:
        return hmac.compare_digest(key.strip().encode(), self.key)


class StatusCountMiddleware:
    """Counts responses by route and status for /metrics (unknown paths pooled as "other"), and those in progress
    (`state.responses_in_progress`: a server across ranks that gives up waits for them to end, watchdog.py)."""

    def __init__(self, app: ASGIApp, state: ServerState, routes: tuple[str, ...]) -> None:
        self.app, self.state, self.routes = app, state, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = next((r for r in self.routes if path == r or path.startswith(r + "/")), "other")

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.state.metrics.count_request(route, message["status"])
            await send(message)

        self.state.responses_in_progress += 1
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.state.responses_in_progress -= 1


def middleware_stack(state: ServerState, routes: tuple[str, ...]) -> list[Middleware]:
    """Outermost first: CORS (if origins are set), status counting over `routes`, the API key (if set)."""
    stack = []
    if state.config.cors_origins:  # none unless asked for: browsers on other origins get no access
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(state.config.cors_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version", "anthropic-beta"],
            )
        )
    stack.append(Middleware(StatusCountMiddleware, state=state, routes=routes))
    if state.config.api_key:
        stack.append(Middleware(APIKeyMiddleware, api_key=state.config.api_key))
    return stack
