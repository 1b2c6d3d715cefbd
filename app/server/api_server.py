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
(HEAD too where GET is). The package's other modules are listed in its __init__. A route gets its model through
`await state.served_model(name)` (state.py), which loads it if needed.
"""

from __future__ import annotations

from mlxpaged_app.server.adapter_catalog import AdapterTarget
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
from mlxpaged_app.server.metrics_render import render_metrics
from mlxpaged_app.server.middleware import middleware_stack
from mlxpaged_app.server.model_catalog import CatalogEntry, ModelNotServable
from mlxpaged_app.server.model_registry import ModelRegistry, single_model_registry
from mlxpaged_app.server.ollama import serving as ollama
from mlxpaged_app.server.openai.serving_chat import serve_chat
from mlxpaged_app.server.openai.serving_completion import serve_completion
from mlxpaged_app.server.responses.serving import serve_responses
from mlxpaged_app.server.state import ServerConfig, ServerState

import anyio
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


def _model_card(state: ServerState, entry: CatalogEntry) -> dict:
    """OpenAI's model object; `mlxpaged` adds its kind, whether it is loaded, its memory and requests, and for a
    loaded model what this server applies to requests that leave sampling fields unset (for an embedding model:
    its width and pooling)."""
    served = state.registry.loaded.get(entry.name)
    card = {"id": entry.name, "object": "model", "created": state.created, "owned_by": "mlxpaged"}
    kind = "embedding" if entry.kind == "embed" else "generative"
    extra: dict = {"loaded": False, "kind": kind, "description": entry.description}
    if served is not None and not served.unloaded:
        card["created"] = served.created
        card["max_model_len"] = served.context_limit
        extra = {**served.status(), "description": entry.description}
        if served.kind == "embed":
            embedder = served.embedder
            extra |= {"dimensions": embedder.dimensions, "pooling": embedder.spec.pooling}
        else:
            defaults = served.config.sampling_defaults
            extra |= {
                "sampling_defaults": defaults.values,
                "source": defaults.source,
                "default_max_tokens": served.default_max_tokens,
            }
    card["mlxpaged"] = extra
    return card


def _adapter_card(state: ServerState, adapter: AdapterTarget) -> dict:
    """An adapter as vLLM lists a LoRA module: its own id, `parent` the model it runs on, `root` its directory;
    `mlxpaged` adds where it comes from and, once attached, its type, rank and scale."""
    base = adapter.base.name
    card = {"id": adapter.name, "object": "model", "created": state.created, "owned_by": "mlxpaged"}
    card |= {"parent": base, "root": adapter.path}
    served = state.registry.loaded.get(base)
    attached = served is not None and not served.unloaded and served.engine.adapters is not None
    described = served.engine.adapters.describe().get(adapter.name) if attached else None
    source = "--lora" if adapter.given else "model store"
    extra: dict = {"kind": "adapter", "base_model": base, "source": source, "loaded": described is not None}
    card["mlxpaged"] = extra | (described or {})
    return card


def _servable(state: ServerState) -> list[CatalogEntry]:
    """Loaded models first (the default one leading), then what could be loaded."""
    loaded = [s.entry for s in state.registry.loaded.values()]
    rest = [e for e in state.registry.catalog.servable() if e.name not in state.registry.loaded]
    return sorted(loaded, key=lambda e: e.name != state.registry.default_name) + rest


async def list_models(request: Request) -> Response:
    state = _state(request)
    entries = await anyio.to_thread.run_sync(_servable, state)  # reads the store: off the event loop
    cards = [_model_card(state, e) for e in entries]
    adapters = await anyio.to_thread.run_sync(state.registry.catalog.adapters.listed)  # reads the store too
    cards += [_adapter_card(state, adapter) for adapter in adapters]
    return JSONResponse({"object": "list", "data": cards})


async def get_model(request: Request) -> Response:
    """A model a request may name, loaded or not (asking does not load it)."""
    state = _state(request)
    model_id = request.path_params["model_id"]
    target = await anyio.to_thread.run_sync(state.registry.catalog.adapters.target, model_id)
    if target is not None:
        return JSONResponse(_adapter_card(state, target))
    served = state.registry.find_loaded(model_id)
    if served is not None:
        return JSONResponse(_model_card(state, served.entry))
    try:
        entry = await anyio.to_thread.run_sync(state.registry.catalog.find, model_id)
    except ModelNotServable as exc:
        raise model_not_found(model_id, state.registry.catalog.names_served()) from exc
    return JSONResponse(_model_card(state, entry))


async def health(request: Request) -> Response:
    """200 while the server takes requests; 503 once it is draining for shutdown. Totals over the loaded models
    at the top level, each model under `models`."""
    state = _state(request)
    registry = state.registry
    models = {}
    for served in list(registry.loaded.values()):
        if served.unloaded:
            continue
        # an embedding model has no engine: no scheduler, no KV blocks (its counts are 0)
        stats = served.engine.stats() if served.kind == "generate" else dict.fromkeys(ENGINE_HEALTH, 0)
        models[served.model_id] = {**served.status(), **{key: stats[key] for key in ENGINE_HEALTH}}
    body = {
        "status": "draining" if state.draining else "ok",
        "model": registry.default_name,
        "requests_in_flight": sum(m["requests_in_flight"] for m in models.values()),
        **{key: sum(m[key] for m in models.values()) for key in ENGINE_HEALTH},
        "memory": {
            "budget_bytes": registry.policy.budget_bytes,
            "held_bytes": registry.held_bytes(),
            **process_memory(),
        },
        "models": models,
        "loading": sorted(registry.loading_names()),
        "unloading": sorted(registry.unloading_names()),
        "failed": dict(registry.failures),
    }
    return JSONResponse(body, status_code=503 if state.draining else 200)


def process_memory() -> dict:
    """What the process holds now: its resident set (psutil) and the bytes of MLX arrays alive (on every backend)."""
    import mlx.core as mx
    import psutil

    return {"process_resident_bytes": psutil.Process().memory_info().rss, "mlx_active_bytes": mx.get_active_memory()}


ENGINE_HEALTH = ("requests_running", "requests_waiting", "blocks_used", "blocks_free", "blocks_total")


async def metrics(request: Request) -> Response:
    return Response(render_metrics(_state(request)), media_type=CONTENT_TYPE)


def create_app(models, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app over a ModelRegistry (`mlxpaged serve`: models loaded on demand; the caller closes it), or
    over one loaded `Engine` or `Embedder`, which it then serves alone (the caller owns it and closes it)."""
    config = config or ServerConfig()
    registry = models if isinstance(models, ModelRegistry) else single_model_registry(models, config)
    state = ServerState(registry, config)
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
