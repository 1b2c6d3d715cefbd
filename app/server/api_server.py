"""The ASGI app of `mlxpaged serve`: routes, middleware and error handlers over one `Engine`.

Why Starlette (on uvicorn) rather than FastAPI: what FastAPI adds is automatic body parsing,
422 validation errors and OpenAPI docs, and this API needs all three done differently — bodies
read under a size limit and decoded with our own UTF-8 / JSON errors, every error in its API's
shape (OpenAI's with status 400 and the offending `param`, Anthropic's on /v1/messages), and no
extra public routes. Starlette gives the routing, middleware and streaming that FastAPI itself is
built on, with nothing to override; pydantic (already a FastAPI dependency) still types the request
bodies (protocol.py).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/messages[/count_tokens] (Anthropic),
POST /v1/responses, POST /v1/embeddings, GET /v1/models[/{id}], GET /health, GET /metrics, and Ollama's: POST
/api/chat, POST /api/generate, POST /api/embed, GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, GET /
(HEAD too where GET is). The package's other modules are listed in its __init__.
"""

from __future__ import annotations

from mlxpaged_app.server.anthropic.serving import serve_count_tokens, serve_messages
from mlxpaged_app.server.embeddings.ollama_embed import serve_ollama_embed
from mlxpaged_app.server.embeddings.openai_embeddings import serve_embeddings
from mlxpaged_app.server.errors import (
    APIError,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
    model_not_found,
)
from mlxpaged_app.server.metrics import CONTENT_TYPE
from mlxpaged_app.server.middleware import middleware_stack
from mlxpaged_app.server.ollama import serving as ollama
from mlxpaged_app.server.openai.serving_chat import serve_chat
from mlxpaged_app.server.openai.serving_completion import serve_completion
from mlxpaged_app.server.responses.serving import serve_responses
from mlxpaged_app.server.state import ServerConfig, ServerState

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

__all__ = ["ServerConfig", "ServerState", "create_app"]

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/embeddings",
    "/api/embed",
    "/v1/models",
    "/health",
    "/metrics",
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/ps",
    "/api/version",
    "/",
)


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def chat_completions(request: Request) -> Response:
    return await serve_chat(request, _state(request))


async def responses(request: Request) -> Response:
    return await serve_responses(request, _state(request))


async def completions(request: Request) -> Response:
    return await serve_completion(request, _state(request))


async def embeddings(request: Request) -> Response:
    return await serve_embeddings(request, _state(request))


async def ollama_embed(request: Request) -> Response:
    return await serve_ollama_embed(request, _state(request))


async def messages(request: Request) -> Response:
    return await serve_messages(request, _state(request))


async def count_tokens(request: Request) -> Response:
    return await serve_count_tokens(request, _state(request))


async def ollama_chat(request: Request) -> Response:
    return await ollama.serve_chat(request, _state(request))


async def ollama_generate(request: Request) -> Response:
    return await ollama.serve_generate(request, _state(request))


async def ollama_tags(request: Request) -> Response:
    return await ollama.tags(request, _state(request))


async def ollama_show(request: Request) -> Response:
    return await ollama.show(request, _state(request))


async def ollama_ps(request: Request) -> Response:
    return await ollama.running(request, _state(request))


def _model_card(state: ServerState) -> dict:
    """OpenAI's model object, plus what this server applies to requests that leave sampling fields unset (for an
    embedding model: its width and pooling)."""
    card = {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "mlxpaged"}
    if state.embedder is not None:
        embedder = state.embedder
        return card | {
            "max_model_len": embedder.max_input_tokens,
            "mlxpaged": {"kind": "embedding", "dimensions": embedder.dimensions, "pooling": embedder.spec.pooling},
        }
    defaults = state.config.sampling_defaults
    return card | {
        "max_model_len": state.context_limit,
        "mlxpaged": {
            "sampling_defaults": defaults.values,
            "source": defaults.source,
            "default_max_tokens": state.default_max_tokens,
        },
    }


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
    body = {
        "status": "draining" if state.draining else "ok",
        "model": state.model_id,
        "requests_in_flight": state.admission.in_flight,
    }
    if state.engine is not None:  # an embedding model has no engine: no scheduler, no KV blocks
        stats = state.engine.stats()
        keys = ("requests_running", "requests_waiting", "blocks_used", "blocks_free", "blocks_total")
        body |= {key: stats[key] for key in keys}
    return JSONResponse(body, status_code=503 if state.draining else 200)


async def metrics(request: Request) -> Response:
    state = _state(request)
    stats = state.engine.stats() if state.engine is not None else None
    text = state.metrics.render(stats, state.admission.in_flight, state.admission.capacity)
    return Response(text, media_type=CONTENT_TYPE)


def create_app(served, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app over a loaded `Engine`, or an `Embedder` (an embedding model: the embedding routes answer, the
    generative ones refuse); the caller owns it (and closes it)."""
    state = ServerState(served, config or ServerConfig())
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/api/embed", ollama_embed, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/api/chat", ollama_chat, methods=["POST"]),
        Route("/api/generate", ollama_generate, methods=["POST"]),
        Route("/api/tags", ollama_tags, methods=["GET"]),  # Starlette answers HEAD wherever GET is
        Route("/api/show", ollama_show, methods=["POST"]),
        Route("/api/ps", ollama_ps, methods=["GET"]),
        Route("/api/version", ollama.version, methods=["GET"]),
        Route("/", ollama.root, methods=["GET"]),
    ]
    handlers = {APIError: handle_api_error, HTTPException: handle_http_exception, Exception: handle_unexpected}
    app = Starlette(routes=routes, middleware=middleware_stack(state, ROUTES), exception_handlers=handlers)
    app.state.server = state
    return app
